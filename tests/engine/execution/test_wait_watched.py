"""``in_flight.wait_watched``: how rank 0 waits for a step's tokens under tensor parallelism. It returns once the
event completes, calls the watch while it waits (every ``WATCH_PERIOD_S``), and a watch that raises (a dead worker)
ends the wait with that error instead of waiting for ever. The event here is a host-side stand-in with CUDA
events' ``query()``: it completes after a set time."""

from __future__ import annotations

import time

import pytest

from compile_attn.engine.execution import in_flight


class TimedEvent:
    def __init__(self, after_s: float) -> None:
        self.done_at = time.monotonic() + after_s

    def query(self) -> bool:
        return time.monotonic() >= self.done_at


def test_returns_when_the_event_completes_and_watches_meanwhile() -> None:
    calls: list[float] = []
    start = time.monotonic()
    in_flight.wait_watched(TimedEvent(0.22), lambda: calls.append(time.monotonic()))
    waited = time.monotonic() - start
    assert 0.22 <= waited < 0.22 + 0.5
    assert 2 <= len(calls) <= 5  # every 50 ms of the 220 ms (4 on an idle machine)


def test_a_raising_watch_ends_the_wait() -> None:
    class WorkerDied(RuntimeError):
        pass

    def watch() -> None:
        raise WorkerDied("rank 1 died")

    start = time.monotonic()
    with pytest.raises(WorkerDied, match="rank 1 died"):
        in_flight.wait_watched(TimedEvent(3600.0), watch)
    assert time.monotonic() - start < 0.5
