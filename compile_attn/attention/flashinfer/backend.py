"""flashinfer: attention through FlashInfer's plan/run wrappers; decode can be captured as a full CUDA graph.

``init_forward_metadata_out_graph`` builds the page CSR and calls ``plan()`` once per plan group
(layers sharing heads, window, softcap, scale) — host work, never inside a graph or compiled code; for a
graph bucket the page ids are gathered by ``init_forward_metadata_in_graph`` (one launch, in the graph).
Decode runs the batch-decode wrappers (per bucket with ``use_cuda_graph=True`` over static buffers when
the batch is a graph runner's view). Extend/mixed batches run ragged attention over the new K/V when
no request has a cached prefix, otherwise paged attention over the pool, or (``extend_prefix_path=
"cascade"``) ragged over the new tokens merged with paged over the prefix by FlashInfer's base-2 LSE.
An eager decode batch that carries shared-prefix groups (``fb.shared_prefix``, set by whoever builds it) runs
FlashInfer's two-level cascade wrapper instead (``flashinfer/cascade.py``): each shared prefix is read once.
The planning of eager steps lives in ``flashinfer/planner.py``; this module owns the contract and the runs.
Verification steps run as extends; draft trees (``fb.draft_parents``) run paged attention with a custom mask
(ancestors, and the sliding window on rotary positions) on FlashInfer's fa2 prefill (``plan_tree_prefill``).
Over an fp8 pool the kernels read the stored bytes (FlashInfer's fp8 KV paths, queries in bf16) and the pool's
per-KV-head scales are folded around them (``attention/kv_scale_fold.py``: queries times the K scale, outputs
times the V scale); the ragged path's new K/V are rounded through the pool's format, so every path sees what the
pool holds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from compile_attn.attention.base import AttentionBackend
from compile_attn.attention.flashinfer.graph_state import DecodeGraphState
from compile_attn.attention.flashinfer.library import load_flashinfer
from compile_attn.attention.flashinfer.plan_groups import group_layers, use_tensor_cores
from compile_attn.attention.flashinfer.planner import StepPlan, StepPlanner
from compile_attn.attention.flashinfer.warmup import build_kernels, kernel_specs
from compile_attn.attention.flashinfer.wrappers import EagerWrappers, PlanDTypes, run_into
from compile_attn.attention.kernel_loader import load_triton_ops
from compile_attn.attention.kv_scale_fold import apply_v_scale_, as_stored, fold_k_scale
from compile_attn.attention.registry import register_backend
from compile_attn.batch import ForwardBatch
from compile_attn.errors import UnsupportedConfigError
from compile_attn.graph_mode import GraphMode
from compile_attn.kv.cache import KVCache
from compile_attn.layer import AttentionLayer

logger = logging.getLogger(__name__)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
_EXTEND_PREFIX_PATHS = ("paged", "cascade")
_PREFILL_BACKENDS = ("fa2", "fa3", "auto")


@register_backend("flashinfer")
class FlashInferBackend(AttentionBackend):
    """FlashInfer attention over the paged KV pool (NHD pages are views of the pool's slot buffers)."""

    graph_support = GraphMode.FULL_AND_PIECEWISE
    tree_verify = True

    def __init__(
        self,
        kv_cache: KVCache,
        layers: Sequence[AttentionLayer] | Mapping[int, AttentionLayer],
        *,
        workspace_bytes: int = 128 * 1024 * 1024,
        decode_use_tensor_cores: bool | None = None,
        extend_prefix_path: str = "paged",
        prefill_backend: str = "fa2",
        q_dtype: torch.dtype | None = None,
        graph_max_context: int | None = None,
        fast_decode_plan: bool = True,
    ) -> None:
        """Options: ``decode_use_tensor_cores`` (None: for GQA groups >= 4 or fp8 KV), ``extend_prefix_path``
        ("paged" or "cascade"), ``prefill_backend`` (flashinfer's "fa2", "fa3" or "auto"; fa2 shares its
        JIT module with tensor-core decode), ``q_dtype`` (default: the KV dtype, bf16 for fp8 KV),
        ``graph_max_context`` (longest sequence a decode graph serves; default the cache's max_context),
        ``fast_decode_plan`` (re-plan graph buckets with flashinfer's fast_decode_plan))."""
        self._fi = load_flashinfer()
        load_triton_ops()  # the page-id gather is a Triton kernel: fail here, with the install command
        super().__init__(kv_cache, layers)
        if extend_prefix_path not in _EXTEND_PREFIX_PATHS:
            raise ValueError(f"extend_prefix_path must be one of {_EXTEND_PREFIX_PATHS}, got {extend_prefix_path!r}")
        if prefill_backend not in _PREFILL_BACKENDS:
            raise ValueError(f"prefill_backend must be one of {_PREFILL_BACKENDS}, got {prefill_backend!r}")
        self._check_device()
        pool = kv_cache.pool
        self.page_size = pool.page_size
        self.extend_prefix_path = extend_prefix_path
        self.prefill_backend = prefill_backend
        self.graph_max_context = graph_max_context or kv_cache.max_context
        self.fast_decode_plan = fast_decode_plan
        kv_dtype = pool.dtype
        self.dtypes = PlanDTypes(q=q_dtype or (kv_dtype if kv_dtype.itemsize == 2 else torch.bfloat16), kv=kv_dtype)
        self.groups, self.layer_group = group_layers(self.layers.values())
        self.tensor_cores = [use_tensor_cores(g, kv_dtype, decode_use_tensor_cores) for g in self.groups]
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._eager = EagerWrappers(self._fi, self.groups, self.tensor_cores, self.workspace, prefill_backend)
        self._planner = StepPlanner(self._fi, kv_cache, self.groups, self._eager, self.dtypes, self.workspace,
                                    extend_prefix_path)
        self._graph: DecodeGraphState | None = None
        self._step: StepPlan | None = None
        self._planned: torch.cuda.Event | None = None  # recorded after the last plan's host-to-device copies
        ps = self.page_size
        self._pages = {  # NHD paged views [num_pages + 1, page_size, Hkv, D] of the pool's slot buffers
            lid: tuple(buf.view(-1, ps, *buf.shape[1:]) for buf in pool.get_kv(lid)) for lid in self.layers
        }
        logger.info(
            "flashinfer %s backend: %d plan group(s): %s", self._fi.version, len(self.groups),
            "; ".join(f"{g.describe()} ({'tensor-core' if tc else 'cuda-core'} decode)"
                      for g, tc in zip(self.groups, self.tensor_cores)),
        )

    # ------------------------------------------------------------------ configuration checks
    def _check_device(self) -> None:
        if self.device.type != "cuda":
            raise UnsupportedConfigError(
                f"the flashinfer backend runs on CUDA GPUs but the KV cache is on {self.device}; "
                f"use backend='torch_native' on the CPU"
            )

    def check_layer(self, layer: AttentionLayer) -> None:
        super().check_layer(layer)
        if layer.head_dim not in SUPPORTED_HEAD_DIMS:
            raise UnsupportedConfigError(
                f"layer {layer.layer_id}: head_dim {layer.head_dim} is not supported by the flashinfer backend; "
                f"supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}; use backend='triton' or 'torch_native'"
            )
        if layer.v_head_dim != layer.head_dim:
            raise UnsupportedConfigError(
                f"layer {layer.layer_id}: v_head_dim {layer.v_head_dim} != head_dim {layer.head_dim}; the flashinfer "
                f"backend needs equal K and V head dims; use backend='torch_native'"
            )
        if self.kv_cache.pool.dtype not in _KV_DTYPES:
            raise UnsupportedConfigError(
                f"KV cache dtype {self.kv_cache.pool.dtype} is not supported by the flashinfer backend; create the "
                f"KVCache with dtype torch.bfloat16, torch.float16 or an fp8 type"
            )

    @property
    def cascade_steps(self) -> int:
        """Eager decode steps run through the cascade wrappers (tests, debugging)."""
        return self._planner.cascade_steps

    # ------------------------------------------------------------------ metadata contract
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._graph = DecodeGraphState(
            self._fi, self.groups, self.tensor_cores, self.workspace, max_bs=max_bs,
            max_context=self.graph_max_context, page_size=self.page_size, fast_plan=self.fast_decode_plan,
        )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # a padded request reads one token of the scratch page

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        # plan() stages its metadata in pinned host buffers and copies them without waiting; with the engine's
        # step in flight the host plans the next step while the previous one is queued, so it first waits for
        # the previous plan's copies (issued at that step's start: normally done long before).
        if self._planned is not None:
            self._planned.synchronize()
            self._planned = None
        if fb.forward_mode.is_idle() or fb.batch_size == 0:
            self._step = None
        elif fb.forward_mode.is_decode():
            self._step = self._plan_decode(fb)
        else:
            self._step = self._planner.extend(fb)
        if self._step is not None and fb.input_ids.is_cuda and not in_capture:
            self._planned = torch.cuda.Event()
            self._planned.record()

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        """Gather a graph bucket's page ids from ``req_to_token``: one launch, static shapes, no host sync."""
        step = self._step
        if step is None or not step.graph_bound:
            return  # eager decode and extend steps are complete after out_graph
        assert self._graph is not None
        self._graph.gather(self.kv_cache.req_to_token, fb.req_pool_indices)
        step.filled = True

    def _plan_decode(self, fb: ForwardBatch) -> StepPlan:
        if fb.graph_bucket is not None and self._graph is not None:
            self.check_graph_view(fb, self._graph.max_bs, self._graph.max_context)
            wrappers = self._graph.plan(fb.seq_lens_cpu, self.dtypes)
            return StepPlan(is_decode=True, batch_size=fb.batch_size, num_tokens=fb.batch_size, decode=wrappers,
                            graph_bound=True, filled=False)
        return self._planner.decode(fb)

    def _require_step(self, decode: bool) -> StepPlan:
        step = self._step
        if step is None or step.is_decode != decode:
            raise RuntimeError(
                f"flashinfer has no {'decode' if decode else 'extend'} plan for this batch: call "
                f"backend.init_forward_metadata(batch) (or init_forward_metadata_out_graph) before the forward"
            )
        return step

    def _check_q(self, q: torch.Tensor) -> torch.Tensor:
        if q.dtype != self.dtypes.q:
            raise UnsupportedConfigError(
                f"queries are {q.dtype} but the flashinfer backend plans for {self.dtypes.q}; create it with "
                f"q_dtype={q.dtype} (create_backend('flashinfer', ..., q_dtype=...))"
            )
        return q if q.stride(-1) == 1 else q.contiguous()

    # ------------------------------------------------------------------ compute
    def forward_decode(self, q, k, v, layer, fb, out, save_kv_cache) -> None:  # noqa: ANN001
        if not save_kv_cache:
            raise UnsupportedConfigError(
                "the flashinfer backend reads a decode token's K/V from the pool, so it needs save_kv_cache=True"
            )
        self.save_kv(layer, fb, k, v)
        self.decode_attention(q, layer, out)

    def decode_attention(self, q: torch.Tensor, layer: AttentionLayer, out: torch.Tensor) -> None:
        """Decode attention of the planned step over the pool (the new K/V must already be stored)."""
        step = self._require_step(decode=True)
        if step.cascade is not None:
            bs = step.batch_size
            scales = self.kv_cache.pool.kv_scales(layer.layer_id)
            qd = self._check_q(q[:bs]) if scales is None else fold_k_scale(self._check_q(q[:bs]), scales[0])
            k_buf, v_buf = self.kv_cache.pool.get_kv(layer.layer_id)
            cascade = step.cascade[self.layer_group[layer.layer_id]]
            run_into(out[:bs], lambda o: cascade.run(qd, k_buf, v_buf, o), self.dtypes.q)
            if scales is not None:
                apply_v_scale_(out[:bs], scales[1])
            if out.shape[0] > bs:
                out[bs:].zero_()
            return
        assert step.decode is not None
        if not step.filled:
            raise RuntimeError(
                "flashinfer: this graph bucket's page ids were not gathered: call "
                "backend.init_forward_metadata_in_graph(batch) after init_forward_metadata_out_graph (or "
                "backend.init_forward_metadata(batch), which calls both)"
            )
        bs = step.batch_size
        wrapper = step.decode[self.layer_group[layer.layer_id]]
        scales = self.kv_cache.pool.kv_scales(layer.layer_id)
        qd = self._check_q(q[:bs]) if scales is None else fold_k_scale(self._check_q(q[:bs]), scales[0])
        pages = self._pages[layer.layer_id]
        run_into(out[:bs], lambda o: wrapper.run(qd, pages, out=o), self.dtypes.q)
        if scales is not None:
            apply_v_scale_(out[:bs], scales[1])
        if out.shape[0] > bs:
            out[bs:].zero_()

    def forward_extend(self, q, k, v, layer, fb, out, save_kv_cache) -> None:  # noqa: ANN001
        step = self._require_step(decode=False)
        assert step.extend_paths is not None
        g = self.layer_group[layer.layer_id]
        path = step.extend_paths[g]
        if path == "tree" and not save_kv_cache:
            raise UnsupportedConfigError(
                "the flashinfer backend verifies draft trees over the pool (the new K/V included), so it needs "
                "save_kv_cache=True"
            )
        if path == "paged" and not save_kv_cache:
            raise UnsupportedConfigError(
                "the paged extend path reads the new K/V from the pool, so it needs save_kv_cache=True; "
                "create the flashinfer backend with extend_prefix_path='cascade' (full-attention layers)"
            )
        if save_kv_cache:
            self.save_kv(layer, fb, k, v)
        n = step.num_tokens
        if n:
            qn = self._check_q(q[:n])
            kn, vn = k[:n].to(qn.dtype), v[:n].to(qn.dtype)
            scales = self.kv_cache.pool.kv_scales(layer.layer_id)
            qp = qn  # the queries of the paths that read the pool: times the K scale over an fp8 pool
            if scales is not None:
                kv_dtype = self.kv_cache.pool.dtype
                kn, vn = as_stored(kn, scales[0], kv_dtype), as_stored(vn, scales[1], kv_dtype)
                if path != "ragged":
                    qp = fold_k_scale(qn, scales[0])

            def from_pool(o: torch.Tensor) -> None:  # an output over the fp8 pages, times the V scale
                if scales is not None:
                    apply_v_scale_(o, scales[1])

            ragged, paged, pages = self._eager.ragged[g], self._eager.paged[g], self._pages[layer.layer_id]
            if path == "ragged":
                run_into(out[:n], lambda o: ragged.run(qn, kn, vn, out=o), qn.dtype)
            elif path == "paged":
                run_into(out[:n], lambda o: (paged.run(qp, pages, out=o), from_pool(o)), qn.dtype)
            elif path == "tree":
                tree = self._eager.tree[g]
                run_into(out[:n], lambda o: (tree.run(qp, pages, out=o), from_pool(o)), qn.dtype)
            else:

                def cascade(o: torch.Tensor) -> None:
                    _, lse_new = ragged.run(qn, kn, vn, out=o, return_lse=True)
                    o_prefix, lse_prefix = paged.run(qp, pages, return_lse=True)
                    from_pool(o_prefix)  # the LSE needs no fold: the folded query gives the real scores
                    self._fi.merge_state_in_place(o, lse_new, o_prefix, lse_prefix)  # base-2 LSEs on both sides

                run_into(out[:n], cascade, qn.dtype)
        if out.shape[0] > n:
            out[n:].zero_()  # padding tokens of a graph bucket

    # ------------------------------------------------------------------ JIT warm-up
    def warmup(self, max_workers: int = 1) -> dict[str, float]:
        """Build or load every FlashInfer kernel this backend will call; seconds per kernel.

        ``max_workers > 1`` builds modules in parallel (faster cold start), but their ninja runs share
        FlashInfer's build log, which can make the next process rebuild once (see docs/flashinfer.md).
        """
        with_merge = self.extend_prefix_path == "cascade" and any(not g.uses_window for g in self.groups)
        specs = kernel_specs(self.groups, self.tensor_cores, self.dtypes, self.prefill_backend, with_merge)
        return build_kernels(self._fi, specs, self.workspace, max_workers=max_workers)
