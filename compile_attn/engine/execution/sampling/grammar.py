"""Structured outputs on the device: compiled grammars (xgrammar, cached), and the token bitmask of a step's rows
that have one, applied to their logits inside the sampling step.

``GrammarCache`` compiles a request's constraint (``GuidedDecodingParams``) once per (kind, spec) against the model's
tokenizer, keeps the compiled grammars in a bounded LRU, and gives each request its own ``GrammarMatcher``.

In a step (``GuidedRows``), the host fills each grammar row's bitmask of allowed next tokens while the device runs
the forward (xgrammar's ``BatchGrammarMatcher`` fills several rows on its threads), sends the bitmasks and the rows
they belong to in one host-to-device copy, and ``apply_token_bitmask_`` sets the other tokens' logits to -inf on
the device; the sampler then picks among the allowed tokens (greedy or sampled alike). The engine feeds each sampled
token back to its matcher when it writes it (``TokenWriter``). xgrammar is imported only once a request has a
constraint. See docs/structured_outputs.md.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from compile_attn.engine.requests.guided_decoding import (GrammarError, GuidedDecodingParams, build_grammar,
                                                         import_xgrammar, xgrammar_message)

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
BITS = 32  # tokens per bitmask word (xgrammar's int32 words)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return math.ceil(vocab_size / BITS)


class GrammarCache:
    """Compiled grammars for one model: xgrammar's ``GrammarCompiler`` over the tokenizer's vocabulary (a Hugging Face
    tokenizer, or an xgrammar ``TokenizerInfo``; ``vocab_size`` tokens, the model's: it may exceed the tokenizer's;
    the ids past it are never allowed) with ``stop_token_ids``
    (the model's EOS ids; None: the tokenizer's) ending a finished grammar, and an LRU of ``max_size`` compiled
    grammars keyed by ``GuidedDecodingParams.key``. ``num_compiled`` counts compilations (cache misses). The compiler
    is built, and xgrammar imported, on the first ``compile``."""

    def __init__(self, tokenizer: Any, vocab_size: int | None, stop_token_ids: Sequence[int] | None = None,
                 max_size: int = DEFAULT_CACHE_SIZE, max_threads: int | str = "auto") -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self.tokenizer, self.vocab_size, self.max_size = tokenizer, vocab_size, max_size
        self.stop_token_ids = sorted(set(stop_token_ids)) if stop_token_ids else None
        self.max_threads = max_threads
        self.num_compiled = 0
        self._compiled: OrderedDict[tuple, Any] = OrderedDict()
        self._compiler: Any = None
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher (its thread pool fills several rows at once)

    def _ensure_compiler(self) -> Any:
        if self._compiler is None:
            xgr = import_xgrammar()
            if self.tokenizer is None:
                raise GrammarError("structured outputs need the model's tokenizer, and this LLM has none; pass "
                                   "LLM(..., tokenizer=...)", "guided_decoding")
            if self.vocab_size is None:
                raise GrammarError("structured outputs need the model's vocabulary size, which this model does not "
                                   "tell (no config.vocab_size)", "guided_decoding")
            if isinstance(self.tokenizer, xgr.TokenizerInfo):  # given as xgrammar's own (benchmarks, tests)
                info = self.tokenizer
            else:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # the LRU here is the cache
            self._batch = xgr.BatchGrammarMatcher(self.max_threads)
            logger.info("structured outputs: xgrammar compiler over %d tokens (%s), stop tokens %s",
                        self.vocab_size, info.vocab_type.name, info.stop_token_ids)
        return self._compiler

    def compile(self, params: GuidedDecodingParams) -> Any:
        """The compiled grammar of ``params``: from the cache, else compiled now (GrammarError for a bad one)."""
        key = params.key
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
            return hit
        compiler = self._ensure_compiler()
        grammar = build_grammar(params)
        try:
            compiled = compiler.compile_grammar(grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar's errors are RuntimeErrors with its message
            raise GrammarError(f"guided_decoding.{params.kind}: cannot compile: {xgrammar_message(exc)}",
                               f"guided_decoding.{params.kind}") from None
        self.num_compiled += 1
        self._compiled[key] = compiled
        if len(self._compiled) > self.max_size:
            self._compiled.popitem(last=False)
        return compiled

    def matcher(self, params: GuidedDecodingParams) -> Any:
        """A fresh ``GrammarMatcher`` (one request's state) over the compiled grammar of ``params``."""
        return import_xgrammar().GrammarMatcher(self.compile(params))

    def __len__(self) -> int:
        return len(self._compiled)

    def fill(self, matchers: Sequence[Any], bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """Fill row ``rows[i]`` (``i`` when ``rows`` is None) of the CPU int32 ``bitmask[N, W]`` with ``matchers[i]``'s
        allowed next tokens; other rows are left as they are."""
        at = list(range(len(matchers))) if rows is None else list(rows)
        if len(matchers) == 1 or self._batch is None:
            for i, m in zip(at, matchers):
                m.fill_next_token_bitmask(bitmask, i)
        else:
            self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask, None if rows is None else at)


class GuidedRows:
    """The rows of one step's logits whose requests have a grammar: ``at[i]`` is the row of ``matchers[i]`` among
    the step's ``num_rows`` sampled rows. ``apply`` masks their logits."""

    def __init__(self, cache: GrammarCache, at: list[int], matchers: list[Any], num_rows: int) -> None:
        self.cache, self.at, self.matchers, self.num_rows = cache, at, matchers, num_rows
        self._layout_for: tuple[int, int, bool] | None = None  # (logits' vocab, bitmask width, one pass): _layout

    @classmethod
    def for_step(cls, cache: GrammarCache | None, reqs: Sequence[Any]) -> GuidedRows | None:
        """None when no request of the step's sampled rows ``reqs`` has a grammar (nothing is filled or copied)."""
        if cache is None:
            return None
        at = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not at:
            return None
        return cls(cache, at, [reqs[i].grammar for i in at], len(reqs))

    def host_bitmask(self, width: int, pin: bool) -> torch.Tensor:
        """One int32 host buffer of ``G * width + G`` words: the G rows' bitmasks (``[G, width]``, filled by their
        matchers), then the logits row each belongs to; pinned when ``pin`` (a GPU's copy never waits)."""
        g = len(self.matchers)
        buf = torch.empty(g * width + g, dtype=torch.int32, pin_memory=pin)
        self.cache.fill(self.matchers, buf[: g * width].view(g, width))
        buf[g * width:] = torch.tensor(self.at, dtype=torch.int32)
        return buf

    def host_bitmask_all_rows(self, width: int, pin: bool) -> torch.Tensor:
        """An int32 host ``[num_rows, width]`` bitmask: the grammar rows filled by their matchers, every other row
        all ones (every token allowed); pinned when ``pin``."""
        buf = torch.empty(self.num_rows, width, dtype=torch.int32, pin_memory=pin)
        free = torch.ones(self.num_rows, dtype=torch.bool)
        free[self.at] = False
        buf[free] = -1  # -1: every bit set
        self.cache.fill(self.matchers, buf, self.at)
        return buf

    def apply(self, logits: torch.Tensor) -> None:
        """Set, in place, the logits of the grammar rows' disallowed tokens to -inf: ``fill_host`` then ``mask``."""
        self.mask(logits, self.fill_host(logits))

    def _layout(self, vocab: int) -> tuple[int, bool]:
        """(int32 words per bitmask row, one pass) for logits of ``vocab`` columns; worked out once per step
        (``fill_host`` and ``mask`` both read it). One pass: a partly guided step masks every row at once: the host
        writes a bitmask of every row (the others all ones) and the device masks the batch as it would a fully
        guided one. The row-index path (G rows scattered into a full bitmask on the device first) measured slower;
        it stays for a bitmask narrower than the logits (its tail is banned in the guided rows only)."""
        known = self._layout_for
        if known is None or known[0] != vocab:
            width = bitmask_width(self.cache.vocab_size or vocab)
            known = self._layout_for = (vocab, width, len(self.matchers) < self.num_rows and width * BITS >= vocab)
        return known[1], known[2]

    def fill_host(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's host bitmask for ``logits`` (pinned on a GPU), filled by the matchers: ``host_bitmask_all_rows``
        or ``host_bitmask``. Filled while the device still runs the step's forward."""
        rows, vocab = logits.shape
        if rows != self.num_rows:
            raise ValueError(f"GuidedRows for {self.num_rows} rows applied to logits of {rows} rows")
        width, one_pass = self._layout(vocab)
        if one_pass:
            return self.host_bitmask_all_rows(width, pin=logits.is_cuda)
        return self.host_bitmask(width, pin=logits.is_cuda)

    def mask(self, logits: torch.Tensor, host: torch.Tensor) -> None:
        """Copy ``fill_host``'s buffer to the device in one copy and mask ``logits`` in place
        (``apply_token_bitmask_``)."""
        rows, vocab = logits.shape
        width, one_pass = self._layout(vocab)
        with torch.inference_mode():  # the logits of an inference-mode forward are changed in place
            dev = host.to(logits.device, non_blocking=True)
            if one_pass:
                apply_token_bitmask_(logits, dev, None)
                return
            g = len(self.matchers)
            every_row = g == rows  # ``at`` is increasing: every row, in order
            apply_token_bitmask_(logits, dev[: g * width].view(g, width), None if every_row else dev[g * width:])


_BANNED_BITS: dict[torch.device, torch.Tensor] = {}  # per device: [256, 8] bool, bit j of byte value i is 0
_triton_kernel: Any = None  # xgrammar's Triton kernel once it has run here (False: unavailable, use torch ops)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None,
                         backend: str = "auto") -> None:
    """In place on ``logits[B, V]``'s device: -inf at every token whose bit is 0 in its row's bitmask. ``bitmask``
    is int32 ``[G, W]`` (bit ``t % 32`` of word ``t // 32`` allows token ``t``, xgrammar's layout); row ``i`` of it
    belongs to logits row ``rows[i]`` (an integer tensor on the device), or to row ``i`` when ``rows`` is None (then
    G == B). Rows not named keep every token. Tokens past ``32 * W`` are never allowed in a masked row. No host sync.

    ``backend``: "torch" (plain torch ops on any device: each byte of the bitmask looks its 8 bits up in a table,
    then one masked fill), "xgrammar" (xgrammar's ``apply_token_bitmask_inplace``: its fused Triton kernel on a
    GPU, its C++ one on the CPU), or "auto": xgrammar's Triton kernel on a GPU where it runs (the first failure
    falls back to torch ops for good), torch ops elsewhere. Tests check the two agree."""
    b, v = logits.shape
    g, w = bitmask.shape
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 (xgrammar's), got {bitmask.dtype}")
    if rows is None and g != b:
        raise ValueError(f"a bitmask of {g} rows without row indices must cover the logits' {b} rows")
    if backend not in ("auto", "torch", "xgrammar"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'xgrammar', got {backend!r}")
    if rows is not None:
        full = torch.full((b, w), -1, dtype=torch.int32, device=logits.device)  # -1: every bit set, all allowed
        bitmask = full.index_copy_(0, rows.long(), bitmask)
    width = min(v, w * BITS)
    if backend == "xgrammar" or (backend == "auto" and logits.is_cuda and _triton_kernel is not False):
        if _xgrammar_apply(logits, bitmask, width, rows, required=backend == "xgrammar"):
            _ban_past(logits, w * BITS, rows)
            return
    table = _BANNED_BITS.get(logits.device)
    if table is None:
        values = torch.arange(256)[:, None] >> torch.arange(8)
        table = _BANNED_BITS[logits.device] = ((values & 1) == 0).to(logits.device)
    # Little-endian words (CPUs and GPUs alike): token t is bit t % 8 of byte t // 8 of the row.
    banned = table[bitmask.view(torch.uint8).long()].view(b, w * BITS)
    logits[:, :width].masked_fill_(banned[:, :width], float("-inf"))
    _ban_past(logits, w * BITS, rows)


def _xgrammar_apply(logits: torch.Tensor, bitmask: torch.Tensor, width: int, rows: torch.Tensor | None,
                    required: bool) -> bool:
    """xgrammar's own kernel on the (full-batch) bitmask; False where it cannot run (and ``required`` is off)."""
    global _triton_kernel
    try:
        xgr = import_xgrammar()
        indices = None if rows is None else rows.to(torch.int32)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=indices)
    except Exception as exc:  # noqa: BLE001 - no Triton, or its kernel does not build here
        if required:
            raise
        logger.warning("xgrammar's bitmask kernel does not run here (%s: %s); masking with torch ops",
                       type(exc).__name__, exc)
        _triton_kernel = False
        return False
    if logits.is_cuda:
        _triton_kernel = True
    return True


def _ban_past(logits: torch.Tensor, bits: int, rows: torch.Tensor | None) -> None:
    """-inf at the tokens past a bitmask of ``bits`` tokens, in the masked rows (a bitmask narrower than the
    logits)."""
    b, v = logits.shape
    if bits >= v:
        return
    if rows is None:
        logits[:, bits:] = float("-inf")
    else:
        masked = torch.zeros(b, dtype=torch.bool, device=logits.device).index_fill_(0, rows.long(), True)
        logits[:, bits:].masked_fill_(masked[:, None], float("-inf"))
