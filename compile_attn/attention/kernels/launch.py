"""Triton kernel launches that skip the per-call argument binding when the exact arguments were seen before.

``kernel[grid](*args)`` runs Triton's ``JITFunction.run`` every time: binding and specialising each argument,
hashing the specialisation, reading knobs, building launch metadata: several times an aten op's host cost.
Piecewise decode launches our kernels between graph replays, so it is on the critical path. ``CachedLaunch``
keys a call by the exact argument values (tensor data pointers and dtypes, ints and floats with their types,
constexprs, launch options). Same key means Triton would specialise it identically, so the compiled kernel of
the first call is launched directly through its launcher (``CompiledKernel.run``), the same call
``JITFunction.run`` ends with, tensors passed as their addresses (checked by the regular launch that made the
entry). In piecewise and graph-bucketed decode, every layer's arguments repeat step after step (static
buffers), so after the first step every launch takes the short path.

The short path is used only where it mirrors the installed Triton exactly: compiled (not interpreted)
kernels, a ``JITFunction.run`` that launches with ``kernel.run(..., *bound_args.values())`` (every parameter,
constexprs included: the Triton versions this project supports), no launch hooks installed (profilers such as
proton), every parameter passed explicitly, and a ``CompiledKernel`` returned synchronously. Otherwise every
call goes through ``kernel[grid]``. This is the attention layer's host shortcut: off (every launch through
``kernel[grid]``) when ``$COMPILE_ATTN_HOST_SHORTCUTS`` is 0 at the time a launcher is made (``config.py``), and
tied to Triton's internals (the source of ``JITFunction.run``, ``CompiledKernel.run``'s arguments, where launch
hooks live): tests/test_host_shortcuts.py pins them.

``CachedLaunch.bind`` goes one step further for a caller that knows its launch repeats exactly (a decode layer
between piecewise graphs, over static buffers): the returned ``BoundLaunch`` holds the launcher and the argument
list and relaunches without building the key; checking that the arguments still hold is the caller's job.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import triton
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from compile_attn.env import host_shortcuts_enabled
from compile_attn.ops.triton_launch import launch

logger = logging.getLogger(__name__)

MAX_ENTRIES = 4096  # distinct argument lists kept per kernel (then the cache starts over)


def _mirrors_installed_triton() -> bool:
    """True when ``JITFunction.run`` of the installed Triton launches with every bound parameter, in the
    ``kernel.run(grid_0, grid_1, grid_2, stream, function, packed_metadata, ...)`` form this module repeats."""
    try:
        source = inspect.getsource(JITFunction.run)
    except (OSError, TypeError):
        return False
    return "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata" in source and (
        "*bound_args.values())" in source
    )


_SHORT_PATH = _mirrors_installed_triton()


def _active(hook: Any) -> bool:
    """A launch hook that would do something: set, and (for Triton's ``HookChain``) holding at least one call."""
    return hook is not None and bool(getattr(hook, "calls", True))


# Where the installed Triton keeps its launch hooks (``triton.knobs.runtime`` in 3.4+, ``CompiledKernel`` before),
# looked up once: the hooks themselves are read on every launch, since a profiler may install them at any time.
_HOOK_HOLDERS = tuple(
    h for h in (getattr(getattr(triton, "knobs", None), "runtime", None), CompiledKernel)
    if h is not None and (hasattr(h, "launch_enter_hook") or hasattr(h, "launch_exit_hook"))
)


def _hooks_installed() -> bool:
    """True when a launch enter/exit hook is active (the short path does not call hooks)."""
    for holder in _HOOK_HOLDERS:
        if _active(getattr(holder, "launch_enter_hook", None)) or _active(getattr(holder, "launch_exit_hook", None)):
            return True
    return False


_SCALARS = frozenset({int, float, bool, str, type(None)})


def _call_key(args: tuple, kwargs: dict) -> tuple | None:
    """The cache key of a launch: argument types, then scalars by value and tensors by address, the tensors'
    dtypes, then the keyword arguments. None for an argument that is neither (it is launched the regular way,
    uncached). Built with comprehensions, not a function call per argument: this runs on every launch, and
    comprehensions halve its cost. ``key[1]`` is also what the short path passes to the launcher."""
    try:
        values = tuple([a if type(a) in _SCALARS else a.data_ptr() for a in args])
    except AttributeError:
        return None
    return (tuple(map(type, args)), values, tuple([a.dtype for a in args if type(a) not in _SCALARS]),
            tuple(kwargs.items()))


def _launch_args(key: tuple) -> tuple:
    """The positional arguments of a launch as the launcher takes them: tensors as their addresses (Triton's
    launchers take an int for a pointer parameter, and skip the per-pointer driver query they make for a
    tensor, which the regular launch of the same key already made)."""
    return key[1]


class BoundLaunch:
    """One launch with all its arguments fixed: ``bound()`` launches what ``CachedLaunch.__call__`` would for
    them, on the current stream, skipping even the key. Made by :meth:`CachedLaunch.bind` for callers that
    know their launch repeats exactly (same buffers at the same addresses, same scalars), such as a decode
    layer of a piecewise graph step; checking that is the caller's job. Holds no tensor (only addresses).
    Returns False, launching nothing, while a launch hook is active: the caller then launches the regular way.
    """

    __slots__ = ("_grid", "_run", "_tail")

    def __init__(self, compiled: Any, grid: Sequence[int], launch_args: tuple, constexprs: tuple) -> None:
        g = (*grid, 1, 1)
        self._grid = (g[0], g[1], g[2])
        self._run = compiled.run
        self._tail = (compiled.function, compiled.packed_metadata, None, None, None, *launch_args, *constexprs)

    def __call__(self) -> bool:
        if _hooks_installed():
            return False
        device = driver.active.get_current_device()
        self._run(*self._grid, driver.active.get_current_stream(device), *self._tail)
        return True


class CachedLaunch:
    """``launch(grid, *args, **constexprs_and_options)``: same semantics as ``kernel[grid](*args, **kwargs)``.

    Runtime arguments go positionally, constexprs and launch options (``num_warps``, ``num_stages``) by
    keyword. Counters ``fast`` and ``slow`` count the launches that took each path.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.fast = 0
        self.slow = 0
        self._cache: dict[tuple, tuple[Any, tuple]] = {}
        self._usable = _SHORT_PATH and isinstance(kernel, JITFunction) and host_shortcuts_enabled()
        self._names = list(getattr(kernel, "arg_names", ()))

    def __call__(self, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
        if not self._usable:
            self.slow += 1
            launch(self.kernel, grid, *args, **kwargs)
            return
        key = _call_key(args, kwargs)
        hit = None if key is None else self._cache.get(key)
        if hit is not None and not _hooks_installed():
            compiled, constexprs = hit
            device = driver.active.get_current_device()
            stream = driver.active.get_current_stream(device)
            g = (*grid, 1, 1)
            compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                         *_launch_args(key), *constexprs)
            self.fast += 1
            return
        self.slow += 1
        compiled = launch(self.kernel, grid, *args, **kwargs)
        constexprs = self._trailing_args(len(args), kwargs)
        if key is None or constexprs is None or not all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata")
        ):
            return  # not a form this module mirrors: this kernel always takes the regular path from now on
        if len(self._cache) >= MAX_ENTRIES:
            self._cache.clear()
        # The entry holds no tensors (the key has their addresses, which a hit passes to the launcher): caching
        # a launch never keeps memory alive.
        self._cache[key] = (compiled, constexprs)

    def bind(self, grid: Sequence[int], *args: Any, **kwargs: Any) -> BoundLaunch | None:
        """The launch ``self(grid, *args, **kwargs)`` as a :class:`BoundLaunch`, or None where the short path
        cannot take it: interpreted kernels, a Triton this module does not mirror, arguments not cached yet (launch
        them once through ``self`` first, which compiles the kernel)."""
        if not self._usable:
            return None
        key = _call_key(args, kwargs)
        hit = None if key is None else self._cache.get(key)
        if hit is None:
            return None
        compiled, constexprs = hit
        return BoundLaunch(compiled, grid, _launch_args(key), constexprs)

    def _trailing_args(self, num_positional: int, kwargs: dict) -> tuple | None:
        """The keyword parameters (constexprs), in signature order, that ``JITFunction.run`` passes after the
        positional ones to ``CompiledKernel.run``; None if one is left to its default (then the short path is
        switched off for this kernel)."""
        values = []
        for name in self._names[num_positional:]:
            if name not in kwargs:
                self._usable = False
                logger.debug("CachedLaunch: %s leaves %s to its default; using kernel[grid] for it", self.kernel, name)
                return None
            values.append(kwargs[name])
        return tuple(values)
