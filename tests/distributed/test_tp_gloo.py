"""Tensor parallelism across real processes: gloo on the CPU, 2 ranks (and one 4-rank case), float32.

Each rank shards the same seeded tiny model of every supported family and runs the ragged three-step scenario
through the compile_attn attention path; its logits must equal those of the unsharded HF eager model (an
independent reference) to 1e-5 relative. Also: torch.compile with the compile_attn backend keeps the all-reduces
inside the compiled pieces, a checkpoint loads per rank from its safetensors slices, and a rank that raises ends
the run with that rank's error and no process left behind.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from tests.distributed import workers
from tests.distributed.launch import RankFailedError, run_ranks
from tests.hf.hf_tiny_models import FAMILIES, build_pair


def test_six_families_match_the_unsharded_model_on_2_ranks() -> None:
    cases = [(family, {}) for family in FAMILIES] + [
        ("llama", {"num_key_value_heads": 1}),  # one KV head, replicated on both ranks
        ("gemma3", {"vocab_size": 97, "tie_word_embeddings": True}),  # padded vocabulary, tied LM head
        ("qwen2", {"tie_word_embeddings": True}),  # q/k/v biases, tied LM head
    ]
    run_ranks(workers.sharded_families, 2, cases)


def test_4_ranks_with_kv_heads_replicated() -> None:
    """4 query heads and 2 KV heads over 4 ranks: each KV head on two ranks; vocab 96 and intermediate 96 in 4."""
    run_ranks(workers.sharded_families, 4, [("qwen3", {}), ("gemma2", {"vocab_size": 98})])


def test_compile_attn_backend_keeps_all_reduce_in_pieces() -> None:
    run_ranks(workers.compiled_family, 2, "llama", "inductor")


def test_load_sharded_checkpoint(tmp_path: Path) -> None:
    ours, _ = build_pair("mistral", vocab_size=97)
    ours.save_pretrained(tmp_path, max_shard_size="100KB")  # several files and an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    run_ranks(workers.loaded_checkpoint, 2, str(tmp_path), "mistral")


def test_a_failing_rank_ends_the_run_with_its_error() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 failed first:(.|\n)*rank 1 failed on purpose"):
        run_ranks(workers.failing_rank, 2, timeout_s=60)
    assert time.monotonic() - start < 45  # the error, not the 60 s collective timeout
    assert multiprocessing.active_children() == []
    assert torch.distributed.is_initialized() is False  # the test process itself never joins a group


def test_step_messages_arrive_as_sent() -> None:
    """Decode (host per-token fields with placeholders and feed), extend with device-side slots, verify with keep
    rows and a rewritten table row, then shutdown."""
    run_ranks(workers.step_messages, 2)


def test_the_fast_all_reduce_is_on_every_rank_or_none() -> None:
    run_ranks(workers.fast_all_reduce_agreement, 2)
