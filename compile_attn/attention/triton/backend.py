"""triton: attention through compile_attn's own Triton kernels (``attention/kernels``) over the paged KV pool.

Decode can be captured as one full CUDA graph: ``init_cuda_graph_state`` allocates static token-CSR
buffers (``kv_indptr``/``kv_indices``/``num_kv_splits``, one set for full attention and one per
sliding-window size) and split-K scratch, and ``init_forward_metadata_in_graph`` fills them on the
device with static shapes. Extend and mixed batches are prepared in ``init_forward_metadata_out_graph``
from host lengths (the kernel's grid depends on them) and run eagerly between captured pieces; a mixed batch's
leading decode rows (extend length 1 over a cached prefix) get a decode step of their own there and run in the
split-K decode kernel beside the extend kernel's launch for the other rows (``triton/mixed.py``).

Where the buffers live and how an extend step is prepared: ``triton/prepare.py``; the kernel launches of one layer
(with the bound relaunch of graph-bound decode layers, ``DecodePlan``): ``triton/launch.py``.

An eager decode batch whose requests share a cached prefix (``fb.shared_prefix``, set by whoever builds the batch)
runs the shared-prefix (cascade) kernels instead, and so does a decode batch the graph
runner routes to its piecewise graphs because it carries groups: see ``triton/cascade.py``.

Verify steps whose requests all verify the same Q tokens, chains or draft trees, run in the decode kernel's verify
mode (``triton/verify_mode.py``): each request's prefix read once for its Q tokens, eagerly or, in a graph runner's
verify view, over the static decode buffers inside a full verify graph (``supports_verify_mode``); draft trees add a
per-row ancestor bitmask over the request's Q new keys, uploaded out of graph. Other verification steps run as
extends. There draft trees (``fb.draft_parents``) add, prepared on the host in out_graph and uploaded with the extend
offsets, each request's ancestor mask over its new keys and the new tokens' positions (``prefix + depth``, so a
sliding window counts along the token's path, as a chain of that path would).

An fp8 KV pool (``float8_e4m3fn``/``float8_e5m2``) is read and written by the same kernels: every launch that
touches a layer's cache passes the pool's per-head scales for that layer (``PagedKVPool.kv_scales``), device
tensors the kernels read when they run, so captured graphs use the scales' current values. The stores quantise;
decode attends to its new token as stored, extend to its new tokens as given (docs/triton_backend.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from compile_attn.attention.base import AttentionBackend
from compile_attn.attention.kernel_loader import kernels_interpreted, load_triton_ops
from compile_attn.attention.registry import register_backend
from compile_attn.attention.triton.cascade import CascadePlanner, CascadeStep
from compile_attn.attention.triton.launch import DecodeLauncher, run_extend
from compile_attn.attention.triton.metadata import DecodeGraphBuffers, DecodeStep, ExtendStep
from compile_attn.attention.triton.mixed import leading_decode_rows
from compile_attn.attention.triton.prepare import DecodeBuffers, prepare_extend
from compile_attn.attention.triton.verify_mode import VerifyPlanner, VerifyStep, uniform_verify_tokens
from compile_attn.batch import ForwardBatch
from compile_attn import env
from compile_attn.errors import BackendUnavailableError, InvalidBatchError, UnsupportedConfigError
from compile_attn.graph_mode import GraphMode
from compile_attn.kv.cache import KVCache
from compile_attn.layer import AttentionLayer

logger = logging.getLogger(__name__)


@register_backend("triton")
class TritonBackend(AttentionBackend):
    """Split-K paged decode and paged extend with compile_attn's Triton kernels; decode is full-graph capturable."""

    graph_support = GraphMode.FULL_AND_PIECEWISE
    # The decode kernel stores each row's new token itself (one launch per layer) until store_decode_kv_first().
    decode_stores_kv_first = False
    tree_verify = True

    def __init__(
        self,
        kv_cache: KVCache,
        layers: Sequence[AttentionLayer] | Mapping[int, AttentionLayer],
        *,
        max_kv_splits: int | None = None,
        deterministic: bool = False,
        split_size: int | None = None,
        graph_max_context: int | None = None,
        one_launch_decode: bool | None = None,
        mixed_decode_rows: bool | None = None,
    ) -> None:
        """Options: ``max_kv_splits`` (most KV splits per decode request; default kernels.DEFAULT_MAX_KV_SPLITS, or
        fewer where the cache's ``max_context`` cannot fill that many ``split_size``-token splits),
        ``deterministic`` (fixed ``split_size``-token splits and one KV tile size for every batch size, so a
        request's decode output is bitwise the same whatever else is in the batch), ``split_size`` (default
        kernels.DEFAULT_SPLIT_SIZE; the shortest split otherwise), ``graph_max_context`` (longest sequence a
        decode graph serves; default the cache's max_context), ``one_launch_decode`` (the split kernel merges the
        splits itself, one launch per decode layer; False: a separate merge kernel, two launches; default on
        unless the environment sets ``COMPILE_ATTN_DECODE_ONE_LAUNCH=0``, for A/B runs)), ``mixed_decode_rows`` (an
        extend/mixed batch's leading decode rows run in the decode kernel, ``triton/mixed.py``; default on unless the
        environment sets ``COMPILE_ATTN_MIXED_DECODE_ROWS=0``, for A/B runs). Decode batches that carry
        ``shared_prefix`` groups read each shared prefix once (``triton/cascade.py``)."""
        self._ops = load_triton_ops()
        # Stage-1 programs per SM for the decode's KV splits: twice as many over an fp8 cache (half a tile's bytes).
        self._programs_per_sm = (self._ops.FP8_PROGRAMS_PER_SM if kv_cache.pool.quantized
                                 else self._ops.PROGRAMS_PER_SM)
        self._check_device(kv_cache.device)
        self._check_fp8_device(kv_cache)
        super().__init__(kv_cache, layers)
        self.split_size = int(self._ops.DEFAULT_SPLIT_SIZE if split_size is None else split_size)
        if self.split_size <= 0:
            raise ValueError(f"split_size must be positive, got {split_size}")
        if max_kv_splits is None:
            # A split holds at least split_size tokens, so no request of the cache has more splits than this; the
            # decode grid launches max_kv_splits programs per request and head block whether they have keys or not.
            max_kv_splits = min(self._ops.DEFAULT_MAX_KV_SPLITS, -(-kv_cache.max_context // self.split_size))
        self.max_kv_splits = int(max_kv_splits)
        if self.max_kv_splits <= 0:
            raise ValueError(f"max_kv_splits must be positive, got {max_kv_splits}")
        self.deterministic = deterministic
        if one_launch_decode is None:
            one_launch_decode = env.one_launch_decode()
        self.one_launch_decode = bool(one_launch_decode)
        self.mixed_decode_rows = env.mixed_decode_rows() if mixed_decode_rows is None else bool(mixed_decode_rows)
        self.graph_max_context = graph_max_context or kv_cache.max_context
        self.num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        )
        ordered = [self.layers[i] for i in sorted(self.layers)]
        self.windows: list[int | None] = list(dict.fromkeys(layer.sliding_window for layer in ordered))
        self.head_shapes: list[tuple[int, int]] = list(
            dict.fromkeys((layer.num_heads, layer.v_head_dim) for layer in ordered)
        )
        self._buffers = DecodeBuffers(self.device, self.windows, self.head_shapes, self.max_kv_splits,
                                      self.graph_max_context)
        self._step: DecodeStep | ExtendStep | CascadeStep | VerifyStep | None = None
        # Shared-prefix decode needs every layer to see the whole sequence (no sliding window).
        self.cascade = CascadePlanner(kv_cache, self._ops) if self.windows == [None] else None
        self.verify = VerifyPlanner(kv_cache, self._ops, ordered, dict(
            num_sms=self.num_sms, max_kv_splits=self.max_kv_splits, deterministic=deterministic,
            split_size=self.split_size, programs_per_sm=self._programs_per_sm), self.one_launch_decode, deterministic)
        # Graph-bound decode layers' launches, per (layer, batch size, save_kv_cache): see triton/launch.py.
        self._decoder = DecodeLauncher(self._ops, kv_cache, max_kv_splits=self.max_kv_splits,
                                       one_launch=self.one_launch_decode, deterministic=deterministic)
        logger.info(
            "triton backend: %d layers, windows %s, max_kv_splits %d, split_size %d%s%s%s, %s",
            len(self.layers), ["full" if w is None else w for w in self.windows], self.max_kv_splits,
            self.split_size, ", deterministic" if deterministic else "",
            "" if self.one_launch_decode else ", two-launch decode (separate merge kernel)",
            "" if self.mixed_decode_rows else ", mixed batches' decode rows in the extend kernel",
            "interpreted kernels, so no full decode graphs (graph mode support: piecewise)"
            if self._interpreted else f"{self.num_sms} SMs",
        )

    # ------------------------------------------------------------------ configuration checks
    def _check_device(self, device: torch.device) -> None:
        interpreted = kernels_interpreted()
        if device.type != "cuda" and not interpreted:
            raise BackendUnavailableError(
                f"the triton backend runs its kernels on CUDA GPUs but the KV cache is on {device}; use "
                f"backend='torch_native' on the CPU (tests may run the kernels on the CPU by setting "
                f"TRITON_INTERPRET=1 before compile_attn.attention.kernels is first imported)"
            )
        self._interpreted = interpreted

    def _check_fp8_device(self, kv_cache: KVCache) -> None:
        """An e4m3 cache needs the fp8 conversions of NVIDIA compute capability 8.9+ (Ada, Hopper and later)."""
        dtype, device = kv_cache.pool.dtype, kv_cache.device
        if dtype != torch.float8_e4m3fn or device.type != "cuda" or torch.version.hip is not None:
            return
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise UnsupportedConfigError(
                f"the triton backend reads a float8_e4m3fn KV cache on compute capability 8.9+ only, and "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}; use kv_cache_dtype fp8_e5m2, or an "
                f"unquantised cache"
            )

    def store_decode_kv_first(self) -> bool:
        """Decode stores the step's K/V in one launch before the attention kernel (one more launch per layer) instead
        of in it, so that rows of one request see each other's new tokens (chain verify steps as decode rows)."""
        self.decode_stores_kv_first = True
        return True

    def supports_verify_mode(self, tokens_per_request: int) -> bool:
        """Chain verify steps of Q tokens per request run in the decode kernel's verify mode (full-graph capturable)
        where no layer has a sliding window and Q x the GQA group fits one program (``triton/verify_mode.py``)."""
        return self.verify.supports(tokens_per_request)

    def supported_graph_mode(self) -> GraphMode:
        """Piecewise only with interpreted kernels: they run on the host, so no CUDA graph (or CPU op tape) can
        record them."""
        return GraphMode.PIECEWISE if self._interpreted else self.graph_support

    def check_layer(self, layer: AttentionLayer) -> None:
        super().check_layer(layer)
        pool = self.kv_cache.pool
        if layer.v_head_dim != pool.v_head_dim:
            raise UnsupportedConfigError(
                f"layer {layer.layer_id} has v_head_dim {layer.v_head_dim} but the KV pool holds V heads of dim "
                f"{pool.v_head_dim}; build the KVCache with v_head_dim={layer.v_head_dim}"
            )
        try:
            self._ops.check_supported(layer.head_dim, layer.v_head_dim, pool.dtype)
        except ValueError as exc:
            raise UnsupportedConfigError(f"layer {layer.layer_id}: {exc}") from None

    # ------------------------------------------------------------------ inspection (tests, debugging)
    @property
    def step_metadata(self) -> DecodeStep | ExtendStep | None:
        """What the last ``init_forward_metadata_out_graph`` prepared."""
        return self._step

    @property
    def graph_buffers(self) -> DecodeGraphBuffers | None:
        """The static decode buffers of ``init_cuda_graph_state`` (None before it ran)."""
        return self._buffers.graph

    @property
    def bound_decode_launches(self) -> int:
        """Decode layers launched through a ``DecodePlan`` (tests, debugging)."""
        return self._decoder.bound_launches

    # ------------------------------------------------------------------ metadata contract
    def takes_shared_prefix_decode(self) -> bool:
        """Decode batches with ``shared_prefix`` groups run the cascade kernels (models without sliding windows)."""
        return self.cascade is not None

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # a padded request reads one token: row PAD_REQUEST's scratch slot

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self._buffers.allocate_graph(max_bs):  # else graphs captured so far keep their buffers
            self._decoder.clear()  # bound to the buffers just replaced

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        if fb.forward_mode.is_idle() or fb.batch_size == 0:
            self._step = None
        elif fb.forward_mode.is_decode():
            # A graph view carries groups only where the runner passed them on (a piecewise route, where attention
            # runs eagerly); a full-graph decode view carries none and keeps the split-K kernel.
            eager = fb.graph_bucket is None
            cascade = self.cascade.prepare(fb) if self.cascade is not None and fb.shared_prefix else None
            if cascade is not None:
                self._step = cascade
            else:
                self._step = self._buffers.allocate_eager(fb) if eager else self._bind_graph_decode(fb)
        elif (verify := self._prepare_verify(fb)) is not None:
            self._step = verify
        else:
            self._step = prepare_extend(fb, self._ops, self.kv_cache, self.device, self._prepare_decode_rows(fb))

    def _prepare_decode_rows(self, fb: ForwardBatch) -> DecodeStep | None:
        """The decode step of an extend/mixed batch's leading decode rows (``triton/mixed.py``), its CSRs and split
        counts filled on the device now (out of graph, with the extend offsets); None: every row runs as extend."""
        rows = leading_decode_rows(fb) if self.mixed_decode_rows else 0
        if not rows:
            return None
        step = self._buffers.allocate_rows(rows, fb.seq_lens_cpu[:rows])
        self._fill_decode(step, fb.req_pool_indices[:rows], fb.seq_lens[:rows])
        return step

    def _prepare_verify(self, fb: ForwardBatch) -> VerifyStep | None:
        """Verify-mode metadata for a verify batch of uniform Q, chains or draft trees (None: the batch runs as an
        extend); a graph view of exactly its B x Q tokens binds the static decode buffers and tree mask (a full verify
        graph reads them)."""
        q = fb.chain_verify_tokens() if fb.draft_parents is None else uniform_verify_tokens(fb)
        if q is None or not self.verify.supports(q):
            return None
        graph = self._buffers.graph
        bind = fb.graph_bucket is not None and graph is not None and fb.num_tokens == fb.batch_size * q <= graph.max_bs
        if bind:
            self.check_graph_view(fb, graph.max_bs, self.graph_max_context)
        return self.verify.prepare(fb, q, graph if bind else None, self._buffers.scratch_for)

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        """Fill the decode token CSR and split counts on the device: static shapes, no host sync."""
        step = self._step
        if isinstance(step, VerifyStep):
            self.verify.fill(step, fb, self.kv_cache.pool.num_kv_heads)
            return
        if not isinstance(step, DecodeStep):
            return  # extend metadata (a mixed batch's decode rows' too) is prepared in out_graph
        self._fill_decode(step, fb.req_pool_indices, fb.seq_lens)

    def _fill_decode(self, step: DecodeStep, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """A decode step's token CSRs and split counts for these requests, on the device: one launch per window."""
        for idx in step.indexes.values():
            self._ops.build_decode_metadata(
                self.kv_cache.req_to_token, req_pool_indices, seq_lens, idx.kv_indptr, idx.kv_indices,
                idx.num_kv_splits, num_sms=self.num_sms, max_kv_splits=self.max_kv_splits,
                deterministic=self.deterministic, split_size=self.split_size,
                num_kv_heads=self.kv_cache.pool.num_kv_heads, window=idx.window, kv_start=idx.kv_start,
                programs_per_sm=self._programs_per_sm,
            )
        step.filled = True

    def _bind_graph_decode(self, fb: ForwardBatch) -> DecodeStep:
        graph = self._buffers.graph
        self.check_graph_view(fb, None if graph is None else graph.max_bs, self.graph_max_context)
        return self._buffers.bind_graph(fb.batch_size)

    def _require_step(self, decode: bool, fb: ForwardBatch) -> DecodeStep | ExtendStep:
        step = self._step
        if not isinstance(step, DecodeStep if decode else ExtendStep) or (decode and not step.filled):
            raise RuntimeError(
                f"the triton backend has no {'decode' if decode else 'extend'} metadata for this batch: call "
                f"backend.init_forward_metadata(batch) (or out_graph then in_graph) before the forward"
            )
        # The kernels' grids and index buffers were sized for the batch the metadata was prepared for.
        prepared, given = ((step.batch_size, fb.batch_size) if isinstance(step, DecodeStep)
                           else (step.num_tokens, fb.num_request_tokens))
        if prepared != given or (not decode and step.draft_parents is not fb.draft_parents):
            what = (f"{prepared} {'requests' if decode else 'tokens'}" if prepared != given
                    else "other draft trees (draft_parents)")
            raise InvalidBatchError(
                f"the triton backend's metadata was prepared for a batch of {what} but the forward runs another "
                f"({given} {'requests' if decode else 'tokens'}); call backend.init_forward_metadata(batch) with the "
                f"batch the forward context holds"
            )
        return step

    # ------------------------------------------------------------------ compute
    def forward_decode(self, q, k, v, layer, fb, out, save_kv_cache) -> None:
        if isinstance(self._step, CascadeStep) and self._step.batch_size == fb.batch_size:
            self.cascade.forward(self._step, q, k, v, layer, fb, out, save_kv_cache)
            return
        step = self._require_step(decode=True, fb=fb)
        assert isinstance(step, DecodeStep)
        self._decoder.run(step, q, k, v, layer, fb, out, save_kv_cache, self.decode_stores_kv_first)

    def forward_extend(self, q, k, v, layer, fb, out, save_kv_cache) -> None:
        step = self._step
        if isinstance(step, VerifyStep) and step.filled and step.batch_size == fb.batch_size:
            self.verify.forward(step, q, k, v, layer, fb, out, save_kv_cache, self.max_kv_splits)
            return
        step = self._require_step(decode=False, fb=fb)
        assert isinstance(step, ExtendStep)
        run_extend(self._ops, self.kv_cache, step, q, k, v, layer, fb, out, save_kv_cache)
        if step.decode is not None:  # the leading decode rows: their K/V stored above, each attends its own from k/v
            d = step.decode_rows
            self._decoder.run(step.decode, q[:d], k[:d], v[:d], layer, fb, out[:d], save_kv_cache=False,
                              stores_kv_first=False)
