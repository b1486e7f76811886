"""Backend registry: backends register by name with ``@register_backend``; ``create_backend`` builds one.

Registration is lazy where a backend has optional dependencies: the registry stores the module that
defines it and imports it on first use, so ``import compile_attn`` never needs flashinfer or
sgl_kernel. ``"auto"`` picks by device and what is installed (``auto_backend_candidates``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from compile_attn.errors import BackendUnavailableError, UnknownBackendError, UnsupportedConfigError

if TYPE_CHECKING:
    from compile_attn.attention.base import AttentionBackend
    from compile_attn.kv.cache import KVCache
    from compile_attn.layer import AttentionLayer

logger = logging.getLogger(__name__)

_BACKENDS: dict[str, type[AttentionBackend]] = {}
# name -> module that registers it when imported (for backends with optional dependencies)
_LAZY_BACKENDS: dict[str, str] = {
    "torch_native": "compile_attn.attention.torch_native.backend",
    "triton": "compile_attn.attention.triton.backend",
    "flashinfer": "compile_attn.attention.flashinfer.backend",
    "fa3": "compile_attn.attention.fa3.backend",
    "hybrid": "compile_attn.attention.hybrid",
}

# name -> the package its kernels come from (a backend is "installed" when that package is importable)
_REQUIRES: dict[str, str] = {"triton": "triton", "flashinfer": "flashinfer", "fa3": "sgl_kernel"}
# name -> the backend's install command (the extra of compile-attn that brings the package), as ``module:NAME``
_INSTALL_HINTS: dict[str, str] = {
    "triton": "compile_attn.attention.kernel_loader:INSTALL_HINT",
    "flashinfer": "compile_attn.attention.flashinfer.library:INSTALL_HINT",
    "fa3": "compile_attn.attention.fa3.backend:INSTALL_HINT",
}

B = TypeVar("B", bound="type[AttentionBackend]")


def register_backend(name: str) -> Callable[[B], B]:
    """Class decorator: make the backend available as ``create_backend(name, ...)``."""

    def deco(cls: B) -> B:
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return deco


def module_available(module: str) -> bool:
    """True if ``module`` is importable as a real module (a bare namespace directory does not count,
    e.g. a ``tests/attention/flashinfer/`` folder on sys.path)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def available_backends() -> list[str]:
    """Names that ``create_backend`` knows (registered, or importable on demand), whether or not the package
    their kernels need is installed: see :func:`installed_backends` for that."""
    names = set(_BACKENDS)
    names.update(n for n, mod in _LAZY_BACKENDS.items() if module_available(mod))
    return sorted(names)


def installed_backends() -> list[str]:
    """Known backends whose kernel package is importable here (``triton``, ``flashinfer``, ``sgl_kernel`` for
    fa3; hybrid counts when two of them are). Says nothing about the device: fa3 still needs a Hopper GPU."""
    names = [n for n in available_backends() if n != "hybrid" and module_available(_REQUIRES.get(n, "torch"))]
    return sorted([*names, "hybrid"] if "hybrid" in available_backends() and len(names) >= 2 else names)


def check_backend_installed(name: str) -> None:
    """BackendUnavailableError, one line naming the extra to install, when backend ``name`` (or a part of
    ``"<prefill>+<decode>"``) needs a package that is not installed; ``"auto"``, torch_native and installed backends
    pass. The one check of a missing kernel package, for every backend: ``LLM`` / ``EngineConfig`` and the command
    line run it before the model loads, ``create_backend`` before importing the backend. Imports nothing."""
    for part in name.split("+"):
        package = _REQUIRES.get(part)
        if package is not None and not module_available(package):
            others = [n for n in installed_backends() if n not in ("hybrid", part)]
            module, _, attr = _INSTALL_HINTS[part].partition(":")
            hint = getattr(importlib.import_module(module), attr)  # imports torch and compile_attn only
            raise BackendUnavailableError(
                f"the {part} attention backend needs the {package} package, which is not installed: {hint}; or pick "
                f"another backend: auto, {', '.join(others)}"
            )


def get_backend_class(name: str) -> type[AttentionBackend]:
    check_backend_installed(name)
    if name not in _BACKENDS and name in _LAZY_BACKENDS and module_available(_LAZY_BACKENDS[name]):
        importlib.import_module(_LAZY_BACKENDS[name])
    try:
        return _BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(
            f"unknown attention backend {name!r}; known backends: {', '.join(available_backends())} "
            f"(or 'auto' to pick by device)"
        ) from None


def auto_backend_candidates(device: torch.device) -> list[str]:
    """Backends "auto" tries on ``device``, best first: CUDA -> triton, then fa3 (Hopper) and flashinfer
    (Ampere+) for models triton refuses, where installed, then torch_native; CPU -> torch_native.

    triton leads on every GPU because its full-graph decode step measured fastest and its kernels build in
    seconds, where flashinfer's JIT build exceeds the start-time budget (docs/performance.md)."""
    if device.type != "cuda":
        return ["torch_native"]
    major, _ = torch.cuda.get_device_capability(device)
    candidates = ["triton"]
    if major == 9:
        candidates.append("fa3")
    if major >= 8:
        candidates.append("flashinfer")
    installed = installed_backends()  # each needs its kernel package (_REQUIRES)
    return [name for name in candidates if name in installed] + ["torch_native"]


def resolve_auto_backend(device: torch.device) -> str:
    """The first of ``auto_backend_candidates(device)`` (before checking that it supports the model)."""
    return auto_backend_candidates(device)[0]


def check_backend_name(name: str) -> None:
    """Raise UnknownBackendError unless ``create_backend`` knows ``name``: "auto", a backend name, or
    "<prefill>+<decode>" with two of those. Builds and imports nothing (an early check before a model loads);
    whether the backend runs here is for ``create_backend`` to find out."""
    known = available_backends()
    if "+" in name:
        prefill, _, decode = name.partition("+")
        parts = {"auto", *known} - {"hybrid"}
        if not prefill or not decode or "+" in decode:
            raise UnknownBackendError(
                f"hybrid backend name {name!r} must be '<prefill>+<decode>' with two backend names, "
                f"e.g. 'fa3+flashinfer'; known backends: {', '.join(known)}"
            )
        for part in (prefill, decode):
            if part not in parts:
                raise UnknownBackendError(
                    f"unknown attention backend {part!r} in {name!r}; known backends: {', '.join(sorted(parts))}"
                )
    elif name != "auto" and name not in known:
        raise UnknownBackendError(
            f"unknown attention backend {name!r}; known backends: {', '.join(known)} (or 'auto' to pick by device)"
        )


def create_backend(
    name: str,
    kv_cache: KVCache,
    layers: Sequence[AttentionLayer] | Mapping[int, AttentionLayer],
    **kwargs: object,
) -> AttentionBackend:
    """Build backend ``name`` over ``kv_cache`` for ``layers``. ``"auto"`` picks one by device;
    ``"<prefill>+<decode>"`` (e.g. ``"fa3+flashinfer"``) builds a HybridBackend of the two; ``kwargs`` go to
    the backend's constructor (for a hybrid: ``prefill_options`` / ``decode_options``)."""
    if "+" in name:
        check_backend_name(name)
        prefill, _, decode = name.partition("+")
        return get_backend_class("hybrid")(kv_cache, layers, prefill=prefill, decode=decode, **kwargs)
    if name != "auto":
        return get_backend_class(name)(kv_cache, layers, **kwargs)
    candidates = auto_backend_candidates(kv_cache.device)
    for candidate in candidates:
        try:
            backend = get_backend_class(candidate)(kv_cache, layers, **kwargs)
        except (UnsupportedConfigError, BackendUnavailableError) as exc:
            if candidate == candidates[-1]:
                raise
            logger.info("attention backend 'auto': skipping %r (%s)", candidate, exc)
            continue
        logger.info("attention backend 'auto' resolved to %r on %s", candidate, kv_cache.device)
        return backend
    raise AssertionError("unreachable: torch_native is always a candidate")
