"""The serving engine: LLM (generate), SamplingParams, the continuous-batching scheduler and the sampler."""

from compile_attn.engine.errors import (
    EngineBusyError,
    EngineOptionError,
    InvalidRequestError,
    NoChatTemplateError,
    RequestTooLargeError,
    RequestTypeError,
)
from compile_attn.engine.llm import LLM
from compile_attn.engine.request import CompletionOutput, RequestOutput
from compile_attn.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineBusyError",
    "EngineOptionError",
    "InvalidRequestError",
    "NoChatTemplateError",
    "RequestOutput",
    "RequestTooLargeError",
    "RequestTypeError",
    "SamplingParams",
]
