"""Quickstart: a tiny decoder whose attention is compile_attn's op, generating greedily over a paged KV cache.

Runs on the GPU if there is one, else on the CPU. Three requests of different prompt lengths are
prefilled together; a fourth arrives while they decode, so one step mixes prefill and decode.
"""

from __future__ import annotations

import argparse
import logging

import torch

import compile_attn
from compile_attn import ForwardBatch, KVCache, create_backend, forward_context
from compile_attn.models import ToyDecoder, ToyDecoderConfig

log = logging.getLogger("quickstart")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--backend", default="auto", help="attention backend: auto, torch_native, triton, ...")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(0)
    cfg = ToyDecoderConfig(vocab_size=256, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = ToyDecoder(cfg).to(args.device, dtype).eval()
    kv = KVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_requests=8,
                 max_context=256, num_tokens=2048, page_size=16, dtype=dtype, device=args.device)
    backend = create_backend(args.backend, kv, model.attention_layers())
    log.info("compile_attn %s | device %s | backend %s", compile_attn.__version__, args.device, backend.name)

    prompts = [list(b"Hello, compile_attn!"), list(b"Paged KV"), list(b"Attention is a custom op."), list(b"Late")]
    late = 3  # the last request arrives after two decode steps
    rows = [kv.alloc_request() for _ in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    cached = [0] * len(prompts)  # tokens already in the KV cache per request
    for step in range(args.max_new_tokens + 2):
        active = [i for i in range(len(prompts)) if (i != late or step >= 2) and len(generated[i]) < args.max_new_tokens]
        if not active:
            break
        new_tokens = [prompts[i] if cached[i] == 0 else generated[i][-1:] for i in active]
        loc = kv.alloc_extend([rows[i] for i in active], [len(t) for t in new_tokens])
        fb = ForwardBatch.build(
            req_pool_indices=[rows[i] for i in active], prefix_lens=[cached[i] for i in active],
            extend_lens=[len(t) for t in new_tokens], out_cache_loc=loc,
            input_ids=[t for toks in new_tokens for t in toks], device=args.device,
        )
        backend.init_forward_metadata(fb)
        with forward_context(fb, backend), torch.no_grad():
            logits = model(fb.input_ids, fb.positions)
        last = torch.tensor(fb.extend_seq_lens_cpu).cumsum(0) - 1
        next_ids = logits[last.to(args.device)].argmax(-1).tolist()
        log.info("step %2d  %-6s  requests %s  tokens %d", step, fb.forward_mode.name, active, fb.num_tokens)
        for i, tok, toks in zip(active, next_ids, new_tokens):
            cached[i] += len(toks)
            generated[i].append(tok)
    for i, prompt in enumerate(prompts):
        text = bytes(generated[i]).decode("latin-1").encode("unicode_escape").decode()
        log.info("request %d  prompt %r  -> %d tokens: %s", i, bytes(prompt).decode(), len(generated[i]), text)
        kv.free_request(rows[i])
    assert kv.available_tokens == kv.allocator.num_pages * kv.page_size, "KV cache not back to empty"
    log.info("KV cache back to empty (%d tokens free)", kv.available_tokens)


if __name__ == "__main__":
    main()
