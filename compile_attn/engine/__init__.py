"""The serving engine: LLM (generate), SamplingParams, the continuous-batching scheduler and the sampler."""

from compile_attn.engine.errors import (
    EngineBusyError,
    EngineOptionError,
    InvalidRequestError,
    RequestTooLargeError,
    RequestTypeError,
)
from compile_attn.engine.llm import LLM
from compile_attn.engine.request import RequestOutput
from compile_attn.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "EngineBusyError",
    "EngineOptionError",
    "InvalidRequestError",
    "RequestOutput",
    "RequestTooLargeError",
    "RequestTypeError",
    "SamplingParams",
]
