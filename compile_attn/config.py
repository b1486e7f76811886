"""GraphConfig: the one place where graph and compile options live (mode, capture sizes, compiler, dirs); the
defaults that come from the environment are read by ``env``.

Validated on construction; components read it, never their own copies of the same options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from compile_attn import env
from compile_attn.graph_mode import GraphMode

DEFAULT_DECODE_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, *range(16, 257, 8))
# Extend buckets: 16 ... 1,024, 1,536 and 2,048 tokens. A step of more tokens runs the compiled pieces at its exact
# token count without graphs: past ~2,048 tokens the launches hide behind the GPU's work, while padding to the next
# power of two cost up to 1.6x (4,200 tokens as 8,192: 32.0 vs 19.7 ms on an H100; docs/performance.md).
DEFAULT_EXTEND_TOKEN_SIZES: tuple[int, ...] = (*(2**i for i in range(4, 11)), 1536, 2048)
COMPILERS = ("inductor", "eager")
AUTO_GPU_COMPILE_SIZES: tuple[int, ...] = (1,)  # GraphConfig.compile_sizes=None on a GPU: bs-1 decode


def parse_compile_sizes(text: str) -> tuple[int, ...] | None:
    """A command line's compile sizes: "auto" -> None (the device decides), "" or "none" -> (), "1,4" -> (1, 4)."""
    text = text.strip().lower()
    if text == "auto":
        return None
    if text in ("", "none"):
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"compile sizes must be 'auto', 'none' or comma-separated token counts, got {text!r}") from None


def _check_inductor_options(patches: Mapping[str, Any], field_name: str = "inductor_config") -> None:
    """Unknown keys are an error when the config is made, not in the middle of the first compile."""
    if not patches:
        return
    import torch
    import torch._inductor.config as inductor_config

    unknown = sorted(set(patches) - set(inductor_config.get_config_copy()))
    if unknown:
        raise ValueError(f"GraphConfig.{field_name}: unknown Inductor option(s) {unknown} in torch "
                         f"{torch.__version__}; the names are those of torch._inductor.config, nested ones dotted "
                         f"(e.g. 'combo_kernels', 'triton.max_tiles')")


# Options under an older name: refused with the new one (one name per concept; see docs/graph_runner.md).
_RENAMED_OPTIONS = {"prefill_token_sizes": "extend_token_sizes"}


@dataclass(frozen=True)
class GraphConfig:
    """Options of the compile backend and the graph runner.

    mode: which graphs run (see GraphMode). decode_batch_sizes: the graph runner's decode buckets (requests).
    extend_token_sizes: its extend buckets (tokens). The compile backend reads neither: its piecewise wrappers
    capture the bucket the runner's step names (docs/graph_runner.md). compiler: "inductor" or "eager" for the pieces
    between split ops. cache_dir: persistent compile cache (None disables it). debug_dir: where the
    decompiled code and each piece's graph are written; default ``$COMPILE_ATTN_DEBUG_DIR``, and an explicit
    None means no dump even when that variable is set. verify: after capture,
    replay every bucket once and compare with eager execution. fuse_linears: run linear layers that read
    the same input (q/k/v, gate/up) as one GEMM; their weights become views of one fused tensor
    (see ``compile_attn.passes.fuse_linears``). inductor_config: ``torch._inductor.config`` patches
    for the compiled pieces (e.g. ``{"combo_kernels": True}``), over those of ``torch.compile(mode=...)`` and
    compile_attn's ``inductor_choices_class`` (``compile_attn.compiler.fusion_choices``); unknown names are a
    ValueError.
    skip_guards: once the graph runner has captured, it calls the compiled model with Dynamo's guard
    evaluation off (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``), which saves the guard check
    on every piecewise step. This holds because ``CompiledModel`` compiles one graph for every token
    count and the runner passes only inputs of the kinds seen during capture. Off under ``verify``.
    direct_calls: once a piecewise step of a token-count bucket has run through Dynamo, later steps of that
    bucket call the compiled graph with the same arguments themselves, without Dynamo's frame (its bytecode,
    guards and the Python around the graph: host time before the first piece), when that step ran one graph
    and returned one of its output tensors. This holds under ``skip_guards``'s assumption, and when the model's
    ``forward`` has no Python side effects outside its graph (Dynamo would replay them; a direct call does
    not). Off under ``verify`` and with ``skip_guards`` off. Both are host shortcuts (``graph_runner/shortcuts.py``):
    also off while ``$COMPILE_ATTN_HOST_SHORTCUTS`` is 0 (``env.host_shortcuts_enabled``).
    compile_sizes: token counts at which every piece is compiled once more with static shapes (at one
    token its linear layers become fused matrix-vector reductions); other sizes run the symbolic-shape
    compile. Each size adds one compile per unique piece to a cold start (cached like the others). None
    (default): ``(1,)`` for a model on a GPU (a faster bs-1 decode graph: docs/performance.md), ``()``
    elsewhere. See ``compile_attn.compiler.compile_sizes``.
    static_inductor_config: Inductor config patches for those static compiles only, over ``inductor_config``.
    ``{"triton.enable_pdl": True, "compile_threads": 1}`` (programmatic dependent launches, Hopper and newer)
    is the opt-in for bs-1 decode latency, paid for in cold-start time (docs/performance.md).
    verify_tokens: tokens per request (speculative decoding's 1 + K) of the chain verify steps that get full verify
    graphs of their own, one per decode bucket of requests whose tokens fit, where the attention backend has a
    verify mode (``AttentionBackend.supports_verify_mode``); None: no verify graphs. The engine sets it for chain
    speculation. The compiled pieces see those steps' token counts through the symbolic-shape compile.
    verify_trees: the verify graphs are captured for draft trees (speculative ``topk`` > 1; the engine sets it with
    ``verify_tokens`` = 1 + the tree's draft tokens): each replay reads the step's per-token ancestor masks from a
    static buffer written out of graph, and verify batches of draft trees (``ForwardBatch.draft_parents``) whose
    requests all verify ``verify_tokens`` tokens replay them too (chains as trees of one branch). Where the backend
    cannot verify trees (``AttentionBackend.supports_tree_verify``) no verify graphs are captured.
    """

    mode: GraphMode = GraphMode.FULL_AND_PIECEWISE
    decode_batch_sizes: tuple[int, ...] = DEFAULT_DECODE_BATCH_SIZES
    extend_token_sizes: tuple[int, ...] = DEFAULT_EXTEND_TOKEN_SIZES
    compiler: str = "inductor"
    cache_dir: str | None = field(default_factory=env.cache_dir)
    debug_dir: str | None = field(default_factory=env.debug_dir)
    verify: bool = False
    fuse_linears: bool = True
    inductor_config: dict[str, Any] = field(default_factory=dict, hash=False)
    skip_guards: bool = True
    direct_calls: bool = True
    compile_sizes: tuple[int, ...] | None = None
    static_inductor_config: dict[str, Any] = field(default_factory=dict, hash=False)
    verify_tokens: int | None = None
    verify_trees: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", GraphMode.parse(self.mode))
        for name in ("decode_batch_sizes", "extend_token_sizes", "compile_sizes"):
            value = getattr(self, name)
            if value is None and name == "compile_sizes":  # left to the device (static_compile_sizes)
                continue
            try:
                sizes = tuple(int(s) for s in value)
            except (TypeError, ValueError):
                raise TypeError(f"GraphConfig.{name} must be a sequence of integers, e.g. (1, 2, 4), got {value!r}"
                                ) from None
            if any(s <= 0 for s in sizes):
                raise ValueError(f"GraphConfig.{name} must be positive integers, got {sizes}")
            object.__setattr__(self, name, tuple(sorted(set(sizes))))
        for name in ("inductor_config", "static_inductor_config"):
            patches = getattr(self, name)
            if not isinstance(patches, Mapping):
                raise TypeError(f"GraphConfig.{name} must be a dict of Inductor config patches, "
                                f"got {type(patches).__name__}")
            object.__setattr__(self, name, dict(patches))
            _check_inductor_options(patches, name)
        if self.verify_tokens is not None and (not isinstance(self.verify_tokens, int) or self.verify_tokens < 1):
            raise ValueError(f"GraphConfig.verify_tokens must be a positive integer (speculative decoding's 1 + K) or "
                             f"None, got {self.verify_tokens!r}")
        if self.compiler not in COMPILERS:
            raise ValueError(f"GraphConfig.compiler must be one of {COMPILERS}, got {self.compiler!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> GraphConfig:
        """Build from a ``torch.compile(..., options=...)`` dict; unknown keys are an error listing the known ones."""
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        renamed = {old: new for old, new in _RENAMED_OPTIONS.items() if old in unknown}
        if renamed:
            raise ValueError("compile_attn option(s) renamed: " + ", ".join(f"{o!r} is now {n!r}"
                                                                             for o, n in renamed.items()))
        if unknown:
            raise ValueError(f"unknown compile_attn option(s) {unknown}; known options: {sorted(known)}")
        return cls(**options)

    def static_compile_sizes(self, on_cuda: bool) -> tuple[int, ...]:
        """``compile_sizes``, or where it is None: one token for a graph on a GPU, none on other devices."""
        if self.compile_sizes is not None:
            return self.compile_sizes
        return AUTO_GPU_COMPILE_SIZES if on_cuda else ()

    def replace(self, **changes: Any) -> GraphConfig:
        return dataclasses.replace(self, **changes)
