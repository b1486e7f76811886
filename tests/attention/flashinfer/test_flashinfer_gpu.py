"""GPU tests of the flashinfer backend with the real kernels (bf16 on CUDA) against the float64 reference:
decode / extend / prefix / mixed batches, page sizes 1 and 16, GQA 1/4/8, head dims 64 and 128, sliding
window and softcap, both prefix paths and tensor-core decode (the shared harness, tests/attention/harness.py);
captured decode graphs replayed with new batches per bucket with and without the fast plan; and a ToyDecoder
through the GraphRunner (full decode graphs, breakable extend) against eager torch_native.

All kernels the module needs are JIT-built once, in parallel, before the first test.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from compile_attn import create_backend
from compile_attn.attention.flashinfer.library import flashinfer_installed, load_flashinfer
from compile_attn.attention.flashinfer.warmup import KernelSpec, build_kernels
from tests.attention.harness import TOL, Case, decode_replays, run_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flashinfer_installed(), reason="flashinfer is not installed"),
]

BF16 = torch.bfloat16
KERNELS = [
    *(KernelSpec(kind, hd, BF16, BF16, sliding_window=w, softcap=w)
      for hd, w in ((64, False), (64, True), (128, False)) for kind in ("paged", "ragged")),
    KernelSpec("decode", 64, BF16, BF16),  # GQA 1 decodes on CUDA cores
    KernelSpec("merge", 64, BF16, BF16),
]


@pytest.fixture(scope="module", autouse=True)
def built_kernels() -> None:
    workspace = torch.zeros(64 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    timings = build_kernels(load_flashinfer(), KERNELS, workspace, max_workers=len(KERNELS))
    if os.environ.get("FI_JIT_REPORT"):
        Path(os.environ["FI_JIT_REPORT"]).write_text(json.dumps(timings, indent=1))


def make_backend(kv, layers, **kwargs):  # noqa: ANN001, ANN201
    return create_backend("flashinfer", kv, layers, **kwargs)


W = dict(window=9, logit_cap=30.0)


def fi(kind: str, head_dim: int, *, prefix_path: str = "paged", tensor_cores: bool | None = None,
       **fields: object) -> object:
    """A harness case with flashinfer's own options (extend prefix path, tensor-core decode)."""
    case = Case.named(kind, head_dim=head_dim, **fields)
    options = dict(extend_prefix_path=prefix_path, decode_use_tensor_cores=tensor_cores)
    name = "-".join([kind, f"d{head_dim}", *(f"{k}{v}" for k, v in fields.items()), prefix_path,
                     *(["tc"] if tensor_cores else [])])
    return pytest.param(case, options, id=name)


CASES = [
    fi("decode", 64, group=1, page_size=1),
    fi("decode", 64, group=4, page_size=16),
    fi("decode", 64, group=8, page_size=1),
    fi("decode", 128, group=4, page_size=16),
    fi("decode", 128, group=8, page_size=1),
    fi("decode", 128, group=1, page_size=16, tensor_cores=True),
    fi("decode", 64, group=4, page_size=16, **W),
    fi("decode", 64, group=8, page_size=1, **W),
    fi("extend", 64, group=1, page_size=1),
    fi("extend", 64, group=4, page_size=16),
    fi("extend", 128, group=8, page_size=1),
    fi("extend", 64, group=8, page_size=16, **W),
    fi("prefix", 64, group=4, page_size=1),
    fi("prefix", 64, group=8, page_size=16),
    fi("prefix", 128, group=4, page_size=16),
    fi("prefix", 128, group=1, page_size=1, tensor_cores=True),
    fi("prefix", 64, group=4, page_size=16, **W),
    fi("prefix", 64, group=4, page_size=16, prefix_path="cascade"),
    fi("prefix", 128, group=8, page_size=1, prefix_path="cascade"),
    fi("prefix", 64, group=4, page_size=1, prefix_path="cascade", **W),
    fi("mixed", 64, group=1, page_size=16),
    fi("mixed", 64, group=4, page_size=1),
    fi("mixed", 128, group=8, page_size=16),
    fi("mixed", 64, group=4, page_size=16, **W),
    fi("mixed", 64, group=8, page_size=1, prefix_path="cascade"),
    fi("mixed", 128, group=4, page_size=16, prefix_path="cascade"),
]


@pytest.mark.parametrize(("case", "options"), CASES)
def test_matches_float64_reference_bf16_on_every_path(case: Case, options: dict) -> None:
    for seed in range(2):
        for result in run_case(case, "cuda", BF16, seed=seed, backend_name="flashinfer", backend_kwargs=options):
            assert result.error < TOL[BF16], f"seed {seed}: relative error {result.error:.2e}"


@pytest.mark.parametrize("kind", ["extend", "mixed"])
def test_padding_tokens_of_a_cascade_bucket_get_zero_output(kind: str) -> None:
    """The paged path is in the conformance suite; the cascade path pads the same way."""
    case = Case.named(kind, group=4, page_size=16, **W)
    for result in run_case(case, "cuda", BF16, pad_tokens=11, backend_name="flashinfer",
                           backend_kwargs=dict(extend_prefix_path="cascade")):
        assert result.error < TOL[BF16]
        assert torch.count_nonzero(result.pad_out) == 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("fast_plan", [True, False])
def test_decode_cuda_graphs_replay_new_batches_per_bucket(fast_plan: bool, page_size: int) -> None:
    """One capture per bucket (two plan groups: window+softcap and full layers), then three different
    batches per bucket (one with padded requests), re-planned outside the graph before each replay."""
    report = decode_replays("cuda", BF16, buckets=(1, 3, 8, 16), trials=3, capture=True, max_len=150,
                            page_size=page_size, backend_name="flashinfer",
                            backend_kwargs=dict(fast_decode_plan=fast_plan))
    assert report.trials == 4 * 3 and len(report.errors) == 4 * 3 * 2
    assert max(report.errors) < TOL[BF16], report.errors


def test_graph_bucket_replan_never_waits_and_needs_the_in_graph_gather() -> None:
    """A graph bucket's out_graph (host CSR, one upload, fast re-plan) runs under sync-debug "error" (no
    blocking copy, no read-back); its page ids come from in_graph, and attention without it is refused."""
    from compile_attn import AttentionLayer, KVCache, ForwardBatch

    layer = AttentionLayer(0, 8, 2, 64)
    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=4, max_context=64, kv_cache_tokens=512,
                 page_size=16, dtype=BF16, device="cuda")
    backend = make_backend(kv, [layer])
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    rows = [kv.alloc_request() for _ in range(4)]
    kv.alloc_extend(rows, [40, 3, 17, 16])
    loc = kv.alloc_extend(rows, [1] * 4)
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[40, 3, 17, 16], extend_lens=[1] * 4,
                            out_cache_loc=loc, device="cuda")
    fb.graph_bucket = 4
    backend.init_forward_metadata_out_graph(fb, in_capture=True)  # the bucket's first, full plan
    q = torch.randn(4, 8, 64, dtype=BF16, device="cuda")
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="init_forward_metadata_in_graph"):
        backend.decode_attention(q, layer, out)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.init_forward_metadata_out_graph(fb)  # fast re-plan
        backend.init_forward_metadata_in_graph(fb)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = backend._graph
    indptr = graph.indptr(4).tolist()
    assert indptr == [0, 3, 4, 6, 8]  # 41, 4, 18 and 17 tokens in pages of 16
    pages = graph.indices[: indptr[-1]].tolist()
    for b, row in enumerate(rows):
        n = int(fb.seq_lens_cpu[b])
        assert pages[indptr[b] : indptr[b + 1]] == [int(kv.req_to_token[row, j]) // 16 for j in range(0, n, 16)]


def test_warmup_loads_built_kernels_with_a_log_line_each(caplog: pytest.LogCaptureFixture) -> None:
    from compile_attn import AttentionLayer, KVCache

    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=2, max_context=32, kv_cache_tokens=64,
                 dtype=BF16, device="cuda")
    backend = make_backend(kv, [AttentionLayer(0, 8, 2, 64)])
    with caplog.at_level("INFO", logger="compile_attn.attention.flashinfer.warmup"):
        timings = backend.warmup()
    assert len([r for r in caplog.records if "kernel ready" in r.getMessage()]) == len(timings) == 3
    assert max(timings.values()) < 30, timings  # built by the fixture: loading only


def test_toy_decoder_through_graph_runner_matches_eager_torch_native() -> None:
    """Full decode graphs (every bucket) and breakable extend graphs with flashinfer attention, against the
    same random steps run eagerly with torch_native on a twin KV cache."""
    from tests.graph_runner.gr_helpers import Twin, make_model, run_scenario

    from compile_attn.attention.torch_native.backend import TorchNativeBackend
    from compile_attn.config import GraphConfig
    from compile_attn.graph_runner import GraphRunner
    from compile_attn.models import ToyDecoderConfig

    cfg = ToyDecoderConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                           intermediate_size=512)
    decode, extend = (1, 2, 4, 8, 16), (16, 32, 64, 128)
    model = make_model(cfg, "cuda", BF16, seed=0)
    twin = Twin(cfg, "cuda", BF16, seed=0, max_batch_size=40, max_context=320, kv_cache_tokens=16384)
    layers = model.attention_layers()
    config = GraphConfig(mode="full_and_piecewise", decode_batch_sizes=decode, extend_token_sizes=extend,
                         cache_dir=None)
    runner = GraphRunner(model, make_backend(twin.caches[0], layers), config, max_batch_size=16,
                         max_num_tokens=128)
    runner.capture()
    assert runner.stats.captures.get("full") == len(decode)
    rng = random.Random(1)
    plan = []
    for _ in range(6):
        plan += [("decode", rng.randint(lo + 1, hi)) for lo, hi in zip((0, *decode), decode)]
        plan += [("extend", rng.randint(lo + 1, hi)) for lo, hi in zip((0, *extend), extend)]
    steps = run_scenario(runner, model, TorchNativeBackend(twin.caches[1], layers), twin, plan,
                         max_extend_requests=5, atol=8e-2, rtol=8e-2)
    assert len(steps) >= len(plan)
    assert runner.stats.runs["full"] >= 30
    assert runner.stats.eager_fallbacks == 0
