"""OpenAI's logprobs objects built from the engine's per-token dicts (computed here by compute_logprobs from known
logits, decoded by a real byte-level tokenizer): completions' four parallel lists with running text offsets, chat's
content items with bytes and ranked top_logprobs, merged across Deltas."""

from __future__ import annotations

import math

import pytest
import torch

from compile_attn.engine.execution.sampling.logprobs import compute_logprobs, to_host
from compile_attn.server.logprobs_format import chat_logprobs, completion_logprobs, merge


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


def entries_for(tokenizer, text: str, num_top: int):
    ids = tokenizer(text)["input_ids"]
    vocab = len(tokenizer)
    logits = torch.zeros(len(ids), vocab)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 2.0  # each sampled token the likeliest
    logits[:, ids[0]] += 1.0  # the runner-up of every other row
    logits[0, ids[1 % len(ids)]] += 0.5  # row 0's runner-up
    return ids, to_host(compute_logprobs(logits, torch.tensor(ids), num_top), [num_top] * len(ids)), logits


def test_completion_logprobs(tokenizer) -> None:
    ids, entries, logits = entries_for(tokenizer, "ab c", 2)
    out = completion_logprobs(entries[:2], ids[:2], tokenizer, 2)
    rest = completion_logprobs(entries[2:], ids[2:], tokenizer, 2, offset=2)
    whole = merge(False, [out, rest])
    assert whole["tokens"] == ["a", "b", " ", "c"] and whole["text_offset"] == [0, 1, 2, 3]
    logp = torch.log_softmax(logits.double(), -1)
    assert whole["token_logprobs"] == pytest.approx([logp[i, t].item() for i, t in enumerate(ids)], abs=1e-6)
    assert [list(d) for d in whole["top_logprobs"]] == [["a", "b"], ["b", "a"], [" ", "a"], ["c", "a"]]
    assert whole["top_logprobs"][1]["a"] == pytest.approx(logp[1, ids[0]].item(), abs=1e-6)
    assert merge(False, []) is None


def test_chat_logprobs_bytes_and_ranks(tokenizer) -> None:
    ids, entries, _ = entries_for(tokenizer, "é!", 1)  # "é" is two byte tokens, each a piece of a character
    out = chat_logprobs(entries, ids, tokenizer, 1)["content"]
    assert [c["token"] for c in out] == ["\ufffd", "\ufffd", "!"]
    assert out[2]["bytes"] == [33] and all(math.isfinite(c["logprob"]) for c in out)
    assert [len(c["top_logprobs"]) for c in out] == [1, 1, 1]
    assert out[1]["top_logprobs"][0]["token"] == "\ufffd" and out[1]["top_logprobs"][0]["logprob"] == out[1]["logprob"]
    assert merge(True, [{"content": out[:1]}, {"content": out[1:]}]) == {"content": out}
