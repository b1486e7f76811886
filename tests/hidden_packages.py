"""Run Python code in a fresh interpreter with some packages hidden from the import system, as if not installed.

Tests that check what happens without an optional package (the core install, a backend whose kernel package is
missing) cannot hide it in their own process (``sys.modules`` already holds it). ``run_python`` starts a fresh
interpreter with this checkout first on the path; its prelude wraps every finder of ``sys.meta_path`` so that it
finds nothing for a hidden package: importing one raises ModuleNotFoundError and ``importlib.util.find_spec``
returns None.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_HIDE = """
import sys
HIDDEN = set({hidden!r})
class Hide:
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN or not hasattr(self.inner, "find_spec"):
            return None
        return self.inner.find_spec(name, path, target)
    def invalidate_caches(self):
        getattr(self.inner, "invalidate_caches", lambda: None)()
assert not [m for m in sys.modules if m.split(".")[0] in HIDDEN]
sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
"""


def hide_prelude(hidden: Iterable[str]) -> str:
    """Code that, run first in a fresh interpreter, hides the top-level packages ``hidden`` (none loaded yet)."""
    return _HIDE.format(hidden=sorted(hidden))


def run_python(code: str, *, hidden: Iterable[str] = (), env: Mapping[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter from the repository root, this checkout first on ``PYTHONPATH``,
    ``hidden`` packages refused and ``env`` added to the environment; its exit status and text output."""
    hidden = tuple(hidden)
    prelude = hide_prelude(hidden) if hidden else ""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, env=full_env,
                          cwd=ROOT, timeout=timeout)
