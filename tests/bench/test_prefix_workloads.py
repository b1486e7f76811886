"""The prefix-cache workloads of ``compile-attn throughput``: ``shared-prefix`` and ``multi-turn`` have the issue's
shapes, and tiny CPU runs report the cache on and off in one run, generate every token with both, and save at
least the tokens the workload shares (the system prompt of every request admitted after the first; each later
turn's history)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compile_attn import cli
from compile_attn.bench import workloads as bench_workloads

FAST = ["--tiny", "--no-compile", "--graph-mode", "none", "--device", "cpu", "--rounds", "1"]


def test_shared_prefix_shape() -> None:
    w = bench_workloads.build("shared-prefix", 128256)
    assert w.num_seqs == 256 and {len(p) for p in w.prompts} == {2048 + 32} and set(w.output_lens) == {128}
    system = w.prompts[0][:2048]
    assert all(p[:2048] == system for p in w.prompts)
    assert len({tuple(p[2048:]) for p in w.prompts}) == 256  # each request's own tokens differ
    assert w.prompt_tokens == 256 * 2080 and w.output_tokens == 256 * 128 and w.temperature == 0.0


def test_multi_turn_shape() -> None:
    w = bench_workloads.build("multi-turn", 128256)
    assert len(w.prompts) == 64 and w.num_seqs == 64 * 4
    assert all(len(f) == 3 and all(len(t) == 128 for t in f) for f in w.follow_ups)
    turn_lens = [1024 + k * (128 + 128) for k in range(4)]  # each turn adds the answer and the user's tokens
    assert w.prompt_tokens == 64 * sum(turn_lens) and w.output_tokens == 64 * 4 * 128
    assert w.longest == turn_lens[-1] + 128
    small = bench_workloads.multi_turn(num_seqs=2, prompt_len=5, turn_len=2, output_len=3, turns=2, vocab_size=7)
    assert (small.num_seqs, small.prompt_tokens, small.output_tokens, small.longest) == (4, 2 * (5 + 10), 12, 13)


def _run(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    out = tmp_path / "throughput.json"
    assert cli.main(["throughput", *argv, "--out", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_shared_prefix_tiny_on_and_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["shared-prefix", *FAST, "--num-seqs", "8", "--prompt-len", "64", "--output-len", "6",
            "--max-num-tokens", "96", "--no-hf"]
    result, table = _run(argv, tmp_path, capsys)
    on, off = result["engine"]["rounds"]
    assert on["prefix_cache"] and not off["prefix_cache"]
    assert on["output_tokens"] == off["output_tokens"] == 8 * 6
    # one request fits the first step (96 tokens); the seven after it find the 64-token system prompt cached
    assert on["prefill_tokens_saved"] >= 7 * 64
    assert on["prefix_hit_rate"] == pytest.approx(on["prefill_tokens_saved"] / (8 * 96))
    assert off["prefill_tokens_saved"] == 0
    assert "| compile_attn torch_native none, prefix cache off | 1 (first) |" in table and "| off |" in table


def test_multi_turn_tiny_saves_each_history(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["multi-turn", *FAST, "--num-seqs", "3", "--prompt-len", "24", "--output-len", "5"]
    result, table = _run(argv, tmp_path, capsys)
    w = bench_workloads.build("multi-turn", 256, num_seqs=3, prompt_len=24, output_len=5)
    assert result["workload"]["num_seqs"] == 12 and result["workload"]["prompt_tokens"] == w.prompt_tokens
    on, off = result["engine"]["rounds"]
    assert on["output_tokens"] == off["output_tokens"] == 12 * 5
    # a later turn finds at least the turn before's prompt cached (its answer's KV, too, but for its last tokens)
    histories = sum(24 + k * (5 + 3) for k in range(3))
    assert on["prefill_tokens_saved"] >= 3 * histories
    assert "skipped: generate_batch takes every prompt at once" in table


def test_no_prefix_cache_flag_runs_with_it_off_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["shared-prefix", *FAST, "--num-seqs", "3", "--prompt-len", "16", "--output-len", "3", "--no-hf",
            "--no-prefix-cache"]
    result, _ = _run(argv, tmp_path, capsys)
    assert result["config"]["prefix_cache"] is False
    (only,) = result["engine"]["rounds"]
    assert not only["prefix_cache"] and only["prefill_tokens_saved"] == 0 and only["output_tokens"] == 9
