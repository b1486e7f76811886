"""Host-side tensor building for per-step metadata: Python int lists to tensors, and ragged index math.

A prefill step of thousands of tokens turns thousands of Python ints into tensors before the GPU has
anything to do, so this is on the critical path of every step. ``torch.tensor(list)`` converts element by
element (~70 ns each); going through ``array.array`` (one C loop) is about 4x faster. The ragged helpers
replace per-token Python loops with a few vectorised ops; callers run them on the device, after one small
copy of the per-request values: on the CPU, ``torch.repeat_interleave`` splits even an 8-row input over every
OpenMP thread, which cost ~5 ms per call on a 16-core GPU host.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from itertools import chain

import torch

_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A CPU tensor of the Python ints ``values`` (int64 or int32); OverflowError names a value that does not fit."""
    code = _TYPECODES.get(dtype)
    if code is None:
        raise TypeError(f"int_tensor builds int64 or int32 tensors, got dtype {dtype}")
    if len(values) == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(code, values), dtype=dtype)


def ragged_arange(starts: torch.Tensor, lens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lens)])`` without a Python loop, int64 on ``starts``' device.

    ``total`` is ``sum(lens)``; pass it when the caller knows it, so a device tensor is not read back.
    """
    starts, lens = starts.to(torch.int64), lens.to(torch.int64)
    total = int(lens.sum()) if total is None else total
    if total == 0:
        return torch.empty(0, dtype=torch.int64, device=starts.device)
    offsets = torch.cumsum(lens, 0) - lens  # where each run begins in the output
    return (torch.arange(total, dtype=torch.int64, device=starts.device)
            + torch.repeat_interleave(starts - offsets, lens, output_size=total))


def repeat_each(values: torch.Tensor, lens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``values[i]`` repeated ``lens[i]`` times, runs concatenated (int64, on ``values``' device; ``total`` as above)."""
    lens = lens.to(torch.int64)
    total = int(lens.sum()) if total is None else total
    return torch.repeat_interleave(values.to(torch.int64), lens, output_size=total)


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU through pinned memory, so the host does not wait for the copy.

    A copy from pageable memory returns only once the data is staged, which waits for the GPU's queue as
    well. The pinned buffer goes back to torch's caching host allocator only after the copy has run.
    """
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_device(parts: list[torch.Tensor | Sequence[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """``parts`` (int lists or tensors) as ``dtype`` tensors on ``device``: the host ones through a single copy.

    Host parts go in one copy per call (per dtype per step), through pinned memory (see ``upload``). When
    every host part is an int list (the engine's case), they become one tensor directly, with no per-part
    tensors to concatenate: at small batches the torch op count is the cost.
    """
    out: list[torch.Tensor | None] = [None] * len(parts)
    host: list[int] = []
    lists_only = True
    for i, x in enumerate(parts):
        if isinstance(x, torch.Tensor):
            if not x.is_cpu:
                out[i] = x.to(device=device, dtype=dtype)
                continue
            lists_only = False
        host.append(i)
    if not host:
        return out  # type: ignore[return-value]
    if lists_only:
        sizes = [len(parts[i]) for i in host]
        flat = upload(int_tensor(list(chain.from_iterable(parts[i] for i in host)), dtype), device)
        pieces = flat.split_with_sizes(sizes)  # the C method: Tensor.split adds a Python layer
        for i, piece in zip(host, pieces):
            out[i] = piece
        return out  # type: ignore[return-value]
    tensors = [parts[i].to(dtype) if isinstance(parts[i], torch.Tensor) else int_tensor(list(parts[i]), dtype)
               for i in host]
    tensors = [t.reshape(1) if t.dim() == 0 else t for t in tensors]  # a scalar tensor becomes one entry
    flat = upload(torch.cat([t.reshape(-1) for t in tensors]), device)
    for i, t, piece in zip(host, tensors, flat.split_with_sizes([t.numel() for t in tensors])):
        out[i] = piece.view(t.shape)
    return out  # type: ignore[return-value]
