"""Scheduler: continuous batching with chunked prefill over the paged KV cache, preempting when full.

Each step it takes every decoding request (one token each), then continues chunked prefills and
admits waiting requests (FIFO) until ``max_num_tokens`` or ``max_batch_size`` is reached, so new
requests prefill in the same step as others decode. KV pages for the step are reserved before
anything is allocated; when they run out, the most recently admitted request is preempted (its KV
freed, to be recomputed later). Requests that could never fit are refused when added. ``snapshot`` /
``restore`` undo a step that failed (its rows and KV pages released), and ``abort`` drops requests.

With the KV cache's prefix cache (``kv.prefix_cache``) a starting request takes its longest cached prefix and
computes from there (always at least its last token, so that the step samples); the KV of prefill chunks,
finished, retired and preempted requests goes into the cache, whose unpinned pages count as free: they are
evicted before anyone is preempted. Of two requests starting in one step with the same first
``SHARE_MIN_TOKENS`` tokens, the second waits a step and then takes the first one's prefix from the cache.
"""

from __future__ import annotations

import array
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compile_attn.engine.requests.errors import InvalidRequestError, RequestTooLargeError
from compile_attn.engine.requests.request import Request, RequestStatus
from compile_attn.kv.cache import KVCache

logger = logging.getLogger(__name__)

SHARE_MIN_TOKENS = 32  # a prefix this long shared by two starting requests makes the second wait one step

__all__ = ["RequestTooLargeError", "ScheduledStep", "Scheduler", "SchedulerState"]


@dataclass
class ScheduledStep:
    requests: list[Request]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor
    # The request table's entries for the new slots are left to the step (a host out_cache_loc, see
    # KVCache.alloc_extend's defer_table_write; decode and verify steps): build the batch with
    # ForwardBatch.build(table_write_pending=...).
    table_write_pending: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def input_ids(self) -> array.array:
        """The step's tokens, request after request: one memory copy per request (a prefill has thousands); a
        decode step (one token each) reads each request's token at its prefix length in one comprehension. A
        request verifying drafts runs its last token and then its ``draft_ids``."""
        if self.extend_lens.count(1) == len(self.extend_lens):
            return array.array("q", [r.token_ids[p] for r, p in zip(self.requests, self.prefix_lens)])
        ids = array.array("q")
        for r, p, n in zip(self.requests, self.prefix_lens, self.extend_lens):
            ids.extend(r.token_ids[p : p + n])
            if p + n > len(r.token_ids):
                ids.extend(r.draft_ids)
        return ids


@dataclass
class SchedulerState:
    """The queues before a step: enough to undo the step (see ``Scheduler.restore``)."""

    waiting: list[Request]
    running: list[Request]


class Scheduler:
    def __init__(self, kv_cache: KVCache, max_batch_size: int, max_num_tokens: int, *,
                 defer_table_write: bool = False) -> None:
        """``defer_table_write``: steps of one new token per request (decode) and steps of decoding requests with
        their drafts (speculative verify) leave the request table's write to the step that runs them
        (``ScheduledStep.table_write_pending``), so their slots reach the device in the batch's own upload."""
        self.kv = kv_cache
        self.defer_table_write = defer_table_write
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._prefilled: list[Request] = []  # requests that ran prefill chunks in the last step: cached next step

    # ------------------------------------------------------------------ admission
    def check_fits(self, req: Request) -> None:
        total = len(req.prompt_ids) + req.params.max_new_tokens
        capacity = self.kv.allocator.num_pages * self.kv.page_size
        if not req.prompt_ids:
            raise InvalidRequestError(f"request {req.request_id} has an empty prompt; pass at least one token id")
        if total > self.kv.max_context or total > capacity:
            raise RequestTooLargeError(
                f"request {req.request_id} needs up to {total} tokens (prompt {len(req.prompt_ids)} + max_new_tokens "
                f"{req.params.max_new_tokens}) but the KV cache holds {capacity} tokens with max_context "
                f"{self.kv.max_context}; shorten the prompt, lower max_new_tokens, or raise kv_cache_tokens / max_context"
            )

    def add(self, req: Request) -> None:
        self.check_fits(req)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ per-step decisions
    def _free_tokens_for(self, req: Request, free_pages: int) -> int:
        """Tokens ``req`` could still add: room in its last page plus ``free_pages`` whole pages."""
        slack = 0 if req.row is None else self.kv.room_in_last_page(req.row)
        return slack + free_pages * self.kv.page_size

    def _cache(self, reqs: Sequence[Request]) -> None:
        """Put the computed KV of ``reqs`` (those holding a row) into the prefix cache, if there is one."""
        cache = self.kv.prefix_cache
        if cache is None:
            return
        for r in reqs:
            if r.row is not None:
                cache.insert(r.row, r.token_ids[:min(r.num_cached, len(r.token_ids) - r.unresolved)])

    def _preempt(self, victim: Request) -> None:
        logger.info("KV cache full: preempting request %d (%d tokens cached) to recompute later",
                    victim.request_id, victim.num_cached)
        self._cache([victim])  # what is left of it in the cache when it starts again is not recomputed
        self.kv.free_request(victim.row)
        victim.row, victim.num_cached = None, 0
        victim.penalty_row = None  # its next row's penalty statistics are filled again (engine/execution/step_extras.py)
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(victim)
        self.waiting.appendleft(victim)

    def schedule(self) -> ScheduledStep | None:
        """Choose this step's requests and token counts, allocate their KV slots. None when idle."""
        self._cache([r for r in self._prefilled if r.status is RequestStatus.RUNNING])
        self._prefilled = []
        while self.has_work():
            step = self._try_schedule()
            if step is not None:
                return step
            # Nothing fits while requests hold KV (e.g. several half-done prefills): free the newest.
            self._preempt(self.running[-1])
        return None

    def may_mix(self) -> bool:
        """Whether the next step may take a prefill chunk beside the decoding requests: one is part-way through its
        prompt, or one waits and a request row is free for it. (A preemption can still bring one in.)"""
        if any(not r.is_decoding for r in self.running):
            return True
        return bool(self.waiting) and len(self.running) < self.max_batch_size and \
            self.kv.req_to_token_pool.available > 0

    def _try_schedule(self) -> ScheduledStep | None:
        chosen: list[tuple[Request, int]] = []
        chosen_ids: set[int] = set()  # id() of the chosen requests: membership in O(1), batches reach hundreds
        reserved = 0
        budget = self.max_num_tokens

        def free_pages() -> int:
            return self.kv.available_pages - reserved

        preempted: set[int] = set()
        verifying = -1  # with drafts: the decoding requests taken with them, all at once (a verify step's)
        decoding = [r for r in self.running if r.is_decoding]
        # A decoding request with drafts (speculative decoding) runs its last token and its drafts: 1 + len(drafts).
        drafting = any(r.draft_ids for r in decoding)
        tokens = sum(1 + len(r.draft_ids) for r in decoding) if drafting else len(decoding)
        if decoding and len(decoding) <= self.max_batch_size and tokens <= budget:
            need = (sum(self.kv.pages_needed(r.row, 1 + len(r.draft_ids)) for r in decoding) if drafting
                    else self.kv.decode_pages_needed([r.row for r in decoding]))
            if need <= free_pages():  # every decoding request fits: take them all, no preemption to consider
                reserved, budget = need, budget - tokens
                chosen = [(r, 1 + len(r.draft_ids)) for r in decoding]
                chosen_ids = {id(r) for r in decoding}
                verifying = len(chosen) if drafting else -1
                decoding = []
        for r in decoding if drafting else ():  # not all fit with their drafts: plain decode first, drafts later
            r.draft_ids, r.draft_parents = [], None
        for req in decoding:
            if len(chosen) >= self.max_batch_size or budget == 0:
                break
            if id(req) in preempted:  # preempted below while making room for an earlier one
                continue
            need = self.kv.pages_needed(req.row, 1)
            while need > free_pages():
                victim = next(r for r in reversed(self.running) if id(r) not in chosen_ids)
                self._preempt(victim)
                preempted.add(id(victim))
                if victim is req:
                    break
            else:
                reserved += need
                chosen.append((req, 1))
                chosen_ids.add(id(req))
                budget -= 1

        if len(chosen) == len(self.running):  # every running request decodes this step (the steady state)
            candidates = list(self.waiting)
        else:
            candidates = [r for r in self.running if not r.is_decoding and id(r) not in chosen_ids]
            candidates += self.waiting
        cache = self.kv.prefix_cache
        starting: set[tuple[int, ...]] = set()  # share keys of the requests starting in this step
        for req in candidates:
            if len(chosen) >= self.max_batch_size or budget == 0:
                break
            if req.row is None and self.kv.req_to_token_pool.available == 0:
                break
            match = None  # a starting request's cached prefix (pinned), its last token (or placeholder) left out
            key = None
            if req.row is None and cache is not None:
                match = cache.match(req.token_ids, len(req.token_ids) - max(req.unresolved, 1))
                key = self._share_key(req)
                if key is not None and key in starting and len(match.pages) * self.kv.page_size < len(key):
                    # A request starting in this step computes this prefix: wait one step and take it from the
                    # cache (the n samples of one prompt, many prompts behind one system prompt).
                    cache.unpin(match)
                    continue
            start = req.num_cached if match is None else len(match.pages) * self.kv.page_size
            n = min(len(req.token_ids) - start, budget, self._free_tokens_for(req, free_pages()))
            if n <= 0:
                if match is not None:
                    cache.unpin(match)
                break
            if req.row is None:
                req.row = self.kv.alloc_request()
                if match is not None:
                    req.num_cached = cache.attach(req.row, match, len(req.token_ids))
                req.status = RequestStatus.RUNNING
                self.waiting.remove(req)
                self.running.append(req)
            reserved += self.kv.pages_needed(req.row, n)
            chosen.append((req, n))
            chosen_ids.add(id(req))
            budget -= n
            self._prefilled.append(req)
            if key is not None:
                starting.add(key)

        if not chosen:
            return None
        reqs = [r for r, _ in chosen]
        extend_lens = [n for _, n in chosen]
        # Decode steps, and verify steps (every request decoding with its drafts, none else: ``verifying``), leave
        # the table write to the step.
        defer = self.defer_table_write and (verifying == len(chosen) or extend_lens.count(1) == len(extend_lens))
        out_cache_loc = self.kv.alloc_extend([r.row for r in reqs], extend_lens, defer_table_write=defer)
        return ScheduledStep(reqs, [r.num_cached for r in reqs], extend_lens, out_cache_loc, defer)

    def _share_key(self, req: Request) -> tuple[int, ...] | None:
        """The first ``SHARE_MIN_TOKENS`` tokens of ``req`` (rounded up to whole pages) when it has more, else None:
        two starting requests with one key would compute the same prefix, so the second waits for the cache."""
        size = -(-SHARE_MIN_TOKENS // self.kv.page_size) * self.kv.page_size
        if len(req.token_ids) - max(req.unresolved, 1) < size:
            return None
        return tuple(req.token_ids[:size])

    def finish_all(self, done: Sequence[tuple[Request, str]]) -> None:
        """Finish several requests at once: their KV is freed in one call (one device op for their rows). A request
        may be running, retired (see ``retire``), or waiting after a preemption."""
        if not done:
            return
        self._cache([req for req, _ in done])
        self.kv.free_requests([req.row for req, _ in done if req.row is not None])
        ids = set()
        for req, reason in done:
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
            req.status, req.finish_reason, req.row = RequestStatus.FINISHED, reason, None
            ids.add(id(req))
        self.running[:] = [r for r in self.running if id(r) not in ids]

    def retire(self, reqs: Sequence[Request]) -> None:
        """Take running requests out of scheduling and free their KV while their last token is still on the
        device: they finish whatever it is (a length limit), and ``finish_all`` gives them their reason once it
        is read. Safe on a GPU: a freed slot is reused only by a later step, which runs after this one."""
        if not reqs:
            return
        self._cache(reqs)
        self.kv.free_requests([r.row for r in reqs])
        ids = {id(r) for r in reqs}
        for r in reqs:
            r.row = None
        self.running[:] = [r for r in self.running if id(r) not in ids]

    def abort(self, reqs: Sequence[Request]) -> None:
        """Drop ``reqs`` wherever they are (waiting or running; finished ones are left alone): their KV rows and
        pages are freed and they finish with reason "abort"."""
        ids = {id(r) for r in reqs if r.status is not RequestStatus.FINISHED}
        if not ids:
            return
        rows = [r.row for r in self.running if id(r) in ids]
        self.running[:] = [r for r in self.running if id(r) not in ids]
        self.waiting = deque(r for r in self.waiting if id(r) not in ids)
        if rows:
            self.kv.free_requests(rows)
        for r in reqs:
            if id(r) in ids:
                r.status, r.finish_reason, r.row = RequestStatus.FINISHED, "abort", None

    # ------------------------------------------------------------------ undoing a failed step
    def snapshot(self) -> SchedulerState:
        """The queues as they are now; between steps every running request's KV holds exactly its ``num_cached``
        tokens, which is what ``restore`` goes back to."""
        return SchedulerState(list(self.waiting), list(self.running))

    def restore(self, state: SchedulerState) -> None:
        """Undo whatever a step did since ``state`` was taken, once the step's requests have their ``num_cached``
        and ``token_ids`` back: requests admitted in it go back to ``waiting`` (rows freed), running ones have their
        KV cut back to ``num_cached``, and the queues get their order back. A request the step preempted stays
        preempted (its KV is gone; it is recomputed later) at the front of ``waiting``; one that finished stays
        finished."""
        before_running = {id(r) for r in state.running}
        admitted = [r for r in state.waiting if r.row is not None and r.status is not RequestStatus.FINISHED]
        if admitted:
            self.kv.free_requests([r.row for r in admitted])
            for r in admitted:
                r.row, r.num_cached, r.status = None, 0, RequestStatus.WAITING
        running = [r for r in state.running if r.row is not None and r.status is RequestStatus.RUNNING]
        for r in running:
            self.kv.truncate(r.row, r.num_cached)  # a no-op for a row the step did not grow
        preempted = [r for r in self.waiting if id(r) in before_running]
        self.running[:] = running
        self.waiting = deque(preempted + [r for r in state.waiting if r.status is RequestStatus.WAITING])
