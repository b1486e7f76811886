"""Two compiled engines of one architecture in one process each run their own compiled code.

Dynamo keeps compiled code per Python code object, and every model of a class shares its ``forward`` code: a
second engine of the same architecture used to pass the first one's guards and run its compiled graph, fused
q/k/v and gate/up weights included, so a second checkpoint generated the first one's tokens (and on GPUs replayed
graphs captured with the first engine's buffers). Each engine's greedy tokens are checked against HF ``generate``
on its own weights, and an engine's compiled graph is gone once the engine is.
"""

from __future__ import annotations

import gc

import pytest
import torch
from tests.hf.hf_tiny_models import build_pair, hf_greedy

from compile_attn.compiler.counters import compile_counters
from compile_attn.compiler.shortcuts import GraphEntry
from compile_attn.engine import LLM, SamplingParams

PROMPT = [1, 2, 3, 4, 5, 6, 7]
NEW_TOKENS = 8
OPTIONS = dict(device="cpu", dtype=torch.float32, max_batch_size=2, max_num_tokens=32, max_context=64,
               kv_cache_tokens=256, compile=True, compile_options={"cache_dir": None})


def _live_graph_entries() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is GraphEntry)


@pytest.mark.parametrize("family", ["llama"])
def test_second_engine_of_one_architecture_runs_its_own_weights(tmp_path, family: str) -> None:
    entries_before = _live_graph_entries()
    for seed in (0, 1):  # same architecture, different weights
        ours, ref = build_pair(family, seed=seed)
        path = tmp_path / f"seed{seed}"
        ours.save_pretrained(path)
        seen = compile_counters.graphs_seen
        llm = LLM(str(path), **OPTIONS)
        try:
            got = llm.generate([PROMPT], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                               use_tqdm=False)[0].token_ids
        finally:
            llm.shutdown()
        assert compile_counters.graphs_seen == seen + 1, "the engine did not compile its own graph"
        assert got == hf_greedy(ref, PROMPT, NEW_TOKENS), f"engine {seed} did not generate its own model's tokens"
        del llm
        assert _live_graph_entries() == entries_before, "a shut-down engine's compiled graph is still alive"
