"""Registry of split ops: ops at which the compile backend cuts the FX graph and the breakable
graph runner ends a captured segment. The attention op registers itself; users add their own with
``register_split_op``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_SPLIT_OPS: set[str] = set()
# Python bodies of split ops registered through torch.library.Library (custom_op ops carry their own):
# a CPU full-graph capture descends into them so the ops inside are recorded as a CUDA graph would.
_PY_IMPLS: dict[str, Callable[..., Any]] = {}


def op_name(target: Any) -> str | None:
    """Qualified name ``namespace::name`` of an op overload, packet, or name string; None otherwise."""
    if isinstance(target, str):
        return target if "::" in target else None
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def register_split_op(op: Any, python_impl: Callable[..., Any] | None = None) -> None:
    """Mark ``op`` (``torch.ops.ns.name``, an overload, or ``"ns::name"``) as a graph split point.
    ``python_impl``: the op's Python body, for ops registered with ``torch.library.Library.impl``."""
    name = op_name(op)
    if name is None:
        raise TypeError(f"register_split_op expects a torch op or a 'namespace::name' string, got {op!r}")
    _SPLIT_OPS.add(name)
    if python_impl is not None:
        _PY_IMPLS[name] = python_impl


def split_op_python_impl(target: Any) -> Callable[..., Any] | None:
    """The Python body given to ``register_split_op`` for ``target`` (None if none was given)."""
    return _PY_IMPLS.get(op_name(target) or "")


def unregister_split_op(op: Any) -> None:
    name = op_name(op) or ""
    _SPLIT_OPS.discard(name)
    _PY_IMPLS.pop(name, None)


def is_split_op(target: Any) -> bool:
    """True if an FX node target is a registered split op."""
    name = op_name(target)
    return name is not None and name in _SPLIT_OPS


def split_op_names() -> frozenset[str]:
    return frozenset(_SPLIT_OPS)
