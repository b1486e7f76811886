"""The engine with an fp8 KV cache on the CPU (torch_native): it generates; every graph mode, with and without
overlap, gives the eager serial loop's tokens (the scales are calibrated once, on the first prefill, whichever route
it takes); the pool takes a quarter of an fp32 cache's bytes; scales from a JSON file and from the checkpoint
directory reach the pool; bad options are refused by name before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compile_attn.engine import LLM, SamplingParams
from compile_attn.engine.requests.errors import EngineOptionError
from compile_attn.models import ToyDecoder, ToyDecoderConfig

CFG = ToyDecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64, sliding_window=11)
PROMPTS = [[(7 * i + j) % CFG.vocab_size for j in range(n)] for i, n in enumerate([3, 5, 2, 30, 1])]


@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    torch.manual_seed(0)
    return ToyDecoder(CFG).eval()


def make_llm(model: ToyDecoder, **kw: object) -> LLM:
    args = dict(max_batch_size=4, max_num_tokens=16, kv_cache_tokens=256, max_context=64, page_size=4,
                graph_mode="none", compile=False, device="cpu", kv_cache_dtype="fp8_e4m3")
    args.update(kw)
    return LLM(model, **args)


def tokens(llm: LLM, overlap: bool) -> list[list[int]]:
    llm.overlap = overlap
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=8))]


@pytest.fixture(scope="module", params=["fp8_e4m3", "fp8_e5m2"])
def eager(request: pytest.FixtureRequest, model: ToyDecoder) -> tuple[str, list[list[int]], list[torch.Tensor]]:
    llm = make_llm(model, kv_cache_dtype=request.param)
    out = tokens(llm, overlap=False)
    assert all(len(t) == 8 for t in out)
    assert llm.kv_cache.pool.scale_calibration is None  # calibrated on the first prefill
    return request.param, out, [s.clone() for s in llm.kv_cache.pool.k_scales]


@pytest.mark.parametrize(("graph_mode", "compile", "compiler"), [
    ("full", False, None),
    ("breakable", False, None),
    ("piecewise", True, "eager"),
    ("full_and_piecewise", True, "inductor"),
])
@pytest.mark.parametrize("overlap", [False, True])
def test_graph_modes_and_overlap_give_the_eager_tokens(model: ToyDecoder, eager, graph_mode: str,  # noqa: ANN001
                                                        compile: bool, compiler: str | None, overlap: bool) -> None:
    kv_cache_dtype, expected, scales = eager
    llm = make_llm(model, kv_cache_dtype=kv_cache_dtype, graph_mode=graph_mode, compile=compile,
                   compile_options={"compiler": compiler} if compile else None)
    assert tokens(llm, overlap=overlap) == expected
    # the same first prefill, so the same scales, whatever route the step took (eager, piecewise view, breakable;
    # Inductor's fused kernels round the K projection a little differently)
    for got, want in zip(llm.kv_cache.pool.k_scales, scales):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert sum(n for mode, n in llm.step_runner.runner.stats.runs.items() if mode != "none") > 0


def test_fp8_pool_is_a_quarter_of_fp32(model: ToyDecoder) -> None:
    fp8, fp32 = make_llm(model), make_llm(model, kv_cache_dtype="auto")
    assert fp8.kv_cache.pool.dtype == torch.float8_e4m3fn and fp32.kv_cache.pool.dtype == torch.float32
    assert fp8.kv_cache.pool.bytes * 4 == fp32.kv_cache.pool.bytes
    assert fp8.config.kv_cache_dtype == "fp8_e4m3" and make_llm(model, kv_cache_dtype="fp8").config.kv_cache_dtype \
        == "fp8_e4m3"


def test_default_sizing_fits_four_times_the_tokens_of_fp32(model: ToyDecoder, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from compile_attn.engine.execution import memory_profile

    monkeypatch.setattr(memory_profile, "host_available_bytes", lambda: 4 * 2**20)  # 1 MiB for the KV cache
    with caplog.at_level("INFO", logger="compile_attn"):
        fp8 = make_llm(model, kv_cache_tokens=None, max_batch_size=64, max_context=1024)
    fp32 = make_llm(model, kv_cache_tokens=None, max_batch_size=64, max_context=1024, kv_cache_dtype="auto")
    per_token = CFG.num_layers * 2 * CFG.num_kv_heads * CFG.head_dim  # elements of K and V per token
    assert fp8.kv_cache.pool.bytes == (fp8.kv_cache.pool.num_pages + 1) * fp8.kv_cache.page_size * per_token  # one byte each, scratch page too
    assert 4 * fp32.kv_cache.pool.num_pages <= fp8.kv_cache.pool.num_pages + 4
    assert "float8_e4m3fn KV cache: 1 byte(s) per element, 4x the tokens of a float32 cache" in caplog.text


def test_scales_from_a_json_file(model: ToyDecoder, tmp_path: Path) -> None:
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": [0.5, [0.25, 0.125]], "v_scale": [1, 2]}))
    llm = make_llm(model, kv_scales_path=str(path))
    pool = llm.kv_cache.pool
    assert pool.scale_calibration is None
    assert pool.k_scales[1].tolist() == [0.25, 0.125] and pool.v_scales[0].tolist() == [1.0, 1.0]
    tokens(llm, overlap=True)
    assert pool.k_scales[1].tolist() == [0.25, 0.125]  # no calibration on top


def test_scales_from_the_checkpoint_directory(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from compile_attn.models.tiny_llama import tiny_llama

    path = tiny_llama(tmp_path / "model", steps=20)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    save_file({f"model.layers.{i}.self_attn.{n}": torch.tensor(0.05 * (i + 1))
               for i in range(layers) for n in ("k_scale", "v_scale")}, str(path / "kv_scales.safetensors"))
    llm = LLM(str(path), max_batch_size=2, max_num_tokens=64, kv_cache_tokens=256, max_context=128,
              graph_mode="none", compile=False, device="cpu", kv_cache_dtype="fp8_e4m3")
    assert llm.kv_cache.pool.scale_calibration is None
    assert [s[0].item() for s in llm.kv_cache.pool.k_scales] == pytest.approx([0.05 * (i + 1) for i in range(layers)])
    (out,) = llm.generate(["A function is"], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


@pytest.mark.parametrize(("options", "match"), [
    (dict(kv_cache_dtype="int8"), r"LLM\(kv_cache_dtype='int8'\) is not a KV cache dtype; pass 'auto'"),
    (dict(kv_cache_dtype=torch.float16), r"is not a KV cache dtype"),
    (dict(kv_scales_path="s.json"), r"kv_cache_dtype is 'auto'; pass kv_cache_dtype='fp8_e4m3'"),
])
def test_bad_options_are_refused_before_the_model_loads(options: dict, match: str) -> None:
    class NotLoaded(torch.nn.Module):
        def attention_layers(self) -> list:
            raise AssertionError("the model was loaded")

    args = dict(max_batch_size=4, max_num_tokens=16, kv_cache_tokens=256, max_context=64, graph_mode="none",
                compile=False, device="cpu", kv_cache_dtype="auto")
    with pytest.raises(EngineOptionError, match=match):
        LLM(NotLoaded(), **{**args, **options})
