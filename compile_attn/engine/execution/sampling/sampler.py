"""Batched token sampling on the device without sorting the vocabulary: greedy, temperature, top-k, top-p,
min_p, per-request seeds, no host sync when the caller passes a ``SamplingPlan``.

Rows without top-k / top-p (greedy and min_p rows included) take one fused Gumbel-max pass over the
logits. Rows with top-k / top-p take FlashInfer's rejection sampling when FlashInfer is installed and
none of them has an explicit seed or min_p; otherwise ``torch.topk`` of the batch's largest k and the
candidates' softmax, or, for a row with top-p and no top-k, a full-vocabulary sort (correct, slower).
Seeded randomness is a counter hash of (seed, position, token id), so a seeded request samples the same
tokens whatever else is in its batch. ``warmup`` builds every kernel a configuration can reach.
"""

from __future__ import annotations

import logging

import torch

from compile_attn.engine.execution.sampling import flashinfer_sampling
from compile_attn.engine.execution.sampling.noise import hashed_uniform
from compile_attn.engine.execution.sampling.plan import SamplingPlan
from compile_attn.engine.execution.sampling import portable
from compile_attn import env
from compile_attn.engine.execution.sampling.portable import compile_default, run_candidates, run_plain

__all__ = ["BACKENDS", "SamplingPlan", "hashed_uniform", "sample", "warmup"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "portable", "flashinfer")
_warmed_compiled: set[torch.device] = set()  # devices whose compiled graphs ``warmup`` has built


def _use_flashinfer(plan: SamplingPlan, device: torch.device, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"sampler backend must be one of {BACKENDS}, got {backend!r}")
    if not plan.filtered_rows or backend == "portable":
        return False
    if backend == "flashinfer":
        if not flashinfer_sampling.available(device):
            raise ValueError(f"backend='flashinfer' needs FlashInfer installed and CUDA logits (got {device}); "
                             "use backend='auto' or 'portable'")
        if not plan.flashinfer_eligible:
            raise ValueError("backend='flashinfer' cannot serve rows with an explicit seed or min_p (FlashInfer "
                             "draws one random stream per call and has no min_p with top-k/top-p); use 'auto'")
        return True
    # 'auto': FlashInfer's rejection sampling only where the portable path would sort the whole vocabulary (top-p
    # without top-k); over top-k candidates the portable kernels measured faster (benchmarks/bench_sampler.py).
    return plan.top_p_without_top_k and plan.flashinfer_eligible and flashinfer_sampling.available(device)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    *,
    min_p: torch.Tensor | None = None,
    plan: SamplingPlan | None = None,
    backend: str = "auto",
    compiled: bool | None = None,
) -> torch.Tensor:
    """int64 next token per row of ``logits[N, V]``. Per-row parameters are device tensors of length N:
    ``temperature`` (0 = greedy), ``top_k`` (int, 0 = off), ``top_p`` (1 = off), ``min_p`` (0 = off); None
    means off for every row. ``seeds`` / ``positions`` (int64) key the counter-hash noise (None: fresh random
    seeds, position 0). ``plan`` tells which filters the batch uses (build it on the host with
    ``SamplingPlan.for_rows``); without one, it is read from the tensors with one host sync, and every row
    counts as seeded when ``seeds`` is given. The plan is trusted: a filter it says no row uses is not
    applied. ``backend``: 'auto' (FlashInfer for unseeded top-p-without-top-k rows where installed), 'portable' or
    'flashinfer'. ``compiled``: run the portable kernels through ``torch.compile``; by default only once
    ``warmup`` has compiled them for this device (so traffic never compiles), unless
    ``COMPILE_ATTN_SAMPLER_COMPILE`` is set to 1 or 0. Compiled graphs are keyed on the inputs' kind as well as their shapes:
    ``warmup`` builds them for inference-mode logits (the engine's forward output) and parameter tensors
    made, like this call, outside inference mode (the engine's uploads)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    device = logits.device
    if temperature.shape != (rows,):
        raise ValueError(f"temperature must have shape ({rows},) for {rows} logit rows, got {tuple(temperature.shape)}")
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if plan is None:
        plan = SamplingPlan.from_tensors(temperature, top_k, top_p, min_p, seeded=seeds is not None)
    if seeds is None:
        seeds = torch.randint(0, 2**31 - 1, (rows,), device=device)
    if positions is None:
        positions = torch.zeros(rows, dtype=torch.int64, device=device)
    if compiled is None:
        switch = env.sampler_compile()
        compiled = switch if switch is not None else device in _warmed_compiled
    top_k = top_k if plan.max_top_k > 0 else None
    top_p = top_p if plan.top_p_rows else None
    min_p = min_p if plan.min_p_rows else None

    tokens = run_plain(logits, temperature, seeds, positions, min_p, compiled) if plan.plain_rows else None
    if not plan.filtered_rows:
        return tokens  # type: ignore[return-value]
    if _use_flashinfer(plan, device, backend):
        filtered = flashinfer_sampling.filtered_tokens(logits, temperature, top_k, top_p)
    else:
        candidates = vocab if plan.top_p_without_top_k else plan.max_top_k
        filtered = run_candidates(logits, candidates, temperature, top_k, top_p, min_p, seeds, positions, compiled)
    if tokens is None:
        return filtered
    is_filtered = (top_k > 0) if top_k is not None else torch.zeros_like(temperature, dtype=torch.bool)
    if top_p is not None:
        is_filtered = is_filtered | (top_p < 1.0)
    return torch.where(is_filtered & (temperature > 0), filtered, tokens)


def warmup(
    device: torch.device | str,
    vocab_size: int,
    max_rows: int,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
    compiled: bool | None = None,
) -> int:
    """Build every kernel ``sample`` can reach for ``[rows <= max_rows, vocab_size]`` logits of ``dtype``:
    the compiled portable graphs (one row, any row count below and from ``portable.WIDE_ROWS``; plain, min_p,
    candidates) and FlashInfer's
    JIT modules where they would be used. Call it at start-up so that no traffic compiles; ``sample`` runs
    the compiled graphs on this device from then on (eagerly before). ``compiled`` defaults to
    ``portable.compile_default``. Returns the number of ``sample`` calls made."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    compiled = compile_default(device) if compiled is None else compiled
    if vocab_size < 1 or max_rows < 1:
        raise ValueError(f"warmup needs vocab_size >= 1 and max_rows >= 1, got {vocab_size} and {max_rows}")
    calls = 0
    gen = torch.Generator(device="cpu").manual_seed(0)
    for rows in sorted({1, min(2, max_rows), min(portable.WIDE_ROWS, max_rows), max_rows}):
        with torch.inference_mode():  # the logits of an inference-mode forward, as in the engine
            logits = torch.randn(rows, vocab_size, generator=gen).to(device=device, dtype=dtype)
        temps = [0.0] + [0.7] * (rows - 1) if rows > 1 else [0.7]
        t = torch.tensor(temps, device=device)
        seeds = torch.arange(rows, device=device)
        positions = torch.zeros(rows, dtype=torch.int64, device=device)
        variants: list[tuple[list[int], list[float], list[float], bool]] = [
            ([0] * rows, [1.0] * rows, [0.0] * rows, True),  # plain
            ([0] * rows, [1.0] * rows, [0.1] * rows, True),  # plain with min_p
            ([2] * rows, [0.9] * rows, [0.1] * rows, True),  # candidates: top-k, top-p, min_p
        ]
        if backend != "portable" and flashinfer_sampling.available(device):
            variants += [([2] * rows, [1.0] * rows, [0.0] * rows, False),  # FlashInfer top-k
                         ([0] * rows, [0.9] * rows, [0.0] * rows, False),  # FlashInfer top-p
                         ([2] * rows, [0.9] * rows, [0.0] * rows, False)]  # FlashInfer top-k + top-p
        for k, p, m, seeded in variants:
            plan = SamplingPlan.for_rows(temps, k, p, m, seeded)
            sample(logits, t, torch.tensor(k, device=device), torch.tensor(p, device=device), seeds, positions,
                   min_p=torch.tensor(m, device=device), plan=plan, backend=backend, compiled=compiled)
            calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if compiled:
        _warmed_compiled.add(device)
    logger.info("sampler warm-up: %d calls over rows 1..%d x vocab %d (%s)", calls, max_rows, vocab_size, dtype)
    return calls
