"""The device ops a steady decode step issues outside the model forward, counted on the CPU (compile_attn/bench/step_ops.py
says how): on a GPU each is a launch around the decode graph's replay, with its own few microseconds of device
time and a gap before the next.

A small random Llama runs through ``LLM`` (Triton backend interpreted on the CPU, graph mode full, overlap on); B
greedy requests decode, and the ops of 4 steady steps are counted per step, by region: outside the forward ("step"),
the backend's in-graph metadata (inside a GPU's full decode graph), the LM head. The forward itself is not listed.

    python benchmarks/profile_step_ops.py --batch-sizes 1,3,8
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run on the CPU
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from compile_attn.engine import LLM  # noqa: E402
from compile_attn.bench.step_ops import REGIONS, steady_decode_ops  # noqa: E402


def small_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,3,8")
    p.add_argument("--backend", default="triton")
    p.add_argument("--graph-mode", default="full")
    args = p.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(small_llama(), attn_backend=args.backend, graph_mode=args.graph_mode, compile=False,
              max_batch_size=max(sizes), max_num_tokens=64, max_context=128, page_size=4, device="cpu",
              compile_options={"decode_batch_sizes": sorted({1, 2, 4, 8, *sizes})})
    for bs in sizes:
        ops = steady_decode_ops(llm, bs)
        for region in REGIONS:
            if region == "forward" or not ops[region]:
                continue
            listed = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in ops[region].items())
            print(f"batch {bs:4d} | {region:17s} | {sum(ops[region].values()):3d} ops | {listed}")


if __name__ == "__main__":
    main()
