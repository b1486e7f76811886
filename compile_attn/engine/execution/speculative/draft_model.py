"""Draft-model proposals: a smaller model of the target's tokenizer, run by the engine's own machinery (its own KV
cache, attention backend and graph runner), proposes each request's next K tokens greedily.

Per engine step, for the requests that may draft: one extend step feeds each request the tokens its draft KV does
not hold yet (usually the target's newest token and the drafts it accepted; the whole prompt the first time, in
chunks of ``max_num_tokens``) and takes the argmax of its last row; then K - 1 decode steps (full decode graphs)
feed those argmaxes back on the device (``TokenFeed`` placeholders: no host round trip between them) and take
theirs. The K drafts per request come back to the host in one copy. The draft's KV then holds the request's tokens
and its first K - 1 drafts; at the next proposal whatever of those the target did not keep is cut off
(``KVCache.truncate``), so accepted drafts' KV is reused and nothing is recomputed.

Greedy drafts are point masses, so ``acceptance.accept_chain``'s rule keeps sampled requests' outputs exactly the
target's distribution. A request whose draft KV does not fit (the draft cache is full) gets no drafts this step;
rows of requests that finish or are preempted are given back after the step (``forget``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from compile_attn.attention import create_backend
from compile_attn.batch import ForwardBatch
from compile_attn.engine.execution.kv_sizing import kv_bytes_per_token
from compile_attn.engine.execution.model_loading import load_for_engine
from compile_attn.engine.execution.step_runner import StepRunner
from compile_attn.engine.requests.admission import find_vocab_size
from compile_attn.engine.requests.errors import EngineOptionError
from compile_attn.engine.requests.request import Request
from compile_attn.errors import KVCacheExhaustedError
from compile_attn.graph_runner.step_kernels import TokenFeed
from compile_attn.host_tensors import to_device
from compile_attn.kv.cache import KVCache

logger = logging.getLogger(__name__)


@dataclass
class _DraftRow:
    """A request's row in the draft's KV cache and the token ids whose KV it holds, in order; the last
    ``unverified`` of them are drafts the target had not seen when they were written."""

    row: int
    held: list[int]
    unverified: int = 0

    def shared_with(self, tokens: Any) -> int:
        """How many of the held tokens ``tokens`` starts with (only the unverified tail is compared)."""
        same = len(self.held) - self.unverified
        end = min(len(self.held), len(tokens))
        while same < end and self.held[same] == tokens[same]:
            same += 1
        return same


@dataclass(frozen=True)
class DraftEngineOptions:
    """What the draft runs with, taken from the target engine's options: the draft shares its device, dtype,
    attention backend, page size, graph mode and compile switch, and its sizes."""

    device: torch.device
    dtype: torch.dtype
    attn_backend: str
    page_size: int
    graph_mode: Any
    compile: bool
    compile_options: dict[str, Any] | None
    max_batch_size: int
    max_num_tokens: int
    max_context: int


class DraftModelProposer:
    """Proposes up to ``num_speculative_tokens`` greedy drafts per request with a draft model (``model``: an HF
    directory, a ``transformers`` config, an HF model or a protocol model, as ``LLM``'s ``model``)."""

    def __init__(self, model: Any, num_speculative_tokens: int, options: DraftEngineOptions,
                 target_vocab_size: int | None) -> None:
        self.k = num_speculative_tokens
        self.options = options
        loaded = load_for_engine(model, tokenizer=None, dtype=options.dtype, device=options.device)
        self.model = loaded.model
        self.vocab_size = find_vocab_size(self.model)
        if target_vocab_size is not None and self.vocab_size is not None and self.vocab_size != target_vocab_size:
            raise EngineOptionError(
                f"speculative_config: the draft model's vocabulary has {self.vocab_size} tokens and the target's "
                f"{target_vocab_size}; a draft model must share the target's tokenizer (e.g. a smaller model of the "
                f"same family)")
        self.layers = self.model.attention_layers()
        self.kv_cache: KVCache | None = None  # made by ``build`` once the target knows how many tokens it holds
        self.runner: StepRunner | None = None
        self._rows: dict[int, _DraftRow] = {}  # request id -> its draft row
        self.steps = 0  # draft-model forwards run (extend and decode)

    def share_of(self, kv_cache_tokens: int, target_layers: list[Any], page_size: int,
                 target_kv_dtype: torch.dtype) -> int:
        """The target's KV tokens when the memory sized for ``kv_cache_tokens`` of the target's KV alone holds both
        caches, the draft's of the same token count (whole pages, at least one). The draft's KV is kept in the
        model dtype whatever the target's KV dtype."""
        target = kv_bytes_per_token(target_layers, target_kv_dtype)
        both = target + kv_bytes_per_token(self.layers, self.options.dtype)
        tokens = kv_cache_tokens * target // both // page_size * page_size
        logger.info("KV memory shared with the draft model: %d target tokens (of %d sized for the target alone)",
                    tokens, kv_cache_tokens)
        return max(tokens, page_size)

    def build(self, kv_cache_tokens: int) -> None:
        """Make the draft's KV cache (``kv_cache_tokens`` tokens, the target's count: every request's draft KV
        mirrors its target KV plus K - 1 drafts), backend and step runner."""
        o = self.options
        self.kv_cache = KVCache.for_layers(self.layers, max_batch_size=o.max_batch_size, max_context=o.max_context,
                                           kv_cache_tokens=kv_cache_tokens, page_size=o.page_size, dtype=o.dtype,
                                           device=o.device)
        backend = create_backend(o.attn_backend, self.kv_cache, self.layers)
        self.runner = StepRunner(self.model, backend, graph_mode=o.graph_mode, compile=o.compile,
                                 compile_options=o.compile_options, max_batch_size=o.max_batch_size,
                                 max_num_tokens=o.max_num_tokens)
        logger.info("draft model: %d layers, KV cache %d tokens (%.1f MiB)", len(self.layers), kv_cache_tokens,
                    self.kv_cache.pool.bytes / 2**20)

    def capture(self) -> None:
        """Capture the draft's graphs (its decode buckets and extend route) before traffic."""
        assert self.runner is not None, "build() first"
        self.runner.capture()

    # ------------------------------------------------------------------ proposing
    def forget(self, live: set[int]) -> None:
        """Free the draft rows of requests not in ``live`` (finished, aborted or preempted: a preempted request
        catches up again when it next drafts)."""
        gone = [rid for rid in self._rows if rid not in live]
        if gone:
            assert self.kv_cache is not None
            self.kv_cache.free_requests([self._rows.pop(rid).row for rid in gone])

    @torch.no_grad()  # not inference_mode: batches built in it would not match the graphs' guards (StepRunner.run)
    def propose(self, requests: list[Request], rooms: list[int], tree: tuple[int, int] | None = None,
                ) -> list[tuple[list[int], list[int] | None]]:
        """Drafts for each of ``requests`` (decoding, every token known), as (tokens, parents): a chain of at most
        ``min(K, rooms[i])`` tokens (parents None), or with ``tree`` = (topk, max nodes) the tree of the top-``topk``
        tokens at each depth of that chain (``top_k_tree``)."""
        assert self.kv_cache is not None and self.runner is not None, "build() first"
        limits = [min(self.k, room) for room in rooms]
        reqs, feeds, limits = self._catch_up_rows(requests, limits)
        out: dict[int, tuple[list[int], list[int] | None]] = {}
        if reqs:
            topk = tree[0] if tree is not None else 1
            for r, (tokens, logprobs) in zip(reqs, self._draft(reqs, feeds, limits, topk)):
                if tree is None:
                    out[r.request_id] = ([row[0] for row in tokens], None)
                else:
                    cap = min(tree[1], self.options.max_context - len(r.token_ids) - 1)
                    out[r.request_id] = top_k_tree(tokens, logprobs, cap)
        return [out.get(r.request_id, ([], None)) for r in requests]

    def _catch_up_rows(self, requests: list[Request], limits: list[int],
                       ) -> tuple[list[Request], list[list[int]], list[int]]:
        """For each request that drafts: its row (made on first use) cut back to the tokens it shares with the
        request, and the tokens to feed it. Requests whose KV does not fit are left out."""
        kv = self.kv_cache
        assert kv is not None
        drafting, cut_rows, cut_lens = [], [], []
        for r, limit in zip(requests, limits):
            if limit <= 0:
                continue
            state = self._rows.get(r.request_id)
            if state is None:
                try:
                    state = self._rows[r.request_id] = _DraftRow(kv.alloc_request(), [])
                except KVCacheExhaustedError:
                    continue
            tokens = r.token_ids
            same = state.shared_with(tokens)
            state.unverified = 0
            if same == len(tokens):  # the draft holds every token: feed the last again over its own slot
                same -= 1
            if same < len(state.held):
                cut_rows.append(state.row)
                cut_lens.append(same)
                del state.held[same:]
            drafting.append((r, state, same, limit))
        kv.truncate_rows(cut_rows, cut_lens)  # the drafts the target did not keep: one device op for all
        reqs, feeds, kept = [], [], []
        free_pages = kv.allocator.available  # what this proposal's allocations may take, request by request
        for r, state, same, limit in drafting:
            tokens = r.token_ids
            room = min(limit, kv.max_context - len(tokens) + 1)  # the draft's KV grows to len + limit - 1
            pages = kv.pages_needed(state.row, len(tokens) - same + room - 1) if room > 0 else 0
            if room <= 0 or pages > free_pages:  # no room in the context or in the draft's cache: no drafts
                continue
            free_pages -= pages
            reqs.append(r)
            feeds.append(list(tokens[same:]))
            kept.append(room)
        return reqs, feeds, kept

    def _draft(self, reqs: list[Request], feeds: list[list[int]], limits: list[int], topk: int,
               ) -> list[tuple[list[list[int]], list[list[float]] | None]]:
        """Run the catch-up extend and the decode steps (each feeding the previous step's argmax); per request,
        the top-``topk`` tokens at each of its ``limits[i]`` depths (best first: the chain is column 0) and, for
        ``topk`` > 1, their log-probabilities. One copy to the host."""
        kv, runner, device = self.kv_cache, self.runner, self.options.device
        assert kv is not None and runner is not None
        last, last_lp = self._extend(reqs, feeds, topk)  # [n, topk] device: each request's first drafts
        states = [self._rows[r.request_id] for r in reqs]
        columns, lp_columns = [last], [last_lp]
        alive = list(range(len(reqs)))  # rows still drafting: those whose limit is not reached
        for step in range(1, max(limits)):
            keep = [i for i in alive if limits[i] > step]
            if not keep:
                break
            chain = columns[-1][:, 0]
            feed_from = chain if len(keep) == len(reqs) else chain[to_device([keep], torch.int64, device)[0]]
            alive = keep
            rows = [states[i].row for i in alive]
            lens = [len(states[i].held) for i in alive]
            loc = kv.alloc_extend(rows, [1] * len(rows), defer_table_write=True)
            fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=lens, extend_lens=[1] * len(rows),
                                    out_cache_loc=loc, input_ids=[-(j + 1) for j in range(len(rows))],
                                    device=device, table_write_pending=True)
            logits = runner.run(fb, None, TokenFeed(feed_from, self.vocab_size))
            self.steps += 1
            for i in alive:
                states[i].held.append(-1)  # the draft token's value is known after the copy below
            nxt, nxt_lp = _top(logits, topk)
            if len(alive) < len(reqs):  # scatter into full-width columns (stopped rows: cut off below)
                at = to_device([alive], torch.int64, device)[0]
                nxt = torch.full((len(reqs), topk), -1, dtype=torch.int64, device=nxt.device).index_copy_(0, at, nxt)
                if nxt_lp is not None:
                    nxt_lp = torch.full((len(reqs), topk), float("-inf"), device=nxt_lp.device).index_copy_(
                        0, at, nxt_lp)
            columns.append(nxt)
            lp_columns.append(nxt_lp)
        table = torch.stack(columns, dim=1).tolist()  # [n, steps, topk]: the copies to the host
        lps = torch.stack(lp_columns, dim=1).tolist() if topk > 1 else None
        out = []
        for i, (state, rows, limit) in enumerate(zip(states, table, limits)):
            d = [int(row[0]) for row in rows[:limit]]
            # The KV written by the decode steps belongs to the first limit - 1 drafts of the chain.
            fed = len(d) - 1
            if fed:
                state.held[len(state.held) - fed:] = d[:fed]
            state.unverified = fed
            out.append((rows[:limit], lps[i][:limit] if lps is not None else None))
        return out

    def _extend(self, reqs: list[Request], feeds: list[list[int]], topk: int,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed each request its missing tokens (chunks of at most ``max_num_tokens`` tokens per step); the
        top-``topk`` tokens of each request's last row ([n, topk] int64 on the device) and, for ``topk`` > 1, their
        log-probabilities."""
        kv, runner, device = self.kv_cache, self.runner, self.options.device
        assert kv is not None and runner is not None
        states = [self._rows[r.request_id] for r in reqs]
        pending = [list(f) for f in feeds]
        budget = self.options.max_num_tokens
        result: torch.Tensor | None = None
        result_lp: torch.Tensor | None = None
        while any(pending):
            take, left = [], budget
            for p in pending:  # each request takes what is left of the budget, in order; the last ones wait
                n = min(len(p), left)
                take.append(n)
                left -= n
            picked = [i for i, n in enumerate(take) if n > 0]
            rows = [states[i].row for i in picked]
            prefix = [len(states[i].held) for i in picked]
            lens = [take[i] for i in picked]
            ids = [t for i in picked for t in pending[i][: take[i]]]
            loc = kv.alloc_extend(rows, lens)
            fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=prefix, extend_lens=lens, out_cache_loc=loc,
                                    input_ids=ids, device=device)
            done_now = [j for j, i in enumerate(picked) if take[i] == len(pending[i])]
            ends, total = [], 0
            for n in lens:
                total += n
                ends.append(total - 1)
            keep = to_device([[ends[j] for j in done_now]], torch.int64, device)[0]
            firsts, firsts_lp = _top(runner.run(fb, keep), topk)
            self.steps += 1
            for i in picked:
                states[i].held.extend(pending[i][: take[i]])
                pending[i] = pending[i][take[i]:]
            if result is None:
                result = torch.empty(len(reqs), topk, dtype=torch.int64, device=firsts.device)
                result_lp = torch.empty(len(reqs), topk, device=firsts.device) if firsts_lp is not None else None
            at = to_device([[picked[j] for j in done_now]], torch.int64, device)[0]
            result[at] = firsts
            if result_lp is not None:
                result_lp[at] = firsts_lp
        assert result is not None
        return result, result_lp


def _top(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``topk`` best tokens of each row ([n, topk], best first) and, for ``topk`` > 1, their log-probabilities
    (a chain needs the argmax only)."""
    if topk == 1:
        return logits.argmax(dim=-1, keepdim=True), None
    values, tokens = torch.log_softmax(logits.float(), dim=-1).topk(topk, dim=-1)
    return tokens, values


def top_k_tree(tokens: list[list[int]], logprobs: list[list[float]] | None, max_nodes: int,
               ) -> tuple[list[int], list[int]]:
    """A draft tree from a greedy chain and its runners-up: ``tokens[d]`` are the draft's best tokens at depth d + 1
    after the chain's first d tokens (``tokens[d][0]`` is the chain's), ``logprobs[d]`` theirs. Every candidate is a
    node whose parent is the chain's node one depth up (the root for depth 1); the ``max_nodes`` of highest path
    log-probability are kept (a parent never scores below its child, so the kept set is a tree), parents first.
    Returns (tokens, parents), parents indexing the tokens (-1: the root)."""
    assert logprobs is not None
    candidates = []  # (path log-probability, depth, rank, token)
    path = 0.0  # the chain's path log-probability down to depth d
    for d, (toks, lps) in enumerate(zip(tokens, logprobs)):
        for rank, (tok, lp) in enumerate(zip(toks, lps)):
            if tok >= 0 and lp > float("-inf"):
                candidates.append((path + lp, d, rank, tok))
        path += lps[0]
    kept = sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))[:max(max_nodes, 0)]
    kept.sort(key=lambda c: (c[1], c[2]))  # by depth: parents first, the chain's node first at its depth
    index = {(d, rank): i for i, (_, d, rank, _) in enumerate(kept)}
    out_tokens = [tok for *_, tok in kept]
    parents = [-1 if d == 0 else index[(d - 1, 0)] for _, d, _, _ in kept]
    return out_tokens, parents

