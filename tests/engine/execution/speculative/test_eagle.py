"""EAGLE-1/2 heads in the engine on the CPU: checkpoints written here in the EAGLE format for a tiny random Llama
(random weights: the mechanics must not depend on trained ones). Greedy outputs equal HF ``generate`` and the run
without speculation (graph modes, chunked prompts, prefix-cache hits); heads built so that their drafts are known
(the target's newest token again; the target's own next token) check that the head reads the right target features
and that every such draft is accepted; malformed checkpoints and unsupported options are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaModel

from compile_attn.engine import LLM, SamplingParams
from compile_attn.engine.requests.errors import EngineOptionError
from tests.engine.execution.speculative.test_speculative_engine import make_llm
from tests.hf.hf_tiny_models import build_pair, hf_greedy, tiny_config

PROMPTS = [[(3 * i + j) % 11 + 1 for j in range(n)] for i, n in enumerate([5, 12, 30])]  # 30: two prefill chunks
NEW = 12


def write_head(path: Path, seed: int = 1, fc: torch.Tensor | None = None, silent: bool = False,
               embed: bool = False, safetensors: bool = True, **config_overrides: object) -> Path:
    """An EAGLE-1/2 head checkpoint for the tiny Llama: one layer without input_layernorm, ``fc`` [H, 2H] with a
    bias (random unless given); ``silent``: attention and MLP output projections zero (the layer passes its input
    through); ``embed``: its own copy of an embedding table."""
    config = tiny_config("llama", num_hidden_layers=1)
    for name, value in config_overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    layer = {k: v for k, v in LlamaModel(config).state_dict().items()
             if k.startswith("layers.0.") and "input_layernorm" not in k}
    if silent:
        layer["layers.0.self_attn.o_proj.weight"].zero_()
        layer["layers.0.mlp.down_proj.weight"].zero_()
    h = config.hidden_size
    weights = {**layer, "fc.weight": fc if fc is not None else torch.randn(h, 2 * h) * 0.1,
               "fc.bias": torch.zeros(h) if fc is not None else torch.randn(h) * 0.1}
    if embed:
        weights["embed_tokens.weight"] = torch.randn(config.vocab_size, h)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config.to_dict(), "bias": True}))
    if safetensors:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    else:
        torch.save(weights, path / "pytorch_model.bin")
    return path


def eagle(path: Path, k: int = 3, **more: object) -> dict:
    return {"method": "eagle", "model": str(path), "num_speculative_tokens": k, **more}


@pytest.fixture(scope="module")
def target():
    return build_pair("llama", attn="eager")


def generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))]


@pytest.mark.parametrize(("graph_mode", "compile"), [("none", False), ("full", False),
                                                      ("full_and_piecewise", True)])
def test_greedy_equals_hf_generate_with_a_random_head(target, tmp_path, graph_mode, compile) -> None:  # noqa: ANN001
    ours, stock = target
    options = {"compiler": "eager"} if compile else None
    llm = make_llm(ours, graph_mode=graph_mode, compile=compile, compile_options=options,
                   speculative_config=eagle(write_head(tmp_path / "head", embed=graph_mode == "full")))
    outs = generate(llm)
    assert outs == [hf_greedy(stock, p, NEW) for p in PROMPTS]
    stats = llm.speculator.stats
    assert stats.verify_steps > 0 and stats.draft_tokens > 0
    assert outs == generate(llm)  # again: every prompt now starts from the prefix cache
    assert llm.speculator.draft.steps > 0


@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_a_head_echoing_its_feature_drafts_the_newest_token(target, tmp_path, graph_mode) -> None:  # noqa: ANN001
    """fc = [0 | I] and a silent layer: the head's output is the target feature it is fed, so each draft is the
    target's argmax after f_{n-2}, i.e. the newest token x_{n-1}, again and again (drafts fed the head's own
    output, through the feature buffer that the head's decode graphs read). A feature off by one position would
    draft another token."""
    ours, _ = target
    h = ours.config.hidden_size
    fc = torch.cat((torch.zeros(h, h), torch.eye(h)), dim=1)
    llm = make_llm(ours, graph_mode=graph_mode, speculative_config=eagle(
        write_head(tmp_path / "echo", fc=fc, silent=True, safetensors=False)))
    seen = []
    draft = llm.speculator.draft
    propose = draft.propose

    def spy(requests, rooms, tree=None):  # noqa: ANN001, ANN202
        out = propose(requests, rooms, tree)
        seen.extend((r.token_ids[-1], drafts) for r, (drafts, _) in zip(requests, out))
        return out

    draft.propose = spy
    assert generate(llm) == generate(make_llm(ours))
    proposed = [(last, drafts) for last, drafts in seen if drafts]
    assert len(proposed) >= len(PROMPTS) * 3
    assert all(drafts == [last] * len(drafts) for last, drafts in proposed), proposed[:4]


def test_a_head_that_knows_the_target_has_every_draft_accepted(tmp_path) -> None:
    """A target whose layers are silent is a bigram model (next token = argmax of the LM head over norm(embed(x)));
    a head with fc = [I | 0] and a silent layer outputs embed(x_{t+1}), a positive multiple of the target's
    feature there: its drafts are the target's own tokens, all accepted."""
    ours, stock = build_pair("llama", attn="eager", seed=3)
    with torch.no_grad():
        for m in (ours, stock):
            for layer in m.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    h = ours.config.hidden_size
    fc = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    llm = make_llm(ours, speculative_config=eagle(write_head(tmp_path / "oracle", fc=fc, silent=True), k=3))
    assert generate(llm) == [hf_greedy(stock, p, NEW) for p in PROMPTS]
    stats = llm.speculator.stats
    assert stats.draft_tokens >= 3 * len(PROMPTS) * 2
    assert stats.accepted_tokens == stats.draft_tokens
    assert stats.mean_accepted_length > 3


def _config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(("breaks", "needle"), [
    ("no_dir", "EAGLE checkpoint directory"),
    ("no_weights", "has no weights"),
    ("bad_json", "cannot read"),
    ("no_fc", "no fc.weight"),
    ("extra_key", "unexpected ['norm.weight']"),
    ("hidden", "hidden_size 32 and the target 64"),
    ("vocab", "vocab_size 100 and the target 96"),
    ("eagle3_config", "EAGLE-3"),
    ("eagle3_fc", "EAGLE-3"),
])
def test_malformed_or_mismatched_heads_are_refused(target, tmp_path, breaks, needle) -> None:  # noqa: ANN001
    ours, _ = target
    path = tmp_path / "head"
    h = ours.config.hidden_size
    if breaks == "hidden":
        write_head(path, hidden_size=32, intermediate_size=48)
    elif breaks == "vocab":
        write_head(path, vocab_size=100)
    elif breaks == "eagle3_fc":
        write_head(path, fc=torch.zeros(h, 3 * h))
    elif breaks != "no_dir":
        write_head(path)
    if breaks == "no_weights":
        (path / "model.safetensors").unlink()
    elif breaks == "bad_json":
        (path / "config.json").write_text("{not json")
    elif breaks in ("no_fc", "extra_key"):
        from safetensors.torch import load_file

        weights = load_file(str(path / "model.safetensors"))
        if breaks == "no_fc":
            del weights["fc.weight"]
        else:
            weights["norm.weight"] = torch.ones(h)
        save_file(weights, str(path / "model.safetensors"))
    elif breaks == "eagle3_config":
        (path / "config.json").write_text(json.dumps({**_config_of(path), "draft_vocab_size": 32}))
    with pytest.raises(EngineOptionError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        make_llm(ours, speculative_config=eagle(path))


def test_unsupported_eagle_options_are_refused_before_loading(target, tmp_path) -> None:  # noqa: ANN001
    ours, _ = target
    with pytest.raises(EngineOptionError, match="'eagle3' is not supported.*supported: 'eagle'"):
        make_llm(ours, speculative_config={"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3})
    with pytest.raises(EngineOptionError, match="topk=2 .*not built for method 'eagle'"):
        make_llm(ours, speculative_config=eagle(tmp_path, topk=2))
    with pytest.raises(EngineOptionError, match="needs 'model'"):
        make_llm(ours, speculative_config={"method": "eagle", "num_speculative_tokens": 3})
