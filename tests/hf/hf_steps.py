"""A three-step ragged serving scenario for HF tests: prefill some prefixes, extend every request, decode.

Each step is one flattened ``[1, T]`` batch driven through ``forward_context`` over a real KVCache.
The result is, per request, the logits of every token the scenario fed, in order, so a test can
compare them with the logits of an HF reference model run alone on the request's full sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from compile_attn import ForwardBatch, KVCache, create_backend, forward_context
from compile_attn.attention.base import AttentionBackend

# (tokens cached by step 1, tokens added by step 2) per request; step 3 decodes one more token each.
# Requests 0 and 2 have cached prefixes; every full prompt is longer than the 8-token test window.
SCENARIO: tuple[tuple[int, int], ...] = ((11, 8), (0, 14), (10, 13), (0, 6))


def run_step(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    kv: KVCache,
    backend: AttentionBackend,
    rows: list[int],
    prefix_lens: list[int],
    chunks: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Run new tokens ``chunks[i]`` of request ``rows[i]`` (``prefix_lens[i]`` cached) as one batch."""
    extend = [len(c) for c in chunks]
    loc = kv.alloc_extend(rows, extend)
    fb = ForwardBatch.build(
        req_pool_indices=rows,
        prefix_lens=prefix_lens,
        extend_lens=extend,
        out_cache_loc=loc,
        input_ids=torch.cat(chunks),
        device=kv.device,
    )
    fb.validate(kv)
    backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(fb, backend):
        logits = model(fb.input_ids, fb.positions)
    assert logits.shape == (len(fb.input_ids), logits.shape[-1])
    return list(logits.split(extend))


def run_scenario(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    kv: KVCache,
    backend_name: str,
    layers: list,
    sequences: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Feed ``sequences[i]`` (length = sum of SCENARIO[i] + 1) over three steps; return logits per request."""
    backend = create_backend(backend_name, kv, layers)
    rows = [kv.alloc_request() for _ in SCENARIO]
    per_request: list[list[torch.Tensor]] = [[] for _ in SCENARIO]

    cached = [i for i, (p, _) in enumerate(SCENARIO) if p]
    out = run_step(
        model,
        kv,
        backend,
        [rows[i] for i in cached],
        [0] * len(cached),
        [sequences[i][: SCENARIO[i][0]] for i in cached],
    )
    for i, lg in zip(cached, out, strict=True):
        per_request[i].append(lg)

    out = run_step(
        model,
        kv,
        backend,
        rows,
        [p for p, _ in SCENARIO],
        [sequences[i][p : p + e] for i, (p, e) in enumerate(SCENARIO)],
    )
    for i, lg in enumerate(out):
        per_request[i].append(lg)

    lens = [p + e for p, e in SCENARIO]
    out = run_step(model, kv, backend, rows, lens, [sequences[i][n : n + 1] for i, n in enumerate(lens)])
    for i, lg in enumerate(out):
        per_request[i].append(lg)
    return [torch.cat(chunks) for chunks in per_request]


def random_sequences(
    vocab_size: int, seed: int = 0, device: torch.device | str = "cpu"
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (p + e + 1,), generator=gen).to(device) for p, e in SCENARIO]
