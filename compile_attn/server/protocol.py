"""OpenAI (and vLLM) request bodies checked field by field: each bad value raises APIError naming its field, which
the app turns into a 400 with OpenAI's error body; good ones become the prompts' token ids and SamplingParams for the
engine. The fields a route knows are its pydantic model's (``compile_attn.server.schemas``, which /docs shows);
others are ignored with a warning in the log, as vLLM ignores them. A known field this server does not implement is
accepted at its neutral value (``best_of`` equal to ``n``, an empty ``logit_bias``, ...) and refused otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from compile_attn.engine.requests.chat import render_chat, split_conversations
from compile_attn.engine.requests.errors import InvalidRequestError, NoChatTemplateError
from compile_attn.engine.requests.sampling_params import SamplingParams
from compile_attn.server import schemas
from compile_attn.server.guided import GUIDED_FIELDS, guided_params

logger = logging.getLogger(__name__)

# OpenAI / vLLM name -> SamplingParams field
SAMPLING_FIELDS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
                   "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
                   "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
                   "skip_special_tokens": "skip_special_tokens",
                   "include_stop_str_in_output": "include_stop_str_in_output"}
# Read by ``parse`` itself (the prompt, the response's shape, the structured-output constraint)
HANDLED = frozenset({"model", "prompt", "messages", "stream", "stream_options", "n", "logprobs", "top_logprobs",
                     "return_token_ids", "echo", "add_special_tokens", "add_generation_prompt",
                     "continue_final_message", "request_id"}) | GUIDED_FIELDS  # structured outputs: server/guided.py
# Accepted whatever their value, with no effect here (``spaces_between_special_tokens``: vLLM's has none with a fast
# tokenizer either; ``parallel_tool_calls``: no tools)
IGNORED = frozenset({"user", "spaces_between_special_tokens", "parallel_tool_calls"})


def _neutral(*values: Any) -> Callable[[Any, dict], bool]:
    """A check that a value is null or one of ``values`` (of the same JSON type: ``0`` is not ``false``)."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def check(value: Any, _body: dict) -> bool:
        return value is None or any(value == n and (type(value) is type(n) or number(value) and number(n))
                                    for n in values)
    return check


def _best_of_neutral(value: Any, body: dict) -> bool:
    n = body.get("n")
    return value is None or (type(value) is int and value == (1 if n is None else n))


# Known fields this server does not implement -> (whether a value is neutral, what the neutral values are)
UNSUPPORTED: dict[str, tuple[Callable[[Any, dict], bool], str]] = {
    "best_of": (_best_of_neutral, "null or n"),
    "logit_bias": (_neutral({}), "null or {}"),
    "suffix": (_neutral(""), "null or ''"),
    "prompt_logprobs": (_neutral(), "null"),
    "use_beam_search": (_neutral(False), "null or false"),
    "length_penalty": (_neutral(1.0), "null or 1.0"),
    "truncate_prompt_tokens": (_neutral(), "null"),
    "allowed_token_ids": (_neutral(), "null"),
    "bad_words": (_neutral([]), "null or []"),
    "logits_processors": (_neutral([]), "null or []"),
    "priority": (_neutral(0), "null or 0"),
    "return_tokens_as_token_ids": (_neutral(False), "null or false"),
    "tools": (_neutral([]), "null or []"),
    "tool_choice": (_neutral("none", "auto"), "null, 'none' or 'auto'"),
    "functions": (_neutral([]), "null or []"),
    "function_call": (_neutral("none", "auto"), "null, 'none' or 'auto'"),
    "chat_template": (_neutral(), "null (the server's template: compile-attn serve --chat-template)"),
    "chat_template_kwargs": (_neutral({}), "null or {}"),
    "documents": (_neutral(), "null"),
}
# ... and those of chat alone (completions' echo is supported)
CHAT_UNSUPPORTED = {**UNSUPPORTED, "echo": (_neutral(False), "null or false")}
COMPLETION_FIELDS = frozenset(schemas.CompletionRequest.model_fields)
CHAT_FIELDS = frozenset(schemas.ChatCompletionRequest.model_fields)
OPENAI_DEFAULTS = {"temperature": 1.0}  # OpenAI's default, not the engine's greedy 0.0
# Bounds on one request's stop strings (the offline SamplingParams has none): every string is matched against the
# decoded text after each token, and all of them travel with the request to the engine.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096


def known_fields(chat: bool) -> frozenset[str]:
    """The fields /v1/chat/completions (``chat``) or /v1/completions knows: its schema model's."""
    return CHAT_FIELDS if chat else COMPLETION_FIELDS


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
    """A checked /v1/completions or /v1/chat/completions request: its prompts' token ids (chat: one), the sampling
    parameters every sample shares, ``n`` samples per prompt (choice ``i * n + k`` is sample ``k`` of prompt ``i``)
    and how the answer is shaped."""

    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool = False  # vLLM's extension: each choice (and chunk) carries its token ids
    echo_texts: list[str] | None = None  # completions' echo: each prompt's text, which its choices' text begins with
    request_id: str | None = None  # vLLM's request_id: the response id's suffix

    @property
    def prompt_ids(self) -> list[int]:
        """The first (for chat, the only) prompt's token ids."""
        return self.prompts[0]

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def parse(body: Any, *, chat: bool, tokenizer: Any, model_name: str, max_context: int) -> Parsed:
    """Check a /v1/completions (``chat=False``) or /v1/chat/completions body and encode its prompts."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    known = known_fields(chat)
    unknown = [key for key in body if key not in known]
    if unknown:
        logger.warning("%s: ignoring field(s) this server does not know: %s", "/v1/chat/completions" if chat else
                       "/v1/completions", ", ".join(repr(k)[:60] for k in unknown[:16]))
    unsupported = CHAT_UNSUPPORTED if chat else UNSUPPORTED
    for key in body:
        check = unsupported.get(key)
        if check is not None and key in known and not check[0](body[key], body):
            raise APIError(f"{key}={body[key]!r:.60} is not supported by this server; leave it out or send "
                           f"{check[1]}", key)
    check_model(body, model_name)
    field = "messages" if chat else "prompt"
    if chat:
        prompts = [_chat_ids(body, tokenizer, add_generation_prompt=_flag(body, "add_generation_prompt", default=True),
                             continue_final_message=_flag(body, "continue_final_message"),
                             add_special_tokens=_flag(body, "add_special_tokens"))]
    else:
        add_special = _flag(body, "add_special_tokens", default=True)
        prompts = [_encode(p, tokenizer, add_special) for p in _prompt_list(body)]
    for i, ids in enumerate(prompts):
        if len(ids) >= max_context:
            which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            raise APIError(f"{which} is {len(ids)} tokens and the context is {max_context}; shorten it", field)
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
    _flag(body, "spaces_between_special_tokens")  # accepted, no effect: a bool all the same
    request_id = body.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or not request_id.isprintable()
                                   or len(request_id) > 128):
        raise APIError(f"request_id must be a printable string of at most 128 characters, got {request_id!r:.40}",
                       "request_id")
    values: dict[str, Any] = dict(OPENAI_DEFAULTS)
    for key, value in body.items():
        if key in SAMPLING_FIELDS and value is not None and key in known:
            values[SAMPLING_FIELDS[key]] = value
    logprobs = _chat_logprobs(body) if chat else body.get("logprobs")
    if logprobs is not None:
        values["logprobs"] = logprobs
    longest = max(map(len, prompts))
    room = max_context - longest
    values.setdefault("max_tokens", 16 if not chat else room)
    try:
        guided = guided_params(body, tokenizer)  # response_format, guided_json, ...: parsed by xgrammar here
    except InvalidRequestError as exc:
        raise APIError(str(exc), getattr(exc, "param", None)) from None
    if guided is not None:
        values["guided_decoding"] = guided
    try:
        params = SamplingParams(**values)
    except (InvalidRequestError, TypeError):
        _refuse_by_field(values, body)
    if params.max_tokens > room:
        which = "the prompt's" if len(prompts) == 1 else "the longest prompt's"
        raise APIError(f"max_tokens={params.max_tokens} plus {which} {longest} tokens exceed the context of "
                       f"{max_context} tokens; ask for at most {room}", _openai_name("max_tokens", body))
    if params.stop and tokenizer is None:
        raise APIError("stop strings need a tokenizer and this model has none", "stop")
    _check_stop_size(values.get("stop"), _openai_name("stop", body))
    echo_texts = None
    if not chat and _flag(body, "echo"):
        echo_texts = _echo_texts(body, prompts, tokenizer, params)
    return Parsed(prompts, params, n, stream, include_usage, _flag(body, "return_token_ids"), echo_texts, request_id)


def _refuse_by_field(values: dict[str, Any], body: dict) -> NoReturn:
    """APIError naming the field at fault among ``values`` (SamplingParams' names), which together SamplingParams
    refused: each field alone first (min_tokens with its max_tokens, which bounds it), so the error names the one at
    fault."""
    for key, value in values.items():
        try:
            SamplingParams(**({key: value} if key != "min_tokens" else {key: value, "max_tokens": 2**62}))
        except (InvalidRequestError, TypeError) as exc:
            raise APIError(str(exc), _openai_name(key, body)) from None
    try:
        SamplingParams(**values)
    except (InvalidRequestError, TypeError) as exc:  # the fields together: min_tokens more than max_tokens
        raise APIError(str(exc), "min_tokens" if "min_tokens" in values else None) from None
    raise AssertionError("SamplingParams refused the values, then took them")


def check_model(body: dict, model_name: str) -> None:
    """400 (code ``model_not_found``) unless ``model`` is left out, null or the served model's name."""
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(f"model {model!r:.80} is not served here; this server serves {model_name!r} (see GET "
                       f"/v1/models; or leave model out)", "model", code="model_not_found")


def _echo_texts(body: dict, prompts: list[list[int]], tokenizer: Any, params: SamplingParams) -> list[str]:
    """Each prompt's text for ``echo``: the string sent, or the decode of the token ids sent."""
    if params.logprobs is not None:
        raise APIError("echo with logprobs would return the prompt's logprobs too, which this server does not "
                       "compute; leave out one of them", "echo")
    if tokenizer is None:
        raise APIError("echo needs a tokenizer to write the prompt's text and this model has none", "echo")
    given = _prompt_list(body)
    return [p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
            for p, ids in zip(given, prompts)]


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


def _flag(body: dict, key: str, name: str | None = None, *, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"{name or key} must be true or false, got {value!r:.40}", name or key)
    return value


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


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


def _prompt_list(body: dict) -> list[str | list[int]]:
    """/v1/completions' ``prompt`` as a list of prompts: a string, a list of token ids, or a non-empty list of
    either."""
    prompt: Any = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return prompt
    raise APIError(f"prompt must be a non-empty string, a non-empty list of token ids (ints >= 0), or a non-empty "
                   f"list of either (several prompts), got {prompt!r:.80}", "prompt")


def _encode(prompt: str | list[int], tokenizer: Any, add_special_tokens: bool) -> list[int]:
    if not isinstance(prompt, str):
        return list(prompt)
    if not prompt:
        raise APIError("prompt has an empty string; send text or token ids", "prompt")
    if tokenizer is None:
        raise APIError("this model has no tokenizer; send the prompt as a list of token ids", "prompt")
    check_unicode(prompt, "prompt")
    ids = list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    if not ids:
        raise APIError(f"prompt {prompt!r:.40} encodes to no tokens; send text or token ids", "prompt")
    return ids


def _chat_ids(body: dict, tokenizer: Any, *, add_generation_prompt: bool = True,
              continue_final_message: bool = False, add_special_tokens: bool = False) -> list[int]:
    """The token ids of ``body``'s ``messages`` (one conversation) rendered with the chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise APIError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} objects, got "
                       f"{messages!r:.80}", "messages")
    messages = list(messages)
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
    if continue_final_message and add_generation_prompt:
        raise APIError("continue_final_message needs add_generation_prompt false (the reply continues the last "
                       "message instead of starting a new one)", "continue_final_message")
    try:
        (conv,) = split_conversations(messages)
        if add_generation_prompt:
            text = render_chat(tokenizer, conv)
        else:
            if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                render_chat(tokenizer, conv)  # raises NoChatTemplateError, naming the way out
            text = tokenizer.apply_chat_template(conv, add_generation_prompt=False, tokenize=False,
                                                 continue_final_message=continue_final_message)
    except NoChatTemplateError:  # the server's own flags are the way out, not LLM.chat's keyword
        way_out = ("the served model's tokenizer has no chat template; start the server with --chat-template FILE "
                   "(a Jinja chat template, or the template text)" if tokenizer is not None else
                   "the served model has no tokenizer; start the server with --tokenizer DIR --chat-template FILE")
        raise APIError(way_out + ", or send the prompt text to /v1/completions", "messages") from None
    except (InvalidRequestError, ValueError) as exc:
        raise APIError(str(exc), "messages") from None
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def parse_tokenize(body: Any, *, tokenizer: Any, model_name: str) -> tuple[list[int], bool]:
    """A /tokenize body (vLLM's: ``prompt`` or ``messages``, ``add_special_tokens``, ``return_token_strs``): the
    token ids, and whether their strings are asked for."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    check_model(body, model_name)
    if tokenizer is None:
        raise APIError("this model has no tokenizer", status=400)
    strs = _flag(body, "return_token_strs")
    if "messages" in body:
        ids = _chat_ids(body, tokenizer, add_generation_prompt=_flag(body, "add_generation_prompt", default=True),
                        continue_final_message=_flag(body, "continue_final_message"),
                        add_special_tokens=_flag(body, "add_special_tokens"))
        return ids, strs
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise APIError(f"/tokenize takes a prompt (a string) or messages, got prompt={prompt!r:.60}", "prompt")
    check_unicode(prompt, "prompt")
    return list(tokenizer(prompt, add_special_tokens=_flag(body, "add_special_tokens", default=True))["input_ids"]), strs


def parse_detokenize(body: Any, *, model_name: str, vocab_size: int | None = None) -> list[int]:
    """A /detokenize body (vLLM's: ``tokens``): the token ids to decode."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    check_model(body, model_name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise APIError(f"tokens must be a list of token ids (ints >= 0), got {tokens!r:.60}", "tokens")
    if vocab_size is not None and any(t >= vocab_size for t in tokens):
        raise APIError(f"tokens has an id outside the vocabulary [0, {vocab_size})", "tokens")
    return tokens
