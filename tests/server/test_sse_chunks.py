"""ChunkFormat's streamed chunks are byte for byte ``json.dumps`` of the chunk object built from ``app._choice`` (the
whole-object path), for any text (non-ASCII, escapes, lone surrogates), finish reason, logprobs and token ids, in
completions and chat form, with and without usage and stop reasons."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from compile_attn.server.app import _choice
from compile_attn.server.sse import ChunkFormat

logprobs = st.none() | st.fixed_dictionaries({"tokens": st.lists(st.text(max_size=4), max_size=3),
                                              "token_logprobs": st.lists(st.floats(-50, 0), max_size=3)})


def reference(rid, created, model, chat, include_usage, choices, usage=None) -> str:
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": choices}
    if include_usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


@settings(max_examples=300, deadline=None)
@given(rid=st.text(max_size=12), created=st.integers(0, 2**40), model=st.text(max_size=10), chat=st.booleans(),
       include_usage=st.booleans(), index=st.integers(0, 15), text=st.text(max_size=12),
       finish=st.sampled_from([None, "stop", "length", "abort"]), lp=logprobs,
       stop=st.none() | st.integers(0, 2**31) | st.text(max_size=6),
       ids=st.none() | st.lists(st.integers(0, 2**31), max_size=4))
def test_delta_chunk_is_json_dumps_of_the_chunk(rid, created, model, chat, include_usage, index, text, finish, lp,
                                                 ids, stop) -> None:
    fmt = ChunkFormat(rid, created, model, chat=chat, include_usage=include_usage)
    choice = _choice(chat, index, text, finish, delta=True, logprobs=lp, token_ids=ids, stop_reason=stop)
    assert fmt.delta(index, text, finish, lp, ids, stop) == reference(rid, created, model, chat, include_usage,
                                                                      [choice])


def test_other_chunks_and_a_client_reads_them() -> None:
    fmt = ChunkFormat("cmpl-1", 7, "m", chat=True, include_usage=True)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert fmt.chunk([], usage) == reference("cmpl-1", 7, "m", True, True, [], usage)
    parsed = json.loads(fmt.delta(1, "h\u00e9\n\"", None)[len("data: "):])
    assert parsed["choices"] == [{"index": 1, "delta": {"role": "assistant", "content": "h\u00e9\n\""},
                                  "logprobs": None, "finish_reason": None, "stop_reason": None}]
    assert parsed["usage"] is None
