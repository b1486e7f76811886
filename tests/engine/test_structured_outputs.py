"""Structured outputs offline (``SamplingParams(guided_decoding=...)``) on the CPU, on a tiny Llama with random weights
and a real byte-level BPE tokenizer: whatever the model prefers, the grammar makes every output valid, so each is
checked against its constraint independently of xgrammar (``json.loads`` and a JSON-schema check, Python's ``re``,
set membership). Schemas come from hypothesis (objects of bounded strings, integer ranges, booleans and enums, with
required lists); every constraint bounds the output, so each request finishes with reason "stop" well within
max_tokens. Constraints with unbounded outputs (any JSON object) run with a bias towards closing tokens
(``closing_bias``), a model that ends its structures soon. Also: the grammar cache, errors naming the field, overlap
and speculative decoding with grammar rows, and the device bitmask op against xgrammar's own kernel."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_attn.engine import LLM, InvalidRequestError, RequestTypeError, SamplingParams
from compile_attn.engine.execution.sampling.grammar import GrammarCache, GuidedRows, apply_token_bitmask_
from compile_attn.engine.requests.guided_decoding import GrammarError, GuidedDecodingParams, import_xgrammar
from tests.guided_helpers import check_schema, closing_bias

xgr = pytest.importorskip("xgrammar")

ENGINE = dict(max_batch_size=8, max_num_tokens=256, kv_cache_tokens=4096, max_context=256, page_size=4,
              graph_mode="none", compile=False, device="cpu")
PROMPTS = ["A function is", "The value of x", "An exception is raised when"]
MAX_TOKENS = 160  # every bounded constraint here ends far sooner
TEMPERATURES = [0.0, 1.0]  # greedy and sampled


@pytest.fixture(scope="module")
def model_dir(trained_tiny_llama: Callable[[int], Path]) -> str:
    return str(trained_tiny_llama(1))  # random weights, trained tokenizer


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    out = LLM(model_dir, **ENGINE)
    out.fresh_kv_tokens = out.kv_cache.available_tokens
    return out


def assert_idle(llm: LLM) -> None:
    assert not llm.has_work() and not llm._in_flight
    assert llm.kv_cache.available_tokens == llm.fresh_kv_tokens


def generate(llm: LLM, guided: Any, temperature: float, prompts: list[str] = PROMPTS, **kw: Any) -> list:
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=7, guided_decoding=guided, **kw)
    outs = llm.generate(prompts, sp)
    assert_idle(llm)
    return [c for o in outs for c in o.outputs]


# ---------------------------------------------------------------- hypothesis schemas

_names = st.text(alphabet="abcdefghijklmnop_", min_size=1, max_size=6)
_enum_value = st.one_of(st.text(alphabet="xyz ", max_size=4), st.integers(-9, 99), st.booleans())
_property = st.one_of(
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-100, 100), st.integers(0, 10_000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.lists(_enum_value, min_size=1, max_size=4, unique_by=lambda v: (type(v), v)).map(lambda v: {"enum": v}),
)
schemas = st.dictionaries(_names, _property, min_size=1, max_size=4).flatmap(
    lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
        lambda req: {"type": "object", "properties": props, "required": req}))


@pytest.mark.parametrize("temperature", TEMPERATURES)
@settings(max_examples=6, deadline=None)
@given(schema=schemas)
def test_every_output_parses_and_validates_against_its_schema(llm: LLM, temperature: float, schema: dict) -> None:
    for c in generate(llm, {"json": schema, "disable_any_whitespace": True}, temperature):
        assert c.finish_reason == "stop", (c.text, schema)
        check_schema(json.loads(c.text), schema)  # strict: no raw control characters in strings


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_json_with_any_whitespace_and_json_objects_parse(llm: LLM, temperature: float) -> None:
    """vLLM's default JSON (any whitespace between tokens) and json_object=True (any object), on a model that closes
    its structures soon."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["name", "n"]}
    with closing_bias(llm):
        for c in generate(llm, GuidedDecodingParams(json=schema), temperature):
            assert c.finish_reason == "stop", c.text
            check_schema(json.loads(c.text), schema)
        for compact in (False, True):
            for c in generate(llm, GuidedDecodingParams(json_object=True, disable_any_whitespace=compact),
                              temperature):
                assert c.finish_reason == "stop", c.text
                assert isinstance(json.loads(c.text), dict), c.text


REGEXES = [r"[a-z]{1,8}@[a-z]{1,5}\.(com|org)", r"-?[0-9]{1,4}(\.[0-9]{1,2})?", r"(yes|no), because [a-z ]{0,12}",
           r"\(\d{3}\) \d{3}-\d{4}", r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}"]


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("regex", REGEXES)
def test_regex_outputs_fullmatch(llm: LLM, regex: str, temperature: float) -> None:
    for c in generate(llm, {"regex": regex}, temperature):
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), (regex, c.text)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_choice_outputs_are_one_of_the_choices(llm: LLM, temperature: float) -> None:
    choices = ["yes", "no", "n", "maybe so", 'a "quoted"\nline', "café ∑"]  # "n" is a prefix of "no"
    seen = set()
    for seed in range(4):
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=temperature, seed=seed,
                                                    guided_decoding={"choice": choices}))
        for c in (o.outputs[0] for o in outs):
            assert c.finish_reason == "stop" and c.text in choices, c.text
            seen.add(c.text)
    assert_idle(llm)
    assert temperature == 0 or len(seen) > 1


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_ebnf_and_lark_grammars(llm: LLM, temperature: float) -> None:
    ebnf = 'root ::= "(" num ("," num){0,3} ")"\nnum ::= [0-9] | [1-9] [0-9] | [1-9] [0-9] [0-9]'
    for c in generate(llm, {"grammar": ebnf}, temperature):
        assert c.finish_reason == "stop" and re.fullmatch(r"\((0|[1-9]\d{0,2})(,(0|[1-9]\d{0,2})){0,3}\)", c.text)
    lark = 'start: "id-" DIGIT DIGIT? | "none"\nDIGIT: /[0-9]/'
    for c in generate(llm, {"grammar": lark}, temperature):
        assert c.finish_reason == "stop" and re.fullmatch(r"id-\d\d?|none", c.text), c.text


def test_pydantic_model_class_ignore_eos_n_and_logprobs(llm: LLM) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        code: int = pydantic.Field(ge=0, le=999)
        ok: bool

    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=2,
                                                    ignore_eos=True, logprobs=2,
                                                    guided_decoding=GuidedDecodingParams(json=Item)))
    assert_idle(llm)
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "stop", c.text  # a finished grammar ends the request, ignore_eos or not
        Item.model_validate_json(c.text)
        assert len(c.logprobs) == len(c.token_ids)
        for tok, entry in zip(c.token_ids, c.logprobs):  # the model's raw logprobs: finite, whatever the mask
            assert -1e9 < entry[tok].logprob <= 0 and entry[tok].rank >= 1


def test_guided_and_plain_requests_share_a_batch(llm: LLM) -> None:
    """Plain rows come out as they do without grammar rows beside them; greedy guided rows as they do alone."""
    plain = SamplingParams(max_tokens=12)
    guided = SamplingParams(max_tokens=MAX_TOKENS, guided_decoding={"regex": "[a-z]{2,9}"})
    alone_plain = [o.token_ids for o in llm.generate(PROMPTS, plain)]
    alone_guided = [o.token_ids for o in llm.generate(PROMPTS, guided)]
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + [guided] * 3)
    assert [o.token_ids for o in mixed[:3]] == alone_plain
    assert [o.token_ids for o in mixed[3:]] == alone_guided
    assert all(re.fullmatch("[a-z]{2,9}", o.text) for o in mixed[3:])
    assert_idle(llm)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_min_tokens_and_a_grammar_both_hold(llm: LLM, temperature: float) -> None:
    """Both masks apply: a grammar with room to go on (and a model keen to end, ``closing_bias``) writes at least
    min_tokens tokens before its EOS, all of them the grammar's; a grammar complete before min_tokens (its only
    allowed token is EOS) ends there with "stop", its output valid, not with "error"."""
    regex, min_tokens = "[a-z ]{1,200}", 12
    with closing_bias(llm):
        short = generate(llm, {"regex": regex}, temperature)
        held = generate(llm, {"regex": regex}, temperature, min_tokens=min_tokens)
    assert all(len(c.token_ids) < min_tokens for c in short)  # without min_tokens this model ends soon
    for c in held:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
        assert len(c.token_ids) > min_tokens and c.token_ids[-1] == llm.tokenizer.eos_token_id, c.token_ids
    for c in generate(llm, {"choice": ["yes", "no"]}, temperature, min_tokens=30):
        assert c.finish_reason == "stop" and c.text in ("yes", "no"), (c.finish_reason, c.text)
        assert len(c.token_ids) < 30


def test_steps_with_grammar_rows_do_not_overlap_and_give_the_same_tokens(model_dir: str, llm: LLM) -> None:
    """With overlap on, a step that samples a grammar row is read before the next is launched (its masks follow
    those tokens); plain steps still overlap; tokens equal those of overlap=False."""
    serial = LLM(model_dir, **{**ENGINE, "overlap": False})
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in range(2)] + \
        [SamplingParams(max_tokens=MAX_TOKENS, temperature=t, seed=5, guided_decoding={"choice": ["alpha", "beta"]})
         for t in (0.0, 1.0)]
    want = [o.token_ids for o in serial.generate(PROMPTS[:2] * 2, params)]
    assert [o.token_ids for o in llm.generate(PROMPTS[:2] * 2, params)] == want
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=6))  # plain: its steps overlap
    llm.step()
    assert len(llm._in_flight) == 1
    while llm.has_work():
        llm.step()
    req = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=40, guided_decoding={"regex": "[0-9]{5}"}))
    while llm.has_work():
        llm.step()
        assert not llm._in_flight  # read at once
    assert req.finish_reason == "stop" and re.fullmatch("[0-9]{5}", llm.tokenizer.decode(req.output_ids,
                                                                                          skip_special_tokens=True))


def test_speculative_decoding_gives_grammar_rows_no_drafts(model_dir: str, llm: LLM) -> None:
    spec = LLM(model_dir, **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    guided = SamplingParams(max_tokens=MAX_TOKENS, guided_decoding={"regex": r"(ab|abc)( ab){0,6}"})
    outs = spec.generate(PROMPTS, guided)
    assert spec.speculator.stats.draft_tokens == 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(PROMPTS, guided)]
    assert all(o.finish_reason == "stop" and re.fullmatch(r"(ab|abc)( ab){0,6}", o.text) for o in outs)
    # Plain requests beside them still verify drafts (a repetitive prompt: prompt lookup finds some).
    rep = "the value of the value of the value of the value of"
    plain = SamplingParams(max_tokens=24)
    mixed = spec.generate([rep, rep], [plain, guided])
    assert spec.speculator.stats.draft_tokens > 0
    assert mixed[0].token_ids == llm.generate([rep], plain)[0].token_ids
    assert re.fullmatch(r"(ab|abc)( ab){0,6}", mixed[1].text)


def test_the_grammar_cache_compiles_each_spec_once(model_dir: str, llm: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": [1, 2]}},
              "required": ["a", "b"]}
    cache = llm._grammar_cache()
    before = cache.num_compiled
    for guided in ({"json": schema}, {"json": dict(schema)}, {"json": json.dumps(schema, indent=2)}):
        generate(llm, {**guided, "disable_any_whitespace": True}, 0.0)
    assert cache.num_compiled == before + 1  # one schema, three spellings, 9 requests
    generate(llm, {"json": schema}, 0.0)  # any whitespace: another grammar
    assert cache.num_compiled == before + 2
    # The properties' order is the output's: another order, another grammar, the fields in that order.
    reordered = {**schema, "properties": {"b": {"enum": [1, 2]}, "a": {"type": "boolean"}}}
    for c in generate(llm, {"json": reordered, "disable_any_whitespace": True}, 0.0):
        assert list(json.loads(c.text)) == ["b", "a"], c.text
    assert cache.num_compiled == before + 3
    for c in generate(llm, {"json": schema, "disable_any_whitespace": True}, 0.0):
        assert list(json.loads(c.text)) == ["a", "b"], c.text

    small = GrammarCache(llm.tokenizer, llm.vocab_size, max_size=2)
    specs = [GuidedDecodingParams(regex=r) for r in ("a+", "b+", "c+")]
    for p in specs + specs[2:] + specs[:1]:  # a, b, c, c (hit), a (evicted: compiled again)
        small.compile(p)
    assert small.num_compiled == 4 and len(small) == 2


def test_bad_constraints_are_refused_by_name_before_anything_is_queued(llm: LLM) -> None:
    bad = {
        "json": ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "nonsense"),
        "json text": ({"json": '{"type": "object",'}, "JSON"),
        "regex": ({"regex": "(ab"}, "parenthesis"),
        "grammar": ({"grammar": 'root ::= "a" |'}, "EBNF"),
        "rule": ({"grammar": 'start ::= "a"'}, "root"),
    }
    for name, (guided, words) in bad.items():
        with pytest.raises(GrammarError, match=words) as info:
            llm.generate(PROMPTS, SamplingParams(guided_decoding=guided))
        kind = next(iter(guided))
        assert info.value.param == f"guided_decoding.{kind}" and str(info.value).startswith(info.value.param), name
        assert "/project/" not in str(info.value)  # xgrammar's C++ location is cut
        assert_idle(llm)
    refused = [({"json_object": True, "regex": "a"}, "exactly one"), ({}, "exactly one"),
               ({"json_object": False}, "exactly one"), ({"choice": []}, "empty"), ({"regex": 5}, "string"),
               ({"choice": "yes"}, "list"), ({"jsn": {}}, "unknown"), ({"regex": "a", "whitespace_pattern": " "},
                                                                       "whitespace_pattern"),
               ({"regex": "a", "backend": "outlines"}, "xgrammar"), ({"regex": "a", "structural_tag": "x"},
                                                                    "structural_tag")]
    for guided, words in refused:
        with pytest.raises(InvalidRequestError, match=words):
            SamplingParams(guided_decoding=guided)
    with pytest.raises(RequestTypeError):
        SamplingParams(guided_decoding="json")
    assert GuidedDecodingParams(regex="a", backend="xgrammar:disable-any-whitespace").disable_any_whitespace
    assert SamplingParams.from_mapping({"guided_decoding": {"regex": "a"}}).guided_decoding == \
        GuidedDecodingParams(regex="a")
    assert_idle(llm)


def test_without_xgrammar_a_grammar_request_names_the_extra(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(GrammarError, match=r"compile-attn\[structured\]"):
        import_xgrammar()
    monkeypatch.setattr(llm, "grammars", None)  # as a fresh LLM: its compiler is built on first use
    with pytest.raises(GrammarError, match=r"pip install 'compile-attn\[structured\]'"):
        llm.generate(PROMPTS, SamplingParams(guided_decoding={"regex": "a+"}))
    assert [o.finish_reason for o in llm.generate(PROMPTS, SamplingParams(max_tokens=3))] == ["length"] * 3
    assert_idle(llm)


# ---------------------------------------------------------------- the device op

def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The masked logits by the definition: token t of row rows[i] is allowed iff bit t % 32 of word t // 32 of
    bitmask[i] is set (tokens past the bitmask never are); other rows unchanged."""
    out = logits.clone()
    v = logits.shape[1]
    t = torch.arange(v)
    for i, r in enumerate(rows):
        words = bitmask[i].long() & 0xFFFFFFFF
        allowed = torch.zeros(v, dtype=torch.bool)
        inside = t < 32 * bitmask.shape[1]
        allowed[inside] = ((words[t[inside] // 32] >> (t[inside] % 32)) & 1) == 1
        out[r, ~allowed] = float("-inf")
    return out


@pytest.mark.parametrize("backend", ["torch", "xgrammar", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab, width", [(5, 1000, 32), (8, 1024, 32), (3, 70, 3), (4, 100, 3)])
def test_apply_token_bitmask_follows_the_bit_layout(backend: str, dtype: torch.dtype, rows: int, vocab: int,
                                                    width: int) -> None:
    """Ours (torch ops) and xgrammar's kernel both, every row or some, a vocabulary that is not a multiple of 32
    and a bitmask narrower than the logits."""
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, width), generator=gen, dtype=torch.int64).to(torch.int32)
    got = logits.clone()
    apply_token_bitmask_(got, bitmask, backend=backend)
    assert torch.equal(got, reference_mask(logits, bitmask, list(range(rows))))
    at = [i for i in range(rows) if i % 2 == 0]
    got = logits.clone()
    apply_token_bitmask_(got, bitmask[at], torch.tensor(at, dtype=torch.int32), backend=backend)
    assert torch.equal(got, reference_mask(logits, bitmask[at], at))
    if backend == "torch" and 32 * width >= vocab:  # xgrammar's own kernel agrees
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab)
        got = logits.clone()
        apply_token_bitmask_(got, bitmask, backend="torch")
        assert torch.equal(got, want)


def test_guided_rows_fill_one_buffer_of_masks_and_rows(llm: LLM) -> None:
    cache = llm._grammar_cache()
    p = GuidedDecodingParams(choice=["yes", "no"])
    reqs = [type("R", (), {"grammar": g})() for g in (None, cache.matcher(p), None, cache.matcher(p))]
    rows = GuidedRows.for_step(cache, reqs)
    assert rows.at == [1, 3]
    width = -(-llm.vocab_size // 32)
    buf = rows.host_bitmask(width, pin=False)
    assert buf.shape == (2 * width + 2,) and buf[-2:].tolist() == [1, 3]
    allowed = {t for t in range(llm.vocab_size) if (int(buf[t // 32]) >> (t % 32)) & 1}
    assert allowed and all("yes".startswith(s) or "no".startswith(s)
                           for s in (llm.tokenizer.decode([t]) for t in allowed))
    full = rows.host_bitmask_all_rows(width, pin=False)  # the one-pass layout: every row, the free ones all ones
    assert full.shape == (4, width) and (full[[0, 2]] == -1).all()
    assert torch.equal(full[1], buf[:width]) and torch.equal(full[3], buf[width:2 * width])
    logits = torch.zeros(4, llm.vocab_size)
    rows.apply(logits)
    assert torch.isfinite(logits[[0, 2]]).all()
    assert {int(t) for t in torch.isfinite(logits[1]).nonzero()} == allowed
    assert GuidedRows.for_step(cache, [reqs[0]]) is None and GuidedRows.for_step(None, reqs) is None


def test_guided_rows_mask_logits_wider_than_the_bitmask_and_one_step_at_two_widths(llm: LLM) -> None:
    """Logits of the model's width mask every row in one pass; logits with more columns than the grammar's vocabulary
    (a padded embedding) take the row-index path. Either way the guided row keeps only its allowed tokens (columns
    past the bitmask banned) and the other rows keep every token, one ``GuidedRows`` applied at both widths."""
    cache = llm._grammar_cache()
    p = GuidedDecodingParams(choice=["yes", "no"])
    reqs = [type("R", (), {"grammar": g})() for g in (cache.matcher(p), None, None)]
    rows = GuidedRows.for_step(cache, reqs)
    width = -(-llm.vocab_size // 32)
    buf = rows.host_bitmask(width, pin=False)
    allowed = {t for t in range(llm.vocab_size) if (int(buf[t // 32]) >> (t % 32)) & 1}
    assert allowed
    for vocab in (llm.vocab_size, 32 * width + 40):
        logits = torch.zeros(3, vocab)
        rows.apply(logits)
        assert {int(t) for t in torch.isfinite(logits[0]).nonzero()} == allowed, vocab
        assert torch.isfinite(logits[1:]).all(), vocab


def test_the_structured_sampling_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_structured_sampling.py"
    out = tmp_path / "s.json"
    subprocess.run([sys.executable, str(script), "--device", "cpu", "--rows", "4", "--vocab", "600", "--reps", "1",
                    "--warmup", "0", "--guided-fraction", "0.5", "--out", str(out)], check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(script.parents[1])})
    results = json.loads(out.read_text())["results"]
    assert [r["case"] for r in results] == ["greedy", "temperature 0.7", "top-k 50 + top-p 0.9"]
    assert all(r["guided_rows"] == 2 and r["plain_ms"] > 0 and r["fill_ms"] > 0 for r in results)
