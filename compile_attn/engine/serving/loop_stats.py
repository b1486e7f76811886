"""Counters of the steps an AsyncLLM's loop ran: how many, the seconds spent in them, and how many ran with each
batch size (requests in the step); and where the rest of the loop's time went: handing Deltas out and handling
commands (``other_seconds``, of which ``deliver_seconds`` inside the sinks' deliver), waiting for work with nothing to run (``idle_seconds``). They only grow; two ``snapshot()`` copies subtract to what happened between them (a
benchmark's run), which says the batch size the engine ran at and its mean step time."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepCounts:
    """``by_batch[b]``: steps that ran ``b`` requests; ``seconds``: wall time inside ``LLM.step`` over all
    ``steps``."""

    steps: int = 0
    seconds: float = 0.0
    by_batch: dict[int, int] = field(default_factory=dict)
    other_seconds: float = 0.0  # the loop outside LLM.step: Deltas handed out, commands handled
    idle_seconds: float = 0.0  # the loop waiting for a command with no work
    first_tokens: tuple[float, ...] = ()  # per request: seconds from its admission to its first token handed out
    num_first_tokens: int = 0  # requests ever counted (``first_tokens`` keeps the most recent ones)
    deliver_seconds: float = 0.0  # of other_seconds: in the sinks' deliver (a pipe: pickling, the write, and any
    # wait for its reader to make room)

    def __sub__(self, before: StepCounts) -> StepCounts:
        diff = {b: n - before.by_batch.get(b, 0) for b, n in self.by_batch.items()}
        new_firsts = self.num_first_tokens - before.num_first_tokens
        return StepCounts(steps=self.steps - before.steps, seconds=self.seconds - before.seconds,
                          by_batch={b: n for b, n in diff.items() if n},
                          other_seconds=self.other_seconds - before.other_seconds,
                          idle_seconds=self.idle_seconds - before.idle_seconds,
                          first_tokens=self._newest(new_firsts), num_first_tokens=new_firsts,
                          deliver_seconds=self.deliver_seconds - before.deliver_seconds)

    def _newest(self, k: int) -> tuple[float, ...]:
        return self.first_tokens[len(self.first_tokens) - k:] if k > 0 else ()

    @property
    def mean_batch(self) -> float | None:
        """Requests per step, averaged over the steps (None: no step)."""
        return sum(b * n for b, n in self.by_batch.items()) / self.steps if self.steps else None

    @property
    def median_batch(self) -> int | None:
        """The batch size of the middle step (the lower one of two; None: no step)."""
        if not self.steps:
            return None
        seen = 0
        for b in sorted(self.by_batch):
            seen += self.by_batch[b]
            if 2 * seen >= self.steps:
                return b
        raise AssertionError("by_batch counts fewer steps than steps")  # pragma: no cover

    @property
    def mean_step_ms(self) -> float | None:
        return 1e3 * self.seconds / self.steps if self.steps else None

    def summary(self) -> dict:
        """JSON-ready: steps, mean step ms, mean and median batch size, seconds in steps / elsewhere / idle, and
        the median and mean time from a request's admission by the loop to its first token handed out (the
        engine's part of the time to first token)."""
        firsts = sorted(self.first_tokens)
        return dict(steps=self.steps, mean_step_ms=self.mean_step_ms, mean_batch=self.mean_batch,
                    median_batch=self.median_batch, step_s=self.seconds, other_s=self.other_seconds,
                    idle_s=self.idle_seconds, deliver_s=self.deliver_seconds,
                    engine_ttft_p50_ms=1e3 * firsts[(len(firsts) - 1) // 2] if firsts else None,
                    engine_ttft_mean_ms=1e3 * sum(firsts) / len(firsts) if firsts else None)


MAX_FIRST_TOKENS = 50_000


class LoopStats:
    """Written by the loop thread (``record``), read from any thread (``snapshot``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps = 0
        self._seconds = 0.0
        self._by_batch: Counter[int] = Counter()
        self._other = 0.0
        self._idle = 0.0
        self._first_tokens: list[float] = []  # the most recent MAX_FIRST_TOKENS (at least)
        self._num_first_tokens = 0
        self._deliver = 0.0

    def record(self, batch: int, seconds: float) -> None:
        with self._lock:
            self._steps += 1
            self._seconds += seconds
            self._by_batch[batch] += 1

    def add_other(self, seconds: float) -> None:
        with self._lock:
            self._other += seconds

    def add_deliver(self, seconds: float) -> None:
        with self._lock:
            self._deliver += seconds

    def add_idle(self, seconds: float) -> None:
        with self._lock:
            self._idle += seconds

    def add_first_token(self, seconds: float) -> None:
        with self._lock:
            self._num_first_tokens += 1
            self._first_tokens.append(seconds)
            if len(self._first_tokens) > 2 * MAX_FIRST_TOKENS:  # a long-running server keeps the recent ones
                del self._first_tokens[:MAX_FIRST_TOKENS]

    def snapshot(self) -> StepCounts:
        with self._lock:
            return StepCounts(steps=self._steps, seconds=self._seconds, by_batch=dict(self._by_batch),
                              other_seconds=self._other, idle_seconds=self._idle,
                              first_tokens=tuple(self._first_tokens), num_first_tokens=self._num_first_tokens,
                              deliver_seconds=self._deliver)
