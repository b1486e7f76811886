"""Counters of what the compile backend and the piecewise graph wrappers did, for tests and logs.

One process-wide instance, ``compile_counters``. Tests take a snapshot before an action and compare
the difference with ``expect(...)``; nothing here changes behaviour.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class CompileCounters:
    """What happened so far in this process (all counts only grow, except through ``reset``).

    graphs_seen: Dynamo graphs the backend compiled. recompiles: of those, graphs for a frame that
    had been compiled before (a guard failed, e.g. a new dynamic-shape specialization).
    floats_specialized: Python float inputs turned into guarded constants. float_restarts: traces
    Dynamo was asked to restart for floats that could not be specialized in place. pieces_split:
    pieces produced by the split (both kinds); split_op_pieces: those holding split ops, run
    eagerly. pieces_compiled: pieces compiled from scratch by Inductor (identical pieces once);
    pieces_reused: pieces that reuse an identical piece's compiled code. cache_hits / cache_misses /
    cache_saves: persistent compile cache; cache_unsaved: misses whose artifact PyTorch could not serialise
    (compiled again at the next start, from Inductor's own caches). graphs_captured / graph_replays: piecewise CUDA graphs.
    replays_refused: replays declined because an input lives at another address than at capture
    (the piece ran without its graph). linear_groups_fused: groups of shared-input linear layers run
    as one GEMM (see ``compile_attn.passes.fuse_linears``). split_calls_direct: split-op calls that the
    compiled model makes to the op's Python body, not through ``torch.ops`` (a host shortcut, see
    ``compiler.shortcuts.direct_split_piece``).
    pieces_compiled_static: extra compiles of a piece at one of ``GraphConfig.compile_sizes`` (static shapes;
    cache hits count under cache_hits); static_piece_calls: calls that ran such an artifact;
    linears_as_reductions: one-row linear calls those static pieces run as reductions (``compile_sizes``).
    """

    graphs_seen: int = 0
    recompiles: int = 0
    floats_specialized: int = 0
    float_restarts: int = 0
    pieces_split: int = 0
    split_op_pieces: int = 0
    pieces_compiled: int = 0
    pieces_reused: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_saves: int = 0
    cache_unsaved: int = 0
    graphs_captured: int = 0
    graph_replays: int = 0
    replays_refused: int = 0
    linear_groups_fused: int = 0
    split_calls_direct: int = 0
    pieces_compiled_static: int = 0
    static_piece_calls: int = 0
    linears_as_reductions: int = 0

    def snapshot(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def delta(self, since: dict[str, int]) -> dict[str, int]:
        """Non-zero changes since ``since`` (a ``snapshot()``)."""
        now = self.snapshot()
        return {k: now[k] - since[k] for k in now if now[k] != since[k]}

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)

    @contextlib.contextmanager
    def expect(self, **expected: int) -> Iterator[None]:
        """Assert that the block changes exactly the named counters by the given amounts.

        Counters not named must not change, except ``graph_replays``, ``linear_groups_fused``,
        ``split_calls_direct``, ``static_piece_calls`` and ``linears_as_reductions`` (checked only when named).
        """
        unknown = set(expected) - set(self.snapshot())
        if unknown:
            raise ValueError(f"unknown counter(s) {sorted(unknown)}; known: {sorted(self.snapshot())}")
        before = self.snapshot()
        yield
        got = self.delta(before)
        for optional in ("graph_replays", "linear_groups_fused", "split_calls_direct", "static_piece_calls",
                         "linears_as_reductions"):
            if optional not in expected:
                got.pop(optional, None)
        want = {k: v for k, v in expected.items() if v != 0}
        if got != want:
            raise AssertionError(f"compile counters changed by {got}, expected {want}")


compile_counters = CompileCounters()
