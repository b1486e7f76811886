"""torch.library custom ops (attention, the one-row linear) and the split-op registry the compiler and runner cut at."""

from compile_attn.ops.attention import attention
from compile_attn.ops.gemv import gemv
from compile_attn.ops.split_registry import (
    is_split_op,
    op_name,
    register_split_op,
    split_op_names,
    unregister_split_op,
)

__all__ = ["attention", "gemv", "is_split_op", "op_name", "register_split_op", "split_op_names", "unregister_split_op"]
