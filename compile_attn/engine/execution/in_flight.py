"""A launched engine step whose sampled tokens the host has not read yet, and the device-side feedback of those
tokens into the next step's input ids.

With overlap scheduling the engine launches step N+1 before it reads step N's tokens. Each request that samples in
step N gets a placeholder in its ``token_ids`` at launch: ``-(i + 1)`` where ``i`` is its row in step N's token
tensor. The scheduler counts it like any token, so step N+1 is planned as if the token were known; its input ids
carry the placeholder, and every negative id is replaced with step N's token on the device before the forward runs
(``step_kernels.TokenFeed``: in the copy of a decode step's inputs into the graph's buffers, else ``feed_tokens``).
When the host reads step N's tokens (``InFlightStep.read``, the step's one wait on the device), the engine writes
them over the placeholders and runs the finish checks one step late.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from compile_attn.graph_runner import step_kernels
from compile_attn.engine.requests.request import Request


def placeholder(row: int) -> int:
    """The placeholder token id of row ``row`` of the step in flight (negative: never a real token id)."""
    return -1 - row


@dataclass(eq=False)
class InFlightStep:
    """``requests[i]`` sampled ``tokens[i]`` (a device tensor) in this step, to be written at ``token_ids[at[i]]``
    (where its placeholder is). ``host`` is the asynchronous copy of ``tokens`` that ``ready`` marks complete (on the
    CPU, ``tokens`` itself and no event)."""

    requests: list[Request]
    at: list[int]
    tokens: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None
    logprob_at: list[int]  # positions in ``requests`` of the rows of ``logprobs_host``
    logprobs_host: torch.Tensor | None  # their packed log-probabilities (engine/execution/step_extras.py), copied with tokens
    verify: Any = None  # a verify step's SampleRows (engine/execution/speculative): rows per request, no placeholders
    guided: bool = False  # some row has a grammar: read before the next step is launched (its masks follow these)

    @classmethod
    def launch(cls, requests: list[Request], tokens: torch.Tensor, logprobs: torch.Tensor | None = None,
               logprob_at: list[int] | None = None, verify: Any = None) -> InFlightStep:
        """Start copying ``tokens`` (and ``logprobs``) to the host and put a placeholder at the end of each
        request's ``token_ids``; a verify step's rows (``verify``) get none: it is read before the next step."""
        ready = None
        host, logprobs_host = tokens, logprobs
        if tokens.is_cuda:
            host = _to_pinned(tokens)
            logprobs_host = None if logprobs is None else _to_pinned(logprobs)
            ready = torch.cuda.Event()
            ready.record()
        at = []
        for i, r in enumerate(() if verify is not None else requests):  # hundreds per step: placeholder(i) inlined
            at.append(len(r.token_ids))
            r.token_ids.append(-1 - i)
            r.unresolved += 1
        return cls(requests, at, tokens, host, ready, logprob_at or [], logprobs_host, verify)

    def read(self, watch: Callable[[], None] | None = None) -> list[int]:
        """The sampled tokens on the host; waits for this step's device work (and only for it). ``watch`` (tensor
        parallelism) is called every ``WATCH_PERIOD_S`` of the wait and raises if a peer rank died: a kernel waiting
        for a dead peer would otherwise never end."""
        if self.ready is not None:
            if watch is None:
                self.ready.synchronize()
            else:
                wait_watched(self.ready, watch)
        return self.host.tolist()


WATCH_PERIOD_S = 0.05


def wait_watched(event: torch.cuda.Event, watch: Callable[[], None]) -> None:
    """Wait for ``event`` by polling it, calling ``watch`` every ``WATCH_PERIOD_S``."""
    due = time.monotonic() + WATCH_PERIOD_S
    while not event.query():
        if time.monotonic() >= due:
            watch()
            due = time.monotonic() + WATCH_PERIOD_S
        time.sleep(0)  # lets other threads run between polls


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy of the device tensor ``t`` into fresh pinned host memory."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def has_placeholders(requests: list[Request], prefix_lens: list[int], extend_lens: list[int]) -> bool:
    """Whether some request's tokens for this step include a placeholder (its newest token, not read yet)."""
    for r, p, n in zip(requests, prefix_lens, extend_lens):
        if r.unresolved and p + n > len(r.token_ids) - r.unresolved:
            return True
    return False


def feed_tokens(input_ids: torch.Tensor, tokens: torch.Tensor, vocab_size: int | None) -> None:
    """Replace, in place and on the device, each placeholder ``-(i + 1)`` in ``input_ids`` with ``tokens[i]``,
    clamped into the vocabulary (``step_kernels.feed_tokens``: one kernel where it can)."""
    step_kernels.feed_tokens(input_ids, tokens, vocab_size)
