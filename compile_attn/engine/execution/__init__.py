"""Model execution: one engine step on the device. The step runner over the graph runner, the in-flight step and
its token feed, the step's extras (logprobs, penalties), sampling (``sampling/``: the step's sampling half, the
sampler and its kernels), KV sizing from free memory and the memory profile, and model loading.

Reads requests (``engine/requests``) and never schedules them; imports nothing of ``engine/serving``.
"""
