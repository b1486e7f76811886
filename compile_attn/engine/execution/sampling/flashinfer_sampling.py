"""FlashInfer's sorting-free top-k / top-p sampling (rejection sampling over the probabilities), used for
batches whose filtered rows need no reproducibility; imported only if FlashInfer is installed.

FlashInfer draws from one Philox stream per call, offset by the generator's state, so a row's tokens
depend on its batch: rows with an explicit seed never come here. Without a generator FlashInfer (0.5)
starts a fresh one per call and would draw the same numbers every step, so this module always passes
the device's default CUDA generator (``torch.manual_seed`` seeds it).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from compile_attn.engine.execution.sampling.portable import MIN_TEMPERATURE

logger = logging.getLogger(__name__)

try:
    import flashinfer.sampling as _fi_sampling
except Exception as exc:  # noqa: BLE001 -- missing, or installed without a usable CUDA runtime
    _fi_sampling: ModuleType | None = None  # type: ignore[no-redef]
    logger.debug("FlashInfer sampling unavailable (%s); the portable sampler serves every batch", exc)


def available(device: torch.device) -> bool:
    """Whether FlashInfer's sampling kernels can run on ``device``."""
    return _fi_sampling is not None and device.type == "cuda"


def _generator(device: torch.device) -> torch.Generator:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


def filtered_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """int64 next token per row of ``logits[N, V]`` with top-k and/or top-p (None: off for every row; top_k
    0 / top_p 1 off for one row). Top-k applies first, top-p to the renormalised top-k set, as in
    ``portable.candidate_tokens``. Rows with temperature 0 get a sample too: the caller replaces it."""
    if _fi_sampling is None:
        raise RuntimeError("FlashInfer is not installed; use the portable sampler (backend='portable')")
    if top_k is None and top_p is None:
        raise ValueError("filtered_tokens needs top_k or top_p; rows without filters use the portable kernel")
    vocab = logits.shape[-1]
    gen = _generator(logits.device)
    probs = _fi_sampling.softmax(logits, temperature=temperature.clamp(min=MIN_TEMPERATURE))
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).to(torch.int32)  # FlashInfer: k >= vocab is off; 0 is not
        if top_p is not None:
            out = _fi_sampling.top_k_top_p_sampling_from_probs(
                probs, k, top_p.float(), filter_apply_order="top_k_first", generator=gen)
        else:
            out = _fi_sampling.top_k_sampling_from_probs(probs, k, generator=gen)
    else:
        out = _fi_sampling.top_p_sampling_from_probs(probs, top_p.float(), generator=gen)  # type: ignore[union-attr]
    return out.long()
