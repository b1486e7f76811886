"""Compile-backend benchmark on a Llama-3.2-1B-shaped decoder: cold/warm compile, capture time, graph memory.

Model: hidden 2048, 16 layers, 32 heads, 8 KV heads, head_dim 64, MLP 8192, vocab 128256, random bf16
weights (the ToyDecoder architecture). The compiled body returns hidden states; the LM head runs outside
it on the sampled tokens only, as a serving engine does. ``--phase all`` runs a cold start (empty caches)
and warm starts (same compile_attn cache; with an empty Inductor cache, and with Inductor's local cache)
in fresh processes, and prints JSON lines and a table.
Targets: cold compile + capture <= 30 s, warm <= 10 s, graph memory <= 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

from compile_attn import ForwardBatch, KVCache, create_backend, forward_context
from compile_attn.config import DEFAULT_PREFILL_TOKEN_SIZES
from compile_attn.models.toy_decoder import ToyDecoder, ToyDecoderConfig

LLAMA_1B = ToyDecoderConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                            head_dim=64, intermediate_size=8192, rope_theta=500000.0)
MAX_REQUEST_TOKENS = 512


class Backbone(nn.Module):
    """The decoder without its LM head: ``(input_ids[T], positions[T]) -> hidden[T, H]``."""

    def __init__(self, decoder: ToyDecoder) -> None:
        super().__init__()
        self.decoder = decoder

    def attention_layers(self):  # noqa: ANN201
        return self.decoder.attention_layers()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.decoder.embed(input_ids)
        for layer in self.decoder.layers:
            x = layer(x, positions)
        return self.decoder.norm(x)


def _step(model, kv, backend, num_tokens, ids_buf=None, pos_buf=None) -> torch.Tensor:  # noqa: ANN001
    lens = [MAX_REQUEST_TOKENS] * (num_tokens // MAX_REQUEST_TOKENS) + [num_tokens % MAX_REQUEST_TOKENS]
    lens = [n for n in lens if n]
    rows = [kv.alloc_request() for _ in lens]
    loc = kv.alloc_extend(rows, lens)
    ids = torch.randint(0, LLAMA_1B.vocab_size, (num_tokens,), device="cuda")
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[0] * len(lens), extend_lens=lens,
                            out_cache_loc=loc, input_ids=ids, device="cuda")
    backend.init_forward_metadata(fb)
    if ids_buf is not None:
        ids_buf[:num_tokens].copy_(fb.input_ids)
        pos_buf[:num_tokens].copy_(fb.positions)
        args = (ids_buf[:num_tokens], pos_buf[:num_tokens])
    else:
        args = (fb.input_ids, fb.positions)
    with forward_context(fb, backend), torch.inference_mode():
        out = model(*args).clone()
    for row in rows:
        kv.free_request(row)
    return out


def _graph_pool_bytes() -> int:
    """Bytes in private (graph) pools, from the allocator's segment snapshot."""
    total = 0
    for seg in torch.cuda.memory_snapshot():
        pool = seg.get("segment_pool_id", (0, 0))
        if tuple(pool) != (0, 0):
            total += seg["total_size"]
    return total


def run_phase(cache_dir: str, buckets: tuple[int, ...]) -> dict:
    from compile_attn.compiler import compile_counters

    torch.manual_seed(0)
    decoder = ToyDecoder(LLAMA_1B).to(device="cuda", dtype=torch.bfloat16)
    for p in decoder.parameters():
        nn.init.normal_(p, std=0.02)
    model = Backbone(decoder).eval()
    max_tokens = max(buckets)
    kv = KVCache(num_layers=LLAMA_1B.num_layers, num_kv_heads=LLAMA_1B.num_kv_heads,
                 head_dim=LLAMA_1B.head_dim, max_requests=64, max_context=MAX_REQUEST_TOKENS,
                 num_tokens=max_tokens + 1024, page_size=1,
                 dtype=torch.bfloat16, device="cuda")
    backend = create_backend("torch_native", kv, model.attention_layers())
    ids_buf = torch.zeros(max_tokens, dtype=torch.int64, device="cuda")
    pos_buf = torch.zeros(max_tokens, dtype=torch.int64, device="cuda")
    compiled = torch.compile(model, backend="compile_attn", dynamic=True,
                             options={"cache_dir": cache_dir, "prefill_token_sizes": buckets})

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _step(compiled, kv, backend, 8)  # 8 tokens: not a bucket, so this is compile (+ one run) only
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    counters_after_compile = compile_counters.snapshot()
    names, seconds = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    breakdown = {n: round(float(v), 2) for n, v in zip(names, seconds, strict=True) if float(v) >= 0.25}
    t0 = time.perf_counter()
    _step(compiled, kv, backend, 8)
    torch.cuda.synchronize()
    second_step_s = time.perf_counter() - t0

    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    for size in sorted(buckets, reverse=True):  # largest first: smaller buckets reuse its pool memory
        _step(compiled, kv, backend, size, ids_buf, pos_buf)
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    torch.cuda.empty_cache()
    graph_pool = _graph_pool_bytes()
    reserved_delta = torch.cuda.memory_reserved() - reserved_before

    # correctness of a replay and its speed against the same compiled pieces without graphs
    check = 512 if 512 in buckets else buckets[0]
    torch.manual_seed(1)
    got = _step(compiled, kv, backend, check, ids_buf, pos_buf)
    torch.manual_seed(1)
    want = _step(model, kv, backend, check)
    rel_err = float((got.float() - want.float()).abs().max() / want.float().abs().max())

    def latency_ms(fn) -> float:  # noqa: ANN001
        times = []
        for _ in range(15):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    small = min(buckets)
    return {
        "compile_s": round(compile_s, 2),
        "second_step_s": round(second_step_s, 3),
        "compile_breakdown_s": breakdown,
        "capture_s": round(capture_s, 2),
        "graph_pool_MiB": round(graph_pool / 2**20, 1),
        "reserved_delta_MiB": round(reserved_delta / 2**20, 1),
        "buckets": list(buckets),
        "graphs_captured": compile_counters.graphs_captured,
        "counters_after_compile": {k: v for k, v in counters_after_compile.items() if v},
        f"replay_rel_err_{check}": rel_err,
        f"step_ms_{small}_graphs": round(
            latency_ms(lambda: _step(compiled, kv, backend, small, ids_buf, pos_buf)), 3),
        f"step_ms_{small}_eager": round(latency_ms(lambda: _step(model, kv, backend, small)), 3),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }


def _subprocess_phase(cache_dir: str, buckets: tuple[int, ...], inductor_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir}
    cmd = [sys.executable, __file__, "--phase", "one", "--cache-dir", cache_dir,
           "--buckets", ",".join(map(str, buckets))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark phase failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=["all", "one"], default="all")
    parser.add_argument("--cache-dir", default=None, help="compile_attn cache dir (default: a new temp dir)")
    parser.add_argument("--buckets", default=",".join(map(str, DEFAULT_PREFILL_TOKEN_SIZES)))
    args = parser.parse_args()
    buckets = tuple(int(b) for b in args.buckets.split(","))
    if args.phase == "one":
        print(json.dumps(run_phase(args.cache_dir, buckets)))
        return
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="compile_attn-cache-")
    cold_inductor = tempfile.mkdtemp(prefix="inductor-")
    phases = {
        "cold": _subprocess_phase(cache_dir, buckets, cold_inductor),  # both caches empty
        # compile_attn's cache only: a fresh Inductor cache dir, so nothing else can be reused
        "warm": _subprocess_phase(cache_dir, buckets, tempfile.mkdtemp(prefix="inductor-")),
        # a restart on the same machine: Inductor's local cache (autotuning results, ...) is there too
        "warm+local": _subprocess_phase(cache_dir, buckets, cold_inductor),
    }
    for name, result in phases.items():
        print(json.dumps({"phase": name, **result}))
    print(f"\n{'start':<11} {'compile s':>10} {'capture s':>10} {'total s':>8} {'pool MiB':>9} {'graphs':>7}")
    for name, r in phases.items():
        total = r["compile_s"] + r["capture_s"]
        print(f"{name:<11} {r['compile_s']:>10} {r['capture_s']:>10} {total:>8.2f} {r['graph_pool_MiB']:>9} "
              f"{r['graphs_captured']:>7}")


if __name__ == "__main__":
    main()
