"""The serving benchmark's client: token-id prompts sent to an OpenAI-compatible ``/v1/completions`` as streaming
requests, arriving as a Poisson process of a given rate (or all at once), with per-request timings (time to the
first token, gaps between tokens, end to end) and the usage the server reported. Chunks carry their token ids
(``return_token_ids``), so tokens are timed whether or not they make text (a model without a tokenizer, a character
split over tokens); ``summarize`` turns them into
percentiles and throughput. It talks HTTP only (httpx), so it runs in processes of its own beside any server: one
load can be dealt to several client processes sending on one wall-clock schedule.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class RequestRecord:
    """One request's timings in seconds from its send; ``error`` is None for a request that completed."""

    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> RequestRecord:
    rec = RequestRecord()
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                n = len(chunk["choices"][0].get("token_ids") or ()) if chunk.get("choices") else 0
                if n:  # a chunk of n tokens after the first: n gaps of 1/n its delay
                    if last is None:
                        rec.ttft = now - start
                    else:
                        rec.itl += [(now - last) / n] * n
                    last = now
        rec.e2e = time.perf_counter() - start
        if rec.output_tokens == 0:
            rec.error = "the stream ended without a usage chunk"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds from the start of ``n`` requests arriving as a Poisson process of ``rate`` per second
    (the first at 0); all 0 for ``math.inf``."""
    if not math.isfinite(rate):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_load(base_url: str, model: str, prompts: list[list[int]], output_lens: list[int], temperature: float,
                   offsets: list[float], max_concurrency: int | None = None, start_at: float | None = None,
                   timeout: float = 3600.0, extra: dict | None = None) -> tuple[list[RequestRecord], float, float]:
    """Send every prompt (request ``i`` asks for ``output_lens[i]`` tokens, EOS ignored) ``offsets[i]`` seconds
    after ``start_at`` (a ``time.time()``; None: now), at most ``max_concurrency`` in flight; ``extra``: more body
    fields for every request (e.g. ``{"response_format": {"type": "json_object"}}``). Returns each request's record
    and the ``time.time()`` of the first send and of the last completion."""
    url = base_url.rstrip("/") + "/v1/completions"
    limit = max_concurrency or len(prompts)
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        async def send(prompt: list[int], out_len: int) -> RequestRecord:
            body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": temperature,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                    "return_token_ids": True, **(extra or {})}
            async with sem:
                return await _one(client, url, body)

        start_at = time.time() if start_at is None else start_at
        await asyncio.sleep(max(0.0, start_at - time.time()))
        first = time.time()
        tasks = []
        for prompt, out_len, at in zip(prompts, output_lens, offsets):
            await asyncio.sleep(max(0.0, start_at + at - time.time()))
            tasks.append(asyncio.ensure_future(send(prompt, out_len)))
        records = await asyncio.gather(*tasks)
        return list(records), first, time.time()


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: list[RequestRecord], duration: float) -> dict:
    """Counts, output tok/s, requests/s and p50 / p99 / mean of TTFT, ITL (gaps between tokens), TPOT
    ((e2e - TTFT) / (output tokens - 1)) and e2e, in milliseconds."""
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    series = {"ttft": [r.ttft for r in ok if r.ttft is not None],
              "itl": [g for r in ok for g in r.itl],
              "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
                       if r.ttft is not None and r.output_tokens > 1],
              "e2e": [r.e2e for r in ok]}
    result: dict = {"requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
                    "duration_s": duration, "prompt_tokens": sum(r.prompt_tokens for r in ok),
                    "output_tokens": out_tokens, "output_tok_per_s": out_tokens / duration if duration else None,
                    "requests_per_s": len(ok) / duration if duration else None}
    for name, xs in series.items():
        for stat, value in (("p50", percentile(xs, 50)), ("p99", percentile(xs, 99)),
                            ("mean", sum(xs) / len(xs) if xs else None)):
            result[f"{name}_{stat}_ms"] = None if value is None else value * 1e3
    result["first_errors"] = [r.error for r in records if r.error is not None][:3]
    return result


def client_ready(_: object = None) -> int:
    """Nothing (its process id): mapped over a process pool once, it makes every client process start and import
    this module before any timed load (a pool spawns its processes on demand, so a load dealt to one not yet
    started would be sent late)."""
    return os.getpid()


def load_part(base_url: str, model: str, prompts: list[list[int]], output_lens: list[int], temperature: float,
              offsets: list[float], max_concurrency: int | None, start_at: float | None,
              extra: dict | None = None) -> dict:
    """``run_load`` in a fresh event loop (the entry point of a client process): its records (as dicts), first send
    and last completion (``time.time()``) and the CPU seconds this process spent."""
    cpu = time.process_time()
    records, first, last = asyncio.run(run_load(base_url, model, prompts, output_lens, temperature, offsets,
                                                max_concurrency, start_at, extra=extra))
    return dict(records=[asdict(r) for r in records], first=first, last=last, cpu_s=time.process_time() - cpu)


def load_and_summarize(base_url: str, model: str, prompts: list[list[int]], output_lens: list[int],
                       temperature: float, rate: float, max_concurrency: int | None, seed: int,
                       pool: Executor | None = None, parts: int = 1, extra: dict | None = None) -> dict:
    """Send the prompts at ``rate`` (Poisson arrivals drawn with ``seed``; ``math.inf``: all at once) and
    ``summarize``. With a process ``pool`` the requests are dealt round-robin to ``parts`` client processes that
    send at the same wall-clock times (``max_concurrency`` shared out evenly), so that reading the streams never
    limits what is measured; ``client_busy`` is the busiest client process's CPU time over its wall time (near 1:
    the client, not the server, set the pace); ``client_start_lag_ms`` how late the last client process began
    sending (a few ms; far more: a process that was not running yet). ``extra``: more body fields for every request
    (see ``run_load``)."""
    n = len(prompts)
    offsets = arrival_offsets(n, rate, seed)
    parts = max(1, min(parts, n)) if pool is not None else 1
    limit = None if max_concurrency is None else max(1, math.ceil(max_concurrency / parts))
    start_at = time.time() + (0.2 if pool is not None else 0.0)
    slices = [list(range(k, n, parts)) for k in range(parts)]
    jobs = [(base_url, model, [prompts[i] for i in idx], [output_lens[i] for i in idx], temperature,
             [offsets[i] for i in idx], limit, start_at, extra) for idx in slices]
    outs = [load_part(*jobs[0])] if pool is None else [f.result() for f in [pool.submit(load_part, *j) for j in jobs]]
    records: list[RequestRecord | None] = [None] * n
    for idx, out in zip(slices, outs):
        for i, r in zip(idx, out["records"]):
            records[i] = RequestRecord(**r)
    duration = max(o["last"] for o in outs) - min(o["first"] for o in outs)
    busy = max(o["cpu_s"] / max(o["last"] - o["first"], 1e-9) for o in outs)
    return {"request_rate": rate if math.isfinite(rate) else "inf", **summarize(records, duration),
            "client_processes": parts, "client_busy": busy,
            "client_start_lag_ms": 1e3 * (max(o["first"] for o in outs) - start_at)}


__all__ = ["RequestRecord", "arrival_offsets", "client_ready", "load_and_summarize", "load_part", "percentile", "run_load", "summarize"]
