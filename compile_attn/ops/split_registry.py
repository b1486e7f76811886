"""Registry of split ops: ops at which the compile backend cuts the FX graph and the breakable
graph runner ends a captured segment. The attention op registers itself; users add their own with
``register_split_op``.
"""

from __future__ import annotations

from typing import Any

import torch

_SPLIT_OPS: set[str] = set()


def op_name(target: Any) -> str | None:
    """Qualified name ``namespace::name`` of an op overload, packet, or name string; None otherwise."""
    if isinstance(target, str):
        return target if "::" in target else None
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def register_split_op(op: Any) -> None:
    """Mark ``op`` (``torch.ops.ns.name``, an overload, or ``"ns::name"``) as a graph split point."""
    name = op_name(op)
    if name is None:
        raise TypeError(f"register_split_op expects a torch op or a 'namespace::name' string, got {op!r}")
    _SPLIT_OPS.add(name)


def unregister_split_op(op: Any) -> None:
    _SPLIT_OPS.discard(op_name(op) or "")


def is_split_op(target: Any) -> bool:
    """True if an FX node target is a registered split op."""
    name = op_name(target)
    return name is not None and name in _SPLIT_OPS


def split_op_names() -> frozenset[str]:
    return frozenset(_SPLIT_OPS)
