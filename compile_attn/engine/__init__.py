"""The serving engine, in three layers: ``requests/`` (the request lifecycle: requests, sampling parameters,
admission, the scheduler, EngineConfig), ``execution/`` (one step on the device: step runner, sampling, memory and KV
sizing, model loading) and ``serving/`` (AsyncLLM and its pipes); ``llm.py`` (LLM) ties them (``intake.py``: how it
queues one call's requests). This package re-exports the public names."""

import importlib as _importlib

# Names load on first use (PEP 562), so that ``from compile_attn import SamplingParams`` (or EngineConfig) does not
# import the engine's step machinery, the graph runner and the compiler. name -> the module that defines it.
_LAZY = {
    "AsyncLLM": "compile_attn.engine.serving.async_engine",
    **dict.fromkeys(("EngineOverloadedError", "EngineStoppedError"), "compile_attn.engine.serving.streams"),
    "EngineConfig": "compile_attn.engine.requests.config",
    **dict.fromkeys(("EngineBusyError", "EngineOptionError", "InvalidRequestError", "NoChatTemplateError",
                     "RequestTooLargeError", "RequestTypeError", "UnknownEngineOptionError"),
                    "compile_attn.engine.requests.errors"),
    "LLM": "compile_attn.engine.llm",
    **dict.fromkeys(("CompletionOutput", "RequestOutput"), "compile_attn.engine.requests.request"),
    **dict.fromkeys(("GuidedDecodingParams", "SamplingParams"), "compile_attn.engine.requests.sampling_params"),
}


def __getattr__(name: str):  # noqa: ANN202
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'compile_attn.engine' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
