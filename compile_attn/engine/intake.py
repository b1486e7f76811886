"""How an LLM queues one call's requests (``LLM.generate`` / ``chat`` / ``add_request``): every prompt and parameter
of the call is checked first, so that one bad value queues nothing; then each sample becomes a Request with its own
state (seed, stop-string matcher, logprob list, grammar matcher, penalty statistics) and goes to the scheduler.

The checks of single values live in engine/requests (admission.py, sampling_params.py); this module owns the
order (check everything, then change state) and the LLM's request state it updates: the next request id, the
grammar cache and the penalty statistics, each made on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from compile_attn.engine.execution.sampling.grammar import GrammarCache
from compile_attn.engine.execution.sampling.penalties import PenaltyState
from compile_attn.engine.requests.admission import encode_prompt, split_params
from compile_attn.engine.requests.errors import InvalidRequestError
from compile_attn.engine.requests.request import Request
from compile_attn.engine.requests.stop_strings import StopStringMatcher, backend_tokenizer
from compile_attn.engine.requests.token_writer import sample_seed

if TYPE_CHECKING:
    import torch

    from compile_attn.engine.requests.scheduler import Scheduler
    from compile_attn.engine.requests.token_writer import TokenWriter
    from compile_attn.kv.cache import KVCache


class Intake(Protocol):
    """What this module reads and updates of an ``LLM`` (a protocol: llm.py imports this module, not the reverse)."""

    tokenizer: Any
    vocab_size: int | None
    device: Any  # the LLM's torch.device (EngineConfig.device, resolved)
    scheduler: Scheduler
    kv_cache: KVCache
    writer: TokenWriter
    grammars: GrammarCache | None  # made on first use (``grammar_cache``)
    penalties: PenaltyState | None  # made when the first request with penalties arrives
    _next_id: int
    _seed_generator: torch.Generator | None


def admit(llm: Intake, prompts: list[Any], params: Any, *, prompt_texts: list[str] | None = None,
          one_sample: bool = False) -> list[list[Request]]:
    """Check every prompt and parameter, then queue them all: per prompt, one request per sample (``n``).
    On any error nothing is queued or changed (a grammar compiled on the way stays cached)."""
    params_list = split_params(params, len(prompts))
    ids = [encode_prompt(p, i, tokenizer=llm.tokenizer, vocab_size=llm.vocab_size) for i, p in enumerate(prompts)]
    texts = prompt_texts or [p if isinstance(p, str) else None for p in prompts]
    groups: list[list[Request]] = []
    next_id = llm._next_id
    for i, (t, sp, text) in enumerate(zip(ids, params_list, texts)):
        if one_sample and sp.n != 1:
            raise InvalidRequestError(f"add_request queues one sample but got n={sp.n}; call generate() for n "
                                      f"samples, or add_request n times with different seeds")
        if sp.stop:
            backend_tokenizer(llm.tokenizer)  # refused here, not at the first step, without a fast tokenizer
        if sp.has_penalties and llm.vocab_size is None:
            raise InvalidRequestError("presence / frequency / repetition penalties need the model's vocabulary "
                                      "size, which this model does not tell (no config.vocab_size); leave them "
                                      "at 0, 0, 1")
        if sp.guided_decoding is not None:  # compiled (or found in the cache) now, not in a step
            grammar_cache(llm).compile(sp.guided_decoding)
        groups.append([Request(next_id + k, t, sp, seed=0, prompt=text) for k in range(sp.n)])
        next_id += sp.n
    requests = [r for group in groups for r in group]
    for req in requests:  # refuse the whole call before queueing anything
        llm.scheduler.check_fits(req)
    for group in groups:
        for k, req in enumerate(group):
            req.seed = sample_seed(req.params.seed, k, llm._seed_generator)
            if req.params.stop:
                req.stop_matcher = StopStringMatcher(llm.tokenizer, req.params.stop,
                                                     skip_special_tokens=req.params.skip_special_tokens)
            if req.params.logprobs is not None:
                req.logprobs = []
            if req.params.guided_decoding is not None:
                req.grammar = grammar_cache(llm).matcher(req.params.guided_decoding)
            if req.params.has_penalties and llm.penalties is None:
                llm.penalties = PenaltyState(llm.kv_cache.req_to_token.shape[0], llm.vocab_size, llm.device)
            llm.scheduler.add(req)
    llm._next_id = next_id
    return groups


def grammar_cache(llm: Intake) -> GrammarCache:
    """The compiled grammars of structured outputs over the LLM's tokenizer and vocabulary, made on first use (its
    EOS ids end a finished grammar)."""
    if llm.grammars is None:
        llm.grammars = GrammarCache(llm.tokenizer, llm.vocab_size, sorted(llm.writer.eos_token_ids))
    return llm.grammars
