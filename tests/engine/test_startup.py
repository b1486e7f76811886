"""Start-up: ``LLM(config)`` creates its random weights on the target device in the target dtype (the same weights
as HF's own ``from_config`` on that device under the same seed, and the same greedy tokens as HF's generate on the
CPU), checkpoints load straight to the device, and on the GPU ``LLM(config)`` starts within 3 s of the same model
passed as a GPU instance and ``gpu_memory_utilization`` bounds the memory the engine takes."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.hf.hf_tiny_models import tiny_config  # noqa: E402

from compile_attn.engine import LLM, SamplingParams  # noqa: E402
from compile_attn.hf import load_model  # noqa: E402

PROMPTS = [[(5 * i + 3 * j + 1) % 96 for j in range(n)] for i, n in enumerate([3, 12, 7, 20])]
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                    max_position_embeddings=131072, rope_theta=500000.0)


def _hf_model(config: LlamaConfig, seed: int, dtype: torch.dtype, device: str, attn: str = "eager"):  # noqa: ANN202
    """HF's own model of ``config`` under ``seed``, built on ``device`` the ordinary way (on the CPU: no device
    context at all)."""
    torch.manual_seed(seed)
    if device == "cpu":
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).eval()
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).eval()


def _llm(config: object, seed: int, **options: object) -> LLM:
    torch.manual_seed(seed)
    return LLM(config, attn_backend="torch_native", graph_mode="none", compile=False, max_batch_size=4,
               max_num_tokens=64, max_context=64, capture=False, **options)


def _same_weights(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    mine = dict(ours.named_parameters())
    theirs = dict(ref.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, param in theirs.items():
        assert torch.equal(mine[name], param), name


# ---------------------------------------------------------------------------------------------------- CPU
def test_config_on_cpu_is_hf_model_of_the_same_seed() -> None:
    """fp32 on the CPU: the weights are those of HF's ordinary ``from_config`` under the same seed, and greedy
    generation gives HF's own greedy tokens (eager attention). The reference is built from the same config object
    after the engine: the engine's model keeps a copy, so the reference's attention setting does not reach it."""
    config = tiny_config("llama")
    llm = _llm(config, seed=7, device="cpu")
    ref = _hf_model(config, seed=7, dtype=torch.float32, device="cpu")
    _same_weights(llm.model.model, ref)
    assert {(p.device.type, p.dtype) for p in llm.model.parameters()} == {("cpu", torch.float32)}
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([prompt])
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == want


def test_config_in_bf16_is_created_in_bf16() -> None:
    """The dtype is set before construction: bf16 parameters straight away, equal to HF's ``from_config(config,
    dtype=bf16)`` under the same seed; a second seed gives other weights, the same seed the same ones."""
    config = tiny_config("qwen3")
    llm = _llm(config, seed=3, device="cpu", dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in llm.model.parameters()} == {("cpu", torch.bfloat16)}
    _same_weights(llm.model.model, _hf_model(config, seed=3, dtype=torch.bfloat16, device="cpu"))
    _same_weights(_llm(config, seed=3, device="cpu", dtype=torch.bfloat16).model.model, llm.model.model)
    other = _llm(config, seed=4, device="cpu", dtype=torch.bfloat16).model.model
    assert not torch.equal(other.lm_head.weight, llm.model.model.lm_head.weight)


def test_checkpoint_loads_in_the_requested_dtype(tmp_path: Path) -> None:
    """An fp32 checkpoint loaded as bf16 on the CPU: every parameter bf16 on the CPU, equal to the saved weights
    rounded to bf16 (through a device map where accelerate is installed, the CPU-then-move path otherwise)."""
    saved = _hf_model(tiny_config("llama"), seed=1, dtype=torch.float32, device="cpu")
    saved.save_pretrained(tmp_path)
    adapter = load_model(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert {(p.device.type, p.dtype) for p in adapter.model.parameters()} == {("cpu", torch.bfloat16)}
    for name, param in saved.named_parameters():
        assert torch.equal(adapter.model.get_parameter(name), param.to(torch.bfloat16)), name


# ---------------------------------------------------------------------------------------------------- GPU
def _free_device_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_config_weights_on_gpu_are_hf_model_built_on_gpu(tmp_path: Path) -> None:
    """On CUDA the weights come from CUDA's generator: equal to HF's model built under ``torch.device("cuda")``
    with the same seed (a CPU-initialised model of that seed differs). A checkpoint loads to the GPU in bf16."""
    config = tiny_config("llama")
    llm = _llm(config, seed=5, device="cuda", dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in llm.model.parameters()} == {("cuda", torch.bfloat16)}
    _same_weights(llm.model.model, _hf_model(config, seed=5, dtype=torch.bfloat16, device="cuda"))

    _hf_model(config, seed=1, dtype=torch.float32, device="cpu").save_pretrained(tmp_path)
    adapter = load_model(tmp_path, dtype=torch.bfloat16, device="cuda")
    assert {(p.device.type, p.dtype) for p in adapter.model.parameters()} == {("cuda", torch.bfloat16)}


@pytest.mark.gpu
def test_config_start_within_3_s_of_a_gpu_instance() -> None:
    """Llama-3.2-1B shape, random bf16: ``LLM(config)`` against ``LLM(instance)`` of a model already on the GPU,
    same options. The rest of start-up (sizing, backend, graphs) is the same code for both, so graphs are off
    and the KV size explicit to time the difference alone. A first start warms CUDA and the kernels up."""
    config = LlamaConfig(**LLAMA_3_2_1B)
    options = dict(attn_backend="triton", graph_mode="none", compile=False, max_batch_size=256,
                   max_num_tokens=8192, max_context=4096, kv_cache_tokens=65536, device="cuda",
                   dtype=torch.bfloat16)
    instance = _hf_model(config, seed=0, dtype=torch.bfloat16, device="cuda", attn="sdpa")
    LLM(instance, **options)  # warm-up start, dropped
    _free_device_memory()

    torch.manual_seed(0)
    start = time.perf_counter()
    from_config = LLM(config, **options)
    torch.cuda.synchronize()
    config_s = time.perf_counter() - start
    _same_weights(from_config.model.model, instance)  # the same model both ways
    del from_config
    _free_device_memory()

    start = time.perf_counter()
    LLM(instance, **options)
    torch.cuda.synchronize()
    instance_s = time.perf_counter() - start
    print(f"\nLLM(config) {config_s:.2f} s, LLM(GPU instance) {instance_s:.2f} s, "
          f"difference {config_s - instance_s:+.2f} s (target <= 3 s)")
    assert config_s - instance_s <= 3.0


@pytest.mark.gpu
def test_memory_utilization_bounds_the_engine() -> None:
    """Llama-3.2-1B shape with its 128k max_context, the issue's engine options and no kv_cache_tokens: the KV
    cache is sized from memory, holds at least one max_context request, and after capture, and after a batch of
    generation, at least (1 - gpu_memory_utilization) of the device's memory is still free."""
    _free_device_memory()
    utilization = 0.6
    torch.manual_seed(0)
    llm = LLM(LlamaConfig(**LLAMA_3_2_1B), attn_backend="triton", graph_mode="full_and_piecewise",
              max_batch_size=256, max_num_tokens=8192, gpu_memory_utilization=utilization, device="cuda",
              dtype=torch.bfloat16)
    free, total = torch.cuda.mem_get_info()
    tokens = llm.kv_cache.allocator.num_pages * llm.kv_cache.page_size
    print(f"\nKV cache {tokens:,} tokens ({llm.kv_cache.pool.bytes / 2**30:.2f} GiB, "
          f"{tokens / 131072:.1f} max-context requests); after capture {free / 2**30:.2f} GiB free of "
          f"{total / 2**30:.2f} GiB (must stay >= {(1 - utilization) * total / 2**30:.2f})")
    assert llm.kv_cache.max_context == 131072 and tokens >= 131072
    assert free >= (1 - utilization) * total
    prompts = [[(7 * i + j) % 10000 for j in range(256)] for i in range(256)]
    llm.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.6, top_p=0.9, top_k=50))
    free_after, _ = torch.cuda.mem_get_info()
    print(f"after generate: {free_after / 2**30:.2f} GiB free")
    assert free_after >= (1 - utilization) * total
