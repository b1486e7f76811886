"""Structural key of a graph piece: equal keys mean the pieces compute the same function of their inputs.

The key is a canonical text of the piece's nodes (names replaced by positions, symbols by their
order of appearance) and of its inputs' metadata (shapes, strides, dtypes, devices). Layers 1..N-2 of a
decoder give the same key, so they compile once; the key is also the model-code part of the
persistent cache key. Anything the text cannot describe faithfully makes the key process-local.
"""

from __future__ import annotations

import hashlib
import types
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

_MAX_CONSTANT_BYTES = 1 << 20  # tensor constants up to this size are keyed by content


@dataclass(frozen=True)
class PieceKey:
    """``digest`` identifies the piece; ``stable`` is False when it only holds within this process."""

    digest: str
    stable: bool
    text: str


class _Canonicalizer:
    def __init__(self) -> None:
        self.stable = True
        self.symbols: dict[sympy.Symbol, sympy.Symbol] = {}
        self.node_index: dict[fx.Node, int] = {}

    def expr(self, e: Any) -> str:
        e = sympy.sympify(e)
        for s in sorted(e.free_symbols, key=str):
            self.symbols.setdefault(s, sympy.Symbol(f"S{len(self.symbols)}"))
        return str(e.xreplace(self.symbols))

    def tensor(self, t: torch.Tensor) -> str:
        shape = ",".join(self.expr(d) if isinstance(d, torch.SymInt) else str(d) for d in t.shape)
        stride = ",".join(self.expr(d) if isinstance(d, torch.SymInt) else str(d) for d in t.stride())
        return f"T[{shape}|{stride}|{t.dtype}|{t.device.type}|grad={t.requires_grad}]"

    def constant(self, t: torch.Tensor) -> str:
        meta = self.tensor(t)
        plain = type(t) in (torch.Tensor, torch.nn.Parameter)
        if t.numel() * t.element_size() > _MAX_CONSTANT_BYTES or not plain:
            self.stable = False
            return f"{meta}@{id(t)}"
        data = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        return f"{meta}#{hashlib.sha256(data).hexdigest()[:16]}"

    def value(self, v: Any) -> str:
        if isinstance(v, fx.Node):
            return f"%{self.node_index[v]}"
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return f"Sym({self.expr(v.node.expr)})"
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if v is None or v is Ellipsis or isinstance(v, (bool, int, float, str, complex)):
            return repr(v)
        if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(v)
        if isinstance(v, (list, tuple)):
            inner = ",".join(self.value(x) for x in v)
            return f"[{inner}]" if isinstance(v, list) else f"({inner})"
        if isinstance(v, dict):
            return "{" + ",".join(f"{self.value(k)}:{self.value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, slice):
            return f"slice({self.value(v.start)},{self.value(v.stop)},{self.value(v.step)})"
        return self.target(v)

    def target(self, t: Any) -> str:
        if isinstance(t, str):
            return t
        if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return f"op:{t}"
        if isinstance(t, (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType, type)):
            module = getattr(t, "__module__", None) or ""
            qualname = getattr(t, "__qualname__", None) or getattr(t, "__name__", "")
            if qualname and "<locals>" not in qualname and "<lambda>" not in qualname:
                return f"{module}.{qualname}"
        self.stable = False  # an object we cannot describe: only identical objects share the key
        return f"{type(t).__qualname__}@{id(t)}"


def piece_key(gm: fx.GraphModule, example_inputs: list[Any]) -> PieceKey:
    """Canonical key of ``gm`` called with inputs described by ``example_inputs`` (fake or real)."""
    canon = _Canonicalizer()
    lines = []
    placeholders = iter(example_inputs)
    for i, node in enumerate(gm.graph.nodes):
        canon.node_index[node] = i
        if node.op == "placeholder":
            lines.append(f"in {canon.value(next(placeholders, None))}")
        elif node.op == "get_attr":
            attr = getattr(gm, str(node.target))
            described = canon.constant(attr) if isinstance(attr, torch.Tensor) else canon.target(attr)
            lines.append(f"const {described}")
        elif node.op == "call_module":
            lines.append(f"module {canon.target(getattr(gm, str(node.target)))} {canon.value(node.args)}")
        else:
            target, args, kwargs = canon.target(node.target), canon.value(node.args), canon.value(node.kwargs)
            lines.append(f"{node.op} {target} {args} {kwargs}")
    text = "\n".join(lines)
    return PieceKey(hashlib.sha256(text.encode()).hexdigest(), canon.stable, text)
