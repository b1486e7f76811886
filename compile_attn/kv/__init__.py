"""The KV cache: the request table and paged K/V pool (``pools``), the page allocator, ``KVCache`` tying them with
each row's pages (``cache``), the batch checks, the prefix cache over a radix tree, the page account, and the
shared-prefix groups of decode batches.

Above the base (``batch``, ``errors``, ``host_tensors``) and below the attention backends: nothing here imports a
backend, the graph runner or the engine. Import from the modules; this package re-exports nothing.
"""
