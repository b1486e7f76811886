"""OpenAI request bodies checked field by field: each bad value raises APIError naming its field, which the app
turns into a 400 with OpenAI's error body; good ones become the prompt token ids and SamplingParams for the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compile_attn.engine.requests.chat import render_chat, split_conversations
from compile_attn.engine.requests.errors import InvalidRequestError, NoChatTemplateError
from compile_attn.engine.requests.sampling_params import SamplingParams
from compile_attn.server.guided import GUIDED_FIELDS, guided_params

# OpenAI name -> SamplingParams field
SAMPLING_FIELDS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
                   "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
                   "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "repetition_penalty": "repetition_penalty"}
IGNORED = {"model", "prompt", "messages", "stream", "stream_options", "n", "user", "logprobs", "top_logprobs",
           "return_token_ids"} | GUIDED_FIELDS  # read by parse (structured outputs: compile_attn.server.guided)
UNSUPPORTED = {"echo", "best_of", "logit_bias", "suffix", "tools", "tool_choice", "functions",
               "function_call", "parallel_tool_calls"}
OPENAI_DEFAULTS = {"temperature": 1.0}  # OpenAI's default, not the engine's greedy 0.0
# Bounds on one request's stop strings (the offline SamplingParams has none): every string is matched against the
# decoded text after each token, and all of them travel with the request to the engine.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096


class APIError(Exception):
    """A request the server refuses: ``status`` (400, 404, 503), OpenAI's error ``type``, the ``param`` at fault."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Parsed:
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool = False  # vLLM's extension: each choice (and chunk) carries its token ids


def parse(body: Any, *, chat: bool, tokenizer: Any, model_name: str, max_context: int) -> Parsed:
    """Check a /v1/completions (``chat=False``) or /v1/chat/completions body and encode its prompt."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    for key in body:
        if key in UNSUPPORTED and body[key] not in (None, False, 0):
            raise APIError(f"{key} is not supported by this server yet; leave it out", key)
    if body.get("model") != model_name:
        raise APIError(f"model {body.get('model')!r} is not served here; this server serves {model_name!r} "
                       f"(see GET /v1/models)", "model", code="model_not_found")
    ids = _chat_ids(body, tokenizer) if chat else _prompt_ids(body, tokenizer)
    field = "messages" if chat else "prompt"
    if len(ids) >= max_context:
        raise APIError(f"the prompt is {len(ids)} tokens and the context is {max_context}; shorten it", field)
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 16:
        raise APIError(f"n must be an int in [1, 16], got {n!r}", "n")
    stream = _flag(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(f"stream_options must be an object, got {opts!r}", "stream_options")
    include_usage = _flag(opts, "include_usage", "stream_options.include_usage")
    values: dict[str, Any] = dict(OPENAI_DEFAULTS)
    for key, value in body.items():
        if key in SAMPLING_FIELDS and value is not None:
            values[SAMPLING_FIELDS[key]] = value
        elif key not in IGNORED and key not in SAMPLING_FIELDS and key not in UNSUPPORTED:
            raise APIError(f"unknown parameter {key!r}", key)
    logprobs = _chat_logprobs(body) if chat else body.get("logprobs")
    if logprobs is not None:
        values["logprobs"] = logprobs
    room = max_context - len(ids)
    values.setdefault("max_tokens", 16 if not chat else room)
    for key, value in values.items():  # each field alone first, so the error names the one at fault
        try:
            SamplingParams(**{key: value})
        except (InvalidRequestError, TypeError) as exc:
            raise APIError(str(exc), _openai_name(key, body)) from None
    if values["max_tokens"] > room:
        raise APIError(f"max_tokens={values['max_tokens']} plus the prompt's {len(ids)} tokens exceed the context of "
                       f"{max_context} tokens; ask for at most {room}", _openai_name("max_tokens", body))
    if values.get("stop") and tokenizer is None:
        raise APIError("stop strings need a tokenizer and this model has none", "stop")
    _check_stop_size(values.get("stop"), _openai_name("stop", body))
    try:
        guided = guided_params(body, tokenizer)  # response_format, guided_json, ...: parsed by xgrammar here
    except InvalidRequestError as exc:
        raise APIError(str(exc), getattr(exc, "param", None)) from None
    return Parsed(ids, SamplingParams(**values, guided_decoding=guided), n, stream, include_usage,
                  _flag(body, "return_token_ids"))


def _check_stop_size(stop: Any, field: str) -> None:
    strings = [stop] if isinstance(stop, str) else list(stop or ())
    if len(strings) > MAX_STOP_STRINGS:
        raise APIError(f"stop has {len(strings)} strings; this server takes at most {MAX_STOP_STRINGS}", field)
    total = sum(len(s) for s in strings)
    if total > MAX_STOP_CHARS:
        raise APIError(f"stop's strings are {total} characters in all; this server takes at most {MAX_STOP_CHARS}",
                       field)
    for s in strings:
        check_unicode(s, field)


def check_unicode(text: str, field: str, param: str | None = None) -> None:
    """APIError (400 naming ``field``, with ``param`` or else ``field`` as its param) if ``text`` has a lone
    surrogate (JSON's ``"\\ud800"`` without its pair), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(f"{field} has an invalid Unicode character {text[exc.start]!r} at index {exc.start} (a lone "
                       f"UTF-16 surrogate); send the character itself or its full surrogate pair",
                       param or field) from None


def _flag(body: dict, key: str, name: str | None = None) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise APIError(f"{name or key} must be true or false, got {value!r:.40}", name or key)
    return bool(value)


def _openai_name(field: str, body: dict) -> str:
    if field == "logprobs" and "top_logprobs" in body:
        return "top_logprobs"
    return next((k for k, v in SAMPLING_FIELDS.items() if v == field and k in body), field)


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (a bool) and ``top_logprobs`` (an int) as SamplingParams.logprobs."""
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise APIError(f"logprobs must be true or false for chat completions, got {on!r:.40}", "logprobs")
    if top is not None and not on:
        raise APIError("top_logprobs needs logprobs=true", "top_logprobs")
    return (0 if top is None else top) if on else None


def _prompt_ids(body: dict, tokenizer: Any) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list: the openai client's shape for a single prompt
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise APIError("this model has no tokenizer; send the prompt as a list of token ids", "prompt")
        check_unicode(prompt, "prompt")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return list(prompt)
    raise APIError(f"prompt must be a non-empty string or list of token ids (one prompt), got {prompt!r:.80}",
                   "prompt")


def _chat_ids(body: dict, tokenizer: Any) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise APIError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} objects, got "
                       f"{messages!r:.80}", "messages")
    for j, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only here
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(f"messages[{j}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                               f"supported, got {content!r:.80}", "messages")
            messages[j] = {**m, "content": "".join(p["text"] for p in content)}
        elif content is not None and not isinstance(content, str):
            raise APIError(f"messages[{j}].content must be a string or a list of text parts, got {content!r:.40}",
                           "messages")
        for key, value in messages[j].items():
            if isinstance(value, str):
                check_unicode(value, f"messages[{j}].{key}", "messages")
    try:
        (conv,) = split_conversations(messages)
        text = render_chat(tokenizer, conv)
    except NoChatTemplateError:  # the server's own flags are the way out, not LLM.chat's keyword
        way_out = ("the served model's tokenizer has no chat template; start the server with --chat-template FILE "
                   "(a Jinja chat template, or the template text)" if tokenizer is not None else
                   "the served model has no tokenizer; start the server with --tokenizer DIR --chat-template FILE")
        raise APIError(way_out + ", or send the prompt text to /v1/completions", "messages") from None
    except (InvalidRequestError, ValueError) as exc:
        raise APIError(str(exc), "messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
