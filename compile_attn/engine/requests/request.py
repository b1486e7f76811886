"""Request: one prompt's life in the engine (waiting -> running -> finished); RequestOutput and CompletionOutput, what
``LLM.generate`` returns, in vLLM's shape (one RequestOutput per prompt holding its ``n`` samples)."""

from __future__ import annotations

import array
import enum
from dataclasses import dataclass, field
from typing import Any

from compile_attn.engine.requests.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler's list membership and removal must not compare token lists
class Request:
    """``token_ids`` is prompt + generated so far; ``num_cached`` of them have KV in the cache.

    ``token_ids`` is an int64 ``array.array``, not a list: a prefill step gathers thousands of them into its
    upload buffer, which for an array is a memory copy and for a list a conversion of each int.

    The tokens still to run through the model are ``token_ids[num_cached:]``: the prompt (or the
    rest of it) while prefilling, exactly the last sampled token while decoding. A preempted request
    drops its KV (``num_cached = 0``) and later recomputes prompt + outputs. With overlap scheduling the last
    ``unresolved`` entries are placeholders for tokens still on the device (see engine/execution/in_flight.py); the
    scheduler counts them, ``output_ids`` leaves them out.
    """

    request_id: int
    prompt_ids: array.array  # int64, like token_ids
    params: SamplingParams
    seed: int
    token_ids: array.array = field(default_factory=lambda: array.array("q"))
    num_cached: int = 0
    row: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it (None: EOS, length)
    text: str | None = None  # the output text cut before a matched stop string (None: not cut)
    stop_matcher: Any = None  # a StopStringMatcher when the request has stop strings (set on admission)
    prompt: str | None = None  # the prompt as given, when it was a string
    unresolved: int = 0  # trailing placeholders in token_ids: tokens sampled by a step whose output is not read yet
    logprobs: list | None = None  # per output token, a dict[int, Logprob] (when params.logprobs is set)
    penalty_row: int | None = None  # the KV row whose penalty statistics describe this request (see step_extras)
    # Speculative decoding: tokens proposed to follow token_ids, verified by the next step beside the last token
    # (never in token_ids, so never counted, cached or returned before the target model accepts them).
    draft_ids: list[int] = field(default_factory=list)
    # A draft tree: draft i's parent among the drafts (-1: the last token); None: the drafts are a chain.
    draft_parents: list[int] | None = None
    # Structured outputs: the xgrammar GrammarMatcher of params.guided_decoding (set on admission; None: no grammar).
    # It has accepted every output token written so far (TokenWriter.write feeds it each one).
    grammar: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_ids, array.array):
            self.prompt_ids = array.array("q", self.prompt_ids)
        if not self.token_ids:
            self.token_ids = self.prompt_ids[:]  # a copy: outputs are appended to it
        elif not isinstance(self.token_ids, array.array):
            self.token_ids = array.array("q", self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens known on the host (placeholders of a step in flight left out)."""
        return self.token_ids[len(self.prompt_ids) : len(self.token_ids) - self.unresolved].tolist()

    @property
    def num_output_known(self) -> int:
        """``len(output_ids)``: generated tokens known on the host."""
        return len(self.token_ids) - self.unresolved - len(self.prompt_ids)

    def drop_unresolved(self) -> None:
        """Forget the tokens of steps in flight (the request finished before them)."""
        if self.unresolved:
            del self.token_ids[len(self.token_ids) - self.unresolved:]
            self.unresolved = 0

    @property
    def num_output(self) -> int:
        """Generated tokens, those of a step in flight included (what the length limits count)."""
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_cached

    @property
    def is_decoding(self) -> bool:
        # num_pending spelt out: the scheduler asks this of every running request every step
        return self.num_cached > 0 and len(self.token_ids) - self.num_cached == 1


@dataclass
class CompletionOutput:
    """One sample of a prompt: its generated token ids (prompt excluded), their text (None without a tokenizer; cut
    before a matched stop string) and why it stopped: "length", "stop" (EOS, a stop token or a stop string; which
    one is ``stop_reason``: the token id or string, None for EOS), "abort", or "error" when the request itself
    failed (see ``LLM.step``)."""

    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list | None = None  # per token, a dict[int, Logprob] (the sampled token and the top ones) if asked


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt, as vLLM does: ``outputs`` holds its ``SamplingParams.n`` samples
    (index 0 first). ``prompt`` is the prompt string (None when token ids were given). ``token_ids``, ``text`` and
    ``finish_reason`` read the first sample, for code written against the single-output form."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def text_ids(output_ids: list[int], finish_reason: str | None, include_stop_str_in_output: bool) -> list[int]:
    """The output tokens whose decode is the output text of a request that the engine did not cut (no stop string
    matched): all of them, but the stop token (EOS or one of ``stop_token_ids``, the last token of a request that
    finished with "stop") is left out unless ``include_stop_str_in_output``, as vLLM does."""
    if finish_reason == "stop" and not include_stop_str_in_output and output_ids:
        return output_ids[:-1]
    return output_ids


def request_output(group: list[Request], tokenizer: Any) -> RequestOutput:
    """One prompt's RequestOutput: a CompletionOutput per sample, its text cut before a matched stop string."""
    outputs = []
    for k, r in enumerate(group):
        text = r.text
        if text is None and tokenizer is not None:
            ids = text_ids(r.output_ids, r.finish_reason, r.params.include_stop_str_in_output)
            text = tokenizer.decode(ids, skip_special_tokens=r.params.skip_special_tokens)
        outputs.append(CompletionOutput(k, text, r.output_ids, r.finish_reason or "length", r.stop_reason,
                                        None if r.logprobs is None else list(r.logprobs)))
    first = group[0]
    return RequestOutput(first.request_id, first.prompt, first.prompt_ids.tolist(), outputs,
                         finished=all(r.status is RequestStatus.FINISHED for r in group))
