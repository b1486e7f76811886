"""The serving engine: LLM (generate), SamplingParams, the continuous-batching scheduler and the sampler."""

from compile_attn.engine.llm import LLM
from compile_attn.engine.request import RequestOutput
from compile_attn.engine.sampling_params import SamplingParams
from compile_attn.engine.scheduler import RequestTooLargeError

__all__ = ["LLM", "RequestOutput", "RequestTooLargeError", "SamplingParams"]
