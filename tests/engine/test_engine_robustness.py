"""A bad request or a failed step never corrupts the engine (CPU, ToyDecoder with 256 tokens, a tiny HF Llama).

Malformed prompts and sampling parameters are refused by name before anything is queued; a step that raises
(a backend error or KeyboardInterrupt on the Nth attention call) is undone; a generate call that raised leaves
nothing queued. After every failure the same LLM's pool accounting is exact and its next generate gives the
same tokens as a fresh LLM's (greedy), which equal the no-cache recompute.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compile_attn.engine import (
    LLM,
    EngineOptionError,
    InvalidRequestError,
    RequestTypeError,
    SamplingParams,
)
from compile_attn.errors import CompileAttnError
from compile_attn.kv.page_account import page_account
from compile_attn.models import ToyDecoder, ToyDecoderConfig
from tests.greedy_reference import greedy_by_recompute

VOCAB = 256
CFG = ToyDecoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64)
PROMPTS = [[(7 * i + 3 * j + 5) % VOCAB for j in range(n)] for i, n in enumerate([3, 17, 9, 30, 1, 5])]
N_NEW = 6
PARAMS = SamplingParams(max_new_tokens=N_NEW)
ENGINE = dict(max_batch_size=4, max_num_tokens=16, kv_cache_tokens=64, max_context=48, page_size=4,
              graph_mode="none", compile=False, device="cpu")  # a pool small enough to preempt


@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    torch.manual_seed(0)
    return ToyDecoder(CFG).eval()


@pytest.fixture(scope="module")
def reference(model: ToyDecoder) -> list[list[int]]:
    """A fresh LLM's greedy tokens for PROMPTS, checked against the no-cache recompute."""
    outs = [o.token_ids for o in LLM(model, **ENGINE).generate(PROMPTS, PARAMS)]
    assert outs == [greedy_by_recompute(model, p, N_NEW) for p in PROMPTS]
    return outs


@pytest.fixture(scope="module")
def llm(model: ToyDecoder) -> LLM:
    """One LLM shared by the module's tests: each leaves it idle, and the next checks it is healthy."""
    return LLM(model, **ENGINE)


def assert_idle_and_exact(llm: LLM) -> None:
    """Nothing queued, every page free (or held only by the prefix cache) and every request row free: the pool's
    accounting equals a fresh cache's."""
    kv = llm.kv_cache
    assert not llm.has_work()
    account = page_account(kv)
    assert account.running == 0 and account.free + account.cached_only == kv.allocator.num_pages
    assert kv.available_tokens == kv.allocator.num_pages * kv.page_size
    assert kv.req_to_token_pool.available == kv.req_to_token_pool.max_batch_size
    assert not kv._pages and not kv._lens
    assert int(kv.req_to_token.abs().sum()) == 0  # every entry back at the scratch slot


def assert_consistent(llm: LLM) -> None:
    """Between steps: each running request's KV holds exactly its num_cached tokens, waiting ones hold none, and
    the pages held plus the free ones are every page."""
    kv = llm.kv_cache
    for r in llm.scheduler.running:
        assert r.row is not None and kv._lens[r.row] == r.num_cached, r
    for r in llm.scheduler.waiting:
        assert r.row is None and r.num_cached == 0, r
    page_account(kv)  # the pages held (each once), the cached-only ones and the free ones are every page
    assert len(kv._pages) == len(llm.scheduler.running)


def assert_healthy(llm: LLM, reference: list[list[int]]) -> None:
    assert_idle_and_exact(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference
    assert_idle_and_exact(llm)


class BackendFailure(RuntimeError):
    pass


def fail_on_attention_call(llm: LLM, n: int, exc: BaseException) -> Callable[[], int]:
    """Make the backend raise ``exc`` on its ``n``-th attention call from now; returns a function that restores it
    and tells how many calls were made."""
    real = llm.backend.forward
    calls = 0

    def forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        nonlocal calls
        calls += 1
        if calls == n:
            raise exc
        return real(*args, **kwargs)

    llm.backend.forward = forward

    def restore() -> int:
        del llm.backend.forward
        return calls

    return restore


# ---------------------------------------------------------------------------------------------- admission
@pytest.mark.parametrize("bad", [[3, VOCAB], [-1, 2], [10**6], [VOCAB + 5, 1, 2]])
def test_token_ids_outside_the_vocabulary_are_refused_whole(llm: LLM, reference: list[list[int]], bad: list[int]) -> None:
    next_id = llm._next_id
    wrong = next(t for t in bad if not 0 <= t < VOCAB)
    with pytest.raises(InvalidRequestError, match=rf"prompt 1 has token id {wrong} .*vocabulary \[0, {VOCAB}\)"):
        llm.generate([PROMPTS[0], bad, PROMPTS[1]], PARAMS)
    with pytest.raises(InvalidRequestError, match=f"token id {wrong}"):
        llm.add_request(bad, PARAMS)
    assert llm._next_id == next_id  # nothing of the refused calls was created or queued
    assert_healthy(llm, reference)


def test_hf_llama_vocabulary_is_checked_and_a_failed_generate_recovers() -> None:
    from tests.hf.hf_tiny_models import build_pair

    ours, stock = build_pair("llama")
    llm = LLM(ours, **ENGINE)
    assert llm.vocab_size == 96
    with pytest.raises(InvalidRequestError, match=r"token id 96 .*\[0, 96\)"):
        llm.generate([[1, 2], [5, 96]], PARAMS)
    assert_idle_and_exact(llm)
    prompt = [5, 95, 3]
    ids = torch.tensor([prompt])
    ref = stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    assert llm.generate([prompt], {"max_new_tokens": 4, "ignore_eos": True})[0].token_ids == ref
    for n, exc in ((3, KeyboardInterrupt()), (6, BackendFailure("injected"))):  # fail mid-generate, then recover
        restore = fail_on_attention_call(llm, n, exc)
        with pytest.raises(type(exc)):
            llm.generate([[1, 2, 3, 4, 5], prompt], {"max_new_tokens": 4, "ignore_eos": True})
        restore()
        assert_idle_and_exact(llm)
        assert llm.generate([prompt], {"max_new_tokens": 4, "ignore_eos": True})[0].token_ids == ref


@pytest.mark.parametrize(
    "prompt",
    [tuple(PROMPTS[1]), torch.tensor(PROMPTS[1]), torch.tensor(PROMPTS[1], dtype=torch.int32),
     np.array(PROMPTS[1]), np.array(PROMPTS[1], dtype=np.uint8), [np.int64(t) for t in PROMPTS[1]]],
    ids=["tuple", "tensor-int64", "tensor-int32", "numpy-int64", "numpy-uint8", "numpy-scalars"],
)
def test_tensor_array_and_tuple_prompts_are_token_ids(llm: LLM, reference: list[list[int]], prompt: object) -> None:
    assert llm.generate(prompt, PARAMS)[0].token_ids == reference[1]  # one prompt
    outs = llm.generate([PROMPTS[0], prompt], PARAMS)  # a list of prompts
    assert [o.token_ids for o in outs] == reference[:2] and outs[1].prompt_token_ids == PROMPTS[1]
    assert_idle_and_exact(llm)


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        (torch.tensor([PROMPTS[0]]), RequestTypeError, r"2-D tensor of shape \(1, 3\).*list\(batch\)"),
        (torch.tensor(3), RequestTypeError, "0-D tensor"),
        (torch.tensor([1.0, 2.0]), RequestTypeError, "dtype torch.float32.*integer dtype"),
        (torch.tensor([True, False]), RequestTypeError, "dtype torch.bool"),
        (np.array([1.5, 2.0]), RequestTypeError, "NumPy array of dtype float64"),
        (np.zeros((2, 2), dtype=np.int64), RequestTypeError, "2-D NumPy array"),
        ([], None, None),  # zero prompts: nothing to do
        ([[]], InvalidRequestError, "prompt 0 is empty"),
        (torch.tensor([], dtype=torch.long), InvalidRequestError, "prompt 0 is empty"),
        ("hello", RequestTypeError, "is a string .* no tokenizer.*tokenizer="),
        ([[1, True]], RequestTypeError, r"got True \(bool\)"),
        ([[1, 2.5]], RequestTypeError, r"got 2.5 \(float\)"),
        ([[1, 2**64]], RequestTypeError, f"got {2**64}"),
        ([None], RequestTypeError, "prompt 0 must be .*got NoneType"),
        (None, RequestTypeError, "prompts must be .*got NoneType"),
        ({1: 2}, RequestTypeError, "prompts must be .*got dict"),
    ],
)
def test_malformed_prompts_are_refused_by_name(llm: LLM, prompt: object, error: type | None, message: str) -> None:
    if error is None:
        assert llm.generate(prompt, PARAMS) == []
    else:
        with pytest.raises(error, match=message):
            llm.generate(prompt, PARAMS)
        if isinstance(prompt, (list, torch.Tensor, np.ndarray, str)):  # the same after a good prompt: refused whole
            batch = [PROMPTS[0], *prompt] if isinstance(prompt, list) else [PROMPTS[0], prompt]
            with pytest.raises(error, match=message.replace("prompt 0", "prompt 1")):
                llm.generate(batch, PARAMS)
    assert_idle_and_exact(llm)


def test_generate_takes_a_dict_of_sampling_params(llm: LLM, reference: list[list[int]]) -> None:
    outs = llm.generate(PROMPTS, {"max_new_tokens": 2})
    assert [o.token_ids for o in outs] == [r[:2] for r in reference]
    outs = llm.generate(PROMPTS[:2], [{"max_new_tokens": 1}, SamplingParams(max_new_tokens=3)])
    assert [o.token_ids for o in outs] == [reference[0][:1], reference[1][:3]]
    req = llm.add_request(PROMPTS[2], {"max_new_tokens": 2})
    while llm.has_work():
        llm.step()
    assert req.output_ids == reference[2][:2]
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter.*'max_len'.*known: .*max_new_tokens"):
        llm.generate(PROMPTS, {"max_len": 2})
    with pytest.raises(InvalidRequestError, match="got 1 SamplingParams for 6 prompts"):
        llm.generate(PROMPTS, [PARAMS])
    with pytest.raises(RequestTypeError, match="SamplingParams or a dict.*got int"):
        llm.generate(PROMPTS, 3)
    assert_idle_and_exact(llm)


# ---------------------------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_new_tokens": 2.5}, RequestTypeError, r"max_new_tokens must be an int, got 2.5"),
        ({"max_new_tokens": True}, RequestTypeError, r"max_new_tokens must be an int, got True"),
        ({"max_new_tokens": 0}, InvalidRequestError, r"max_new_tokens must be >= 1, got 0"),
        ({"temperature": math.nan}, InvalidRequestError, "temperature must be finite, got nan"),
        ({"temperature": math.inf}, InvalidRequestError, "temperature must be finite, got inf"),
        ({"temperature": -0.5}, InvalidRequestError, "temperature must be >= 0"),
        ({"temperature": "hot"}, RequestTypeError, "temperature must be a number"),
        ({"top_k": 2.5}, RequestTypeError, "top_k must be an int, got 2.5"),
        ({"top_k": -2}, InvalidRequestError, "top_k must be >= -1"),
        ({"top_p": 0.0}, InvalidRequestError, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, InvalidRequestError, r"top_p must be in \(0, 1\]"),
        ({"top_p": math.nan}, InvalidRequestError, "top_p must be finite"),
        ({"seed": 2**64}, InvalidRequestError, "seed must be in .*int64"),
        ({"seed": 2**63}, InvalidRequestError, "seed must be in"),
        ({"seed": 1.0}, RequestTypeError, "seed must be an int"),
        ({"stop_token_ids": [1.7]}, RequestTypeError, "stop_token_ids entry must be an int, got 1.7"),
        ({"stop_token_ids": [-3]}, InvalidRequestError, "stop_token_ids entry must be >= 0"),
        ({"stop_token_ids": 5}, RequestTypeError, "stop_token_ids must be a sequence"),
        ({"ignore_eos": 1}, RequestTypeError, "ignore_eos must be a bool, got 1"),
        ({"min_tokens": -1}, InvalidRequestError, "min_tokens must be >= 0"),
        ({"min_tokens": 17}, InvalidRequestError, "min_tokens=17 is more than max_new_tokens=16"),
        ({"min_tokens": 2.0}, RequestTypeError, "min_tokens must be an int"),
        ({"skip_special_tokens": "no"}, RequestTypeError, "skip_special_tokens must be a bool"),
        ({"include_stop_str_in_output": 1}, RequestTypeError, "include_stop_str_in_output must be a bool"),
    ],
)
def test_bad_sampling_params_are_refused_by_name(llm: LLM, kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)
    with pytest.raises(error, match=message):  # the same through generate's dict form, with a good prompt
        llm.generate([PROMPTS[0]], kwargs)
    assert issubclass(error, CompileAttnError) and issubclass(error, ValueError)
    assert_idle_and_exact(llm)


def test_sampling_params_normalise_to_python_values() -> None:
    sp = SamplingParams(max_new_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(4),
                        stop_token_ids=[np.int64(7), 9], seed=np.uint32(5), ignore_eos=np.bool_(True))
    assert (sp.max_new_tokens, sp.top_k, sp.stop_token_ids, sp.seed) == (3, 4, (7, 9), 5)
    assert [type(v) for v in (sp.max_new_tokens, sp.temperature, sp.top_k, sp.seed, sp.ignore_eos)] == \
        [int, float, int, int, bool]
    assert SamplingParams(seed=-(2**63), temperature=2).temperature == 2.0


def test_engine_options_are_checked_before_the_model_loads() -> None:
    class NotLoaded(torch.nn.Module):  # loading it would fail: the checks must come first
        def attention_layers(self) -> list:
            raise AssertionError("the model was loaded")

    for option, value in [("page_size", 0), ("max_batch_size", -1), ("max_num_tokens", 2.5), ("max_context", 0),
                          ("kv_cache_tokens", True)]:
        with pytest.raises(EngineOptionError, match=f"{option}=...\\) must be a positive int, got {value!r}"):
            LLM(NotLoaded(), **{**ENGINE, option: value})
    if not torch.cuda.is_available():
        with pytest.raises(EngineOptionError, match="CUDA is not available.*device='cpu'"):
            LLM(NotLoaded(), **{**ENGINE, "device": "cuda"})
    with pytest.raises(EngineOptionError, match="is not a device"):
        LLM(NotLoaded(), **{**ENGINE, "device": "gpu0"})


# ---------------------------------------------------------------------------------------------- failed steps
@pytest.mark.parametrize("make_exc", [lambda: BackendFailure("injected"), KeyboardInterrupt], ids=["error", "interrupt"])
def test_a_failed_step_is_undone_and_stepping_on_gives_the_right_tokens(llm: LLM, reference: list[list[int]],
                                                                      make_exc: Callable[[], BaseException]) -> None:
    reqs = [llm.add_request(p, PARAMS) for p in PROMPTS]
    failures = 0
    for n in (1, 4, 7, 2, 9, 3):  # the Nth attention call from where the last failure left off
        restore = fail_on_attention_call(llm, n, make_exc())
        try:
            while llm.has_work():
                llm.step()
        except (BackendFailure, KeyboardInterrupt):
            failures += 1
        restore()
        assert_consistent(llm)
    assert failures >= 4
    while llm.has_work():
        llm.step()
    assert [r.output_ids for r in reqs] == reference
    assert all(r.finish_reason == "length" for r in reqs)
    assert_healthy(llm, reference)


def test_a_step_interrupted_while_scheduling_gives_back_its_rows(llm: LLM, reference: list[list[int]]) -> None:
    """KeyboardInterrupt after the scheduler admitted requests (rows taken) but before their KV was allocated: the
    queues are as before the step, the admitted requests' rows free again."""
    reqs = [llm.add_request(p, PARAMS) for p in PROMPTS]

    def interrupted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    for _ in range(3):
        queues = (list(llm.scheduler.waiting), list(llm.scheduler.running))
        rows_free = llm.kv_cache.req_to_token_pool.available
        llm.kv_cache.alloc_extend = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.step()
        del llm.kv_cache.alloc_extend
        assert (list(llm.scheduler.waiting), list(llm.scheduler.running)) == queues
        assert llm.kv_cache.req_to_token_pool.available == rows_free
        assert_consistent(llm)
        llm.step()
    while llm.has_work():
        llm.step()
    assert [r.output_ids for r in reqs] == reference
    assert_healthy(llm, reference)


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("make_exc", [lambda: BackendFailure("injected"), KeyboardInterrupt], ids=["error", "interrupt"])
def test_a_generate_that_raised_leaves_nothing_of_its_own_queued(llm: LLM, reference: list[list[int]], n: int,
                                                                 make_exc: Callable[[], BaseException]) -> None:
    other = llm.add_request(PROMPTS[4], PARAMS)  # queued by another caller: it survives the failed call
    restore = fail_on_attention_call(llm, n, make_exc())
    with pytest.raises((BackendFailure, KeyboardInterrupt)):
        llm.generate(PROMPTS, PARAMS)
    restore()
    assert_consistent(llm)
    assert list(llm.scheduler.waiting) + llm.scheduler.running == [other]
    while llm.has_work():
        llm.step()
    assert other.output_ids == reference[4]
    assert_healthy(llm, reference)


def test_a_failed_step_in_graph_and_compiled_modes_is_undone(model: ToyDecoder, reference: list[list[int]]) -> None:
    for options in (dict(graph_mode="full"), dict(graph_mode="piecewise", compile=True,
                                                  compile_options={"compiler": "eager"})):
        llm = LLM(model, **{**ENGINE, **options})
        for n in (2, 5, 11):
            llm.kv_cache.prefix_cache.clear()  # the prompts computed again: as many attention calls as the first time
            restore = fail_on_attention_call(llm, n, KeyboardInterrupt())
            with pytest.raises(KeyboardInterrupt):
                llm.generate(PROMPTS, PARAMS)
            restore()
            assert_healthy(llm, reference)


class PaddedHead(torch.nn.Module):
    """ToyDecoder whose LM head has 4 more outputs than its embedding has rows (a padded head): token 258 wins
    exactly where the input is TRIGGER at position 2, so one request samples a token the next step could not
    embed."""

    TRIGGER = 200

    def __init__(self, inner: ToyDecoder) -> None:
        super().__init__()
        self.inner, self.embed = inner, inner.embed

    def attention_layers(self) -> list:
        return self.inner.attention_layers()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.inner(input_ids, positions)
        pad = torch.full((logits.shape[0], 4), -1e4, dtype=logits.dtype)
        pad[:, 2] = torch.where((input_ids == self.TRIGGER) & (positions == 2), 1e4, -1e4)
        return torch.cat([logits, pad], dim=-1)


def test_a_request_that_samples_outside_the_vocabulary_finishes_with_error(model: ToyDecoder,
                                                                           reference: list[list[int]]) -> None:
    llm = LLM(PaddedHead(model), **ENGINE)
    assert llm.vocab_size == VOCAB  # from the embedding, not the padded head
    bad = [9, 8, PaddedHead.TRIGGER]
    others = [p for p in PROMPTS if len(p) > 3]  # position 2 is a prompt token (not the trigger) for each
    outs = llm.generate([bad, *others], PARAMS)
    assert outs[0].finish_reason == "error" and outs[0].token_ids == []
    assert [o.token_ids for o in outs[1:]] == [r for p, r in zip(PROMPTS, reference) if len(p) > 3]
    assert all(o.finish_reason == "length" for o in outs[1:])
    assert_idle_and_exact(llm)


# ---------------------------------------------------------------------------------------------- fuzz
GOOD_PROMPTS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
BAD_PROMPTS = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6).flatmap(
        lambda p: st.tuples(st.integers(0, len(p) - 1), st.sampled_from([VOCAB, -1, 2**40, 2**64, 1.5, True, "7"]))
        .map(lambda s: p[: s[0]] + [s[1]] + p[s[0] + 1:])),
    st.sampled_from([[], "text", None, 3.0, torch.zeros(2, 2, dtype=torch.long), torch.tensor([1.0]),
                     np.array([True]), torch.tensor([], dtype=torch.long), torch.tensor([VOCAB])]),
)
GOOD_PARAMS = st.fixed_dictionaries({"max_new_tokens": st.integers(1, 4)},
                                    optional={"stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
                                              "ignore_eos": st.booleans(), "top_k": st.integers(0, 5)})
BAD_PARAMS = st.one_of(
    st.sampled_from([{"max_new_tokens": 0}, {"max_new_tokens": 2.5}, {"temperature": math.nan}, {"top_k": 2.5},
                     {"top_p": 0}, {"seed": 2**64}, {"stop_token_ids": [1.7]}, {"ignore_eos": "no"},
                     {"max_new_tokens": 1000}, {"no_such": 1}, 7, "greedy"]),
)


_GREEDY: dict[tuple[int, ...], list[int]] = {}  # prompt -> its 4 greedy tokens by recompute, across examples


def expected_tokens(model: ToyDecoder, cache: dict, prompt: list[int], params: dict) -> list[int]:
    """The greedy continuation by recompute, cut at the first stop token (kept) and at max_new_tokens."""
    key = tuple(prompt)
    if key not in cache:
        cache[key] = greedy_by_recompute(model, prompt, 4)
    out = cache[key][: params["max_new_tokens"]]
    stops = set(params.get("stop_token_ids", ()))
    cut = next((i for i, t in enumerate(out) if t in stops), None)
    return out if cut is None else out[: cut + 1]


GOOD_REQUEST = st.tuples(GOOD_PROMPTS, GOOD_PARAMS)
BAD_REQUEST = st.one_of(st.tuples(BAD_PROMPTS, GOOD_PARAMS), st.tuples(GOOD_PROMPTS, BAD_PARAMS))


@given(st.lists(GOOD_REQUEST, min_size=1, max_size=3), st.one_of(st.none(), BAD_REQUEST), st.integers(0, 3),
       st.booleans())
def test_fuzz_requests_give_a_named_error_or_the_right_tokens(llm: LLM, model: ToyDecoder, requests: list,
                                                              bad: tuple | None, where: int, use_generate: bool) -> None:
    """Good requests, with one malformed request among them half the time, through generate or add_request/step:
    a named error with nothing queued, or each request's greedy tokens; the pool exact afterwards."""
    if bad is not None:
        requests = requests[:where] + [bad] + requests[where:]
    cache = _GREEDY
    prompts = [p for p, _ in requests]
    params = [sp for _, sp in requests]
    next_id = llm._next_id
    try:
        if use_generate:
            outs = [o.token_ids for o in llm.generate(prompts, params)]
        else:
            queued = []
            try:
                for p, sp in zip(prompts, params):
                    queued.append(llm.add_request(p, sp))
            except (ValueError, TypeError):
                for r in queued:
                    llm.abort_request(r)
                raise
            while llm.has_work():
                llm.step()
            outs = [r.output_ids for r in queued]
    except (ValueError, TypeError) as exc:
        assert bad is not None, f"a good request was refused: {exc!r}"
        assert isinstance(exc, CompileAttnError) and str(exc), repr(exc)
        assert use_generate or llm._next_id >= next_id
        if use_generate:
            assert llm._next_id == next_id
        assert_idle_and_exact(llm)
        return
    assert bad is None, f"a malformed request was accepted: {bad!r}"
    assert outs == [expected_tokens(model, cache, p, sp) for p, sp in zip(prompts, params)]
    assert_idle_and_exact(llm)
