"""Where the device time of steady engine steps goes, from a torch.profiler Chrome trace (``bench_overlap.py
--trace-dir``): the device's span over the traced steps, split into busy time (the union of kernels, copies and
memsets) and idle gaps, per step; each op by device time per step; the longest gaps with the ops around them.

A step is counted by its device-to-host copy (each engine step reads its sampled tokens back with one), or by the
ops whose names match ``--step-marker`` (a tensor-parallel worker reads nothing back: one NCCL ``Broadcast`` per
step brings it the step's device values).

    python benchmarks/gpu_trace_summary.py trace/decode_bs1.json [--top 12] [--step-marker REGEX]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from dataclasses import dataclass

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class DeviceOp:
    name: str
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def device_ops(trace: dict) -> list[DeviceOp]:
    """The trace's device events (kernels, copies, memsets) by start time."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ops = [DeviceOp(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in events
           if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    return sorted(ops, key=lambda o: o.start_us)


def short_name(name: str) -> str:
    """A kernel's name without template arguments and parameter lists (copies, memsets, Triton and Inductor names
    kept whole)."""
    if name.startswith(("Memcpy", "Memset")):
        return name
    name = re.sub(r"\(.*\)$", "", name)
    name = re.sub(r"<.*>", "<>", name)
    return name[:80]


def is_readback(op: DeviceOp) -> bool:
    return "DtoH" in op.name or "Device -> Pinned" in op.name


def summarize(ops: list[DeviceOp], step_marker: str | None = None) -> dict:
    """Span, busy (union of intervals) and idle time over whole steps: from the end of the first read-back (or
    ``step_marker`` op) to the end of the last, so that exactly ``steps`` steps lie inside; per-op totals and gaps
    inside that window."""
    marks = (lambda o: re.search(step_marker, o.name) is not None) if step_marker else is_readback
    ends = [i for i, o in enumerate(ops) if marks(o)]
    if len(ends) < 2:
        raise ValueError(f"the trace holds {len(ends)} device-to-host copies; at least 2 steps are needed")
    window = ops[ends[0] + 1:ends[-1] + 1]
    steps = len(ends) - 1
    t0, t1 = ops[ends[0]].end_us, window[-1].end_us
    busy, gaps = 0.0, []
    cursor, prev = t0, ops[ends[0]]
    for op in window:
        start = max(op.start_us, cursor)
        if op.start_us > cursor:
            gaps.append((op.start_us - cursor, prev.name, op.name))
        if op.end_us > start:
            busy += op.end_us - start
            cursor = op.end_us
            prev = op
    by_op: dict[str, list[float]] = defaultdict(list)
    for op in window:
        by_op[short_name(op.name)].append(op.dur_us)
    span = t1 - t0
    return dict(steps=steps, span_us_per_step=span / steps, busy_us_per_step=busy / steps,
                idle_us_per_step=(span - busy) / steps, ops_per_step=len(window) / steps,
                by_op={k: (len(v) / steps, sum(v) / steps) for k, v in by_op.items()},
                gaps=sorted(gaps, reverse=True))


def to_markdown(s: dict, top: int) -> str:
    lines = [f"{s['steps']} steps: span {s['span_us_per_step']:.1f} us per step = busy {s['busy_us_per_step']:.1f} "
             f"+ idle {s['idle_us_per_step']:.1f}; {s['ops_per_step']:.1f} device ops per step", "",
             "| op | per step | us per step |", "|---|---|---|"]
    for name, (count, us) in sorted(s["by_op"].items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| `{name}` | {count:.2f} | {us:.1f} |")
    lines += ["", "| gap us | after | before |", "|---|---|---|"]
    for gap, after, before in s["gaps"][:top]:
        lines.append(f"| {gap:.1f} | `{short_name(after)}` | `{short_name(before)}` |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--step-marker", help="a regex of the op that ends each step (default: the device-to-host copy)")
    args = p.parse_args()
    for path in args.traces:
        with open(path) as f:
            summary = summarize(device_ops(json.load(f)), args.step_marker)
        print(f"## {path}\n\n{to_markdown(summary, args.top)}\n")


if __name__ == "__main__":
    main()
