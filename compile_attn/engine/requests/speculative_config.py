"""SpeculativeConfig: the ``speculative_config`` option of ``LLM(...)`` / ``--speculative-config``, in vLLM's names.

``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": a, "prompt_lookup_max": b}`` proposes up to
K tokens per decoding request by prompt lookup (the tokens that followed the latest earlier occurrence of the
request's last ``a`` .. ``b`` tokens; no second model); ``{"method": "draft_model", "model": <HF directory, config or
module>, "num_speculative_tokens": K}`` drafts K tokens with a smaller model of the target's tokenizer
(engine/execution/speculative/draft_model.py); ``{"method": "eagle", "model": <EAGLE-1/2 head directory>, ...}``
drafts with an EAGLE head over the target's hidden states (engine/execution/speculative/eagle.py; chains only,
"eagle3" is refused by name). ``"topk"`` (default 1: a chain) and ``"num_draft_tokens"``
describe trees: the draft model's top-``topk`` tokens at each depth of its greedy chain, or the continuations of
up to ``topk`` earlier occurrences of the matched n-gram, at most ``num_draft_tokens`` nodes (default K x topk).
Checked here, once, before a model loads; a bad key or value is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compile_attn.engine.requests.errors import EngineOptionError

METHODS = ("ngram", "draft_model", "eagle")
# vLLM's defaults: with neither bound given, both are 5; with one given, the other takes its value.
DEFAULT_PROMPT_LOOKUP = 5
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: how drafts are proposed ("ngram", "draft_model", "eagle"). num_speculative_tokens: draft tokens per
    request and step (K). prompt_lookup_min / prompt_lookup_max: the n-gram lengths "ngram" matches, longest first.
    model: the draft model of "draft_model" (an HF directory or hub-cache id, a transformers config, an HF model or
    a protocol model), or the EAGLE-1/2 head directory of "eagle".
    topk: candidates per depth of a tree (1: a chain of K). num_draft_tokens: a tree's draft tokens at most (default
    K x topk; its depth is at most K)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    topk: int = 1
    num_draft_tokens: int | None = None
    model: Any = None

    def __post_init__(self) -> None:
        if self.method == "eagle3":
            raise EngineOptionError("speculative_config: method 'eagle3' is not supported (an EAGLE-3 head reads "
                                    "hidden states of three target layers and drafts over its own vocabulary); "
                                    "supported: 'eagle' (EAGLE-1/2 heads), 'draft_model', 'ngram'")
        if self.method not in METHODS:
            raise EngineOptionError(f"speculative_config: method {self.method!r} is not one of {METHODS}; "
                                    f"e.g. {{'method': 'ngram', 'num_speculative_tokens': 4}}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "topk"):
            _check_positive(name, getattr(self, name))
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise EngineOptionError(f"speculative_config: num_speculative_tokens={self.num_speculative_tokens} is "
                                    f"more than {MAX_SPECULATIVE_TOKENS}; a verify step that long wastes compute")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise EngineOptionError(f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} is larger than "
                                    f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft_model" and self.model is None:
            raise EngineOptionError("speculative_config: method 'draft_model' needs 'model' (the draft model's HF "
                                    "directory, config or module), e.g. {'method': 'draft_model', 'model': "
                                    "'/models/Llama-3.2-1B', 'num_speculative_tokens': 4}")
        if self.method == "eagle" and self.model is None:
            raise EngineOptionError("speculative_config: method 'eagle' needs 'model' (the EAGLE head's checkpoint "
                                    "directory), e.g. {'method': 'eagle', 'model': '/models/EAGLE-LLaMA3-Instruct-8B', "
                                    "'num_speculative_tokens': 4}")
        if self.method == "eagle" and self.topk > 1:
            raise EngineOptionError(f"speculative_config: topk={self.topk} (trees) is not built for method 'eagle'; "
                                    f"use topk 1 (a chain), or method 'draft_model' / 'ngram' for trees")
        if self.method == "ngram" and self.model is not None:
            raise EngineOptionError(f"speculative_config: method 'ngram' takes no 'model' (got {self.model!r:.60}); "
                                    f"use method 'draft_model' to draft with a model")
        if self.num_draft_tokens is not None:
            _check_positive("num_draft_tokens", self.num_draft_tokens)
        if self.num_draft_tokens is not None and self.topk == 1 and self.num_draft_tokens != \
                self.num_speculative_tokens:
            raise EngineOptionError(f"speculative_config: num_draft_tokens={self.num_draft_tokens} caps a tree "
                                    f"(topk > 1); a chain has num_speculative_tokens={self.num_speculative_tokens} "
                                    f"drafts: leave num_draft_tokens out or set topk")
        if self.topk > 1 and self.max_draft_tokens > MAX_SPECULATIVE_TOKENS:
            raise EngineOptionError(f"speculative_config: a tree of topk={self.topk} x num_speculative_tokens="
                                    f"{self.num_speculative_tokens} drafts has more than {MAX_SPECULATIVE_TOKENS}; "
                                    f"cap it with num_draft_tokens")

    @property
    def max_draft_tokens(self) -> int:
        """Draft tokens a request verifies per step at most: K for a chain, ``num_draft_tokens`` (default K x topk)
        for a tree."""
        if self.topk == 1:
            return self.num_speculative_tokens
        return self.num_draft_tokens or self.num_speculative_tokens * self.topk

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict of vLLM's keys, or its JSON text (the command line's form); None stays
        None. Unknown keys are refused with the known ones; prompt lookup bounds default as in vLLM."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise EngineOptionError(f"speculative_config is not valid JSON ({exc}); e.g. "
                                        f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'") from None
        if not isinstance(value, Mapping):
            raise EngineOptionError(f"speculative_config must be a dict (or its JSON text), got "
                                    f"{type(value).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise EngineOptionError(f"speculative_config: unknown key(s) {unknown}; the keys are {known}")
        options = dict(value)
        if "method" not in options or "num_speculative_tokens" not in options:
            raise EngineOptionError("speculative_config needs 'method' and 'num_speculative_tokens', e.g. "
                                    "{'method': 'ngram', 'num_speculative_tokens': 4}")
        lo, hi = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
        options["prompt_lookup_min"] = lo if lo is not None else (hi if hi is not None else DEFAULT_PROMPT_LOOKUP)
        options["prompt_lookup_max"] = hi if hi is not None else options["prompt_lookup_min"]
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        """The options as vLLM's dict (what ``/v1/models`` and the benchmarks report); a draft model given as an
        object is named by its type."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out["model"] is not None and not isinstance(out["model"], str):
            out["model"] = str(out["model"]) if hasattr(out["model"], "__fspath__") else type(out["model"]).__name__
        return out


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EngineOptionError(f"speculative_config: {name} must be a positive int, got {value!r}")
