"""Quickstart: a small decoder compiled with ``backend="compile_attn"``, generating with compile_attn's engine.

Runs on the GPU if there is one (bf16, CUDA graphs: full graphs for decode, piecewise for prefill),
else on the CPU (fp32; the same graph-runner logic runs eagerly). The model is a tiny Llama-like
decoder with random weights whose attention is ``torch.ops.compile_attn.attention``; its tokens are
bytes, so the "text" is what random weights say. For a real HF checkpoint see examples/hf_model.py.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

import compile_attn
from compile_attn import LLM, SamplingParams
from compile_attn.models import ToyDecoder, ToyDecoderConfig

log = logging.getLogger("quickstart")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", help="attention backend: auto, torch_native, triton, flashinfer")
    parser.add_argument("--graph-mode", default="full_and_piecewise")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(0)
    cfg = ToyDecoderConfig(vocab_size=256, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                           intermediate_size=512)
    start = time.perf_counter()
    llm = LLM(ToyDecoder(cfg), attn_backend=args.backend, graph_mode=args.graph_mode, compile=True,
              max_batch_size=8, max_num_tokens=256, max_context=512, page_size=16, device=args.device)
    log.info("compile_attn %s: backend %s, %s, ready in %.1f s (graphs captured: %s)", compile_attn.__version__,
             llm.backend.name, args.device, time.perf_counter() - start, dict(llm.step_runner.runner.stats.captures))

    prompts = ["Hello, compile_attn!", "Paged KV caches", "Attention is a custom op.", "CUDA graphs"]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for attempt in ("first (compiles)", "second (warm)"):
        start = time.perf_counter()
        outs = llm.generate([list(p.encode()) for p in prompts], params)
        elapsed = time.perf_counter() - start
        n = sum(len(o.token_ids) for o in outs)
        log.info("%s run: %d tokens in %.2f s (%.0f tok/s)", attempt, n, elapsed, n / elapsed)
    for p, o in zip(prompts, outs):
        log.info("%-28r -> %r", p, bytes(o.token_ids).decode("latin-1"))
    log.info("steps by graph mode: %s; KV cache free again: %s",
             dict(llm.step_runner.runner.stats.runs), llm.kv_cache.available_tokens == llm.kv_cache.allocator.num_pages * 16)


if __name__ == "__main__":
    main()
