"""The request lifecycle: a request and its sampling parameters, admission checks, stop strings, chat templates,
the engine's options (``EngineConfig``) and errors, and the continuous-batching scheduler.

The lowest layer of the engine: nothing here runs a model or touches a device (the scheduler only asks the KV
cache for rows and pages); it imports nothing of ``engine/execution`` or ``engine/serving``.
"""
