"""The benchmark commands and their workloads: ``compile-attn bench`` (``decode_step``, ``engine_start``),
``throughput`` (``throughput``, ``throughput_cli``, ``workloads``, ``hf_batch``) and ``bench-serve`` (``serving``,
``serving_cli``, ``serving_targets``, ``load_client``), with ``run_info`` recording what each run ran on.

An application on top of the library: it may import the engine and the server; nothing in the library or the
server imports it. Import from the modules; this package re-exports nothing.
"""
