"""load_model from a local directory (config + safetensors + tokenizer) and from a config, offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.hf.hf_steps import random_sequences, run_scenario
from tests.hf.hf_tiny_models import build_pair, tiny_config
from tests.reference import max_rel_error
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from compile_attn.hf import HFModelAdapter, load_model


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"<unk>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


def test_load_local_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours, ref = build_pair("qwen2", attn="eager")
    ours.save_pretrained(tmp_path, safe_serialization=True)
    _save_tokenizer(tmp_path, ours.config.vocab_size)
    assert any(p.suffix == ".safetensors" for p in tmp_path.iterdir())

    adapter = load_model(tmp_path, dtype=torch.float32)
    assert isinstance(adapter, HFModelAdapter)
    assert adapter.model.config._attn_implementation == "compile_attn"
    assert not adapter.model.training
    assert adapter.tokenizer is not None
    assert adapter.tokenizer.convert_tokens_to_ids(["w3", "w5", "w7"]) == [
        3,
        5,
        7,
    ]  # our vocab, read from disk

    kv = adapter.make_kv_cache(max_batch_size=8, max_context=64, kv_cache_tokens=256)
    sequences = random_sequences(adapter.vocab_size, seed=4)
    logits = run_scenario(adapter, kv, "torch_native", adapter.attention_layers(), sequences)
    with torch.no_grad():
        for seq, got in zip(sequences, logits, strict=True):
            assert max_rel_error(got, ref(seq[None]).logits[0]) <= 1e-4


def test_load_without_tokenizer_and_from_config(tmp_path: Path) -> None:
    ours, _ = build_pair("llama")
    ours.save_pretrained(tmp_path)
    adapter = load_model(str(tmp_path))
    assert adapter.tokenizer is None
    assert adapter.dtype == torch.float32
    for name, param in adapter.model.state_dict().items():
        assert torch.equal(param, ours.state_dict()[name]), name

    fresh = load_model(tiny_config("gemma3"), dtype=torch.float32)
    assert type(fresh.model).__name__ == "Gemma3ForCausalLM"
    assert len(fresh.attention_layers()) == 2


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a local directory .* does not exist.*nor a Hugging Face "
                                                "model id"):  # ModelNotFoundError, as LLM() and every command say
        load_model(tmp_path / "does-not-exist")
