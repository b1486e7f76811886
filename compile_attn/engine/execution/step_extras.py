"""What a step computes beside the next tokens, for the requests that ask: presence / frequency / repetition
penalties on their logits before sampling, the stop tokens masked out of the logits of a request short of its
``min_tokens``, and the log-probabilities of their sampled tokens after it.

Both stay on the device. Penalties read per-request-row token statistics (``PenaltyState``) that a step updates
with its sampled tokens without a host sync; a request's row is (re)filled from its prompt and outputs when it
first samples in that row (after admission or a preemption). In a verify step (several rows per request) each row
also counts the drafts before it, for that row only, and the step records nothing: the engine counts the accepted
tokens once they are known (engine/execution/speculative/penalties.py). Log-probabilities are packed into one
float64 tensor that the engine copies to the host with the step's tokens (see engine/execution/in_flight.py) and
unpacks when it reads them. A row is short of ``min_tokens`` when the output index its token takes (from its
position: a verify row's own, so each draft row is judged where it stands) is below ``min_tokens``; its EOS and
``stop_token_ids`` logits become -inf, so neither a plain step nor a verify step (whose target tokens decide which
drafts are kept) can stop it early. The ban comes after a structured-output grammar's mask (applied to the logits
first, see engine/execution/sampling/step.py), so both hold; where together they leave a row no token (its grammar is
complete and allows only EOS), the row keeps its stop tokens: no token satisfies both, so the grammar's end wins
over ``min_tokens`` and the request finishes with "stop" (rather than sampling from a row of -inf).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from compile_attn.engine.execution.in_flight import feed_tokens
from compile_attn.engine.requests.request import Request
from compile_attn.engine.execution.sampling.logprobs import compute_logprobs, pack
from compile_attn.engine.execution.sampling.penalties import PenaltyState
from compile_attn.host_tensors import to_device, upload


@dataclass(eq=False)
class StepExtras:
    """For one step's sampled requests ``reqs``: the positions in ``reqs`` of those with penalties and of those
    asking for logprobs, and the device tensors the step needs for them."""

    penalty_at: list[int]
    logprob_at: list[int]
    state: PenaltyState | None
    penalty_index: torch.Tensor | None = None  # [P] positions in the step's sampled rows
    penalty_rows: torch.Tensor | None = None  # [P] request rows of PenaltyState
    penalty_values: torch.Tensor | None = None  # [3, P] presence, frequency, repetition
    logprob_index: torch.Tensor | None = None  # [L]
    num_top: int = 0
    draft_counts: tuple[torch.Tensor, torch.Tensor] | None = None  # (indices into penalty_rows, draft tokens) [N]
    record: bool = True  # count the sampled tokens after sampling (a plain step); a verify step counts on acceptance
    ban: tuple[list[int], list[int]] | None = None  # (step rows, token ids) whose logits are -inf (min_tokens)

    @classmethod
    def for_step(cls, reqs: list[Request], state: PenaltyState | None, device: torch.device,
                 drafts_before: list[list[int]] | None = None, *, eos_token_ids: Collection[int] = (),
                 positions: list[int] | None = None) -> StepExtras | None:
        """None when no sampled request uses penalties, logprobs or min_tokens (the common case: nothing is
        uploaded). ``drafts_before`` (a verify step): the draft tokens on the path before each sampled row
        ``reqs[i]``; ``positions``: the index in its request's tokens that each row's token takes (default: the
        next one); ``eos_token_ids``: the model's, masked with a row's ``stop_token_ids`` while it is short of its
        ``min_tokens``."""
        penalty_at = [i for i, r in enumerate(reqs) if r.params.has_penalties] if state is not None else []
        logprob_at = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        ban = _min_tokens_ban(reqs, eos_token_ids, positions)
        if not penalty_at and not logprob_at and ban is None:
            return None
        extras = cls(penalty_at, logprob_at, state, record=drafts_before is None, ban=ban)
        at, tokens = [], []  # each penalty row's preceding drafts: (its index among the penalty rows, the token)
        for p, i in enumerate(penalty_at if drafts_before is not None else ()):
            at += [p] * len(drafts_before[i])
            tokens += drafts_before[i]
        longs = to_device([penalty_at, [reqs[i].row for i in penalty_at], logprob_at]
                          + ([at, tokens] if tokens else []), torch.int64, device)
        extras.penalty_index, extras.penalty_rows, extras.logprob_index = longs[:3]
        if tokens:
            extras.draft_counts = (longs[3], longs[4])
        if penalty_at:
            values = [[reqs[i].params.presence_penalty for i in penalty_at],
                      [reqs[i].params.frequency_penalty for i in penalty_at],
                      [reqs[i].params.repetition_penalty for i in penalty_at]]
            extras.penalty_values = upload(torch.tensor(values, dtype=torch.float32), device)
        extras.num_top = max((reqs[i].params.logprobs for i in logprob_at), default=0)
        return extras

    def penalise(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of the logits with the penalty rows penalised (computed in float32, stored in the logits' dtype so
        the sampler's kernels built at start-up serve it) and the stop tokens of rows short of their min_tokens at
        -inf; the same tensor when no row has either."""
        if self.penalty_at:
            assert self.state is not None and self.penalty_index is not None and self.penalty_values is not None
            penalised = self.state.apply(logits.index_select(0, self.penalty_index), self.penalty_rows,
                                         *self.penalty_values, extra=self.draft_counts)
            logits = logits.index_copy(0, self.penalty_index, penalised.to(logits.dtype))
        if self.ban is not None:
            vocab = logits.shape[-1]
            pairs = [(i, t) for i, t in zip(*self.ban) if t < vocab]  # a stop token id past the vocabulary: never
            if pairs:                                                  # sampled, nothing to mask
                rows, toks = to_device([[i for i, _ in pairs], [t for _, t in pairs]], torch.int64, logits.device)
                banned = logits.index_put((rows, toks), torch.tensor(float("-inf"), dtype=logits.dtype,
                                                                       device=logits.device))
                # A row the ban leaves without a finite logit (a grammar that allows only its stop tokens) keeps
                # them: on the device, no sync.
                empty = torch.isneginf(banned).all(dim=-1, keepdim=True)
                logits = torch.where(empty, logits, banned)
        return logits

    def after_sampling(self, raw_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
        """Count the penalty rows' new tokens (not in a verify step); return the logprob rows' log-probabilities,
        packed (``logprobs.pack``)."""
        if self.penalty_at and self.record:
            assert self.state is not None
            self.state.record(self.penalty_rows, tokens.index_select(0, self.penalty_index))
        if not self.logprob_at:
            return None
        idx = self.logprob_index
        return pack(compute_logprobs(raw_logits.index_select(0, idx), tokens.index_select(0, idx), self.num_top))


def _min_tokens_ban(reqs: list[Request], eos_token_ids: Collection[int],
                    positions: list[int] | None) -> tuple[list[int], list[int]] | None:
    """(row, token id) pairs to mask: for each sampled row whose token takes an output index below its request's
    ``min_tokens``, its ``stop_token_ids`` and (unless ``ignore_eos``) the EOS ids. None when no row is short."""
    rows: list[int] = []
    toks: list[int] = []
    for i, r in enumerate(reqs):
        params = r.params
        if not params.min_tokens:
            continue
        at = positions[i] if positions is not None else len(r.token_ids)
        if at - len(r.prompt_ids) >= params.min_tokens:
            continue
        stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        rows += [i] * len(stops)
        toks += stops
    return (rows, toks) if rows else None


def start_penalty_rows(reqs: list[Request], state: PenaltyState, in_flight_tokens: torch.Tensor | None,
                       vocab_size: int | None, device: torch.device) -> None:
    """Fill the penalty statistics of each request in ``reqs`` with penalties whose row they do not describe yet
    (a new request, or one preempted and admitted again): its prompt, and its outputs so far. A placeholder among
    the outputs (a token of the step in flight) is read on the device."""
    for r in reqs:
        if not r.params.has_penalties or r.penalty_row == r.row:
            continue
        prompt, outputs = to_device([r.prompt_ids, r.token_ids[len(r.prompt_ids):]], torch.int64, device)
        if r.unresolved and in_flight_tokens is not None:
            feed_tokens(outputs, in_flight_tokens, vocab_size)
        state.start(r.row, prompt, outputs)
        r.penalty_row = r.row
