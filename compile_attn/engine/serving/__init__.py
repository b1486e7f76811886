"""Async serving: ``AsyncLLM`` (one LLM's step loop in its own thread, streaming to asyncio consumers), the pipe to
a front end in another process (``engine_pipe``), incremental detokenisation and the loop's statistics.

The top layer of the engine, under the HTTP server: it drives ``LLM`` and never reaches into a step.
"""
