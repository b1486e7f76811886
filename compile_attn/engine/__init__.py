"""The serving engine, in three layers: ``requests/`` (the request lifecycle: requests, sampling parameters,
admission, the scheduler, EngineConfig), ``execution/`` (one step on the device: step runner, sampling, memory and KV
sizing, model loading) and ``serving/`` (AsyncLLM and its pipes); ``llm.py`` (LLM) ties them. This package re-exports
the public names."""

from compile_attn.engine.serving.async_engine import AsyncLLM

from compile_attn.engine.serving.streams import EngineOverloadedError, EngineStoppedError
from compile_attn.engine.requests.config import EngineConfig
from compile_attn.engine.requests.errors import (
    EngineBusyError,
    EngineOptionError,
    InvalidRequestError,
    NoChatTemplateError,
    RequestTooLargeError,
    RequestTypeError,
    UnknownEngineOptionError,
)
from compile_attn.engine.llm import LLM
from compile_attn.engine.requests.request import CompletionOutput, RequestOutput
from compile_attn.engine.requests.sampling_params import GuidedDecodingParams, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineConfig",
    "EngineOverloadedError",
    "EngineStoppedError",
    "CompletionOutput",
    "EngineBusyError",
    "EngineOptionError",
    "GuidedDecodingParams",
    "InvalidRequestError",
    "NoChatTemplateError",
    "RequestOutput",
    "RequestTooLargeError",
    "RequestTypeError",
    "SamplingParams",
    "UnknownEngineOptionError",
]
