"""The engine's speculative decoding: proposes each decoding request's drafts before a step is scheduled, plans which
rows of the step sample at which positions, and keeps the counts that ``/metrics`` and the benchmarks report.

A request verifying K drafts runs K + 1 tokens in the step (its last token, then the drafts: a chain, causal like
an extend) and samples all K + 1 rows; ``acceptance.accept_chain`` keeps what the target agrees with. Penalties
hold row by row (``speculative/penalties.py``). Requests within one token of their length limit get no drafts, nor do
requests with a grammar (structured outputs).

Steps: one that verifies runs to completion before the next is scheduled (its accepted tokens decide the next
drafts); one in which nothing was proposed is a plain step and may overlap the next as without speculation: while
proposals keep failing, the engine reads every token first after 1, 2, 4, .. up to ``PROBE_EVERY`` plain steps
(``probe_due``), so that proposals are looked for again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from compile_attn.draft_tree import depths, is_chain
from compile_attn.engine.execution.speculative.acceptance import accept_chain, accept_tree
from compile_attn.engine.execution.speculative.draft_model import DraftModelProposer
from compile_attn.engine.execution.speculative.ngram import NgramProposer
from compile_attn.engine.execution.speculative.tree_kv import move_accepted_path
from compile_attn.engine.requests.request import Request, RequestStatus
from compile_attn.engine.requests.scheduler import ScheduledStep
from compile_attn.engine.requests.speculative_config import SpeculativeConfig
from compile_attn.engine.requests.token_writer import TokenWriter
from compile_attn.kv.cache import KVCache

logger = logging.getLogger(__name__)

# With nothing to propose the engine overlaps steps and looks for drafts again every this many steps.
PROBE_EVERY = 8


@dataclass
class SpeculativeStats:
    """Counts since start: verify_steps (steps in which some request verified drafts), verified (request-steps
    with drafts), draft_tokens (drafts verified), accepted_tokens (drafts the target agreed with), tree_verified (of
    ``verified``, those whose drafts branched)."""

    verify_steps: int = 0
    tree_verified: int = 0
    verified: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request gains per verify step on average (accepted drafts + the target's own token)."""
        return 1.0 + self.accepted_tokens / self.verified if self.verified else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"verify_steps": self.verify_steps, "verified_requests": self.verified,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "tree_verified_requests": self.tree_verified,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length}


@dataclass
class SampleRows:
    """Which rows of a step sample: ``reqs[j]`` samples batch row ``rows[j]``, its token taking index
    ``positions[j]`` of the request's tokens. ``spans`` has one entry per sampling request: (request, index of its
    first row in ``reqs``, its drafts, their parents or None for a chain), the drafts empty for a plain row."""

    reqs: list[Request] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[tuple[Request, int, list[int], list[int] | None]] = field(default_factory=list)

    @property
    def verifies(self) -> bool:
        return any(drafts for _, _, drafts, _ in self.spans)


class Speculator:
    """Drafts and counts for one engine: prompt lookup ("ngram"), or ``draft``'s model ("draft_model")."""

    def __init__(self, config: SpeculativeConfig, max_context: int, draft: DraftModelProposer | None = None) -> None:
        self.config = config
        self.max_context = max_context
        self.draft = draft
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.stats = SpeculativeStats()
        self._overlapped = 0  # plain steps overlapped since the engine last read every token (see probe_due)
        self._interval = 1  # ... and how many it lets pass before it reads them all again: 1, 2, 4, .. PROBE_EVERY
        logger.info("speculative decoding: %s, up to %d draft tokens per request and step", config.method,
                    config.num_speculative_tokens)

    def probe_due(self) -> bool:
        """Whether the engine reads every token of a plain step (nothing proposed) before the next, so that the next
        looks for drafts; otherwise it overlaps the next step, whose requests then hold a placeholder and get none.
        Plain steps in a row are let pass 1, 2, 4, .. ``PROBE_EVERY`` at a time; a step with drafts starts over at 1.
        Called once per plain step launched with overlap."""
        self._overlapped += 1
        if self._overlapped < self._interval:
            return False
        self._overlapped = 0
        self._interval = min(PROBE_EVERY, 2 * self._interval)
        return True

    def room(self, r: Request) -> int:
        """Drafts ``r`` may verify now: a verify step adds up to drafts + 1 tokens, within ``max_new_tokens`` and the
        context."""
        return min(r.params.max_new_tokens - r.num_output, self.max_context - len(r.token_ids)) - 1

    @property
    def tree(self) -> tuple[int, int] | None:
        """(topk, num_draft_tokens) of a tree config; None for chains."""
        c = self.config
        return (c.topk, c.max_draft_tokens) if c.topk > 1 else None

    def propose(self, running: list[Request], trees: bool = True) -> None:
        """Set the drafts of every running request: proposals for those decoding, none for the others. ``trees``
        (with a tree config): propose trees; else chains (a step that may mix prefill chunks in runs causally)."""
        drafting, rooms = [], []
        for r in running:
            # A request with a grammar (structured outputs) gets no drafts: each of its tokens is masked by the
            # grammar state its previous token leaves, so it decodes one token per step (docs/structured_outputs.md).
            if r.is_decoding and not r.unresolved and r.grammar is None and (room := self.room(r)) > 0:
                drafting.append(r)
                rooms.append(room)
            elif r.draft_ids:
                r.draft_ids, r.draft_parents = [], None
        tree = self.tree if trees else None
        if self.draft is not None:
            self.draft.forget({r.request_id for r in running})
            proposals = self.draft.propose(drafting, rooms, tree) if drafting else []
        elif tree is not None:
            proposals = [self.proposer.propose_tree(r.token_ids, room, tree[0], self._nodes(r, tree[1]))
                         for r, room in zip(drafting, rooms)]
        else:
            proposals = [(self.proposer.propose(r.token_ids, room), None) for r, room in zip(drafting, rooms)]
        found = False
        for r, (drafts, parents) in zip(drafting, proposals):
            r.draft_ids = drafts
            r.draft_parents = None if parents is None or is_chain(parents) else parents
            found = found or bool(drafts)
        if found:
            self._interval, self._overlapped = 1, 0

    def _nodes(self, r: Request, cap: int) -> int:
        """A tree's nodes for ``r`` at most: ``cap``, and what its context has room for."""
        return min(cap, self.max_context - len(r.token_ids) - 1)

    def settle(self, running: list[Request]) -> None:
        """After a step's tokens are written: the draft model gives back the rows of requests no longer running."""
        if self.draft is not None:
            self.draft.forget({r.request_id for r in running})

    def sample_rows(self, step: ScheduledStep) -> SampleRows:
        """The step's sampling rows: every row of a request verifying drafts, the last row of a request whose step
        reaches its last token, none for a prefill chunk that does not."""
        out = SampleRows()
        for r, p, n, end in zip(step.requests, step.prefix_lens, step.extend_lens, accumulate(step.extend_lens)):
            length = len(r.token_ids)
            drafts = r.draft_ids if p + n == length + len(r.draft_ids) else []
            if p + n != length + len(drafts):
                continue
            parents = r.draft_parents if drafts else None
            out.spans.append((r, len(out.reqs), drafts, parents))
            # A node's token takes the index after its path: length + its depth (a chain's j-th row: length + j).
            offsets = range(len(drafts) + 1) if parents is None else depths([-1] + [q + 1 for q in parents])
            for j, depth in enumerate(offsets):
                out.reqs.append(r)
                out.rows.append(end - 1 - len(drafts) + j)
                out.positions.append(length + depth)
        return out

    def count(self, drafts: list[int], accepted: int) -> None:
        """Record one request's verification: ``accepted`` of its ``drafts`` kept."""
        if drafts:
            self.stats.verified += 1
            self.stats.draft_tokens += len(drafts)
            self.stats.accepted_tokens += accepted

    def resolve(self, rows: SampleRows, tokens: list[int], logprobs: dict[int, Any], writer: TokenWriter,
                kv_cache: KVCache) -> list[tuple[Request, str]]:
        """Write a verify step's accepted tokens (``accept_chain`` / ``accept_tree`` per request), one by one through
        ``writer``'s checks as a decode step's token, move an accepted tree path's KV into place and cut each
        request's KV back to what its accepted tokens hold. Returns the requests that finish, with their reasons
        (the caller finishes them)."""
        done, cut_rows, cut_lens = [], [], []
        for r, first, drafts, parents in rows.spans:
            r.draft_ids, r.draft_parents = [], None
            if r.status is RequestStatus.FINISHED:
                continue
            base = len(r.token_ids) - 1  # tokens with KV before the step: all but the last
            targets = tokens[first : first + len(drafts) + 1]
            if parents is None:
                accepted = accept_chain(drafts, targets)
                nodes = list(range(len(accepted)))
            else:
                accepted, nodes = accept_tree(drafts, parents, targets)
            self.count(drafts, len(accepted) - 1)
            self.stats.tree_verified += parents is not None
            reason, written = None, 0
            for tok, node in zip(accepted, nodes):
                r.token_ids.append(-1)  # written by writer.write, as a decode step's placeholder is
                r.unresolved += 1
                reason = writer.write(r, len(r.token_ids) - 1, tok, logprobs.get(first + node))
                written += 1
                if reason:
                    break
            if parents is not None:  # the KV of the accepted path's nodes, into consecutive positions
                move_accepted_path(kv_cache, r.row, base, nodes[:written])
            # KV holds the old last token and the drafts equal to the tokens written before the newest one: the
            # prefix cache (on finishing) and the next step read no further.
            r.num_cached = base + written
            if reason:
                done.append((r, reason))
            elif drafts:  # the rejected drafts' slots go back
                cut_rows.append(r.row)
                cut_lens.append(r.num_cached)
        kv_cache.truncate_rows(cut_rows, cut_lens)  # one device op for every request
        if rows.verifies:
            self.stats.verify_steps += 1
        return done

