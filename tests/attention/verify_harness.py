"""Verification steps (ForwardMode.TARGET_VERIFY) for the attention tests: random draft trees over a real KV cache,
a float64 reference written from the definition, and a cross-check that re-runs every root-to-node path as a plain
causal chain.

The reference does not use compile_attn's tree helpers or any backend code: for each new token it walks the
parents to the root (its ancestors; the walk's length is its depth), gives every key its rotary position (a cached
key: its index; a new key: prefix + depth) and takes a softmax over the allowed keys: every cached key and every
ancestor and the token itself, within the sliding window counted on those positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from tests.batch_factory import fill_prefixes
from tests.reference import max_rel_error

from compile_attn import AttentionLayer, ForwardBatch, ForwardMode, KVCache, create_backend, forward_context
from compile_attn.graph_runner import ReplayViews, StaticBuffers
from compile_attn.graph_runner.verify_layout import view_parents


@dataclass(frozen=True)
class VerifyCase:
    """One verification step: per request its cached prefix length and the parents of its new tokens; the head
    layout, page size, and layer 0's window and softcap (a full-attention layer 1 is added when layer 0 has either,
    so two windows share the step)."""

    prefix: tuple[int, ...]
    parents: tuple[tuple[int, ...], ...]
    num_kv_heads: int = 2
    group: int = 2
    page_size: int = 1
    window: int | None = None
    logit_cap: float = 0.0
    head_dim: int = 64

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def extend(self) -> list[int]:
        return [len(p) for p in self.parents]

    def layers(self) -> list[AttentionLayer]:
        first = AttentionLayer(0, self.num_heads, self.num_kv_heads, self.head_dim, sliding_window=self.window,
                               logit_cap=self.logit_cap)
        if self.window is None and self.logit_cap == 0:
            return [first]
        return [first, AttentionLayer(1, self.num_heads, self.num_kv_heads, self.head_dim)]

    def make_kv(self, device: str, dtype: torch.dtype) -> KVCache:
        """Room for the step and for one chain per new token (``path_chain_outputs``)."""
        seq = [p + e for p, e in zip(self.prefix, self.extend)]
        nodes = sum(self.extend)
        ps = self.page_size
        chain_tokens = sum(p + len(walk(t, i)) + ps for p, t in zip(self.prefix, self.parents) for i in range(len(t)))
        return KVCache(num_layers=len(self.layers()), num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                       max_batch_size=len(seq) + nodes + 2, max_context=max(seq) + 1,
                       kv_cache_tokens=sum(seq) + len(seq) * ps + chain_tokens + 4 * ps, page_size=ps, dtype=dtype,
                       device=device)


def walk(parents: tuple[int, ...], i: int) -> list[int]:
    """``i`` and its ancestors, root last."""
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path


@st.composite
def verify_cases(draw: st.DrawFn, max_requests: int = 3, max_tokens: int = 6, max_prefix: int = 20,
                 page_sizes: tuple[int, ...] = (1, 4)) -> VerifyCase:
    """Random trees (random parents), chains and one-token (decode-like) rows, prefixes from 0, GQA 1 or 2, page
    sizes, a sliding window and a softcap on layer 0."""
    parents = []
    for _ in range(draw(st.integers(1, max_requests))):
        kind = draw(st.sampled_from(["tree", "tree", "chain", "decode"]))
        n = 1 if kind == "decode" else draw(st.integers(2, max_tokens))
        if kind == "tree":
            parents.append((-1, *(draw(st.integers(0, i - 1)) for i in range(1, n))))
        else:
            parents.append(tuple(range(-1, n - 1)))
    prefix = tuple(draw(st.integers(0, max_prefix)) for _ in parents)
    return VerifyCase(prefix, tuple(parents), group=draw(st.sampled_from([1, 2])),
                      page_size=draw(st.sampled_from(page_sizes)), window=draw(st.sampled_from([None, 1, 3, 7])),
                      logit_cap=draw(st.sampled_from([0.0, 0.0, 5.0])))


def reference_verify(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, req_to_token: torch.Tensor, rows: list[int], case: VerifyCase,
                     layer: AttentionLayer) -> torch.Tensor:
    """float64 ``[T, Hq, Dv]`` on the CPU, token by token and head by head (see the module docstring)."""
    group = case.num_heads // case.num_kv_heads
    out = torch.zeros(q.shape[0], case.num_heads, v_new.shape[2], dtype=torch.float64)
    t0 = 0
    for row, prefix, parents in zip(rows, case.prefix, case.parents):
        slots = [int(req_to_token[row, j]) for j in range(prefix)]
        for i in range(len(parents)):
            path = walk(parents, i)
            q_pos = prefix + len(path) - 1
            keys = [k_pool[s].double().cpu() for s in slots] + [k_new[t0 + a].double().cpu() for a in path]
            vals = [v_pool[s].double().cpu() for s in slots] + [v_new[t0 + a].double().cpu() for a in path]
            k_pos = list(range(prefix)) + [prefix + len(walk(parents, a)) - 1 for a in path]
            keep = [layer.sliding_window is None or p > q_pos - layer.sliding_window for p in k_pos]
            keys = torch.stack([k for k, ok in zip(keys, keep) if ok])
            vals = torch.stack([v for v, ok in zip(vals, keep) if ok])
            for h in range(case.num_heads):
                s = keys[:, h // group] @ q[t0 + i, h].double().cpu() * layer.scaling
                if layer.logit_cap > 0:
                    s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
                out[t0 + i, h] = torch.softmax(s, dim=0) @ vals[:, h // group]
        t0 += len(parents)
    return out


@dataclass
class VerifyRun:
    """What ``run_verify`` ran: the batch, the cache and backend, and per layer its inputs and output."""

    case: VerifyCase
    kv: KVCache
    backend: object
    batch: ForwardBatch
    rows: list[int]
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    outputs: list[torch.Tensor]

    def errors(self) -> list[float]:
        """Per layer: max relative error against ``reference_verify`` (the requests' tokens: a graph view's padding
        tokens after them are left out)."""
        errs = []
        n = sum(self.case.extend)
        for layer, (q, k, v), out in zip(self.case.layers(), self.inputs, self.outputs):
            k_pool, v_pool = self.kv.pool.get_kv(layer.layer_id)
            expected = reference_verify(q[:n], k[:n], v[:n], k_pool, v_pool, self.kv.req_to_token, self.rows,
                                        self.case, layer)
            errs.append(max_rel_error(out[:n], expected))
        return errs


def run_verify(case: VerifyCase, backend_name: str, device: str, dtype: torch.dtype, *, seed: int = 0,
               backend_kwargs: dict | None = None, tree: bool = True, graph_bucket: int | None = None) -> VerifyRun:
    """Build ``case`` as a TARGET_VERIFY batch (``tree=False``: without draft_parents, so only chains are meant) and
    run every layer through the attention op on ``backend_name``. ``graph_bucket`` (requests of one length Q): run it
    as a graph runner's verify view padded to that many requests (``ReplayViews.verify_view``), its metadata through
    out_graph and in_graph over the backend's static buffers; ``VerifyRun.batch`` is then the view."""
    gen = torch.Generator().manual_seed(seed)
    kv = case.make_kv(device, dtype)
    rows = [kv.alloc_request() for _ in case.parents]
    fill_prefixes(kv, rows, list(case.prefix), gen)
    loc = kv.alloc_extend(rows, case.extend)
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=case.prefix, extend_lens=case.extend,
                            out_cache_loc=loc, forward_mode=ForwardMode.TARGET_VERIFY,
                            draft_parents=case.parents if tree else None, device=device)
    backend = create_backend(backend_name, kv, case.layers(), **(backend_kwargs or {}))
    if graph_bucket is None:
        backend.init_forward_metadata(fb)
    else:
        fb = verify_graph_view(backend, fb, graph_bucket)
    n = fb.num_tokens

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 2).to(device=device, dtype=dtype)

    inputs, outputs = [], []
    for layer in case.layers():
        q, k, v = rand(n, case.num_heads, case.head_dim), rand(n, case.num_kv_heads, case.head_dim), rand(
            n, case.num_kv_heads, case.head_dim)
        out = torch.full((n, case.num_heads, case.head_dim), math.nan, dtype=dtype, device=device)
        with forward_context(fb, backend):
            torch.ops.compile_attn.attention(q, k, v, out, layer.layer_id)
        assert not out.isnan().any(), f"layer {layer.layer_id}: NaN in the output"
        inputs.append((q, k, v))
        outputs.append(out)
    return VerifyRun(case, kv, backend, fb, rows, inputs, outputs)


def path_chain_outputs(run: VerifyRun, backend_name: str, backend_kwargs: dict | None = None) -> list[torch.Tensor]:
    """Per layer, each new token's output when its root-to-node path runs alone as a causal chain (one EXTEND request
    per token, over a copy of its request's prefix): a check of the tree that uses no tree mask."""
    case, kv, device = run.case, run.kv, run.batch.device
    rows, prefix, paths, owners = [], [], [], []
    t0 = 0
    for row, p, parents in zip(run.rows, case.prefix, case.parents):
        for i in range(len(parents)):
            path = [t0 + a for a in reversed(walk(parents, i))]  # root first
            new_row = kv.alloc_request()
            copy = kv.alloc_extend([new_row], [p])
            for layer_id in range(kv.pool.num_layers):
                k_pool, v_pool = kv.pool.get_kv(layer_id)
                src = kv.req_to_token[row, :p].long()
                kv.pool.set_kv(layer_id, copy, k_pool[src].clone(), v_pool[src].clone())
            rows.append(new_row)
            prefix.append(p)
            paths.append(path)
            owners.append(t0 + i)
        t0 += len(parents)
    loc = kv.alloc_extend(rows, [len(x) for x in paths])
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=prefix, extend_lens=[len(x) for x in paths],
                            out_cache_loc=loc, forward_mode=ForwardMode.EXTEND, device=device)
    backend = create_backend(backend_name, kv, case.layers(), **(backend_kwargs or {}))
    backend.init_forward_metadata(fb)
    gather = torch.tensor([t for x in paths for t in x], device=device)
    last = torch.tensor([sum(len(x) for x in paths[: j + 1]) - 1 for j in range(len(paths))], device=device)
    results = []
    for layer, (q, k, v), tree_out in zip(case.layers(), run.inputs, run.outputs):
        out = torch.full((gather.shape[0], case.num_heads, case.head_dim), math.nan, dtype=q.dtype, device=device)
        with forward_context(fb, backend):
            torch.ops.compile_attn.attention(q[gather], k[gather], v[gather], out, layer.layer_id)
        per_token = torch.empty_like(tree_out)
        per_token[torch.tensor(owners, device=device)] = out[last]
        results.append(per_token)
    return results


def verify_graph_view(backend: object, fb: ForwardBatch, bucket: int) -> ForwardBatch:
    """``fb`` (chains, or draft trees, of one length Q) as a graph runner's verify view of ``bucket`` requests over
    fresh static buffers (the backend's sized for them), its metadata prepared as a graph replay does (out_graph, then
    in_graph); draft trees go with the view as a tree verify graph's runner passes them (padded requests: chains)."""
    lens = set(fb.extend_seq_lens_cpu)
    assert len(lens) == 1, "a verify view needs requests of one length"
    q = lens.pop()
    buffers = StaticBuffers(bucket * q, bucket * q, fb.device)
    view = ReplayViews(buffers, backend.get_cuda_graph_seq_len_fill_value()).verify_view(fb, bucket, q)
    if fb.draft_parents is not None:
        view.draft_parents = view_parents(fb.draft_parents, bucket, q)
    backend.init_cuda_graph_state(buffers.max_batch_size, buffers.max_num_tokens)
    backend.init_forward_metadata_out_graph(view)
    backend.init_forward_metadata_in_graph(view)
    return view
