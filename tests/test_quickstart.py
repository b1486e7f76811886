"""The quickstart's path: a tiny Llama and its BPE tokenizer trained on Python's own prose, saved as an HF directory
and loaded through ``LLM(directory)`` with string prompts. Checked against HF itself (tokenizer, loss, generate)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compile_attn import LLM, SamplingParams
from compile_attn.models.tiny_llama import is_trained, python_docs_text, tiny_llama, train_tiny_llama

STEPS = 120  # enough for words; the quickstart trains longer
PROMPTS = ["A function is", "An exception is raised when", "The value of"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", steps=STEPS, seed=0)


def held_out_loss(model: torch.nn.Module, tokenizer, paragraphs: list[str]) -> float:
    """HF's own next-token loss over whole paragraphs, averaged per token."""
    total, count = 0.0, 0
    with torch.no_grad():
        for text in paragraphs:
            ids = torch.tensor([tokenizer(text)["input_ids"][:128]])
            total += model(input_ids=ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / count


def test_the_directory_is_an_hf_checkpoint_with_a_tokenizer_that_round_trips(trained: Path) -> None:
    tok = AutoTokenizer.from_pretrained(trained, local_files_only=True)
    for text in ["A function is an object.", python_docs_text().split("\n\n")[3], "naïve café: ü → ∑ \t tabs"]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
        assert tok.decode(ids, skip_special_tokens=True) == text
    config = json.loads((trained / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == len(tok)
    assert config["eos_token_id"] == tok.eos_token_id and config["bos_token_id"] == tok.bos_token_id


def test_training_lowers_the_held_out_loss_far_below_uniform(trained: Path) -> None:
    tok = AutoTokenizer.from_pretrained(trained, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(trained, local_files_only=True).eval()
    torch.manual_seed(1)
    untrained = AutoModelForCausalLM.from_config(model.config).eval()
    paragraphs = python_docs_text().split("\n\n")[-20:]  # the held-out end of the text
    uniform = math.log(len(tok))
    before, after = held_out_loss(untrained, tok, paragraphs), held_out_loss(model, tok, paragraphs)
    assert before > uniform - 0.5  # an untrained model is about uniform
    assert after < uniform - 1.5 and after < before - 1.5, (before, after, uniform)


def test_llm_with_string_prompts_matches_hf_generate_and_writes_words(trained: Path) -> None:
    llm = LLM(str(trained), compile=False, graph_mode="none", max_batch_size=4, max_context=128, page_size=4,
              device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    tok = AutoTokenizer.from_pretrained(trained, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(trained, local_files_only=True).eval()
    vocabulary = set(re.findall(r"[A-Za-z]+", python_docs_text()))
    words = []
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref, prompt
        assert out.text == tok.decode(ref, skip_special_tokens=True)
        words += re.findall(r"[A-Za-z]+", out.text)
    assert len(words) >= 10, outs
    known = sum(w in vocabulary for w in words) / len(words)
    assert known >= 0.8, f"only {known:.0%} of the generated words are words of the text: {[o.text for o in outs]}"


def test_training_is_reproducible_and_the_cache_is_reused(tmp_path: Path) -> None:
    a = train_tiny_llama(tmp_path / "a", steps=3, seed=0)
    b = train_tiny_llama(tmp_path / "b", steps=3, seed=0)
    c = train_tiny_llama(tmp_path / "c", steps=3, seed=1)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert is_trained(a, steps=3) and not is_trained(a) and not is_trained(tmp_path / "missing", steps=3)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert tiny_llama(a, steps=3) == a and (a / "model.safetensors").stat().st_mtime_ns == stamp  # reused
    (a / "training.json").unlink()  # an interrupted run: trained again
    assert tiny_llama(a, steps=3) == a and is_trained(a, steps=3)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds something other than a model"):
        train_tiny_llama(tmp_path / "notes", steps=1)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_cli_generate_with_the_trained_model_prints_its_text_and_no_random_weights_warning(
    trained: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    import compile_attn.models.tiny_llama as tiny
    from compile_attn import cli

    monkeypatch.setattr(tiny, "tiny_llama", lambda: trained)  # the module's model stands in for the cached one
    monkeypatch.setattr(tiny, "is_trained", lambda directory: True)
    argv = ["generate", "--model", cli.TRAINED_MODEL, "--no-compile", "--graph-mode", "none", "--device", "cpu",
            "--max-new-tokens", "6", "--ignore-eos", "--prompt", PROMPTS[0]]
    with caplog.at_level("WARNING", logger="compile_attn.cli"):
        assert cli.main(argv) == 0
    assert not [r for r in caplog.records if "random weights" in r.getMessage()]
    out = capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(trained, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(trained, local_files_only=True).eval()
    ids = torch.tensor([tok(PROMPTS[0])["input_ids"]])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, eos_token_id=None,
                      pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
    assert f"--- {PROMPTS[0]!r} -> (6 tokens, length)\n{tok.decode(ref, skip_special_tokens=True)}\n" in out
