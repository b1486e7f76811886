"""Errors the engine raises about a request or about how it is called.

A request is checked whole when it is admitted (prompt types and token ids, every SamplingParams field), so a bad
request is refused before anything is queued and never fails inside a step. Each class also derives from the
built-in a caller would catch (ValueError for bad values, TypeError for bad types, RuntimeError for bad state).
"""

from __future__ import annotations

from compile_attn.errors import CompileAttnError


class InvalidRequestError(CompileAttnError, ValueError):
    """A prompt or sampling parameter with a bad value: a token id outside the vocabulary, an empty prompt, a
    parameter out of its range, an unknown parameter name."""


class RequestTypeError(InvalidRequestError, TypeError):
    """A prompt or sampling parameter of the wrong type (a float where an int is needed, a 2-D tensor, a string
    prompt without a tokenizer); also an InvalidRequestError, so one ``except`` catches every refused request."""


class RequestTooLargeError(InvalidRequestError):
    """A request whose prompt plus max_new_tokens can never fit the KV cache or its max_context."""


class MessageTooLargeError(InvalidRequestError):
    """A request whose message to the engine's process (its prompt and parameters, pickled) is larger than the
    transport's bound (``EngineClient.max_message_bytes``); an HTTP server answers 413."""


class EngineBusyError(CompileAttnError, RuntimeError):
    """An LLM was called from a second thread while another call on it was running; an LLM runs one call at a
    time (use one LLM per thread, or serialise the calls)."""


class EngineOptionError(CompileAttnError, ValueError):
    """An ``LLM(...)`` option with a bad type or value (a non-positive size, a CUDA device without CUDA); raised
    before the model loads."""


class UnknownEngineOptionError(EngineOptionError, TypeError):
    """``LLM(...)`` was given a keyword that names no EngineConfig field."""


class NoChatTemplateError(CompileAttnError, ValueError):
    """``LLM.chat`` was called on an LLM whose tokenizer has no chat template (or that has no tokenizer)."""
