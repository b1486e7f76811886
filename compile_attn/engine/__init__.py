"""The serving engine: LLM (generate) and its EngineConfig, SamplingParams, the continuous-batching scheduler and the
sampler."""

from compile_attn.engine.async_engine import AsyncLLM, EngineOverloadedError, EngineStoppedError
from compile_attn.engine.config import EngineConfig
from compile_attn.engine.errors import (
    EngineBusyError,
    EngineOptionError,
    InvalidRequestError,
    NoChatTemplateError,
    RequestTooLargeError,
    RequestTypeError,
    UnknownEngineOptionError,
)
from compile_attn.engine.llm import LLM
from compile_attn.engine.request import CompletionOutput, RequestOutput
from compile_attn.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineConfig",
    "EngineOverloadedError",
    "EngineStoppedError",
    "CompletionOutput",
    "EngineBusyError",
    "EngineOptionError",
    "InvalidRequestError",
    "NoChatTemplateError",
    "RequestOutput",
    "RequestTooLargeError",
    "RequestTypeError",
    "SamplingParams",
    "UnknownEngineOptionError",
]
