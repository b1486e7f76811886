"""The yardsticks ``compile-attn bench-serve`` holds its latencies against, measured on the engine that served them
once the server has stopped: the time to prefill one prompt of the workload's typical length (a ``generate`` of one
token, as a client's TTFT counts it), and the time of one steady decode step at a given batch size (``LLM.step``
wall time, as ITL sees it); then the serving targets as ratios: server output tok/s over offline ``generate``,
ITL p50 over the decode step, TTFT p50 over the one-prompt prefill.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from compile_attn.bench.workloads import Workload

logger = logging.getLogger(__name__)

# The targets: server tok/s >= 0.9 x offline; at half load ITL p50 <= 1.3 x decode step, TTFT p50 <= 2 x prefill.
MIN_VS_OFFLINE, MAX_ITL_OVER_STEP, MAX_TTFT_OVER_PREFILL = 0.9, 1.3, 2.0


def _random_prompts(llm, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random ids: none shares a prefix with the workload's or another's (no prefix
    cache hit)."""
    high = min(llm.vocab_size or 10000, 10000)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (n, length), generator=g).tolist()


def _sync(llm) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def prefill_ms(llm, prompt_len: int, temperature: float, repeats: int = 5, seed: int = 1) -> dict:
    """Median wall time of ``LLM.generate`` of one token for one fresh prompt of ``prompt_len`` ids on the idle
    engine (admission, the prefill step, sampling and the read-back: what a client's TTFT holds besides queueing
    and HTTP), over ``repeats`` prompts after one untimed."""
    from compile_attn.engine import SamplingParams

    prompt_len = max(1, min(prompt_len, llm.kv_cache.max_context - 1))
    params = SamplingParams(max_tokens=1, temperature=temperature, ignore_eos=True)
    samples = []
    for i, prompt in enumerate(_random_prompts(llm, repeats + 1, prompt_len, seed)):
        _sync(llm)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        if i:
            samples.append(1e3 * (time.perf_counter() - start))
    return dict(prompt_len=prompt_len, median_ms=statistics.median(samples), samples_ms=samples)


def decode_step_ms(llm, batch_size: int, context_len: int, temperature: float, steps: int = 100,
                   windows: int = 5, seed: int = 2) -> dict:
    """Median over ``windows`` windows of the mean wall time of ``LLM.step`` in steady decode: ``batch_size``
    requests of ``context_len``-token fresh prompts, prefilled, then a few untimed steps, then the timed ones.
    The context is capped at half of ``max_context`` and the steps at what fits after it."""
    from compile_attn.engine import SamplingParams

    budget = llm.kv_cache.max_context
    context_len = max(1, min(context_len, budget // 2))
    room = budget - context_len  # new tokens a request may make: the prefill's, the warm-up's, the timed steps'
    warm = min(8, max(0, room // 4))
    per = max(1, min(steps // windows, (room - warm - 2) // windows))
    params = SamplingParams(max_tokens=min(room, warm + per * windows + 2), temperature=temperature,
                            ignore_eos=True)
    reqs = [llm.add_request(p, params) for p in _random_prompts(llm, batch_size, context_len, seed)]
    try:
        while any(r.num_cached < len(r.prompt_ids) for r in reqs):
            llm.step()
        for _ in range(warm):
            llm.step()
        running = len(llm.scheduler.running)
        if running != batch_size:
            logger.warning("decode step: %d of %d requests running (the KV cache holds no more); timing that batch",
                           running, batch_size)
        _sync(llm)
        samples = []
        for _ in range(windows):
            start = time.perf_counter()
            for _ in range(per):
                llm.step()
            samples.append(1e3 * (time.perf_counter() - start) / per)
    finally:
        for r in reqs:
            llm.abort_request(r)
        while llm.has_work():
            llm.step()
        _sync(llm)
    return dict(batch_size=batch_size, running=running, context_len=context_len, steps_per_window=per,
                median_ms=statistics.median(samples), windows_ms=samples)


def denominators(llm, workload: Workload, batch_size: int) -> dict:
    """The one-prompt prefill at the workload's median prompt length and the decode step at ``batch_size`` with
    each request's mean context while it decodes (median prompt + half the median output)."""
    prompt = int(statistics.median(len(p) for p in workload.prompts))
    output = int(statistics.median(workload.output_lens))
    prefill = prefill_ms(llm, prompt, workload.temperature)
    decode = decode_step_ms(llm, max(1, batch_size), prompt + output // 2, workload.temperature)
    logger.info("one-prompt prefill %.2f ms (%d tokens); decode step %.2f ms at batch %d", prefill["median_ms"],
                prompt, decode["median_ms"], batch_size)
    return dict(prefill=prefill, decode_step=decode)


def targets(result: dict) -> dict:
    """The serving targets from a bench-serve result: each ratio with its bound and whether it is met (None where
    the run lacks what it needs: no offline round, no saturated or half-load run, no denominators)."""
    rates = {r.get("rate_name", r["request_rate"]): r for r in result["rates"]}
    inf, half, den = rates.get("inf"), rates.get("half"), result.get("denominators")
    offline = result.get("offline", {}).get("output_tok_s")
    vs = inf["output_tok_per_s"] / offline if inf and offline and inf["output_tok_per_s"] else None
    itl = ttft = None
    if half and den:
        if half["itl_p50_ms"] is not None:
            itl = half["itl_p50_ms"] / den["decode_step"]["median_ms"]
        if half["ttft_p50_ms"] is not None:
            ttft = half["ttft_p50_ms"] / den["prefill"]["median_ms"]

    def check(value: float | None, bound: float, at_least: bool) -> dict:
        met = None if value is None else (value >= bound if at_least else value <= bound)
        return dict(value=value, bound=bound, met=met)

    return dict(server_vs_offline=check(vs, MIN_VS_OFFLINE, True),
                itl_p50_over_decode_step=check(itl, MAX_ITL_OVER_STEP, False),
                ttft_p50_over_prefill=check(ttft, MAX_TTFT_OVER_PREFILL, False))


def targets_markdown(result: dict) -> list[str]:
    """The target lines of the table (none where nothing was measured)."""
    t, den = result.get("targets"), result.get("denominators")
    if not t:
        return []

    def verdict(x: dict) -> str:
        return {True: "met", False: "NOT met", None: "-"}[x["met"]]

    lines = ["", "targets:"]
    vs = t["server_vs_offline"]
    if vs["value"] is not None:
        lines.append(f"- saturated server output tok/s / offline generate: {vs['value']:.1%} (>= {vs['bound']:.0%}: "
                     f"{verdict(vs)})")
    half = next((r for r in result["rates"] if r.get("rate_name") == "half"), None)
    if half is not None and den:
        b, p, d = half.get("batch", {}), den["prefill"], den["decode_step"]
        itl, ttft = t["itl_p50_over_decode_step"], t["ttft_p50_over_prefill"]
        lines.append(f"- half load ({half['request_rate']:.3g} req/s; batch median {b.get('median_batch')}, "
                     f"mean {b.get('mean_batch') or 0:.1f}; in-server step {b.get('mean_step_ms') or 0:.2f} ms mean)")
        if itl["value"] is not None:
            lines.append(f"- ITL p50 {half['itl_p50_ms']:.2f} ms / decode step at batch {d['batch_size']} "
                         f"({d['context_len']}-token contexts) {d['median_ms']:.2f} ms = {itl['value']:.2f} "
                         f"(<= {itl['bound']}: {verdict(itl)})")
        if ttft["value"] is not None:
            lines.append(f"- TTFT p50 {half['ttft_p50_ms']:.2f} ms / prefill of one {p['prompt_len']}-token prompt "
                         f"{p['median_ms']:.2f} ms = {ttft['value']:.2f} (<= {ttft['bound']}: {verdict(ttft)})")
    return lines
