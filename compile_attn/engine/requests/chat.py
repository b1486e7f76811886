"""Chat prompts for ``LLM.chat``: conversations (lists of ``{"role", "content"}`` messages) checked by name and
rendered to prompt text with the tokenizer's chat template (``apply_chat_template(..., add_generation_prompt=True)``).
The template writes the special tokens it wants (BOS included), so its text is encoded without adding any.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from compile_attn.engine.requests.errors import InvalidRequestError, NoChatTemplateError, RequestTypeError

Message = Mapping[str, Any]


def split_conversations(messages: Sequence[Message] | Sequence[Sequence[Message]]) -> list[list[Message]]:
    """One conversation (a list of messages) or a list of conversations -> a list of conversations, each checked:
    non-empty, every message a mapping with a string ``role`` and a ``content``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts (one "
                                  f"conversation) or a list of such lists, got {messages!r:.80}")
    conversations = [messages] if isinstance(messages[0], Mapping) else messages
    out = []
    for i, conv in enumerate(conversations):
        if isinstance(conv, (str, bytes, Mapping)) or not isinstance(conv, Sequence) or not conv:
            raise InvalidRequestError(f"conversation {i} must be a non-empty list of messages, got {conv!r:.80}")
        for j, msg in enumerate(conv):
            if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str) or "content" not in msg:
                raise RequestTypeError(f"conversation {i} message {j} must be a dict with a string 'role' and a "
                                       f"'content', got {msg!r:.80}")
        out.append(list(conv))
    return out


def render_chat(tokenizer: Any, conversation: list[Message], chat_template: str | None = None) -> str:
    """The conversation as prompt text through the tokenizer's chat template (or ``chat_template``), ending with
    the template's generation prompt for the assistant's reply."""
    if tokenizer is None:
        raise NoChatTemplateError("LLM.chat needs a tokenizer with a chat template and this LLM has none; pass "
                                  "LLM(..., tokenizer=...), or call generate() with token ids")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError(f"the tokenizer ({type(tokenizer).__name__}) has no chat template; set "
                                  f"tokenizer.chat_template, pass LLM.chat(..., chat_template=...), or call generate() "
                                  f"with the prompt text")
    return tokenizer.apply_chat_template(conversation, chat_template=chat_template, add_generation_prompt=True,
                                         tokenize=False)
