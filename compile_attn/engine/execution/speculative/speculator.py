"""The engine's speculative decoding: proposes each decoding request's drafts before a step is scheduled, plans which
rows of the step sample at which positions, and keeps the counts that ``/metrics`` and the benchmarks report.

A request verifying K drafts runs K + 1 tokens in the step (its last token, then the drafts: a chain, causal like
an extend) and samples all K + 1 rows; ``acceptance.accept_chain`` keeps what the target agrees with. Requests with
presence / frequency / repetition penalties are not given drafts (their statistics would have to follow each draft
row); neither are requests within one token of their length limit.

Steps: one that verifies runs to completion before the next is scheduled (its accepted tokens decide the next
drafts); one in which nothing was proposed is a plain step and may overlap the next as without speculation: while
proposals keep failing, the engine reads every token first after 1, 2, 4, .. up to ``PROBE_EVERY`` plain steps
(``probe_due``), so that proposals are looked for again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import accumulate

from collections.abc import Mapping
from typing import Any

from compile_attn.config import GraphConfig
from compile_attn.engine.execution.speculative.acceptance import accept_chain
from compile_attn.engine.execution.speculative.draft_model import DraftModelProposer
from compile_attn.engine.execution.speculative.ngram import NgramProposer
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
    with drafts), draft_tokens (drafts verified), accepted_tokens (drafts the target agreed with)."""

    verify_steps: int = 0
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
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length}


@dataclass
class SampleRows:
    """Which rows of a step sample: ``reqs[j]`` samples batch row ``rows[j]``, its token taking index
    ``positions[j]`` of the request's tokens. ``spans`` has one entry per sampling request: (request, index of its
    first row in ``reqs``, its drafts), the drafts empty for a plain row."""

    reqs: list[Request] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[tuple[Request, int, list[int]]] = field(default_factory=list)

    @property
    def verifies(self) -> bool:
        return any(drafts for _, _, drafts in self.spans)


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

    def propose(self, running: list[Request]) -> None:
        """Set the drafts of every running request: proposals for those decoding, none for the others."""
        drafting, rooms = [], []
        for r in running:
            if r.is_decoding and not r.unresolved and not r.params.has_penalties and (room := self.room(r)) > 0:
                drafting.append(r)
                rooms.append(room)
            elif r.draft_ids:
                r.draft_ids = []
        if self.draft is not None:
            self.draft.forget({r.request_id for r in running})
            proposals = self.draft.propose(drafting, rooms) if drafting else []
        else:
            proposals = [self.proposer.propose(r.token_ids, room) for r, room in zip(drafting, rooms)]
        found = False
        for r, drafts in zip(drafting, proposals):
            r.draft_ids = drafts
            found = found or bool(drafts)
        if found:
            self._interval, self._overlapped = 1, 0

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
            out.spans.append((r, len(out.reqs), drafts))
            for j in range(len(drafts) + 1):
                out.reqs.append(r)
                out.rows.append(end - 1 - len(drafts) + j)
                out.positions.append(length + j)
        return out

    def count(self, drafts: list[int], accepted: int) -> None:
        """Record one request's verification: ``accepted`` of its ``drafts`` kept."""
        if drafts:
            self.stats.verified += 1
            self.stats.draft_tokens += len(drafts)
            self.stats.accepted_tokens += accepted

    def resolve(self, rows: SampleRows, tokens: list[int], logprobs: dict[int, Any], writer: TokenWriter,
                kv_cache: KVCache) -> list[tuple[Request, str]]:
        """Write a verify step's accepted tokens (``accept_chain`` per request), one by one through ``writer``'s
        checks as a decode step's token, and cut each request's KV back to what its accepted tokens hold. Returns
        the requests that finish, with their reasons (the caller finishes them)."""
        done = []
        for r, first, drafts in rows.spans:
            r.draft_ids = []
            if r.status is RequestStatus.FINISHED:
                continue
            base = len(r.token_ids) - 1  # tokens with KV before the step: all but the last
            accepted = accept_chain(drafts, tokens[first : first + len(drafts) + 1])
            self.count(drafts, len(accepted) - 1)
            reason, written = None, 0
            for tok in accepted:
                r.token_ids.append(-1)  # written by writer.write, as a decode step's placeholder is
                r.unresolved += 1
                reason = writer.write(r, len(r.token_ids) - 1, tok, logprobs.get(first + written))
                written += 1
                if reason:
                    break
            # KV holds the old last token and the drafts equal to the tokens written before the newest one: the
            # prefix cache (on finishing) and the next step read no further.
            r.num_cached = base + written
            if reason:
                done.append((r, reason))
            elif drafts:  # the rejected drafts' slots go back
                kv_cache.truncate(r.row, r.num_cached)
        if rows.verifies:
            self.stats.verify_steps += 1
        return done


def verify_graph_sizes(options: Mapping[str, Any] | None, rows: int) -> Mapping[str, Any] | None:
    """``options`` with decode graphs up to ``rows`` rows (the default sizes continued in steps of 8) where they
    leave ``decode_batch_sizes`` to its default and verify steps (``rows``: requests x (1 + K)) need more rows."""
    options = dict(options or {})
    default = GraphConfig.decode_batch_sizes
    if "decode_batch_sizes" in options or rows <= default[-1]:
        return options or None
    options["decode_batch_sizes"] = (*default, *range(default[-1] + 8, rows + 8, 8))
    return options
