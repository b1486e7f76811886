"""The decode-step benchmark runs end to end on a tiny model and routes each mode to its graphs."""

from __future__ import annotations

import json

from compile_attn import bench


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
