"""Log-probabilities of a step's sampled tokens and of each row's likeliest tokens, on the device, and their move to
the host in vLLM's shape (per output token, a dict from token id to ``Logprob``).

``compute_logprobs`` works on the logits the model produced (before temperature, penalties and filters: vLLM's
default "raw" logprobs, and what OpenAI's API reports) and needs no host sync; ``to_host`` is the one copy to the
host, for the rows that asked for logprobs. Which rows ask, and how many top tokens each wants, is the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability, its rank among the vocabulary (1 = likeliest) and, once detokenised, its text
    (vLLM's ``Logprob``)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(frozen=True)
class StepLogprobs:
    """Device tensors for a step's ``B`` sampled rows: the sampled token ids ``token_ids[B]``, their log-probability
    ``sampled[B]`` (float32) and rank ``rank[B]`` (int64, 1 = likeliest), and the ``k`` likeliest tokens
    ``top_ids[B, k]`` / ``top_logprobs[B, k]``, likeliest first."""

    token_ids: torch.Tensor
    sampled: torch.Tensor
    rank: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> StepLogprobs:
    """Log-softmax of ``logits[B, V]`` in float32, read at ``token_ids[B]`` (int64, the sampled tokens) and at each
    row's ``num_top`` likeliest tokens (0: none). A token's rank is 1 + the number of tokens strictly likelier."""
    if logits.dim() != 2 or token_ids.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [B, V] and token_ids [B], got {tuple(logits.shape)} and "
                         f"{tuple(token_ids.shape)}")
    if not 0 <= num_top <= logits.shape[1]:
        raise ValueError(f"num_top must be in [0, {logits.shape[1]}] (the vocabulary), got {num_top}")
    logp = torch.log_softmax(logits.float(), dim=-1)
    sampled = logp.gather(1, token_ids[:, None]).squeeze(1)
    rank = (logp > sampled[:, None]).sum(dim=1) + 1
    top_logprobs, top_ids = logp.topk(num_top, dim=-1) if num_top else (logp[:, :0], token_ids[:, None][:, :0])
    return StepLogprobs(token_ids, sampled, rank, top_ids, top_logprobs)


def pack(step: StepLogprobs) -> torch.Tensor:
    """The step's log-probabilities as one float64 device tensor ``[B, 3 + 2k]`` (token id, its logprob, its rank,
    the top ids, the top logprobs), so that they reach the host in one copy. Token ids < 2**53 are exact."""
    return torch.cat([step.token_ids[:, None].double(), step.sampled[:, None].double(), step.rank[:, None].double(),
                      step.top_ids.double(), step.top_logprobs.double()], dim=1)


def unpack(rows: Sequence[Sequence[float]], num_top: Sequence[int]) -> list[dict[int, Logprob]]:
    """Per row of ``pack``'s host copy, the dict vLLM returns for one output token: the sampled token first, then the
    row's ``num_top[i]`` likeliest (at most the ``k`` packed; a token in both appears once)."""
    out = []
    for row, n in zip(rows, num_top):
        k = (len(row) - 3) // 2
        if not 0 <= n <= k:
            raise ValueError(f"num_top must be in [0, {k}] (the top tokens computed), got {n}")
        entry = {int(row[0]): Logprob(row[1], int(row[2]))}
        for j in range(n):
            entry.setdefault(int(row[3 + j]), Logprob(row[3 + k + j], j + 1))
        out.append(entry)
    return out


def to_host(step: StepLogprobs, num_top: Sequence[int]) -> list[dict[int, Logprob]]:
    """``unpack`` of ``pack(step)``: one device-to-host copy (which waits for the device)."""
    rows, k = step.top_ids.shape
    if len(num_top) != rows or any(n < 0 or n > k for n in num_top):
        raise ValueError(f"num_top must give {rows} counts in [0, {k}], got {list(num_top)}")
    return unpack(pack(step).cpu().tolist(), num_top)
