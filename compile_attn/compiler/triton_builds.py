"""Counting the Triton kernels that Triton's JIT builds in this process, by kernel name.

A hand-written kernel (attention, metadata, sampling helpers) is compiled once per specialisation: its constexprs
and the alignment of its integer and pointer arguments (divisible by 16 or not, equal to 1). A specialisation met
for the first time on live traffic costs a compile of ~0.1-1 s inside a step, which is what the engine's warm-up is
there to prevent. ``triton_builds.install()`` chains a ``triton.knobs.runtime.jit_cache_hook`` (called on every
cache miss of a ``JITFunction``, before it compiles) that counts the miss and lets the compile go on;
``triton_builds.since(snapshot)`` is what was built after a ``snapshot()``, and ``specialisations_since(snapshot)``
names each build's specialisation (Triton's cache key: each argument's type and alignment, the constexprs) so that
the warm-up can be taught the one it missed. Inductor's generated kernels are built
by Inductor's own compile path at compile time and are not counted here. Nothing here changes behaviour.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

logger = logging.getLogger(__name__)


class TritonBuilds:
    """Process-wide counts of JIT builds per kernel name (``install`` once; further calls do nothing)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.specialisations: list[str] = []  # each build's kernel name and Triton cache key, in build order
        self._installed = False
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Start counting; False where this Triton has no ``jit_cache_hook`` knob (then nothing is counted)."""
        with self._lock:
            if self._installed:
                return True
            try:
                from triton import knobs
            except ImportError:
                return False
            runtime = getattr(knobs, "runtime", None)
            if runtime is None or not hasattr(runtime, "jit_cache_hook"):
                return False
            previous = runtime.jit_cache_hook

            def hook(*args: Any, **kwargs: Any) -> Any:
                fn = kwargs.get("fn")
                name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[")[0]
                self.counts[name.rsplit(".", 1)[-1]] += 1  # a qualified name's last part: the kernel's own
                # Triton's cache key: each argument's type and specialisation (alignment, == 1), constexprs, options
                self.specialisations.append(f"{name.rsplit('.', 1)[-1]} {kwargs.get('key')}"[:600])
                return previous(*args, **kwargs) if previous is not None else None  # None: compile as usual

            runtime.jit_cache_hook = hook
            self._installed = True
            return True

    def snapshot(self) -> Counter[str]:
        return Counter(self.counts)

    def since(self, snapshot: Counter[str]) -> dict[str, int]:
        """Kernel name -> builds after ``snapshot``, most first."""
        return dict((self.counts - snapshot).most_common())

    def specialisations_since(self, snapshot: Counter[str]) -> list[str]:
        """Kernel name and Triton cache key of each build after ``snapshot``."""
        return self.specialisations[sum(snapshot.values()):]


triton_builds = TritonBuilds()
