"""Models with one KV head (multi-query attention) compiled with Inductor, on the CPU.

The engine's greedy tokens for a one-KV-head Llama (head_dim 16, and head_dim 64 with one query head) and Gemma2
equal HF ``generate`` with eager attention, from one Dynamo graph for every token count. A pure-torch case pins the
Inductor limitation behind the ``clone`` in ``compile_attn.hf.attention``: a view of a [1, 1, T, D] buffer with
T unbacked, as a graph output, fails to compile; the same values copied into a fresh [T, 1, D] tensor compile.
"""

from __future__ import annotations

import pytest
import torch
from tests.hf.hf_tiny_models import build_pair, hf_greedy
from torch._dynamo.decorators import mark_unbacked
from torch._inductor.exc import InductorError

from compile_attn.compiler import compile_counters
from compile_attn.engine import LLM, SamplingParams

PROMPTS = [[(5 * i + 3 * j + 1) % 96 for j in range(n)] for i, n in enumerate([3, 12, 7, 20])]
N_NEW = 6


@pytest.mark.parametrize(
    ("family", "num_heads", "head_dim", "graph_mode"),
    [("llama", 4, 16, "piecewise"), ("llama", 1, 64, "full_and_piecewise"), ("gemma2", 4, 16, "piecewise")],
)
def test_one_kv_head_compiled_greedy_equals_hf_generate(family: str, num_heads: int, head_dim: int,
                                                        graph_mode: str) -> None:
    torch._dynamo.reset()
    ours, ref = build_pair(family, attn="eager", num_key_value_heads=1, num_attention_heads=num_heads,
                           head_dim=head_dim)
    refs = [hf_greedy(ref, p, N_NEW) for p in PROMPTS]
    before = compile_counters.snapshot()
    # cache_dir None: every piece goes through Inductor (a cached artifact would skip the lowering under test)
    llm = LLM(ours, graph_mode=graph_mode, compile=True, compile_options={"compiler": "inductor", "cache_dir": None},
              max_batch_size=4, max_num_tokens=32, max_context=64, page_size=4, device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    delta = compile_counters.delta(before)
    # prefills of 3..20 tokens, decode batches of 1..4, capture buckets: one Dynamo graph, no recompile
    assert delta.get("graphs_seen") == 1 and "recompiles" not in delta, delta
    assert delta.get("pieces_compiled", 0) >= 1, delta


def _rotated_keys(copy: str):  # noqa: ANN202
    """HF's layout: keys ``[1, H, T, D]`` out of a pointwise op (rotary), then the op's ``[T, H, D]``."""

    def f(x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor]:
        k = x.view(1, x.shape[0], 1, 16).transpose(1, 2)  # [1, 1, T, 16]
        k = k * positions[None, None, :, None].float().cos()  # a new [1, 1, T, 16] buffer
        k = k[0].transpose(0, 1)  # [T, 1, 16]: already contiguous, so contiguous() returns this view
        return (k.contiguous() if copy == "contiguous" else k.clone(memory_format=torch.contiguous_format),)

    return f


@pytest.mark.parametrize("copy", ["contiguous", "clone"])
def test_inductor_limit_on_views_of_one_head_4d_buffers(copy: str) -> None:
    """Pins the upstream cause. Inductor lays out a [1, 1, T, D] buffer as channels-last (its size-1 dims make it
    both contiguous and channels-last) and orders its strides by hint, which an unbacked T lacks. If the
    ``contiguous`` case starts compiling, torch fixed it, and ``compile_attn.hf.attention`` may use contiguous()."""
    torch._dynamo.reset()
    f = _rotated_keys(copy)
    x, positions = torch.randn(5, 16), torch.arange(5)
    mark_unbacked(x, 0)
    mark_unbacked(positions, 0)
    compiled = torch.compile(f, backend="inductor", fullgraph=True)
    if copy == "contiguous":
        with pytest.raises(InductorError, match="GuardOnDataDependentSymNode"):
            compiled(x, positions)
        return
    torch.testing.assert_close(compiled(x, positions)[0], f(x, positions)[0])
