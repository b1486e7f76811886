"""What a scheduled step needs before it launches: its ForwardBatch (with the in-flight token feed, where its
inputs hold placeholders) and its sampling inputs: which of its rows sample, the requests behind them, their
penalty rows (re)filled, the step's extras (penalties, logprobs, min_tokens) and its grammar rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from compile_attn.batch import ForwardBatch, ForwardMode
from compile_attn.engine.execution.in_flight import has_placeholders
from compile_attn.engine.execution.sampling.grammar import GrammarCache, GuidedRows
from compile_attn.engine.execution.sampling.penalties import PenaltyState
from compile_attn.engine.execution.speculative.penalties import drafts_before
from compile_attn.engine.execution.speculative.speculator import SampleRows
from compile_attn.engine.execution.speculative.step_plan import StepPlan
from compile_attn.engine.execution.step_extras import StepExtras, start_penalty_rows
from compile_attn.engine.requests.request import Request
from compile_attn.engine.requests.scheduler import ScheduledStep
from compile_attn.graph_runner.step_kernels import TokenFeed


def build_batch(plan: StepPlan, device: torch.device, prefix_groups: Any, in_flight: torch.Tensor | None,
                vocab_size: int) -> tuple[ForwardBatch, TokenFeed | None]:
    """The forward batch of ``plan`` and its token feed: None unless the step's inputs hold placeholders for
    ``in_flight`` (the previous step's tokens), replaced on the device in the copy into the graph's inputs."""
    step = plan.step
    fb = ForwardBatch.build(
        req_pool_indices=[r.row for r in step.requests], prefix_lens=step.prefix_lens,
        extend_lens=step.extend_lens, out_cache_loc=step.out_cache_loc,
        input_ids=step.input_ids(), device=device, table_write_pending=step.table_write_pending,
        forward_mode=ForwardMode.TARGET_VERIFY if plan.verify else None, draft_parents=plan.trees,
    )
    if prefix_groups is not None and fb.forward_mode.is_decode():
        fb.shared_prefix = prefix_groups.groups_for(fb)
    feed = None
    if in_flight is not None and has_placeholders(step.requests, step.prefix_lens, step.extend_lens):
        feed = TokenFeed(in_flight, vocab_size)
    return fb, feed


@dataclass(eq=False)
class SamplingInputs:
    """A step's sampling inputs: ``sampled`` (positions in the step of the requests that sample, without drafts),
    ``reqs`` (the request of each sampling row), ``extras`` and ``guided`` (None where nothing asks for them)."""

    sampled: list[int]
    reqs: list[Request]
    extras: StepExtras | None
    guided: GuidedRows | None


def prepare_sampling(step: ScheduledStep, rows: SampleRows | None, penalties: PenaltyState | None,
                     in_flight: torch.Tensor | None, vocab_size: int, device: torch.device, *,
                     eos_token_ids: object, grammars: GrammarCache | None) -> SamplingInputs:
    """The sampling inputs of ``step``; ``rows`` are its sampling rows where a request verifies drafts (None: one
    row per request that reaches its last token), ``in_flight`` the previous step's tokens still on the device."""
    sampled = [i for i, (r, p, n) in enumerate(zip(step.requests, step.prefix_lens, step.extend_lens))
               if p + n == len(r.token_ids)]
    reqs = [step.requests[i] for i in sampled] if rows is None else rows.reqs
    if penalties is not None:
        start_penalty_rows(reqs, penalties, in_flight, vocab_size, device)
    before = drafts_before(rows) if rows is not None and penalties is not None else None
    extras = StepExtras.for_step(reqs, penalties, device, before,  # penalties, logprobs, min_tokens
                                 eos_token_ids=eos_token_ids, positions=rows and rows.positions)
    guided = GuidedRows.for_step(grammars, reqs)  # rows with a grammar (structured outputs)
    return SamplingInputs(sampled, reqs, extras, guided)
