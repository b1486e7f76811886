"""An HF model end to end: load a local checkpoint directory with attn_implementation="compile_attn"
and generate with compile_attn's engine.

    python examples/hf_model.py --model /path/to/local/llama      # any supported family, local files only
    python examples/hf_model.py                                   # the quickstart's tiny trained Llama

Without --model, the tiny Llama and BPE tokenizer that examples/quickstart.py trains on the CPU (offline, once;
see compile_attn.models.tiny_llama) are loaded from their cache directory, so the whole path runs without a
download.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from compile_attn import LLM, SamplingParams
from compile_attn.models.tiny_llama import tiny_llama

log = logging.getLogger("hf_model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="local HF model directory")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    path = args.model or tiny_llama()
    start = time.perf_counter()
    llm = LLM(str(path), attn_backend=args.backend, compile=not args.no_compile, max_batch_size=8, max_context=512)
    log.info("loaded %s in %.1f s", path, time.perf_counter() - start)
    prompts = ["A function is", "The value of", "An exception is raised when"]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True))
    elapsed = time.perf_counter() - start
    for p, o in zip(prompts, outs):
        log.info("%r -> %r (%s)", p, o.text, o.finish_reason)
    n = sum(len(o.token_ids) for o in outs)
    log.info("%d tokens in %.2f s (%.1f tok/s)", n, elapsed, n / elapsed)

if __name__ == "__main__":
    main()
