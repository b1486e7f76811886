"""Inbox: the commands other threads hand to AsyncLLM's loop thread, and the pipe that wakes that loop when idle.

Any thread may ``post``; only the loop thread reads (``drain_wakeups``, ``get``) and closes. The loop waits on
``wake_fd`` beside its ports' pipes (a consumer in another process is polled by the loop itself: a reader thread
would need the interpreter lock the loop holds). After ``close``, a post still queues its command (the loop's
stop refuses what it finds) but wakes nothing.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any


class Inbox:
    """A thread-safe command queue with a wake-up pipe: one byte per command wakes an idle loop."""

    def __init__(self) -> None:
        self._commands: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()  # the write end is closed under it once the loop ends

    @property
    def wake_fd(self) -> int:
        """The read end of the wake-up pipe: readable once a command was posted (for ``wait``)."""
        return self._wake_r

    def post(self, cmd: tuple) -> None:
        """Queue ``cmd`` and wake the loop if idle (any thread)."""
        self._commands.put(cmd)
        with self._lock:
            if self._wake_w is None:  # the loop has ended
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # the wake pipe is full: the loop has wake-ups enough
                pass

    def drain_wakeups(self) -> None:
        """Empty the wake-up pipe (the loop thread, before it reads the commands)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def get(self) -> Any:
        """The next queued command, or None when there is none (the loop thread)."""
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        """Close the pipe once the loop has ended (the loop thread); later posts only queue."""
        with self._lock:
            os.close(self._wake_w)
            self._wake_w = None
        os.close(self._wake_r)
