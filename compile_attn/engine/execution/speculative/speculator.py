"""The engine's speculative decoding: proposes each decoding request's drafts before a step is scheduled, plans which
rows of the step sample at which positions, and keeps the counts that ``/metrics`` and the benchmarks report.

A request verifying K drafts runs K + 1 tokens in the step (its last token, then the drafts: a chain, causal like
an extend) and samples all K + 1 rows; ``acceptance.accept_chain`` keeps what the target agrees with. Requests with
presence / frequency / repetition penalties are not given drafts (their statistics would have to follow each draft
row); neither are requests within one token of their length limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import accumulate

from compile_attn.engine.execution.speculative.ngram import NgramProposer
from compile_attn.engine.requests.request import Request
from compile_attn.engine.requests.scheduler import ScheduledStep
from compile_attn.engine.requests.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


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
    """Drafts and counts for one engine (``SpeculativeConfig``'s method; "ngram" today)."""

    def __init__(self, config: SpeculativeConfig, max_context: int) -> None:
        self.config = config
        self.max_context = max_context
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.stats = SpeculativeStats()
        logger.info("speculative decoding: %s, up to %d draft tokens per request and step", config.method,
                    config.num_speculative_tokens)

    def room(self, r: Request) -> int:
        """Drafts ``r`` may verify now: a verify step adds up to drafts + 1 tokens, within ``max_new_tokens`` and the
        context."""
        return min(r.params.max_new_tokens - r.num_output, self.max_context - len(r.token_ids)) - 1

    def propose(self, running: list[Request]) -> None:
        """Set the drafts of every running request: proposals for those decoding, none for the others."""
        for r in running:
            if r.is_decoding and not r.unresolved and not r.params.has_penalties and (room := self.room(r)) > 0:
                r.draft_ids = self.proposer.propose(r.token_ids, room)
            elif r.draft_ids:
                r.draft_ids = []

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
