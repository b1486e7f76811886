"""IncrementalDetokenizer against ``tokenizer.decode`` of the whole output, with a byte-level BPE tokenizer trained on
ASCII text only, so every emoji and CJK character spans several byte tokens: the pieces never hold a broken
character, never have to be taken back (each push's text extends the last), hold back what could start a stop
string, and add up to the full decode (or to the text cut before a stop string). Then the same through AsyncLLM: a
toy model sampling random byte tokens streams exactly the text a separate LLM's generate returns."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from compile_attn.engine import LLM, SamplingParams
from compile_attn.engine.serving.async_engine import AsyncLLM
from compile_attn.engine.serving.detokenizer import IncrementalDetokenizer, held_back
from compile_attn.models import ToyDecoder, ToyDecoderConfig

TEXTS = ["the cat 🐱 sat on the mat", "猫は mat の上 🐈‍⬛ ok", "naïve café — déjà vu 😀😀", "👍"]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["the cat sat on the mat and the dog ate the hat"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def stream_pieces(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push([t]) for t in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_full_decode(tokenizer, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == text
    detok = IncrementalDetokenizer(tokenizer)
    pieces = stream_pieces(detok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert pieces.count("") >= 1  # a character spanning tokens was held back at least once
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some token is part of a character only
    assert "".join(pieces) + detok.finish(full) == full
    assert "".join(pieces) == full  # the last token completes the last character: nothing left for finish


@pytest.mark.parametrize("text,stop", [(TEXTS[0], "🐱 s"), (TEXTS[1], "の上"), (TEXTS[2], "é — d"),
                                       (TEXTS[0], "mat")])
def test_stop_strings_across_token_boundaries(tokenizer, text: str, stop: str) -> None:
    ids = tokenizer(text)["input_ids"]
    # the engine finishes at the first token whose decoded output contains the stop string, cut where it starts
    k = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    decoded = tokenizer.decode(ids[:k])
    cut = decoded[: decoded.index(stop)]
    detok = IncrementalDetokenizer(tokenizer, ["zzz", stop])
    sent = "".join(stream_pieces(detok, ids[: k - 1]))
    assert cut.startswith(sent)  # nothing after the stop string's start was ever sent
    assert sent + detok.finish(cut) == cut


def test_a_whole_stop_string_is_never_sent_before_the_request_finishes(tokenizer) -> None:
    ids = tokenizer("abc STOP def")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, ["STOP"])
    sent = "".join(stream_pieces(detok, ids))  # the request did not finish on it (its finish check runs later)
    assert sent == "abc "


def test_held_back() -> None:
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["world"]) == 0
    assert held_back("aa", ["aab", "ab"]) == 2
    assert held_back("xa", ["ab", "b"]) == 1
    assert held_back("", ["ab"]) == 0
    assert held_back("ab", ["ab"]) == 0  # a whole stop string is not a proper prefix (push cuts before it)


def test_random_token_sequences_never_take_text_back(tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 30))]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        detok = IncrementalDetokenizer(tokenizer, ["ca"])
        sent = ""
        for t in ids:
            sent += detok.push([t])
            assert full.startswith(sent), (ids, sent, full)
        assert sent + detok.finish(full) == full


class BytesTokenizer:
    """A tokenizer without a ``tokenizers`` backend: token ids are UTF-8 bytes."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_tokenizer_without_a_backend_decodes_whole() -> None:
    text = "é€😀 ok"
    ids = list(text.encode())
    detok = IncrementalDetokenizer(BytesTokenizer())
    pieces = stream_pieces(detok, ids)
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == text


CFG = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
ENGINE = dict(max_batch_size=4, max_num_tokens=64, kv_cache_tokens=2048, max_context=256, page_size=4,
              graph_mode="none", compile=False, device="cpu")


def byte_llm(tokenizer) -> LLM:
    torch.manual_seed(0)
    model = ToyDecoder(ToyDecoderConfig(vocab_size=len(tokenizer), **CFG)).eval()
    return LLM(model, tokenizer=tokenizer, **ENGINE)


def test_async_stream_matches_generate_on_split_characters(tokenizer) -> None:
    reference = byte_llm(tokenizer)
    prompt = tokenizer("the cat")["input_ids"]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, ignore_eos=True) for s in range(6)]
    want = [reference.generate(prompt, p)[0] for p in params]
    seed = next(s for s, o in enumerate(want) if len(o.text) > 12)
    stop = want[seed].text[5:8]  # a stop string that sample's text contains
    params.append(SamplingParams(max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True, stop=stop))
    want.append(reference.generate(prompt, params[-1])[0])
    assert want[-1].finish_reason == "stop" and want[-1].outputs[0].stop_reason == stop
    engine = AsyncLLM(byte_llm(tokenizer))

    async def one(p: SamplingParams) -> list:
        return [d async for d in engine.generate(prompt, p)]

    async def main() -> list:
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in params)), 60)

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    split = 0
    for deltas, out in zip(results, want):
        assert "".join(d.text for d in deltas) == out.text
        assert [t for d in deltas for t in d.token_ids] == out.token_ids
        split += sum(1 for d in deltas[:-1] if d.token_ids and not d.text)
    assert split > 0  # some tokens were held back (a partial character or a possible stop string)
