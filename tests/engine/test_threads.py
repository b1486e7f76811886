"""Threads (CPU): the forward context belongs to the thread that set it and nests; two LLMs generating in two
threads give the tokens each gives alone (eager and compiled, ToyDecoder and a tiny HF Llama); one LLM called from
two threads at once refuses the second call with EngineBusyError instead of mixing batches."""

from __future__ import annotations

import threading

import pytest
import torch

from compile_attn import ForwardBatch, KVCache, create_backend, forward_context, get_forward_context, has_forward_context
from compile_attn.engine import LLM, EngineBusyError, SamplingParams
from compile_attn.errors import NoForwardContextError
from compile_attn.models import ToyDecoder, ToyDecoderConfig

from tests.hf.hf_tiny_models import build_pair  # noqa: E402

CFG = ToyDecoderConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64)
TOY_PROMPTS = [[(7 * i + 3 * j + 5) % 256 for j in range(n)] for i, n in enumerate([3, 17, 9, 30, 1, 5])]
HF_PROMPTS = [[(5 * i + 3 * j + 1) % 96 for j in range(n)] for i, n in enumerate([4, 12, 7, 20])]
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
ENGINE = dict(max_batch_size=4, max_num_tokens=16, kv_cache_tokens=256, max_context=64, page_size=4, device="cpu")


def _batch_and_backend(num_tokens: int) -> tuple[ForwardBatch, object]:
    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=16, max_batch_size=1, max_context=8, kv_cache_tokens=8)
    backend = create_backend("torch_native", kv, ToyDecoder(ToyDecoderConfig(num_layers=1)).attention_layers())
    row = kv.alloc_request()
    fb = ForwardBatch.build(req_pool_indices=[row], prefix_lens=[0], extend_lens=[num_tokens],
                            out_cache_loc=kv.alloc_extend([row], [num_tokens]), input_ids=list(range(num_tokens)))
    return fb, backend


def test_forward_context_is_per_thread_and_nests() -> None:
    (outer, backend), (inner, _) = _batch_and_backend(2), _batch_and_backend(3)
    seen: dict[str, object] = {}
    entered, release = threading.Event(), threading.Event()

    def other_thread() -> None:
        seen["before"] = has_forward_context()
        with forward_context(inner, backend):
            entered.set()
            release.wait(10)
            seen["inside"] = get_forward_context().batch
        seen["after"] = has_forward_context()

    with forward_context(outer, backend):
        t = threading.Thread(target=other_thread)
        t.start()
        entered.wait(10)
        assert get_forward_context().batch is outer  # the other thread's context is not ours
        with forward_context(inner, backend):
            assert get_forward_context().batch is inner
        assert get_forward_context().batch is outer  # the nested exit restored ours
        release.set()
        t.join(10)
    assert seen == {"before": False, "inside": inner, "after": False}
    assert not has_forward_context()
    with pytest.raises(NoForwardContextError):
        get_forward_context()


def test_compiled_code_sees_its_own_threads_context() -> None:
    """Dynamo guards on "is there a forward context" per thread: a function compiled with a context in one thread
    takes the other branch in a thread without one."""
    fb, backend = _batch_and_backend(2)

    @torch.compile(backend="eager", fullgraph=True)
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if has_forward_context() else x - 1

    results: dict[str, float] = {}
    started, release = threading.Event(), threading.Event()

    def with_context() -> None:
        with forward_context(fb, backend):
            results["thread"] = float(f(torch.zeros(1)))
            started.set()
            release.wait(10)

    t = threading.Thread(target=with_context)
    t.start()
    started.wait(10)
    results["main"] = float(f(torch.zeros(1)))  # while the other thread is still inside its context
    release.set()
    t.join(10)
    assert results == {"thread": 1.0, "main": -1.0}


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    toy = ToyDecoder(CFG).eval()
    hf, _ = build_pair("llama")
    return toy, hf


@pytest.mark.parametrize(("graph_mode", "compile"), [("full", False), ("piecewise", True)])
def test_two_llms_in_two_threads_give_their_own_tokens(models: tuple, graph_mode: str, compile: bool) -> None:
    toy, hf = models
    options = dict(graph_mode=graph_mode, compile=compile, compile_options={"compiler": "eager"} if compile else None)
    a, b = LLM(toy, **ENGINE, **options), LLM(hf, **ENGINE, **options)
    alone_a = [o.token_ids for o in a.generate(TOY_PROMPTS, PARAMS)]
    alone_b = [o.token_ids for o in b.generate(HF_PROMPTS, PARAMS)]
    results: dict[str, list] = {"a": [], "b": []}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(name: str, llm: LLM, prompts: list) -> None:
        try:
            barrier.wait(10)
            for _ in range(4):
                results[name].append([o.token_ids for o in llm.generate(prompts, PARAMS)])
        except BaseException as exc:  # noqa: BLE001  (reported below, with the thread's result)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=("a", a, TOY_PROMPTS)),
               threading.Thread(target=run, args=("b", b, HF_PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert results["a"] == [alone_a] * 4 and results["b"] == [alone_b] * 4
    assert not has_forward_context()  # nothing leaked into this thread
    ids = torch.tensor([HF_PROMPTS[0]])  # a plain HF forward outside the engine still runs stock attention
    assert hf(ids, attention_mask=torch.ones_like(ids)).logits.shape == (1, len(HF_PROMPTS[0]), 96)


def test_one_llm_from_two_threads_refuses_the_second_call(models: tuple) -> None:
    toy, _ = models
    llm = LLM(toy, **ENGINE, graph_mode="none", compile=False)
    alone = [o.token_ids for o in llm.generate(TOY_PROMPTS, PARAMS)]
    inside, release = threading.Event(), threading.Event()
    real = llm.backend.forward

    def slow_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        inside.set()
        release.wait(10)
        return real(*args, **kwargs)

    llm.backend.forward = slow_forward
    out: list = []
    t = threading.Thread(target=lambda: out.append([o.token_ids for o in llm.generate(TOY_PROMPTS, PARAMS)]))
    t.start()
    assert inside.wait(10)
    try:
        for call in (lambda: llm.generate(TOY_PROMPTS[:1], PARAMS), llm.step,
                     lambda: llm.add_request(TOY_PROMPTS[0], PARAMS)):
            with pytest.raises(EngineBusyError, match="another call on this LLM is running"):
                call()
    finally:
        release.set()
        t.join(60)
    del llm.backend.forward
    assert out == [alone]  # the running call was not disturbed; the refused ones queued nothing
    assert not llm.has_work() and llm.kv_cache.available_tokens == 256
    assert [o.token_ids for o in llm.generate(TOY_PROMPTS, PARAMS)] == alone
