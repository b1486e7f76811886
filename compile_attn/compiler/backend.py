"""The Dynamo backend ``"compile_attn"``: split at attention, compile pieces, piecewise CUDA graphs.

``torch.compile(model, backend="compile_attn", options={...})`` with options named after
``GraphConfig`` fields (``compiler``, ``cache_dir``, ``debug_dir``, ``compile_sizes``, ...) or
``options={"config": GraphConfig(...)}``. The returned callable (the split GraphModule, in a ``GraphEntry`` with
the host shortcuts on) runs compiled pieces and eager split ops in the original order. On a GPU each compiled
piece whose token count is dynamic sits in a ``PiecewiseGraphWrapper``, which captures and replays the buckets the
graph runner's piecewise steps name. This module wires the passes and compilers together and owns no algorithm.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx
from tqdm.auto import tqdm

from compile_attn.compiler.cache import CompileCache
from compile_attn.compiler.compile_sizes import SizeDispatch
from compile_attn.compiler.counters import compile_counters
from compile_attn.compiler.debug_dump import DebugDump, PieceRow, SplitSummary
from compile_attn.compiler.piece_compiler import PieceCompiler, inductor_options_for_mode
from compile_attn.compiler.piecewise import PiecewiseGraphWrapper
from compile_attn.compiler.shortcuts import GraphEntry, direct_split_piece, install_piece
from compile_attn.compiler.token_dim import find_token_symbol, token_count_getter
from compile_attn.env import host_shortcuts_enabled
from compile_attn.config import GraphConfig
from compile_attn.errors import CompileAttnError
from compile_attn.passes.fuse_linears import bind_fused_weights, fuse_linears, fused_group_count, guard_fused_weights
from compile_attn.passes.scalars import specialize_tensorified_floats
from compile_attn.passes.split import Piece, split_graph

logger = logging.getLogger(__name__)


def resolve_config(options: Mapping[str, Any] | None) -> GraphConfig:
    """GraphConfig from ``torch.compile`` options: its fields, or ``config=GraphConfig`` plus overrides."""
    options = dict(options or {})
    base = options.pop("config", None)
    if base is None:
        return GraphConfig.from_options(options)
    if not isinstance(base, GraphConfig):
        raise TypeError(f"options['config'] must be a compile_attn GraphConfig, got {type(base).__name__}")
    known = {f.name for f in dataclasses.fields(GraphConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        known_options = sorted(known | {"config"})
        raise ValueError(f"unknown compile_attn option(s) {unknown}; known options: {known_options}")
    return base.replace(**options) if options else base


def _compile_id() -> tuple[str, bool]:
    """(``"frame/compile"`` of the graph being compiled, whether its frame was compiled before)."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None:
        return "direct", False
    return str(compile_id), bool(compile_id.frame_compile_id)


def _piece_inputs(piece: Piece) -> list[Any]:
    """Fake example inputs of a piece, from the metadata Dynamo attached to its placeholders."""
    inputs = []
    for node in piece.graph_module.graph.find_nodes(op="placeholder"):
        if "example_value" not in node.meta:
            raise CompileAttnError(
                f"piece {piece.name}: input {node.name} carries no example value; compile_attn needs graphs "
                f"from Dynamo (torch.compile), not hand-built FX graphs"
            )
        inputs.append(node.meta["example_value"])
    return inputs


def _on_cuda(gm: fx.GraphModule) -> bool:
    return any(
        isinstance(v := n.meta.get("example_value"), torch.Tensor) and v.device.type == "cuda"
        for n in gm.graph.find_nodes(op="placeholder")
    )


def compile_attn_backend(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Any:
    """Dynamo backend: returns ``gm`` split at split ops, pieces compiled, on CUDA wrapped for piecewise graphs (in
    a GraphEntry with the host shortcuts on, which runs it)."""
    config = resolve_config(options)
    shortcuts = host_shortcuts_enabled()
    try:
        compile_counters.floats_specialized += len(specialize_tensorified_floats(gm))
    except Exception:
        compile_counters.float_restarts += 1
        raise
    start = time.perf_counter()
    compile_id, is_recompile = _compile_id()
    compile_counters.graphs_seen += 1
    compile_counters.recompiles += int(is_recompile)
    dump = DebugDump(config.debug_dir, compile_id) if config.debug_dir else None
    if dump is not None:
        dump.write_dynamo_graph(gm)
        dump.expect_bytecode()

    token_symbol = find_token_symbol(gm)
    gm, fused = fuse_linears(gm, example_inputs) if config.fuse_linears else (gm, [])
    compile_counters.linear_groups_fused += fused_group_count(fused)
    split = split_graph(gm)
    bind_fused_weights(split.split_gm, fused)
    compile_counters.pieces_split += len(split.pieces)
    compile_counters.split_op_pieces += len(split.split_op_pieces)
    if dump is not None:
        dump.write_split(split)  # as split: before the pieces are installed in it
    on_cuda = _on_cuda(gm)
    compile_sizes = config.static_compile_sizes(on_cuda)
    if on_cuda and token_symbol is None:
        logger.info(
            "compile_attn: graph %s has static shapes, so its pieces get no piecewise CUDA graphs; compile "
            "with torch.compile(..., dynamic=True) to make the token count dynamic", compile_id
        )
    cache = CompileCache(config.cache_dir) if config.cache_dir and config.compiler == "inductor" else None
    compiler = PieceCompiler(config.compiler, cache, {**inductor_options_for_mode(mode), **config.inductor_config},
                             config.static_inductor_config)

    rows: list[PieceRow] = []
    progress = tqdm(split.pieces, desc="compile_attn: pieces", unit="piece", disable=None, leave=False)
    for piece in progress:
        if piece.is_split_op:
            if shortcuts:  # no Module call, no dispatcher
                runnable_op, redirected = direct_split_piece(piece.graph_module)
                install_piece(split.split_gm, piece.name, runnable_op, shortcuts)
                compile_counters.split_calls_direct += redirected
            rows.append(PieceRow(piece.index, piece.name, "split op (eager)", None, piece.op_labels, False))
            continue
        example = _piece_inputs(piece)
        compiled = compiler.compile(piece, example)
        getter = token_count_getter(example, token_symbol)
        runnable: Any = compiled
        if compile_sizes and getter is not None and token_symbol is not None:
            static = {size: compiler.compile_static(piece, example, token_symbol, size) for size in compile_sizes}
            runnable = SizeDispatch(compiled, static, getter)
        if on_cuda and getter is not None:
            runnable = PiecewiseGraphWrapper(
                runnable, piece.name, getter,
                debug=dump is not None, on_capture=dump.record_capture if dump is not None else None,
            )
        install_piece(split.split_gm, piece.name, runnable, shortcuts)
        kind = f"compiled ({compiled.source})"
        rows.append(PieceRow(piece.index, piece.name, kind, compiler.group_of(piece.name), piece.op_labels,
                             getter is not None))

    if dump is not None:
        dump.write_summary(SplitSummary(compile_id, config.compiler, on_cuda,
                                        None if token_symbol is None else str(token_symbol), rows))
    logger.info(
        "compile_attn: graph %s: %d pieces (%d split-op), %d unique compiled, %.2f s",
        compile_id, len(split.pieces), len(split.split_op_pieces), len(compiler.groups),
        time.perf_counter() - start,
    )
    # GraphEntry: graph runners may record a call and repeat it (shortcuts.DirectCall)
    return guard_fused_weights(GraphEntry(split.split_gm) if shortcuts else split.split_gm, fused)
