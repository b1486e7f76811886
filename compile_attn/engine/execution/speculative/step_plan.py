"""One engine step scheduled with speculative decoding: the running requests' drafts proposed, the step scheduled,
and how its forward runs (a verify step or not, each request's draft tree, the rows that sample). It owns one rule:
a tree never shares a step with a prefill chunk. Proposing and planning the sampling rows are ``speculator.py``'s;
launching the step is the engine's."""

from __future__ import annotations

from dataclasses import dataclass

from compile_attn.draft_tree import chain
from compile_attn.engine.execution.speculative.speculator import SampleRows, Speculator
from compile_attn.engine.requests.scheduler import ScheduledStep, Scheduler, SchedulerState


@dataclass
class StepPlan:
    """A scheduled ``step`` and how it runs. ``rows``: its sampling rows where a request verifies drafts (None: a
    plain step, each request sampling its last row if the step reaches its last token). ``verify``: every request
    decodes, so the forward is a ``ForwardMode.TARGET_VERIFY`` step. ``trees``: the batch's ``draft_parents`` where a
    request verifies a tree (None: chains only)."""

    step: ScheduledStep
    rows: SampleRows | None = None
    verify: bool = False
    trees: list[tuple[int, ...]] | None = None


def schedule_step(scheduler: Scheduler, speculator: Speculator | None, state: SchedulerState) -> StepPlan | None:
    """Schedule the next step (None: nothing to run), with the drafts ``speculator`` proposes (none without one).
    Trees are proposed only where the step cannot mix in prefill chunks; if a preemption lets a prefill chunk in beside
    a tree anyway (a verify step runs decoding requests only), the step is scheduled again from ``state`` (the
    scheduler's snapshot before proposing) without the trees."""
    if speculator is not None:
        speculator.propose(scheduler.running, trees=not scheduler.may_mix())
    step = scheduler.schedule()
    if step is None:
        return None
    if any(r.draft_parents for r in step.requests) and not all(r.is_decoding for r in step.requests):
        scheduler.restore(state)
        for r in scheduler.running:
            if r.draft_parents:
                r.draft_ids, r.draft_parents = [], None
        step = scheduler.schedule()
        assert step is not None
    # Nothing proposed for this step's requests: a plain step (no per-row plan), which may overlap the next.
    if speculator is None or not any(r.draft_ids for r in step.requests):
        return StepPlan(step)
    rows = speculator.sample_rows(step)
    if not rows.verifies:
        return StepPlan(step)
    verify = all(r.is_decoding for r in step.requests)
    trees = None
    if verify and any(r.draft_parents for r in step.requests):
        trees = [(-1, *(p + 1 for p in r.draft_parents)) if r.draft_parents else chain(n)
                 for r, n in zip(step.requests, step.extend_lens)]
    return StepPlan(step, rows, verify, trees)
