"""Host-side tensor building for per-step metadata: Python int lists to tensors, and ragged index math.

A prefill step of thousands of tokens turns thousands of Python ints into tensors before the GPU has
anything to do, so this is on the critical path of every step. ``torch.tensor(list)`` converts element by
element; going through ``array.array`` (one C loop) is several times faster. The ragged helpers replace
per-token Python loops with a few NumPy ops on the host (a list comprehension for few tokens, where NumPy's
per-call cost is larger), whose results go to the device in the step's one
upload (``to_device_groups``: every dtype in one copy). Not torch ops: on the CPU ``torch.repeat_interleave``
splits even an 8-row input over every OpenMP thread (costly on a many-core host), and on the device each op is a
kernel launch that the GPU waits for at the step's start (docs/performance.md).
"""

from __future__ import annotations

import array
import operator
from collections.abc import Sequence

import numpy as np
import torch

from compile_attn.errors import InvalidBatchError

_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A CPU tensor of the Python ints ``values`` (int64 or int32); OverflowError names a value that does not fit."""
    code = _TYPECODES.get(dtype)
    if code is None:
        raise TypeError(f"int_tensor builds int64 or int32 tensors, got dtype {dtype}")
    if len(values) == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(code, values), dtype=dtype)


# Up to this many tokens the ragged helpers build a list by a comprehension: NumPy's per-call cost (a verify step of
# 1 + K tokens per request at small batches) is larger than the loop's. Lists and int64 arrays both go to the
# device through ``to_device`` / ``to_device_groups``.
SMALL_TOKENS = 256


def _run_lengths(lens: Sequence[int] | np.ndarray, caller: str) -> np.ndarray:
    """``lens`` as int64; ValueError (naming ``caller`` and the lengths) if one is negative."""
    lens = np.asarray(lens, dtype=np.int64)
    if lens.size and lens.min() < 0:
        raise ValueError(f"{caller} needs non-negative run lengths, got {lens.tolist()}")
    return lens


def _small_runs(firsts: Sequence[int] | np.ndarray, lens: Sequence[int] | np.ndarray, caller: str) -> bool:
    """Whether ``firsts`` and ``lens`` are lists (or tuples) whose runs total at most ``SMALL_TOKENS`` tokens;
    ValueError (naming ``caller`` and the lengths) if such a length is negative."""
    if not isinstance(lens, (list, tuple)) or not isinstance(firsts, (list, tuple)) or sum(lens) > SMALL_TOKENS:
        return False
    if lens and min(lens) < 0:
        raise ValueError(f"{caller} needs non-negative run lengths, got {list(lens)}")
    return True


def ragged_arange(starts: Sequence[int] | np.ndarray, lens: Sequence[int] | np.ndarray) -> list[int] | np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lens)])`` on the host: a list of ints where
    ``starts`` and ``lens`` are lists of at most ``SMALL_TOKENS`` tokens in all, else an int64 array (no Python
    loop)."""
    if _small_runs(starts, lens, "ragged_arange"):
        return [s + j for s, n in zip(starts, lens) for j in range(n)]
    lens = _run_lengths(lens, "ragged_arange")
    offsets = np.cumsum(lens) - lens  # where each run begins in the output
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lens)


def repeat_each(values: Sequence[int] | np.ndarray, lens: Sequence[int] | np.ndarray) -> list[int] | np.ndarray:
    """``values[i]`` repeated ``lens[i]`` times, runs concatenated, on the host: a list of ints where ``values`` and
    ``lens`` are lists of at most ``SMALL_TOKENS`` tokens in all, else an int64 array."""
    if _small_runs(values, lens, "repeat_each"):
        return [v for v, n in zip(values, lens) for _ in range(n)]
    return np.repeat(np.asarray(values, dtype=np.int64), _run_lengths(lens, "repeat_each"))


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU through pinned memory, so the host does not wait for the copy.

    A copy from pageable memory returns only once the data is staged, which waits for the GPU's queue as
    well. The pinned buffer goes back to torch's caching host allocator only after the copy has run.
    """
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def upload_into(dst: torch.Tensor, t: torch.Tensor) -> None:
    """Copy the host tensor ``t`` into ``dst`` (e.g. a static buffer), on a GPU as one host-to-device copy through
    pinned memory that the host does not wait for (see ``upload``)."""
    if dst.is_cuda:
        dst.copy_(t.pin_memory(), non_blocking=True)
    else:
        dst.copy_(t)


def to_device(
    parts: list[torch.Tensor | np.ndarray | array.array | Sequence[int]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """``parts`` (int lists, ``array.array``s, NumPy arrays or tensors) as ``dtype`` tensors on ``device``: the
    host ones through a single copy.

    Host parts are packed into one ``array.array`` (lists in one C loop each, arrays and CPU tensors as bytes)
    and go in one copy per call, through pinned memory (see ``upload``): at small batches the number of torch
    ops is the cost, so no per-part tensors are made. Arrays and tensors keep their shape (a 0-d one becomes one
    entry). A value that does not fit ``dtype`` raises OverflowError. ``to_device_groups`` sends parts of several
    dtypes in one copy.
    """
    return to_device_groups([(parts, dtype)], device)[0]


def to_device_groups(
    groups: Sequence[tuple[list[torch.Tensor | np.ndarray | array.array | Sequence[int]], torch.dtype]],
    device: torch.device,
) -> list[list[torch.Tensor]]:
    """``to_device`` of each ``(parts, dtype)`` group, all host parts in one host-to-device copy (a step's int32 and
    int64 fields: one copy instead of one per dtype).

    The groups are packed as bytes into one int64 buffer, each group starting at a whole int64 entry; an int64
    group's tensors are plain views of the uploaded buffer, like ``to_device``'s (torch.compile sees the same kind
    of input: a dtype-changing view as a model input makes Dynamo compile again), an int32 group's a dtype view.
    """
    outs: list[list[torch.Tensor | None]] = []
    packed: list[tuple[array.array, list[tuple[int, int, tuple[int, ...] | None]]]] = []
    for parts, dtype in groups:
        out, buf, host = _pack(parts, dtype, device)
        outs.append(out)
        packed.append((buf, host))
    if not any(host for _, host in packed):
        return outs  # type: ignore[return-value]
    if len(groups) == 1:  # no byte packing needed
        (buf, host), dtype = packed[0], groups[0][1]
        flat = upload(torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype), device)
        _unpack(flat, host, outs[0])
        return outs  # type: ignore[return-value]
    raw = bytearray()
    spans = []  # per group: its int64 entries
    for buf, _ in packed:
        start = len(raw)
        raw.extend(buf.tobytes())
        raw.extend(bytes(-len(raw) % 8))
        spans.append((len(raw) - start) // 8)
    flat = upload(torch.frombuffer(raw, dtype=torch.int64) if raw else torch.empty(0, dtype=torch.int64), device)
    # Views by split_with_sizes (one C call each), not by slicing: at small batches each torch call is the cost.
    for (_, host), (_, dtype), out, words in zip(packed, groups, outs, flat.split_with_sizes(spans)):
        if host:
            _unpack(words if dtype == torch.int64 else words.view(dtype), host, out)
    return outs  # type: ignore[return-value]


def _pack(parts: list, dtype: torch.dtype, device: torch.device,
          ) -> tuple[list[torch.Tensor | None], array.array, list[tuple[int, int, tuple[int, ...] | None]]]:
    """(outputs with device parts filled in, the host parts packed, per host part: its index, entries and the
    shape to restore)."""
    code = _TYPECODES.get(dtype)
    if code is None:
        raise TypeError(f"to_device packs int64 or int32 values, got dtype {dtype}")
    np_dtype = np.dtype(code)
    out: list[torch.Tensor | None] = [None] * len(parts)
    buf = array.array(code)
    host: list[tuple[int, int, tuple[int, ...] | None]] = []
    for i, x in enumerate(parts):
        if isinstance(x, torch.Tensor):
            if not x.is_cpu:
                out[i] = x.to(device=device, dtype=dtype)
                continue
            x = x.detach().numpy()
        elif isinstance(x, array.array) and x.typecode != code:
            x = np.frombuffer(x, dtype=np.dtype(x.typecode)) if len(x) else np.empty(0, dtype=np_dtype)
        if isinstance(x, np.ndarray):
            arr = _fitting(x.reshape(1) if x.ndim == 0 else x, np_dtype)
            buf.frombytes(arr.tobytes())
            host.append((i, arr.size, arr.shape))
        else:
            n = len(buf)
            buf.extend(x)  # an array.array of the same type: a memory copy
            host.append((i, len(buf) - n, None))
    return out, buf, host


def _unpack(flat: torch.Tensor, host: list[tuple[int, int, tuple[int, ...] | None]],
            out: list[torch.Tensor | None]) -> None:
    """Fill ``out``'s host parts with views of the uploaded ``flat`` (which may end in padding entries)."""
    sizes = [n for _, n, _ in host]
    rest = flat.numel() - sum(sizes)
    pieces = flat.split_with_sizes(sizes + [rest] if rest else sizes)  # the C method: Tensor.split adds a layer
    for (i, _, shape), piece in zip(host, pieces):
        out[i] = piece if shape is None else piece.view(shape)


def _fitting(arr: np.ndarray, np_dtype: np.dtype) -> np.ndarray:
    """``arr`` as a contiguous ``np_dtype`` array; OverflowError (naming the value) where a value would wrap."""
    if arr.dtype != np_dtype and arr.size:
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"to_device packs integers, got an array of {arr.dtype}")
        info = np.iinfo(np_dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise OverflowError(f"value {bad} does not fit {np_dtype}")
    return np.ascontiguousarray(arr, dtype=np_dtype)


# ------------------------------------------------------------------ host lists given to ForwardBatch.build
def int_list(name: str, values: Sequence[int]) -> list[int]:
    """``values`` as a list of Python ints; InvalidBatchError for a float, None or other non-integer entry."""
    if type(values) in (list, tuple):  # one C loop for the usual int64 values (``__index__``, as operator.index)
        try:
            return array.array("q", values).tolist()
        except (TypeError, OverflowError):
            pass  # the entry-by-entry path: Python ints past int64 pass here, their upload refuses them by name
    try:
        return [operator.index(x) for x in values]
    except TypeError:
        try:
            shown = repr(next(x for x in values if not hasattr(x, "__index__")))
        except (TypeError, StopIteration):
            shown = f"{type(values).__name__} {values!r}"
        raise InvalidBatchError(f"{name} must be a sequence of ints, got {shown}") from None


def num_entries(name: str, value: object) -> int:
    """Entries of a per-token field given as a 1-D integer tensor, array or sequence; InvalidBatchError otherwise."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and not (
        dtype.kind in "iu" if isinstance(dtype, np.dtype) else
        (dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))
    ):
        raise InvalidBatchError(f"{name} must hold integers, got dtype {dtype}")
    if getattr(value, "ndim", 1) != 1:
        raise InvalidBatchError(f"{name} must be 1-D (one entry per token), got shape {tuple(value.shape)}")
    try:
        return int(value.shape[0]) if hasattr(value, "shape") else len(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidBatchError(f"{name} must be a 1-D tensor, array or sequence of ints, got {value!r}") from None


def short_list(values: list[int], limit: int = 8) -> str:
    """A list for an error message, cut after ``limit`` entries."""
    return str(values) if len(values) <= limit else f"[{', '.join(map(str, values[:limit]))}, ... ({len(values)})]"
