"""`compile-attn serve` as a user runs it: a subprocess on a small trained Llama, its front end in a process of its
own. A completion through it; SIGTERM with streams and a whole request open drains the server (the streams end with
a last chunk and [DONE], the whole request with a 503 or its answer) and exits 0 with the port free; either process
killed with SIGKILL takes the other down within seconds, with a log line, and frees the port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from compile_attn.server.frontend import free_port, healthy  # noqa: E402


@pytest.fixture(scope="module")
def model(trained_tiny_llama: Callable[[int], Path]) -> str:
    return str(trained_tiny_llama(20))


def _serve(model: str, *extra: str) -> tuple[subprocess.Popen, str, list[str]]:
    """The server, once it says it serves (its output so far, and from then on, in the returned list)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "compile_attn", "serve", model, "--device", "cpu", "--graph-mode",
                             "none", "--no-compile", "--port", str(port), "--max-context", "512", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
    end = time.monotonic() + 120
    while not any(line.startswith("compile-attn serve:") for line in output):
        assert proc.poll() is None, "".join(output)
        assert time.monotonic() < end, "the server did not start: " + "".join(output)
        time.sleep(0.2)
    assert healthy(url)
    return proc, url, output


def _port_free(url: str) -> bool:
    """Nothing listens there: a new server could bind it (as uvicorn does, with SO_REUSEADDR: connections the old
    one closed may linger in TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            return True
        except OSError:
            return False


def _wait(predicate, seconds: float) -> bool:  # noqa: ANN001
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def _front_end_pid(pid: int) -> int:
    """The front end process among ``pid``'s children (Linux /proc): the spawned one that is no resource tracker."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and "multiprocessing" in cmdline and "resource_tracker" not in cmdline:
            return int(entry.name)
    raise AssertionError(f"no front end process under {pid}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_serve_answers_then_sigterm_drains_and_exits_0(model: str) -> None:
    proc, url, _ = _serve(model, "--shutdown-timeout", "0.5", "--max-batch-size", "4")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
        results: dict[str, object] = {}

        def stream(name: str) -> None:
            lines = []
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 1:
                            results[name + "-started"] = True
            results[name] = lines

        def whole() -> None:
            results["whole"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=stream, args=(f"s{k}",)) for k in range(2)]
        threads.append(threading.Thread(target=whole))
        for t in threads:
            t.start()
        assert _wait(lambda: all(f"s{k}-started" in results for k in range(2)), 60)
        time.sleep(0.1)  # the whole request is admitted by now
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(30) == 0
        for k in range(2):  # each stream ended with a last chunk (cut at the timeout, or finished) and [DONE]
            lines = results[f"s{k}"]
            assert lines[-1] == "[DONE]"
            assert json.loads(lines[-2])["choices"][0]["finish_reason"] in ("abort", "length")
        r = results["whole"]
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert r.json()["error"]["type"] == "server_error"
        assert _wait(lambda: _port_free(url), 10), "the port is still taken"
    finally:
        _stop(proc)


def test_killed_front_end_stops_the_server(model: str) -> None:
    proc, url, output = _serve(model)
    try:
        os.kill(_front_end_pid(proc.pid), signal.SIGKILL)
        assert proc.wait(30) == 1
        assert _wait(lambda: "front end exited" in "".join(output), 5), "".join(output)
        assert _wait(lambda: _port_free(url), 10)
    finally:
        _stop(proc)


def test_killed_engine_process_stops_the_front_end(model: str) -> None:
    proc, url, _ = _serve(model)
    try:
        front = _front_end_pid(proc.pid)
        proc.kill()
        proc.wait(10)
        assert _wait(lambda: not Path(f"/proc/{front}").exists() or "zombie" in _state(front), 15), \
            "the front end outlived the engine's process"
        assert _wait(lambda: _port_free(url), 10)
    finally:
        _stop(proc)


def _state(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}") / "status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"
