"""StepRunner: runs one ForwardBatch through the (optionally compiled) model via the GraphRunner and returns
the logits of the rows that are sampled. It owns the compile and graph options of the engine.

Models that split ``hidden_states`` from ``compute_logits`` (HFModelAdapter, ToyDecoder) are captured and
compiled without their LM head: graphs hold ``[T, hidden]`` outputs, and the head runs eagerly on the
sampled rows only (a prefill of 8k tokens would otherwise compute and store 8k x vocab logits).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import accumulate
from typing import Any

import torch

from compile_attn.attention.base import AttentionBackend
from compile_attn.batch import ForwardBatch
from compile_attn.compiler.compiled_model import compile_model
from compile_attn.config import GraphConfig
from compile_attn.graph_mode import GraphMode
from compile_attn.graph_runner import GraphRunner
from compile_attn.host_tensors import to_device
from compile_attn.graph_runner.step_kernels import TokenFeed

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
        """``compile_options`` are GraphConfig fields (compiler, capture sizes, cache_dir, debug_dir, verify); one
        config drives the graph runner (mode, buckets) and the compile backend (the rest: it captures the buckets
        the runner's steps name)."""
        self.config = GraphConfig.from_options({**(compile_options or {}), "mode": graph_mode})
        self.graph_mode = self.config.mode
        self.compute_logits = getattr(model, "compute_logits", None)
        body = _HiddenStates(model) if self.compute_logits is not None else model
        if compile:
            self.forward = compile_model(body, {k: getattr(self.config, k) for k in (compile_options or {})})
        else:
            self.forward = body
        self.runner = GraphRunner(
            self.forward, backend, self.config, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens
        )
        # Tensor parallelism (rank 0): the workers' group, which sends each step to the other ranks before it runs
        # here (engine/tensor_parallel/engine_group.py: ``run_step``); None in one process.
        self.peers: Any = None
        # Called with (batch, output [T, hidden]) after every step of a model whose LM head is split off, before
        # the head runs: a proposer reading the target's hidden states (EAGLE) sets it. The output may be graph
        # memory, overwritten by the next step: copy what is kept.
        self.on_hidden: Callable[[ForwardBatch, torch.Tensor], None] | None = None

    def capture(self, shared_prefix: bool = False) -> None:
        """Capture every bucket's graph (progress bar; time and memory logged by the runner), then warm up every
        other step path through ``run``, the LM head on the sampled rows included, with ``shared_prefix`` also
        decode batches with shared-prefix groups (``GraphRunner.warm_up``)."""
        self.runner.capture(warm_up=False)
        self.runner.warm_up(run=self._warm_up_step, shared_prefix=shared_prefix)

    def _warm_up_step(self, fb: ForwardBatch) -> torch.Tensor:
        """``run`` as the engine calls it: every row of a decode step, else each request's last token."""
        if fb.forward_mode.is_decode():
            return self._run(fb, None)
        ends = list(accumulate(fb.extend_seq_lens_cpu))
        return self._run(fb, to_device([[e - 1 for e in ends]], torch.int64, fb.input_ids.device)[0])

    @torch.inference_mode()
    def run(self, fb: ForwardBatch, keep: torch.Tensor | None, feed: TokenFeed | None = None) -> torch.Tensor:
        """Logits of the rows ``keep`` of this step (None: every token's row), copied out of graph memory.
        ``feed``: what the placeholders among the input ids stand for (``GraphRunner.run``). With tensor parallelism
        the other ranks get the step first (``peers``); start-up's warm-up steps run on every rank by themselves."""
        if self.peers is not None:
            return self.peers.run_step(self._run, fb, keep, feed)
        return self._run(fb, keep, feed)

    @torch.inference_mode()
    def _run(self, fb: ForwardBatch, keep: torch.Tensor | None, feed: TokenFeed | None = None) -> torch.Tensor:
        out = self.runner.run(fb, feed)
        if self.on_hidden is not None and self.compute_logits is not None:
            self.on_hidden(fb, out)
        if keep is not None:
            rows = out[keep]
        else:  # decode: every row is sampled, no gather (the LM head's output is fresh memory already)
            rows = out if self.compute_logits is not None else out.clone()
        return self.compute_logits(rows) if self.compute_logits is not None else rows


class _HiddenStates(torch.nn.Module):
    """The model without its LM head, seen through the model protocol."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.hidden_states(input_ids, positions)

    def attention_layers(self) -> list:
        return self.model.attention_layers()
