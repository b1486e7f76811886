"""Run a function on N local processes that form a gloo tensor-parallel group, for the distributed tests.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes (spawn start method, a free localhost port,
``env://`` initialisation as torchrun does it), calls ``fn(rank, world_size, *args)`` on each, and returns when all
have finished. A rank that raises makes ``run_ranks`` raise ``RankFailedError`` with the traceback of the rank that
failed first (the others then fail in a collective, or are terminated; their last lines follow). A run past
``timeout_s`` is killed and raises TimeoutError. No process outlives the call.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from compile_attn.distributed import destroy_tensor_parallel, init_tensor_parallel


class RankFailedError(RuntimeError):
    """A rank raised; the message holds its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # the ranks share a few cores
    init_tensor_parallel(rank, world_size, backend="gloo", timeout_s=60)
    fn(rank, world_size, *args)
    # Only after success: a failing rank keeps its connections until its error is written and it exits, so the
    # ranks that then fail in a collective write their errors after it.
    destroy_tensor_parallel()


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any, timeout_s: float = 150.0) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (``fn`` must be importable: module level)."""
    context = mp.start_processes(_rank_main, args=(fn, world_size, free_port(), args), nprocs=world_size,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.05, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{world_size} ranks of {fn.__name__} did not finish within {timeout_s:.0f} s")
    except mp.ProcessRaisedException as exc:
        raise RankFailedError(_first_failure(context.error_files)) from exc
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        for process in context.processes:
            process.join(10)
        for path in context.error_files:
            if os.path.exists(path):
                os.unlink(path)


def _first_failure(error_files: list[str]) -> str:
    """The traceback of the rank whose error was written first, then one line per rank that failed after it."""
    failures = []
    for rank, path in enumerate(error_files):
        if os.path.exists(path):
            with open(path, "rb") as fh:
                try:
                    trace = str(pickle.load(fh))
                except (EOFError, pickle.UnpicklingError):  # terminated while writing it
                    trace = "(its error was cut off when it was terminated)"
            failures.append((os.stat(path).st_mtime_ns, rank, trace))
    failures.sort()
    _, rank, trace = failures[0]
    later = "".join(f"\nthen rank {r} failed: {t.strip().splitlines()[-1]}" for _, r, t in failures[1:])
    return f"rank {rank} failed first:\n{trace}{later}"
