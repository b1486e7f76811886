"""A tensor-parallel worker: rank r > 0 holds its shard of the model, its own KV cache and backend, and runs every
step's forward as rank 0 sends it (``distributed/step_message.py``). It never schedules or samples; its logits are
dropped (the LM head's all-gather gives rank 0 the full logits).

Start-up repeats rank 0's collective calls in rank 0's order (``LLM._build``): the KV size agreed with a MIN
all-reduce, then the graph capture, whose warm-up forwards run the model's all-reduces. The worker's request table
mirrors rank 0's: each step's slots are written from the step's own fields, and rows that rank 0 rewrote outside a
step (the prefix cache) come with the step (``StepMessage.table_rows``). Its cache therefore keeps no bookkeeping
and trusts every batch (``MirroredKVCache``): rank 0 checked them against its own.

Started by ``LLM`` (``spawned_main``, spawn start method), or by an external launcher (torchrun sets RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT): ``python -m compile_attn.engine.tensor_parallel.worker`` on every rank but 0.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from compile_attn.batch import ForwardBatch
from compile_attn.compiler.cuda_graph import release_graphs
from compile_attn.distributed.state import destroy_tensor_parallel, init_tensor_parallel, tp_group, tp_host_group
from compile_attn.distributed.step_message import ProfileControl, StepMessage, StepReceiver
from compile_attn.engine.execution.profiling import StepProfiler
from compile_attn.engine.execution.rank_parts import (build_kv_cache, build_step_runner, rank_kv_tokens,
                                                     setup_all_reduce)
from compile_attn.engine.requests.admission import find_vocab_size
from compile_attn.engine.requests.config import EngineConfig
from compile_attn.engine.tensor_parallel.loading import load_rank
from compile_attn.graph_runner.step_kernels import TokenFeed
from compile_attn.host_tensors import repeat_each, to_device
from compile_attn.kv.cache import KVCache

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = float(os.environ.get("COMPILE_ATTN_TP_TIMEOUT_S", "600"))  # bounds every collective


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank builds, sent by rank 0 once the group exists (the one pickled message of a run)."""

    model_dir: str
    config: EngineConfig
    max_context: int


class MirroredKVCache(KVCache):
    """A worker's KV cache: the same pool and request table as rank 0's, written from rank 0's steps. It keeps no
    row bookkeeping of its own, so it trusts every batch: rank 0 checked each against its cache."""

    def issued(self, out_cache_loc: torch.Tensor, rows: list[int], prefix_lens: list[int],
               extend_lens: list[int]) -> bool:
        return True


def agree_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the tensor-parallel ranks (every rank calls it at the same point)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp_group())
    return int(t.item())


def rank_device(config: EngineConfig) -> torch.device:
    """This rank's device: its own GPU (set by ``init_tensor_parallel``), or the CPU."""
    if config.device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return config.device


class Worker:
    """Rank ``rank``'s model shard, KV cache, backend and step runner, built as rank 0 builds its own."""

    def __init__(self, spec: WorkerSpec, rank: int, world_size: int) -> None:
        config = spec.config
        self.device = device = rank_device(config)
        loaded = load_rank(spec.model_dir, rank, world_size, dtype=config.dtype, device=device)
        model = loaded.model
        layers = model.attention_layers()
        self.vocab_size = find_vocab_size(model)
        setup_all_reduce(model, config, device)  # where rank 0 does (LLM._build), before sizing the KV
        tokens = agree_min(rank_kv_tokens(model, layers, config, spec.max_context)[0], device)  # a draft: rank 0 only
        self.kv_cache = build_kv_cache(MirroredKVCache, layers, loaded, config, spec.max_context, tokens, device)
        _, self.step_runner = build_step_runner(model, layers, self.kv_cache, config)
        if config.capture:
            self.step_runner.capture(shared_prefix=False)
        self.receiver = StepReceiver(tp_group(), tp_host_group(), device)
        self.profiler = StepProfiler(rank, device)
        logger.info("tensor parallel rank %d of %d ready: KV cache %d tokens", rank, world_size, tokens)

    def serve(self) -> int:
        """Run rank 0's steps until it sends shutdown; returns the number of steps run."""
        steps = 0
        while (msg := self.receiver.receive()) is not None:
            if isinstance(msg, ProfileControl):
                self.control_profiler(msg)
                continue
            self.run_step(msg)
            steps += 1
        return steps

    def control_profiler(self, msg: ProfileControl) -> None:
        """Start or stop this rank's profiler as rank 0 did (``LLM.start_profile`` / ``stop_profile``)."""
        if msg.directory is not None:
            self.profiler.start(Path(msg.directory))
        else:
            self.profiler.stop()

    def run_step(self, msg: StepMessage) -> None:
        table = self.kv_cache.req_to_token
        for row, slots in msg.table_rows:  # rows rank 0 rewrote outside a step, before the step reads them
            table[row, :len(slots)] = torch.from_numpy(slots).to(self.device, torch.int32)
        fb = ForwardBatch.build(
            req_pool_indices=msg.req_pool_indices, prefix_lens=msg.prefix_lens, extend_lens=msg.extend_lens,
            out_cache_loc=msg.out_cache_loc, input_ids=msg.input_ids, positions=msg.positions,
            forward_mode=msg.forward_mode, device=self.device, table_write_pending=msg.table_write_pending)
        if not fb.table_write_pending and fb.num_tokens:  # rank 0's alloc_extend wrote these slots into its table
            (token_rows,) = to_device([repeat_each(msg.req_pool_indices, msg.extend_lens)], torch.int64, self.device)
            table[token_rows, fb.positions] = fb.out_cache_loc.to(torch.int32)
        keep = None if msg.keep is None else msg.keep.to(self.device)
        feed = None if msg.feed is None else TokenFeed(msg.feed.to(self.device), self.vocab_size)
        self.step_runner.run(fb, keep, feed)


def receive_spec() -> WorkerSpec:
    """Rank 0's ``WorkerSpec`` (``EngineGroup`` sends it right after the group forms)."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=tp_group())
    return box[0]


def _exit_with_parent(alive: Any) -> None:
    """End this process when rank 0's process ends (the pipe ``alive`` then reads EOF), not to outlive it."""

    def watch() -> None:
        try:
            alive.recv()
        except (EOFError, OSError):
            pass
        os._exit(3)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def release_rank_graphs(owner: str | None = None) -> None:
    """Destroy this process's CUDA graphs of ``owner`` (all of them when None) before the process group ends: each
    graph that captured an NCCL collective holds its communicator, and NCCL's abort waits until none does."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    try:
        torch.cuda.synchronize()
    except RuntimeError:  # a device in error: the graphs are destroyed all the same
        logger.warning("tensor parallel: the device did not synchronise before its graphs were released")
    logger.debug("tensor parallel: released %d CUDA graphs", release_graphs(owner))


def _leave_group() -> None:
    """Destroy this worker's CUDA graphs, then end the process group."""
    release_rank_graphs()
    destroy_tensor_parallel()


def spawned_main(rank: int, world_size: int, init_method: str, backend: str, report: Any, alive: Any) -> None:
    """The entry point of a worker that ``LLM`` spawned: report "joining", form the group, build, serve, exit.
    Any failure is reported to rank 0 as ``("error", rank, traceback)`` and ends the process at once (no
    destroy_process_group, which can hang on a broken group)."""
    logging.basicConfig(level=logging.WARNING)
    _exit_with_parent(alive)
    try:
        report.send(("joining", rank, ""))
        init_tensor_parallel(rank, world_size, backend=backend, init_method=init_method,
                             timeout_s=COLLECTIVE_TIMEOUT_S)
        spec = receive_spec()
        if spec.config.device.type == "cpu":  # the ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        Worker(spec, rank, world_size).serve()
    except BaseException as exc:  # noqa: BLE001  (reported to rank 0, then the process ends)
        report.send(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        report.close()
        os._exit(1)
    report.send(("done", rank, ""))
    _leave_group()


def main() -> None:
    """External launch: this process is rank RANK (> 0) of WORLD_SIZE; rank 0 runs ``LLM(...,
    tensor_parallel_size=WORLD_SIZE)`` with the same environment."""
    logging.basicConfig(level=logging.INFO)
    state = init_tensor_parallel(timeout_s=COLLECTIVE_TIMEOUT_S)
    if state.rank == 0:
        raise SystemExit("rank 0 runs LLM(..., tensor_parallel_size=WORLD_SIZE), not the worker entry point")
    steps = Worker(receive_spec(), state.rank, state.world_size).serve()
    logger.info("tensor parallel rank %d: %d steps, shut down", state.rank, steps)
    _leave_group()


if __name__ == "__main__":
    main()
