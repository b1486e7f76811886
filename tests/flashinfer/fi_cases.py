"""Shared scenarios for the flashinfer backend tests: random batches run through the attention op and
compared with the float64 reference, and decode replays over static graph buffers.

Used by the GPU tests (real flashinfer, bf16 on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tests.batch_factory import random_step
from compile_attn import AttentionLayer, KVCache, forward_context
from compile_attn.kv_cache import PAD_REQUEST, PAD_SLOT
from tests.reference import max_rel_error, reference_attention

# (prefix_lens, extend_lens) per batch kind; "mixed" has decode-like and prefill requests in one step.
LENGTHS: dict[str, tuple[list[int], list[int]]] = {
    "decode": ([5, 33, 70, 17], [1, 1, 1, 1]),
    "extend": ([0, 0, 0], [7, 20, 1]),
    "prefix": ([12, 40, 3], [9, 5, 17]),
    "mixed": ([9, 0, 31, 16], [1, 13, 1, 6]),
}


@dataclass(frozen=True)
class Case:
    mode: str  # a key of LENGTHS
    head_dim: int = 64
    num_kv_heads: int = 2
    group: int = 4  # query heads per KV head
    page_size: int = 1
    window: int | None = None  # layer 0's sliding window; a second, full-attention layer is added
    logit_cap: float = 0.0  # layer 0's softcap
    prefix_path: str = "paged"
    tensor_cores: bool | None = None

    def layers(self) -> list[AttentionLayer]:
        hq = self.num_kv_heads * self.group
        first = AttentionLayer(0, hq, self.num_kv_heads, self.head_dim, sliding_window=self.window,
                               logit_cap=self.logit_cap)
        if self.window is None and self.logit_cap == 0:
            return [first]
        return [first, AttentionLayer(1, hq, self.num_kv_heads, self.head_dim)]

    def backend_kwargs(self) -> dict:
        return dict(extend_prefix_path=self.prefix_path, decode_use_tensor_cores=self.tensor_cores)


MakeBackend = Callable[..., object]


def _reference(step, q, k, v, kv: KVCache, layer: AttentionLayer) -> torch.Tensor:  # noqa: ANN001
    return reference_attention(
        q, k, v, *kv.pool.get_kv(layer.layer_id), kv.req_to_token, step.rows, step.prefix_lens, step.extend_lens,
        scaling=layer.scaling, sliding_window=layer.sliding_window, logit_cap=layer.logit_cap,
    )


def run_case(case: Case, make_backend: MakeBackend, device: str, dtype: torch.dtype, seed: int = 0,
             pad_tokens: int = 0) -> list[tuple[float, torch.Tensor]]:
    """Run every layer of ``case`` once; per layer ``(max relative error, output)``.

    ``pad_tokens`` appends that many padding tokens (a piecewise graph bucket's view); their output
    rows are returned too, so callers can check they are zero.
    """
    layers = case.layers()
    prefix, extend = LENGTHS[case.mode]
    kv = KVCache(num_layers=len(layers), num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, max_batch_size=8,
                 max_context=160, kv_cache_tokens=2048, page_size=case.page_size, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    hq = case.num_kv_heads * case.group
    step = random_step(kv, prefix, extend, hq, gen, dtype=dtype)
    fb = step.batch
    n = fb.num_tokens
    if pad_tokens:
        pad = torch.full((pad_tokens,), PAD_SLOT, dtype=torch.int64, device=device)
        fb.out_cache_loc = torch.cat([fb.out_cache_loc, pad])
        fb.input_ids = torch.cat([fb.input_ids, torch.zeros_like(pad)])
        fb.positions = torch.cat([fb.positions, torch.zeros_like(pad)])
        fb.graph_bucket = n + pad_tokens
    backend = make_backend(kv, layers, **case.backend_kwargs())
    backend.init_forward_metadata(fb)
    results = []
    for layer in layers:
        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        q = torch.cat([step.q, rand(pad_tokens, hq, case.head_dim)]) if layer.layer_id == 0 else rand(
            n + pad_tokens, hq, case.head_dim)
        k = torch.cat([step.k, rand(pad_tokens, case.num_kv_heads, case.head_dim)]) if layer.layer_id == 0 else rand(
            n + pad_tokens, case.num_kv_heads, case.head_dim)
        v = rand(n + pad_tokens, case.num_kv_heads, case.head_dim)
        expected = _reference(step, q[:n], k[:n], v[:n], kv, layer)
        out = torch.full_like(q, float("nan"))
        with forward_context(fb, backend):
            torch.ops.compile_attn.attention(q, k, v, out, layer.layer_id)
        assert not out.isnan().any(), f"layer {layer.layer_id}: NaN in the output"
        results.append((max_rel_error(out[:n], expected), out[n:]))
        # the step's K/V reached the pool
        k_pool, v_pool = kv.pool.get_kv(layer.layer_id)
        torch.testing.assert_close(k_pool[fb.out_cache_loc[:n]], k[:n].to(kv.pool.dtype))
        torch.testing.assert_close(v_pool[fb.out_cache_loc[:n]], v[:n].to(kv.pool.dtype))
    return results


def decode_replays(make_backend: MakeBackend, device: str, dtype: torch.dtype, *, buckets: tuple[int, ...],
                   trials: int, capture: bool, fast_decode_plan: bool = True, page_size: int = 16) -> list[float]:
    """Capture (or, without CUDA, just bind) decode once per bucket over static buffers, then run several
    new batches per bucket — some with padded requests — re-planning in between. Returns the errors."""
    layers = [AttentionLayer(0, 8, 2, 64, sliding_window=9, logit_cap=30.0), AttentionLayer(1, 8, 2, 64)]
    kv = KVCache(num_layers=2, num_kv_heads=2, head_dim=64, max_batch_size=64, max_context=160, kv_cache_tokens=8192,
                 page_size=page_size, dtype=dtype, device=device)
    backend = make_backend(kv, layers, fast_decode_plan=fast_decode_plan)
    backend.init_cuda_graph_state(max_bs=max(buckets), max_num_tokens=max(buckets))
    gen = torch.Generator().manual_seed(0)
    errors = []
    for bucket in sorted(buckets, reverse=True):
        first = random_step(kv, [3 + 7 * i for i in range(bucket)], [1] * bucket, 8, gen, dtype=dtype)
        static = first.batch
        static.graph_bucket = bucket
        q = [torch.zeros(bucket, 8, 64, dtype=dtype, device=device) for _ in layers]
        k = [torch.zeros(bucket, 2, 64, dtype=dtype, device=device) for _ in layers]
        v = [torch.zeros(bucket, 2, 64, dtype=dtype, device=device) for _ in layers]
        out = [torch.zeros(bucket, 8, 64, dtype=dtype, device=device) for _ in layers]

        def body() -> None:
            backend.init_forward_metadata_in_graph(static)
            for layer in layers:
                i = layer.layer_id
                torch.ops.compile_attn.attention(q[i], k[i], v[i], out[i], i)

        backend.init_forward_metadata_out_graph(static, in_capture=True)
        graph = None
        with forward_context(static, backend, graph_mode="full"):
            body()  # warm-up
            if capture:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    body()
        for row in first.rows:
            kv.free_request(row)
        for trial in range(trials):
            live = bucket if trial % 2 == 0 else max(1, bucket - 2)  # odd trials pad the bucket
            step = random_step(kv, torch.randint(1, 150, (live,), generator=gen).tolist(), [1] * live, 8, gen,
                               dtype=dtype)
            fb, pad = step.batch, bucket - live
            rows = torch.cat([fb.req_pool_indices, torch.full((pad,), PAD_REQUEST, device=device)])
            static.req_pool_indices.copy_(rows)
            static.seq_lens.copy_(torch.cat([fb.seq_lens, torch.ones(pad, dtype=torch.int32, device=device)]))
            static.seq_lens_cpu.copy_(torch.cat([fb.seq_lens_cpu, torch.ones(pad, dtype=torch.int64)]))
            static.out_cache_loc.copy_(torch.cat([fb.out_cache_loc, torch.full((pad,), PAD_SLOT, device=device)]))
            static.positions.copy_(torch.cat([fb.positions, torch.zeros(pad, dtype=torch.int64, device=device)]))
            new = {}
            for layer in layers:
                i = layer.layer_id
                qi = step.q if i == 0 else torch.randn(live, 8, 64, generator=gen).to(device=device, dtype=dtype)
                ki = step.k if i == 0 else torch.randn(live, 2, 64, generator=gen).to(device=device, dtype=dtype)
                vi = step.v if i == 0 else torch.randn(live, 2, 64, generator=gen).to(device=device, dtype=dtype)
                q[i][:live].copy_(qi), k[i][:live].copy_(ki), v[i][:live].copy_(vi)
                new[i] = (qi, ki, vi)
            backend.init_forward_metadata_out_graph(static)
            if graph is not None:
                graph.replay()
            else:
                with forward_context(static, backend, graph_mode="full"):
                    body()
            for layer in layers:
                qi, ki, vi = new[layer.layer_id]
                expected = _reference(step, qi, ki, vi, kv, layer)
                errors.append(max_rel_error(out[layer.layer_id][:live], expected))
            for row in step.rows:
                kv.free_request(row)
    return errors
