"""``compile-attn throughput``: the nanovllm workload is nano-vllm's (256 sequences, 133,966 output tokens) and
reproducible, ``fixed`` has its shape, and tiny end-to-end runs on the CPU generate exactly the workload's tokens
in the steps continuous batching must take, with every reported field and the run record in the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compile_attn import cli
from compile_attn.bench import workloads as bench_workloads

FAST = ["--tiny", "--no-compile", "--graph-mode", "none", "--device", "cpu"]


def test_nanovllm_is_nano_vllms_workload_and_reproducible() -> None:
    w = bench_workloads.nanovllm(vocab_size=128256)
    assert w.num_seqs == 256 and w.output_tokens == 133_966  # nano-vllm's bench reports 133,966 tokens
    assert all(100 <= len(p) <= 1024 for p in w.prompts) and all(100 <= n <= 1024 for n in w.output_lens)
    assert all(0 <= t <= 10000 for p in w.prompts for t in p)
    assert w.temperature == 0.6
    again = bench_workloads.build("nanovllm", 128256)
    assert again.prompts == w.prompts and again.output_lens == w.output_lens
    assert bench_workloads.nanovllm(vocab_size=128256, seed=1).output_lens != w.output_lens


def test_nanovllm_scaled_down_and_into_a_small_vocabulary() -> None:
    w = bench_workloads.build("nanovllm", 256, num_seqs=4, prompt_len=32, output_len=16)
    assert w.num_seqs == 4
    assert all(16 <= len(p) <= 32 for p in w.prompts) and all(8 <= n <= 16 for n in w.output_lens)
    assert all(0 <= t < 256 for p in w.prompts for t in p)


def test_fixed_shapes() -> None:
    default = bench_workloads.build("fixed", 128256)
    assert default.num_seqs == 256 and {len(p) for p in default.prompts} == {256}
    assert set(default.output_lens) == {128} and default.temperature == 0.0
    w = bench_workloads.fixed(num_seqs=3, prompt_len=5, output_len=2, vocab_size=7)
    assert [len(p) for p in w.prompts] == [5, 5, 5] and w.output_lens == [2, 2, 2]
    assert (w.prompt_tokens, w.output_tokens, w.longest) == (15, 6, 7)
    assert all(0 <= t < 7 for p in w.prompts for t in p)
    with pytest.raises(ValueError, match="unknown workload 'sharegpt'"):
        bench_workloads.build("sharegpt", 100)


def test_long_context_shapes() -> None:
    w = bench_workloads.build("long-context", 128256)
    assert w.name == "long-context" and w.num_seqs == 32 and {len(p) for p in w.prompts} == {7680}
    assert set(w.output_lens) == {256} and w.temperature == 0.0 and w.longest == 7680 + 256
    small = bench_workloads.build("long-context", 50, num_seqs=2, prompt_len=9, output_len=3)
    assert [len(p) for p in small.prompts] == [9, 9] and all(0 <= t < 50 for p in small.prompts for t in p)


def _run(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    out = tmp_path / "throughput.json"
    assert cli.main(["throughput", *argv, "--out", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_fixed_end_to_end_on_the_cpu_with_hf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["fixed", *FAST, "--num-seqs", "4", "--prompt-len", "16", "--output-len", "8"]
    result, table = _run(argv, tmp_path, capsys)
    run = result["run"]
    assert run["command"] == "compile-attn throughput " + " ".join(argv + ["--out", str(tmp_path / "throughput.json")])
    assert {"date", "git_commit", "device", "versions"} <= set(run) and run["versions"]["torch"].startswith("2.")
    assert result["random_weights"] is True and "random weights" in table
    assert result["workload"] == dict(name="fixed", num_seqs=4, prompt_tokens=64, output_tokens=32, temperature=0.0,
                                      ignore_eos=True, longest=24)
    engine = result["engine"]
    assert engine["startup_s"] > 0 and len(engine["rounds"]) == 2
    for r in engine["rounds"]:
        assert r["output_tokens"] == 4 * 8
        # all four prompts prefill in one step (which samples each first token), then 7 decode steps of 4 rows
        assert r["steps_by_kind"] == {"extend": 1, "decode": 7} and r["steps"] == 8
        assert set(r["ms_per_step_by_kind"]) == {"extend", "decode"} and r["preemptions"] == 0
        assert r["output_tok_s"] == pytest.approx(32 / r["wall_s"])
        assert r["total_tok_s"] == pytest.approx((64 + 32) / r["wall_s"])
        assert sum(r["seconds_by_kind"].values()) <= r["wall_s"]
    assert engine["gpu_busy"] == []  # CPU: nothing profiled
    hf = result["hf"]
    assert "skipped" not in hf and len(hf["rounds"]) == 2
    assert [r["output_tokens"] for r in hf["rounds"]] == [32, 32]
    assert table.count("| compile_attn torch_native none |") == 2 and table.count("| HF generate_batch") == 2


def test_nanovllm_scaled_down_end_to_end_mixes_prefill_into_decode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["nanovllm", *FAST, "--num-seqs", "4", "--max-input", "32", "--max-output", "16", "--max-batch-size", "2",
            "--no-hf", "--rounds", "3"]
    result, table = _run(argv, tmp_path, capsys)
    expected = bench_workloads.build("nanovllm", 256, num_seqs=4, prompt_len=32, output_len=16)
    assert result["workload"]["output_tokens"] == expected.output_tokens
    assert result["workload"]["temperature"] == 0.6 and "hf" not in result
    rounds = result["engine"]["rounds"]
    assert len(rounds) == 3
    for r in rounds:
        assert r["output_tokens"] == expected.output_tokens
        # two requests at a time: the third prefills while the second decodes (a mixed step)
        assert r["steps_by_kind"].get("mixed", 0) >= 1 and r["steps"] == sum(r["steps_by_kind"].values())
    assert [r["steps_by_kind"] for r in rounds[1:]] == [rounds[0]["steps_by_kind"]] * 2  # same schedule each round
    assert "| 1 (first) |" in table and "| 3 |" in table


def test_arrivals_are_poisson_with_log_normal_lengths() -> None:
    """Gaps are exponential at the rate (their mean within 5% over 4,000 draws), lengths stay in their clips with
    medians near the asked ones, and the workload is reproducible."""
    import statistics

    w = bench_workloads.build("arrivals", 256, num_seqs=4000, prompt_len=512, output_len=64, request_rate=100.0)
    gaps = [b - a for a, b in zip(w.arrival_s, w.arrival_s[1:])]
    assert w.arrival_s[0] == 0.0 and min(gaps) >= 0
    assert abs(statistics.mean(gaps) - 0.01) < 0.0005
    prompt_lens = [len(p) for p in w.prompts]
    assert min(prompt_lens) >= 16 and max(prompt_lens) <= 8 * 512 and min(w.output_lens) >= 8
    assert 0.9 * 512 < statistics.median(prompt_lens) < 1.1 * 512 and 0.9 * 64 < statistics.median(w.output_lens) < 1.1 * 64
    assert max(max(p) for p in w.prompts) < 256
    assert w == bench_workloads.build("arrivals", 256, num_seqs=4000, prompt_len=512, output_len=64, request_rate=100.0)


def test_arrivals_end_to_end_add_requests_over_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Requests join while others run: every output token is generated, the round lasts at least until the last
    arrival, and the workload reported is the one asked for."""
    argv = ["arrivals", *FAST, "--num-seqs", "6", "--prompt-len", "16", "--output-len", "8", "--request-rate", "20",
            "--no-hf", "--rounds", "1"]
    result, _ = _run(argv, tmp_path, capsys)
    expected = bench_workloads.build("arrivals", 256, num_seqs=6, prompt_len=16, output_len=8, request_rate=20)
    r = result["engine"]["rounds"][0]
    assert r["output_tokens"] == expected.output_tokens
    assert r["wall_s"] >= expected.arrival_s[-1]
    assert result["workload"]["last_arrival_s"] == expected.arrival_s[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["throughput", "fixed", "--num-seqs", "0"], "--num-seqs must be >= 1, got 0"),
        (["throughput", "fixed", "--hf-max-memory-percent", "2"], "--hf-max-memory-percent must be in (0, 1]"),
        (["throughput", "nanovllm", "--backend", "nope"], "unknown attention backend 'nope'"),
        (["throughput", "fixed", "--temperature", "-1"], "--temperature must be >= 0"),
        (["throughput", "fixed", "--request-rate", "3"], "--request-rate is for the arrivals workload"),
        (["throughput", "arrivals", "--request-rate", "0"], "--request-rate must be a finite number > 0"),
    ],
)
def test_bad_options_are_a_usage_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_busy_windows_on_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["fixed", "--tiny", "--device", "cuda", "--num-seqs", "4", "--prompt-len", "16", "--output-len", "40",
            "--profile-steps", "8", "--no-hf"]
    result, table = _run(argv, tmp_path, capsys)
    busy = result["engine"]["gpu_busy"]
    assert [b["first_step"] for b in busy] == [0, 20] and [b["steps"] for b in busy] == [8, 8]
    assert busy[0]["steps_by_kind"] == {"extend": 1, "decode": 7} and busy[1]["steps_by_kind"] == {"decode": 8}
    assert all(0 < b["busy_fraction"] <= 1 for b in busy) and "GPU busy" in table
