"""Decode graph sizes for steps whose requests run several tokens each as rows of a decode graph (a verify step's
1 + K tokens, a draft model's catch-up tokens): the default sizes continued past their largest in steps of 8."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from compile_attn.config import GraphConfig


def verify_graph_sizes(options: Mapping[str, Any] | None, rows: int) -> Mapping[str, Any] | None:
    """``options`` with decode graphs up to ``rows`` rows (the default sizes continued in steps of 8) where they
    leave ``decode_batch_sizes`` to its default and verify steps (``rows``: requests x (1 + K)) need more rows."""
    options = dict(options or {})
    default = GraphConfig.decode_batch_sizes
    if "decode_batch_sizes" in options or rows <= default[-1]:
        return options or None
    options["decode_batch_sizes"] = (*default, *range(default[-1] + 8, rows + 8, 8))
    return options
