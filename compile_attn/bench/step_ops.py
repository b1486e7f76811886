"""The device ops an engine step issues outside the model forward, counted on the CPU: what a GPU would launch
around the graph replay of every step (uploads of the step's inputs, copies into the graph's static buffers, the
feed of the previous step's tokens, the LM head and the sampler, the copy of the tokens back).

A ``TorchDispatchMode`` sees every aten op. On the CPU host and device tensors live in the same memory, so an op
counts as a device op when one of its tensors is device memory: the engine's own device tensors (model weights,
KV cache, the graph runner's static buffers, the backend's state) or the output of an earlier device op or of an
upload (``host_tensors.upload`` / ``upload_into``, each counted as one host-to-device copy). A read of device
tokens by the host (``InFlightStep.launch``'s copy) counts as one device-to-host copy. Views and other metadata
ops launch nothing and are not counted; ops inside the forward (graph replay or eager model call) and the LM head
are counted apart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from compile_attn import host_tensors
from compile_attn.engine.execution import in_flight
from compile_attn.engine.execution.sampling import step as step_sampling

logger = logging.getLogger(__name__)
H2D, D2H = "H2D copy", "D2H copy"
# "metadata in graph": the backend's in-graph metadata, run outside the graph only where the decode graph is not a
# full one (on the CPU the Triton backend's plan is breakable; a GPU's full decode graph holds it).
REGIONS = ("step", "forward", "metadata in graph", "lm_head")
aten = torch.ops.aten
# Ops that launch no kernel on a GPU: views, metadata, allocation without initialisation.
_FREE = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.slice.Tensor, aten.select.int, aten.split_with_sizes.default,
    aten.split.Tensor, aten.unbind.int, aten.alias.default, aten.as_strided.default, aten._reshape_alias.default,
    aten.detach.default, aten.t.default, aten.transpose.int, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.permute.default, aten.empty.memory_format, aten.empty_strided.default,
    aten.empty_like.default, aten.new_empty.default, aten.is_pinned.default, aten._pin_memory.default,
    aten.lift_fresh.default, aten.view.dtype,
})


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _StepOps(TorchDispatchMode):
    """Counts device ops by region (``REGIONS``); keeps every device tensor it saw alive, so
    that no host tensor of the window reuses a device tensor's address."""

    def __init__(self, device_tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.device = {_ptr(t) for t in device_tensors if t.numel()}
        self.keep: list[Any] = list(device_tensors)  # per-step state among them too: its memory is not reused
        self.region = "step"
        self.quiet = False
        self.ops: dict[str, Counter[str]] = {r: Counter() for r in REGIONS}

    def mark_device(self, tree: Any) -> None:
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.numel():
                self.device.add(_ptr(t))
                self.keep.append(t)

    def count(self, name: str) -> None:
        self.ops[self.region][name] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.quiet:
            return out
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.numel()]
        if any(_ptr(t) in self.device for t in ins):
            self.mark_device(out)
            if func is aten._local_scalar_dense.default:
                self.count("HOST SYNC (.item / .tolist)")
            elif func not in _FREE:
                self.count(func.__name__ if hasattr(func, "__name__") else str(func))
            if os.environ.get("STEP_OPS_TRACE") and self.region == "step" and func not in _FREE:
                logger.warning("%s at\n%s", func, "".join(traceback.format_stack(limit=12)[:-2]))
        return out


def _engine_tensors(llm: Any) -> list[torch.Tensor]:
    """The engine's long-lived device tensors: weights, KV cache, the graph runner's buffers, backend state."""
    found: list[torch.Tensor] = list(llm.model.parameters()) + list(llm.model.buffers())

    def walk(obj: Any, depth: int) -> None:
        if depth > 3 or obj is None:
            return
        for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                found.extend(v for v in value if isinstance(v, torch.Tensor))
            elif isinstance(value, dict):
                found.extend(v for v in value.values() if isinstance(v, torch.Tensor))
            elif type(value).__module__.startswith("compile_attn") and not callable(value):
                walk(value, depth + 1)

    for root in (llm.kv_cache, llm.backend, llm.step_runner.runner.buffers):
        walk(root, 0)
    if llm.penalties is not None:
        walk(llm.penalties, 0)
    for step in llm._in_flight:
        found.append(step.tokens)
    return found


class _Region:
    """Runs ``inner``'s calls (and attribute reads) with the mode counting them under ``region``."""

    def __init__(self, mode: _StepOps, inner: Any, region: str) -> None:
        self._mode, self._inner, self._region = mode, inner, region

    def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        before, self._mode.region = self._mode.region, self._region
        try:
            return fn(*args, **kwargs)
        finally:
            self._mode.region = before

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self._inner, *args, **kwargs)

    def replay(self) -> Any:
        return self._run(self._inner.replay)

    def piecewise(self, *args: Any) -> Any:
        return self._run(self._inner.piecewise, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def count_step_ops(llm: Any, steps: int) -> dict[str, Counter[str]]:
    """Run ``steps`` calls of ``llm.step()`` and count the device ops each region issued (totals over the steps):
    ``"step"`` (outside the forward and the LM head: what this module is for) and the others of ``REGIONS``."""
    mode = _StepOps(_engine_tensors(llm))
    runner, step_runner = llm.step_runner.runner, llm.step_runner

    def uploading(fn: Any) -> Any:
        def wrapped(*args: Any) -> Any:
            mode.quiet = True
            try:
                out = fn(*args)
            finally:
                mode.quiet = False
            mode.count(H2D)
            mode.mark_device(out if out is not None else args[0])
            return out
        return wrapped

    def launching(fn: Any) -> Any:
        def wrapped(requests: Any, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tokens.numel():
                mode.count(D2H)
                if args and args[0] is not None or kwargs.get("logprobs") is not None:
                    mode.count(D2H)
            return fn(requests, tokens, *args, **kwargs)
        return wrapped

    def triton_launch(fn: Any) -> Any:
        def wrapped(kernel: Any, *args: Any, **kwargs: Any) -> Any:
            quiet, mode.quiet = mode.quiet, True  # the interpreter's own tensor copies are not the kernel's work
            try:
                return fn(kernel, *args, **kwargs)
            finally:
                mode.quiet = quiet
                if not quiet:
                    mode.count(f"triton:{kernel.__name__}")
        return wrapped

    graphs = {k: _Region(mode, g, "forward") for k, g in runner._graphs.items()}
    with contextlib.ExitStack() as stack:
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:
            pass
        else:
            stack.enter_context(_patched(InterpretedFunction, "run", triton_launch(InterpretedFunction.run)))
        stack.enter_context(_patched(host_tensors, "upload", uploading(host_tensors.upload)))
        stack.enter_context(_patched(host_tensors, "upload_into", uploading(host_tensors.upload_into)))
        stack.enter_context(_patched(step_sampling, "upload", uploading(step_sampling.upload)))
        stack.enter_context(_patched(in_flight.InFlightStep, "launch",
                                     staticmethod(launching(in_flight.InFlightStep.launch))))
        stack.enter_context(_patched(runner, "model_calls", _Region(mode, runner.model_calls, "forward")))
        stack.enter_context(_patched(runner, "_graphs", graphs))
        stack.enter_context(_patched(llm.backend, "init_forward_metadata_in_graph",
                                     _Region(mode, llm.backend.init_forward_metadata_in_graph, "metadata in graph")))
        if step_runner.compute_logits is not None:
            stack.enter_context(_patched(step_runner, "compute_logits",
                                         _Region(mode, step_runner.compute_logits, "lm_head")))
        with mode:
            for _ in range(steps):
                llm.step()
    return mode.ops


def steady_decode_ops(llm: Any, batch_size: int, steps: int = 4, prompt_len: int = 8) -> dict[str, Counter[str]]:
    """Device ops per steady decode step at ``batch_size`` (``count_step_ops`` over ``steps`` steps, divided):
    ``batch_size`` greedy requests are admitted and stepped until every one decodes, then counted, then aborted."""
    from compile_attn.batch import ForwardMode
    from compile_attn.engine import SamplingParams

    g = torch.Generator().manual_seed(batch_size)
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True)
    reqs = [llm.add_request(torch.randint(0, 64, (prompt_len,), generator=g).tolist(), params)
            for _ in range(batch_size)]
    while any(r.num_cached < len(r.prompt_ids) for r in reqs):
        llm.step()
    for _ in range(2):  # the first decode steps may still resolve the prefill's tokens
        llm.step()
    decodes = llm.steps_by_mode[ForwardMode.DECODE]
    ops = count_step_ops(llm, steps)
    if llm.steps_by_mode[ForwardMode.DECODE] - decodes != steps:
        raise AssertionError(f"expected {steps} decode steps, the engine ran {dict(llm.steps_by_mode)}")
    for r in reqs:
        llm.abort_request(r)
    while llm.has_work():
        llm.step()
    per_step = {}
    for region, counts in ops.items():
        if any(n % steps for n in counts.values()):
            raise AssertionError(f"{region} ops differ between steady steps: {dict(counts)} over {steps} steps")
        per_step[region] = Counter({k: n // steps for k, n in counts.items()})
    return per_step
