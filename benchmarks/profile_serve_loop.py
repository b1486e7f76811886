"""Host time per step of the serving loop: AsyncLLM's step loop with B streams consumed through a pipe by another
process (the HTTP front end's place), split into the time inside ``LLM.step`` and the time outside it (handing each
step's tokens to the pipe, reading commands). On a GPU the sum must stay under the device's step time or the device
waits.

The model call is stubbed for decode steps (zero logits over a 512-token vocabulary), so every measured second is
host work; the reader process only receives and counts, so the pipe never backs up. The first steps (every
request's admission and prefill) are not counted.

    python benchmarks/profile_serve_loop.py --batch-sizes 64,256 --new-tokens 200
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from compile_attn import bench  # noqa: E402
from compile_attn.engine import LLM, SamplingParams  # noqa: E402
from compile_attn.engine.async_engine import AsyncLLM  # noqa: E402
from compile_attn.engine.engine_pipe import PipeBridge  # noqa: E402

VOCAB = 512
SKIP_STEPS = 3  # not timed: the step that admits and prefills every request, and two more


def reader(conn, prompts: list[list[int]], new_tokens: int) -> None:  # noqa: ANN001
    """The consumer's process: queue every prompt, then read until each request has finished."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for key, prompt in enumerate(prompts):
        conn.send(("add", key, prompt, params))
    left = len(prompts)
    while left:
        _, items, _ = conn.recv()
        for _, item in items:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, tuple) and item[1]:  # a finished request's last Delta
                left -= 1
    conn.close()


def stub_llm(bs: int, prompt_len: int, new_tokens: int) -> LLM:
    shape = dict(bench.TINY, vocab_size=VOCAB, max_position_embeddings=prompt_len + new_tokens + 8)
    model = bench._hf_model(bench.BenchConfig(shape=shape, device="cpu"), "sdpa", torch.float32)
    llm = LLM(model, attn_backend="torch_native", max_batch_size=bs, max_num_tokens=bs * prompt_len,
              kv_cache_tokens=bs * (prompt_len + new_tokens + 8), max_context=prompt_len + new_tokens + 8,
              device="cpu", dtype=torch.float32, compile=False, graph_mode="none")
    run, zeros = llm.step_runner.run, torch.zeros(bs, VOCAB)

    def stub_run(fb, keep, feed=None):  # noqa: ANN001, ANN202
        return zeros[:fb.batch_size] if fb.forward_mode.is_decode() else run(fb, keep, feed)

    llm.step_runner.run = stub_run
    return llm


def measure(bs: int, prompt_len: int, new_tokens: int) -> dict:
    llm = stub_llm(bs, prompt_len, new_tokens)
    engine = AsyncLLM(llm, max_pending=2 * bs)
    ours, theirs = multiprocessing.Pipe()
    g = torch.Generator().manual_seed(bs)
    prompts = torch.randint(0, VOCAB, (bs, prompt_len), generator=g).tolist()
    proc = multiprocessing.get_context("spawn").Process(target=reader, args=(theirs, prompts, new_tokens))
    bridge = PipeBridge(engine, ours)
    proc.start()
    while engine.stats.snapshot().steps < SKIP_STEPS and proc.is_alive():  # the admissions and the prefill
        time.sleep(0.0005)
    before = engine.stats.snapshot()
    proc.join()
    counts = engine.stats.snapshot() - before
    engine.call(lambda _llm: bridge.close()).result(10)
    engine.shutdown()
    if proc.exitcode != 0:
        raise RuntimeError(f"the reader process failed (exit code {proc.exitcode})")
    return dict(batch_size=bs, steps=counts.steps, step_ms=1e3 * counts.seconds / counts.steps,
                outside_ms=1e3 * counts.other_seconds / counts.steps,
                deliver_ms=1e3 * counts.deliver_seconds / counts.steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| batch | steps | inside LLM.step ms per step | outside it (tokens to the pipe, commands) ms per step | "
          "of which the pipe's send |")
    print("|---|---|---|---|---|")
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        runs = [measure(bs, args.prompt_len, args.new_tokens) for _ in range(args.repeats)]
        inside = sorted(r["step_ms"] for r in runs)
        outside = sorted(r["outside_ms"] for r in runs)
        send = sorted(r["deliver_ms"] for r in runs)
        print(f"| {bs} | {runs[0]['steps']} | {', '.join(f'{x:.3f}' for x in inside)} | "
              f"{', '.join(f'{x:.3f}' for x in outside)} | {', '.join(f'{x:.3f}' for x in send)} |", flush=True)


if __name__ == "__main__":
    main()
