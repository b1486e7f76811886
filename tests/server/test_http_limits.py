"""The server's HTTP guards against a careless or hostile client, on a real server with its front end in a process
and in a thread: the body size limit (413, by Content-Length and while reading a chunked body, with /health
answering meanwhile), JSON nesting depth, lone surrogates, stop-string bounds, JSON-only POSTs (415), CORS only for
the allowed origins, the API key (401), and OpenAI's error body on every error status. After each, nothing is
pending, the KV pool is fresh and a greedy answer still equals the reference LLM's. Also the body reader and the
depth check alone."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from compile_attn.engine import SamplingParams
from compile_attn.engine.serving.async_engine import AsyncLLM
from compile_attn.server import request_body
from compile_attn.server.frontend import FRONTENDS, serving
from compile_attn.server.options import DEFAULT_MAX_REQUEST_BYTES, ServerOptions, parse_origins
from compile_attn.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS, APIError
from tests.server.conftest import MODEL, Served, _llm

LIMIT = 128 * 1024  # above request_body.OFF_LOOP_BYTES, so a body near it is parsed off the loop
KEY = "test-key-123"
ALLOWED = "https://allowed.example"
FOREIGN = "https://evil.example"
PROMPT = "The function returns"


@pytest.fixture(scope="module", params=FRONTENDS)
def guarded(request: pytest.FixtureRequest, trained_tiny_llama: Callable[[int], Path]) -> Iterator[Served]:
    """A server with every guard on: a small body limit, one allowed origin, an API key."""
    path = str(trained_tiny_llama(60))
    llm, reference = _llm(path), _llm(path)
    engine = AsyncLLM(llm, max_pending=64)
    options = ServerOptions(max_request_bytes=LIMIT, allowed_origins=(ALLOWED,), api_key=KEY)
    try:
        with serving(engine, MODEL, request.param, options) as front:
            yield Served(front.url, engine, llm, reference, llm.kv_cache.available_tokens)
    finally:
        engine.shutdown()


def _send(served: Served, method: str, path: str, content: bytes | Iterator[bytes] | None = None,
          headers: dict[str, str] | None = None) -> httpx.Response:
    with httpx.Client(base_url=served.url, timeout=30, trust_env=False) as client:
        return client.request(method, path, content=content, headers=headers)


def _assert_error(r: httpx.Response, status: int, param: str | None = None, type: str = "invalid_request_error",
                  code: str | None = None) -> dict:
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert (err["type"], err["param"], err["code"]) == (type, param, code), err
    return err


def _assert_still_serves(served: Served, headers: dict[str, str] | None = None) -> None:
    """Idle with a fresh KV pool, and a greedy completion equals the reference LLM's."""
    served.wait_idle()
    ref = served.reference.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = _send(served, "POST", "/v1/completions", json.dumps(body).encode(),
              {"Content-Type": "application/json", **(headers or {})})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["text"] == ref.text
    served.wait_idle()


def _http_rss_mb(served: Served) -> float:
    """The resident memory of the process serving HTTP, from its own /metrics."""
    text = _send(served, "GET", "/metrics").text
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith("process_resident_memory_bytes"))) / 2**20


JSON = {"Content-Type": "application/json"}
AUTH = {**JSON, "Authorization": f"Bearer {KEY}"}


# ---------------------------------------------------------------------------------------------- body size
def test_body_over_the_limit_is_413_by_length_and_while_chunked(guarded: Served) -> None:
    over = b" " * (LIMIT + 1)
    err = _assert_error(_send(guarded, "POST", "/v1/completions", over, AUTH), 413, code="request_too_large")
    assert str(LIMIT) in err["message"] and "--max-request-bytes" in err["message"]
    chunked = (b" " * 4096 for _ in range(LIMIT // 4096 + 2))  # no Content-Length: counted while read
    _assert_error(_send(guarded, "POST", "/v1/chat/completions", chunked, AUTH), 413, code="request_too_large")
    # a body just under the limit (whitespace after the object) is parsed off the loop and served
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    near = body.encode() + b" " * (LIMIT - len(body) - 1)
    assert len(near) >= request_body.OFF_LOOP_BYTES
    ref = guarded.reference.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    r = _send(guarded, "POST", "/v1/completions", near, AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text
    _assert_still_serves(guarded, AUTH)


def test_20mb_body_is_refused_while_health_answers(served: Served) -> None:
    """The default limit: a 20 MB body (declared, then chunked) gets 413; /health answers within a fraction of a
    second meanwhile, and the front end's memory does not grow by the body's size."""
    size = 20 * 10**6
    assert size > DEFAULT_MAX_REQUEST_BYTES
    rss_before = _http_rss_mb(served)
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=served.url, timeout=10, trust_env=False) as client:
            while not done.is_set() or len(latencies) < 3:  # a few probes even when the refusals were quick
                start = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        start = time.perf_counter()
        body = b"[" + b"1," * (size // 2) + b"1]"
        _assert_error(_send(served, "POST", "/v1/completions", body, JSON), 413, code="request_too_large")
        _assert_error(_send(served, "POST", "/v1/completions", (body[i:i + 2**20] for i in range(0, size, 2**20)),
                            JSON), 413, code="request_too_large")
        elapsed = time.perf_counter() - start
    finally:
        done.set()
        prober.join(10)
    assert elapsed < 10 and len(latencies) >= 3
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
    assert _http_rss_mb(served) - rss_before < 64, rss_before  # the body was never held whole
    _assert_still_serves(served)


# ---------------------------------------------------------------------------------------------- refused bodies
DEEP = ("[" * 65) + ("]" * 65)
BAD_BODIES = [
    ("/v1/completions", f'{{"model": "{MODEL}", "prompt": {DEEP}}}', None),
    ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "a\\ud800b"}}', "prompt"),
    ("/v1/completions", f'{{"model": "{MODEL}", "prompt": ["a\\udfffb"]}}', "prompt"),
    ("/v1/chat/completions", f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "a\\ud800b"}}]}}',
     "messages"),
    ("/v1/chat/completions", f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": '
                             f'[{{"type": "text", "text": "\\ud800"}}]}}]}}', "messages"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": PROMPT, "stop": ["x"] * (MAX_STOP_STRINGS + 1)}), "stop"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": PROMPT, "stop": "y" * (MAX_STOP_CHARS + 1)}), "stop"),
    ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "{PROMPT}", "stop": ["a\\ud800"]}}', "stop"),
]


@pytest.mark.parametrize("path,body,param", BAD_BODIES,
                         ids=["depth", "surrogate-prompt", "surrogate-prompt-list", "surrogate-chat",
                              "surrogate-chat-part", "stop-count", "stop-chars", "stop-surrogate"])
def test_refused_body_is_400_naming_the_field(served: Served, path: str, body: str, param: str | None) -> None:
    steps = served.llm.num_steps
    err = _assert_error(_send(served, "POST", path, body.encode(), JSON), 400, param)
    if param is None:
        assert str(request_body.MAX_JSON_DEPTH) in err["message"]
    assert served.llm.num_steps == steps  # refused before anything ran
    _assert_still_serves(served)


def test_stop_at_the_bounds_is_served(served: Served) -> None:
    stop = ["\x00" * (MAX_STOP_CHARS // MAX_STOP_STRINGS)] * MAX_STOP_STRINGS
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stop": stop}
    assert _send(served, "POST", "/v1/completions", json.dumps(body).encode(), JSON).status_code == 200
    _assert_still_serves(served)


# ---------------------------------------------------------------------------------------------- statuses and media types
def test_every_error_status_has_openais_body(served: Served) -> None:
    _assert_error(_send(served, "GET", "/v1/nothing-here"), 404)
    _assert_error(_send(served, "POST", "/nothing", b"{}", JSON), 404)
    err = _assert_error(_send(served, "GET", "/v1/completions"), 405)
    assert "POST" in err["message"]
    _assert_error(_send(served, "DELETE", "/health"), 405)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
        _assert_error(_send(served, "POST", "/v1/completions", body, headers), 415, code="unsupported_media_type")
    for media_type in ("application/json; charset=utf-8", "Application/JSON"):
        assert _send(served, "POST", "/v1/completions", body, {"Content-Type": media_type}).status_code == 200
    _assert_still_serves(served)


def test_unexpected_exception_is_a_logged_500_with_openais_body(served: Served, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture,
                                                                request: pytest.FixtureRequest) -> None:
    if request.node.callspec.params["served"] != "thread":
        pytest.skip("the failure is injected into this process's app (the thread front end)")
    import compile_attn.server.app as app_module

    def broken(*_: object, **__: object) -> None:
        raise ZeroDivisionError("injected")

    monkeypatch.setattr(app_module, "parse", broken)
    body = json.dumps({"model": MODEL, "prompt": PROMPT}).encode()
    with caplog.at_level("ERROR", logger="compile_attn.server.http_guards"):
        err = _assert_error(_send(served, "POST", "/v1/completions", body, JSON), 500, type="server_error")
    assert "ZeroDivisionError" in err["message"]
    assert any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)
    monkeypatch.undo()
    _assert_still_serves(served)


def test_text_plain_post_from_a_foreign_origin_is_refused_without_cors(served: Served) -> None:
    """CORS is off by default: a page's simple POST is refused before anything runs, and a preflight gets no
    CORS headers (405 with OpenAI's body), so a browser sends no JSON POST either."""
    steps = served.llm.num_steps
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 50}).encode()
    r = _send(served, "POST", "/v1/completions", body, {"Content-Type": "text/plain", "Origin": FOREIGN})
    _assert_error(r, 415, code="unsupported_media_type")
    assert "access-control-allow-origin" not in r.headers
    pre = _send(served, "OPTIONS", "/v1/completions", None, {"Origin": FOREIGN,
                                                             "Access-Control-Request-Method": "POST"})
    _assert_error(pre, 405)
    assert "access-control-allow-origin" not in pre.headers
    assert served.llm.num_steps == steps
    _assert_still_serves(served)


# ---------------------------------------------------------------------------------------------- CORS and API key
def test_cors_preflight_answers_the_allowed_origin_only(guarded: Served) -> None:
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = _send(guarded, "OPTIONS", "/v1/chat/completions", None, {"Origin": ALLOWED, **ask})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in ok.headers["access-control-allow-methods"]
    refused = _send(guarded, "OPTIONS", "/v1/chat/completions", None, {"Origin": FOREIGN, **ask})
    _assert_error(refused, 400)
    assert "access-control-allow-origin" not in refused.headers
    r = _send(guarded, "GET", "/v1/models", None, {"Origin": ALLOWED, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED
    r = _send(guarded, "GET", "/v1/models", None, {"Origin": FOREIGN, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    _assert_still_serves(guarded, AUTH)


def test_api_key_guards_all_but_the_open_routes(guarded: Served) -> None:
    steps = guarded.llm.num_steps
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 50}).encode()
    for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
        _assert_error(_send(guarded, "POST", "/v1/completions", body, {**JSON, **auth}), 401, code="invalid_api_key")
        _assert_error(_send(guarded, "GET", "/v1/models", None, auth), 401, code="invalid_api_key")
    _assert_error(_send(guarded, "GET", "/v1/nothing-here"), 401, code="invalid_api_key")
    assert guarded.llm.num_steps == steps
    assert _send(guarded, "GET", "/v1/models", None, {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert _send(guarded, "GET", "/health").status_code == 200
    assert _send(guarded, "GET", "/metrics").status_code == 200
    refused = _send(guarded, "GET", "/v1/models", None, {"Origin": ALLOWED})  # a 401 a page can read
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ALLOWED
    _assert_still_serves(guarded, AUTH)


def test_api_key_with_the_openai_client_and_the_open_routes(guarded: Served) -> None:
    """The openai client with the server's key is served; with another key it gets AuthenticationError (401, code
    invalid_api_key). /tokenize and /detokenize need the key too; /health, /metrics, /version, /docs and
    /openapi.json stay open (as vLLM leaves them)."""
    import openai

    good = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, timeout=30, max_retries=0)
    assert good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens >= 1
    assert [m.id for m in good.models.list().data] == [MODEL]
    bad = openai.OpenAI(base_url=guarded.url + "/v1", api_key="not-the-key", timeout=30, max_retries=0)
    for call in (lambda: bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3),
                 lambda: bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]),
                 lambda: bad.models.list()):
        with pytest.raises(openai.AuthenticationError) as info:
            call()
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    for path, body in (("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [5, 6]})):
        raw = json.dumps(body).encode()
        _assert_error(_send(guarded, "POST", path, raw, JSON), 401, code="invalid_api_key")
        assert _send(guarded, "POST", path, raw, AUTH).status_code == 200
    for path in ("/health", "/metrics", "/version", "/docs", "/openapi.json"):
        assert _send(guarded, "GET", path).status_code == 200, path
    _assert_still_serves(guarded, AUTH)


# ---------------------------------------------------------------------------------------------- units
@pytest.mark.parametrize("text,deeper", [
    ('{"a": [1, 2, {"b": []}]}', False),
    ("[" * 64 + "]" * 64, False),
    ("[" * 65 + "]" * 65, True),
    ('{"x":' * 65 + "1" + "}" * 65, True),
    ("[" * 100_000 + "]" * 100_000, True),  # past the parser's own recursion limit
    ('["' + "[" * 1000 + '"]', False),  # brackets inside a string do not nest
    ("[" + "[]," * 10000 + "[]]", False),  # wide, not deep
    ("[" * 30 + "{}," * 40 + "{}" + "]" * 30, False),
], ids=["shallow", "64-deep", "65-deep", "65-deep-objects", "100000-deep", "in-a-string", "wide", "mixed"])
def test_json_depth_limit(text: str, deeper: bool) -> None:
    if deeper:
        with pytest.raises(APIError, match="more than 64 deep") as info:
            request_body.loads(text.encode())
        assert info.value.status == 400 and info.value.param is None
    else:
        assert request_body.loads(text.encode()) == json.loads(text)
    with pytest.raises(APIError, match="not valid JSON"):
        request_body.loads(b"[" * 100)  # unbalanced, shallow: the parser's own message


def test_nests_deeper_walks_without_recursion() -> None:
    value: list = []
    for _ in range(5000):  # deeper than the interpreter's recursion limit
        value = [value]
    assert request_body.nests_deeper(value, 64) and request_body.nests_deeper(value, 4999)
    assert not request_body.nests_deeper(value, 5001)
    assert not request_body.nests_deeper({"a": [1, {"b": "[[[["}]}, 3) and request_body.nests_deeper([[[[]]]], 3)
    assert not request_body.nests_deeper("[[[[", 1)


def _receive(chunks: list[bytes]):
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> dict:
        return messages.pop(0)
    return receive


def _request(chunks: list[bytes], content_length: int | None) -> "request_body.Request":
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    return request_body.Request({"type": "http", "method": "POST", "headers": headers}, _receive(chunks))


def test_read_limited() -> None:
    read = lambda chunks, length, limit: asyncio.run(request_body.read_limited(_request(chunks, length), limit))  # noqa: E731
    assert read([b"ab", b"cd"], None, 4) == b"abcd"
    assert read([b"abcd"], 4, 4) == b"abcd"
    with pytest.raises(APIError) as info:
        read([b"never read"], 5, 4)  # refused from Content-Length alone
    assert info.value.status == 413 and "5 bytes" in info.value.message
    pulled: list[int] = []
    chunks = [b"x" * 3] * 100

    async def counting_receive() -> dict:
        pulled.append(1)
        return {"type": "http.request", "body": chunks[0], "more_body": True}
    with pytest.raises(APIError) as info:
        asyncio.run(request_body.read_limited(request_body.Request({"type": "http", "method": "POST",
                                                                    "headers": []}, counting_receive), 10))
    assert info.value.status == 413 and len(pulled) == 4  # stopped at the chunk that passed the limit


def test_server_options_check_and_pickle() -> None:
    options = ServerOptions(max_request_bytes=1000, allowed_origins=["*"], api_key="k")
    assert options.allowed_origins == ("*",) and "k" not in repr(options)
    assert pickle.loads(pickle.dumps(options)) == options
    for bad in (dict(max_request_bytes=0), dict(max_request_bytes=True), dict(allowed_origins="*"),
                dict(api_key="")):
        with pytest.raises(ValueError):
            ServerOptions(**bad)
    assert parse_origins('["https://a.example", "https://b.example"]') == ("https://a.example", "https://b.example")
    assert parse_origins("https://a.example, https://b.example,") == ("https://a.example", "https://b.example")
    assert parse_origins("*") == ("*",) and parse_origins("") == ()
    with pytest.raises(ValueError, match="allowed-origins"):
        parse_origins('["https://a.example"')


def test_serve_flags_build_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from compile_attn.cli import build_parser
    from compile_attn.env import API_KEY_ENV, VLLM_API_KEY_ENV
    from compile_attn.server.cli import server_options

    monkeypatch.setenv(API_KEY_ENV, "from-env")
    monkeypatch.delenv(VLLM_API_KEY_ENV, raising=False)
    args = build_parser().parse_args(["serve", "m", "--max-request-bytes", "4096", "--allowed-origins",
                                      "https://a.example,https://b.example"])
    args.prepare(args)
    assert server_options(args) == ServerOptions(4096, ("https://a.example", "https://b.example"), "from-env")
    args = build_parser().parse_args(["serve", "m", "--api-key", "flag"])
    args.prepare(args)
    assert server_options(args) == ServerOptions(DEFAULT_MAX_REQUEST_BYTES, (), "flag")
    monkeypatch.setenv(VLLM_API_KEY_ENV, "from-vllm-env")  # vLLM's variable: read after ours
    args = build_parser().parse_args(["serve", "m"])
    args.prepare(args)
    assert server_options(args).api_key == "from-env"
    monkeypatch.delenv(API_KEY_ENV)
    args = build_parser().parse_args(["serve", "m"])
    args.prepare(args)
    assert server_options(args).api_key == "from-vllm-env"
    monkeypatch.delenv(VLLM_API_KEY_ENV)
    args = build_parser().parse_args(["serve", "m"])
    args.prepare(args)
    assert server_options(args).api_key is None
    for bad in (["--max-request-bytes", "0"], ["--allowed-origins", "[1]"]):
        args = build_parser().parse_args(["serve", "m", *bad])
        with pytest.raises(ValueError, match=bad[0]):
            args.prepare(args)
