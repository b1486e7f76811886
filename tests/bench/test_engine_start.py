"""The engine benchmark runs cold and warm starts in fresh processes on a tiny model; its FLOP count matches
a count made layer by layer from the model's own weight shapes."""

from __future__ import annotations

import torch

from compile_attn.bench import decode_step as bench
from compile_attn.bench import engine_start as bench_engine


def test_prefill_flops_match_the_weights_of_the_model() -> None:
    shape = dict(bench.LLAMA_1B)
    model = bench._hf_model(bench.BenchConfig(shape=dict(bench.TINY), device="cpu"), "sdpa", torch.float32)
    tiny = dict(bench.TINY)
    # linear FLOPs from the weights the decoder layers actually hold: 2 per weight per token
    per_token = sum(p.numel() for n, p in model.model.layers.named_parameters() if n.endswith("proj.weight"))
    n, r = 16, 3
    attn = 2 * 2 * tiny["num_attention_heads"] * tiny["head_dim"] * sum(i + 1 for i in range(n)) * tiny["num_hidden_layers"] * r
    expected = 2 * per_token * n * r + attn + 2 * tiny["hidden_size"] * tiny["vocab_size"] * r
    assert bench_engine.prefill_flops(tiny, r, n) == expected
    assert 15e12 < bench_engine.prefill_flops(shape, 8, 1024) < 18e12  # ~16.5 TFLOP for Llama-1B, 8 x 1024


def test_cold_and_warm_start_in_fresh_processes() -> None:
    cfg = bench_engine.EngineBenchConfig(shape=dict(bench.TINY), backend="torch_native", requests=2, prompt_len=16,
                                         max_batch_size=2, max_num_tokens=32, kv_cache_tokens=128, iters=2,
                                         device="cpu", compile_options={"fuse_linears": False})
    results = bench_engine.run(cfg)
    assert set(results) == {"cold", "warm"}
    for r in results.values():
        assert r["backend"] == "torch_native" and r["ready_s"] > 0 and r["prefill_ms"] > 0
        # (128 slots + the scratch slot) x 2 layers x (K and V) x 2 KV heads x head_dim 16 x 4 bytes (fp32)
        assert r["kv_mib"] * 2**20 == 129 * 2 * 2 * 2 * 16 * 4
        assert r["graphs"], "no graph was captured at start"
        assert r["compile_options"]["fuse_linears"] is False  # the start processes compile with the given options
    assert "| cold | torch_native |" in bench_engine.to_markdown(results, cfg)
