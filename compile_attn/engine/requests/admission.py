"""Admission checks: turn what a caller passes to ``LLM.generate`` / ``add_request`` into token-id arrays and
SamplingParams, refusing anything malformed by name before a request is queued.

Prompts may be strings (with a tokenizer), lists or tuples of ints, or 1-D integer torch tensors / NumPy arrays;
token ids must lie in the model's vocabulary. Sampling parameters may be SamplingParams or dicts of their fields.
Nothing here changes engine state.
"""

from __future__ import annotations

import array
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from compile_attn.engine.requests.errors import InvalidRequestError, RequestTypeError
from compile_attn.engine.requests.sampling_params import SamplingParams

_PROMPT_KINDS = ("a string (with a tokenizer), a list or tuple of token ids, or a 1-D integer tensor or NumPy array")


def find_vocab_size(model: Any) -> int | None:
    """The number of token ids ``model`` accepts: ``vocab_size`` of the model (HFModelAdapter), of its ``cfg``
    (ToyDecoder) or ``config`` (HF), else the rows of its input embedding or the outputs of its LM head. None when
    the model shows none of these; token ids are then not checked against a vocabulary."""
    for owner in (model, getattr(model, "cfg", None), getattr(model, "config", None)):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    embed = None
    if callable(getattr(model, "get_input_embeddings", None)):
        embed = model.get_input_embeddings()
    for name in ("embed_tokens", "embed", "lm_head"):
        embed = embed if embed is not None else getattr(model, name, None)
    if isinstance(embed, torch.nn.Embedding):
        return embed.num_embeddings
    if isinstance(embed, torch.nn.Linear):
        return embed.out_features
    return None


def _is_token(value: object) -> bool:
    """An int-like scalar that can be a token id: int, NumPy integer or 0-d integer tensor, not a bool."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, (int, np.integer)):
        return True
    return isinstance(value, torch.Tensor) and value.ndim == 0 and not value.dtype.is_floating_point \
        and not value.dtype.is_complex and value.dtype != torch.bool


def split_prompts(prompts: Any) -> list[Any]:
    """One prompt or a list of prompts -> a list of prompts (``[]`` for an empty list)."""
    if isinstance(prompts, (str, torch.Tensor, np.ndarray)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and _is_token(prompts[0]):
            return [prompts]
        return list(prompts)
    raise RequestTypeError(
        f"prompts must be {_PROMPT_KINDS}, or a list of these; got {type(prompts).__name__} {_short(prompts)}"
    )


def split_params(params: Any, num_prompts: int) -> list[SamplingParams]:
    """SamplingParams for each prompt from None, one SamplingParams or dict (for every prompt), or one per prompt."""
    if params is None or isinstance(params, (SamplingParams, Mapping)):
        return [_as_params(params)] * num_prompts
    if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
        if len(params) != num_prompts:
            raise InvalidRequestError(f"got {len(params)} SamplingParams for {num_prompts} prompts; pass one per "
                                      f"prompt, or a single SamplingParams (or dict) for all of them")
        return [_as_params(p) for p in params]
    return [_as_params(params)]  # raises, naming the type


def _as_params(params: Any) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, Mapping):
        return SamplingParams.from_mapping(params)
    raise RequestTypeError(
        f"sampling params must be a SamplingParams or a dict of its fields (e.g. {{'max_new_tokens': 8}}), "
        f"got {type(params).__name__} {_short(params)}"
    )


def encode_prompt(prompt: Any, index: int, *, tokenizer: Any, vocab_size: int | None) -> array.array:
    """Prompt ``index`` as an int64 ``array.array`` of token ids, every one in ``[0, vocab_size)``."""
    where = f"prompt {index}"
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestTypeError(f"{where} is a string ({_short(prompt)}) but this LLM has no tokenizer; pass "
                                   f"token ids (a list of ints), or LLM(..., tokenizer=...)")
        ids = _from_list(tokenizer(prompt)["input_ids"], where)
    elif isinstance(prompt, (torch.Tensor, np.ndarray)):
        ids = _from_array(prompt, where)
    elif isinstance(prompt, (list, tuple)):
        ids = _from_list(prompt, where)
    else:
        raise RequestTypeError(f"{where} must be {_PROMPT_KINDS}; got {type(prompt).__name__} {_short(prompt)}")
    if not ids:
        raise InvalidRequestError(f"{where} is empty; pass at least one token id")
    low, high = min(ids), max(ids)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise InvalidRequestError(
            f"{where} has token id {bad} at position {ids.index(bad)}, outside the model's vocabulary {limit}; "
            f"encode prompts with the model's own tokenizer"
        )
    return ids


_BOOL_TYPES = frozenset((bool, np.bool_))  # neither can be subclassed: the exact type says it


def _from_list(prompt: Sequence[Any], where: str) -> array.array:
    try:  # array.array converts in one C loop (a prefill's prompts are thousands of ids) and refuses non-ints
        if not _BOOL_TYPES.isdisjoint(map(type, prompt)):  # array.array takes bools as ints; a C loop, not a genexpr
            raise TypeError
        return array.array("q", prompt)
    except (TypeError, OverflowError):
        bad = next((t for t in prompt if not _fits_int64(t)), None)
        raise RequestTypeError(
            f"prompt token ids must be integers that fit int64, got {bad!r} ({type(bad).__name__}) in {where}; "
            f"pass a list of ints, a 1-D integer tensor, or a string with a tokenizer"
        ) from None


def _fits_int64(value: object) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return False
    try:
        return -(2**63) <= operator.index(value) < 2**63
    except TypeError:
        return False


def _from_array(prompt: torch.Tensor | np.ndarray, where: str) -> array.array:
    kind = "tensor" if isinstance(prompt, torch.Tensor) else "NumPy array"
    if prompt.ndim != 1:
        raise RequestTypeError(
            f"{where} is a {prompt.ndim}-D {kind} of shape {tuple(prompt.shape)}; a prompt is 1-D (token ids). "
            f"For a batch of prompts pass a list of 1-D rows, e.g. list(batch)"
        )
    if isinstance(prompt, torch.Tensor):
        integer = not (prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool)
    else:
        integer = prompt.dtype.kind in "iu"
    if not integer:
        raise RequestTypeError(f"{where} is a {kind} of dtype {prompt.dtype}; token ids need an integer dtype "
                               f"(e.g. .long() / .astype('int64'))")
    values = prompt.tolist()
    if values and max(values) >= 2**63:  # uint64
        raise InvalidRequestError(f"{where} has token id {max(values)}, which does not fit int64")
    return array.array("q", values)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
