"""StepRunner: runs one ForwardBatch through the model (compiled or not) and the GraphRunner, returning
the logits of the rows that are sampled."""

from __future__ import annotations

import logging

import torch

from compile_attn.attention.base import AttentionBackend
from compile_attn.context import forward_context
from compile_attn.graph_runner.mode import GraphMode

logger = logging.getLogger(__name__)


class StepRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        *,
        graph_mode: str | GraphMode,
        compile: bool,
        compile_options: dict | None,
        max_batch_size: int,
        max_num_tokens: int,
    ) -> None:
        self.model, self.backend = model, backend
        self.graph_mode = GraphMode.parse(graph_mode)
        self.forward = model
        self.runner = None

    def capture(self) -> None:
        """Capture the graphs of every bucket (progress bar, timing and memory logged by the runner)."""

    @torch.inference_mode()
    def run(self, fb, keep: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        self.backend.init_forward_metadata(fb)
        with forward_context(fb, self.backend, graph_mode="none"):
            logits = self.forward(fb.input_ids, fb.positions)
        return logits[keep]
