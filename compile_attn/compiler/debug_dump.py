"""Debug dump of one compiled graph: depyf's decompiled bytecode, every graph's code, a readable summary.

Enabled by ``GraphConfig.debug_dir`` (whose default is ``$COMPILE_ATTN_DEBUG_DIR``; ``config.py`` reads it). Layout under that directory::

    graph_<frame>_<compile>/
        dynamo_graph.py            the graph Dynamo handed to the backend
        split_graph.py             the stitched module calling the pieces in order
        piece_<i>_<name>.py        each piece's graph (compiled pieces and split-op pieces)
        summary.txt                pieces, ops in each, compiled or eager, identical groups, captured buckets
        decompiled_<fn>.py         the frame's bytecode after Dynamo, decompiled by depyf
        original_<fn>.py           the frame's original bytecode, decompiled by depyf
"""

from __future__ import annotations

import logging
import re
import types
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from torch import fx

from compile_attn.passes.split import SplitGraph

logger = logging.getLogger(__name__)

@dataclass
class PieceRow:
    index: int
    name: str
    kind: str  # "compiled (inductor)", "compiled (eager)", "split op (eager)"
    group: int | None
    ops: list[str]
    token_dynamic: bool


@dataclass
class SplitSummary:
    """What the summary file says; ``captured`` grows as graphs are captured."""

    compile_id: str
    compiler: str
    piecewise_graphs: bool  # pieces are wrapped for the graph runner's piecewise buckets (on a GPU)
    token_symbol: str | None
    rows: list[PieceRow]
    captured: dict[str, list[int]] = field(default_factory=dict)

    def render(self) -> str:
        compiled = [r for r in self.rows if not r.kind.startswith("split")]
        num_split = len(self.rows) - len(compiled)
        groups = {r.group for r in compiled if r.group is not None}
        lines = [
            f"compile_attn split summary, Dynamo compile {self.compile_id}",
            f"compiler: {self.compiler}; token-count symbol: {self.token_symbol or 'none (static shapes)'}",
            f"pieces: {len(self.rows)} ({len(compiled)} compiled, {num_split} split-op), "
            f"unique compiled: {len(groups) if groups else len(compiled)}",
            "piecewise CUDA graphs: " + ("per bucket of the graph runner's piecewise steps" if self.piecewise_graphs
                                         else "none (not on a GPU)"),
            "",
            f"{'#':>3}  {'piece':<12} {'kind':<20} {'group':<6} {'graph@T':<8} ops",
        ]
        for r in self.rows:  # graph@T: captured per token-count bucket
            ops = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in Counter(r.ops).items())
            group = "-" if r.group is None else str(r.group)
            graphed = r.token_dynamic and r.kind.startswith("compiled") and self.piecewise_graphs
            graphed_text = "yes" if graphed else "no"
            lines.append(f"{r.index:>3}  {r.name:<12} {r.kind:<20} {group:<6} {graphed_text:<8} {ops}")
        lines += ["", "captured sizes (CUDA graphs):"]
        if not self.captured:
            lines.append("  none yet")
        for name, sizes in self.captured.items():
            lines.append(f"  {name}: {sorted(sizes)}")
        return "\n".join(lines) + "\n"


class DebugDump:
    """Files of one Dynamo graph under ``<root>/graph_<frame>_<compile>/``."""

    def __init__(self, root: str, compile_id: str) -> None:
        self.dir = Path(root).expanduser() / f"graph_{re.sub(r'[^0-9A-Za-z]+', '_', compile_id).strip('_')}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.summary: SplitSummary | None = None
        logger.info("compile_attn: writing debug dump to %s", self.dir)

    def write_dynamo_graph(self, gm: fx.GraphModule) -> None:
        self._write("dynamo_graph.py", gm.print_readable(print_output=False))

    def write_split(self, split: SplitGraph) -> None:
        self._write("split_graph.py", split.split_gm.print_readable(print_output=False, include_stride=False))
        for piece in split.pieces:
            code = piece.graph_module.print_readable(print_output=False)
            self._write(f"piece_{piece.index:02d}_{piece.name}.py", code)

    def write_summary(self, summary: SplitSummary) -> None:
        self.summary = summary
        self._write("summary.txt", summary.render())

    def record_capture(self, piece_name: str, size: int) -> None:
        if self.summary is not None:
            self.summary.captured.setdefault(piece_name, []).append(size)
            self._write("summary.txt", self.summary.render())

    def expect_bytecode(self) -> None:
        """Have the next Dynamo bytecode hook call write this frame's decompiled code here."""
        global _pending_dump
        _pending_dump = self.dir
        _install_bytecode_hook()

    def _write(self, name: str, text: str) -> None:
        (self.dir / name).write_text(text)


_pending_dump: Path | None = None
_hook_installed = False


def _decompile(code: types.CodeType) -> str:
    try:
        import depyf
    except ImportError:
        return "# depyf is not installed: pip install depyf (or compile-attn[test]) for decompiled code\n"
    try:
        return depyf.decompile(code)
    except Exception as exc:  # noqa: BLE001 - a dump must never break compilation
        return f"# depyf could not decompile {code.co_name}: {exc}\n"


def _bytecode_hook(code: types.CodeType, new_code: types.CodeType) -> None:
    global _pending_dump
    target, _pending_dump = _pending_dump, None
    if target is None:
        return None
    (target / f"decompiled_{code.co_name}.py").write_text(_decompile(new_code))
    (target / f"original_{code.co_name}.py").write_text(_decompile(code))
    return None


def _install_bytecode_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        from torch._dynamo.convert_frame import register_bytecode_hook

        register_bytecode_hook(_bytecode_hook)
        _hook_installed = True
