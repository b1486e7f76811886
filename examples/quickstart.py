"""Quickstart: train a tiny Llama on the CPU, then generate from it with compile_attn's compiled engine.

The first run trains a byte-level BPE tokenizer and a 2-layer ``LlamaForCausalLM`` on English prose that ships
with Python (pydoc's reference-manual topics) and saves them as a local HF directory (under
``~/.cache/compile_attn/tiny-llama`` or ``--out-dir``); later runs reuse it (``--retrain`` trains again).
``LLM(directory)`` then loads it like any checkpoint (``attn_implementation="compile_attn"``, its tokenizer,
string prompts): on the GPU in bf16 with CUDA graphs, else on the CPU in fp32. For your own checkpoint see
examples/hf_model.py.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

import compile_attn
from compile_attn import LLM, SamplingParams
from compile_attn.models.tiny_llama import tiny_llama

log = logging.getLogger("quickstart")
PROMPTS = ["A function is", "An exception is raised when", "The value of", "If the object"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=None, help="where the tiny model is saved (default: the cache)")
    parser.add_argument("--retrain", action="store_true", help="train the tiny model again")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", help="attention backend: auto, torch_native, triton, flashinfer")
    parser.add_argument("--graph-mode", default="full_and_piecewise")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    start = time.perf_counter()
    path = tiny_llama(args.out_dir, retrain=args.retrain)
    log.info("tiny model ready in %.1f s: %s", time.perf_counter() - start, path)
    start = time.perf_counter()
    llm = LLM(str(path), attn_backend=args.backend, graph_mode=args.graph_mode, compile=True,
              max_batch_size=8, max_num_tokens=256, max_context=256, page_size=16, device=args.device)
    log.info("compile_attn %s: backend %s, %s, ready in %.1f s (graphs captured: %s)", compile_attn.__version__,
             llm.backend.name, args.device, time.perf_counter() - start, dict(llm.step_runner.runner.stats.captures))

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.7, top_k=40, seed=0)
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, params)
    elapsed = time.perf_counter() - start
    n = sum(len(o.token_ids) for o in outs)
    log.info("%d tokens in %.2f s (%.0f tok/s)", n, elapsed, n / elapsed)
    for prompt, out in zip(PROMPTS, outs):
        log.info("%r -> %r", prompt, out.text)


if __name__ == "__main__":
    main()
