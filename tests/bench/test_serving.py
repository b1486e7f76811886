"""``compile-attn bench-serve``: run tiny on the CPU, in-process (random weights, with the offline rounds, a fixed
rate and half load, the requests dealt to two client processes) and against the test server by URL; every request
completes, the tokens counted match the workload, every later token has one ITL sample; the half-load rate is half
the saturated run's requests per second; each rate runs with an empty prefix cache; the batch sizes counted lie
within the engine's limit; the denominators are measured at the workload's median prompt and the half-load run's
median batch, and the targets are the ratios of the numbers reported; Poisson arrival gaps have the rate's mean;
percentiles against numpy's; options refused before anything starts."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from compile_attn.cli import build_parser, main
from compile_attn.bench.load_client import (RequestRecord, arrival_offsets, load_and_summarize, percentile, run_load,
                                             summarize)
from tests.server import conftest as server_conftest
from tests.server.conftest import MODEL, Served

served = server_conftest.served  # the running server of tests/server (fixture)
engine_options = server_conftest.engine_options  # the fixture ``served`` takes (no extra engine options here)


def test_percentile_and_summary_against_numpy() -> None:
    rng = np.random.default_rng(0)
    xs = rng.exponential(size=101).tolist()
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None
    recs = [RequestRecord(ttft=0.1, itl=[0.01, 0.03], e2e=0.14, prompt_tokens=4, output_tokens=3),
            RequestRecord(ttft=0.3, itl=[0.02], e2e=0.32, prompt_tokens=4, output_tokens=2),
            RequestRecord(error="HTTP 503")]
    s = summarize(recs, duration=2.0)
    assert (s["requests"], s["completed"], s["errors"], s["output_tokens"]) == (3, 2, 1, 5)
    assert s["output_tok_per_s"] == 2.5 and s["first_errors"] == ["HTTP 503"]
    assert s["ttft_p50_ms"] == pytest.approx(200.0) and s["itl_p50_ms"] == pytest.approx(20.0)
    assert s["tpot_mean_ms"] == pytest.approx((20.0 + 20.0) / 2)


def test_bench_serve_in_process_tiny(tmp_path) -> None:
    out = tmp_path / "serve.json"
    rc = main(["bench-serve", "--tiny", "--device", "cpu", "--no-compile", "--graph-mode", "none",
               "--num-seqs", "5", "--prompt-len", "6", "--output-len", "4", "--request-rates", "inf,40,half",
               "--client-processes", "2",
               "--max-batch-size", "4", "--max-num-tokens", "64", "--offline", "--num-warmup", "1",
               "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["run"]["command"].startswith("compile-attn bench-serve")
    inf, fixed, half = result["rates"]
    assert [r["request_rate"] for r in (inf, fixed)] == ["inf", 40.0] and half["rate_name"] == "half"
    assert half["request_rate"] == pytest.approx(inf["completed"] / inf["duration_s"] / 2)
    assert len(result["offline_rounds"]) == 2 and result["offline"] == result["offline_rounds"][-1]
    assert result["offline"]["output_tokens"] == 20 and result["offline"]["output_tok_s"] > 0
    for r in result["rates"]:
        assert (r["completed"], r["errors"], r["output_tokens"], r["prompt_tokens"]) == (5, 0, 20, 30)
        for name in ("ttft", "itl", "tpot", "e2e"):
            assert 0 < r[f"{name}_p50_ms"] <= r[f"{name}_p99_ms"]
        assert r["vs_offline"] == pytest.approx(r["output_tok_per_s"] / result["offline"]["output_tok_s"])
        assert r["client_processes"] == 2 and r["client_busy"] > 0
        assert r["client_start_lag_ms"] < 1000  # both client processes were up before the run (a start takes s)
        assert r["prefix_hit_tokens"] == 0  # the same prompts again: only an emptied cache misses them
        b = r["batch"]
        assert b["steps"] >= 4 and 1 <= b["median_batch"] <= 4 and 0 < b["mean_batch"] <= 4
        # each request's three clocks nest (client send .. first chunk read > the server's submission .. first
        # token there > the loop's admission .. first token handed out), so their means do too
        assert 0 < b["engine_ttft_mean_ms"] < r["server_ttft_mean_ms"] < r["ttft_mean_ms"]
        assert 0 < b["deliver_s"] < b["other_s"]  # the pipe's sends are part of the loop's time outside steps
        # the front end's process, from its /metrics: CPU it spent over the run, per token and as a fraction
        assert r["server_cpu_s"] >= 0 and r["server_cpu_busy"] == pytest.approx(r["server_cpu_s"] / r["duration_s"])
        assert r["server_cpu_us_per_token"] == pytest.approx(1e6 * r["server_cpu_s"] / r["output_tokens"])
    den = result["denominators"]
    assert den["prefill"]["prompt_len"] == 6 and len(den["prefill"]["samples_ms"]) == 5
    assert den["decode_step"]["batch_size"] == den["decode_step"]["running"] == half["batch"]["median_batch"]
    t = result["targets"]
    assert t["server_vs_offline"]["value"] == pytest.approx(inf["vs_offline"])
    assert t["itl_p50_over_decode_step"]["value"] == pytest.approx(half["itl_p50_ms"] / den["decode_step"]["median_ms"])
    assert t["ttft_p50_over_prefill"]["value"] == pytest.approx(half["ttft_p50_ms"] / den["prefill"]["median_ms"])
    assert all(x["met"] == (x["value"] >= x["bound"] if name == "server_vs_offline" else x["value"] <= x["bound"])
               for name, x in t.items())


def test_bench_serve_half_load_by_url(served: Served, tmp_path) -> None:
    served.wait_idle()
    out = tmp_path / "url.json"
    rc = main(["bench-serve", "--url", served.url, "--served-model-name", MODEL, "--vocab-size", "50",
               "--num-seqs", "3", "--prompt-len", "4", "--output-len", "3", "--request-rates", "inf,half",
               "--num-warmup", "0", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    inf, half = result["rates"]
    assert half["rate_name"] == "half" and half["request_rate"] == pytest.approx(inf["requests_per_s"] / 2)
    assert [r["output_tokens"] for r in result["rates"]] == [9, 9]
    assert all(0 < r["server_ttft_mean_ms"] < r["ttft_mean_ms"] for r in result["rates"])  # read from /metrics
    assert "denominators" not in result and all(x["value"] is None for x in result["targets"].values())
    served.wait_idle()


def test_load_client_against_a_running_server(served: Served) -> None:
    served.wait_idle()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    r = load_and_summarize(served.url, MODEL, prompts, [5, 3, 7], 0.0, math.inf, 2, 0)
    assert (r["completed"], r["errors"], r["output_tokens"], r["prompt_tokens"]) == (3, 0, 15, 9)
    assert r["client_processes"] == 1 and 0 < r["client_busy"]
    offsets = arrival_offsets(3, 50.0, 1)
    records, first, last = asyncio.run(run_load(served.url, MODEL, prompts, [5, 3, 7], 1.0, offsets))
    assert [r.output_tokens for r in records] == [5, 3, 7]
    assert [len(r.itl) for r in records] == [4, 2, 6]  # one gap per token after the first
    assert all(r.ttft is not None and r.e2e >= r.ttft for r in records)
    assert last - first >= offsets[-1] + records[-1].e2e - 1e-3  # the last request was sent on its time
    bad = load_and_summarize(served.url, "other", prompts[:1], [2], 0.0, math.inf, None, 0)
    assert bad["errors"] == 1 and "HTTP 400" in bad["first_errors"][0]
    served.wait_idle()


def test_arrival_offsets_are_poisson() -> None:
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    xs = arrival_offsets(4000, 20.0, seed=3)
    gaps = np.diff(xs)
    assert xs[0] == 0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.05) and gaps.std() == pytest.approx(1 / 20, rel=0.08)
    assert xs == arrival_offsets(4000, 20.0, seed=3) != arrival_offsets(4000, 20.0, seed=4)


@pytest.mark.parametrize("argv,message", [
    (["--request-rates", "0"], "--request-rates must be > 0"),
    (["--request-rates", "fast"], "--request-rates takes"),
    (["--request-rates", "half,inf"], "'inf' must come before it"),
    (["--request-rates", "10,half"], "'inf' must come before it"),
    (["--offline-rounds", "0"], "--offline-rounds must be >= 1"),
    (["--client-processes", "0"], "--client-processes must be >= 1"),
    (["--url", "http://127.0.0.1:1", "--offline"], "--url benchmarks a running server"),
    (["--url", "127.0.0.1:8000"], "--url must start with http"),
    (["--num-seqs", "0"], "--num-seqs must be >= 1"),
])
def test_bench_serve_options_are_checked(argv: list[str], message: str) -> None:
    args = build_parser().parse_args(["bench-serve", *argv])
    with pytest.raises(ValueError, match=message):
        args.prepare(args)
