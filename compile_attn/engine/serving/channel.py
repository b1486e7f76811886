"""A message channel between the engine's process and one consumer process: a ZeroMQ PAIR socket over IPC for
whole pickled messages, and a lifeline that tells either side when the other is gone.

ZeroMQ frames every message and queues it in its own I/O thread, so a send never blocks, never fails because the
reader is slow, and never leaves half a message behind (the failure modes of a raw pipe written from an event
loop). ZeroMQ says nothing of a peer that died, so a socket pair that nothing is written to goes beside it: it
becomes readable (end of file) when the other side's end closes, on purpose or because its process ended.

The socket lives in a fresh private directory (mode 0700), so only this user's processes can connect; messages are
pickled and must only ever come from the engine's own consumer processes.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq

_COPY_BELOW = 64 * 1024  # smaller messages are copied into ZeroMQ (cheaper than tracking a zero-copy buffer)


class Channel:
    """One end: ``send`` / ``send_bytes`` (never block), ``receive`` (every whole message that arrived), the socket's
    file descriptor to wait on (``fileno``; edge-triggered: call ``readable`` before waiting), and
    ``peer_alive``."""

    def __init__(self, endpoint: str, lifeline: Connection, *, bind: bool, owned_dir: str | None = None) -> None:
        self._ctx = zmq.Context(io_threads=1)
        sock = self._ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # no high-water mark: the bridge bounds what is in flight itself
        sock.setsockopt(zmq.RCVHWM, 0)
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
        self._sock, self._lifeline, self._owned_dir = sock, lifeline, owned_dir
        self._fd = sock.getsockopt(zmq.FD)
        self.closed = False

    def fileno(self) -> int:
        """The socket's descriptor for select/poll: readable when its events may have changed (then call
        ``receive``); a send or receive can consume that signal, so check ``readable()`` before waiting."""
        return self._fd

    def lifeline_fileno(self) -> int:
        return self._lifeline.fileno()

    def waitables(self) -> list:
        """What to wait on (``multiprocessing.connection.wait``): the socket and the lifeline."""
        return [self._fd, self._lifeline]

    def readable(self) -> bool:
        """Whether a whole message is waiting now."""
        return not self.closed and bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def send(self, msg: Any) -> bool:
        """Send ``msg`` pickled; False if no peer is connected yet (nothing was sent)."""
        return self.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, data: bytes) -> bool:
        """Send ``data`` as one message; False if it was not sent (no peer connected yet, or this end closed)."""
        if self.closed:
            return False
        try:
            self._sock.send(data, zmq.NOBLOCK, copy=len(data) < _COPY_BELOW)
            return True
        except zmq.ZMQError:  # zmq.Again: no peer yet
            return False

    def receive(self) -> list:
        """Every whole message waiting now, unpickled, in order."""
        out: list = []
        while not self.closed:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(pickle.loads(data))
        return out

    def peer_alive(self) -> bool:
        """False once the other side's lifeline end closed (nothing is ever written to it: readable means
        end of file) or this side was closed."""
        if self.closed:
            return False
        try:
            return not self._lifeline.poll()
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._sock.close(linger=0)
        self._ctx.term()
        self._lifeline.close()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)


@dataclass
class ChannelAddress:
    """What the consumer's process needs to connect (pickles into a spawned process's arguments; the lifeline end
    travels as a handle). ``gauges``: the engine's gauges at the start, so the consumer knows them before any
    message."""

    endpoint: str
    lifeline: Connection
    gauges: dict[str, float] = field(default_factory=dict)

    def connect(self) -> Channel:
        return Channel(self.endpoint, self.lifeline, bind=False)


def open_channel(*, gauges: dict[str, float] | None = None) -> tuple[Channel, ChannelAddress]:
    """The engine's end (bound) and the address the consumer connects with. Once the consumer's process has
    started, close ``address.lifeline`` in this process, else the lifeline cannot tell
    this side when that process dies."""
    folder = tempfile.mkdtemp(prefix="compile-attn-")  # mode 0700: this user's processes only
    endpoint = f"ipc://{os.path.join(folder, 'engine')}"
    ours, theirs = multiprocessing.get_context("spawn").Pipe()  # a socket pair: either end closing is seen
    return Channel(endpoint, ours, bind=True, owned_dir=folder), ChannelAddress(endpoint, theirs, dict(gauges or {}))
