"""A speculative verify step leaves its request-table write to the step (``Scheduler(defer_table_write=True)``,
``KVCache.alloc_extend(..., defer_table_write=True)``, ``ForwardBatch.table_write_pending``): its slots reach the
device in the batch's own upload, and the table the forward reads holds them. Checked on chains and trees, eager and
in graphs: the allocation leaves the table untouched, after every step the table is what the rows' pages say, and
the greedy tokens are an independent no-cache recompute's.
"""

from __future__ import annotations

import pytest
import torch

from compile_attn.engine import LLM, SamplingParams
from compile_attn.models import ToyDecoder, ToyDecoderConfig
from tests.greedy_reference import greedy_by_recompute
from tests.kv.test_deferred_table_write import reference_table

CFG = ToyDecoderConfig(vocab_size=11, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64)
PROMPTS = [[(7 * i + j) % 11 for j in range(n)] for i, n in enumerate([3, 17, 9, 30])]  # prompt lookup finds drafts
CHAIN = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
TREE = {**CHAIN, "topk": 3, "num_draft_tokens": 7}


@pytest.mark.parametrize(("spec", "graph_mode"), [(CHAIN, "none"), (CHAIN, "full"), (TREE, "none")])
def test_verify_steps_write_the_table_in_the_step(spec: dict, graph_mode: str) -> None:
    torch.manual_seed(0)
    model = ToyDecoder(CFG).eval()
    llm = LLM(model, max_batch_size=4, max_num_tokens=64, kv_cache_tokens=512, max_context=64, page_size=4,
              graph_mode=graph_mode, compile=False, device="cpu", speculative_config=spec,
              enable_prefix_cache=False)  # every page goes back to the allocator at the end
    kv = llm.kv_cache
    alloc, deferred = kv.alloc_extend, []

    def watched(rows, extend_lens, *, defer_table_write=False):  # noqa: ANN001, ANN202
        before = kv.req_to_token.clone()
        loc = alloc(rows, extend_lens, defer_table_write=defer_table_write)
        if defer_table_write:
            assert loc.is_cpu and torch.equal(kv.req_to_token, before)  # nothing written at allocation
            deferred.append(list(extend_lens))
        return loc

    kv.alloc_extend = watched
    reqs = [llm.add_request(p, SamplingParams(max_new_tokens=14)) for p in PROMPTS]
    while llm.has_work():
        llm.step()
        assert kv.req_to_token.tolist() == reference_table(kv)  # the step wrote every slot it allocated
    for r, prompt in zip(reqs, PROMPTS):
        assert r.output_ids == greedy_by_recompute(model, prompt, 14)
    verify_steps = [lens for lens in deferred if max(lens) > 1]
    assert llm.speculator.stats.accepted_tokens > 0
    assert len(verify_steps) >= llm.speculator.stats.verify_steps > 0  # every verify step deferred its write
    assert (llm.speculator.stats.tree_verified > 0) == ("topk" in spec)
    assert kv.allocator.available == kv.allocator.num_pages


def test_a_full_verify_step_of_decode_rows_has_a_graph_at_a_small_max_batch_size() -> None:
    """1 request x (1 + 4) tokens is 5 decode rows: the decode graphs reach the next size (8), so a backend without
    a verify mode pads the step into a graph instead of running it eagerly."""
    torch.manual_seed(0)
    model = ToyDecoder(CFG).eval()
    spec = {**CHAIN, "num_speculative_tokens": 4}
    llm = LLM(model, max_batch_size=1, max_num_tokens=64, kv_cache_tokens=512, max_context=64, page_size=4,
              graph_mode="full", compile=False, device="cpu", speculative_config=spec, attn_backend="torch_native")
    req = llm.add_request(PROMPTS[3], SamplingParams(max_new_tokens=14))
    while llm.has_work():
        llm.step()
    assert req.output_ids == greedy_by_recompute(model, PROMPTS[3], 14)
    runner = llm.step_runner.runner
    assert 8 in runner.decode_buckets and llm.speculator.stats.verify_steps > 0
    assert runner.stats.eager_fallbacks == 0
