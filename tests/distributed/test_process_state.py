"""``process_state``: what a worker that has not joined is doing, as a start that waits for it reports it."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from compile_attn.engine.tensor_parallel.engine_group import process_state


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_names_a_sleeping_process_and_where_it_waits() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        state = process_state(child.pid)
        while "sleeping" not in state and time.monotonic() < deadline:  # until the interpreter is up and asleep
            time.sleep(0.1)
            state = process_state(child.pid)
        assert state.startswith(f"pid {child.pid}, state S (sleeping), threads: "), state
    finally:
        child.kill()
        child.wait()


def test_a_missing_process_is_named_by_its_pid() -> None:
    assert process_state(None) == "not started"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_state(child.pid) == f"pid {child.pid}"
