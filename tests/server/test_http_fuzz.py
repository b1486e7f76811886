"""The running server on arbitrary request bodies (hypothesis, the bodies of ``test_protocol_fuzz``): every answer is
200 with a well-formed completion (or event stream) or 400 with OpenAI's error body, never a 500, a hang or a
dropped connection; afterwards nothing is pending and the KV cache is as fresh as before."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL, Served
from tests.server.test_protocol_fuzz import bodies

SHORT = 12  # new tokens at most where a body asks for more (the tiny model runs on the CPU)


def _shorten(body: dict) -> dict:
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > SHORT:
            body[key] = SHORT
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    return body


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies(), chat=st.booleans())
def test_any_body_gets_a_completion_or_a_400(served: Served, body: dict, chat: bool) -> None:
    body = _shorten({**body, "model": MODEL if body["model"] == "m" else body["model"]})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.Client(base_url=served.url, timeout=30, trust_env=False) as client:
        r = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error", err
        return
    assert r.status_code == 200, r.text[:300]
    if body.get("stream") is True:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in events[:-1])
    else:
        answer = r.json()
        assert len(answer["choices"]) == body.get("n", 1) or body.get("n") is None
        assert answer["usage"]["completion_tokens"] >= 1


def test_idle_after_the_fuzz(served: Served) -> None:
    served.wait_idle()
