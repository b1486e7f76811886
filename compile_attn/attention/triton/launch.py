"""Kernel launches of the triton backend for one layer: decode (split-K, with the bound relaunch of graph-bound
decode layers) and extend (a mixed batch's leading decode rows left to decode, ``mixed.py``), over metadata the
backend prepared (``metadata.py``, ``prepare.py``).

A decode layer run eagerly over graph-bound metadata (between piecewise graphs, or a breakable graph's break) keeps
its launch after the first step (``DecodePlan``): while its q/k/v/out/slot tensors are the same (address, shape,
strides, dtype), later steps relaunch it without the argument checks and launch keys. Every launch that touches a
layer's cache passes an fp8 pool's per-head scales for that layer (``kv_scale_args``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from compile_attn.attention.triton.metadata import DecodePlan, DecodeStep, ExtendStep, decode_inputs
from compile_attn.batch import ForwardBatch
from compile_attn.kv.cache import KVCache
from compile_attn.layer import AttentionLayer


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def kv_scale_args(kv_cache: KVCache, layer_id: int) -> dict[str, torch.Tensor]:
    """The kernels' ``k_scale``/``v_scale`` keywords for a layer: the fp8 pool's scales, none for another pool."""
    scales = kv_cache.pool.kv_scales(layer_id)
    return {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}


def run_into(out: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
    """Run a kernel that needs a last-dim-contiguous output; copy into ``out`` if it is not one."""
    if out.stride(-1) == 1:
        fn(out)
    else:
        tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        fn(tmp)
        out.copy_(tmp)


class DecodeLauncher:
    """Launches split-K decode attention for one layer; keeps graph-bound decode layers' launches (``plans``, per
    (layer, batch size, save_kv_cache)) and counts the relaunches (``bound_launches``: tests, debugging)."""

    def __init__(self, ops: ModuleType, kv_cache: KVCache, *, max_kv_splits: int, one_launch: bool,
                 deterministic: bool) -> None:
        self.ops, self.kv_cache, self.device = ops, kv_cache, kv_cache.device
        self.max_kv_splits, self.one_launch, self.deterministic = max_kv_splits, one_launch, deterministic
        self.plans: dict[tuple[int, int, bool], DecodePlan] = {}
        self.bound_launches = 0

    def clear(self) -> None:
        """Forget the kept launches (they are bound to static buffers that were just replaced)."""
        self.plans.clear()

    def run(self, step: DecodeStep, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
            fb: ForwardBatch, out: torch.Tensor, save_kv_cache: bool, stores_kv_first: bool) -> None:
        """Decode attention of ``step``'s requests into ``out`` (padding rows zeroed); the kernel stores each row's
        new K/V itself unless ``stores_kv_first`` (then one store launch first, so rows see each other's)."""
        loc = fb.out_cache_loc if save_kv_cache else None
        scales = kv_scale_args(self.kv_cache, layer.layer_id)
        if stores_kv_first and loc is not None:  # every row's K/V in place before any row attends
            k_buf, v_buf = self.kv_cache.pool.get_kv(layer.layer_id)
            self.ops.store_kv(k_buf, v_buf, loc, last_dim_contiguous(k), last_dim_contiguous(v), **scales)
            loc = None  # the kernel still takes each row's own token from k/v
        bind = step.graph_bound
        if bind:
            # Between piecewise graphs a decode layer gets the same tensors every step (a graph's static outputs,
            # the runner's static buffers, the graph-bound metadata): then its launch repeats as bound the first
            # time, without the argument checks and launch keys (this runs once per layer per step, on the
            # host's critical path).
            plan_key = (layer.layer_id, step.batch_size, save_kv_cache)
            inputs = decode_inputs(q, k, v, out, loc)
            plan = self.plans.get(plan_key)
            if plan is not None and plan.inputs == inputs and plan.indexes is step.indexes:
                if plan.launch():
                    self.bound_launches += 1
                    return
                bind = False  # a launch hook (profiler) is active: launch the regular way, keep the plan
        k_buf, v_buf = self.kv_cache.pool.get_kv(layer.layer_id)
        bs = step.batch_size
        idx = step.indexes[layer.sliding_window]
        scratch = step.scratch[(layer.num_heads, layer.v_head_dim)]
        # The common case (one row per request, contiguous rows) takes no slicing or copying. The kernel takes
        # each request's new token from k/v and (save_kv_cache) stores it: no separate store_kv launch.
        if q.shape[0] != bs:
            q, bind = q[:bs], False
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
            bind = False
        padded = out.shape[0] > bs

        def decode(launch: Callable[..., Any], o: torch.Tensor) -> Any:  # both launch forms take these arguments
            return launch(q, k_buf, v_buf, o, idx.kv_indptr, idx.kv_indices, idx.num_kv_splits, self.max_kv_splits,
                          scratch.attn_logits, scratch.attn_lse, layer.scaling, layer.logit_cap, k_new=k, v_new=v,
                          new_loc=loc, semaphores=scratch.semaphores if self.one_launch else None,
                          batch_invariant=self.deterministic, **scales)

        if bind and not padded and out.stride(-1) == 1 and not (
            self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        ):
            again = decode(self.ops.decode_attention_fwd_and_bind, out)
            if again is not None:
                self.plans[plan_key] = DecodePlan(inputs, step.indexes, again)
            return
        run_into(out[:bs] if padded else out, lambda o: decode(self.ops.decode_attention_fwd, o))
        if padded:
            out[bs:].zero_()


def run_extend(ops: ModuleType, kv_cache: KVCache, step: ExtendStep, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch, out: torch.Tensor,
               save_kv_cache: bool) -> None:
    """Store the step's K/V (``save_kv_cache``), then paged extend attention of its tokens into ``out`` (padding
    tokens of a graph bucket zeroed). The rows of a step's leading decode rows (``step.decode_rows``) are left to
    the decode kernel (``DecodeLauncher.run`` over ``step.decode``); their K/V are stored here with the rest."""
    k_buf, v_buf = kv_cache.pool.get_kv(layer.layer_id)
    scales = kv_scale_args(kv_cache, layer.layer_id)
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    if save_kv_cache:  # padding tokens of a bucket write the scratch slot (out_cache_loc PAD_SLOT)
        ops.store_kv(k_buf, v_buf, fb.out_cache_loc, k, v, **scales)
    d, n = step.decode_rows, step.num_tokens
    if n > d:
        qn = last_dim_contiguous(q[d:n])
        run_into(out[d:n], lambda o: ops.extend_attention_fwd(
            qn, k[d:n], v[d:n], o, k_buf, v_buf, step.qo_indptr, step.kv_indptr, step.kv_indices,
            step.max_len_extend, layer.scaling, is_causal=layer.causal,
            sliding_window=layer.sliding_window or -1, logit_cap=layer.logit_cap,
            **({} if step.tree is None else step.tree.kernel_args()), **scales,
        ))
    if out.shape[0] > n:
        out[n:].zero_()  # padding tokens of a graph bucket
