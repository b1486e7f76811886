"""`compile-attn serve` as a user runs it: a subprocess on a small trained Llama, its front end in a process of its
own; a completion through it; SIGTERM stops both processes (the port is free again) with exit code 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from compile_attn.models.tiny_llama import tiny_llama  # noqa: E402
from compile_attn.server.frontend import free_port, healthy  # noqa: E402


def test_serve_answers_and_stops_on_sigterm(tmp_path) -> None:
    model = str(tiny_llama(tmp_path / "model", steps=20))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "compile_attn", "serve", model, "--device", "cpu", "--graph-mode",
                             "none", "--no-compile", "--port", str(port), "--max-context", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        end = time.monotonic() + 120
        while not healthy(url):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < end, "the server did not answer /health"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        end = time.monotonic() + 10
        while healthy(url):  # the front end process went with it
            assert time.monotonic() < end, "the front end outlived the server process"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
