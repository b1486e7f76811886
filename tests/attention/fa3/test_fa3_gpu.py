"""GPU tests of the fa3 backend with sgl-kernel's real FA3 kernels against the float64 reference: decode /
extend / prefix / mixed batches, page sizes 1 and 16, GQA 1/4/8, head dims 64/128/256, sliding window and
softcap, bf16 and fp16; refused head dims and dtypes; a ToyDecoder through the GraphRunner against eager
torch_native.

Batches come from the shared harness (tests/attention/harness.py); what every backend must pass (padding
tokens, decode graphs replayed per bucket, save_kv_cache) is in tests/attention/test_conformance.py.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("sgl_kernel")

from compile_attn import AttentionLayer, KVCache, create_backend  # noqa: E402
from compile_attn.errors import UnsupportedConfigError  # noqa: E402
from tests.attention.harness import TOL, Case, run_case  # noqa: E402

BF16 = torch.bfloat16


def make_backend(kv, layers):  # noqa: ANN001, ANN201
    return create_backend("fa3", kv, layers)


W = {"window": 9, "logit_cap": 30.0}
CASES = [
    Case.named("decode", head_dim=64, group=1, page_size=1),
    Case.named("decode", head_dim=64, group=4, page_size=16),
    Case.named("decode", head_dim=128, group=8, page_size=1),
    Case.named("decode", head_dim=256, group=4, page_size=16),
    Case.named("decode", head_dim=64, group=4, page_size=16, **W),
    Case.named("decode", head_dim=128, group=8, page_size=1, **W),
    Case.named("extend", head_dim=64, group=1, page_size=1),
    Case.named("extend", head_dim=64, group=4, page_size=16),
    Case.named("extend", head_dim=128, group=8, page_size=1),
    Case.named("extend", head_dim=64, group=8, page_size=16, **W),
    Case.named("prefix", head_dim=64, group=4, page_size=1),
    Case.named("prefix", head_dim=64, group=8, page_size=16),
    Case.named("prefix", head_dim=128, group=1, page_size=16),
    Case.named("prefix", head_dim=256, group=4, page_size=1),
    Case.named("prefix", head_dim=64, group=4, page_size=16, **W),
    Case.named("prefix", head_dim=128, group=4, page_size=1, **W),
    Case.named("mixed", head_dim=64, group=1, page_size=16),
    Case.named("mixed", head_dim=64, group=4, page_size=1),
    Case.named("mixed", head_dim=128, group=8, page_size=16),
    Case.named("mixed", head_dim=64, group=4, page_size=16, **W),
    Case.named("mixed", head_dim=64, group=8, page_size=1, **W),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_float64_reference_bf16_at_every_head_dim(case: Case) -> None:
    for seed in range(2):
        for result in run_case(case, "cuda", BF16, seed=seed, backend_name="fa3"):
            assert result.error < TOL[BF16], f"seed {seed}: relative error {result.error:.2e}"


@pytest.mark.parametrize("kind", ["decode", "prefix", "mixed"])
def test_matches_float64_reference_fp16(kind: str) -> None:
    for result in run_case(Case.named(kind, head_dim=128, group=4, page_size=16, **W), "cuda", torch.float16,
                           backend_name="fa3"):
        assert result.error < TOL[torch.float16], f"relative error {result.error:.2e}"


def test_unsupported_head_dim_and_dtype_are_refused() -> None:
    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=96, max_batch_size=2, max_context=32, kv_cache_tokens=64,
                 dtype=BF16, device="cuda")
    with pytest.raises(UnsupportedConfigError, match="head_dim 96"):
        create_backend("fa3", kv, [AttentionLayer(0, 8, 2, 96)])
    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=2, max_context=32, kv_cache_tokens=64,
                 dtype=torch.float32, device="cuda")
    with pytest.raises(UnsupportedConfigError, match="float32"):
        create_backend("fa3", kv, [AttentionLayer(0, 8, 2, 64)])


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="auto tries fa3 on Hopper only")
def test_auto_tries_fa3_right_after_triton_on_hopper() -> None:
    from compile_attn.attention.registry import auto_backend_candidates

    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=2, max_context=32, kv_cache_tokens=64,
                 dtype=BF16, device="cuda")
    assert auto_backend_candidates(kv.device)[:2] == ["triton", "fa3"]
    assert create_backend("auto", kv, [AttentionLayer(0, 8, 2, 64)]).name == "triton"


def test_toy_decoder_through_graph_runner_matches_eager_torch_native() -> None:
    """Full decode graphs (every bucket) and breakable extend graphs with fa3 attention, against the same
    random steps run eagerly with torch_native on a twin KV cache."""
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
