"""How this process launches its Triton kernels: interpreted on CPU tensors (``TRITON_INTERPRET=1``, the CPU
tests) or compiled for a GPU, and whether a GPU takes programmatic dependent launches (PDL).

Shared by every Triton kernel of the library (the attention kernels, the graph runner's step kernels and the ops'
own). ``launch`` is the one way a kernel is started outside ``CachedLaunch``'s cached path.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import torch

from compile_attn.env import pdl_turned_off


def is_interpreted(kernel) -> bool:  # noqa: ANN001 - a triton.jit function or its interpreted stand-in
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


# Triton's interpreter patches ``triton.language`` and keeps the current program's index in module state for the
# length of a launch, process-wide: two threads inside interpreted kernels at once break each other ("Did you forget
# to add @triton.jit?"). Interpreted launches therefore run one at a time; compiled ones never take the lock.
_INTERPRETER_LOCK = threading.RLock()


def launch(kernel: Any, grid: Sequence[int], *args: Any, **kwargs: Any) -> Any:
    """``kernel[grid](*args, **kwargs)``, one interpreted launch at a time across threads (``is_interpreted``)."""
    if is_interpreted(kernel):
        with _INTERPRETER_LOCK:
            return kernel[grid](*args, **kwargs)
    return kernel[grid](*args, **kwargs)


@functools.lru_cache(maxsize=None)
def pdl_supported(device_index: int) -> bool:
    """Whether kernels on CUDA device ``device_index`` launch as programmatic dependent launches: NVIDIA compute
    capability 9.0 or newer (the ``griddepcontrol`` instructions), unless ``COMPILE_ATTN_PDL=0`` turns it off
    (read once per process)."""
    if pdl_turned_off():
        return False
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9
