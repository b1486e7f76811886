"""The sampling half of one engine step: run the step's forward for the rows that sample and pick their next
tokens on the device, uploading each request's sampling parameters in one copy per dtype.

Nothing here waits for the device: the tokens come back as a device tensor, which the engine copies to the host
asynchronously (see engine/execution/in_flight.py) while it prepares the next step.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from compile_attn.batch import ForwardBatch
from compile_attn.engine.requests.request import Request
from compile_attn.engine.execution.sampling.grammar import GuidedRows
from compile_attn.engine.execution.sampling.sampler import SamplingPlan, sample
from compile_attn.engine.execution.step_extras import StepExtras
from compile_attn.engine.execution.step_runner import StepRunner
from compile_attn.host_tensors import to_device, upload
from compile_attn.graph_runner.step_kernels import TokenFeed


def forward_and_sample(runner: StepRunner, fb: ForwardBatch, reqs: list[Request], sampled: list[int],
                       device: torch.device, extras: StepExtras | None = None, feed: TokenFeed | None = None,
                       *, rows: list[int] | None = None, positions: list[int] | None = None,
                       guided: GuidedRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """int64 device tensor of the next token of each request ``reqs[i]`` (row ``sampled[i]`` of the batch: the
    request whose last token the step computes), after running ``fb`` through ``runner``; and, when ``extras``
    asks for them, the packed log-probabilities of the rows that want them (else None). ``extras`` also applies
    the penalties before sampling. ``feed``: what the placeholders among ``fb``'s input ids stand for.

    A verify step samples several rows per request: ``rows`` then names the batch's token row of each ``reqs[i]``
    (``sampled`` is not read) and ``positions`` the index in its request's tokens that each sampled token takes
    (default ``len(token_ids)``: a seeded request's noise follows it).

    ``guided``: the rows whose requests have a grammar (structured outputs); their bitmasks are filled on the host
    once the forward is launched, copied in one transfer and applied to the logits before penalties and sampling
    (``GuidedRows.apply``). Logprobs stay the model's raw ones: where a row asks for them, the mask goes on a copy."""
    ends = list(accumulate(fb.extend_seq_lens_cpu))
    keep = rows if rows is not None else [ends[i] - 1 for i in sampled]
    every_row = len(keep) == fb.num_tokens  # the LM head runs on every row (a decode step): no index tensor
    temps = [r.params.temperature for r in reqs]
    if all(t <= 0 for t in temps):  # all greedy: no noise kernels and no parameter uploads
        keep_t = None if every_row else to_device([keep], torch.int64, device)[0]
        raw = runner.run(fb, keep_t, feed)  # a step that samples no row: logits [0, V], no tokens
        masked = _mask(raw, guided, extras)
        if extras is None:
            return masked.argmax(dim=-1), None
        tokens = extras.penalise(masked).argmax(dim=-1)
        return tokens, extras.after_sampling(raw, tokens)
    top_ks = [r.params.top_k for r in reqs]
    top_ps = [r.params.top_p for r in reqs]
    min_ps = [r.params.min_p for r in reqs]
    plan = SamplingPlan.for_rows(temps, top_ks, top_ps, min_ps, [r.params.seed is not None for r in reqs])
    # Two host-to-device copies for the step (one per dtype), not one per field; a filter that no row uses is
    # not uploaded (a batch without filters sends temperatures, seeds and positions only). A request's position
    # counts its tokens so far, the one being computed by the step still in flight included, so a seeded
    # request draws the same noise whether or not steps overlap.
    ints = [[r.seed for r in reqs], positions if positions is not None else [len(r.token_ids) for r in reqs]]
    ints += ([top_ks] if plan.max_top_k else []) + ([] if every_row else [keep])
    on_device = to_device(ints, torch.int64, device)
    seeds, positions = on_device[0], on_device[1]
    top_k = on_device[2] if plan.max_top_k else None
    logits = runner.run(fb, None if every_row else on_device[-1], feed)
    masked = _mask(logits, guided, extras)
    floats = [temps] + ([top_ps] if plan.top_p_rows else []) + ([min_ps] if plan.min_p_rows else [])
    temperature, *filters = upload(torch.tensor(floats, dtype=torch.float32), device).unbind(0)
    top_p = filters.pop(0) if plan.top_p_rows else None
    min_p = filters.pop(0) if plan.min_p_rows else None
    if extras is None:
        return sample(masked, temperature, top_k, top_p, seeds, positions, min_p=min_p, plan=plan), None
    tokens = sample(extras.penalise(masked), temperature, top_k, top_p, seeds, positions, min_p=min_p, plan=plan)
    return tokens, extras.after_sampling(logits, tokens)


def _mask(logits: torch.Tensor, guided: GuidedRows | None, extras: StepExtras | None) -> torch.Tensor:
    """The logits with the grammar rows' bitmasks applied: in place, or on a copy when some row wants logprobs
    (which are computed from the raw logits)."""
    if guided is None:
        return logits
    masked = logits.clone() if extras is not None and extras.logprob_at else logits
    guided.apply(masked)
    return masked
