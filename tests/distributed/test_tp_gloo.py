"""Tensor parallelism across real processes: gloo on the CPU, 2 ranks (and one 4-rank case), float32.

Each rank shards the same seeded tiny model of every supported family and runs the ragged three-step scenario
through the compile_attn attention path; its logits must equal those of the unsharded HF eager model (an
independent reference) to 1e-5 relative. Also: torch.compile with the compile_attn backend keeps the all-reduces
inside the compiled pieces, a checkpoint loads per rank from its safetensors slices, and a rank that raises ends
the run with that rank's error and no process left behind.

The 2-rank checks share one spawn (``two_ranks``: starting the ranks costs more than most checks); each test
reports its own check's result from that run.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from tests.distributed import failing_worker, workers
from tests.distributed.launch import ChecksOutcome, RankFailedError, run_checks, run_ranks
from tests.hf.hf_tiny_models import FAMILIES, build_pair

FAMILY_CASES = [(family, {}) for family in FAMILIES] + [
    ("llama", {"num_key_value_heads": 1}),  # one KV head, replicated on both ranks
    ("gemma3", {"vocab_size": 97, "tie_word_embeddings": True}),  # padded vocabulary, tied LM head
    ("qwen2", {"tie_word_embeddings": True}),  # q/k/v biases, tied LM head
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A mistral checkpoint saved in several safetensors files and an index."""
    path = tmp_path_factory.mktemp("mistral")
    ours, _ = build_pair("mistral", vocab_size=97)
    ours.save_pretrained(path, max_shard_size="100KB")
    return path


@pytest.fixture(scope="module")
def two_ranks(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> ChecksOutcome:
    """Every 2-rank check in one spawn, the cheap ones first."""
    return run_checks([
        ("step messages", workers.step_messages, ()),
        ("fast all-reduce on every rank or none", workers.fast_all_reduce_agreement, ()),
        ("families on 2 ranks", workers.sharded_families, (FAMILY_CASES,)),
        ("load sharded checkpoint", workers.loaded_checkpoint, (str(checkpoint), "mistral")),
        ("compiled with the compile_attn backend", workers.compiled_family, ("llama", "inductor")),
    ], 2, tmp_path_factory.mktemp("two_ranks"))


def test_six_families_match_the_unsharded_model_on_2_ranks(two_ranks: ChecksOutcome) -> None:
    two_ranks.expect("families on 2 ranks")


def test_4_ranks_with_kv_heads_replicated() -> None:
    """4 query heads and 2 KV heads over 4 ranks: each KV head on two ranks; vocab 96 and intermediate 96 in 4."""
    run_ranks(workers.sharded_families, 4, [("qwen3", {}), ("gemma2", {"vocab_size": 98})])


def test_compile_attn_backend_keeps_all_reduce_in_pieces(two_ranks: ChecksOutcome) -> None:
    two_ranks.expect("compiled with the compile_attn backend")


def test_load_sharded_checkpoint(checkpoint: Path, two_ranks: ChecksOutcome) -> None:
    assert len(list(checkpoint.glob("*.safetensors"))) > 1
    two_ranks.expect("load sharded checkpoint")


def test_a_failing_rank_ends_the_run_with_its_error() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 failed first:(.|\n)*rank 1 failed on purpose"):
        run_ranks(failing_worker.failing_rank, 2, timeout_s=60)
    assert time.monotonic() - start < 45  # the error, not the 60 s collective timeout
    assert multiprocessing.active_children() == []
    assert torch.distributed.is_initialized() is False  # the test process itself never joins a group


def test_step_messages_arrive_as_sent(two_ranks: ChecksOutcome) -> None:
    """Decode (host per-token fields with placeholders and feed), extend with device-side slots, verify with keep
    rows and a rewritten table row, then shutdown."""
    two_ranks.expect("step messages")


def test_the_fast_all_reduce_is_on_every_rank_or_none(two_ranks: ChecksOutcome) -> None:
    two_ranks.expect("fast all-reduce on every rank or none")
