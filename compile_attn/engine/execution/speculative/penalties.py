"""Presence / frequency / repetition penalties with drafts, exact as in plain decoding.

A verify step samples a request's row at draft position j (a tree's node j) as plain decoding would sample there,
so its penalties must count the request's tokens *and the drafts before j* (the node's ancestors in a tree).
``drafts_before`` lists those drafts per sampled row; ``StepExtras`` adds them on the device to the gathered
statistics of the row alone, and the verify step records nothing. After acceptance ``record_accepted`` counts the
tokens each request actually gained (rejected drafts never count) in one upload and one device op. A verify step
is read before the next step is scheduled, so the next step sees the statistics complete.
"""

from __future__ import annotations

import torch

from compile_attn.engine.execution.sampling.penalties import PenaltyState
from compile_attn.engine.execution.speculative.speculator import SampleRows
from compile_attn.engine.requests.request import RequestStatus
from compile_attn.host_tensors import to_device


def drafts_before(rows: SampleRows) -> list[list[int]]:
    """For each sampled row ``rows.reqs[i]``: the draft tokens its request's path holds before the token it samples
    (a chain's j-th row: ``drafts[:j]``; a tree node's row: its own draft and its ancestors'; a plain row: none)."""
    out: list[list[int]] = [[] for _ in rows.reqs]
    for _, first, drafts, parents in rows.spans:
        for node in range(1, len(drafts) + 1):
            if parents is None:
                out[first + node] = drafts[:node]
            else:  # a parent comes before its children (node numbering of draft_tree)
                out[first + node] = out[first + parents[node - 1] + 1] + [drafts[node - 1]]
    return out


def record_accepted(state: PenaltyState, rows: SampleRows, device: torch.device) -> None:
    """Count, after a verify step's tokens are written (``Speculator.resolve``), the tokens each penalised request
    gained in it into its statistics row: those from the index its first row sampled at on. Requests that finished
    are left out (their row is filled afresh by its next request)."""
    at, tokens = [], []
    for r, first, _, _ in rows.spans:
        if r.params.has_penalties and r.penalty_row == r.row and r.status is not RequestStatus.FINISHED:
            gained = r.token_ids[rows.positions[first]:]
            at += [r.row] * len(gained)
            tokens += gained
    if tokens:
        state.record(*to_device([at, tokens], torch.int64, device))
