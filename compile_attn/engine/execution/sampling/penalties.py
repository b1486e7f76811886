"""Presence, frequency and repetition penalties on a batch's logits, on the device, as OpenAI and vLLM define them.

The inputs are per-row token statistics kept on the device: ``output_counts[R, V]`` (how often each token occurs in
a request's output so far) and ``prompt_mask[R, V]`` (whether it occurs in the prompt), one row per request slot.
``count_tokens`` builds them from token ids, ``add_tokens`` counts a step's sampled tokens without leaving the
device (no host sync), and ``apply_penalties`` rewrites the logits of the batch's rows; ``PenaltyState`` holds the
statistics per request row for an engine. Nothing here decides which rows need penalties: the caller passes only
those rows, or neutral values for the others.
"""

from __future__ import annotations

import torch


def count_tokens(token_ids: torch.Tensor, rows: torch.Tensor, num_rows: int, vocab_size: int,
                 dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``counts[num_rows, vocab_size]``: how many times each token id occurs in each row, from a flat list of
    ``token_ids[N]`` and the row ``rows[N]`` each belongs to (both int64, on the same device)."""
    if token_ids.shape != rows.shape or token_ids.dim() != 1:
        raise ValueError(f"token_ids and rows must be 1-D of one length, got {tuple(token_ids.shape)} and "
                         f"{tuple(rows.shape)}")
    counts = torch.zeros(num_rows, vocab_size, dtype=dtype, device=token_ids.device)
    add_tokens(counts, rows, token_ids)
    return counts


def add_tokens(counts: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Count ``token_ids[N]`` into ``counts[rows[N]]`` in place (repeated (row, token) pairs add up). No host sync:
    ``token_ids`` can be a step's sampled tokens still on the device."""
    ones = torch.ones(token_ids.shape, dtype=counts.dtype, device=counts.device)
    counts.index_put_((rows, token_ids), ones, accumulate=True)


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Penalised float32 logits ``[B, V]`` (a new tensor; ``logits`` is not changed).

    ``output_counts[B, V]`` (integer) and ``prompt_mask[B, V]`` (bool) describe each row's request; ``presence``,
    ``frequency`` and ``repetition`` are ``[B]`` floats (neutral: 0, 0, 1). First the repetition penalty, on
    every token in the prompt or the output: a positive logit is divided by it, a negative one multiplied. Then
    ``logit -= frequency * count + presence * (count > 0)`` over the output's tokens only.
    """
    rows, vocab = logits.shape
    for name, t in (("output_counts", output_counts), ("prompt_mask", prompt_mask)):
        if t.shape != (rows, vocab):
            raise ValueError(f"{name} must have the logits' shape {(rows, vocab)}, got {tuple(t.shape)}")
    for name, t in (("presence", presence), ("frequency", frequency), ("repetition", repetition)):
        if t.shape != (rows,):
            raise ValueError(f"{name} must have shape ({rows},), got {tuple(t.shape)}")
    out = logits.float()
    counts = output_counts.float()
    seen = prompt_mask | (output_counts > 0)
    scale = torch.where(seen, repetition.float()[:, None], 1.0)
    out = torch.where(out > 0, out / scale, out * scale)
    return out - frequency.float()[:, None] * counts - presence.float()[:, None] * (counts > 0)


class PenaltyState:
    """The per-request-row statistics that penalties read, kept on the device for ``max_rows`` rows (the KV
    cache's request rows) and a vocabulary of ``vocab_size``: ``output_counts[max_rows, V]`` (int32) and
    ``prompt_mask[max_rows, V]`` (bool). ``start`` fills a row when a request takes it (its prompt, and its outputs
    so far after a preemption), ``record`` counts a step's sampled tokens without a host sync, ``apply`` penalises
    the logits of a step's rows."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.output_counts = torch.zeros(max_rows, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(max_rows, vocab_size, dtype=torch.bool, device=device)

    def start(self, row: int, prompt_ids: torch.Tensor, output_ids: torch.Tensor | None = None) -> None:
        """Row ``row`` now holds a request with these prompt (and, after a preemption, output) token ids (int64,
        1-D, on the device or the host)."""
        device = self.output_counts.device
        self.output_counts[row].zero_()
        self.prompt_mask[row].zero_()
        self.prompt_mask[row, prompt_ids.to(device)] = True
        if output_ids is not None and output_ids.numel():
            ids = output_ids.to(device)
            add_tokens(self.output_counts, torch.full_like(ids, row), ids)

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """A step sampled ``token_ids[B]`` for the requests in ``rows[B]`` (int64 device tensors)."""
        add_tokens(self.output_counts, rows, token_ids)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
              repetition: torch.Tensor, extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``apply_penalties`` for the step's ``logits[B, V]``, whose row i belongs to request row ``rows[i]``.
        ``extra``: tokens ``extra[1][N]`` counted into the step's rows ``extra[0][N]`` (indices into ``rows``) on top
        of their requests' statistics, for this step only (a verify row: the drafts before it)."""
        counts = self.output_counts[rows]  # a gathered copy: the correction leaves the request rows as they are
        if extra is not None:
            add_tokens(counts, *extra)
        return apply_penalties(logits, counts, self.prompt_mask[rows], presence, frequency, repetition)
