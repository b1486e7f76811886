"""HF transformers' continuous batching on a throughput workload: the baseline next to the engine's rounds.

One manager (``model.continuous_batching_context_manager``, the machinery under ``generate_batch``) runs the
workload ``rounds`` times, each request with its own ``max_new_tokens`` and EOS disabled, so it generates exactly
the workload's output tokens. Its KV cache takes ``max_memory_percent`` of the memory left free; an out-of-memory
(or any other failure) is reported as a skipped baseline with its reason, not raised.
"""

from __future__ import annotations

import inspect
import logging
import time

import torch

from compile_attn.bench.workloads import Workload

logger = logging.getLogger(__name__)

CPU_PAGE_SIZE = 16


def run(model: torch.nn.Module, workload: Workload, *, rounds: int = 2, max_memory_percent: float | None = 0.8,
        timeout_s: float = 600.0) -> dict:
    """Start-up (the manager's warm-up) and, per round, wall time, generated tokens and tok/s."""
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    result: dict = dict(system="HF generate_batch", max_memory_percent=max_memory_percent, rounds=[])
    start = time.perf_counter()
    try:  # everything HF, its configuration included: the baseline failing must not lose the engine's results
        with _manager(model, workload, max_memory_percent, timeout_s) as manager:
            result["startup_s"] = time.perf_counter() - start
            result["attn_implementation"] = model.config._attn_implementation
            for _ in range(rounds):
                result["rounds"].append(_round(manager, workload, sync, timeout_s))
    except torch.OutOfMemoryError as exc:
        logger.warning("HF generate_batch ran out of memory; its row is skipped: %s", exc)
        result["skipped"] = f"out of memory: {str(exc).splitlines()[0]}"
    except Exception as exc:  # measured after the engine: its results are kept whatever happens here
        logger.exception("HF generate_batch failed; its row is skipped")
        result["skipped"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return result


def _manager(model: torch.nn.Module, workload: Workload, max_memory_percent: float | None, timeout_s: float):
    """The continuous-batching manager for ``workload``, with only the options this transformers version takes
    (``page_size`` was ``block_size`` before; workload hints and warm-up are newer)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    sampled = workload.temperature > 0
    gen = GenerationConfig(do_sample=sampled, temperature=workload.temperature if sampled else None,
                           max_new_tokens=max(workload.output_lens), eos_token_id=-1)  # no top-k / top-p filter
    # on a GPU the cache takes its share of free memory; on the CPU just what the workload needs (HF would size it
    # from the machine's RAM)
    pages = None if model.device.type == "cuda" else sum(
        -(-(len(p) + n) // CPU_PAGE_SIZE) for p, n in zip(workload.prompts, workload.output_lens))
    config_args = inspect.signature(ContinuousBatchingConfig).parameters
    page_arg = "page_size" if "page_size" in config_args else "block_size"
    cb = ContinuousBatchingConfig(max_memory_percent=max_memory_percent, num_blocks=pages,
                                  **{page_arg: CPU_PAGE_SIZE if pages else 256})
    manager_args = inspect.signature(model.continuous_batching_context_manager).parameters
    extra: dict = {}
    if "workload_hints" in manager_args:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        extra["workload_hints"] = WorkloadHints(max_prompt_length=max(map(len, workload.prompts)),
                                                max_generated_length=max(workload.output_lens),
                                                num_requests=workload.num_seqs)
    if "warmup" in manager_args:
        extra["warmup"] = True
    return model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                     block=True, timeout=timeout_s, **extra)


def _round(manager, workload: Workload, sync, timeout_s: float) -> dict:
    sync()
    start = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=o, eos_token_id=-1)
           for p, o in zip(workload.prompts, workload.output_lens)]
    done: dict = {}
    while len(done) < len(ids):
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            done[out.request_id] = out
        elif out is None and not manager.is_running():
            raise RuntimeError(f"HF's generation thread stopped with {len(ids) - len(done)} requests unfinished")
        if time.perf_counter() - start > timeout_s:
            raise RuntimeError(f"HF generate_batch did not finish within {timeout_s:.0f} s")
    sync()
    wall = time.perf_counter() - start
    errors = [o.error for o in done.values() if o.error is not None]
    if errors:
        raise RuntimeError(f"HF generate_batch failed {len(errors)} requests, e.g.: {errors[0]}")
    generated = sum(len(done[i].generated_tokens) for i in ids)
    return dict(wall_s=wall, output_tokens=generated, output_tok_s=generated / wall,
                total_tok_s=(workload.prompt_tokens + generated) / wall)
