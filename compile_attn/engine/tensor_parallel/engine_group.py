"""Rank 0's side of tensor parallelism: start the workers, send them each step, turn their failures into one error,
stop them.

``EngineGroup.start`` spawns one worker per other rank (``worker.spawned_main``), waits for each to report that it
is joining (checking that it is alive: a worker that fails to start is reported, not waited for), forms the process
group (gloo on the CPU, NCCL on GPUs; every collective bounded by ``COLLECTIVE_TIMEOUT_S``), sends the workers the
``WorkerSpec`` and loads rank 0's shard. With RANK / WORLD_SIZE in the environment (torchrun) it spawns nothing and
joins the group the launcher set up. ``run_step`` broadcasts a step before rank 0 runs it (``StepRunner.peers``);
any failure there ends the group: the workers are stopped and the error names the rank that failed and its
exception (or how it died). ``close`` (``LLM.shutdown``, a weakref finaliser, interpreter exit) is idempotent and
bounded: shutdown message, join, then terminate and kill what is left.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from compile_attn.batch import ForwardBatch
from compile_attn.distributed.state import destroy_tensor_parallel, init_tensor_parallel, tp_group, tp_host_group
from compile_attn.distributed.step_message import StepSender
from compile_attn.engine.execution.model_loading import LoadedModel
from compile_attn.engine.requests.config import EngineConfig
from compile_attn.engine.tensor_parallel.loading import Checkpoint, check_split, load_rank, prepare_checkpoint
from compile_attn.engine.tensor_parallel.worker import (
    COLLECTIVE_TIMEOUT_S,
    WorkerSpec,
    agree_min,
    rank_device,
    release_rank_graphs,
)
from compile_attn.graph_runner.step_kernels import TokenFeed
from compile_attn.kv.cache import KVCache

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a worker's start (imports) until it joins the group
STOP_TIMEOUT_S = 10.0  # a worker's exit after the shutdown message, before it is terminated
JOIN_REPORT_S = 30.0  # how often a start that waits for a worker logs what the worker is doing


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or died; the workers have been stopped and this LLM cannot run steps."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EngineGroup:
    """The workers of one tensor-parallel LLM, seen from rank 0."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.tensor_parallel_size
        self.device = config.device  # rank 0's own device once the group exists (rank_device)
        self.processes: dict[int, Any] = {}  # rank -> multiprocessing.Process (empty under an external launcher)
        self.reports: dict[int, Any] = {}  # rank -> the read end of its report pipe
        self._alive_pipes: list[Any] = []  # write ends the workers watch: closing them ends the workers
        self._joined: set[int] = set()  # ranks that reported they are joining the group
        self.failures: dict[int, str] = {}  # rank -> what it reported or how it died
        self.broken: str | None = None  # why the group can no longer run steps
        self.checkpoint: Checkpoint | None = None
        self.kv_cache: KVCache | None = None
        self.sender: StepSender | None = None
        self.graph_owner = f"tensor-parallel engine {id(self):x}"  # rank 0's graphs, destroyed before the group ends
        self._closed = False

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, model: Any, tokenizer: Any, config: EngineConfig) -> tuple[EngineGroup, LoadedModel]:
        """Start the group and load rank 0's shard; on any failure the workers are stopped and the error raised."""
        group = cls(config)
        try:
            return group, group._start(model, tokenizer, config)
        except BaseException as exc:
            group._collect_failures(wait_s=2.0)
            group.close()
            if group.failures:
                raise TensorParallelError(f"tensor-parallel start failed: {group._describe()}") from exc
            raise

    def _start(self, model: Any, tokenizer: Any, config: EngineConfig) -> LoadedModel:
        backend = "nccl" if config.device.type == "cuda" else "gloo"
        check_split(model, self.size)
        external = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if external:  # torchrun-style: the other ranks run worker.main under the same launcher
            if int(os.environ.get("WORLD_SIZE", "1")) != self.size or int(os.environ.get("RANK", "0")) != 0:
                raise TensorParallelError(
                    f"LLM(tensor_parallel_size={self.size}) under a launcher with RANK={os.environ.get('RANK')} "
                    f"WORLD_SIZE={os.environ.get('WORLD_SIZE')}: LLM runs on rank 0 of a world of that size")
            self.checkpoint = prepare_checkpoint(model, tokenizer, config)
            init_tensor_parallel(backend=backend, timeout_s=COLLECTIVE_TIMEOUT_S)
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            self._spawn(init_method, backend)
            self.checkpoint = prepare_checkpoint(model, tokenizer, config)  # while the workers import
            self._wait_joining()
            init_tensor_parallel(0, self.size, backend=backend, init_method=init_method,
                                 timeout_s=COLLECTIVE_TIMEOUT_S)
        self.device = rank_device(config)
        loaded = load_rank(self.checkpoint.path, 0, self.size, dtype=config.dtype, device=config.device,
                           tokenizer=self.checkpoint.tokenizer)
        max_context = config.max_context or loaded.max_context or 4096
        import torch.distributed as dist

        dist.broadcast_object_list([WorkerSpec(self.checkpoint.path, config, max_context)], src=0, group=tp_group())
        self.sender = StepSender(tp_group(), tp_host_group(), self.device)
        return loaded

    def _spawn(self, init_method: str, backend: str) -> None:
        from compile_attn.engine.tensor_parallel.worker import spawned_main

        ctx = torch.multiprocessing.get_context("spawn")
        for rank in range(1, self.size):
            report_read, report_write = ctx.Pipe(duplex=False)
            alive_read, alive_write = ctx.Pipe(duplex=False)
            process = ctx.Process(target=spawned_main, name=f"compile_attn-tp-rank{rank}",
                                  args=(rank, self.size, init_method, backend, report_write, alive_read))
            process.start()
            report_write.close()
            alive_read.close()
            self.processes[rank], self.reports[rank] = process, report_read
            self._alive_pipes.append(alive_write)
        logger.info("tensor parallel: started %d worker process(es) (%s)", len(self.processes),
                    ", ".join(f"rank {r}: pid {p.pid}" for r, p in self.processes.items()))

    def _wait_joining(self) -> None:
        """Wait until every worker reported that it joins the group; a worker that fails or dies first is
        reported at once."""
        waiting = set(self.processes)
        start = time.monotonic()
        deadline, next_report = start + START_TIMEOUT_S, start + JOIN_REPORT_S
        while waiting:
            now = time.monotonic()
            if now > deadline:
                raise TensorParallelError(
                    f"tensor-parallel rank(s) {sorted(waiting)} did not start within {START_TIMEOUT_S:.0f} s ("
                    + "; ".join(f"rank {r}: {process_state(self.processes[r].pid)}" for r in sorted(waiting)) + ")")
            if now > next_report:  # a long wait says what it waits for
                next_report = now + JOIN_REPORT_S
                for r in sorted(waiting):
                    logger.warning("tensor parallel: rank %d has not joined after %.0f s (%s)", r, now - start,
                                   process_state(self.processes[r].pid))
            handles = [self.reports[r] for r in waiting] + [self.processes[r].sentinel for r in waiting]
            multiprocessing.connection.wait(handles, timeout=1.0)
            for rank in list(waiting):
                self._read_reports(rank)
                if rank in self.failures:
                    raise TensorParallelError(f"tensor-parallel start failed: {self._describe()}")
                if rank in self._joined:
                    waiting.discard(rank)
                elif not self.processes[rank].is_alive():
                    self._note_death(rank)
                    raise TensorParallelError(f"tensor-parallel start failed: {self._describe()}")

    def _read_reports(self, rank: int) -> None:
        conn = self.reports[rank]
        try:
            while conn.poll():
                kind, _, text = conn.recv()
                if kind == "joining":
                    self._joined.add(rank)
                elif kind == "error":
                    self.failures[rank] = text.strip().splitlines()[0] if text.strip() else "failed"
                    logger.error("tensor-parallel rank %d failed:\n%s", rank, text)
        except (EOFError, OSError):
            pass

    def _note_death(self, rank: int) -> None:
        process = self.processes[rank]
        if rank in self.failures or process.is_alive():
            return
        code = process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        self.failures[rank] = f"the worker process (pid {process.pid}) died ({how})"

    def _collect_failures(self, wait_s: float) -> None:
        """Read what the workers reported, waiting up to ``wait_s`` for one that fails to report or die."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank in self.processes:
                self._read_reports(rank)
                self._note_death(rank)
            if self.failures or time.monotonic() >= deadline or not self.processes:
                return
            handles = list(self.reports.values()) + [p.sentinel for p in self.processes.values()]
            multiprocessing.connection.wait(handles, timeout=max(0.05, deadline - time.monotonic()))

    def _describe(self) -> str:
        return "; ".join(f"rank {r}: {text}" for r, text in sorted(self.failures.items()))

    # ------------------------------------------------------------------ steps
    def agree_kv_tokens(self, tokens: int) -> int:
        """The KV capacity every rank allocates: the smallest that any rank sized (same pages everywhere)."""
        agreed = agree_min(tokens, self.device)
        if agreed != tokens:
            logger.info("tensor parallel: KV cache %d tokens (the smallest rank's), not %d", agreed, tokens)
        return agreed

    def attach(self, kv_cache: KVCache) -> None:
        """Mirror ``kv_cache``'s request table on the workers: collect the rows rewritten outside steps."""
        self.kv_cache = kv_cache
        kv_cache.rewritten_rows = set()

    def _rewritten_rows(self) -> list[tuple[int, np.ndarray]]:
        """Each rewritten row still held, with its slots for positions ``0 .. row_len - 1`` (from the pages)."""
        kv = self.kv_cache
        if kv is None or not kv.rewritten_rows:
            return []
        out = []
        offsets = np.arange(kv.page_size, dtype=np.int64)
        for row in sorted(kv.rewritten_rows):
            pages = kv.row_pages(row)
            if pages is not None and len(pages):
                slots = (np.frombuffer(pages, dtype=np.int64)[:, None] * kv.page_size + offsets).ravel()
                out.append((row, slots[:kv.row_len(row)]))
        kv.rewritten_rows.clear()
        return out

    def run_step(self, run: Callable[..., torch.Tensor], fb: ForwardBatch, keep: torch.Tensor | None,
                 feed: TokenFeed | None) -> torch.Tensor:
        """Send the step to the workers, then ``run(fb, keep, feed)`` on rank 0 (the forward's collectives meet
        the workers' there). A failure stops the group and raises TensorParallelError naming the failed rank."""
        if self.broken is not None:
            raise TensorParallelError(f"this LLM's tensor-parallel group has stopped ({self.broken}); create a new LLM")
        assert self.sender is not None
        try:
            self.sender.send(fb, keep, None if feed is None else feed.tokens, self._rewritten_rows())
            return run(fb, keep, feed)
        except BaseException as exc:
            self._collect_failures(wait_s=5.0 if isinstance(exc, Exception) else 0.0)
            failed = self._describe() or f"rank 0: {type(exc).__name__}: {exc}"
            self.broken = failed
            self.close()
            if not isinstance(exc, Exception):
                raise
            raise TensorParallelError(f"tensor-parallel step failed, the workers were stopped: {failed}") from exc

    def check_alive(self) -> None:
        """Raise TensorParallelError (after stopping the group) if a worker died: called while rank 0 waits for a
        step's tokens, since a collective kernel waiting for a dead peer never ends on its own."""
        if all(p.is_alive() for p in self.processes.values()):
            return
        self._collect_failures(wait_s=0.0)
        self.broken = self._describe() or "a worker process ended"
        self.close()
        raise TensorParallelError(f"tensor-parallel rank died while a step ran, the workers were stopped: "
                                  f"{self.broken}")

    def profile(self, directory: str | None) -> None:
        """Start the workers' profilers writing to ``directory`` (None: stop them and write their traces)."""
        if self.broken is not None:
            raise TensorParallelError(f"this LLM's tensor-parallel group has stopped ({self.broken}); create a new LLM")
        assert self.sender is not None
        self.sender.profile(directory)

    # ------------------------------------------------------------------ stop
    def close(self) -> None:
        """Stop every worker (bounded) and leave the process group; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self.broken is None and self.sender is not None:
            try:
                self.sender.shutdown()
            except Exception:  # noqa: BLE001  (a dead worker: terminated below)
                logger.warning("tensor parallel: the shutdown message did not reach every worker")
        deadline = time.monotonic() + (STOP_TIMEOUT_S if self.broken is None else 0.5)
        for process in self.processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for pipe in self._alive_pipes:  # a worker stuck in a collective ends on its own (its parent watch)
            pipe.close()
        for process in self.processes.values():
            process.join(timeout=1.0)
            if process.is_alive():
                process.terminate()
                process.join(timeout=2.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=2.0)
        for conn in self.reports.values():
            conn.close()
        release_rank_graphs(self.graph_owner)
        _destroy_bounded()
        if self.checkpoint is not None:
            self.checkpoint.cleanup()
        logger.info("tensor parallel: %d worker(s) stopped", len(self.processes))


def process_state(pid: int | None) -> str:
    """What process ``pid`` is doing as Linux shows it: its state and, per thread, the kernel function it waits in
    (``/proc/PID/task/*/wchan``); what can be read where /proc cannot."""
    if pid is None:
        return "not started"
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next((line.split(":", 1)[1].strip() for line in f if line.startswith("State:")), "?")
        waits: dict[str, int] = {}
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/wchan") as f:
                where = f.read().strip()
            where = "running" if where in ("", "0") else where
            waits[where] = waits.get(where, 0) + 1
    except OSError:
        return f"pid {pid}"
    threads = ", ".join(f"{n} in {w}" if n > 1 else w for w, n in sorted(waits.items()))
    return f"pid {pid}, state {state}, threads: {threads}"


def _destroy_bounded(timeout_s: float = 10.0) -> None:
    """``destroy_tensor_parallel`` in a thread that is not waited for past ``timeout_s`` (it can hang on a broken
    group)."""
    thread = threading.Thread(target=destroy_tensor_parallel, name="tp-destroy", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("tensor parallel: destroying the process group did not finish in %.0f s", timeout_s)
