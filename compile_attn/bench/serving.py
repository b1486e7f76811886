"""The serving benchmark behind ``compile-attn bench-serve``: a seeded workload (``compile_attn.bench.workloads``)
sent to an OpenAI-compatible server at fixed request rates (Poisson arrivals) and all at once, reporting TTFT, ITL,
TPOT and e2e percentiles and output tok/s per rate. The rate ``"half"`` is half the request throughput of the
saturated (``inf``) run before it: the load that uses half the saturated output tok/s.

The server is either at ``url`` or started here: an LLM (a local HF directory, or random weights of a shape) behind
AsyncLLM and uvicorn on a free loopback port (the HTTP front end in a process of its own unless ``frontend`` is
"thread", see ``compile_attn.server.frontend``), after optional offline ``LLM.generate`` rounds of the same workload on
the same engine (the throughput the server is compared with; the last round counts, the first warms up). Started
here, each rate runs with an empty prefix cache (as each offline round does), the engine's running batch size is
counted per rate, and after a half-load run the server stops and the same engine measures what its latencies are
held against (``serving_targets``): the prefill of one prompt and the decode step at the batch size it ran at. The
client always runs in a process of its own, so that its work never competes with the engine's step loop for the
interpreter lock (several, when one cannot read the streams as fast as the server writes them).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace

from compile_attn.bench.throughput import ThroughputConfig, engine_round
from compile_attn.bench.workloads import Workload
from compile_attn.engine.serving.async_engine import AsyncLLM
from compile_attn.bench import serving_targets as bench_targets
from compile_attn.server.frontend import direct_opener, serving
from compile_attn.bench.load_client import client_ready, load_and_summarize

logger = logging.getLogger(__name__)


@dataclass
class ServingBenchConfig:
    """``engine`` says what to start (its ``model``, ``shape``, device and sizes) and which workload to send; with
    ``url`` nothing is started and ``served_model_name`` is what requests name."""

    engine: ThroughputConfig = field(default_factory=ThroughputConfig)
    url: str | None = None
    served_model_name: str | None = None
    vocab_size: int | None = None  # the workload's id range with ``url`` (default 10001); else the model's
    request_rates: list[float | str] = field(default_factory=lambda: [math.inf])  # "half": see the module doc
    max_concurrency: int | None = None
    num_warmup: int = 2
    offline: bool = False
    offline_rounds: int = 2
    client_processes: int = 1  # the load is dealt to this many client processes
    seed: int = 0
    frontend: str = "process"  # where a server started here runs its HTTP front end (see server.frontend)
    # Every request's response_format type (None: none): "json_object" asks for structured outputs (any JSON
    # object), so its output tok/s can be set beside a plain run's (docs/structured_outputs.md).
    response_format: str | None = None

    @property
    def extra_body(self) -> dict | None:
        """The request fields beside the workload's (None: none)."""
        return None if self.response_format is None else {"response_format": {"type": self.response_format}}


def run(cfg: ServingBenchConfig) -> dict:
    """Every request rate in turn (after ``num_warmup`` requests); one result dict (JSON-ready)."""
    result: dict = {"config": asdict(cfg) | {"request_rates": [_rate_name(r) for r in cfg.request_rates]}}
    if cfg.url is not None:
        from compile_attn.bench import workloads as bench_workloads

        e = cfg.engine
        workload = bench_workloads.build(e.workload, cfg.vocab_size or 10001, num_seqs=e.num_seqs,
                                         prompt_len=e.prompt_len, output_len=e.output_len)
        if e.temperature is not None:
            workload = replace(workload, temperature=e.temperature)
        result["workload"] = workload.summary()
        result["rates"] = _sweep(cfg.url, cfg.served_model_name or "default", workload, cfg)
        result["targets"] = bench_targets.targets(result)
        return result
    llm, workload = _start_llm(cfg, result)
    if cfg.offline:
        result["offline_rounds"] = []
        for _ in range(cfg.offline_rounds):
            result["offline_rounds"].append(engine_round(llm, workload))
            logger.info("offline generate: %.0f output tok/s", result["offline_rounds"][-1]["output_tok_s"])
        result["offline"] = result["offline_rounds"][-1]
    name = cfg.served_model_name or "bench"
    engine = AsyncLLM(llm, max_pending=max(256, workload.num_seqs))
    try:
        with serving(engine, name, cfg.frontend) as front:
            url = front.url
            result["rates"] = _sweep(url, name, workload, cfg, engine)
    finally:
        engine.shutdown()
    if cfg.offline:
        for r in result["rates"]:
            if r["output_tok_per_s"]:
                r["vs_offline"] = r["output_tok_per_s"] / result["offline"]["output_tok_s"]
    half = next((r for r in result["rates"] if r.get("rate_name") == "half"), None)
    if half is not None and half["batch"]["median_batch"] is not None:
        result["denominators"] = bench_targets.denominators(llm, workload, half["batch"]["median_batch"])
    result["targets"] = bench_targets.targets(result)
    return result


def _start_llm(cfg: ServingBenchConfig, result: dict) -> tuple[object, Workload]:
    import torch

    from compile_attn.bench import throughput as bench_throughput
    from compile_attn.engine import LLM

    e = cfg.engine
    dtype = torch.bfloat16 if e.device == "cuda" else torch.float32
    workload = bench_throughput.make_workload(e)
    model = e.model if e.model is not None else bench_throughput._random_model(e, dtype)
    start = time.perf_counter()
    llm = LLM(model, **e.llm_options(workload, dtype))
    result["workload"] = workload.summary()
    result["engine"] = dict(backend=llm.backend.name, graph_mode=llm.step_runner.graph_mode.value,
                            device=str(llm.device), dtype=str(dtype).removeprefix("torch."),
                            random_weights=e.model is None, startup_s=time.perf_counter() - start,
                            kv_cache_tokens=llm.kv_cache.allocator.num_pages * llm.kv_cache.page_size)
    return llm, workload


def _sweep(url: str, model: str, workload: Workload, cfg: ServingBenchConfig, engine: object = None) -> list[dict]:
    """Warm-up requests, then the workload at each rate, each run by a client in its own process. With the
    ``engine`` (an AsyncLLM) each rate starts with an empty prefix cache and counts the steps it ran."""
    args = (url, model)
    out = []
    parts = cfg.client_processes
    with ProcessPoolExecutor(parts, mp_context=multiprocessing.get_context("spawn")) as client:
        started = set(client.map(client_ready, range(parts)))  # every client process up before any timed send
        logger.info("%d client processes started", len(started))
        if cfg.num_warmup:
            n = min(cfg.num_warmup, workload.num_seqs)
            warm = load_and_summarize(*args, workload.prompts[:n], workload.output_lens[:n], workload.temperature,
                                      math.inf, None, cfg.seed, pool=client, parts=parts, extra=cfg.extra_body)
            if warm["errors"]:
                raise RuntimeError(f"the warm-up requests failed: {warm['first_errors']}")
        for name in cfg.request_rates:
            rate = _half_rate(out) if name == "half" else name
            if engine is not None:
                hits = engine.call(_clear_prefix_cache).result(60)
                before = engine.stats.snapshot()
            scraped = scrape(url)
            r = load_and_summarize(*args, workload.prompts, workload.output_lens, workload.temperature, rate,
                                   cfg.max_concurrency, cfg.seed, pool=client, parts=parts, extra=cfg.extra_body)
            r.update(server_side(scraped, scrape(url), r))
            if name == "half":
                r["rate_name"] = "half"
            if engine is not None:
                r["batch"] = (engine.stats.snapshot() - before).summary()
                r["prefix_hit_tokens"] = engine.call(_prefix_hits).result(60) - hits
            logger.info("rate %s: %s", _rate_name(name), r)
            out.append(r)
    return out


TTFT_METRIC = "compile_attn_time_to_first_token_seconds"
CPU_METRIC = "process_cpu_seconds_total"


def scrape(url: str) -> dict[str, float]:
    """The server's ``GET /metrics`` samples by name (summed over labels), or {} where it cannot be read."""
    import urllib.error

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with direct_opener().open(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        logger.warning("could not read %s/metrics (%s); no server-side TTFT or CPU", url, exc)
        return {}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def server_side(before: dict[str, float], after: dict[str, float], r: dict) -> dict:
    """From two scrapes around a rate's run ``r``: the server's mean TTFT (its histogram: the front end's submission
    of a request to its first token there) and the CPU seconds of the process serving HTTP (the front end's own
    when it runs apart), also per output token and as a fraction of the run. None where the server lacks them."""
    out: dict = dict(server_ttft_mean_ms=None, server_cpu_s=None, server_cpu_us_per_token=None,
                     server_cpu_busy=None)
    s, c = TTFT_METRIC + "_sum", TTFT_METRIC + "_count"
    if all(k in before and k in after for k in (s, c)) and after[c] > before[c]:
        out["server_ttft_mean_ms"] = 1e3 * (after[s] - before[s]) / (after[c] - before[c])
    if CPU_METRIC in before and CPU_METRIC in after:
        cpu = after[CPU_METRIC] - before[CPU_METRIC]
        out["server_cpu_s"] = cpu
        if r.get("output_tokens"):
            out["server_cpu_us_per_token"] = 1e6 * cpu / r["output_tokens"]
        if r.get("duration_s"):
            out["server_cpu_busy"] = cpu / r["duration_s"]
    return out


def _half_rate(done: list[dict]) -> float:
    """Half the request throughput of the last saturated run in ``done``."""
    inf = [r for r in done if r["request_rate"] == "inf" and r["requests_per_s"]]
    if not inf:
        raise ValueError("the request rate 'half' needs an 'inf' run before it (e.g. --request-rates inf,half)")
    return inf[-1]["requests_per_s"] / 2


def _clear_prefix_cache(llm: object) -> int:
    """Empty the prefix cache (if any); its hit count so far."""
    if llm.kv_cache.prefix_cache is not None:
        llm.kv_cache.prefix_cache.clear()
    return _prefix_hits(llm)


def _prefix_hits(llm: object) -> int:
    cache = llm.kv_cache.prefix_cache
    return 0 if cache is None else cache.num_hit_tokens


def _rate_name(rate: float | str) -> str | float:
    return rate if isinstance(rate, str) else "inf" if math.isinf(rate) else rate


def _label(r: dict) -> str | float:
    """A rate's name in the lines under the table: "inf", "half" or its requests per second."""
    return _rate_name(r.get("rate_name") or r["request_rate"])


def _ttft_split(r: dict) -> str:
    """The mean TTFT of a rate split at the server's and the engine's clocks (means add up; medians do not)."""
    client, server = r.get("ttft_mean_ms"), r.get("server_ttft_mean_ms")
    engine = r.get("batch", {}).get("engine_ttft_mean_ms")
    if client is None or server is None:
        return ""
    text = f"{_label(r)}: client {client:.1f} ms = HTTP and client " \
           f"{client - server:.1f} + server {server:.1f}"
    if engine is not None:
        text += f" (= pipes, loop pick-up and front end {server - engine:.1f} + engine {engine:.1f}: admission to " \
                "first token handed out)"
    return text


def to_markdown(result: dict) -> str:
    """A header line, then one table row per request rate."""
    w = result["workload"]
    lines = [f"workload {w['name']}: {w['num_seqs']} requests, {w['prompt_tokens']:,} prompt + "
             f"{w['output_tokens']:,} output tokens, temperature {w['temperature']}"
             + (f", response_format {fmt}" if (fmt := result["config"].get("response_format")) else "")]
    if "engine" in result:
        e = result["engine"]
        lines.append(f"engine: {e['backend']}, {e['graph_mode']}, {e['device']} {e['dtype']}, KV cache "
                     f"{e['kv_cache_tokens']:,} tokens" + (", random weights" if e["random_weights"] else ""))
    if "offline" in result:
        rounds = ", ".join(f"{r['output_tok_s']:,.0f}" for r in result.get("offline_rounds", [result["offline"]]))
        lines.append(f"offline LLM.generate of the same workload on the same engine: {rounds} output tok/s by round "
                     f"(the last one counts)")
    lines += ["", "| rate (req/s) | done / errors | output tok/s | vs offline | TTFT p50 / p99 ms | "
              "ITL p50 / p99 ms | TPOT p50 / p99 ms | e2e p50 / p99 ms | batch median / mean | client busy |",
              "|---|---|---|---|---|---|---|---|---|---|"]

    def pair(r: dict, name: str) -> str:
        a, b = r[f"{name}_p50_ms"], r[f"{name}_p99_ms"]
        return "-" if a is None else f"{a:.1f} / {b:.1f}"

    for r in result["rates"]:
        tps = r["output_tok_per_s"]
        vs = f"{r['vs_offline']:.0%}" if "vs_offline" in r else "-"
        rate = f"half ({r['request_rate']:.3g})" if r.get("rate_name") == "half" else r["request_rate"]
        b = r.get("batch", {})
        batch = "-" if b.get("mean_batch") is None else f"{b['median_batch']} / {b['mean_batch']:.1f}"
        lines.append(f"| {rate} | {r['completed']} / {r['errors']} | "
                     f"{'-' if tps is None else f'{tps:,.0f}'} | {vs} | {pair(r, 'ttft')} | {pair(r, 'itl')} | "
                     f"{pair(r, 'tpot')} | {pair(r, 'e2e')} | {batch} | {r['client_busy']:.0%} of "
                     f"{r['client_processes']} |")
    loops = [f"{_label(r)}: {b['step_s']:.2f} s in {b['steps']} steps, "
             f"{b['other_s']:.2f} s handing out tokens and commands"
             + ("" if b.get("deliver_s") is None else f" ({b['deliver_s']:.2f} s of it in the sinks' deliver)")
             + f", {b['idle_s']:.2f} s idle"
             + ("" if b.get("engine_ttft_p50_ms") is None else
                f", admission to first token p50 {b['engine_ttft_p50_ms']:.1f} ms")
             for r in result["rates"] if (b := r.get("batch")) and "step_s" in b]
    if loops:
        lines += ["", "engine loop by rate: " + "; ".join(loops)]
    cpu = [f"{_label(r)}: {r['server_cpu_s']:.2f} s = "
           f"{r['server_cpu_busy']:.0%} of the run, {r['server_cpu_us_per_token']:.0f} us per output token"
           for r in result["rates"] if r.get("server_cpu_busy") is not None and r.get("server_cpu_us_per_token")]
    if cpu:
        lines += ["", "CPU of the process serving HTTP by rate (the front end's own when it runs apart; near 100%: "
                  "it sets the pace): " + "; ".join(cpu)]
    split = [_ttft_split(r) for r in result["rates"]]
    if any(split):
        lines += ["", "TTFT means by rate (where the time to first token goes): " + "; ".join(s for s in split if s)]
    return "\n".join(lines + bench_targets.targets_markdown(result))
