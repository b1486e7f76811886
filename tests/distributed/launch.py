"""Run a function on N local processes that form a gloo tensor-parallel group, for the distributed tests.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes (spawn start method, a free localhost port,
``env://`` initialisation as torchrun does it), calls ``fn(rank, world_size, *args)`` on each, and returns when all
have finished. A rank that raises makes ``run_ranks`` raise ``RankFailedError`` with the traceback of the rank that
failed first (the others then fail in a collective, or are terminated; their last lines follow). A run past
``timeout_s`` is killed and raises TimeoutError. No process outlives the call.

``run_checks(checks, world_size, directory)`` runs several named checks of one world size in a single spawn (the
process start and imports cost more than most checks) and says which passed, which failed and which the failure
left unrun, so each test can report its own check.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

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


Check = tuple[str, Callable[..., None], tuple[Any, ...]]  # (name, fn(rank, world_size, *args), args)


def checks_in_sequence(rank: int, world_size: int, done_path: str, checks: list[Check]) -> None:
    """Each check in turn on every rank; once every rank has passed one, rank 0 appends its name to ``done_path``."""
    for name, fn, args in checks:
        fn(rank, world_size, *args)
        torch.distributed.barrier()
        if rank == 0:
            with open(done_path, "a", encoding="utf-8") as fh:
                fh.write(name + "\n")


@dataclass(frozen=True)
class ChecksOutcome:
    """What one ``run_checks`` run did: the checks in order, those every rank passed, and the run's error."""

    names: list[str]
    passed: list[str]
    error: str | None

    def expect(self, name: str) -> None:
        """Fail the calling test unless check ``name`` passed on every rank, naming the check that failed."""
        assert name in self.names, f"no check named {name!r} in this run: {self.names}"
        if name in self.passed:
            return
        failed = next(n for n in self.names if n not in self.passed)
        if failed == name:
            pytest.fail(f"check {name!r} failed:\n{self.error}", pytrace=False)
        pytest.fail(f"check {name!r} did not run: the run stopped at the earlier check {failed!r}:\n{self.error}",
                    pytrace=False)


def run_checks(checks: list[Check], world_size: int, directory: Path, timeout_s: float = 600.0) -> ChecksOutcome:
    """``checks`` in order on one spawn of ``world_size`` ranks; the run stops at the first check that fails."""
    done = directory / "passed.txt"
    done.unlink(missing_ok=True)
    error = None
    try:
        run_ranks(checks_in_sequence, world_size, str(done), checks, timeout_s=timeout_s)
    except (RankFailedError, TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    passed = done.read_text(encoding="utf-8").splitlines() if done.exists() else []
    names = [name for name, _, _ in checks]
    if error is None and passed != names:
        error = f"the run ended without error but only {passed} of {names} passed"
    return ChecksOutcome(names, passed, error)
