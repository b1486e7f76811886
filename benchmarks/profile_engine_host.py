"""Host time of one engine prefill step before the model runs: what the GPU would wait for.

``LLM.generate`` of ``requests x prompt_len`` prompt tokens with ``max_new_tokens=1`` (one step), timed from the
call to each stage: the scheduler (slot allocation included), the model call (``GraphRunner.run``: batch built,
metadata prepared) and the end. Runs anywhere (the model is tiny but keeps the real vocabulary; no graphs), since
the stages before the model call are pure host work whose cost does not depend on the device.

    python benchmarks/profile_engine_host.py --requests 8 --prompt-len 1024

``--decode-batch N``: instead, the engine's host time per decode step outside the model (scheduling, slot
allocation, batch building, sampling, stop checks) with N requests decoding; the model has a 512-token vocabulary
so that the CPU's logits and argmax do not count. On a GPU this time adds to every decode step.

    python benchmarks/profile_engine_host.py --decode-batch 256

``--stub-model`` (with ``--decode-batch``): decode steps skip the model call and take zero logits, so the whole
``step()`` is host work and no model time has to be subtracted (steadier on a busy host); 200 steps, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import HOST_VOCAB, host_decode_llm

from compile_attn.bench import decode_step as bench
from compile_attn.engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--decode-batch", type=int, default=0)
    parser.add_argument("--stub-model", action="store_true")
    args = parser.parse_args()
    if args.decode_batch:
        if args.stub_model:
            torch.set_num_threads(1)
            decode_host(args.decode_batch, args.prompt_len // 2, new_tokens=200, stub_model=True)
        else:
            decode_host(args.decode_batch, args.prompt_len // 2)
        return

    tokens = args.requests * args.prompt_len
    shape = dict(bench.TINY, vocab_size=bench.LLAMA_1B["vocab_size"], max_position_embeddings=args.prompt_len + 64)
    model = bench._hf_model(bench.BenchConfig(shape=shape, device="cpu"), "sdpa", torch.float32)
    llm = LLM(model, attn_backend="torch_native", max_batch_size=args.requests, max_num_tokens=tokens,
              kv_cache_tokens=tokens + 1024, max_context=args.prompt_len + 64, device="cpu", dtype=torch.float32,
              compile=False, graph_mode="none")
    marks: dict[str, float] = {}

    def timed(name: str, fn):  # noqa: ANN001, ANN202
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            marks[name] = time.perf_counter()
            return fn(*a, **k)
        return wrapper

    llm.scheduler.schedule = timed("schedule", llm.scheduler.schedule)
    llm.step_runner.runner.run = timed("model call", llm.step_runner.runner.run)
    prompts = torch.randint(0, shape["vocab_size"], (args.requests, args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    llm.generate(prompts, params)
    rows: dict[str, list[float]] = {"schedule": [], "model call": []}
    for _ in range(args.iters):
        start = time.perf_counter()
        llm.generate(prompts, params)
        for name in rows:
            rows[name].append((marks[name] - start) * 1e3)
    print(f"## host time from generate() to each stage, {args.requests} x {args.prompt_len} tokens "
          f"(median of {args.iters})\n\n| stage reached | ms |\n|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.2f} |")


def decode_host(bs: int, prompt_len: int, new_tokens: int = 40, stub_model: bool = False) -> None:
    llm = host_decode_llm(bs, prompt_len, new_tokens, stub_decode=stub_model)
    in_model = [0.0]
    if not stub_model:
        run = llm.step_runner.run

        def timed_run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            out = run(*a, **k)
            in_model[0] += time.perf_counter() - t0
            return out

        llm.step_runner.run = timed_run
    prompts = torch.randint(0, HOST_VOCAB, (bs, prompt_len), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for prompt in prompts.tolist():
        llm.add_request(prompt, params)
    llm.step()  # the prefill
    host_ms = []
    while llm.has_work():
        in_model[0] = 0.0
        t0 = time.perf_counter()
        llm.step()
        host_ms.append((time.perf_counter() - t0 - in_model[0]) * 1e3)
    what = "with the model call stubbed" if stub_model else "outside the model"
    print(f"## engine host time per decode step {what}, batch {bs}, context {prompt_len}+\n\n"
          f"median {statistics.median(host_ms):.3f} ms over {len(host_ms)} steps")


if __name__ == "__main__":
    main()
