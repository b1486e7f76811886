"""Writing a step's sampled tokens into their requests and deciding which requests finish with them.

``TokenWriter.write`` puts a token over its request's placeholder and runs the finish checks in order: a token
outside the vocabulary (the request alone finishes with "error"), a token its grammar refuses ("error"), a stop
token, EOS, a stop string, a finished grammar ("stop"), the length limits (``max_new_tokens``, the context); a
request with a grammar (structured outputs) has each written token fed to its matcher here. Decode steps write one
token per request; a verify step writes each accepted token through the same call, so every check holds token by
token. ``sample_seed`` gives each sample of a request its seed (``seed_generator``: where unseeded requests' seeds
come from with ``EngineConfig.seed``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from compile_attn.engine.requests.request import Request

logger = logging.getLogger(__name__)


class TokenWriter:
    """The finish checks of one engine: its EOS ids, vocabulary size (None: unknown) and context length."""

    def __init__(self, eos_token_ids: Collection[int], vocab_size: int | None, max_context: int) -> None:
        self.eos_token_ids, self.vocab_size, self.max_context = eos_token_ids, vocab_size, max_context

    def write(self, r: Request, at: int, tok: int, logprob: Any) -> str | None:
        """Write ``tok`` over ``r``'s placeholder at ``at`` and check it: the reason ``r`` finishes with it ("error"
        for a token outside the vocabulary or a failing stop check: this request alone finishes), or None."""
        r.unresolved -= 1
        vocab = self.vocab_size
        if vocab is not None and not 0 <= tok < vocab:  # this request's fault: it alone finishes
            logger.warning("request %d: the model sampled token %d, outside the vocabulary [0, %d); finishing "
                           "it with reason 'error'", r.request_id, tok, vocab)
            del r.token_ids[at:]  # the bad token and any later step's placeholder
            r.unresolved = 0
            return "error"
        r.token_ids[at] = tok
        if logprob is not None:
            r.logprobs.append(logprob)
        if r.grammar is not None and not r.grammar.accept_token(tok):  # masked out: only a bug (or a NaN) gets here
            logger.warning("request %d: token %d is not allowed by its grammar; finishing it with reason 'error'",
                           r.request_id, tok)
            del r.token_ids[at + 1:]
            r.unresolved = 0
            return "error"
        try:
            reason = self.stop_reason(r, tok, at + 1)
        except Exception:  # e.g. detokenising its stop strings: this request alone finishes, the step resolves
            logger.exception("request %d: the stop check failed; finishing it with reason 'error'", r.request_id)
            del r.token_ids[at + 1:]  # a later step's placeholders
            r.unresolved = 0
            return "error"
        if reason:
            r.drop_unresolved()
        return reason

    def at_length_limit(self, r: Request, length: int) -> bool:
        """Whether ``r`` with ``length`` tokens (prompt included) has reached max_new_tokens or max_context."""
        return length - len(r.prompt_ids) >= r.params.max_new_tokens or length >= self.max_context

    def stop_reason(self, r: Request, tok: int, length: int) -> str | None:
        """Why ``r`` stops at its token ``tok``, the ``length``-th of its tokens (None: it goes on). Tokens past
        ``length`` (a later step's, in flight) are not looked at. Before ``min_tokens`` output tokens no stop
        token, EOS or stop string ends it (the token that stops is output token ``min_tokens + 1`` or later, as in
        vLLM; the sampler keeps EOS and the stop tokens out until then, see ``StepExtras``)."""
        params = r.params
        may_stop = not params.min_tokens or length - len(r.prompt_ids) > params.min_tokens
        if may_stop:
            if tok in params.stop_token_ids:
                r.stop_reason = tok
                return "stop"
            if not params.ignore_eos and tok in self.eos_token_ids:
                return "stop"
        if r.stop_matcher is not None:
            later = r.token_ids[length:]
            del r.token_ids[length:]
            hit = r.stop_matcher.update(r.token_ids, len(r.prompt_ids))  # decodes every token, stopping or not
            r.token_ids.extend(later)
            if hit is not None and may_stop:
                cut, r.stop_reason = hit
                r.text = cut + r.stop_reason if params.include_stop_str_in_output else cut
                return "stop"
        if r.grammar is not None and r.grammar.is_terminated():  # its grammar is complete and took a stop token
            return "stop"
        return "length" if self.at_length_limit(r, length) else None


def sample_seed(seed: int | None, index: int, generator: torch.Generator | None = None) -> int:
    """The seed of sample ``index`` of a request: the request's own seed for sample 0, for the others distinct
    seeds derived from it (so a seeded call with n > 1 is reproducible), random when the request has no seed (drawn
    from ``generator``, the engine's seeded one with ``EngineConfig.seed``, else from torch's default)."""
    if seed is None:
        return int(torch.randint(0, 2**31 - 1, (), generator=generator).item())
    if index == 0:
        return seed
    return int(np.random.SeedSequence([seed % 2**64, index]).generate_state(1, np.uint64)[0] >> 1)


def seed_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """The engine's generator of unseeded requests' seeds with ``EngineConfig.seed`` (None without one). Like vLLM's
    seed it also seeds ``device``'s CUDA generator (which FlashInfer's sampling kernels draw from for unseeded
    rows)."""
    if seed is None:
        return None
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    return torch.Generator().manual_seed(seed)
