"""The fa3 backend (``backend.py``): FlashAttention-3 through sglang-kernel's paged kernels, reading a page table
built from the request table. Nothing here imports sgl_kernel at import time, and no other backend is imported.
"""
