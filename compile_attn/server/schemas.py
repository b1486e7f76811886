"""The server's request bodies as pydantic models: what ``/openapi.json`` publishes and ``/docs`` shows, field by
field with its type, default and meaning. They describe; they do not parse: a body is checked by
``compile_attn.server.protocol`` (a 400 naming the field at fault, OpenAI's error body), which no pydantic validation
sits in front of, so a streamed token costs what it did. The models' field names are the fields each route knows:
any other field of a body is ignored with a warning in the server's log, as vLLM does (``protocol.known_fields``).
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

_UNSUPPORTED = "Not supported by this server: only the neutral value ({}) is accepted, any other gets a 400 naming it."
_STRUCTURED = ("Structured output (xgrammar; docs/structured_outputs.md): {} At most one constraint per request; a "
               "malformed one, or a schema / regex / grammar xgrammar cannot parse, gets a 400 naming this field.")


def _unsupported(neutral: str, default: Any = None, **kw: Any) -> Any:
    return Field(default, description=_UNSUPPORTED.format(neutral), **kw)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = Field(False, description="end the stream with a chunk carrying the usage (no "
                                                          "choices); every other chunk has usage null")


class _Sampling(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="the served model's name (GET /v1/models); left out or null: the "
                                                "served model")
    max_tokens: int | None = Field(None, ge=1, description="output tokens at most (completions default 16; chat "
                                                          "default: what the context leaves)")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    temperature: float | None = Field(1.0, ge=0, description="0 = greedy (OpenAI's default 1.0)")
    top_p: float | None = Field(1.0, gt=0, le=1, description="nucleus sampling; 1 = off")
    top_k: int | None = Field(0, ge=-1, description="vLLM's: the k likeliest tokens only; 0 or -1 = off")
    min_p: float | None = Field(0.0, ge=0, le=1, description="vLLM's: drop tokens below min_p times the likeliest "
                                                            "token's probability; 0 = off")
    seed: int | None = Field(None, description="reproducible sampling whatever the batch (sample k of n gets a seed "
                                               "derived from it)")
    n: int | None = Field(1, ge=1, le=16, description="samples per prompt")
    stop: str | list[str] | None = Field(None, description="stop strings (at most 64, 4096 characters in all): the "
                                                          "text is cut where the first one starts")
    stop_token_ids: list[int] | None = Field(None, description="vLLM's: token ids that end a sample (the token "
                                                               "stays in token_ids, its text is left out)")
    ignore_eos: bool | None = Field(False, description="vLLM's: go on past the model's EOS token")
    min_tokens: int | None = Field(0, ge=0, description="vLLM's: no EOS, stop token or stop string ends a sample "
                                                        "before this many output tokens (EOS and the stop tokens are "
                                                        "masked out of the logits until then)")
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(1.0, gt=0, description="vLLM's; 1 = off")
    skip_special_tokens: bool | None = Field(True, description="vLLM's: leave special tokens out of the text")
    spaces_between_special_tokens: bool | None = Field(
        True, description="vLLM's: accepted; like vLLM with a fast tokenizer (the only kind served here), it has no "
                          "effect")
    include_stop_str_in_output: bool | None = Field(False, description="vLLM's: keep the matched stop string (or "
                                                                       "the stop token's text) at the end of the text")
    stream: bool | None = Field(False, description="server-sent events in OpenAI's chunk format, ending with "
                                                   "data: [DONE]")
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = Field(False, description="vLLM's: each choice (and chunk) carries its output "
                                                             "token_ids")
    user: str | None = Field(None, description="accepted and ignored")
    request_id: str | None = Field(None, description="vLLM's: the response id's suffix and the log line's id "
                                                     "(default: random)")
    logit_bias: dict[str, float] | None = _unsupported("null or {}")
    best_of: int | None = _unsupported("null or n")
    prompt_logprobs: int | None = _unsupported("null")
    use_beam_search: bool | None = _unsupported("false")
    length_penalty: float | None = _unsupported("1.0")
    truncate_prompt_tokens: int | None = _unsupported("null")
    allowed_token_ids: list[int] | None = _unsupported("null")
    bad_words: list[str] | None = _unsupported("null or []")
    logits_processors: list[Any] | None = _unsupported("null or []")
    priority: int | None = _unsupported("0")
    return_tokens_as_token_ids: bool | None = _unsupported("false")
    response_format: dict[str, Any] | None = Field(None, description=_STRUCTURED.format(
        "OpenAI's {'type': 'text'} (no constraint), {'type': 'json_object'} (any JSON object) or {'type': "
        "'json_schema', 'json_schema': {'name': ..., 'schema': {...}}} (JSON valid against the schema)."))
    guided_json: Any = Field(None, description=_STRUCTURED.format("vLLM's: a JSON schema (an object or its JSON "
                                                                  "text); the output is JSON valid against it."))
    guided_regex: str | None = Field(None, description=_STRUCTURED.format("vLLM's: the output matches this regular "
                                                                          "expression."))
    guided_choice: list[str] | None = Field(None, description=_STRUCTURED.format("vLLM's: the output is exactly one "
                                                                                 "of these strings."))
    guided_grammar: str | None = Field(None, description=_STRUCTURED.format(
        "vLLM's: the output is a sentence of this EBNF grammar (xgrammar's GBNF, rule root; Lark accepted)."))
    guided_decoding_backend: str | None = Field(None, description=_STRUCTURED.format(
        "vLLM's backend name: null, 'auto' or 'xgrammar', with its options ('xgrammar:disable-any-whitespace')."))
    guided_whitespace_pattern: str | None = Field(None, description=_STRUCTURED.format(
        "vLLM's: not supported, a value other than null gets a 400."))
    structured_outputs: dict[str, Any] | None = Field(None, description=_STRUCTURED.format(
        "newer vLLM's object: one of 'json', 'regex', 'choice', 'grammar', 'json_object' (GuidedDecodingParams' "
        "fields)."))


class CompletionRequest(_Sampling):
    """POST /v1/completions. Fields not listed here are ignored (with a warning in the server's log), as vLLM
    ignores them."""

    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="a string, a list of token ids, or a list of either (several prompts: choice i * n + k is "
                         "sample k of prompt i)")
    echo: bool | None = Field(False, description="each choice's text begins with its prompt (the prompt string, or "
                                                 "the decode of its token ids); not with logprobs")
    logprobs: int | None = Field(None, ge=0, le=20, description="per output token its logprob and the logprobs "
                                                               "likeliest tokens'")
    add_special_tokens: bool | None = Field(True, description="vLLM's: a string prompt is encoded with the "
                                                              "tokenizer's special tokens (BOS)")
    suffix: str | None = _unsupported("null or ''")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = Field(None, description="text, or OpenAI's content parts of type "
                                                                         "'text'")


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. Fields not listed here are ignored (with a warning in the server's log), as vLLM
    ignores them."""

    messages: list[ChatMessage] = Field(..., min_length=1, description="one conversation, rendered with the chat "
                                                                       "template")
    logprobs: bool | None = Field(False, description="per output token its logprob")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: the likeliest tokens' too")
    add_generation_prompt: bool | None = Field(True, description="vLLM's: end the rendered prompt with the "
                                                                 "template's generation prompt")
    continue_final_message: bool | None = Field(False, description="vLLM's: leave the last message open for the "
                                                                   "reply to continue (needs add_generation_prompt "
                                                                   "false)")
    add_special_tokens: bool | None = Field(False, description="vLLM's: also add the tokenizer's special tokens "
                                                               "to the rendered prompt (the template writes its own)")
    parallel_tool_calls: bool | None = Field(None, description="accepted and ignored (no tools)")
    echo: bool | None = _unsupported("false")
    tools: list[dict[str, Any]] | None = _unsupported("null or []")
    tool_choice: str | dict[str, Any] | None = _unsupported("null, 'none' or 'auto'")
    functions: list[dict[str, Any]] | None = _unsupported("null or []")
    function_call: str | dict[str, Any] | None = _unsupported("null, 'none' or 'auto'")
    chat_template: str | None = _unsupported("null: the server's template, see --chat-template")
    chat_template_kwargs: dict[str, Any] | None = _unsupported("null or {}")
    documents: list[dict[str, Any]] | None = _unsupported("null")


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = Field(True, description="encode with the tokenizer's special tokens (BOS)")
    return_token_strs: bool | None = Field(False, description="also return each token's string")


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with messages, rendered with the chat template as /v1/chat/completions renders them."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int] = Field(..., description="token ids, decoded as the tokenizer's decode does (special tokens "
                                               "kept)")


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body, on every error status."""

    error: ErrorBody


REQUEST_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest,
                                               TokenizeChatRequest, DetokenizeRequest)
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (TokenizeResponse, DetokenizeResponse, VersionResponse, ErrorResponse)


def component_schemas() -> dict[str, Any]:
    """Every model's JSON schema, keyed by its name, with references into ``#/components/schemas``: what the
    OpenAPI document's ``components.schemas`` gets."""
    _, top = models_json_schema([(m, "validation") for m in REQUEST_MODELS + RESPONSE_MODELS],
                                ref_template="#/components/schemas/{model}")
    return top.get("$defs", {})


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI ``requestBody`` (for a route's ``openapi_extra``) whose JSON schema is ``models`` (several: any of
    them)."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def response(model: type[BaseModel], description: str = "OK") -> dict[str, Any]:
    """An OpenAPI ``responses`` entry for status 200 whose JSON schema is ``model``."""
    return {"200": {"description": description, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}

