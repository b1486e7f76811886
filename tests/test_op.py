"""The attention custom op: opcheck, clear error without context, one graph and no recompiles under torch.compile."""

from __future__ import annotations

import pytest
import torch

from tests.batch_factory import random_step
from compile_attn import (
    AttentionLayer, ForwardBatch, KVCache, NoForwardContextError, create_backend, forward_context, register_split_op,
)
from compile_attn.ops import is_split_op, split_op_names, unregister_split_op
from compile_attn.models import ToyDecoder, ToyDecoderConfig


def _setup(prefix: list[int], extend: list[int], seed: int = 0):
    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=8, max_batch_size=64, max_context=256, kv_cache_tokens=4096,
                 dtype=torch.float32)
    backend = create_backend("torch_native", kv, [AttentionLayer(0, 4, 2, 8)])
    step = random_step(kv, prefix, extend, 4, torch.Generator().manual_seed(seed))
    backend.init_forward_metadata(step.batch)
    return kv, backend, step


@pytest.mark.parametrize("extend", [[1, 1, 1], [3, 1, 5]], ids=["decode", "mixed"])
def test_opcheck(extend: list[int]) -> None:
    _, backend, step = _setup([4, 2, 6], extend)
    out = torch.empty_like(step.q)
    with forward_context(step.batch, backend):
        torch.library.opcheck(
            torch.ops.compile_attn.attention.default, (step.q, step.k, step.v, out, 0),
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
        )


def test_op_without_context_is_a_clear_error() -> None:
    q = torch.randn(2, 4, 8)
    k = v = torch.randn(2, 2, 8)
    with pytest.raises(NoForwardContextError, match="forward context"):
        torch.ops.compile_attn.attention(q, k, v, torch.empty_like(q), 0)


def test_unknown_layer_id_names_the_known_ones() -> None:
    _, backend, step = _setup([2], [1])
    with forward_context(step.batch, backend), pytest.raises(KeyError, match="known: \\[0\\]"):
        torch.ops.compile_attn.attention(step.q, step.k, step.v, torch.empty_like(step.q), 7)


def test_attention_is_a_split_op_and_users_can_add_their_own() -> None:
    assert is_split_op(torch.ops.compile_attn.attention)
    assert is_split_op(torch.ops.compile_attn.attention.default)
    assert not is_split_op(torch.ops.aten.mm.default)
    register_split_op(torch.ops.aten.mm.default)
    try:
        assert is_split_op(torch.ops.aten.mm) and "aten::mm" in split_op_names()
    finally:
        unregister_split_op("aten::mm")
    with pytest.raises(TypeError, match="namespace::name"):
        register_split_op(42)


def test_fullgraph_compile_no_graph_break_and_no_recompile_across_token_counts() -> None:
    """One dynamic compile serves 20 different token counts; outputs equal eager."""
    torch._dynamo.reset()
    cfg = ToyDecoderConfig(num_layers=2)
    model = ToyDecoder(cfg).eval()
    kv = KVCache(num_layers=2, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_batch_size=64,
                 max_context=256, kv_cache_tokens=8192, dtype=torch.float32)
    backend = create_backend("torch_native", kv, model.attention_layers())
    frames = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs):  # noqa: ANN001
        frames.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=counting_backend, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 21):
        rows = [kv.alloc_request() for _ in range(2)]
        extend = [n, 2 * n + 1]
        loc = kv.alloc_extend(rows, extend)
        ids = torch.randint(0, cfg.vocab_size, (sum(extend),), generator=gen)
        fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[0, 0], extend_lens=extend,
                                out_cache_loc=loc, input_ids=ids)
        backend.init_forward_metadata(fb)
        with forward_context(fb, backend), torch.no_grad():
            got = compiled(fb.input_ids, fb.positions)
            want = model(fb.input_ids, fb.positions)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for row in rows:
            kv.free_request(row)
    assert len(frames) == 1, f"expected one compiled graph for 20 token counts, got {len(frames)}"
    targets = [n.target for n in frames[0].graph.nodes if n.op == "call_function"]
    assert sum(is_split_op(t) for t in targets) == cfg.num_layers
