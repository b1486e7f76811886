"""Tensor parallelism in the engine: rank 0 (the ``LLM`` process) schedules and samples, and one worker process per
other rank runs the same forward on its shard of the model (docs/tensor_parallel.md).

``engine_group`` (rank 0: starts, feeds and stops the workers), ``worker`` (the other ranks' step loop, also the
entry point of an external launch), ``loading`` (each rank's shard from a checkpoint directory). Imported only when
``tensor_parallel_size`` > 1.
"""
