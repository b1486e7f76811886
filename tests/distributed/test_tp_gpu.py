"""Tensor parallelism on 2 GPUs (NCCL): greedy tokens equal one GPU's in full CUDA graphs with compile, with
speculative chains and with an fp8 KV cache; shutdown is bounded and leaves no process. Skipped without 2 GPUs."""

from __future__ import annotations

import time

import pytest
import torch
from tests.hf.hf_tiny_models import build_pair

from compile_attn.batch import ForwardMode
from compile_attn.distributed import tp_size
from compile_attn.engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

PROMPTS = [[(7 * j + 3 * i + 1) % 96 for j in range(n)] * 2 for i, n in enumerate([5, 17, 9, 30])]
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)
OPTIONS = dict(device="cuda", dtype=torch.float32, max_batch_size=8, max_num_tokens=128, max_context=128,
               kv_cache_tokens=2048, compile=False)
STOP_BOUND_S = 25.0  # shutdown message, join (10 s at most), the bounded abort (10 s at most)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    model, _ = build_pair("llama")
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return str(path)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("case", ["full_graphs_compiled", "ngram_chains", "fp8_kv"])
def test_two_gpus_equal_one(llama: str, case: str) -> None:
    options = dict(OPTIONS)
    if case == "full_graphs_compiled":
        options.update(compile=True, compile_options={"cache_dir": None})
    if case == "fp8_kv":
        options["kv_cache_dtype"] = "fp8_e4m3"
    want = _tokens(LLM(llama, **options))
    if case == "ngram_chains":
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                         "prompt_lookup_max": 3}
    llm = LLM(llama, tensor_parallel_size=2, **options)
    workers = list(llm._tp.processes.values())
    got = _tokens(llm)
    if case == "ngram_chains":
        assert llm.steps_by_mode[ForwardMode.TARGET_VERIFY] > 0
    start = time.monotonic()
    llm.shutdown()
    stop_s = time.monotonic() - start
    assert got == want, case
    assert stop_s < STOP_BOUND_S, f"shutdown took {stop_s:.1f} s"
    assert not [w.pid for w in workers if w.is_alive()]
    assert tp_size() == 1


def test_custom_all_reduce_equals_nccl(llama: str) -> None:
    """bf16 on 2 GPUs: every all-reduce through FlashInfer's Lamport kernel (inside the compiled, captured graphs)
    gives the tokens that NCCL's gives (a sum of two operands rounds the same); the buffers are released at
    shutdown."""
    from compile_attn.distributed.lamport_all_reduce import active_workspace

    options = dict(OPTIONS, dtype=torch.bfloat16, compile=True, compile_options={"cache_dir": None})
    llm = LLM(llama, tensor_parallel_size=2, disable_custom_all_reduce=True, **options)
    assert active_workspace() is None
    want = _tokens(llm)
    llm.shutdown()
    # a second engine of the same model in this process compiles its own graph (test_compiled_model_isolation):
    # rank 0 reusing the first engine's piecewise graphs made the two ranks' all-reduce sequences differ (a hang)
    llm = LLM(llama, tensor_parallel_size=2, **options)
    assert active_workspace() is not None, "the fast all-reduce was not set up"
    got = _tokens(llm)
    llm.shutdown()
    assert got == want
    assert active_workspace() is None
