"""``GraphMode`` under its former import path; it lives in ``compile_attn.graph_mode`` (the lowest layer), so the
config, the attention backends, the compile backend and the graph runner all use the one enum."""

from compile_attn.graph_mode import GraphMode

__all__ = ["GraphMode"]
