"""A verification step with draft trees through the GraphRunner: its token-padded replay view keeps the batch's
draft_parents, so the model's outputs equal a plain eager run of the same step (a view that dropped the trees
would attend as chains and differ)."""

from __future__ import annotations

import pytest
import torch
from tests.graph_runner.gr_helpers import CountingBackend, Twin, eager_reference, make_model

from compile_attn import ForwardBatch, ForwardMode
from compile_attn.config import GraphConfig
from compile_attn.graph_runner import GraphRunner

PARENTS = ((-1, 0, 0, 1, 1, 2), (-1,), (-1, 0, 1))  # a tree, a decode-like row, a chain


def _verify_step(twin: Twin, ids: list[int]) -> tuple[ForwardBatch, ForwardBatch]:
    """The same TARGET_VERIFY step on both caches (rotary positions default to prefix + depth)."""
    extend = [len(p) for p in PARENTS]
    prefix = [twin.lens[i] for i in ids]
    tokens = [twin.rng.randrange(twin.cfg.vocab_size) for _ in range(sum(extend))]
    batches = []
    for c, kv in enumerate(twin.caches):
        rows = [twin.rows[i][c] for i in ids]
        batches.append(ForwardBatch.build(
            req_pool_indices=rows, prefix_lens=prefix, extend_lens=extend, out_cache_loc=kv.alloc_extend(rows, extend),
            input_ids=tokens, forward_mode=ForwardMode.TARGET_VERIFY, draft_parents=PARENTS, device=twin.device))
    return batches[0], batches[1]


@pytest.mark.parametrize("mode", ["breakable", "none"])  # (piecewise needs a compiled model: breakable here)
def test_tree_verify_step_through_the_runner_matches_eager(mode: str) -> None:
    model = make_model()
    twin = Twin(seed=3)
    layers = model.attention_layers()
    runner = GraphRunner(model, CountingBackend(twin.caches[0], layers),
                         GraphConfig(mode=mode, decode_batch_sizes=(1, 2, 4), extend_token_sizes=(16, 32),
                                     cache_dir=None), max_batch_size=4, max_num_tokens=32)
    runner.capture()
    ref_backend = CountingBackend(twin.caches[1], layers)
    ids = twin.new_requests(3)
    prefill = twin.step(ids, [7, 4, 12])
    torch.testing.assert_close(runner.run(prefill.runner_batch), eager_reference(model, ref_backend,
                                                                                 prefill.ref_batch))
    runner_fb, ref_fb = _verify_step(twin, ids)
    out = runner.run(runner_fb)
    ref = eager_reference(model, ref_backend, ref_fb)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    as_chains = eager_reference(model, CountingBackend(twin.caches[1], layers),
                                ForwardBatch.build(req_pool_indices=ref_fb.req_pool_indices_cpu,
                                                   prefix_lens=ref_fb.extend_prefix_lens_cpu,
                                                   extend_lens=ref_fb.extend_seq_lens_cpu,
                                                   out_cache_loc=ref_fb.out_cache_loc, input_ids=ref_fb.input_ids,
                                                   positions=ref_fb.positions, forward_mode=ForwardMode.TARGET_VERIFY))
    assert not torch.allclose(as_chains[:6], ref[:6], atol=1e-3), "the tree made no difference: the test is blind"
    assert runner.stats.runs[mode] == 2, runner.stats  # the prefill and the verification step, through a view
