"""Build (or load) FlashInfer's JIT kernels up front, one log line per kernel, several at once.

FlashInfer compiles a module per (kernel family, dtypes, head dim, sliding window on/off, softcap
on/off) the first time a plan needs it, tens of seconds per module (docs/performance.md). A
warm-up plans and runs each needed kernel once on a one-token problem (reading only the scratch
page), so the first real step does not stall. Builds of different modules run in parallel threads
(each is an external ninja/nvcc process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from compile_attn.attention.flashinfer.library import FlashInferAPI
from compile_attn.attention.flashinfer.plan_groups import PlanGroup
from compile_attn.attention.flashinfer.wrappers import PlanDTypes

logger = logging.getLogger(__name__)

_WARM_QO_HEADS, _WARM_KV_HEADS = 4, 1


@dataclass(frozen=True)
class KernelSpec:
    """One JIT kernel the backend will call. ``kind``: decode, decode_tc, paged, ragged or merge.

    ``ragged`` reads the step's new K/V, so its ``kv_dtype`` is the query dtype.
    """

    kind: str
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    sliding_window: bool = False
    softcap: bool = False
    prefill_backend: str = "fa2"

    def module_key(self) -> tuple:
        """Specs with equal keys compile the same flashinfer module (tensor-core decode is fa2 prefill)."""
        if self.kind == "merge":
            return ("merge",)
        family = {"decode": "decode", "decode_tc": "prefill-fa2"}.get(self.kind, f"prefill-{self.prefill_backend}")
        return (family, self.q_dtype, self.kv_dtype, self.head_dim, self.sliding_window, self.softcap)

    def describe(self) -> str:
        if self.kind == "merge":
            return "merge_state"
        name = {"decode": "decode", "decode_tc": "decode (tensor cores)"}.get(
            self.kind, f"{self.kind} prefill ({self.prefill_backend})"
        )
        flags = "".join([", window" if self.sliding_window else "", ", softcap" if self.softcap else ""])
        q = str(self.q_dtype).removeprefix("torch.")
        kv = str(self.kv_dtype).removeprefix("torch.")
        return f"{name} q {q} kv {kv} head_dim {self.head_dim}{flags}"


def _unique(specs: Iterable[KernelSpec]) -> list[KernelSpec]:
    seen: dict[KernelSpec, None] = {}
    for spec in specs:
        seen.setdefault(spec, None)
    return list(seen)


def kernel_specs(
    groups: Sequence[PlanGroup],
    tensor_cores: Sequence[bool],
    dtypes: PlanDTypes,
    prefill_backend: str,
    with_merge: bool,
) -> list[KernelSpec]:
    """The kernels a backend with these plan groups calls: decode, paged and ragged prefill per group,
    and merge_state when the cascade extend path is on."""
    specs = []
    for group, tc in zip(groups, tensor_cores):
        flags = dict(head_dim=group.head_dim, sliding_window=group.uses_window, softcap=group.uses_softcap)
        specs.append(KernelSpec("decode_tc" if tc else "decode", q_dtype=dtypes.q, kv_dtype=dtypes.kv, **flags))
        specs.append(KernelSpec("paged", q_dtype=dtypes.q, kv_dtype=dtypes.kv, prefill_backend=prefill_backend, **flags))
        specs.append(KernelSpec("ragged", q_dtype=dtypes.q, kv_dtype=dtypes.q, prefill_backend=prefill_backend, **flags))
    if with_merge:
        specs.append(KernelSpec("merge", head_dim=64, q_dtype=dtypes.q, kv_dtype=dtypes.q))
    return _unique(specs)


def _warm_one(fi: FlashInferAPI, spec: KernelSpec, workspace: torch.Tensor) -> None:
    """Plan and run ``spec``'s kernel once on a one-token problem (builds the module if needed)."""
    device = workspace.device
    hq, hkv, d = _WARM_QO_HEADS, _WARM_KV_HEADS, spec.head_dim
    q = torch.zeros(1, hq, d, dtype=spec.q_dtype, device=device)
    if spec.kind == "merge":
        fi.merge_state_in_place(q.clone(), torch.zeros(1, hq, device=device), q.clone(), torch.zeros(1, hq, device=device))
        return
    pages = tuple(torch.zeros(1, 1, hkv, d, device=device).to(spec.kv_dtype) for _ in range(2))
    one = torch.tensor([0, 1], dtype=torch.int32)
    page_ids = torch.zeros(1, dtype=torch.int32, device=device)
    last = torch.ones(1, dtype=torch.int32)
    common = dict(
        window_left=15 if spec.sliding_window else -1,
        logits_soft_cap=30.0 if spec.softcap else 0.0,
        q_data_type=spec.q_dtype,
        kv_data_type=spec.kv_dtype,
    )
    if spec.kind in ("decode", "decode_tc"):
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=spec.kind == "decode_tc")
        wrapper.plan(one, page_ids, last, hq, hkv, d, 1, **common)
        wrapper.run(q, pages)
        return
    if spec.kind == "paged":
        paged = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=spec.prefill_backend)
        paged.plan(one, one, page_ids, last, hq, hkv, d, 1, causal=True, **common)
        paged.run(q, pages)
        return
    ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=spec.prefill_backend)
    ragged.plan(one, one, hq, hkv, d, causal=True, **common)
    ragged.run(q, pages[0][0], pages[1][0])


def build_kernels(
    fi: FlashInferAPI,
    specs: Sequence[KernelSpec],
    workspace: torch.Tensor,
    max_workers: int = 1,
) -> dict[str, float]:
    """Build/load every kernel in ``specs``; returns seconds per kernel (wall time, builds overlap).

    Specs that compile the same module run one after another in one thread; different modules build
    in up to ``max_workers`` threads. Each kernel logs one line when it is ready.
    """
    tasks: dict[tuple, list[KernelSpec]] = {}
    for spec in _unique(specs):
        tasks.setdefault(spec.module_key(), []).append(spec)
    timings: dict[str, float] = {}
    start = time.perf_counter()

    def run_task(group: list[KernelSpec]) -> list[tuple[str, float]]:
        done = []
        for spec in group:
            t0 = time.perf_counter()
            _warm_one(fi, spec, workspace)
            if workspace.is_cuda:
                torch.cuda.synchronize(workspace.device)
            seconds = time.perf_counter() - t0
            logger.info("flashinfer kernel ready in %.1f s: %s", seconds, spec.describe())
            done.append((spec.describe(), seconds))
        return done

    logger.info("flashinfer warm-up: %d kernels in %d modules (flashinfer %s)", sum(map(len, tasks.values())),
                len(tasks), fi.version)
    with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
        futures = [pool.submit(run_task, group) for group in tasks.values()]
        for future in tqdm(as_completed(futures), total=len(futures), desc="flashinfer JIT", unit="module",
                           disable=None):
            timings.update(future.result())
    logger.info("flashinfer warm-up done in %.1f s", time.perf_counter() - start)
    return timings
