"""Triton backend tests run the kernels on CPU tensors under the Triton interpreter when no GPU exists.

TRITON_INTERPRET is read when a kernel is decorated, so it must be set before the kernel modules are
imported; if something imported them earlier in compiled mode, they are reloaded here.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

    _MODULES = (
        "compile_attn.attention.triton_ops._common",
        "compile_attn.attention.triton_ops.kv_index",
        "compile_attn.attention.triton_ops.decode_attention",
        "compile_attn.attention.triton_ops.extend_attention",
        "compile_attn.attention.triton_ops",
    )
    _kv_index = sys.modules.get("compile_attn.attention.triton_ops.kv_index")
    if _kv_index is not None and type(_kv_index._store_kv_kernel).__name__ != "InterpretedFunction":
        for _name in _MODULES:
            if _name in sys.modules:
                importlib.reload(sys.modules[_name])
