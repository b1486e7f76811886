"""KV cache sizing: the formulas of engine/execution/kv_sizing.py checked against numbers worked out by hand from their
docstrings, the bytes per token against a real KVCache's pool, the errors for caches too small for one request,
and LLM's CPU default (``max_batch_size * max_context``)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.hf.hf_tiny_models import tiny_config  # noqa: E402

from compile_attn.engine import LLM  # noqa: E402
from compile_attn.engine.requests.config import check_memory_utilization  # noqa: E402
from compile_attn.engine.execution.kv_sizing import (  # noqa: E402
    kv_bytes_per_token,
    size_for_host_memory,
    size_from_device_memory,
)
from compile_attn.engine.execution.memory_profile import profile_batch, profile_forward, profile_lengths  # noqa: E402
from compile_attn.errors import CompileAttnError, InvalidConfigError, KVCacheTooSmallError  # noqa: E402
from compile_attn.kv.cache import KVCache  # noqa: E402
from compile_attn.layer import AttentionLayer  # noqa: E402
from compile_attn.models import ToyDecoder, ToyDecoderConfig  # noqa: E402

GiB = 2**30


def test_llama_1b_shape_on_an_80_gib_device() -> None:
    # 0.9 x 80 GiB = 72 GiB allowed; 3 GiB in use, 1 GiB activations, 2 GiB graphs: 66 GiB for the pool.
    # Llama-3.2-1B bf16: 16 layers x 8 KV heads x (64 + 64) x 2 bytes = 32 KiB per token; pages of 16 tokens =
    # 512 KiB, so 66 GiB = 66 x 2048 = 135,168 pages, one of them the scratch page: 135,167 x 16 tokens.
    sizing = size_from_device_memory(
        total_bytes=80 * GiB, free_bytes=77 * GiB, peak_activation_bytes=1 * GiB, graph_reserve_bytes=2 * GiB,
        utilization=0.9, bytes_per_token=32768, page_size=16, max_context=131072, max_batch_size=256,
    )
    assert sizing.kv_cache_tokens == 2_162_672
    assert not sizing.capped_by_requests
    assert sizing.kv_bytes == 66 * GiB  # scratch page included: exactly the budget
    assert math.floor(sizing.max_context_requests) == 16  # 2,162,672 / 131,072 = 16.5


def test_pages_round_down_and_the_scratch_page_is_counted() -> None:
    # limit 0.5 x 10,000,000 = 5,000,000; used 1,000,000; budget 5,000,000 - 1,000,000 - 500,000 - 250,000 =
    # 3,250,000 bytes; a page of 16 tokens x 1,000 B = 16,000 B: 203 whole pages, less the scratch page = 202
    # pages = 3,232 tokens (the most 8 requests of 1,000 tokens can hold is 8 x 63 pages x 16 = 8,064).
    sizing = size_from_device_memory(
        total_bytes=10_000_000, free_bytes=9_000_000, peak_activation_bytes=500_000, graph_reserve_bytes=250_000,
        utilization=0.5, bytes_per_token=1000, page_size=16, max_context=1000, max_batch_size=8,
    )
    assert (sizing.kv_cache_tokens, sizing.kv_budget_bytes, sizing.limit_bytes) == (3232, 3_250_000, 5_000_000)


def test_capped_at_what_max_batch_size_requests_can_hold() -> None:
    # 4 requests of max_context 1,000 in pages of 16: 4 x 63 x 16 = 4,032 tokens, far below what memory allows.
    sizing = size_from_device_memory(
        total_bytes=80 * GiB, free_bytes=79 * GiB, peak_activation_bytes=GiB, graph_reserve_bytes=GiB,
        utilization=0.9, bytes_per_token=32768, page_size=16, max_context=1000, max_batch_size=4,
    )
    assert sizing.kv_cache_tokens == 4032 and sizing.capped_by_requests


def test_the_pool_that_results_stays_within_the_budget() -> None:
    """A real KVCache built with the tokens chosen: its pool (the allocator's own count of bytes) fits the budget,
    and one more page would not."""
    layers = [AttentionLayer(layer_id=i, num_heads=4, num_kv_heads=2, head_dim=16) for i in range(3)]
    per_token = kv_bytes_per_token(layers, torch.float32)
    assert per_token == 3 * 2 * (16 + 16) * 4  # layers x KV heads x (K + V dims) x fp32 bytes
    for page_size in (1, 4, 16):
        sizing = size_from_device_memory(
            total_bytes=4_000_000, free_bytes=3_600_000, peak_activation_bytes=123_457,
            graph_reserve_bytes=54_321, utilization=0.75, bytes_per_token=per_token, page_size=page_size,
            max_context=64, max_batch_size=1000,
        )
        kv = KVCache(num_layers=3, num_kv_heads=2, head_dim=16, max_batch_size=2, max_context=64,
                     kv_cache_tokens=sizing.kv_cache_tokens, page_size=page_size, dtype=torch.float32)
        assert kv.pool.bytes == sizing.kv_bytes
        assert kv.pool.bytes <= sizing.kv_budget_bytes < kv.pool.bytes + page_size * per_token


@pytest.mark.parametrize("free_gib", [10.5, 5.0])  # 72 - 69.5 - 2 = 0.5 GiB for the pool; 72 - 75 - 2 < 0
def test_too_small_for_one_request_is_a_named_error(free_gib: float) -> None:
    with pytest.raises(KVCacheTooSmallError) as info:
        size_from_device_memory(
            total_bytes=80 * GiB, free_bytes=int(free_gib * GiB), peak_activation_bytes=GiB,
            graph_reserve_bytes=GiB, utilization=0.9, bytes_per_token=32768, page_size=16, max_context=131072,
            max_batch_size=32,
        )
    message = str(info.value)
    assert "131,072" in message and "0.9" in message and "80.00 GiB" in message
    for way_out in ("lower max_context", "raise gpu_memory_utilization", "pass kv_cache_tokens"):
        assert way_out in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, CompileAttnError)


def test_one_request_exactly_is_enough() -> None:
    # budget for 2 pages of 64 tokens x 100 B = 12,800 B: one page for the scratch page, one for the request
    sizing = size_from_device_memory(
        total_bytes=100_000, free_bytes=100_000, peak_activation_bytes=0, graph_reserve_bytes=87_200,
        utilization=1.0, bytes_per_token=100, page_size=64, max_context=64, max_batch_size=8,
    )
    assert sizing.kv_cache_tokens == 64
    with pytest.raises(KVCacheTooSmallError):
        size_from_device_memory(
            total_bytes=100_000, free_bytes=100_000, peak_activation_bytes=0, graph_reserve_bytes=87_201,
            utilization=1.0, bytes_per_token=100, page_size=64, max_context=64, max_batch_size=8,
        )


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.01, float("nan"), True, "0.9", None])
def test_utilization_out_of_range(bad: object) -> None:
    with pytest.raises(InvalidConfigError, match="gpu_memory_utilization must be a number in"):
        check_memory_utilization(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gpu_memory_utilization"):  # before any model is loaded
        LLM(object(), gpu_memory_utilization=bad)  # type: ignore[arg-type]


def test_host_cap() -> None:
    # no cap reached: 4 requests x 128 tokens = 512 tokens; 0.25 x 1 GiB would allow ~524k at 512 B per token
    uncapped = size_for_host_memory(available_bytes=GiB, bytes_per_token=512, page_size=1, max_context=128,
                                    max_batch_size=4)
    assert uncapped.kv_cache_tokens == 512 and uncapped.capped_by_requests
    # 0.25 x 1,000,000 = 250,000 B; 250,000 // 512 = 488 pages of one token, less the scratch page: 487 tokens
    capped = size_for_host_memory(available_bytes=1_000_000, bytes_per_token=512, page_size=1, max_context=128,
                                  max_batch_size=32)
    assert capped.kv_cache_tokens == 487 and not capped.capped_by_requests
    assert size_for_host_memory(available_bytes=None, bytes_per_token=512, page_size=4, max_context=10,
                                max_batch_size=3).kv_cache_tokens == 36  # 3 x 3 pages of 4: no host figure, no cap
    with pytest.raises(KVCacheTooSmallError, match="lower max_context, or pass kv_cache_tokens"):
        size_for_host_memory(available_bytes=1_000_000, bytes_per_token=512, page_size=1, max_context=1000,
                             max_batch_size=32)


def test_llm_cpu_default_and_explicit_tokens() -> None:
    config = tiny_config("llama")  # max_position_embeddings 128, 2 layers x 2 KV heads x 16 dims
    llm = LLM(config, attn_backend="torch_native", graph_mode="none", compile=False, max_batch_size=4,
              max_num_tokens=32, capture=False, device="cpu")
    assert llm.kv_cache.allocator.num_pages == 4 * 128
    paged = LLM(config, attn_backend="torch_native", graph_mode="none", compile=False, max_batch_size=3,
                max_num_tokens=32, max_context=100, page_size=16, capture=False, device="cpu")
    assert paged.kv_cache.allocator.num_pages * 16 == 3 * 112  # each request rounded up to 7 pages of 16
    explicit = LLM(config, attn_backend="torch_native", graph_mode="none", compile=False, max_batch_size=4,
                   max_num_tokens=32, kv_cache_tokens=40, capture=False, device="cpu")
    assert explicit.kv_cache.allocator.num_pages == 40  # fewer than max_context 128: an explicit size wins


def test_profile_step_runs_the_engine_model() -> None:
    """The profile batch on the CPU: max_num_tokens tokens in requests of at most max_context, at most
    max_batch_size of them, through the model, LM head and sampler."""
    assert profile_lengths(100, 64, 8) == [64, 36]
    assert profile_lengths(100, 16, 3) == [16, 16, 16]
    assert profile_lengths(8, 64, 8) == [8]
    model = ToyDecoder(ToyDecoderConfig(vocab_size=50))
    layers = model.attention_layers()
    with profile_batch(layers, attn_backend="torch_native", max_batch_size=4, max_num_tokens=40, max_context=16,
                       page_size=4, dtype=torch.float32, device=torch.device("cpu"), graphs=True) as (kv, _, fb):
        assert fb.extend_seq_lens_cpu == [16, 16, 8] and kv.req_to_token.shape == (5, 16)
        ids = profile_forward(model, _, fb, num_rows=4)
    assert ids.shape == (4,) and ids.dtype == torch.int64 and bool(((ids >= 0) & (ids < 50)).all())
