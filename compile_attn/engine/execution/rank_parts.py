"""What every rank of an engine builds the same way: its KV cache's size before the ranks agree on one, its KV
cache (with an fp8 pool's scales) and its attention backend and step runner. ``LLM._build`` (rank 0, or the only
rank) and a tensor-parallel worker (engine/tensor_parallel/worker.py) both call these, so the ranks cannot drift
apart in what they store or capture.
"""

from __future__ import annotations

from typing import Any

from compile_attn.attention import create_backend
from compile_attn.attention.base import AttentionBackend
from compile_attn.engine.execution.memory_profile import size_kv_cache
from compile_attn.engine.execution.model_loading import LoadedModel
from compile_attn.engine.execution.speculative.setup import decode_graph_rows
from compile_attn.engine.execution.step_runner import StepRunner
from compile_attn.engine.requests.config import EngineConfig
from compile_attn.kv.cache import KVCache
from compile_attn.kv.kv_scales import setup_kv_scales


def setup_all_reduce(model: Any, config: EngineConfig, device: Any) -> bool:
    """With tensor parallelism on GPUs, map FlashInfer's all-reduce buffers for this model's messages (the
    row-parallel layers' width, up to ``max_num_tokens`` or 2,048 tokens): collective, every rank at the same point,
    after loading and before KV sizing (distributed/lamport_all_reduce.py). False where NCCL carries every message
    (one rank, ``disable_custom_all_reduce``, or a rank that cannot run the kernel)."""
    from compile_attn.distributed.lamport_all_reduce import DEFAULT_MAX_TOKENS, setup_lamport_all_reduce
    from compile_attn.distributed.linear import RowParallelLinear
    from compile_attn.distributed.state import tp_state

    state = tp_state()
    if state.world_size == 1 or config.disable_custom_all_reduce:
        return False
    widths = {m.out_features for m in model.modules() if isinstance(m, RowParallelLinear)}
    if len(widths) != 1:  # the same on every rank: the same model
        return False
    return setup_lamport_all_reduce(state.group, state.group_name, state.rank, state.world_size, widths.pop(),
                                    min(config.max_num_tokens, DEFAULT_MAX_TOKENS), config.dtype, device)


def rank_kv_tokens(model: Any, layers: list[Any], config: EngineConfig, max_context: int) -> tuple[int, bool]:
    """``(tokens, sized)``: the KV tokens this rank can hold, ``config.kv_cache_tokens`` when set, else what memory
    sizing gives (``size_kv_cache``, sized=True). Rank 0 then gives a draft model its share of a sized cache (the
    draft runs on rank 0 alone), and the ranks allocate the smallest count of them all."""
    if config.kv_cache_tokens:
        return config.kv_cache_tokens, False
    return size_kv_cache(model, layers, config, max_context).kv_cache_tokens, True


def build_kv_cache(cache_type: type[KVCache], layers: list[Any], loaded: LoadedModel, config: EngineConfig,
                   max_context: int, kv_cache_tokens: int, device: Any) -> KVCache:
    """A ``cache_type`` of ``kv_cache_tokens`` for ``layers``; an fp8 pool gets its scales from
    ``config.kv_scales_path``, else the checkpoint, else the first prefill (kv/kv_scales.py), for the KV heads this
    rank holds (``loaded.kv_heads``)."""
    kv_cache = cache_type.for_layers(layers, max_batch_size=config.max_batch_size, max_context=max_context,
                                     kv_cache_tokens=kv_cache_tokens, page_size=config.page_size,
                                     dtype=config.kv_dtype, device=device)
    setup_kv_scales(kv_cache.pool, checkpoint_dir=loaded.checkpoint_dir, scales_path=config.kv_scales_path,
                    kv_heads=loaded.kv_heads)
    return kv_cache


def build_step_runner(model: Any, layers: list[Any], kv_cache: KVCache,
                      config: EngineConfig) -> tuple[AttentionBackend, StepRunner]:
    """The attention backend over ``kv_cache`` and the step runner of ``model`` with the engine's graph and compile
    options. With speculative decoding the backend stores a step's KV before attending (chain verify steps replay
    the decode graphs, whose rows of one request would otherwise race for each other's slots) and the decode
    graphs take a verify step's rows (``decode_graph_rows``)."""
    backend = create_backend(config.attn_backend, kv_cache, layers)
    if config.speculative_config is not None:
        backend.store_decode_kv_first()
    rows, compile_options = decode_graph_rows(config)
    runner = StepRunner(model, backend, graph_mode=config.graph_mode, compile=config.compile,
                        compile_options=compile_options, max_batch_size=rows, max_num_tokens=config.max_num_tokens)
    return backend, runner
