"""Accuracy of the fp8 KV cache on a real model: the quickstart's trained tiny Llama scored on held-out text with the
unquantised cache and with each fp8 format.

For each KV cache dtype the engine is built as users build it (``LLM(path, kv_cache_dtype=...)``, scales calibrated
on the first prefill unless the checkpoint or ``--kv-scales-path`` gives them), then:

* perplexity: consecutive ``--window``-token windows of the held-out text (the last 5% of the training text's token
  stream, which training never saw), each fed through the engine's KV cache in ``--chunk``-token steps, so every
  step reads the earlier tokens back from the (fp8) cache;
* teacher-forced agreement: the share of those positions whose argmax token equals the unquantised cache's;
* greedy agreement: ``--gen-tokens`` greedy tokens from ``--prompts`` held-out prompts, the share of positions equal
  to the unquantised cache's generation (position by position) and the mean length of the common prefix.

Prints a table and (``--out``) JSON. CPU: ``python benchmarks/fp8_kv_accuracy.py --device cpu``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time

import torch

from compile_attn import LLM, SamplingParams
from compile_attn.batch import ForwardBatch
from compile_attn.context import forward_context
from compile_attn.models.tiny_llama import TinyLlamaRecipe, python_docs_text, tiny_llama

log = logging.getLogger("fp8_kv_accuracy")
DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


def held_out_stream(tokenizer: object) -> torch.Tensor:
    """The held-out token stream the tiny model's training set aside (same text, tokenizer and split)."""
    paragraphs = python_docs_text().split("\n\n")
    ids: list[int] = []
    for one in tokenizer(paragraphs)["input_ids"]:
        ids.extend(one)
        ids.append(tokenizer.eos_token_id)
    split = int(len(ids) * (1 - TinyLlamaRecipe.held_out_fraction))
    return torch.tensor(ids[split:], dtype=torch.long)


@torch.inference_mode()
def score(llm: LLM, stream: torch.Tensor, window: int, chunk: int, windows: int) -> tuple[float, torch.Tensor]:
    """Mean next-token NLL over ``windows`` windows of ``stream``, each run in ``chunk``-token steps through the
    engine's KV cache; returns (nll, argmax tokens of every scored position)."""
    kv, backend, device = llm.kv_cache, llm.backend, llm.device
    nll, count, argmax = 0.0, 0, []
    for w in range(windows):
        ids = stream[w * window: (w + 1) * window + 1]
        row = kv.alloc_request()
        for start in range(0, window, chunk):
            n = min(chunk, window - start)
            loc = kv.alloc_extend([row], [n])
            fb = ForwardBatch.build(req_pool_indices=[row], prefix_lens=[start], extend_lens=[n], out_cache_loc=loc,
                                    input_ids=ids[start:start + n].tolist(), device=device)
            backend.init_forward_metadata(fb)
            with forward_context(fb, backend):
                logits = llm.model(fb.input_ids, fb.positions).float()
            target = ids[start + 1:start + n + 1].to(device)
            nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            count += n
            argmax.append(logits.argmax(-1).cpu())
        kv.free_request(row)
    return nll / count, torch.cat(argmax)


def greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local HF directory (default: the quickstart's tiny Llama)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="auto")
    p.add_argument("--window", type=int, default=256, help="tokens per scored window")
    p.add_argument("--chunk", type=int, default=32, help="tokens per step within a window")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--kv-scales-path", default=None)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("compile_attn").setLevel(logging.WARNING)
    path = args.model or str(tiny_llama())
    results, base_argmax, base_gen = [], None, None
    for kv_dtype in DTYPES:
        start = time.perf_counter()
        llm = LLM(path, attn_backend=args.backend, kv_cache_dtype=kv_dtype, device=args.device, graph_mode="none",
                  compile=False, max_batch_size=max(args.prompts, 1), max_num_tokens=4096,
                  max_context=max(args.window, args.prompt_len + args.gen_tokens) + 1,
                  kv_cache_tokens=args.prompts * (args.prompt_len + args.gen_tokens + 16) + args.window + 64,
                  kv_scales_path=args.kv_scales_path if kv_dtype != "auto" else None)
        stream = held_out_stream(llm.tokenizer)
        windows = min(args.windows, (len(stream) - 1 - args.prompts * args.prompt_len) // args.window)
        if windows < 1:
            raise SystemExit(f"the held-out text has {len(stream)} tokens: too few for one {args.window}-token "
                             f"window and {args.prompts} prompts of {args.prompt_len}; lower them")
        nll, argmax = score(llm, stream, args.window, args.chunk, windows)
        offset = windows * args.window
        prompts = [stream[offset + i * args.prompt_len: offset + (i + 1) * args.prompt_len].tolist()
                   for i in range(args.prompts)]
        gen = greedy(llm, prompts, args.gen_tokens)
        if base_argmax is None:
            base_argmax, base_gen = argmax, gen
        row = dict(kv_cache_dtype=kv_dtype, perplexity=math.exp(nll), nll=nll, scored_tokens=int(argmax.numel()),
                   teacher_forced_agreement=float((argmax == base_argmax).float().mean()),
                   greedy_agreement=sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(gen, base_gen))
                   / sum(len(b) for b in base_gen),
                   greedy_common_prefix=sum(common_prefix(a, b) for a, b in zip(gen, base_gen)) / len(gen),
                   seconds=time.perf_counter() - start)
        results.append(row)
        log.info("%s: perplexity %.4f (%.2f s)", kv_dtype, row["perplexity"], row["seconds"])
    base = results[0]["perplexity"]
    print(f"model {path}, {args.device}, {args.backend}; {results[0]['scored_tokens']} held-out tokens in "
          f"{args.window}-token windows ({args.chunk}-token steps); greedy: {args.prompts} prompts x "
          f"{args.gen_tokens} tokens")
    print("| KV cache | perplexity | vs unquantised | teacher-forced agreement | greedy agreement | "
          "greedy common prefix |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['kv_cache_dtype']} | {r['perplexity']:.4f} | {100 * (r['perplexity'] / base - 1):+.2f}% | "
              f"{100 * r['teacher_forced_agreement']:.2f}% | {100 * r['greedy_agreement']:.2f}% | "
              f"{r['greedy_common_prefix']:.1f} / {args.gen_tokens} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
