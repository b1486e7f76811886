"""The target distribution the speculative engine tests sample against: a small peaked model, the exact joint
probability of its 2nd and 3rd output tokens after a prompt (from prefill batches through the torch_native backend),
and the check that sampled outputs follow it (tests/stats_helpers.py). Each test keeps its own draft, sample count
and engine options."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from compile_attn import ForwardBatch, KVCache, create_backend, forward_context
from compile_attn.models import ToyDecoder, ToyDecoderConfig
from tests.stats_helpers import assert_chi_square_fits

SMALL = ToyDecoderConfig(vocab_size=6, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                         intermediate_size=32)
ALPHA = 1e-4  # the chance that a test fails while the outputs do follow the target


def peaked_model() -> ToyDecoder:
    """A SMALL model (seed 3) with its weights scaled by 1.5: a peaked distribution, far from uniform."""
    torch.manual_seed(3)
    model = ToyDecoder(SMALL).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    return model


def next_token_probs(model: ToyDecoder, seqs: list[list[int]]) -> np.ndarray:
    """p(next token | seq) for each sequence, from one prefill batch through the torch_native backend."""
    cfg, total = model.cfg, sum(len(s) for s in seqs)
    kv = KVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                 max_batch_size=len(seqs), max_context=max(map(len, seqs)), kv_cache_tokens=total,
                 dtype=torch.float32)
    backend = create_backend("torch_native", kv, model.attention_layers())
    rows = [kv.alloc_request() for _ in seqs]
    lens = [len(s) for s in seqs]
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[0] * len(seqs), extend_lens=lens,
                            out_cache_loc=kv.alloc_extend(rows, lens), input_ids=[t for s in seqs for t in s])
    backend.init_forward_metadata(fb)
    with forward_context(fb, backend), torch.no_grad():
        logits = model(fb.input_ids, fb.positions).double()
    ends = np.cumsum(lens) - 1
    return torch.softmax(logits[torch.as_tensor(ends)], dim=-1).numpy()


def joint_of_tokens_2_and_3(model: ToyDecoder, prompt: list[int]) -> np.ndarray:
    """P(x2 = b, x3 = c) after ``prompt``: a (vocab, vocab) array, summed over the first output token."""
    v = model.cfg.vocab_size
    p1 = next_token_probs(model, [prompt])[0]
    p2 = next_token_probs(model, [prompt + [a] for a in range(v)])
    p3 = next_token_probs(model, [prompt + [a, b] for a, b in itertools.product(range(v), repeat=2)]).reshape(v, v, v)
    return np.einsum("a,ab,abc->bc", p1, p2, p3)


def assert_tokens_2_and_3_follow(outputs: Sequence, joint: np.ndarray) -> None:
    """The (2nd, 3rd) token pairs of ``outputs`` (each with ``token_ids``) follow ``joint``, by a chi-square test."""
    counts = np.zeros_like(joint)
    for o in outputs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    assert_chi_square_fits(counts, joint * len(outputs), alpha=ALPHA)
