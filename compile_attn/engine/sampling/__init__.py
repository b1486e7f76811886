"""The sampler's parts: counter-hash noise (``noise``), plain-torch kernels that Inductor fuses
(``portable``), FlashInfer's rejection sampling where installed (``flashinfer_sampling``), and the host-side
``SamplingPlan`` that picks among them. ``compile_attn.engine.sampler.sample`` is the entry point."""

from compile_attn.engine.sampling.plan import SamplingPlan

__all__ = ["SamplingPlan"]
