"""AttentionBackend: the interface every attention backend implements, and the graphs it declares it can run in.

The three-method metadata contract lets a graph runner capture decode as one full CUDA graph:

* ``init_forward_metadata_out_graph(fb, in_capture=False)`` runs on the host, outside any graph:
  dynamic-shape work, planners, writing static buffers. With ``in_capture=True`` it binds the
  static-buffer views the capture will record.
* ``init_forward_metadata_in_graph(fb)`` is recorded into the graph: static shapes only, no
  ``.item()``/``.cpu()``/``.tolist()``, no host sync, no allocation whose address must persist.
* ``init_forward_metadata(fb)`` is the eager entry: ``fb.check(kv_cache)`` (the batch fits the cache;
  see ``ForwardBatch.check`` for what that costs), the batch's pending request-table write if it has one
  (``ForwardBatch.write_pending_table``), then out_graph, then in_graph.

``forward`` checks the batch too if the eager entry did not, and the shapes, dtypes and devices of
q/k/v/out against the layer, the batch and the KV pool, before anything is written (InvalidBatchError).
On an fp8 pool whose scales are not set yet, ``forward`` lets the pool's calibration see the first prefill's K/V
before any backend stores them (``kv/kv_scales.py``); once set, that is one attribute check per layer.

``fb.graph_bucket`` is set when ``fb`` is a graph runner's padded view of its static buffers
(capture or replay); backends then use the buffers from ``init_cuda_graph_state``.

Verification steps (``ForwardMode.TARGET_VERIFY``) take the extend path. Chains of draft tokens are causal extends
in every backend; draft trees (``fb.draft_parents`` that are not chains) run where ``supports_tree_verify()``. A
backend whose ``supports_verify_mode(Q)`` is True also runs chain verify batches of Q tokens per request in a verify
mode of its own (each request's prefix read once for its Q tokens), and the graph runner captures full verify graphs
for them (``graph_runner/runner.py``); the others' chain verify steps replay the full decode graphs as decode rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch

from compile_attn.batch import ForwardBatch
from compile_attn.draft_tree import is_chain
from compile_attn.errors import InvalidBatchError, InvalidConfigError, UnsupportedConfigError
from compile_attn.graph_mode import GraphMode
from compile_attn.kv.cache import KVCache
from compile_attn.layer import AttentionLayer


# The backends that verify draft trees (their supports_tree_verify() is True); tests check it against the classes.
TREE_VERIFY_BACKENDS = ("triton", "flashinfer", "torch_native")


class AttentionBackend(ABC):
    """Base class: owns per-step metadata, reads/writes the KV cache, computes attention into ``out``."""

    name: ClassVar[str] = "base"
    # The richest GraphMode this kind of backend runs in: NONE (no graphs at all), PIECEWISE (attention eager
    # between captured pieces) or FULL_AND_PIECEWISE (decode attention can also be captured in a full graph).
    # Declared per class and never assigned on an instance; see supported_graph_mode.
    graph_support: ClassVar[GraphMode] = GraphMode.PIECEWISE
    # Whether decode stores every row's new K/V before any row attends: then rows of one request (a chain verify
    # step unrolled into decode rows, graph_runner/verify_unroll.py) see each other's tokens, and the full decode
    # graphs serve verify steps. Where the decode kernel stores each row's token itself (triton) it is off until
    # ``store_decode_kv_first()`` turns it on.
    decode_stores_kv_first: ClassVar[bool] = True
    # Whether TARGET_VERIFY batches with draft trees run here (see supports_tree_verify).
    tree_verify: ClassVar[bool] = False

    def __init__(
        self,
        kv_cache: KVCache,
        layers: Sequence[AttentionLayer] | Mapping[int, AttentionLayer],
    ) -> None:
        self.kv_cache = kv_cache
        self.layers: dict[int, AttentionLayer] = (
            dict(layers) if isinstance(layers, Mapping) else {layer.layer_id: layer for layer in layers}
        )
        self.device = kv_cache.device
        self._pool_device = kv_cache.pool.k_buffers[0].device  # with its index, for comparing with inputs'
        self._checked_batch: ForwardBatch | None = None  # the last batch that passed ForwardBatch.check
        for layer in self.layers.values():
            self.check_layer(layer)

    def supported_graph_mode(self) -> GraphMode:
        """What this backend runs in: the class's ``graph_support``, narrowed by backends whose instances can do
        less (interpreted Triton kernels, a hybrid whose decode part has no full graphs)."""
        return self.graph_support

    def store_decode_kv_first(self) -> bool:
        """Make decode steps store every row's new K/V before any row attends (call before graphs are captured), so
        that chain verify steps can run as decode rows (``decode_stores_kv_first``); returns whether they do now.
        The engine calls it when speculative decoding is on. Default: nothing to change."""
        return self.decode_stores_kv_first

    def supports_tree_verify(self) -> bool:
        """Whether verification steps whose draft tokens form trees (``fb.draft_parents`` that are not chains) run
        here; chains run in every backend, as causal extends. Default: the class's ``tree_verify``."""
        return self.tree_verify

    def supports_verify_mode(self, tokens_per_request: int) -> bool:
        """Whether chain verify batches (``ForwardMode.TARGET_VERIFY`` without trees) whose requests all verify
        ``tokens_per_request`` tokens run here in a verify mode that is full-graph capturable: the graph runner then
        gives them full graphs keyed by their number of requests (padded requests on row ``PAD_REQUEST`` with the
        seq_len fill value, whose tokens see at most that one scratch key), instead of replaying the decode graphs
        with one row per token. Default: no."""
        return False

    def check_tree_verify(self, fb: ForwardBatch) -> None:
        """UnsupportedConfigError, naming the backends that can, if ``fb`` verifies a draft tree and this backend
        does not verify trees. Host lists only; backends without tree support call it in ``out_graph``."""
        if fb.draft_parents is None or self.supports_tree_verify():
            return
        tree = next((b for b, parents in enumerate(fb.draft_parents) if not is_chain(parents)), None)
        if tree is not None:
            raise UnsupportedConfigError(
                f"the {self.name} attention backend cannot verify draft trees (request {tree}'s draft_parents "
                f"{fb.draft_parents[tree]} are not a chain); backends that can: {', '.join(TREE_VERIFY_BACKENDS)}; "
                f"or verify chains of drafts (speculative topk=1)"
            )

    # ------------------------------------------------------------------ configuration checks
    def check_layer(self, layer: AttentionLayer) -> None:
        """Raise UnsupportedConfigError if this backend cannot run ``layer`` (InvalidConfigError if the cache has no
        such layer). Default: any layer whose KV heads the pool holds."""
        pool = self.kv_cache.pool
        if layer.layer_id >= pool.num_layers:
            raise InvalidConfigError(
                f"layer_id {layer.layer_id} is past the KV cache's {pool.num_layers} layers (ids 0.."
                f"{pool.num_layers - 1}); build the KVCache with num_layers={layer.layer_id + 1} or more"
            )
        if layer.num_kv_heads != pool.num_kv_heads or layer.head_dim != pool.head_dim:
            raise UnsupportedConfigError(
                f"layer {layer.layer_id} has {layer.num_kv_heads} KV heads of dim {layer.head_dim} but the KV "
                f"pool holds {pool.num_kv_heads} heads of dim {pool.head_dim}; build the KVCache from the model config"
            )

    # ------------------------------------------------------------------ the metadata contract
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Eager entry: check that ``fb`` fits the KV cache (InvalidBatchError, nothing prepared), then prepare
        everything ``forward`` needs for it (a request-table write the batch still owes first: see
        ``ForwardBatch.table_write_pending``)."""
        fb.check(self.kv_cache)
        fb.write_pending_table(self.kv_cache)
        self._checked_batch = fb
        self.init_forward_metadata_out_graph(fb, in_capture=False)
        self.init_forward_metadata_in_graph(fb)

    @abstractmethod
    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        """Host-side and dynamic-shape work; never recorded in a graph."""

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:  # noqa: B027 - optional hook
        """Graph-recordable metadata work (static shapes, no host sync). Default: nothing."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:  # noqa: B027
        """Allocate static buffers for graphs of up to ``max_bs`` requests / ``max_num_tokens`` tokens."""

    def takes_shared_prefix_decode(self) -> bool:
        """Whether decode batches carrying ``shared_prefix`` groups take a shared-prefix path that runs attention
        eagerly: the graph runner then runs them piecewise instead of in a full decode graph. Default: no."""
        return False

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len given to padded requests in a graph bucket (they point at the scratch slot)."""
        return 1

    def check_graph_view(self, fb: ForwardBatch, allocated_bs: int | None, graph_max_context: int) -> None:
        """Raise if the graph-bucket view ``fb`` does not fit static buffers allocated for ``allocated_bs``
        requests (None: ``init_cuda_graph_state`` never ran) of up to ``graph_max_context`` tokens."""
        if allocated_bs is None:
            raise RuntimeError(
                f"the batch is a graph bucket view (fb.graph_bucket is set) but the {self.name} backend has no "
                f"static buffers: call backend.init_cuda_graph_state(max_bs, max_num_tokens) first"
            )
        if fb.batch_size > allocated_bs:
            raise ValueError(
                f"decode graph bucket of {fb.batch_size} requests exceeds the {allocated_bs} that "
                f"init_cuda_graph_state allocated for; call init_cuda_graph_state with a larger max_bs"
            )
        longest = int(fb.seq_lens_cpu.max()) if fb.batch_size else 0
        if longest > graph_max_context:
            raise ValueError(
                f"seq_len {longest} exceeds graph_max_context {graph_max_context}; run this batch eagerly "
                f"or create the backend with a larger graph_max_context"
            )

    # ------------------------------------------------------------------ compute
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        fb: ForwardBatch,
        out: torch.Tensor,
        save_kv_cache: bool = True,
    ) -> None:
        """Write new K/V (if ``save_kv_cache``) and compute attention for ``fb`` into ``out``."""
        if fb.forward_mode.is_idle():
            return
        if fb is not self._checked_batch:  # e.g. an extend batch run without init_forward_metadata
            fb.check(self.kv_cache)
            fb.write_pending_table(self.kv_cache)
            self._checked_batch = fb
        self.check_inputs(q, k, v, layer, fb, out)
        calibration = self.kv_cache.pool.scale_calibration  # an fp8 pool whose scales the first prefill sets
        if calibration is not None:
            calibration.observe(layer.layer_id, fb, k, v)  # before this step's K/V are stored
        if fb.forward_mode.is_decode():
            self.forward_decode(q, k, v, layer, fb, out, save_kv_cache)
        else:
            self.forward_extend(q, k, v, layer, fb, out, save_kv_cache)

    def check_inputs(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch,
        out: torch.Tensor,
    ) -> None:
        """InvalidBatchError unless ``q[T, Hq, D]``, ``k[T, Hkv, D]``, ``v[T, Hkv, Dv]`` and ``out[T, Hq, Dv]`` have
        the batch's token count ``T`` (padding included), the layer's heads, the pool's head dims, one floating
        dtype and the pool's device. Attribute comparisons only: it runs once per layer per step."""
        pool = self.kv_cache.pool
        n, hq, hkv = fb.out_cache_loc.shape[0], layer.num_heads, pool.num_kv_heads
        d, dv = pool.head_dim, pool.v_head_dim
        dev, dtype = self._pool_device, q.dtype
        if (q.shape == (n, hq, d) and k.shape == (n, hkv, d) and v.shape == (n, hkv, dv) and out.shape == (n, hq, dv)
                and k.dtype == dtype and v.dtype == dtype and out.dtype == dtype and dtype.is_floating_point
                and q.device == dev and k.device == dev and v.device == dev and out.device == dev
                and self.layers.get(layer.layer_id) is layer):
            return
        if self.layers.get(layer.layer_id) is not layer:  # a layer given by the forward context, not the backend's
            self.check_layer(layer)
        want = {"q": (n, hq, d), "k": (n, hkv, d), "v": (n, hkv, dv), "out": (n, hq, dv)}
        for name, t in zip(want, (q, k, v, out)):
            if tuple(t.shape) != want[name]:
                raise InvalidBatchError(
                    f"layer {layer.layer_id}: {name} has shape {tuple(t.shape)}, expected {want[name]} ([tokens, "
                    f"heads, head_dim] with the batch's {n} tokens, the layer's {hq} query / {hkv} KV heads, head "
                    f"dims {d}/{dv}); nothing was written"
                )
            if t.dtype != dtype or not dtype.is_floating_point:
                raise InvalidBatchError(
                    f"layer {layer.layer_id}: q, k, v and out must share one floating dtype, got q {q.dtype}, "
                    f"k {k.dtype}, v {v.dtype}, out {out.dtype}; nothing was written"
                )
            if t.device != dev:
                raise InvalidBatchError(
                    f"layer {layer.layer_id}: {name} is on {t.device} but the KV cache is on {dev}; "
                    f"nothing was written"
                )

    def save_kv(self, layer: AttentionLayer, fb: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new K/V at ``fb.out_cache_loc`` (padding tokens go to the scratch slot)."""
        self.kv_cache.pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
        fb: ForwardBatch, out: torch.Tensor, save_kv_cache: bool,
    ) -> None:
        """One new token per request."""

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
        fb: ForwardBatch, out: torch.Tensor, save_kv_cache: bool,
    ) -> None:
        """Variable-length new tokens per request, with or without a cached prefix (EXTEND, MIXED and
        TARGET_VERIFY)."""
