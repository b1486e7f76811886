"""On the GPU: after ``LLM(...)`` start-up, serving builds nothing. A workload with every step path (prefills,
chunked prefills with cached prefixes, mixed steps, decode batches of many sizes, batches over the largest
buckets, greedy and sampled requests) compiles no Dynamo graph, JIT-builds no Triton kernel specialisation and
builds or autotunes no Inductor kernel."""

from __future__ import annotations

import pytest
import torch
from tests.engine.first_traffic import assert_every_path_taken, every_path_traffic, generate_recorded

from compile_attn.engine import LLM

pytestmark = pytest.mark.gpu


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    with torch.device("cuda"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


@pytest.mark.parametrize("graph_mode", ["full_and_piecewise", "piecewise"])
def test_first_generate_builds_nothing(graph_mode: str, tmp_path) -> None:
    llm = LLM(_llama(), attn_backend="triton", graph_mode=graph_mode, max_batch_size=12, max_num_tokens=96,
              kv_cache_tokens=12 * 400, max_context=400,
              compile_options={"cache_dir": str(tmp_path), "decode_batch_sizes": (1, 2, 4, 8),
                               "extend_token_sizes": (16, 32, 64)})
    traffic = every_path_traffic(1024, longest_prompt=300, num_requests=20)
    _, builds, log = generate_recorded(llm, traffic)
    assert_every_path_taken(llm, log)
    assert builds.nothing(), builds
