"""Host time per step of the serving loop: AsyncLLM's step loop with B streams consumed through a pipe by another
process (the HTTP front end's place), split into the time inside ``LLM.step`` and the time outside it (handing each
step's tokens to the pipe, reading commands). On a GPU the sum must stay under the device's step time or the device
waits.

The model call is stubbed for decode steps (zero logits over a 512-token vocabulary), so every measured second is
host work; the reader process only receives and counts, so the pipe never backs up. The first steps (every
request's admission and prefill) are not counted.

    python benchmarks/profile_serve_loop.py --batch-sizes 64,256 --new-tokens 200

``--reader-us-per-item U`` makes the reader spend U us of CPU per item it receives (a front end's work per chunk),
so that it lags the engine; the table then also says when the reader had every token (its wall time) and how many
tokens an item carried. ``--no-merge`` turns off PipeBridge's holding and merging of a lagging reader's items (every
step's message is then queued for the reader, however far behind it is).

    python benchmarks/profile_serve_loop.py --batch-sizes 256 --reader-us-per-item 20 [--no-merge]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from common import HOST_VOCAB, host_decode_llm  # noqa: E402

from compile_attn.engine import SamplingParams  # noqa: E402
from compile_attn.engine.serving.async_engine import AsyncLLM  # noqa: E402
from compile_attn.engine.serving.engine_pipe import PipeBridge  # noqa: E402

SKIP_STEPS = 3  # not timed: the step that admits and prefills every request, and two more


def reader(address, prompts: list[list[int]], new_tokens: int, us_per_item: float, report) -> None:  # noqa: ANN001
    """The consumer's process: queue every prompt, then read until each request has finished, spending
    ``us_per_item`` of CPU per item and acknowledging each read (as the front end's EngineClient does); ``report``
    gets (seconds from the first add to the last token, tokens, token items)."""
    from multiprocessing.connection import wait

    channel = address.connect()
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for key, prompt in enumerate(prompts):
        channel.send(("add", key, prompt, params))
    left, tokens, items_seen = len(prompts), 0, 0
    while left:
        if not channel.readable():
            wait([channel.fileno()], 1.0)
        msgs = channel.receive()
        for _, items, _ in msgs:
            for _, item in items:
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, tuple):
                    tokens, items_seen = tokens + len(item[0]), items_seen + 1
                    until = time.perf_counter() + us_per_item * 1e-6
                    while time.perf_counter() < until:  # the front end's work on a chunk
                        pass
                    if item[1]:  # a finished request's last Delta
                        left -= 1
        if msgs:
            channel.send(("ack", len(msgs)))
    report.put((time.perf_counter() - start, tokens, items_seen))
    channel.close()


def measure(bs: int, prompt_len: int, new_tokens: int, us_per_item: float = 0.0, merge: bool = True) -> dict:
    llm = host_decode_llm(bs, prompt_len, new_tokens, stub_decode=True)
    engine = AsyncLLM(llm, max_pending=2 * bs)
    ctx = multiprocessing.get_context("spawn")
    report = ctx.Queue()
    g = torch.Generator().manual_seed(bs)
    prompts = torch.randint(0, HOST_VOCAB, (bs, prompt_len), generator=g).tolist()
    bridge = PipeBridge(engine)
    if not merge:
        bridge.max_unacked = float("inf")
    proc = ctx.Process(target=reader, args=(bridge.address, prompts, new_tokens, us_per_item, report))
    proc.start()
    bridge.address.lifeline.close()
    while engine.stats.snapshot().steps < SKIP_STEPS and proc.is_alive():  # the admissions and the prefill
        time.sleep(0.0005)
    before = engine.stats.snapshot()
    reader_s, tokens, items = report.get()
    proc.join()
    counts = engine.stats.snapshot() - before
    bridge.close()
    engine.shutdown()
    if proc.exitcode != 0:
        raise RuntimeError(f"the reader process failed (exit code {proc.exitcode})")
    return dict(batch_size=bs, steps=counts.steps, step_ms=1e3 * counts.seconds / counts.steps,
                outside_ms=1e3 * counts.other_seconds / counts.steps,
                deliver_ms=1e3 * counts.deliver_seconds / counts.steps, reader_s=reader_s,
                tokens_per_item=tokens / max(items, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reader-us-per-item", type=float, default=0.0)
    p.add_argument("--no-merge", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| batch | steps | inside LLM.step ms per step | outside it (tokens to the pipe, commands) ms per step | "
          "of which the pipe's send | reader had every token, s | tokens per item |")
    print("|---|---|---|---|---|---|---|")

    def cell(runs: list[dict], key: str, fmt: str = ".3f") -> str:
        return ", ".join(f"{x:{fmt}}" for x in sorted(r[key] for r in runs))

    for bs in (int(b) for b in args.batch_sizes.split(",")):
        runs = [measure(bs, args.prompt_len, args.new_tokens, args.reader_us_per_item, not args.no_merge)
                for _ in range(args.repeats)]
        print(f"| {bs} | {runs[0]['steps']} | {cell(runs, 'step_ms')} | {cell(runs, 'outside_ms')} | "
              f"{cell(runs, 'deliver_ms')} | {cell(runs, 'reader_s', '.2f')} | {cell(runs, 'tokens_per_item', '.2f')} |",
              flush=True)


if __name__ == "__main__":
    main()
