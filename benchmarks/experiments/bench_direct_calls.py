"""Piecewise steps with and without direct graph calls (``GraphConfig.direct_calls``), one compiled model, two runners.

A tiny 16-layer HF Llama (random weights) compiled with ``backend="compile_attn"``; each runner runs bs-1 piecewise
decode steps, one with Dynamo's frame on every call, one calling the compiled graph directly after the bucket's
first step. Prints the outputs' equality and the median step time of each (alternating rounds). Runs on the CPU
(torch_native attention, no CUDA graphs) or a GPU:

    python benchmarks/experiments/bench_direct_calls.py [--device cuda --backend triton]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from compile_attn import GraphConfig
from compile_attn.bench import decode_step as bench
from compile_attn.compiler.compiled_model import compile_model
from compile_attn.graph_runner.runner import GraphRunner
from compile_attn.hf import HFModelAdapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="torch_native")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    shape = dict(bench.LLAMA_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=16, vocab_size=100,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg = bench.BenchConfig(shape=shape, batch_sizes=[1], context=32, backends=[args.backend], modes=["piecewise"],
                            hf_baselines=[], device=args.device)
    adapter = HFModelAdapter(bench._hf_model(cfg, "sdpa", dtype))
    setup = bench.DecodeSetup(adapter, cfg, args.backend, dtype)
    sizes = {"decode_batch_sizes": (1,), "extend_token_sizes": (1,), "cache_dir": None}
    model = compile_model(adapter, {"mode": "piecewise", **sizes})
    runners = {
        direct: GraphRunner(model, setup.backend, GraphConfig(mode="piecewise", direct_calls=direct, **sizes),
                            max_batch_size=1, max_num_tokens=1)
        for direct in (False, True)
    }
    fb = setup.batch(1)

    def per_step_us(fn, n: int = 300) -> float:  # noqa: ANN001
        rounds = []
        for _ in range(7):
            if args.device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            if args.device != "cpu":
                torch.cuda.synchronize()
            rounds.append((time.perf_counter() - t0) / n * 1e6)
        return sorted(rounds)[3]

    with torch.inference_mode():
        outs = {}
        for direct, runner in runners.items():
            runner.capture()
            runner.run(fb)
            outs[direct] = runner.run(fb).clone()
        print(f"outputs equal: {torch.equal(outs[False], outs[True])}")
        for _ in range(2):
            for direct, runner in runners.items():
                print(f"{'direct calls' if direct else 'through Dynamo'}: {per_step_us(lambda: runner.run(fb)):.0f} "
                      f"us per step")
        print(f"direct calls taken: {runners[True].stats.direct_calls}")


if __name__ == "__main__":
    main()
