"""The offline API in vLLM's shape on the CPU: SamplingParams' max_tokens / stop / n, RequestOutput.outputs, dtype
names, LLM.chat and use_tqdm's default. Text features run on a briefly trained tiny Llama with its own tokenizer;
each is checked against an independent expectation (the full output without the feature, re-decoded) and the KV
pool is back to its fresh size after every call."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from compile_attn.engine import (
    LLM,
    CompletionOutput,
    EngineOptionError,
    InvalidRequestError,
    NoChatTemplateError,
    RequestOutput,
    RequestTypeError,
    SamplingParams,
)
from compile_attn.models import ToyDecoder, ToyDecoderConfig

CFG = ToyDecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64)
ENGINE = dict(max_batch_size=4, max_num_tokens=64, kv_cache_tokens=1024, max_context=128, page_size=4,
              graph_mode="none", compile=False, device="cpu")
PROMPT = "The function returns"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def text_llm(trained_tiny_llama: Callable[[int], Path]) -> LLM:
    path = trained_tiny_llama(60)  # varied text, not quality, is what matters
    llm = LLM(str(path), **ENGINE)
    llm.fresh_kv_tokens = llm.kv_cache.available_tokens
    return llm


@pytest.fixture(scope="module")
def toy_llm() -> LLM:
    torch.manual_seed(0)
    llm = LLM(ToyDecoder(CFG).eval(), **ENGINE)
    llm.fresh_kv_tokens = llm.kv_cache.available_tokens
    return llm


def assert_kv_empty(llm: LLM) -> None:
    assert not llm.has_work()
    assert llm.kv_cache.available_tokens == llm.fresh_kv_tokens


def spanning_stop(llm: LLM, token_ids: list[int], text: str) -> tuple[str, int]:
    """A 2-character string whose first occurrence in ``text`` straddles the boundary between two output tokens,
    and that boundary, found by decoding every prefix of the output."""
    ends = [len(llm.tokenizer.decode(token_ids[:k], skip_special_tokens=True)) for k in range(1, len(token_ids))]
    for b in ends:
        s = text[b - 1:b + 1]
        if 0 < b < len(text) and text.find(s) == b - 1:
            return s, b
    raise AssertionError(f"no token boundary in {text!r} starts a new 2-character string")


# ---------------------------------------------------------------------------------------------- stop strings
@pytest.mark.parametrize("params", [dict(), dict(temperature=1.0, seed=11)], ids=["greedy", "seeded"])
def test_stop_string_cuts_where_the_full_output_first_contains_it(text_llm: LLM, params: dict) -> None:
    full = text_llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, **params))[0]
    assert full.text == text_llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop, boundary = spanning_stop(text_llm, full.token_ids, full.text)
    at = full.text.find(stop)
    assert at < boundary < at + len(stop)  # the string spans two tokens
    # The first output whose decoded text contains the stop string: where generation must end.
    need = next(k for k in range(1, len(full.token_ids) + 1)
                if stop in text_llm.tokenizer.decode(full.token_ids[:k], skip_special_tokens=True))
    for stops in (stop, [stop], ["\x00never", stop]):
        out = text_llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, stop=stops, **params))[0]
        assert out.text == full.text[:at]
        assert out.token_ids == full.token_ids[:need]
        assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
        assert_kv_empty(text_llm)
    # Two stop strings: the one that occurs first in the text wins, whichever is listed first.
    later = next(full.text[p:p + 2] for p in range(at + 1, len(full.text) - 1) if full.text.find(full.text[p:p + 2]) > at)
    out = text_llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, stop=[later, stop], **params))[0]
    assert out.text == full.text[:at] and out.outputs[0].stop_reason == stop
    # Absent from the text: the full output, finished by length.
    out = text_llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, stop="\x00never", **params))[0]
    assert (out.text, out.token_ids, out.finish_reason) == (full.text, full.token_ids, "length")
    assert_kv_empty(text_llm)


def test_stop_strings_in_a_batch_stop_each_request_at_its_own_match(text_llm: LLM) -> None:
    prompts = [PROMPT, "A class", "When the"]
    fulls = text_llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=5))
    stops = [spanning_stop(text_llm, f.token_ids, f.text)[0] for f in fulls]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=5, stop=s) for s in stops]
    outs = text_llm.generate(prompts, params)
    assert [o.text for o in outs] == [f.text[:f.text.find(s)] for f, s in zip(fulls, stops)]
    assert_kv_empty(text_llm)


def test_stop_strings_without_a_tokenizer_are_refused_before_queueing(toy_llm: LLM) -> None:
    with pytest.raises(RequestTypeError, match="stop strings need a tokenizer.*stop_token_ids"):
        toy_llm.generate([[1, 2, 3], [4, 5]], SamplingParams(stop="x"))
    assert_kv_empty(toy_llm)
    with pytest.raises(RequestTypeError, match="stop entries must be strings"):
        SamplingParams(stop=[3])
    with pytest.raises(InvalidRequestError, match="stop has an empty string"):
        SamplingParams(stop=["a", ""])



@pytest.mark.parametrize("bad", [object(), None, 7, "req-1"], ids=["object", "None", "int", "str"])
def test_abort_request_of_a_non_request_is_a_request_type_error(toy_llm: LLM, bad: object) -> None:
    """A wrong type is the project's named error (also a TypeError), naming the value; the engine is untouched."""
    kept = toy_llm.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RequestTypeError, match=r"abort_request takes a Request from add_request, got "):
        toy_llm.abort_request(bad)
    with pytest.raises(TypeError, match=repr(bad)[:8].replace("(", r"\(")):
        toy_llm.abort_request(bad)
    toy_llm.abort_request(kept)
    while toy_llm.has_work():
        toy_llm.step()
    assert_kv_empty(toy_llm)

# ---------------------------------------------------------------------------------------------- n samples
def test_n_samples_are_independent_reproducible_and_distinct(toy_llm: LLM) -> None:
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44]]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3, ignore_eos=True)
    outs = toy_llm.generate(prompts, params)
    assert len(outs) == 2 and all(len(o.outputs) == 3 for o in outs)
    for o in outs:
        assert [c.index for c in o.outputs] == [0, 1, 2]
        samples = [tuple(c.token_ids) for c in o.outputs]
        assert len(set(samples)) == 3, f"the 3 samples are not distinct: {samples}"
        assert all(len(s) == 12 for s in samples)
    assert_kv_empty(toy_llm)
    again = toy_llm.generate(prompts, params)  # seeded: the same samples, also batched with other work
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in outs]
    other = toy_llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=8, n=3, ignore_eos=True))
    assert [c.token_ids for c in other[0].outputs] != [c.token_ids for c in outs[0].outputs]
    unseeded = toy_llm.generate(prompts[0], SamplingParams(max_tokens=12, temperature=1.0, n=3, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) == 3
    # Greedy: every sample is the single greedy output.
    single = toy_llm.generate(prompts[0], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    greedy = toy_llm.generate(prompts[0], SamplingParams(max_tokens=12, ignore_eos=True, n=3))[0]
    assert [c.token_ids for c in greedy.outputs] == [single.token_ids] * 3
    assert_kv_empty(toy_llm)
    with pytest.raises(InvalidRequestError, match="add_request queues one sample but got n=2"):
        toy_llm.add_request([1, 2], SamplingParams(n=2))
    assert_kv_empty(toy_llm)


# ---------------------------------------------------------------------------------------------- SamplingParams
def test_max_tokens_is_max_new_tokens(toy_llm: LLM) -> None:
    a = toy_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    b = toy_llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    c = toy_llm.generate([[5, 6, 7]], {"max_tokens": 6, "ignore_eos": True})[0]
    assert a.token_ids == b.token_ids == c.token_ids and len(a.token_ids) == 6
    assert SamplingParams(max_tokens=6) == SamplingParams(max_new_tokens=6) == SamplingParams(6, max_tokens=6)
    assert SamplingParams(max_tokens=6).max_tokens == SamplingParams(max_new_tokens=6).max_tokens == 6
    assert SamplingParams().max_tokens == 16 and SamplingParams().temperature == 0.0  # greedy by default
    with pytest.raises(InvalidRequestError, match=r"max_tokens=4 and max_new_tokens=5 disagree"):
        SamplingParams(max_new_tokens=5, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="max_tokens must be >= 1, got 0"):
        SamplingParams(max_tokens=0)
    assert_kv_empty(toy_llm)


@pytest.mark.parametrize(("name", "value"), [("prompt_logprobs", 0), ("best_of", 2)])
def test_unimplemented_vllm_options_are_refused_by_name(toy_llm: LLM, name: str, value: object) -> None:
    with pytest.raises(InvalidRequestError, match=f"{name}={value!r}: not supported yet"):
        SamplingParams(**{name: value})
    with pytest.raises(InvalidRequestError, match=f"{name}={value!r}: not supported yet"):
        toy_llm.generate([[1, 2]], {name: value})
    assert_kv_empty(toy_llm)


@pytest.mark.parametrize(("kw", "message"), [
    (dict(logprobs=21), r"logprobs must be in \[0, 20\]"), (dict(logprobs=-1), r"logprobs must be in"),
    (dict(logprobs=1.0), "logprobs must be an int"), (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in"), (dict(frequency_penalty="x"), "must be a number"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be finite"),
])
def test_logprobs_and_penalty_ranges(kw: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kw)


def test_neutral_values_of_unimplemented_options_and_unknown_names() -> None:
    neutral = SamplingParams(logprobs=None, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                             prompt_logprobs=None, best_of=None)
    assert neutral == SamplingParams() and not neutral.has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties and SamplingParams(presence_penalty=-1).has_penalties
    with pytest.raises(RequestTypeError, match="unknown parameter.*'max_lenght'.*known: .*max_tokens"):
        SamplingParams(max_lenght=3)


# ---------------------------------------------------------------------------------------------- RequestOutput
def test_request_output_has_vllms_shape_and_the_old_attributes(text_llm: LLM, toy_llm: LLM) -> None:
    out = text_llm.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert isinstance(out, RequestOutput) and out.finished and out.prompt == PROMPT
    assert out.prompt_token_ids == text_llm.tokenizer(PROMPT)["input_ids"]
    (first,) = out.outputs
    assert isinstance(first, CompletionOutput) and first.index == 0 and len(first.token_ids) == 5
    assert first.text == text_llm.tokenizer.decode(first.token_ids, skip_special_tokens=True)
    assert (out.token_ids, out.text, out.finish_reason) == (first.token_ids, first.text, first.finish_reason)
    ids = toy_llm.generate([[3, 4]], SamplingParams(max_tokens=2, stop_token_ids=list(range(97))))[0]
    assert ids.prompt is None and ids.text is None and ids.prompt_token_ids == [3, 4]
    assert ids.finish_reason == "stop" and ids.outputs[0].stop_reason == ids.token_ids[-1]
    assert_kv_empty(toy_llm)


# ---------------------------------------------------------------------------------------------- dtype names
@pytest.mark.parametrize(("name", "dtype"), [("auto", torch.float32), ("float32", torch.float32),
                                             ("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                             (None, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_dtype_names(name: object, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    llm = LLM(ToyDecoder(CFG), **ENGINE, dtype=name)
    assert llm.dtype == dtype and llm.kv_cache.pool.dtype == dtype
    assert {p.dtype for p in llm.model.parameters()} == {dtype}
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


@pytest.mark.parametrize("bad", ["fp8", "int8", "bf16x", torch.int32, 16])
def test_bad_dtypes_are_refused_before_the_model_loads(bad: object) -> None:
    class NotLoaded(torch.nn.Module):
        def attention_layers(self) -> list:
            raise AssertionError("the model was loaded")

    with pytest.raises(EngineOptionError, match=r"LLM\(dtype=.*\) is not a floating dtype; pass 'auto'"):
        LLM(NotLoaded(), **ENGINE, dtype=bad)


# ---------------------------------------------------------------------------------------------- chat
def test_chat_equals_generate_on_the_templated_prompt(text_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    conversations = [[{"role": "user", "content": "What is a list?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a type."}]]
    texts = ["<|user|>\nWhat is a list?\n<|assistant|>\n",
             "<|system|>\nBe brief.\n<|user|>\nName a type.\n<|assistant|>\n"]  # TEMPLATE written out by hand
    monkeypatch.setattr(text_llm.tokenizer, "chat_template", None)  # the tiny model ships one (tiny_llama.py)
    with pytest.raises(NoChatTemplateError, match="has no chat template.*chat_template"):
        text_llm.chat(conversations[0], params)
    monkeypatch.setattr(text_llm.tokenizer, "chat_template", TEMPLATE)
    expected = text_llm.generate(texts, params)  # a string prompt gets BOS from the tokenizer, as TEMPLATE writes it
    (one,) = text_llm.chat(conversations[0], params)
    both = text_llm.chat(conversations, params)
    for out, ref in zip([one, *both], [expected[0], *expected]):
        assert (out.prompt_token_ids, out.token_ids, out.text) == (ref.prompt_token_ids, ref.token_ids, ref.text)
    assert one.prompt == text_llm.tokenizer.bos_token + texts[0]
    assert_kv_empty(text_llm)
    with pytest.raises(InvalidRequestError, match="messages must be a non-empty list"):
        text_llm.chat([], params)
    with pytest.raises(RequestTypeError, match="conversation 0 message 0 must be a dict"):
        text_llm.chat([[{"content": "no role"}]], params)
    assert_kv_empty(text_llm)


def test_chat_without_a_tokenizer_is_refused(toy_llm: LLM) -> None:
    with pytest.raises(NoChatTemplateError, match="needs a tokenizer"):
        toy_llm.chat([{"role": "user", "content": "hi"}])
    assert_kv_empty(toy_llm)


# ---------------------------------------------------------------------------------------------- use_tqdm
def test_progress_bar_by_default_for_several_prompts_only(toy_llm: LLM, capsys: pytest.CaptureFixture) -> None:
    params = SamplingParams(max_tokens=2)
    toy_llm.generate([[1, 2]], params)
    assert "generate" not in capsys.readouterr().err
    toy_llm.generate([[1, 2], [3, 4]], params)
    assert "generate" in capsys.readouterr().err
    toy_llm.generate([[1, 2], [3, 4]], params, use_tqdm=False)
    assert "generate" not in capsys.readouterr().err
    toy_llm.generate([[1, 2]], params, use_tqdm=True)
    assert "generate" in capsys.readouterr().err
    assert_kv_empty(toy_llm)


# ---------------------------------------------------------------------------------------------- vLLM's min_tokens, text
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_with_every_token_a_stop_token(toy_llm: LLM, overlap: bool, temperature: float) -> None:
    """With every token id a stop token, a request stops at its first token, and with min_tokens=k at its k+1-th
    (the first token the sampler may draw from the stop tokens), with or without overlap, greedy or sampled."""
    every = list(range(CFG.vocab_size))
    toy_llm.overlap = overlap
    try:
        for k in (0, 1, 5, 11):
            outs = toy_llm.generate([[3, 4], [5, 6, 7]], SamplingParams(max_tokens=20, stop_token_ids=every,
                                                                       min_tokens=k, temperature=temperature,
                                                                       seed=1))
            for out in outs:
                assert len(out.token_ids) == k + 1 and out.finish_reason == "stop"
                assert out.outputs[0].stop_reason == out.token_ids[-1]
    finally:
        toy_llm.overlap = True
    assert_kv_empty(toy_llm)


def test_stop_text_semantics_and_skip_special_tokens(text_llm: LLM) -> None:
    """A stop token's text is left out of the output text (vLLM's semantics) unless include_stop_str_in_output; a
    stop string is cut off, or kept with include_stop_str_in_output; skip_special_tokens=False keeps special tokens
    in the text. Expected texts are the plain output's, decoded or cut by hand."""
    tok = text_llm.tokenizer
    full = text_llm.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop_id = full.token_ids[3]
    upto = full.token_ids[:full.token_ids.index(stop_id) + 1]
    for include, ids in ((False, upto[:-1]), (True, upto)):
        out = text_llm.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id],
                                                       include_stop_str_in_output=include))[0]
        assert out.token_ids == upto and out.text == tok.decode(ids, skip_special_tokens=True)
    stop = full.text[5:8]
    at = full.text.index(stop)
    for include, want in ((False, full.text[:at]), (True, full.text[:at + len(stop)])):
        out = text_llm.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True, stop=stop,
                                                       include_stop_str_in_output=include))[0]
        assert (out.text, out.outputs[0].stop_reason) == (want, stop)
    bos_first = [tok.bos_token_id, tok.eos_token_id] + tok("x", add_special_tokens=False)["input_ids"]
    for skip in (True, False):
        out = text_llm.generate([bos_first], SamplingParams(max_tokens=4, ignore_eos=True,
                                                            skip_special_tokens=skip))[0]
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=skip)
    assert_kv_empty(text_llm)
