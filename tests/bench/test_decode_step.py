"""The decode-step benchmark runs end to end on a tiny model and routes each mode to its graphs."""

from __future__ import annotations

import json

from compile_attn.bench import decode_step as bench


def test_bench_runs_every_mode_and_hf_eager_on_a_tiny_model() -> None:
    cfg = bench.BenchConfig(shape=dict(bench.TINY), batch_sizes=(2,), context=16, modes=("none", "full", "breakable"),
                            hf_baselines=("eager",), iters=2, warmup=1, device="cpu")
    rows = bench.run(cfg)
    systems = [r.system for r in rows]
    assert systems == ["HF eager", "compile_attn torch_native none (eager)", "compile_attn torch_native full (full)",
                       "compile_attn torch_native breakable (breakable)"]
    assert all(r.ms > 0 and r.floor_ms > 0 for r in rows)
    expected_floor = (sum(p.numel() for p in bench._hf_model(cfg, "sdpa", bench.torch.float32).parameters()) * 4
                      + 2 * 16 * 2 * 2 * 2 * 16 * 4) / 3.0e12 * 1e3
    assert abs(rows[1].floor_ms - expected_floor) < 1e-9
    assert "| HF eager | 2 |" in bench.to_markdown(rows)
    assert len(json.loads(bench.to_json(rows, cfg))["rows"]) == 4


def test_busy_time_counts_overlapping_kernels_once() -> None:
    from hypothesis import given
    from hypothesis import strategies as st

    assert bench.busy_us([]) == 0.0
    assert bench.busy_us([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0  # [0, 3] and [5, 6]
    assert bench.busy_us([(0.0, 10.0), (2.0, 3.0)]) == 10.0  # nested

    @given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 20)), max_size=20))
    def matches_a_grid_of_unit_cells(spans: list[tuple[int, int]]) -> None:
        intervals = [(float(a), float(a + n)) for a, n in spans]
        covered = {t for a, n in spans for t in range(a, a + n)}  # unit cells [t, t+1) under some interval
        assert bench.busy_us(intervals) == float(len(covered))

    matches_a_grid_of_unit_cells()


def test_bench_json_records_the_command_versions_and_commit(tmp_path) -> None:  # noqa: ANN001
    import re

    import torch

    from compile_attn import cli
    from compile_attn.bench.run_info import git_commit

    out = tmp_path / "bench.json"
    argv = ["bench", "--tiny", "--backend", "torch_native", "--batch-sizes", "1", "--modes", "none", "--hf", "",
            "--iters", "2", "--no-profile", "--out", str(out)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    run = result["run"]
    assert run["command"] == ("compile-attn bench --tiny --backend torch_native --batch-sizes 1 --modes none --hf '' "
                              f"--iters 2 --no-profile --out {out}")
    assert run["versions"]["torch"] == torch.__version__
    assert run["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    assert run["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", run["git_commit"])
    assert [r["system"] for r in result["decode"]["rows"]] == ["compile_attn torch_native none (eager)"]
    assert git_commit(str(tmp_path)) is None  # not a checkout
