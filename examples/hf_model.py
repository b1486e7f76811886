"""An HF model end to end: load a local checkpoint directory with attn_implementation="compile_attn"
and generate with compile_attn's engine.

    python examples/hf_model.py --model /path/to/local/llama      # any supported family, local files only
    python examples/hf_model.py                                   # builds a tiny random Llama + tokenizer first

Without --model, a tiny random-weight Llama and a byte-level BPE tokenizer (trained here, offline) are
saved to a temporary directory and loaded from there, so the whole path runs without a download.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import torch

from compile_attn import LLM, SamplingParams

log = logging.getLogger("hf_model")


def build_tiny_checkpoint(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["Attention is a custom op.", "Piecewise CUDA graphs run between attention ops.",
              "The KV cache is paged.", "compile_attn makes attention first-class."] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="local HF model directory")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_tiny_checkpoint(Path(tmp))
        start = time.perf_counter()
        llm = LLM(str(path), attn_backend=args.backend, compile=not args.no_compile, max_batch_size=8,
                  max_context=512)
        log.info("loaded %s in %.1f s", path, time.perf_counter() - start)
        prompts = ["Attention is", "The KV cache", "Piecewise CUDA graphs"]
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True))
        elapsed = time.perf_counter() - start
        for p, o in zip(prompts, outs):
            log.info("%r -> %r (%s)", p, o.text, o.finish_reason)
        n = sum(len(o.token_ids) for o in outs)
        log.info("%d tokens in %.2f s (%.1f tok/s)", n, elapsed, n / elapsed)


if __name__ == "__main__":
    main()
