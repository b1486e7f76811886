"""EngineConfig: every keyword LLM took still works, ``LLM(model, config=...)`` builds the same engine as the
keywords, bad values and unknown keywords are refused before the model loads, and the command line builds the
same EngineConfig as the keywords would."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compile_attn import cli
from compile_attn.cli_options import engine_config
from compile_attn.engine import LLM, EngineConfig, EngineOptionError, SamplingParams, UnknownEngineOptionError
from compile_attn.errors import CompileAttnError, InvalidConfigError, UnknownBackendError
from compile_attn.models import ToyDecoder, ToyDecoderConfig
from tests.greedy_reference import greedy_by_recompute

CFG = ToyDecoderConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64)
ENGINE = dict(max_batch_size=3, max_num_tokens=16, kv_cache_tokens=96, max_context=40, page_size=4,
              graph_mode="none", compile=False, device="cpu")
PROMPTS = [[5, 9, 2], [(3 * j + 1) % 128 for j in range(13)], [7]]
# LLM's keywords before EngineConfig: each must still be accepted.
FORMER_KEYWORDS = {"attn_backend", "graph_mode", "compile", "max_batch_size", "max_num_tokens", "kv_cache_tokens",
                   "gpu_memory_utilization", "max_context", "page_size", "dtype", "device", "compile_options",
                   "capture"}


class NotLoaded(torch.nn.Module):
    """A model whose loading fails: a check that runs after loading would hit this instead of its own error."""

    def attention_layers(self) -> list:
        raise AssertionError("the model was loaded")


@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    torch.manual_seed(0)
    return ToyDecoder(CFG).eval()


def test_every_former_keyword_is_a_field_and_overlap_defaults_on() -> None:
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert FORMER_KEYWORDS <= set(fields)
    assert fields["overlap"].default is True


def test_config_and_keywords_build_the_same_engine(model: ToyDecoder) -> None:
    params = SamplingParams(max_new_tokens=5)
    expected = [greedy_by_recompute(model, p, 5) for p in PROMPTS]
    by_keywords = LLM(model, **ENGINE)
    by_config = LLM(model, config=EngineConfig(**ENGINE))
    for llm in (by_keywords, by_config):
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
        assert llm.config == EngineConfig(**ENGINE)
        assert (llm.kv_cache.allocator.num_pages, llm.kv_cache.req_to_token_pool.num_rows) == (96 // 4, 3 + 1)
    # keywords replace the config's fields
    smaller = LLM(model, config=EngineConfig(**ENGINE), max_batch_size=1, page_size=2)
    assert (smaller.scheduler.max_batch_size, smaller.kv_cache.req_to_token_pool.num_rows) == (1, 2)
    assert smaller.kv_cache.page_size == 2
    assert [o.token_ids for o in smaller.generate(PROMPTS, params)] == expected


def test_an_unknown_keyword_is_refused_before_the_model_loads() -> None:
    with pytest.raises(UnknownEngineOptionError, match="'max_batch'; did you mean max_batch_size") as exc:
        LLM(NotLoaded(), max_batch=4)
    assert isinstance(exc.value, TypeError) and isinstance(exc.value, CompileAttnError)
    with pytest.raises(UnknownEngineOptionError, match="'kv_tokens'"):
        LLM(NotLoaded(), config=EngineConfig(**ENGINE), kv_tokens=4)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (dict(page_size=0), EngineOptionError, r"page_size=...\) must be a positive int, got 0"),
        (dict(max_context=-3), EngineOptionError, r"max_context=...\) must be a positive int, got -3"),
        (dict(kv_cache_tokens=2.5), EngineOptionError, r"kv_cache_tokens=...\) must be a positive int, got 2.5"),
        (dict(gpu_memory_utilization=1.5), InvalidConfigError, "gpu_memory_utilization must be a number in"),
        (dict(attn_backend="nope"), UnknownBackendError, "unknown attention backend 'nope'"),
        (dict(graph_mode="fast"), ValueError, "unknown graph mode 'fast'"),
        (dict(compile_options={"no_such_option": 1}), ValueError, "unknown compile_attn option"),
        (dict(dtype="int8"), EngineOptionError, "is not a floating dtype"),
        (dict(device="gpu0"), EngineOptionError, "is not a device"),
    ],
)
def test_bad_values_are_refused_by_the_config_and_by_llm(options: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        EngineConfig(**options)
    with pytest.raises(error, match=message):
        LLM(NotLoaded(), **options)


def test_device_and_dtype_are_resolved() -> None:
    config = EngineConfig(device="cpu", dtype="half")
    assert (config.device, config.dtype) == (torch.device("cpu"), torch.float16)
    assert EngineConfig(device="cpu").dtype == torch.float32  # "auto": float32 on the CPU
    assert dataclasses.replace(config, max_batch_size=2).dtype == torch.float16  # resolved values stay valid


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["generate", "--device", "cpu"], dict(max_batch_size=8, max_num_tokens=2048, max_context=512)),
        (["serve", "m", "--device", "cpu", "--no-compile", "--graph-mode", "none", "--max-batch-size", "8",
          "--page-size", "4", "--kv-cache-tokens", "256", "--no-overlap"],
         dict(compile=False, graph_mode="none", max_batch_size=8, page_size=4, kv_cache_tokens=256, overlap=False)),
        (["throughput", "fixed", "--device", "cpu", "--backend", "torch_native", "--gpu-memory-utilization", "0.5",
          "--max-context", "300"],
         dict(attn_backend="torch_native", max_batch_size=256, max_num_tokens=8192, gpu_memory_utilization=0.5,
              max_context=300)),
    ],
)
def test_the_command_line_builds_the_same_config(argv: list[str], expected: dict) -> None:
    args = cli.build_parser().parse_args(argv)
    assert engine_config(args) == EngineConfig(device="cpu", **expected)
