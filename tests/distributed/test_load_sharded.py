"""``load_sharded`` in one process: each rank's parameters read from a checkpoint's safetensors slices equal the
slices of the full model; at size 1 the loaded model gives the full model's logits; a tensor missing from the
checkpoint is named in the error."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tests.distributed.workers import check_close, reference_logits, run_adapter
from tests.hf.hf_tiny_models import build_pair

from compile_attn.distributed import load_sharded, shard_model


@pytest.mark.parametrize(("family", "overrides"), [("qwen2", {"vocab_size": 97}), ("gemma3", {"tie_word_embeddings":
                                                                                              True})])
def test_each_rank_reads_its_slices(tmp_path: Path, family: str, overrides: dict) -> None:
    full, _ = build_pair(family, **overrides)
    full.save_pretrained(tmp_path, max_shard_size="100KB")
    for rank in range(2):
        loaded = load_sharded(tmp_path, rank, 2).model
        want = dict(shard_model(copy.deepcopy(full), rank, 2).named_parameters())
        got = dict(loaded.named_parameters())
        assert got.keys() == want.keys()
        for name, param in got.items():
            assert param.device.type == "cpu" and param.dtype == torch.float32, name
            torch.testing.assert_close(param, want[name], rtol=0, atol=0, msg=name)
        assert all(b.device.type == "cpu" for b in loaded.buffers())  # rotary frequencies built, not meta
        assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == full.config.tie_word_embeddings


def test_size_one_gives_the_full_models_logits(tmp_path: Path) -> None:
    full, ref = build_pair("gemma2")
    full.save_pretrained(tmp_path)
    sequences, logits = run_adapter(load_sharded(tmp_path, 0, 1))
    check_close("gemma2 loaded at size 1", logits, reference_logits(ref, sequences))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    full, _ = build_pair("llama")
    full.config.save_pretrained(tmp_path)
    state = {k: v for k, v in full.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no tensor for \['model.layers.1.mlp.up_proj.weight'\]"):
        load_sharded(tmp_path, 1, 2)
