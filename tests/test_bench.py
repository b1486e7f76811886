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
