"""examples/speculative_acceptance.py's core on tiny settings: a target and a smaller draft trained briefly on the
quickstart's text with one tokenizer, held-out prompts, n-gram and draft-model chains (and trees where the engine
serves them). Greedy outputs must equal those without speculation and the acceptance counts must be consistent."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from compile_attn.models.tiny_llama import (TinyLlamaRecipe, held_out_paragraphs, is_trained, load_tokenizer,
                                            python_docs_text, tiny_llama, tiny_llama_draft)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "speculative_acceptance.py"
# Just enough training that the models write the text's words (and so repeat themselves and agree sometimes).
TARGET = TinyLlamaRecipe(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=1, num_kv_heads=1,
                         batch_size=8, steps=40)
DRAFT = replace(TARGET, num_layers=1)


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("speculative_acceptance", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = tiny_llama(root / "target", recipe=TARGET)
    return target, tiny_llama_draft(target, root / "draft", recipe=DRAFT)


def test_the_draft_shares_the_targets_tokenizer_and_is_reused(models: tuple[Path, Path]) -> None:
    target, draft = models
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    assert is_trained(draft, recipe=DRAFT, tokenizer_from=target)
    assert not is_trained(draft, recipe=TARGET) and not is_trained(draft)  # another recipe is not this model
    stamp = (draft / "model.safetensors").stat().st_mtime_ns
    assert tiny_llama_draft(target, draft, recipe=DRAFT) == draft
    assert (draft / "model.safetensors").stat().st_mtime_ns == stamp


def test_held_out_paragraphs_are_the_end_of_the_stream_that_training_leaves_out(models: tuple[Path, Path]) -> None:
    tokenizer = load_tokenizer(models[0])
    paragraphs = python_docs_text().split("\n\n")
    held = held_out_paragraphs(tokenizer, paragraphs)
    assert held and held == paragraphs[len(paragraphs) - len(held):]
    lengths = [len(ids) + 1 for ids in tokenizer(paragraphs)["input_ids"]]  # BOS ... EOS per paragraph
    held_out_tokens = sum(lengths) - int(sum(lengths) * (1 - TinyLlamaRecipe.held_out_fraction))
    assert sum(lengths[-len(held):]) <= held_out_tokens < sum(lengths[-len(held) - 1:])  # all after the split


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Models this small run fastest on one thread (and do not slow down several-fold on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_greedy_is_identical_and_acceptance_counts_are_consistent(models: tuple[Path, Path], one_thread: None) -> None:
    example = load_example()
    target, draft = models
    prompts = example.held_out_prompts(target, count=3, prompt_tokens=16)
    assert len(prompts) == 3 and all(len(p) == 16 for p in prompts)
    methods = example.methods(draft, ks=[2], tree_topks=[2], tree_depth=2, tree_tokens=3)
    engine = dict(graph_mode="none", compile=False, max_batch_size=4, max_num_tokens=128, max_context=128,
                  page_size=4, device="cpu", dtype="float32")
    result = example.measure(target, methods, prompts, example.samplings(12, temperature=1.0), engine)

    assert not result.greedy_mismatches(), example.markdown_table(result.rows)
    measured = {(r.method, r.shape) for r in result.rows} | {tuple(k.split(" ", 1)) for k in result.skipped}
    assert measured == {(m.name, m.shape) for m in methods}
    assert all(m.is_tree for m in methods if f"{m.name} {m.shape}" in result.skipped)  # only trees may be refused
    plain_steps = {r.sampling: r.steps for r in result.rows if r.method == "none"}
    for row in result.rows:
        c = row.counts
        assert row.output_tokens == 3 * 12
        if row.method == "none":
            assert c == dict.fromkeys(example.COUNTS, 0)
            continue
        assert 0 <= c["accepted_tokens"] <= c["draft_tokens"], row
        assert c["verify_steps"] <= c["verified_requests"] <= c["draft_tokens"], row
        assert 0.0 <= row.acceptance_rate <= 1.0, row
        assert row.mean_accepted_length >= 1.0 or c["verified_requests"] == 0, row
        assert row.steps <= plain_steps[row.sampling], row  # every step gains each request a token at least
    drafted = [r for r in result.rows if r.method == "draft_model" and r.sampling == "greedy"]
    assert drafted and all(r.counts["verify_steps"] > 0 for r in drafted)  # a draft model proposes every step
    table = example.markdown_table(result.rows)
    assert table.count("\n") == len(result.rows) + 1
