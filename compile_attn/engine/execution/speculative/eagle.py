"""EAGLE proposals: an EAGLE-1/2 head (``eagle_head.py``) drafts each request's next K tokens greedily from the
target's hidden states, run like a draft model (``DraftModelProposer``'s KV cache, backend, StepRunner and graphs;
one KV layer per head layer).

Pairs: the head's KV row holds one entry per pair (x_{t+1}, f_t), f_t being the target's final hidden state at
position t (``observe`` keeps each step's rows per target KV row, on the device, no host sync). Per engine step,
for the requests that may draft: one extend step feeds each request the pairs its row lacks (the target's features
of the tokens verified since, the whole prompt the first time) and takes the argmax of its last row; then K - 1
decode steps feed that argmax with the head's own output hidden state as the next pair (``TokenFeed``
placeholders and the ``features`` buffer: no host round trip); the K drafts come to the host in one copy. The
pairs written by decode steps carry the head's features, not the target's, so the next proposal cuts them off and
feeds the accepted tokens' pairs again with the target's (as EAGLE and vLLM do): a verify step's accepted
drafts cost one pair each in the next extend. Chains only (topk 1).

A request whose first tokens came from the prefix cache has no target features for them: its head row starts at
the first position with one (positions in the row are relative; RoPE attention depends on differences only), which
can lower acceptance but never changes outputs (the target verifies every draft).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from compile_attn.batch import ForwardBatch
from compile_attn.config import GraphConfig
from compile_attn.engine.execution.speculative.draft_model import DraftEngineOptions, DraftModelProposer
from compile_attn.engine.execution.speculative.eagle_head import load_eagle_head
from compile_attn.engine.requests.request import Request
from compile_attn.errors import KVCacheExhaustedError
from compile_attn.graph_runner.step_kernels import TokenFeed
from compile_attn.host_tensors import to_device

logger = logging.getLogger(__name__)


@dataclass
class _HeadRow:
    """A request's row in the head's KV: pairs for positions ``start`` .. ``start + fed - 1`` carry the target's
    features; ``length`` - ``fed`` more were written by the last proposal's decode steps (cut at the next)."""

    row: int
    start: int
    fed: int = 0
    length: int = 0


@dataclass
class _Features:
    """The target's final hidden states of positions ``start`` .. ``start + len(rows) - 1`` of one KV row."""

    start: int
    rows: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]


class EagleProposer(DraftModelProposer):
    """Proposes up to ``num_speculative_tokens`` greedy drafts per request with the EAGLE head in ``path``."""

    def __init__(self, path: Any, num_speculative_tokens: int, options: DraftEngineOptions, target: Any) -> None:
        self.k = num_speculative_tokens
        self.options = options
        self.model = load_eagle_head(path, target, options.dtype, options.device)
        self.vocab_size = self.model.vocab_size
        self.layers = self.model.attention_layers()
        self.kv_cache = None
        self.runner = None
        self._rows: dict[int, _HeadRow] = {}  # request id -> its head row (``forget`` frees them)
        self._features: dict[int, _Features] = {}  # target KV row -> its target features not fed yet
        self._owner: dict[int, int] = {}  # target KV row -> the request that last drafted from it
        self._out: torch.Tensor | None = None  # the head's hidden states of its last step (graph memory)
        self.steps = 0

    def build(self, kv_cache_tokens: int) -> None:
        """The head's KV cache, backend and runner (``DraftModelProposer.build``) and its feature buffer, as many
        rows as the largest step or graph bucket."""
        o = self.options
        sizes = GraphConfig.from_options({**(o.compile_options or {}), "mode": o.graph_mode})
        rows = max(o.max_num_tokens, o.max_batch_size, *_ceil(o.max_num_tokens, sizes.extend_token_sizes),
                   *_ceil(o.max_batch_size, sizes.decode_batch_sizes))
        self.model.allocate_features(rows)
        super().build(kv_cache_tokens)
        assert self.runner is not None
        self.runner.on_hidden = self._keep_out

    def _keep_out(self, fb: ForwardBatch, hidden: torch.Tensor) -> None:
        self._out = hidden

    # ------------------------------------------------------------------ the target's features
    def observe(self, fb: ForwardBatch, hidden: torch.Tensor) -> None:
        """After each target step (``StepRunner.on_hidden``): keep each request's rows of ``hidden`` [T, H] (the
        target's final hidden states, in token order) by its KV row; a row's earlier features from this step's
        prefix on are replaced. Device copies only."""
        rows, prefix, lens = fb.req_pool_indices_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
        assert rows is not None
        off = 0
        for row, p, n in zip(rows, prefix, lens):
            part, off = hidden[off : off + n], off + n
            f = self._features.get(row)
            if f is None or not f.start <= p <= f.end:
                self._features[row] = _Features(p, part.clone())
            else:
                f.rows = torch.cat((f.rows[: p - f.start], part))

    def forget(self, live: set[int]) -> None:
        """Free the head rows of requests not in ``live`` and the features of KV rows they drafted from."""
        super().forget(live)
        for row in [row for row, rid in self._owner.items() if rid not in live]:
            self._features.pop(row, None)
            del self._owner[row]

    # ------------------------------------------------------------------ proposing
    @torch.no_grad()  # not inference_mode: batches built in it would not match the graphs' guards (StepRunner.run)
    def propose(self, requests: list[Request], rooms: list[int], tree: tuple[int, int] | None = None,
                ) -> list[tuple[list[int], list[int] | None]]:
        """A chain of at most ``min(K, rooms[i])`` drafts per request (parents None); none where the target's
        features of its newest tokens are missing or the head's KV does not fit."""
        assert tree is None, "EAGLE trees are refused by SpeculativeConfig"
        assert self.kv_cache is not None and self.runner is not None, "build() first"
        reqs, pairs, limits = self._catch_up(requests, [min(self.k, room) for room in rooms])
        out: dict[int, list[int]] = {}
        if reqs:
            for r, drafts in zip(reqs, self._draft_chain(reqs, pairs, limits)):
                out[r.request_id] = drafts
        return [(out.get(r.request_id, []), None) for r in requests]

    def _catch_up(self, requests: list[Request], limits: list[int],
                  ) -> tuple[list[Request], list[tuple[list[int], torch.Tensor]], list[int]]:
        """For each request that drafts: its head row cut back to the pairs fed with target features, and the
        pairs (tokens, features [n, H]) to feed it, up to (its newest token, the target's feature before it)."""
        kv = self.kv_cache
        assert kv is not None
        plans, cut_rows, cut_lens = [], [], []
        for r, limit in zip(requests, limits):
            tokens, last = r.token_ids, len(r.token_ids) - 2  # the newest pair: (x_{n-1}, f_{n-2})
            f = self._features.get(r.row)
            if limit <= 0 or f is None or f.end <= last or last < f.start:
                continue
            state = self._rows.get(r.request_id)
            if state is None:
                try:
                    state = self._rows[r.request_id] = _HeadRow(kv.alloc_request(), f.start)
                except KVCacheExhaustedError:
                    continue
            self._owner[r.row] = r.request_id
            first = min(state.start + state.fed, last)  # the last pair again when nothing new was verified
            if first < f.start:  # features before f.start are gone: the row starts over there
                state.start, first = f.start, f.start
            keep = first - state.start
            if keep < state.length:
                cut_rows.append(state.row)
                cut_lens.append(keep)
            state.fed = state.length = keep
            ids = list(tokens[first + 1 : last + 2])
            plans.append((r, state, ids, f, f.rows[first - f.start : last + 1 - f.start], limit))
        kv.truncate_rows(cut_rows, cut_lens)  # one device op for all
        reqs, pairs, kept = [], [], []
        free_pages = kv.allocator.available
        for r, state, ids, f, feats, limit in plans:
            room = min(limit, kv.max_context - state.length - len(ids) + 1)
            pages = kv.pages_needed(state.row, len(ids) + room - 1) if room > 0 else 0
            if room <= 0 or pages > free_pages:
                continue
            free_pages -= pages
            last = len(r.token_ids) - 2  # keep f_{n-2} only: a re-feed of the newest pair needs it
            f.rows, f.start = f.rows[last - f.start :], last
            reqs.append(r)
            pairs.append((ids, feats))
            kept.append(room)
        return reqs, pairs, kept

    def _draft_chain(self, reqs: list[Request], pairs: list[tuple[list[int], torch.Tensor]], limits: list[int],
                     ) -> list[list[int]]:
        """The extend step(s) over the pairs, then K - 1 decode steps, each feeding the previous argmax and the
        head's own hidden state of it; per request its ``limits[i]`` drafts (one copy to the host)."""
        kv, runner, device = self.kv_cache, self.runner, self.options.device
        assert kv is not None and runner is not None
        states = [self._rows[r.request_id] for r in reqs]
        token, hidden = self._extend(states, pairs)  # [n], [n, H]: each request's first draft and its hidden
        columns = [token.clone()]
        for step in range(1, max(limits)):
            alive = [i for i in range(len(reqs)) if limits[i] > step]
            at = None if len(alive) == len(reqs) else to_device([alive], torch.int64, device)[0]
            rows = [states[i].row for i in alive]
            loc = kv.alloc_extend(rows, [1] * len(rows), defer_table_write=True)
            fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[states[i].length for i in alive],
                                    extend_lens=[1] * len(rows), out_cache_loc=loc,
                                    input_ids=[-(j + 1) for j in range(len(rows))], device=device,
                                    table_write_pending=True)
            self.model.features[: len(rows)].copy_(hidden if at is None else hidden[at])
            logits = runner.run(fb, None, TokenFeed(token if at is None else token[at], self.vocab_size))
            self.steps += 1
            for i in alive:
                states[i].length += 1
            assert self._out is not None
            if at is None:
                token, hidden = logits.argmax(dim=-1), self._out.clone()
            else:
                token, hidden = token.clone(), hidden.clone()
                token[at], hidden[at] = logits.argmax(dim=-1), self._out
            columns.append(token.clone())
        table = torch.stack(columns, dim=1).tolist()  # [n, steps]: the copy to the host
        return [[int(t) for t in row[:limit]] for row, limit in zip(table, limits)]

    def _extend(self, states: list[_HeadRow], pairs: list[tuple[list[int], torch.Tensor]],
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each request its pairs in chunks of at most ``max_num_tokens``; the argmax of each request's last
        row [n] and the head's hidden state there [n, H]."""
        kv, runner, device = self.kv_cache, self.runner, self.options.device
        assert kv is not None and runner is not None
        pending = [(list(ids), feats) for ids, feats in pairs]
        token = torch.empty(len(states), dtype=torch.int64, device=device)
        hidden = torch.empty(len(states), self.model.hidden_size, dtype=self.options.dtype, device=device)
        while any(ids for ids, _ in pending):
            picked, take, left = [], [], self.options.max_num_tokens
            for i, (ids, _) in enumerate(pending):  # each takes what is left of the budget, in order
                if ids and left > 0:
                    picked.append(i)
                    take.append(min(len(ids), left))
                    left -= take[-1]
            rows = [states[i].row for i in picked]
            loc = kv.alloc_extend(rows, take)
            fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[states[i].length for i in picked],
                                    extend_lens=take, out_cache_loc=loc,
                                    input_ids=[t for i, n in zip(picked, take) for t in pending[i][0][:n]],
                                    device=device)
            self.model.features[: sum(take)].copy_(torch.cat([pending[i][1][:n] for i, n in zip(picked, take)]))
            done = [j for j, (i, n) in enumerate(zip(picked, take)) if n == len(pending[i][0])]
            ends = [sum(take[: j + 1]) - 1 for j in done]
            keep = to_device([ends], torch.int64, device)[0]
            logits = runner.run(fb, keep)
            self.steps += 1
            assert self._out is not None
            at = to_device([[picked[j] for j in done]], torch.int64, device)[0]
            token[at], hidden[at] = logits.argmax(dim=-1), self._out[keep]
            for i, n in zip(picked, take):
                states[i].length += n
                states[i].fed += n
                pending[i] = (pending[i][0][n:], pending[i][1][n:])
        return token, hidden


def _ceil(n: int, sizes: tuple[int, ...] | None) -> list[int]:
    """The smallest of ``sizes`` that holds ``n`` (a graph bucket a step of ``n`` pads to), as a list of 0 or 1."""
    fits = [s for s in sizes or () if s >= n]
    return [min(fits)] if fits else []
