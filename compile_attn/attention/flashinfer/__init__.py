"""Pieces of the FlashInfer attention backend (the backend itself is ``attention/flashinfer_backend.py``).

``library`` imports flashinfer on demand, ``plan_groups`` groups layers that share one plan per step,
``paged_indices`` builds FlashInfer's page-level CSR from ``req_to_token``, ``wrappers`` owns the
eager plan/run wrappers, ``graph_state`` the CUDA-graph decode wrappers and their static buffers, and
``warmup`` builds the JIT kernels up front. Nothing here imports flashinfer at module import time.
"""
