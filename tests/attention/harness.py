"""The one harness every attention backend's tests use: random batches through the attention op against a
float64 reference, padded decode batches over a backend's static graph buffers (captured as CUDA graphs on a GPU,
called directly on the CPU), and a chunked float64 reference fast enough for 8k-token sequences.

References never look at the backend's metadata: they walk ``req_to_token`` by position. The scenarios every
backend must pass are in ``test_conformance.py``; a backend's own folder tests only what is its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tests.batch_factory import RandomStep, random_step
from tests.reference import max_rel_error, reference_attention

from compile_attn import (
    AttentionLayer,
    ForwardBatch,
    ForwardMode,
    KVCache,
    create_backend,
    forward_context,
)
from compile_attn.batch import PAD_REQUEST, PAD_SLOT

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# (prefix_lens, extend_lens) per batch kind; "mixed" has decode-like and prefill requests in one step.
LENGTHS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "decode": ((5, 33, 70, 17), (1, 1, 1, 1)),
    "extend": ((0, 0, 0), (7, 20, 1)),
    "prefix": ((12, 40, 3), (9, 5, 17)),
    "mixed": ((9, 0, 31, 16), (1, 13, 1, 6)),
}
Reference = Callable[..., torch.Tensor]


# ---------------------------------------------------------------------------------------- reference
def chunked_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    *,
    scaling: float,
    sliding_window: int | None = None,
    logit_cap: float = 0.0,
    causal: bool = True,
    chunk: int = 256,
) -> torch.Tensor:
    """Same contract as ``reference.reference_attention`` (float64, masks from absolute positions), but
    vectorised per request and chunked over queries, on ``q``'s device."""
    device = q.device
    num_q_heads, num_kv_heads = q.shape[1], k_new.shape[1]
    kv_head = torch.arange(num_q_heads, device=device) // (num_q_heads // num_kv_heads)
    out = torch.zeros(q.shape[0], num_q_heads, v_new.shape[2], dtype=torch.float64, device=device)
    t0 = 0
    for row, prefix, ext in zip(req_rows, prefix_lens, extend_lens):
        slots = req_to_token[row, :prefix].long()
        keys = torch.cat([k_pool[slots].double(), k_new[t0 : t0 + ext].double()])[:, kv_head]  # [L, Hq, D]
        vals = torch.cat([v_pool[slots].double(), v_new[t0 : t0 + ext].double()])[:, kv_head]
        k_pos = torch.arange(prefix + ext, device=device)
        for c in range(0, ext, chunk):
            rows = slice(t0 + c, t0 + min(ext, c + chunk))
            qc = q[rows].double()
            q_pos = prefix + c + torch.arange(qc.shape[0], device=device)
            allowed = torch.ones(qc.shape[0], k_pos.shape[0], dtype=torch.bool, device=device)
            if causal:
                allowed &= k_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
            s = torch.einsum("mhd,lhd->hml", qc, keys) * scaling
            if logit_cap > 0:
                s = logit_cap * torch.tanh(s / logit_cap)
            p = torch.softmax(s.masked_fill(~allowed[None], -math.inf), dim=-1)
            out[rows] = torch.einsum("hml,lhd->mhd", p, vals)
        t0 += ext
    return out


def layer_reference(reference: Reference, step: RandomStep, q, k, v, kv: KVCache, layer: AttentionLayer):
    return reference(
        q, k, v, *kv.pool.get_kv(layer.layer_id), kv.req_to_token, step.rows, step.prefix_lens, step.extend_lens,
        scaling=layer.scaling, sliding_window=layer.sliding_window, logit_cap=layer.logit_cap,
    )


# ---------------------------------------------------------------------------------------- one step
@dataclass(frozen=True)
class Case:
    """One batch: per-request prefix and new-token counts, head layout, page size, window/softcap of layer 0
    (a second, full-attention layer is added when layer 0 has either, so two windows share a step)."""

    prefix: tuple[int, ...]
    extend: tuple[int, ...]
    num_kv_heads: int = 2
    group: int = 4
    page_size: int = 1
    window: int | None = None
    logit_cap: float = 0.0
    head_dim: int = 64
    v_head_dim: int | None = None  # None: head_dim
    mode: ForwardMode | None = None

    @classmethod
    def named(cls, kind: str, **fields: object) -> Case:
        """A case of one of LENGTHS' batch kinds ("mixed" runs as a MIXED batch)."""
        mode = ForwardMode.MIXED if kind == "mixed" else None
        return cls(*LENGTHS[kind], **{"mode": mode, **fields})  # type: ignore[arg-type]

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def dv(self) -> int:
        return self.v_head_dim or self.head_dim

    def layers(self) -> list[AttentionLayer]:
        first = AttentionLayer(0, self.num_heads, self.num_kv_heads, self.head_dim, self.dv,
                               sliding_window=self.window, logit_cap=self.logit_cap)
        if self.window is None and self.logit_cap == 0:
            return [first]
        return [first, AttentionLayer(1, self.num_heads, self.num_kv_heads, self.head_dim, self.dv)]

    def make_kv(self, device: str, dtype: torch.dtype) -> KVCache:
        seq = [p + e for p, e in zip(self.prefix, self.extend)]
        ps = self.page_size
        return KVCache(num_layers=len(self.layers()), num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                       v_head_dim=self.dv, max_batch_size=len(seq) + 2, max_context=max(seq) + 1,
                       kv_cache_tokens=sum(seq) + len(seq) * ps + 4 * ps, page_size=ps, dtype=dtype, device=device)


@dataclass
class LayerResult:
    error: float  # max relative error of the live tokens against the reference
    pad_out: torch.Tensor  # outputs of the padding tokens (empty without padding)


def run_case(case: Case, device: str, dtype: torch.dtype, *, seed: int = 0, pad_tokens: int = 0,
             backend_kwargs: dict | None = None, reference: Reference = reference_attention,
             save_kv_cache: bool = True, strided: bool = False, backend_name: str = "triton") -> list[LayerResult]:
    """Run every layer of ``case`` once through the op (``backend_name``'s backend); check NaN-freedom and the
    pool writes.

    ``pad_tokens`` appends padding tokens (a piecewise bucket's view: out_cache_loc PAD_SLOT, belonging
    to no request) with random q/k/v. ``strided``: q/k/v are views into one packed [tokens, q | k | v] tensor
    (a fused QKV projection's output) and ``out`` is a view whose last dimension is not contiguous.
    """
    layers = case.layers()
    kv = case.make_kv(device, dtype)
    gen = torch.Generator().manual_seed(seed)
    step = random_step(kv, list(case.prefix), list(case.extend), case.num_heads, gen, dtype=dtype,
                       forward_mode=case.mode)
    fb = step.batch
    n = fb.num_tokens
    if pad_tokens:
        pad = torch.full((pad_tokens,), PAD_SLOT, dtype=torch.int64, device=device)
        fb.out_cache_loc = torch.cat([fb.out_cache_loc, pad])
        fb.input_ids = torch.cat([fb.input_ids, torch.zeros_like(pad)])
        fb.positions = torch.cat([fb.positions, torch.zeros_like(pad)])
        fb.graph_bucket = n + pad_tokens
    backend = create_backend(backend_name, kv, layers, **(backend_kwargs or {}))
    backend.init_forward_metadata(fb)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    results = []
    for layer in layers:
        first = layer.layer_id == 0
        q = torch.cat([step.q if first else rand(n, case.num_heads, case.head_dim),
                       rand(pad_tokens, case.num_heads, case.head_dim)])
        k = torch.cat([step.k if first else rand(n, case.num_kv_heads, case.head_dim),
                       rand(pad_tokens, case.num_kv_heads, case.head_dim)])
        v = torch.cat([step.v if first else rand(n, case.num_kv_heads, case.dv),
                       rand(pad_tokens, case.num_kv_heads, case.dv)])
        k_pool, v_pool = kv.pool.get_kv(layer.layer_id)
        pool_before = k_pool.clone()
        expected = layer_reference(reference, step, q[:n], k[:n], v[:n], kv, layer)
        out = torch.full((q.shape[0], case.num_heads, case.dv), float("nan"), dtype=dtype, device=device)
        if strided:
            q, k, v = _packed_views(q, k, v)
            out = torch.full((q.shape[0], case.dv, case.num_heads), float("nan"), dtype=dtype,
                             device=device).transpose(1, 2)
        with forward_context(fb, backend):
            torch.ops.compile_attn.attention(q, k, v, out, layer.layer_id, save_kv_cache=save_kv_cache)
        assert not out.isnan().any(), f"layer {layer.layer_id}: NaN in the output"
        if save_kv_cache:  # the step's K/V reached the pool, and nothing else live changed
            torch.testing.assert_close(k_pool[fb.out_cache_loc[:n]], k[:n].to(kv.pool.dtype), rtol=0, atol=0)
            torch.testing.assert_close(v_pool[fb.out_cache_loc[:n]], v[:n].to(kv.pool.dtype), rtol=0, atol=0)
            untouched = torch.ones(k_pool.shape[0], dtype=torch.bool, device=device)
            untouched[fb.out_cache_loc] = False
            assert torch.equal(k_pool[untouched], pool_before[untouched]), "a slot outside the step changed"
        else:
            assert torch.equal(k_pool, pool_before), "save_kv_cache=False wrote the pool"
        results.append(LayerResult(max_rel_error(out[:n], expected), out[n:]))
    return results


def _packed_views(*parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``parts`` ([T, H, D] each) copied into one [T, sum(H * D)] tensor and returned as views of it."""
    packed = torch.cat([p.flatten(1) for p in parts], dim=1)
    views, col = [], 0
    for p in parts:
        width = p.shape[1] * p.shape[2]
        views.append(packed[:, col:col + width].view(p.shape))
        col += width
    return tuple(views)


# ---------------------------------------------------------------------------------------- padded decode
def padded_decode_batch(step: RandomStep, bucket: int) -> ForwardBatch:
    """``step`` (decode) plus ``bucket - live`` padded requests: row PAD_REQUEST, seq_len 1, slot PAD_SLOT."""
    live = step.batch.batch_size
    pad = bucket - live
    device = step.batch.device
    loc = torch.cat([step.batch.out_cache_loc, torch.full((pad,), PAD_SLOT, dtype=torch.int64, device=device)])
    fb = ForwardBatch.build(
        req_pool_indices=step.rows + [PAD_REQUEST] * pad, prefix_lens=step.prefix_lens + [0] * pad,
        extend_lens=[1] * bucket, out_cache_loc=loc, forward_mode=ForwardMode.DECODE, device=device,
    )
    fb.graph_bucket = bucket
    fb.real_batch_size = live
    return fb


class StaticDecode:
    """A padded decode batch whose tensors keep their addresses (what a captured graph reads); ``load``
    copies a new step into it, like the graph runner's replay views."""

    def __init__(self, bucket: int, device: str) -> None:
        self.bucket = bucket
        self.batch = ForwardBatch.build(
            req_pool_indices=[PAD_REQUEST] * bucket, prefix_lens=[0] * bucket, extend_lens=[1] * bucket,
            out_cache_loc=[PAD_SLOT] * bucket, forward_mode=ForwardMode.DECODE, device=device,
        )
        self.batch.graph_bucket = bucket

    def load(self, step: RandomStep) -> None:
        new = padded_decode_batch(step, self.bucket)
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "positions", "input_ids", "extend_prefix_lens"):
            getattr(self.batch, name).copy_(getattr(new, name))
        self.batch.seq_lens_cpu.copy_(new.seq_lens_cpu)
        self.batch.extend_prefix_lens_cpu = new.extend_prefix_lens_cpu
        self.batch.seq_lens_sum = new.seq_lens_sum
        self.batch.real_batch_size = new.real_batch_size


def bound_buffers(backend) -> list[tuple[int, int]]:
    """(data_ptr of the bound decode metadata, data_ptr of the static buffer it must view), per tensor."""
    step, graph = backend.step_metadata, backend.graph_buffers
    pairs = []
    for w, idx in step.indexes.items():
        static = graph.indexes[w]
        for name in ("kv_indptr", "kv_indices", "num_kv_splits", "kv_start"):
            if getattr(idx, name) is not None:
                pairs.append((getattr(idx, name).data_ptr(), getattr(static, name).data_ptr()))
    for shape, scratch in step.scratch.items():
        pairs.append((scratch.attn_logits.data_ptr(), graph.scratch[shape].attn_logits.data_ptr()))
    return pairs


@dataclass
class ReplayReport:
    errors: list[float] = field(default_factory=list)
    trials: int = 0
    bound_launches: int = 0  # decode layers the backend launched through a DecodePlan


def decode_replays(device: str, dtype: torch.dtype, *, buckets: tuple[int, ...], trials: int, capture: bool,
                   max_len: int, page_size: int = 16, head_dim: int = 64, backend_name: str = "triton",
                   reference: Reference = reference_attention, backend_kwargs: dict | None = None) -> ReplayReport:
    """Per bucket: bind (and with ``capture``, capture as a CUDA graph) decode over the static buffers once,
    then run ``trials`` new batches through it (odd trials padded with PAD_REQUEST requests), with
    ``init_forward_metadata_out_graph`` on the static batch before each. Two layers: window 9 + softcap 30,
    and full attention. Checks per trial: padded outputs finite, only the step's slots (and the scratch
    slot) written, and for triton the metadata bound to the static buffers. Returns the live outputs' errors."""
    layers = [AttentionLayer(0, 8, 2, head_dim, sliding_window=9, logit_cap=30.0), AttentionLayer(1, 8, 2, head_dim)]
    kv = KVCache(num_layers=2, num_kv_heads=2, head_dim=head_dim, max_batch_size=2 * max(buckets) + 2,
                 max_context=max_len + 1, kv_cache_tokens=max(buckets) * (max_len + 2 * page_size), page_size=page_size,
                 dtype=dtype, device=device)
    backend = create_backend(backend_name, kv, layers, **(backend_kwargs or {}))
    backend.init_cuda_graph_state(max(buckets), max(buckets))
    gen = torch.Generator().manual_seed(0)
    report = ReplayReport()

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    for bucket in sorted(buckets, reverse=True):
        static = StaticDecode(bucket, device)
        q = [torch.zeros(bucket, 8, head_dim, dtype=dtype, device=device) for _ in layers]
        k = [torch.zeros(bucket, 2, head_dim, dtype=dtype, device=device) for _ in layers]
        v = [torch.zeros(bucket, 2, head_dim, dtype=dtype, device=device) for _ in layers]
        out = [torch.zeros(bucket, 8, head_dim, dtype=dtype, device=device) for _ in layers]

        def body() -> None:
            backend.init_forward_metadata_in_graph(static.batch)  # noqa: B023
            for layer in layers:
                i = layer.layer_id
                torch.ops.compile_attn.attention(q[i], k[i], v[i], out[i], i)  # noqa: B023

        backend.init_forward_metadata_out_graph(static.batch, in_capture=True)
        graph = None
        with forward_context(static.batch, backend, graph_mode="full"):
            body()  # warm-up: compiles the kernels outside the capture
            if capture:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    body()
        for trial in range(trials):
            live = bucket if trial % 2 == 0 or bucket == 1 else bucket - 1 - trial % min(3, bucket - 1)
            lens = torch.randint(1, max_len, (live,), generator=gen).tolist()
            step = random_step(kv, lens, [1] * live, 8, gen, dtype=dtype)
            static.load(step)
            new = {}
            for layer in layers:
                i = layer.layer_id
                qi, ki, vi = (step.q, step.k, step.v) if i == 0 else (
                    rand(live, 8, head_dim), rand(live, 2, head_dim), rand(live, 2, head_dim))
                pad = bucket - live
                q[i].copy_(torch.cat([qi, rand(pad, 8, head_dim)]))
                k[i].copy_(torch.cat([ki, rand(pad, 2, head_dim)]))
                v[i].copy_(torch.cat([vi, rand(pad, 2, head_dim)]))
                new[i] = (qi, ki, vi)
            before = [kv.pool.get_kv(layer.layer_id)[0].clone() for layer in layers]
            backend.init_forward_metadata_out_graph(static.batch)
            if backend_name == "triton":
                assert all(a == b for a, b in bound_buffers(backend)), "decode metadata is not the static buffers"
            if graph is not None:
                graph.replay()
            else:
                with forward_context(static.batch, backend, graph_mode="full"):
                    body()
            written = torch.zeros(before[0].shape[0], dtype=torch.bool, device=device)
            written[step.batch.out_cache_loc] = True
            written[PAD_SLOT] = True
            for layer in layers:
                i = layer.layer_id
                assert torch.isfinite(out[i][live:].float()).all(), f"bucket {bucket}: padded output not finite"
                k_pool = kv.pool.get_kv(i)[0]
                assert torch.equal(k_pool[~written], before[i][~written]), "a live slot outside the step changed"
                expected = layer_reference(reference, step, *new[i], kv, layer)
                report.errors.append(max_rel_error(out[i][:live], expected))
            report.trials += 1
            for row in step.rows:
                kv.free_request(row)
    report.bound_launches = getattr(backend, "bound_decode_launches", 0)
    return report
