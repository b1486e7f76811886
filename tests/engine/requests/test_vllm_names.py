"""vLLM's option names: on ``LLM(...)`` each alias builds the same EngineConfig as our name, ``enforce_eager`` /
``trust_remote_code`` / ``enable_chunked_prefill`` take vLLM's meaning, ``seed`` makes unseeded sampling repeat;
unknown keywords get hints from vLLM's table first; on the command line (generate, throughput, serve) each vLLM flag
parses to the same EngineConfig as ours; docs/vllm_compat.md lists every name the table knows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from compile_attn import cli
from compile_attn.cli_options import check_engine_options, engine_config
from compile_attn.engine import LLM, EngineConfig, EngineOptionError, SamplingParams, UnknownEngineOptionError
from compile_attn.engine.requests import vllm_names
from compile_attn.models import ToyDecoder, ToyDecoderConfig

ROOT = Path(__file__).resolve().parents[3]
CFG = ToyDecoderConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64)
BASE = dict(device="cpu", kv_cache_tokens=256)  # EngineConfig's checks only
ENGINE = dict(device="cpu", kv_cache_tokens=256, max_context=64, graph_mode="none", compile=False)  # LLMs on the CPU


class NotLoaded(torch.nn.Module):
    """A model whose loading fails: a check that runs after loading would hit this instead of its own error."""

    def attention_layers(self) -> list:
        raise AssertionError("the model was loaded")


@pytest.mark.parametrize(
    ("vllm", "ours"),
    [
        (dict(max_model_len=300), dict(max_context=300)),
        (dict(max_num_seqs=5), dict(max_batch_size=5)),
        (dict(max_num_batched_tokens=64), dict(max_num_tokens=64)),
        (dict(block_size=16), dict(page_size=16)),
        (dict(enable_prefix_caching=False), dict(enable_prefix_cache=False)),
        (dict(enforce_eager=True), dict(graph_mode="none", compile=False)),
        (dict(enforce_eager=False), dict()),
        (dict(trust_remote_code=False), dict()),
        (dict(enable_chunked_prefill=True), dict()),
        (dict(seed=0), dict(seed=0)),
        (dict(tensor_parallel_size=1), dict(tensor_parallel_size=1)),
        (dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="fp8_e4m3")),
        (dict(dtype="half"), dict(dtype=torch.float16)),
        (dict(gpu_memory_utilization=0.5), dict(gpu_memory_utilization=0.5)),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
         dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')),
    ],
)
def test_each_vllm_keyword_sets_our_option(vllm: dict, ours: dict) -> None:
    assert EngineConfig.from_options(**BASE, **vllm) == EngineConfig(**{**BASE, **ours})


def test_an_offline_vllm_script_runs_unchanged() -> None:
    """vLLM's keywords and SamplingParams as an offline script passes them (the model: a module, here)."""
    torch.manual_seed(0)
    llm = LLM(model=ToyDecoder(CFG).eval(), dtype="float32", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=128, block_size=4, enforce_eager=True, seed=0, tensor_parallel_size=1,
              gpu_memory_utilization=0.9, kv_cache_dtype="auto", enable_prefix_caching=True, trust_remote_code=False,
              device="cpu", kv_cache_tokens=512)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert (llm.config.max_context, llm.config.max_batch_size, llm.config.page_size) == (64, 4, 4)
    assert llm.step_runner.graph_mode.value == "none" and not llm.config.compile


def test_seed_makes_unseeded_sampling_repeat() -> None:
    """Requests without a seed draw theirs from the engine's seeded generator: the same calls sample the same tokens
    on a new LLM of the same seed; without a seed (vLLM's default 0 aside), fresh random seeds."""
    torch.manual_seed(0)
    model = ToyDecoder(CFG).eval()
    params = SamplingParams(temperature=1.0, max_tokens=12)
    prompts = [[1, 2, 3], [7, 8]]

    def run(seed: int | None) -> list[list[int]]:
        llm = LLM(model, **ENGINE, seed=seed)
        return [o.token_ids for o in llm.generate(prompts, params)] + [o.token_ids for o in llm.generate(prompts,
                                                                                                          params)]

    assert run(7) == run(7)
    torch.manual_seed(1)  # the unseeded default draws from torch's generator: another state, other seeds
    first = run(None)
    torch.manual_seed(2)
    assert first != run(None)
    with pytest.raises(EngineOptionError, match=r"seed=...\) must be an int"):
        LLM(NotLoaded(), seed=-1)


def test_trust_remote_code_true_is_refused_before_the_model_loads() -> None:
    with pytest.raises(EngineOptionError, match="trust_remote_code=True. is refused: compile_attn runs only the model "
                                                "code that ships with transformers"):
        LLM(NotLoaded(), trust_remote_code=True)
    with pytest.raises(EngineOptionError, match="enable_chunked_prefill=False. is refused: prefills are always "
                                                "chunked"):
        LLM(NotLoaded(), enable_chunked_prefill=False)


def test_an_alias_next_to_our_name_must_agree() -> None:
    with pytest.raises(EngineOptionError, match="got max_model_len=300 and max_context=200, which set max_context "
                                                "differently .vLLM's max_model_len is our max_context."):
        LLM(NotLoaded(), max_model_len=300, max_context=200)
    with pytest.raises(EngineOptionError, match="enforce_eager=True means graph_mode='none', compile=False"):
        LLM(NotLoaded(), enforce_eager=True, graph_mode="full")
    assert EngineConfig.from_options(max_num_seqs=4, max_batch_size=4).max_batch_size == 4  # the same value: fine


@pytest.mark.parametrize(
    ("keyword", "hint"),
    [
        ("max_num_seq", "did you mean max_num_seqs (vLLM's name for max_batch_size)"),
        ("gpu_memory_utilisation", "did you mean gpu_memory_utilization?"),
        ("kv_cache_dtyp", "did you mean kv_cache_dtype"),
        ("max_model_length", "did you mean max_model_len (vLLM's name for max_context)"),
        ("enforce_eagre", "did you mean enforce_eager"),
        ("swap_space", "swap_space=...) is vLLM's option, not taken here: preempted requests are recomputed"),
        ("quantization", "quantization=...) is vLLM's option, not taken here: quantized weights"),
    ],
)
def test_unknown_keywords_are_hinted_from_vllms_table_first(keyword: str, hint: str) -> None:
    with pytest.raises(UnknownEngineOptionError) as exc:
        LLM(NotLoaded(), **{keyword: 1})
    assert hint in str(exc.value)


def test_the_table_does_not_shadow_our_fields() -> None:
    fields = set(EngineConfig.__dataclass_fields__)
    assert set(vllm_names.ALIASES.values()) <= fields
    assert not vllm_names.vllm_names() & fields  # a vLLM name that is also ours would never be translated


# ------------------------------------------------------------------ the command line
FLAGS = [
    (["--max-model-len", "300"], ["--max-context", "300"]),
    (["--max-num-seqs", "5"], ["--max-batch-size", "5"]),
    (["--max-num-batched-tokens", "64"], ["--max-num-tokens", "64"]),
    (["--block-size", "16"], ["--page-size", "16"]),
    (["--enforce-eager"], ["--graph-mode", "none", "--no-compile"]),
    (["--no-enable-prefix-caching"], ["--no-prefix-cache"]),
    (["--enable-prefix-caching"], []),
    (["--enable-chunked-prefill"], []),
    (["-tp", "1"], ["--tensor-parallel-size", "1"]),
    (["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8_e4m3"]),
]
COMMANDS = {"generate": ["generate"], "throughput": ["throughput", "fixed"], "serve": ["serve", "org/model"]}


def _config(argv: list[str]) -> EngineConfig:
    args = cli.build_parser().parse_args(argv)
    check_engine_options(args)
    return engine_config(args)


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("vllm", "ours"), FLAGS, ids=[" ".join(f[0]) for f in FLAGS])
def test_each_vllm_flag_sets_our_option(command: str, vllm: list[str], ours: list[str]) -> None:
    base = [*COMMANDS[command], "--device", "cpu"]
    assert _config(base + vllm) == _config(base + ours)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_dtype_seed_tokenizer_revision_flags(command: str) -> None:
    config = _config([*COMMANDS[command], "--device", "cpu", "--dtype", "bfloat16", "--seed", "3", "--tokenizer",
                      "org/tok", "--revision", "v1"])
    assert (config.dtype, config.seed, config.tokenizer, config.revision) == (torch.bfloat16, 3, "org/tok", "v1")


def test_a_vllm_serving_scripts_flags_parse() -> None:
    argv = ["serve", "meta-llama/Llama-3.2-1B", "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--block-size", "16", "--enforce-eager",
            "--seed", "0", "--enable-prefix-caching", "--tensor-parallel-size", "1", "--kv-cache-dtype", "auto",
            "--gpu-memory-utilization", "0.8", "--revision", "main"]
    config = _config(argv)
    assert (config.max_context, config.max_batch_size, config.max_num_tokens, config.page_size) == (512, 8, 256, 16)
    assert (config.graph_mode, config.compile, config.seed, config.revision) == ("none", False, 0, "main")


def test_refused_and_unknown_flags_name_the_reason_or_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["serve", "m", "--trust-remote-code"], "--trust-remote-code is refused: compile_attn runs only the model code"),
        (["serve", "m", "--swap-space", "4"], "--swap-space is vLLM's option, not taken here: preempted requests"),
        (["generate", "--gpu-memory-utilisation", "0.5"], "did you mean --gpu-memory-utilization?"),
        (["throughput", "fixed", "--enforce-eager", "--graph-mode", "full"], "--enforce-eager runs without CUDA "
                                                                             "graphs, but --graph-mode is 'full'"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err, err
        assert err.startswith(f"compile-attn {argv[0]}: error: ") and err.count("\n") == 1, err


# ------------------------------------------------------------------ the doc page
def test_the_doc_page_lists_every_name_the_table_knows() -> None:
    doc = (ROOT / "docs" / "vllm_compat.md").read_text()
    names = set(re.findall(r"`([a-z_]+)`", doc))
    missing = sorted(vllm_names.vllm_names() - names)
    assert not missing, f"docs/vllm_compat.md does not list {missing}"
    for flag in ["--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--enforce-eager",
                 "--dtype", "--seed", "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--tensor-parallel-size", "--kv-cache-dtype", "--trust-remote-code", "--tokenizer", "--revision"]:
        assert f"`{flag}" in doc, flag
    assert "docs/vllm_compat.md" in (ROOT / "README.md").read_text()
