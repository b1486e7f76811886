"""Sampling, in one place: the step's sampling half (``step``: forward the sampling rows, pick their tokens), the
sampler (``sampler.sample``, the entry point) and its parts: counter-hash noise (``noise``), plain-torch kernels
that Inductor fuses (``portable``), FlashInfer's rejection sampling where installed (``flashinfer_sampling``),
logprobs, penalties, and the host-side ``SamplingPlan`` that picks among them. The request's parameters are
``engine/requests/sampling_params.py``."""

from compile_attn.engine.execution.sampling.plan import SamplingPlan

__all__ = ["SamplingPlan"]
