"""Test helpers for the graph runner: a tiny model, a call-counting backend, and a driver that runs the
same random steps on two KV caches in lockstep (one through the GraphRunner, one plainly eager).

The counting backend subclasses torch_native and only records calls (kernels are real); ``VerifyModeNative`` adds a
graph-recordable verify mode to it, standing in on the CPU for the triton backend's (whose kernels are interpreted
there, so never in a full graph). The eager
reference never touches the runner: it calls ``init_forward_metadata`` and the model directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from compile_attn import ForwardBatch, ForwardMode, KVCache, forward_context, get_forward_context
from compile_attn.attention.torch_native.backend import TorchNativeBackend, _gather, _masked_attention, _visibility
from compile_attn.draft_tree import ancestor_mask
from compile_attn.models import ToyDecoder, ToyDecoderConfig

SMALL = ToyDecoderConfig(
    vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64
)


def make_model(
    cfg: ToyDecoderConfig = SMALL, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
):
    torch.manual_seed(seed)
    return ToyDecoder(cfg).to(device=device, dtype=dtype).eval()


def make_kv(
    cfg: ToyDecoderConfig = SMALL,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    max_batch_size: int = 24,
    max_context: int = 96,
    kv_cache_tokens: int = 4096,
) -> KVCache:
    return KVCache(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_batch_size=max_batch_size,
        max_context=max_context,
        kv_cache_tokens=kv_cache_tokens,
        dtype=dtype,
        device=device,
    )


class CountingBackend(TorchNativeBackend):
    """torch_native that records each contract call: (name, graph_bucket, in_capture / graph_mode)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple] = []

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.calls.append(("init_cuda_graph_state", max_bs, max_num_tokens))
        super().init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        self.calls.append(("out_graph", fb.graph_bucket, in_capture))
        super().init_forward_metadata_out_graph(fb, in_capture)

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        self.calls.append(("in_graph", fb.graph_bucket))
        super().init_forward_metadata_in_graph(fb)

    def forward(self, q, k, v, layer, fb, out, save_kv_cache=True) -> None:
        mode = get_forward_context().graph_mode  # a GraphMode; recorded by its value ("full", "piecewise", ...)
        self.calls.append(("forward", fb.graph_bucket, None if mode is None else mode.value))
        super().forward(q, k, v, layer, fb, out, save_kv_cache)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class VerifyModeNative(CountingBackend):
    """torch_native with a verify mode: a graph runner's verify view (Q tokens per request) attends like decode with Q
    rows per request over the static slot table, filled in graph, so CPU op tapes replay it like a CUDA graph; a tree
    view's ancestor masks go into a static buffer out of graph, as the triton backend's tree masks do.
    Other batches (eager verify batches included) take torch_native's own paths."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.verify_table: torch.Tensor | None = None
        self.tree_allowed: torch.Tensor | None = None  # a tree view's [B, Q, Q] ancestor masks (static, per Q)
        self._tree_buffers: dict[int, torch.Tensor] = {}
        self.verify_forwards = self.tree_forwards = 0

    def supports_verify_mode(self, tokens_per_request: int) -> bool:
        return True

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        super().init_forward_metadata_out_graph(fb, in_capture)
        lens = fb.extend_seq_lens_cpu
        q = lens[0] if fb.forward_mode.is_verify() and fb.batch_size and lens.count(lens[0]) == len(lens) else None
        view = fb.graph_bucket is not None and q is not None and fb.num_tokens == fb.batch_size * q
        self.verify_table = self._cg_table[: fb.batch_size] if view else None
        self.tree_allowed = None
        if view and fb.draft_parents is not None:  # written out of graph into a buffer the recorded steps read
            buf = self._tree_buffers.setdefault(q, torch.zeros(self._cg_table.shape[0], q, q, dtype=torch.bool,
                                                               device=self.device))
            self.tree_allowed = buf[: fb.batch_size]
            self.tree_allowed.copy_(torch.stack([ancestor_mask(p) for p in fb.draft_parents]))

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        super().init_forward_metadata_in_graph(fb)
        if self.verify_table is not None:
            width = self.verify_table.shape[1]
            self.verify_table.copy_(self.kv_cache.req_to_token[fb.req_pool_indices, :width])

    def forward_extend(self, q, k, v, layer, fb, out, save_kv_cache) -> None:  # noqa: ANN001
        table = self.verify_table
        if table is None:
            return super().forward_extend(q, k, v, layer, fb, out, save_kv_cache)
        self.verify_forwards += 1
        if save_kv_cache:
            self.save_kv(layer, fb, k, v)
        bs, width = table.shape
        nq = fb.num_tokens // bs
        k_all, v_all = _gather(self.kv_cache.pool, layer.layer_id, table.long())
        k_pos = torch.arange(width, device=q.device).expand(bs, width)
        q_pos = fb.seq_lens.long()[:, None] - nq + torch.arange(nq, device=q.device)
        allowed = _visibility(q_pos, k_pos, k_pos < fb.seq_lens[:, None], layer)
        if self.tree_allowed is not None:  # of the last nq keys, a token sees its ancestors and itself
            self.tree_forwards += 1
            draft = k_pos - (fb.seq_lens.long()[:, None] - nq)
            seen = self.tree_allowed.gather(2, draft.clamp(0, nq - 1)[:, None, :].expand(bs, nq, width))
            allowed &= (draft < 0)[:, None, :] | seen
        qh = q.float().view(bs, nq, layer.num_kv_heads, layer.group_size, layer.head_dim)
        out.copy_(_masked_attention(qh, k_all, v_all, allowed, layer).reshape(out.shape))


def eager_reference(model, backend, fb: ForwardBatch) -> torch.Tensor:
    """Plain eager step, independent of the runner."""
    backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(fb, backend):
        return model(fb.input_ids, fb.positions)


@dataclass
class Step:
    runner_batch: ForwardBatch  # on the runner's cache
    ref_batch: ForwardBatch  # same step on the reference cache
    kind: str  # "decode" | "extend" | "mixed"


class Twin:
    """Two KV caches driven with the same requests; each cache allocates its own rows and slots.

    Requests are named by ids (keys of ``lens``); ``rows[id]`` holds the row in each cache. The caches
    need not allocate identically (verify, for one, allocates in the runner's cache only).
    """

    def __init__(
        self,
        cfg: ToyDecoderConfig = SMALL,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        **kv_kwargs,
    ) -> None:
        self.cfg, self.device = cfg, device
        self.caches = [make_kv(cfg, device, dtype, **kv_kwargs) for _ in range(2)]
        self.rng = random.Random(seed)
        self.lens: dict[int, int] = {}  # live request id -> tokens cached
        self.rows: dict[int, tuple[int, int]] = {}  # request id -> (row in cache 0, row in cache 1)
        self._next_id = 0

    @property
    def max_context(self) -> int:
        return self.caches[0].max_context

    def new_requests(self, n: int) -> list[int]:
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        for i in ids:
            self.rows[i] = (self.caches[0].alloc_request(), self.caches[1].alloc_request())
            self.lens[i] = 0
        return ids

    def finish(self, ids: list[int]) -> None:
        for i in ids:
            for kv, row in zip(self.caches, self.rows.pop(i)):
                kv.free_request(row)
            del self.lens[i]

    def step(self, ids: list[int], extend_lens: list[int], mode: ForwardMode | None = None,
             draft_parents: tuple[tuple[int, ...], ...] | None = None) -> Step:
        prefix = [self.lens[i] for i in ids]
        tokens = [self.rng.randrange(self.cfg.vocab_size) for _ in range(sum(extend_lens))]
        fbs = []
        for c, kv in enumerate(self.caches):
            rows = [self.rows[i][c] for i in ids]
            loc = kv.alloc_extend(rows, extend_lens)
            fbs.append(
                ForwardBatch.build(
                    req_pool_indices=rows,
                    prefix_lens=prefix,
                    extend_lens=extend_lens,
                    out_cache_loc=loc,
                    input_ids=tokens,
                    forward_mode=mode,
                    draft_parents=draft_parents,
                    device=self.device,
                )
            )
        for i, e in zip(ids, extend_lens):
            self.lens[i] += e
        kind = (
            "decode"
            if fbs[0].forward_mode.is_decode()
            else ("mixed" if mode is ForwardMode.MIXED else "extend")
        )
        return Step(fbs[0], fbs[1], kind)

    # ------------------------------------------------------------------ random steps
    def room(self, ids: list[int], need: int) -> list[int]:
        return [i for i in ids if self.lens[i] + need <= self.max_context]

    def decode_step(self, bs: int) -> Step:
        """``bs`` live requests add one token each."""
        live = self.room(list(self.lens), 1)
        self.rng.shuffle(live)
        return self.step(live[:bs], [1] * bs)

    def extend_step(self, num_tokens: int, max_batch_size: int) -> Step:
        """New requests (and sometimes continuing ones: chunked prefill) adding ``num_tokens`` in total."""
        n = self.rng.randint(1, max(1, min(max_batch_size, num_tokens)))
        cuts = sorted(self.rng.sample(range(1, num_tokens), n - 1)) if n > 1 else []
        ext = [b - a for a, b in zip([0, *cuts], [*cuts, num_tokens])]
        continuing = [i for i in self.room(list(self.lens), max(ext)) if self.lens[i] > 0]
        self.rng.shuffle(continuing)
        reuse = continuing[: self.rng.randint(0, min(len(continuing), n - 1))] if n > 1 else []
        ids = reuse + self.new_requests(n - len(reuse))
        mixed = any(e == 1 for e in ext) and any(self.lens[i] > 0 for i in ids)
        return self.step(ids, ext, ForwardMode.MIXED if mixed else ForwardMode.EXTEND)

    def trim(self, keep: int) -> None:
        """Finish requests near their max_context, then random ones until at most ``keep`` are live."""
        self.finish([i for i in self.lens if self.lens[i] >= self.max_context - 8])
        live = list(self.lens)
        self.rng.shuffle(live)
        if len(live) > keep:
            self.finish(live[keep:])

    def pools_equal(self) -> bool:
        """Every live request's cached K/V is the same in both caches (read through each one's slots)."""
        for i, n in self.lens.items():
            slots = [kv.req_to_token[row, :n].long() for kv, row in zip(self.caches, self.rows[i])]
            a, b = (kv.pool for kv in self.caches)
            for layer in range(a.num_layers):
                for x, y in (
                    (a.k_buffers[layer], b.k_buffers[layer]),
                    (a.v_buffers[layer], b.v_buffers[layer]),
                ):
                    if not torch.allclose(x[slots[0]].float(), y[slots[1]].float(), atol=1e-5, rtol=1e-4):
                        return False
        return True


def run_scenario(
    runner,
    model,
    ref_backend,
    twin: Twin,
    plan: list[tuple[str, int]],
    *,
    max_extend_requests: int = 4,
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> list[Step]:
    """Run ``plan`` (``("decode", batch_size)`` / ``("extend", num_tokens)``) through the runner and the
    eager reference; every step's output must match. Returns the steps run (helper prefills included)."""
    done: list[Step] = []

    def check(step: Step) -> None:
        out = runner.run(step.runner_batch)
        ref = eager_reference(model, ref_backend, step.ref_batch)
        assert out.shape == ref.shape, (step.kind, out.shape, ref.shape)
        torch.testing.assert_close(
            out,
            ref,
            atol=atol,
            rtol=rtol,
            msg=lambda m: (
                f"{step.kind} step of {step.runner_batch.batch_size} requests, "
                f"{step.runner_batch.num_tokens} tokens: {m}"
            ),
        )
        done.append(step)

    free_rows = twin.caches[0].req_to_token_pool.max_batch_size
    for kind, n in plan:
        if kind == "decode":
            twin.trim(keep=max(n, free_rows - max_extend_requests))
            missing = n - len(twin.room(list(twin.lens), 1))
            if missing > 0:  # prefill enough requests first
                rows = twin.new_requests(missing)
                check(twin.step(rows, [twin.rng.randint(1, 6) for _ in rows]))
            check(twin.decode_step(n))
        else:
            twin.trim(keep=free_rows - max_extend_requests)
            check(twin.extend_step(n, max_extend_requests))
    return done
