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
from dataclasses import dataclass, field, fields
from typing import Any

from compile_attn.engine.errors import InvalidRequestError, RequestTypeError

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


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k 0 / top_p 1.0 / min_p 0.0 disable those filters (min_p keeps tokens
    with probability >= min_p times the most likely token's). ``seed`` makes a request's
    samples reproducible whatever else is in its batch. Generation stops at ``max_new_tokens``, at the
    model's EOS token (unless ``ignore_eos``), or at any of ``stop_token_ids`` (the stop token is kept
    in the output).

    Ranges: max_new_tokens an int >= 1; temperature a finite number >= 0; top_k an int >= 0; top_p a finite number
    in (0, 1]; seed None or an int64; stop_token_ids ints >= 0; ignore_eos a bool. ``SamplingParams.from_mapping``
    builds one from a dict (``LLM.generate`` accepts dicts too).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("max_new_tokens", check_int("max_new_tokens", self.max_new_tokens, low=1))
        put("temperature", check_real("temperature", self.temperature, " (0 = greedy)"))
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        put("top_k", check_int("top_k", self.top_k, low=0, hint=" (0 = no top-k filter)"))
        put("top_p", check_real("top_p", self.top_p, " (1 = no top-p filter)"))
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1] (1 = no top-p filter), got {self.top_p}")
        put("min_p", check_real("min_p", self.min_p, " (0 = no min-p filter)"))
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1] (0 = no min-p filter), got {self.min_p}")
        if self.seed is not None:
            put("seed", check_int("seed", self.seed, hint=" (the sampler's seeds are int64; None = random)"))
        put("stop_token_ids", _check_stop_ids(self.stop_token_ids))
        if not _is_bool(self.ignore_eos):
            raise RequestTypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r} "
                                   f"({type(self.ignore_eos).__name__})")
        put("ignore_eos", bool(self.ignore_eos))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SamplingParams:
        """``SamplingParams(**values)``, refusing keys that are not fields by name."""
        names = {f.name for f in fields(cls)}
        unknown = [k for k in values if k not in names]
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(names))}"
            )
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_stop_ids(ids: object) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise RequestTypeError(f"stop_token_ids must be a sequence of token ids, got {ids!r} ({type(ids).__name__}); "
                               f"pass e.g. stop_token_ids=[2] or (2, 7)")
    return tuple(check_int("stop_token_ids entry", t, low=0) for t in ids)
