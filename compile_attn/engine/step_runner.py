"""StepRunner: runs one ForwardBatch through the (optionally compiled) model via the GraphRunner and returns
the logits of the rows that are sampled. It owns the compile and graph options of the engine."""

from __future__ import annotations

import logging
from typing import Any

import torch

from compile_attn.attention.base import AttentionBackend
from compile_attn.batch import ForwardBatch
from compile_attn.config import GraphConfig
from compile_attn.graph_runner.mode import GraphMode
from compile_attn.graph_runner.runner import GraphRunner

logger = logging.getLogger(__name__)


class StepRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        *,
        graph_mode: str | GraphMode,
        compile: bool,
        compile_options: dict[str, Any] | None,
        max_batch_size: int,
        max_num_tokens: int,
    ) -> None:
        """``compile_options`` are GraphConfig fields (compiler, capture sizes, cache_dir, debug_dir, verify);
        the same config drives the compile backend and the graph runner so their buckets agree."""
        self.config = GraphConfig.from_options({**(compile_options or {}), "mode": graph_mode})
        self.graph_mode = self.config.mode
        if compile:
            from compile_attn.compiler.compiled_model import compile_model

            options = {k: getattr(self.config, k) for k in (compile_options or {})}
            self.forward = compile_model(model, {**options, "mode": self.config.mode.value})
        else:
            self.forward = model
        self.runner = GraphRunner(
            self.forward, backend, self.config, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens
        )

    def capture(self) -> None:
        """Capture every bucket's graph (progress bar; time and memory logged by the runner)."""
        self.runner.capture()

    @torch.inference_mode()
    def run(self, fb: ForwardBatch, keep: torch.Tensor) -> torch.Tensor:
        """Logits of the rows ``keep`` of this step (copied out of graph memory)."""
        return self.runner.run(fb)[keep]
