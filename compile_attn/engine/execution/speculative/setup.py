"""What the engine builds for a speculative config: the draft model of a "draft_model" config (its KV cache is built
once the target's size is known), the decode graphs' rows, which a verify step's tokens fill (requests x (1 + K), a
tree's 1 + num_draft_tokens), and the tokens per request of the runner's verify graphs (chains or trees). It owns no
step logic: proposing, scheduling and accepting drafts are ``speculator.py``'s, ``step_plan.py``'s and
``acceptance.py``'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from compile_attn.config import GraphConfig
from compile_attn.engine.execution.speculative.draft_model import DraftEngineOptions, DraftModelProposer
from compile_attn.engine.execution.speculative.eagle import EagleProposer
from compile_attn.engine.requests.config import EngineConfig


def load_draft(config: EngineConfig, max_context: int, vocab_size: int | None,
               target: Any = None) -> DraftModelProposer | None:
    """The draft model of a "draft_model" speculative config, or the EAGLE head of an "eagle" one over ``target``,
    loaded on the engine's device with the engine's options (its KV cache is built by ``DraftModelProposer.build``
    once the target's size is known); None for other methods and without speculation."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("draft_model", "eagle"):
        return None
    options = DraftEngineOptions(
        device=config.device, dtype=config.dtype, attn_backend=config.attn_backend, page_size=config.page_size,
        graph_mode=config.graph_mode, compile=config.compile, compile_options=config.compile_options,
        max_batch_size=config.max_batch_size, max_num_tokens=config.max_num_tokens, max_context=max_context)
    if spec.method == "eagle":
        return EagleProposer(spec.model, spec.num_speculative_tokens, options, target)
    return DraftModelProposer(spec.model, spec.num_speculative_tokens, options, vocab_size)


def decode_graph_rows(config: EngineConfig) -> tuple[int, Mapping[str, Any] | None]:
    """``(rows, compile_options)`` for the engine's step runner: a verify step that its backend cannot run in a verify
    graph runs each request's tokens as rows of a decode graph, so graphs of up to ``max_batch_size x (1 + K)`` rows,
    rounded up to a decode graph size where one fits ``max_num_tokens`` (``max_batch_size`` without speculation), and the compile options with decode graph sizes that reach them
    (``verify_graph_sizes``) and ``verify_tokens``: the runner's full verify graphs (one per decode bucket up to
    ``max_batch_size`` requests) where the backend has a verify mode. For chains (topk 1) ``1 + K`` tokens per request;
    for trees (topk > 1) ``1 + num_draft_tokens`` (``max_draft_tokens``) and ``verify_trees``: the graphs take each
    step's tree masks, and the decode graphs' rows grow to ``max_batch_size x (1 + num_draft_tokens)`` with them."""
    spec = config.speculative_config
    q = 1 + (spec.max_draft_tokens if spec is not None else 0)
    rows = config.max_batch_size * q
    options = verify_graph_sizes(config.compile_options, rows)
    if spec is not None:  # up to a decode size, so that a full verify step of decode rows has a graph to pad into
        sizes = sorted((options or {}).get("decode_batch_sizes", GraphConfig.decode_batch_sizes))
        rows = next((s for s in sizes if rows <= s <= max(rows, config.max_num_tokens)), rows)
    if spec is not None and "verify_tokens" not in (options or {}):
        options = {**(options or {}), "verify_tokens": q}
        if spec.topk > 1:
            options["verify_trees"] = True
    return rows, options


def verify_graph_sizes(options: Mapping[str, Any] | None, rows: int) -> Mapping[str, Any] | None:
    """``options`` with decode graphs up to ``rows`` rows (the default sizes continued in steps of 8) where they
    leave ``decode_batch_sizes`` to its default and verify steps (``rows``: requests x (1 + K)) need more rows."""
    options = dict(options or {})
    default = GraphConfig.decode_batch_sizes
    if "decode_batch_sizes" in options or rows <= default[-1]:
        return options or None
    options["decode_batch_sizes"] = (*default, *range(default[-1] + 8, rows + 8, 8))
    return options
