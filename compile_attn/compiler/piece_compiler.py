"""Compile the pieces of one split graph: Inductor (default) or eager, identical pieces once, disk cache.

Pieces are compiled with the token count symbolic (the graph's own dynamic dimension), so one
compiled piece serves every token count; ``compile_static`` adds a static-shape compile at one token count
(``GraphConfig.compile_sizes``). A piece whose structural key was seen before in the same
graph reuses that compiled code; a unique piece is loaded from the persistent cache when present,
else compiled with ``torch._inductor.standalone_compile`` and saved. Inductor scores fusions with
``fusion_choices.UnbackedFusionChoices`` (buffers over the unbacked token count have a size).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch import fx

from compile_attn.compiler.cache import CompileCache, environment_fingerprint
from compile_attn.compiler.compile_sizes import STATIC_PATCHES, linears_as_reductions, static_example_inputs
from compile_attn.compiler.counters import compile_counters
from compile_attn.compiler.fusion_choices import FUSION_PATCHES, choices_handler
from compile_attn.compiler.piece_key import PieceKey, piece_key
from compile_attn.env import gemv_kernel
from compile_attn.passes.split import Piece

logger = logging.getLogger(__name__)


def _with_tuple_output(gm: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
    """``gm`` returning a tuple (as compiled and loaded artifacts do), and whether it returned one value."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return gm, False
    graph = fx.Graph()
    value = graph.graph_copy(gm.graph, {})
    graph.output((value,))
    return fx.GraphModule(gm, graph), True


class CompiledPiece:
    """Calls compiled code with a piece's inputs and returns what the original piece returned."""

    def __init__(self, fn: Callable[..., Any], single_output: bool, source: str) -> None:
        self.fn = fn
        self.single_output = single_output
        self.source = source  # "inductor", "cache", "eager"

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        return out[0] if self.single_output else out


def inductor_options_for_mode(mode: str | None) -> dict[str, Any]:
    """Inductor config patches of a ``torch.compile(mode=...)``, minus Inductor's own CUDA graphs."""
    if mode in (None, "default"):
        return {}
    options = dict(torch._inductor.list_mode_options(mode))
    if options.pop("triton.cudagraphs", False):
        logger.info("compile_attn: mode=%r: Inductor's CUDA graphs are replaced by piecewise graphs", mode)
    return options


class PieceCompiler:
    """Compiles the non-split pieces of one Dynamo graph; keeps the map of identical pieces."""

    def __init__(self, compiler: str, cache: CompileCache | None, config_patches: dict[str, Any],
                 static_patches: dict[str, Any] | None = None) -> None:
        self.compiler = compiler
        self.cache = cache
        self.config_patches = {**FUSION_PATCHES, **config_patches}  # the caller's patches win
        # the static compiles: those, then STATIC_PATCHES, then the caller's patches for static compiles
        self.static_patches = {**self.config_patches, **STATIC_PATCHES, **(static_patches or {})}
        self.groups: dict[str, list[str]] = {}  # structural digest -> names of the pieces sharing it
        self._compiled: dict[str, CompiledPiece] = {}
        self._keys: dict[str, PieceKey] = {}  # piece name -> its key

    def group_of(self, piece_name: str) -> int | None:
        """Index (in order of first appearance) of the group of identical pieces holding ``piece_name``."""
        for i, names in enumerate(self.groups.values()):
            if piece_name in names:
                return i
        return None

    def compile(self, piece: Piece, example_inputs: Sequence[Any]) -> CompiledPiece:
        if self.compiler == "eager":
            return CompiledPiece(piece.graph_module, single_output=False, source="eager")
        key = self._key_of(piece, example_inputs)
        self.groups.setdefault(key.digest, []).append(piece.name)
        if key.digest in self._compiled:
            compile_counters.pieces_reused += 1
            return self._compiled[key.digest]
        compiled = self._load_or_compile(
            piece.graph_module, key, example_inputs, self.config_patches,
            lambda gm: self._inductor_compile(piece.name, gm, example_inputs, "from_tracing_context",
                                              self.config_patches),
        )
        if compiled.source == "inductor":
            compile_counters.pieces_compiled += 1
        self._compiled[key.digest] = compiled
        return compiled

    def compile_static(
        self, piece: Piece, example_inputs: Sequence[Any], symbol: sympy.Symbol, size: int
    ) -> CompiledPiece:
        """``piece`` compiled for ``symbol = size`` with static shapes, its one-row linears as reductions
        (``linears_as_reductions``) with ``static_patches``; identical pieces share it. Only valid for calls at
        exactly that token count."""
        if self.compiler == "eager":
            return CompiledPiece(piece.graph_module, single_output=False, source="eager")
        base = self._key_of(piece, example_inputs)
        use_gemv = gemv_kernel()
        rewrite = "gemv" if use_gemv else "reductions"
        # the digest names the rewrite, so artifacts compiled before it existed are not loaded for it
        key = PieceKey(f"{base.digest}@{size}+linears_as_{rewrite}", base.stable,
                       f"{base.text}\nstatic token count {size}, one-row linears as {rewrite}")
        if key.digest in self._compiled:
            return self._compiled[key.digest]
        gm, rewritten = linears_as_reductions(piece.graph_module, symbol, size, use_gemv=use_gemv)
        compile_counters.linears_as_reductions += rewritten
        patches = self.static_patches
        compiled = self._load_or_compile(
            gm, key, example_inputs, patches,
            lambda g: self._inductor_compile(f"{piece.name}@{size}", g,
                                             static_example_inputs(example_inputs, symbol, size),
                                             "from_example_inputs", patches),
        )
        if compiled.source == "inductor":
            compile_counters.pieces_compiled_static += 1
        self._compiled[key.digest] = compiled
        return compiled

    def _key_of(self, piece: Piece, example_inputs: Sequence[Any]) -> PieceKey:
        """The piece's structural key, hashed once (``compile_static`` asks again for every compile size)."""
        key = self._keys.get(piece.name)
        if key is None:
            key = self._keys[piece.name] = piece_key(piece.graph_module, list(example_inputs))
        return key

    def _load_or_compile(
        self, gm: fx.GraphModule, key: PieceKey, example_inputs: Sequence[Any], patches: dict[str, Any],
        compile_fn: Callable[[fx.GraphModule], Any],
    ) -> CompiledPiece:
        """From the persistent cache when it holds ``key`` under these patches, else ``compile_fn`` (then saved)."""
        gm, single = _with_tuple_output(gm)
        entry = None
        if self.cache is not None:
            devices = [x.device for x in example_inputs if isinstance(x, torch.Tensor)]
            entry = self.cache.entry_key(key, environment_fingerprint(devices, patches))
        artifact = self.cache.load(entry) if entry is not None and self.cache is not None else None
        if artifact is not None:
            compile_counters.cache_hits += 1
            return CompiledPiece(artifact, single, source="cache")
        if entry is not None:
            compile_counters.cache_misses += 1
        artifact = compile_fn(gm)
        if entry is not None and self.cache is not None:
            if self.cache.save(entry, artifact):
                compile_counters.cache_saves += 1
            else:
                compile_counters.cache_unsaved += 1
        return CompiledPiece(artifact, single, source="inductor")

    def _inductor_compile(self, name: str, gm: fx.GraphModule, example_inputs: Sequence[Any], dynamic_shapes: str,
                          patches: dict[str, Any]) -> Any:
        from torch._inductor import standalone_compile

        start = time.perf_counter()
        with choices_handler(patches):
            artifact = standalone_compile(
                gm,
                list(example_inputs),
                dynamic_shapes=dynamic_shapes,
                options={"config_patches": dict(patches)},
            )
        logger.debug("compile_attn: Inductor compiled %s in %.2f s", name, time.perf_counter() - start)
        return artifact
