"""SamplingParams: how one request's tokens are chosen and when it stops.

Every field is checked on construction, by type and range, so a bad value is refused by name before a request is
queued rather than failing (or silently sampling wrong) inside a step. Values are normalised to plain Python
``int`` / ``float`` / ``bool`` / ``tuple`` (NumPy scalars are accepted).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from compile_attn.engine.requests.errors import InvalidRequestError, RequestTypeError
from compile_attn.engine.requests.guided_decoding import GuidedDecodingParams
from compile_attn.engine.requests.mapping_keys import field_names, refuse_unknown_keys

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the sampler holds top_k, seeds and token ids as int64


def _is_bool(value: object) -> bool:
    """bool, numpy.bool_, or a bool tensor (each also passes for an integer)."""
    return isinstance(value, bool) or "bool" in str(getattr(value, "dtype", type(value).__name__))


def check_int(name: str, value: object, *, low: int = INT64_MIN, high: int = INT64_MAX, hint: str = "") -> int:
    """``value`` as an int in ``[low, high]``: anything with ``__index__`` (int, NumPy integers, a 0-d integer
    tensor). RequestTypeError for anything else (floats such as 2.0 and bools included: an int is meant),
    InvalidRequestError outside the range."""
    try:
        if _is_bool(value):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise RequestTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}){hint}") from None
    if not low <= value <= high:
        bounds = f">= {low}" if high == INT64_MAX and low != INT64_MIN else f"in [{low}, {high}]"
        raise InvalidRequestError(f"{name} must be {bounds}, got {value}{hint}")
    return value


def check_real(name: str, value: object, hint: str = "") -> float:
    """``value`` as a finite float; RequestTypeError for a non-number or bool, InvalidRequestError for NaN / inf."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise RequestTypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}){hint}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {value}{hint}")
    return value


# vLLM's SamplingParams options that this engine does not implement, with the value that means "off": passing
# the neutral value is accepted (ported code often spells defaults out), anything else is refused by name.
UNSUPPORTED = {"prompt_logprobs": None, "best_of": None}
ALIASES = {"max_tokens": "max_new_tokens"}  # vLLM's names for fields spelt differently here
MAX_LOGPROBS = 20  # top logprobs per token at most (vLLM's default max_logprobs, OpenAI's top_logprobs limit)
PENALTY_RANGE = 2.0  # presence / frequency penalties lie in [-2, 2], as OpenAI and vLLM define them



@dataclass(frozen=True, init=False)
class SamplingParams:
    """temperature 0 is greedy. top_k 0 / top_p 1.0 / min_p 0.0 disable those filters (min_p keeps tokens
    with probability >= min_p times the most likely token's). ``seed`` makes a request's
    samples reproducible whatever else is in its batch. Generation stops at ``max_new_tokens``, at the
    model's EOS token (unless ``ignore_eos``), at any of ``stop_token_ids`` (the stop token is kept in the output's
    token ids; its text is left out of the output text, as vLLM does), or once the decoded output text contains one
    of the ``stop`` strings (the text is cut where the string starts; needs a tokenizer). ``include_stop_str_in_output``
    keeps the stop string (or the stop token's text) at the end of the text instead. ``min_tokens`` (0 = off): no
    stop before that many output tokens: EOS and the ``stop_token_ids`` are masked out of the logits on the device
    until then, and neither they nor a stop string end the request earlier. ``skip_special_tokens`` (default True)
    leaves special tokens out of the output text. ``n`` > 1 draws n independent samples of the prompt, each
    its own request; with a ``seed`` they use distinct seeds derived from it, so the call stays reproducible.
    ``logprobs`` (None = off) returns, per output token, its log-probability and rank and the ``logprobs`` likeliest
    tokens' (0: the sampled token only). ``presence_penalty`` / ``frequency_penalty`` (0 = off) lower the logits of
    tokens the output already holds, by a constant / per occurrence; ``repetition_penalty`` (1 = off) divides the
    positive logits and multiplies the negative ones of tokens in the prompt or the output. ``guided_decoding``
    (None = off; a GuidedDecodingParams or a dict of its fields) constrains the output to a JSON schema, regex,
    choice or grammar (structured outputs, with xgrammar). With both, the grammar's mask and the ``min_tokens`` one
    apply; a grammar complete before ``min_tokens`` (it allows only EOS) ends the request there, with "stop".

    Ranges: max_new_tokens an int >= 1; temperature a finite number >= 0; top_k an int >= 0 (-1, vLLM's "off", is
    taken as 0); top_p a finite number in (0, 1]; seed None or an int64; stop_token_ids ints >= 0; ignore_eos a bool;
    stop a string or a list of non-empty strings; n an int >= 1; logprobs None or an int in [0, 20]; presence_penalty
    and frequency_penalty finite numbers in [-2, 2]; repetition_penalty a finite number > 0; min_tokens an int in
    [0, max_new_tokens]; skip_special_tokens and include_stop_str_in_output bools. ``SamplingParams.from_mapping``
    builds one from a dict (``LLM.generate`` accepts dicts too).

    Next to vLLM: ``max_tokens=`` is accepted as vLLM's name for ``max_new_tokens`` (and read back as
    ``.max_tokens``); giving both with different values is refused. The default temperature is 0.0 (greedy)
    where vLLM's is 1.0: pass ``temperature=1.0`` for vLLM's default sampling. vLLM's ``prompt_logprobs`` and
    ``best_of`` are not supported: a value other than their neutral one is refused by name. ``logprobs`` (0-20 top
    tokens besides the sampled one, from the model's raw logits) and the presence / frequency / repetition
    penalties (applied before temperature and filters) take vLLM's names and ranges.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_decoding: GuidedDecodingParams | None = None

    def __init__(self, max_new_tokens: int | None = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                 stop_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                 stop: str | Iterable[str] | None = None, n: int = 1, logprobs: int | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, *,
                 max_tokens: int | None = None, min_tokens: int = 0, skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False,
                 guided_decoding: GuidedDecodingParams | Mapping[str, Any] | None = None, **unsupported: Any) -> None:
        _refuse_unsupported(unsupported)
        if max_new_tokens is not None and max_tokens is not None and max_new_tokens != max_tokens:
            raise InvalidRequestError(f"max_tokens={max_tokens!r} and max_new_tokens={max_new_tokens!r} disagree; "
                                      f"they are the same option (max_tokens is vLLM's name): pass one of them")
        chosen = max_new_tokens if max_new_tokens is not None else max_tokens
        name = "max_new_tokens" if max_new_tokens is not None or max_tokens is None else "max_tokens"

        def put(field_name: str, value: object) -> None:
            object.__setattr__(self, field_name, value)

        put("max_new_tokens", check_int(name, 16 if chosen is None else chosen, low=1))
        put("temperature", check_real("temperature", temperature, " (0 = greedy)"))
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        put("top_k", max(0, check_int("top_k", top_k, low=-1, hint=" (0 or -1 = no top-k filter)")))
        put("top_p", check_real("top_p", top_p, " (1 = no top-p filter)"))
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1] (1 = no top-p filter), got {self.top_p}")
        put("min_p", check_real("min_p", min_p, " (0 = no min-p filter)"))
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1] (0 = no min-p filter), got {self.min_p}")
        put("seed", None if seed is None else
            check_int("seed", seed, hint=" (the sampler's seeds are int64; None = random)"))
        put("stop_token_ids", _check_stop_ids(stop_token_ids))
        if not _is_bool(ignore_eos):
            raise RequestTypeError(f"ignore_eos must be a bool, got {ignore_eos!r} ({type(ignore_eos).__name__})")
        put("ignore_eos", bool(ignore_eos))
        put("stop", _check_stop_strings(stop))
        put("n", check_int("n", n, low=1, hint=" (samples per prompt)"))
        put("logprobs", None if logprobs is None else
            check_int("logprobs", logprobs, low=0, high=MAX_LOGPROBS, hint=" (top logprobs per token; None = off)"))
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            value = check_real(name, value, " (0 = off)")
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise InvalidRequestError(f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0 = off), "
                                          f"got {value}")
            put(name, value)
        put("repetition_penalty", check_real("repetition_penalty", repetition_penalty, " (1 = off)"))
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        put("min_tokens", check_int("min_tokens", min_tokens, low=0, hint=" (output tokens before a stop may end the "
                                                                         "request; 0 = off)"))
        if self.min_tokens > self.max_new_tokens:
            limit = "max_new_tokens" if max_new_tokens is not None or max_tokens is None else "max_tokens"
            raise InvalidRequestError(f"min_tokens={self.min_tokens} is more than {limit}={self.max_new_tokens}; "
                                      f"min_tokens must be <= {limit}")
        for flag, value in (("skip_special_tokens", skip_special_tokens),
                            ("include_stop_str_in_output", include_stop_str_in_output)):
            if not _is_bool(value):
                raise RequestTypeError(f"{flag} must be a bool, got {value!r} ({type(value).__name__})")
            put(flag, bool(value))
        put("guided_decoding", GuidedDecodingParams.of(guided_decoding))  # structured outputs (xgrammar)

    @property
    def max_tokens(self) -> int:
        """vLLM's name for ``max_new_tokens``."""
        return self.max_new_tokens

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SamplingParams:
        """``SamplingParams(**values)``, refusing keys that are neither fields nor vLLM's names by name."""
        known = field_names(cls) | set(ALIASES)
        refuse_unknown_keys(values, known | set(UNSUPPORTED), "unknown sampling parameter(s)", known=known)
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Some presence, frequency or repetition penalty is on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _refuse_unsupported(values: Mapping[str, Any]) -> None:
    """vLLM options not implemented here, given a value other than "off", are refused by name; other names too."""
    refuse_unknown_keys(values, UNSUPPORTED, "SamplingParams got unknown parameter(s)",
                        known=field_names(SamplingParams) | set(ALIASES), error=RequestTypeError)
    used = [f"{k}={v!r}" for k, v in values.items() if v != UNSUPPORTED[k]]
    if used:
        raise InvalidRequestError(f"{', '.join(used)}: not supported yet by compile_attn's sampler; leave "
                                  f"{'it' if len(used) == 1 else 'them'} unset (supported: temperature, top_k, "
                                  f"top_p, min_p, seed, stop, stop_token_ids, n, logprobs, presence_penalty, "
                                  f"frequency_penalty, repetition_penalty, min_tokens, skip_special_tokens, "
                                  f"include_stop_str_in_output, guided_decoding)")


def _check_stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else stop
    if isinstance(strings, bytes) or not isinstance(strings, Iterable):
        raise RequestTypeError(f"stop must be a string or a list of strings, got {stop!r} ({type(stop).__name__})")
    strings = tuple(strings)
    for s in strings:
        if not isinstance(s, str):
            raise RequestTypeError(f"stop entries must be strings, got {s!r} ({type(s).__name__}); stop on token "
                                   f"ids with stop_token_ids=[...]")
        if not s:
            raise InvalidRequestError("stop has an empty string, which every text contains; remove it")
    return strings


def _check_stop_ids(ids: object) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise RequestTypeError(f"stop_token_ids must be a sequence of token ids, got {ids!r} ({type(ids).__name__}); "
                               f"pass e.g. stop_token_ids=[2] or (2, 7)")
    return tuple(check_int("stop_token_ids entry", t, low=0) for t in ids)
