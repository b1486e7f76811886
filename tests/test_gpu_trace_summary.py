"""benchmarks/gpu_trace_summary.py on a hand-made Chrome trace: span, busy time (overlapping ops counted once),
idle gaps and per-op totals per step, against values worked out by hand."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from gpu_trace_summary import device_ops, summarize, to_markdown  # noqa: E402


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


TRACE = {"traceEvents": [
    _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 5),  # the step before the window ends here (t = 5)
    _x("cpu_op", "aten::argmax", 1, 100),  # host events are not device time
    _x("kernel", "void gemm<float, 4>(int)", 10, 10),
    _x("kernel", "triton_poi_fused_0", 18, 12),  # overlaps the gemm by 2 us
    _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 40, 5),  # step 1 ends at 45
    _x("gpu_memset", "Memset (Device)", 50, 10),
    _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 60, 5),  # step 2 ends at 65
]}


def test_busy_idle_and_ops_per_step():
    s = summarize(device_ops(TRACE))
    # window 5..65: 60 us over 2 steps; busy 10..30 (20) + 40..45 + 50..60 + 60..65 = 40; idle 5 + 10 + 5 = 20
    assert s["steps"] == 2
    assert s["span_us_per_step"] == pytest.approx(30.0)
    assert s["busy_us_per_step"] == pytest.approx(20.0)
    assert s["idle_us_per_step"] == pytest.approx(10.0)
    assert s["ops_per_step"] == pytest.approx(2.5)
    assert [g[0] for g in s["gaps"]] == [10.0, 5.0, 5.0]
    assert s["gaps"][0][1].startswith("triton_poi_fused_0") and "DtoH" in s["gaps"][0][2]
    assert s["by_op"]["void gemm<>"] == pytest.approx((0.5, 5.0))
    assert s["by_op"]["Memcpy DtoH (Device -> Pinned)"] == pytest.approx((1.0, 5.0))
    assert "| 10.0 |" in to_markdown(s, top=3)


def test_too_few_steps_is_refused():
    with pytest.raises(ValueError, match="at least 2 steps"):
        summarize(device_ops({"traceEvents": TRACE["traceEvents"][:4]}))
