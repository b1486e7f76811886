"""The triton backend: ``backend.py`` (the registered backend), ``metadata.py`` (its decode and extend metadata and
static buffers), ``prepare.py`` (where the buffers live, extend preparation), ``launch.py`` (one layer's kernel
launches), ``cascade.py`` (the shared-prefix decode path), ``verify_mode.py`` (chain verify steps in decode's
kernel). The kernels it launches are compile_attn's own, in ``attention/kernels`` (shared with the flashinfer
backend). Nothing here imports triton at import time, and no other backend is imported.
"""
