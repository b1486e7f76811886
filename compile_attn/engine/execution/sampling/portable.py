"""Sampling in plain torch ops, for any device: Gumbel-max over the whole vocabulary without sorting, and
top-k / top-p / min_p over a row's candidates (``torch.topk`` of the batch's largest k, or a full sort when
a row has top-p without top-k).

The kernels are elementwise work plus row reductions, which Inductor fuses into a kernel or two; they run
eagerly or through ``torch.compile`` with the row count (and the candidate count) dynamic, so one graph
serves every batch size of two rows or more and one serves a single row. Randomness is the counter hash
of ``noise``, keyed by the token id.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from compile_attn import env
from compile_attn.engine.execution.sampling.noise import hashed_gumbel, row_keys

MIN_TEMPERATURE = 1e-5  # divisor for temperature-0 rows, whose result is replaced by the argmax
_ARGMAX_CHUNK = 2048  # columns per first-stage argmax block (Inductor does not split argmax reductions)
WIDE_ROWS = 128  # from this many rows on, one block per row fills the GPU: a one-stage argmax is cheaper


def _first_argmax(score: torch.Tensor) -> torch.Tensor:
    """``score.argmax(-1)`` (first maximum) in two stages, ``_ARGMAX_CHUNK`` columns per block, so that a
    batch of a few rows still spreads over many thread blocks."""
    rows, cols = score.shape
    if cols <= _ARGMAX_CHUNK:
        return score.argmax(-1)
    pieces = -(-cols // _ARGMAX_CHUNK)
    padded = F.pad(score, (0, pieces * _ARGMAX_CHUNK - cols), value=float("-inf"))
    best, where = padded.view(rows, pieces, _ARGMAX_CHUNK).max(-1)
    piece = best.argmax(-1, keepdim=True)  # the first piece holding the row's maximum
    return (piece * _ARGMAX_CHUNK + where.gather(-1, piece)).squeeze(-1)


def _plain_score(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                 token_ids: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    x = logits.float()
    t = temperature[:, None]
    scaled = x / t.clamp(min=MIN_TEMPERATURE)
    if min_p is not None:
        floor = scaled.amax(-1, keepdim=True) + torch.log(min_p)[:, None]  # log(0) = -inf keeps every token
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    return torch.where(t > 0, scaled + hashed_gumbel(row_keys(seeds, positions), token_ids), x)


def plain_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
    token_ids: torch.Tensor,
) -> torch.Tensor:
    """Next token per row of ``logits[N, V]`` with no filter: ``argmax(logits / T + Gumbel)``, the argmax
    where ``T == 0``. No sort, no softmax: one pass over the logits. ``token_ids`` is ``vocab_ids(V, device)``:
    an input tensor rather than an ``arange`` inside the graph, because Inductor folds ``arange * constant``
    into its int32 index arithmetic, which overflows for the hash's multiplier."""
    return _first_argmax(_plain_score(logits, temperature, seeds, positions, token_ids, None))


def plain_tokens_wide(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
    token_ids: torch.Tensor,
) -> torch.Tensor:
    """``plain_tokens`` for ``WIDE_ROWS`` rows or more: the argmax in one stage (a block per row; the two-stage
    split pays for itself only when rows are too few to occupy the GPU). A function of its own, so its compiled
    graph is separate from the narrow one."""
    return _plain_score(logits, temperature, seeds, positions, token_ids, None).argmax(-1)


def plain_tokens_min_p(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
    token_ids: torch.Tensor, min_p: torch.Tensor,
) -> torch.Tensor:
    """``plain_tokens`` after min_p (``min_p[N]``, 0 = off): tokens with ``p < min_p * p_max``, i.e.
    ``logits / T < max(logits / T) + log(min_p)``, are dropped. A function of its own, so that its compiled
    graphs do not count against ``plain_tokens``' recompile limit."""
    return _first_argmax(_plain_score(logits, temperature, seeds, positions, token_ids, min_p))


def candidate_tokens(
    cand_logits: torch.Tensor,
    cand_ids: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Next token per row from its ``K`` candidates, sorted by descending logit (``cand_logits[N, K]``, token
    ids ``cand_ids[N, K]``). Keeps the first ``top_k`` (0 = all K) and those with ``p >= min_p * p_max``, then
    top-p over that set renormalised: the smallest prefix whose mass reaches ``top_p`` (the first token always
    stays). Draws by Gumbel-max with the noise of each token id, the same noise ``plain_tokens`` uses."""
    x = cand_logits.float() / temperature.clamp(min=MIN_TEMPERATURE)[:, None]
    k_max = x.shape[-1]
    rank = torch.arange(k_max, device=x.device)[None, :]
    keep = rank < torch.where(top_k > 0, top_k, k_max)[:, None]
    keep = keep & (x >= x[:, :1] + torch.log(min_p)[:, None])  # the first candidate is the row's maximum
    x = x.masked_fill(~keep, float("-inf"))
    probs = x.softmax(-1)
    keep = keep & ((probs.cumsum(-1) - probs) < top_p[:, None])
    score = torch.where(keep, x + hashed_gumbel(row_keys(seeds, positions), cand_ids), float("-inf"))
    return cand_ids.gather(-1, score.argmax(-1, keepdim=True)).squeeze(-1)


def compile_default(device: torch.device) -> bool:
    """Whether ``warmup`` compiles the portable functions: ``COMPILE_ATTN_SAMPLER_COMPILE=1/0`` decides;
    otherwise on CUDA (where eager would launch a kernel per op over ``[N, V]``) and not on the CPU."""
    switch = env.sampler_compile()
    return switch if switch is not None else device.type == "cuda"


_compiled: dict[str, Callable[..., torch.Tensor]] = {}
# The hash reads each intermediate twice (``h ^ (h >> 16)``); Inductor's reuse heuristics would write one of
# them to memory as an [N, V] buffer. Inlining keeps the noise in registers (codegen deduplicates it).
_INDUCTOR_OPTIONS = {"realize_opcount_threshold": 1000, "realize_reads_threshold": 1000}


def _compiled_fn(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    if fn.__name__ not in _compiled:
        # dynamic=False with the row (and candidate) dims marked dynamic: the vocabulary size stays static
        _compiled[fn.__name__] = torch.compile(fn, dynamic=False, fullgraph=True, options=_INDUCTOR_OPTIONS)
    return _compiled[fn.__name__]


_vocab_ids: dict[tuple[int, torch.device], torch.Tensor] = {}


def vocab_ids(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``arange(vocab_size)`` as int32 on ``device``, made once per size and device."""
    key = (vocab_size, torch.device(device))
    if key not in _vocab_ids:
        with torch.inference_mode(False):
            _vocab_ids[key] = torch.arange(vocab_size, device=device, dtype=torch.int32)
    return _vocab_ids[key]


def _mark_rows_dynamic(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None:
            torch._dynamo.mark_dynamic(t, 0)


def run_plain(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    min_p: torch.Tensor | None,
    compiled: bool,
) -> torch.Tensor:
    """``plain_tokens`` (``plain_tokens_wide`` from ``WIDE_ROWS`` rows, ``plain_tokens_min_p`` with ``min_p``),
    compiled (one graph for one row, one for any other count) or eager."""
    rows = (logits, temperature, seeds, positions) + (() if min_p is None else (min_p,))
    fn = plain_tokens_min_p if min_p is not None else (
        plain_tokens_wide if logits.shape[0] >= WIDE_ROWS else plain_tokens)
    args = (*rows[:4], vocab_ids(logits.shape[-1], logits.device), *rows[4:])
    if not compiled:
        return fn(*args)
    _mark_rows_dynamic(*rows)  # the vocabulary (token_ids) stays static
    with torch.inference_mode():  # the caller's grad mode is not a guard of its own
        return _compiled_fn(fn)(*args)


def run_candidates(
    logits: torch.Tensor,
    num_candidates: int,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    compiled: bool,
) -> torch.Tensor:
    """Candidates by ``torch.topk`` (by a full sort when ``num_candidates`` covers the vocabulary), then
    ``candidate_tokens``. Filters given as None are off for every row."""
    rows, vocab = logits.shape
    k = min(max(num_candidates, 2), vocab)  # >= 2: a candidate dim of 1 would be a graph of its own
    if k >= vocab:
        cand_logits, cand_ids = logits.sort(dim=-1, descending=True)
    else:
        cand_logits, cand_ids = logits.topk(k, dim=-1)
    # filters that are off for every row still go in as tensors: one graph for every combination (made in
    # the caller's mode, like the caller's own parameter tensors, as the compiled graph's guards check)
    top_k = top_k if top_k is not None else torch.zeros(rows, device=logits.device, dtype=torch.int64)
    top_p = top_p if top_p is not None else torch.ones(rows, device=logits.device, dtype=torch.float32)
    min_p = min_p if min_p is not None else torch.zeros(rows, device=logits.device, dtype=torch.float32)
    args = (cand_logits, cand_ids, temperature, top_k, top_p, min_p, seeds, positions)
    if not compiled or k >= vocab:  # over the whole sorted vocabulary Inductor's kernel was slower than eager
        return candidate_tokens(*args)
    _mark_rows_dynamic(*args)
    torch._dynamo.mark_dynamic(cand_logits, 1)
    torch._dynamo.mark_dynamic(cand_ids, 1)
    with torch.inference_mode():
        return _compiled_fn(candidate_tokens)(*args)
