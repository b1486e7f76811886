"""Horizontal fusion: linear layers that read the same input (q/k/v, gate/up) become one GEMM.

HF models run q, k and v (and gate and up) as separate GEMMs. At decode batch sizes each one is a
GEMV over a few MB of weights, too small to reach HBM bandwidth, and each is a kernel launch. This
pass finds ``linear(x, w_i, b_i)`` calls in a Dynamo graph that share ``x`` and whose weights are
graph inputs (the model's parameters), concatenates the weights once at compile time and makes the
parameters views of the concatenation, so no weight memory is duplicated. The calls become one
``linear`` on the fused weight and a ``split`` of its output; the split parts are views, which the
consumers (``view`` into heads, rotary, ...) read in place.

The fused weights enter the graph as new placeholders, so that the graph split and the piece
compiler treat them like every other weight (identical layers still share one compiled piece).
``bind_fused_weights`` turns those placeholders into attributes of the final module after the split,
so the callable returned to Dynamo keeps the signature of the graph it was given.

Nothing is fused while autograd could need the parameters' gradients (grad mode on and a weight that
requires grad): the fused tensor is not a parameter, and gradients would not reach the model.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from compile_attn.env import host_shortcuts_enabled
from compile_attn.errors import CompileAttnError
from compile_attn.passes.split import is_split_node

logger = logging.getLogger(__name__)

LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
FUSED_PREFIX = "compile_attn_fused_"


@dataclass(frozen=True)
class FusedWeight:
    """A placeholder added to the graph and the real tensor it stands for; ``source`` is the graph input (index
    and tensor) of the group's first weight, a view of ``tensor`` once fused."""

    name: str
    tensor: torch.Tensor
    source: tuple[int, torch.Tensor]


@dataclass(frozen=True)
class _LinearCall:
    node: fx.Node
    weight: fx.Node
    bias: fx.Node | None


def _as_linear_call(node: fx.Node) -> _LinearCall | None:
    if node.op != "call_function" or node.target not in LINEAR_TARGETS:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    weight = node.kwargs.get("weight", args[1])
    bias = node.kwargs.get("bias", args[2])
    if not isinstance(weight, fx.Node) or weight.op != "placeholder":
        return None
    if bias is not None and (not isinstance(bias, fx.Node) or bias.op != "placeholder"):
        return None
    return _LinearCall(node, weight, bias)


def _concat_in_place(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One tensor holding ``tensors`` along dim 0, which afterwards are views of it (their ``.data`` moves)."""
    first = tensors[0]
    offset = first.storage_offset()
    adjacent = all(
        t.is_contiguous() and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        for t in tensors
    )
    if adjacent:  # fused before (an earlier graph of the same model): view the existing storage
        expected = offset
        for t in tensors:
            adjacent = adjacent and t.storage_offset() == expected
            expected += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    shape = (rows, *first.shape[1:])
    with torch.inference_mode(False), torch.no_grad():
        if adjacent:
            stride = (shape[1], 1) if len(shape) == 2 else (1,)
            return first.detach().as_strided(shape, stride, offset)
        fused = torch.empty(shape, dtype=first.dtype, device=first.device)
        start = 0
        for t in tensors:
            part = fused[start:start + t.shape[0]]
            part.copy_(t)
            t.data = part
            start += t.shape[0]
    return fused


def _is_module_parameter(node: fx.Node, value: Any) -> bool:
    """A placeholder Dynamo filled from a module's ``_parameters`` (not a tensor the caller passes in).

    Only those are fused: a tensor argument may be a different tensor on the next call, while a
    parameter stays the same object (updated in place by ``load_state_dict``, which then writes
    into the fused tensor it is a view of).
    """
    grapharg = node.meta.get("grapharg")
    source = getattr(getattr(grapharg, "source", None), "name", "")
    return isinstance(value, torch.nn.Parameter) and "._parameters[" in str(source)


def _fusable(calls: list[_LinearCall], real: dict[fx.Node, Any]) -> bool:
    weights = [real[c.weight] for c in calls]
    first = weights[0]
    if len({c.weight for c in calls}) != len(calls):
        return False
    inputs = [c.weight for c in calls] + [c.bias for c in calls if c.bias is not None]
    if not all(_is_module_parameter(n, real[n]) for n in inputs):
        return False
    if any(not isinstance(w, torch.Tensor) or w.dim() != 2 for w in weights):
        return False
    if any(w.dtype != first.dtype or w.device != first.device or w.shape[1] != first.shape[1] for w in weights):
        return False
    if len({c.bias is None for c in calls}) != 1:
        return False
    if calls[0].bias is not None:
        biases = [real[c.bias] for c in calls]
        if any(not isinstance(b, torch.Tensor) or b.dim() != 1 or b.dtype != first.dtype for b in biases):
            return False
    if torch.is_grad_enabled() and any(real[n].requires_grad for n in inputs):
        return False
    return True


def _groups(graph: fx.Graph) -> list[list[_LinearCall]]:
    """Linear calls on parameter weights that share an input with no split op between them."""
    by_input: dict[fx.Node, list[list[_LinearCall]]] = {}
    splits_seen = 0
    last_split_count: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if is_split_node(node):
            splits_seen += 1
            continue
        call = _as_linear_call(node)
        if call is None or not isinstance(node.args[0], fx.Node):
            continue
        x = node.args[0]
        runs = by_input.setdefault(x, [])
        if not runs or last_split_count[x] != splits_seen:
            runs.append([])
        runs[-1].append(call)
        last_split_count[x] = splits_seen
    return [run for runs in by_input.values() for run in runs if len(run) > 1]


def _fake_mode(node: fx.Node) -> Any:
    """The fake mode of the example value Dynamo attached to ``node`` (None when it has none)."""
    value = node.meta.get("example_value")
    return getattr(value, "fake_mode", None)


def fused_group_count(fused: Sequence[FusedWeight]) -> int:
    """Number of linear groups behind ``fused`` (each group adds a weight, and a bias when it has one)."""
    return sum(1 for w in fused if w.name.endswith("_weight"))


def fuse_linears(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[fx.GraphModule, list[FusedWeight]]:
    """``gm`` with shared-input linears fused (a new module when any were), and the placeholders added.

    ``gm`` itself is left alone: Dynamo reads its placeholders after the backend returns.
    """
    if not _groups(gm.graph):
        return gm, []
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    gm = fx.GraphModule(gm, graph)
    placeholders = list(graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        logger.debug("compile_attn: %d placeholders, %d example inputs: no linear fusion",
                     len(placeholders), len(example_inputs))
        return gm, []
    real = dict(zip(placeholders, example_inputs))
    added: list[FusedWeight] = []
    last_placeholder = placeholders[-1]  # there are groups, so there are weight placeholders
    for calls in _groups(graph):
        if not _fusable(calls, real):
            continue
        sizes = [real[c.weight].shape[0] for c in calls]
        source = (placeholders.index(calls[0].weight), real[calls[0].weight])
        weight = _concat_in_place([real[c.weight] for c in calls])
        bias = _concat_in_place([real[c.bias] for c in calls]) if calls[0].bias is not None else None
        fake_mode = _fake_mode(calls[0].node.args[0])
        new_inputs: list[fx.Node] = []
        for tensor, kind in ((weight, "weight"), (bias, "bias")):
            if tensor is None:
                continue
            name = f"{FUSED_PREFIX}{len(added)}_{kind}"
            with graph.inserting_after(last_placeholder):
                node = graph.placeholder(name)
            if fake_mode is not None:
                node.meta["example_value"] = fake_mode.from_tensor(tensor, static_shapes=True)
            last_placeholder = node
            new_inputs.append(node)
            added.append(FusedWeight(name, tensor, source))
        _rewrite(graph, calls, new_inputs, sizes, fake_mode)
    if added:
        graph.lint()
        gm.recompile()
        logger.info("compile_attn: fused %d groups of linear layers sharing an input", fused_group_count(added))
    return gm, added


class FusedWeightsGuard:
    """Runs a graph whose fused weights were cut from one model's parameters, after checking that the call passes
    that model's parameters. Dynamo reuses compiled code for any model whose guards pass, and a second model of the
    same architecture passes them: run with the first model's fused weights, it would give the first model's
    outputs. ``compile_attn.compile_model`` (what ``LLM`` uses) gives each model its own compiled code; this stops a
    direct ``torch.compile`` of two such models with a clear error instead of wrong outputs."""

    __slots__ = ("fn", "index", "tensor")

    def __init__(self, fn: Callable[..., Any], index: int, tensor: torch.Tensor) -> None:
        self.fn, self.index, self.tensor = fn, index, tensor

    def __call__(self, *args: Any) -> Any:
        if args[self.index] is not self.tensor:
            raise CompileAttnError(
                "this compile_attn graph fuses the q/k/v and gate/up weights of the model it was compiled for, and "
                f"was called with another model's weights (input {self.index}, the same architecture): compile "
                "each model with compile_attn.compile_model(model) (LLM does), call torch._dynamo.reset() before "
                "compiling the next model, or pass options={'fuse_linears': False}")
        return self.fn(*args)


def guard_fused_weights(fn: Callable[..., Any], fused: Sequence[FusedWeight]) -> Callable[..., Any]:
    """``fn``, behind a ``FusedWeightsGuard`` when the graph has fused weights."""
    if not fused:
        return fn
    index, tensor = fused[0].source
    return FusedWeightsGuard(fn, index, tensor)


def _rewrite(
    graph: fx.Graph, calls: list[_LinearCall], new_inputs: list[fx.Node], sizes: list[int], fake_mode: Any
) -> None:
    first = calls[0].node
    x = first.args[0]
    with graph.inserting_before(first):
        fused = graph.call_function(torch._C._nn.linear, (x, *new_inputs))
        parts = graph.call_function(torch.split, (fused, sizes), {"dim": -1})
        outs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(calls))]
    vals = [n.meta.get("example_value") for n in (x, *new_inputs)]
    if fake_mode is not None and all(isinstance(v, torch.Tensor) for v in vals):
        with fake_mode:  # the output's metadata; running linear itself on unbacked sizes fails in torch 2.11
            y = vals[0].new_empty((*vals[0].shape[:-1], sum(sizes)), dtype=vals[1].dtype)
            pieces = torch.split(y, sizes, dim=-1)
        fused.meta["example_value"] = y
        parts.meta["example_value"] = pieces
        for out, piece in zip(outs, pieces):
            out.meta["example_value"] = piece
    for call, out in zip(calls, outs):
        out.meta.setdefault("stack_trace", call.node.meta.get("stack_trace"))
        call.node.replace_all_uses_with(out)
        graph.erase_node(call.node)


def bind_fused_weights(split_gm: fx.GraphModule, fused: Sequence[FusedWeight]) -> None:
    """Replace the fused-weight placeholders of ``split_gm`` with buffers it owns (not in its state dict)."""
    if not fused:
        return
    graph = split_gm.graph
    by_name = {n.target: n for n in graph.find_nodes(op="placeholder")}
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for weight in fused:
        split_gm.register_buffer(weight.name, weight.tensor, persistent=False)
        with graph.inserting_before(first_op):
            attr = graph.get_attr(weight.name)
        placeholder = by_name[weight.name]
        placeholder.replace_all_uses_with(attr)
        graph.erase_node(placeholder)
    graph.lint()
    split_gm.recompile()
    # The forward reads each as ``self.<name>`` on every call; a buffer is found by ``Module.__getattr__`` (a
    # Python lookup per read, two reads per layer per step). The same tensor in the instance dict is a
    # plain attribute read. ``split_gm`` is never moved or converted (``Module._apply``) after this. A host
    # shortcut (``config.host_shortcuts_enabled``; the precedence it relies on is pinned in test_host_shortcuts).
    if host_shortcuts_enabled():
        for weight in fused:
            split_gm.__dict__[weight.name] = weight.tensor
