"""The flashinfer backend: ``backend.py`` (the registered backend) and its pieces.

``library`` imports flashinfer on demand, ``plan_groups`` groups layers that share one plan per step,
``paged_indices`` builds FlashInfer's page-level CSR from ``req_to_token``, ``wrappers`` owns the
eager plan/run wrappers, ``planner`` plans eager steps over them, ``graph_state`` the CUDA-graph decode
wrappers and their static buffers, and ``warmup`` builds the JIT kernels up front, ``cascade`` runs the
shared-prefix decode. Nothing here imports
flashinfer at module import time, and no other backend is imported (the page-id gather is a kernel of
``attention/kernels``, loaded through ``attention/kernel_loader``).
"""
