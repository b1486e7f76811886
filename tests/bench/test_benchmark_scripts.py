"""Every script in ``benchmarks/`` still imports against the library and builds its command line.

The scripts run on GPUs only, so nothing else in CI reads them: a name moved or renamed in ``compile_attn`` would
break them silently. Each is loaded from its file (its ``if __name__ == "__main__":`` body does not run) and its
``main()`` is called with ``--help``, which builds the whole argument parser and exits 0 before any GPU work.
Whatever a script adds to ``sys.path``, ``sys.modules`` or the environment is taken back afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in [*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("experiments/*.py")] if p.stem != "common")


@contextlib.contextmanager
def _isolated():
    path, modules, environ = list(sys.path), set(sys.modules), dict(os.environ)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if str(BENCHMARKS) in str(getattr(sys.modules[name], "__file__", "") or ""):
                del sys.modules[name]
        os.environ.clear()
        os.environ.update(environ)


def test_every_script_is_checked() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"bench_tensor_parallel.py", "profile_speculative_step.py", "gpu_trace_summary.py"} <= names
    assert len(SCRIPTS) >= 25


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_script_imports_and_its_help_exits_zero(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _isolated():
        name = f"_benchmark_{script.stem}"
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
        assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
        monkeypatch.setattr(sys, "argv", [script.name, "--help"])
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            module.main()
        assert done.value.code in (0, None), f"{script.name} --help exited {done.value.code}"
        assert "usage:" in out.getvalue()
