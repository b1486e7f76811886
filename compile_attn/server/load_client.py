"""The serving benchmark's client: token-id prompts sent to an OpenAI-compatible ``/v1/completions`` as streaming
requests, arriving as a Poisson process of a given rate (or all at once), with per-request timings (time to the
first token, gaps between tokens, end to end) and the usage the server reported. Chunks carry their token ids
(``return_token_ids``), so tokens are timed whether or not they make text (a model without a tokenizer, a character
split over tokens); ``summarize`` turns them into
percentiles and throughput. It talks HTTP only (httpx), so it runs in its own process beside any server.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

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


async def run_load(base_url: str, model: str, prompts: list[list[int]], output_lens: list[int], temperature: float,
                   rate: float, max_concurrency: int | None = None, seed: int = 0,
                   timeout: float = 3600.0) -> tuple[list[RequestRecord], float]:
    """Send every prompt (request ``i`` asks for ``output_lens[i]`` tokens, EOS ignored) at ``rate`` requests per
    second (Poisson arrivals; ``math.inf``: all at once), at most ``max_concurrency`` in flight. Returns each
    request's record and the wall time from the first send to the last completion."""
    url = base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(seed)
    limit = max_concurrency or len(prompts)
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        async def send(prompt: list[int], out_len: int) -> RequestRecord:
            body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": temperature,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                    "return_token_ids": True}
            async with sem:
                return await _one(client, url, body)

        start = time.perf_counter()
        tasks = []
        for prompt, out_len in zip(prompts, output_lens):
            tasks.append(asyncio.ensure_future(send(prompt, out_len)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - start


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


def load_and_summarize(base_url: str, model: str, prompts: list[list[int]], output_lens: list[int],
                       temperature: float, rate: float, max_concurrency: int | None, seed: int) -> dict:
    """``run_load`` then ``summarize``, in a fresh event loop (the entry point of the client's own process)."""
    records, duration = asyncio.run(run_load(base_url, model, prompts, output_lens, temperature, rate,
                                             max_concurrency, seed))
    return {"request_rate": rate if math.isfinite(rate) else "inf", **summarize(records, duration)}


__all__ = ["RequestRecord", "load_and_summarize", "percentile", "run_load", "summarize"]
