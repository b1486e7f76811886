"""Speculative decoding's acceptance on trained models: a tiny target and a smaller draft, held-out prompts.

    python examples/speculative_acceptance.py

The target is the quickstart's tiny Llama (2 layers, trained on pydoc's reference-manual topics and cached under
``~/.cache/compile_attn/tiny-llama``); the draft is a 1-layer model half as wide, trained on the same text with
the target's tokenizer (cached under ``~/.cache/compile_attn/tiny-llama-draft``). Both are trained on the first 95%
of the text's tokens; the prompts are the first ``--prompt-tokens`` tokens of paragraphs from the other 5%.

Each method generates for every prompt greedily and with seeded sampling (``--temperature``): no speculation,
prompt lookup (n-gram) chains and draft-model chains of K = ``--ks`` drafts, and trees (``topk`` > 1, at most
``--tree-tokens`` drafts) where the engine serves them. It prints a markdown table of the acceptance counts the
engine records (``llm.speculator.stats``) and fails if a greedy output differs from the one without speculation.
On the CPU, fp32, it takes a few minutes including training (later runs reuse the trained models).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from compile_attn import LLM, SamplingParams
from compile_attn.engine import EngineOptionError
from compile_attn.models.tiny_llama import held_out_paragraphs, load_tokenizer, tiny_llama, tiny_llama_draft

log = logging.getLogger("speculative_acceptance")
COUNTS = ("verify_steps", "verified_requests", "draft_tokens", "accepted_tokens")


@dataclass(frozen=True)
class Method:
    """One speculative setting: its name, shape (K or the tree's) and ``speculative_config`` (None: off)."""

    name: str
    shape: str
    config: dict[str, Any] | None = None

    @property
    def is_tree(self) -> bool:
        return self.config is not None and self.config.get("topk", 1) > 1


@dataclass(frozen=True)
class Row:
    """One method under one sampling setting: the engine's speculative counts over the run, its output tokens and
    engine steps, and whether every output equals the one without speculation."""

    method: str
    shape: str
    sampling: str
    counts: dict[str, int]
    output_tokens: int
    steps: int
    same_as_plain: bool

    @property
    def acceptance_rate(self) -> float:
        return self.counts["accepted_tokens"] / self.counts["draft_tokens"] if self.counts["draft_tokens"] else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request gains per verify step: its accepted drafts plus the target's own token."""
        verified = self.counts["verified_requests"]
        return 1.0 + self.counts["accepted_tokens"] / verified if verified else 0.0


@dataclass
class Measurement:
    """What ``measure`` returns: the rows, and a note per method the engine refused (trees it does not serve)."""

    rows: list[Row] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def greedy_mismatches(self) -> list[Row]:
        return [r for r in self.rows if r.sampling == "greedy" and not r.same_as_plain]


def methods(draft: str | Path, ks: Sequence[int], tree_topks: Sequence[int], tree_depth: int,
            tree_tokens: int, lookup: tuple[int, int] = (2, 4)) -> list[Method]:
    """No speculation, n-gram and draft-model chains of each K, and trees of each topk (depth ``tree_depth``, at
    most ``tree_tokens`` drafts) from both proposers."""
    ngram = {"method": "ngram", "prompt_lookup_min": lookup[0], "prompt_lookup_max": lookup[1]}
    model = {"method": "draft_model", "model": str(draft)}
    out = [Method("none", "-")]
    for name, base in (("ngram", ngram), ("draft_model", model)):
        out += [Method(name, f"chain K={k}", {**base, "num_speculative_tokens": k}) for k in ks]
        out += [Method(name, f"tree topk={t} depth={tree_depth} <={tree_tokens}",
                       {**base, "num_speculative_tokens": tree_depth, "topk": t, "num_draft_tokens": tree_tokens})
                for t in tree_topks]
    return out


def held_out_prompts(target: str | Path, count: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``prompt_tokens`` token ids (BOS first) of ``count`` held-out prose paragraphs long enough."""
    tokenizer = load_tokenizer(target)
    prose = [p for p in held_out_paragraphs(tokenizer) if p[0].isalpha()]
    ids = [tokenizer(p)["input_ids"] for p in prose]
    prompts = [one[:prompt_tokens] for one in ids if len(one) > prompt_tokens]
    if len(prompts) < count:
        raise ValueError(f"the held-out text has {len(prompts)} prose paragraphs longer than {prompt_tokens} tokens; "
                         f"asked for {count}")
    return prompts[:count]


def samplings(max_new_tokens: int, temperature: float, seed: int = 0) -> dict[str, SamplingParams]:
    """Greedy and seeded sampling, ``max_new_tokens`` each (EOS ignored, so every run has as many tokens)."""
    return {"greedy": SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
            f"T={temperature:g}": SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                                 ignore_eos=True)}


def _counts(llm: LLM) -> dict[str, int]:
    stats = llm.speculator.stats.as_dict() if llm.speculator is not None else {}
    return {name: int(stats.get(name, 0)) for name in COUNTS}


def run_method(target: str | Path, method: Method, prompts: list[list[int]],
               settings: dict[str, SamplingParams], engine: dict[str, Any]) -> dict[str, tuple[list[list[int]], Row]]:
    """Generate for ``prompts`` under each sampling setting with one engine of ``method``; per setting, the
    outputs' token ids and the row (``same_as_plain`` still to be filled in by the caller)."""
    llm = LLM(str(target), speculative_config=method.config, **engine)
    out = {}
    for label, params in settings.items():
        before, steps_before = _counts(llm), sum(llm.steps_by_mode.values())
        tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        after = _counts(llm)
        counts = {name: after[name] - before[name] for name in COUNTS}
        out[label] = (tokens, Row(method.name, method.shape, label, counts, sum(map(len, tokens)),
                                  sum(llm.steps_by_mode.values()) - steps_before, True))
    return out


def measure(target: str | Path, method_list: list[Method], prompts: list[list[int]],
            settings: dict[str, SamplingParams], engine: dict[str, Any]) -> Measurement:
    """Run every method (the first must be no speculation: the reference outputs) and compare each output with the
    reference's. A tree the engine refuses (``EngineOptionError``) is skipped with its message."""
    if method_list[0].config is not None:
        raise ValueError("the first method must be no speculation (config None): the reference outputs")
    result = Measurement()
    reference: dict[str, list[list[int]]] = {}  # sampling setting -> outputs without speculation
    for method in method_list:
        start = time.perf_counter()
        try:
            runs = run_method(target, method, prompts, settings, engine)
        except EngineOptionError as exc:
            if not method.is_tree:
                raise
            result.skipped[f"{method.name} {method.shape}"] = str(exc)
            log.warning("skipped %s %s: %s", method.name, method.shape, exc)
            continue
        for label, (tokens, row) in runs.items():
            reference.setdefault(label, tokens)
            same = tokens == reference[label]
            result.rows.append(replace(row, same_as_plain=same))
        log.info("%s %s: %.1f s", method.name, method.shape, time.perf_counter() - start)
    return result


def markdown_table(rows: list[Row]) -> str:
    """The rows as a markdown table."""
    lines = ["| method | K / tree | sampling | acceptance rate | mean accepted length | verify steps | engine steps "
             "| output tokens | = no speculation |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        spec = r.counts["verified_requests"] > 0  # '-': nothing was verified (no speculation, or no proposals)
        lines.append(f"| {r.method} | {r.shape} | {r.sampling} | {f'{r.acceptance_rate:.2f}' if spec else '-'} | "
                     f"{f'{r.mean_accepted_length:.2f}' if spec else '-'} | {r.counts['verify_steps']} | {r.steps} | "
                     f"{r.output_tokens} | {'yes' if r.same_as_plain else 'NO'} |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-dir", default=None, help="the target model (default: the quickstart's cache)")
    parser.add_argument("--draft-dir", default=None, help="the draft model (default: the cache's tiny-llama-draft)")
    parser.add_argument("--retrain", action="store_true", help="train the target and the draft again")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for generation (models this small run fastest on one)")
    parser.add_argument("--backend", default="auto", help="attention backend: auto, torch_native, triton, flashinfer")
    parser.add_argument("--graph-mode", default="full_and_piecewise")
    parser.add_argument("--no-compile", action="store_true", help="run the model eagerly (faster to start)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7, help="the sampled setting's temperature")
    parser.add_argument("--ks", type=_ints, default=[2, 4], help="chain lengths, comma-separated")
    parser.add_argument("--tree-topks", type=_ints, default=[2, 4], help="tree widths, comma-separated ('' none)")
    parser.add_argument("--tree-depth", type=int, default=4)
    parser.add_argument("--tree-tokens", type=int, default=8, help="a tree's drafts at most")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    target = tiny_llama(args.target_dir, retrain=args.retrain)
    draft = tiny_llama_draft(target, args.draft_dir, retrain=args.retrain)
    log.info("target %s and draft %s ready in %.1f s", target, draft, time.perf_counter() - start)
    torch.set_num_threads(args.threads)
    engine = dict(attn_backend=args.backend, graph_mode=args.graph_mode, compile=not args.no_compile,
                  max_batch_size=8, max_num_tokens=256, max_context=256, page_size=16, device=args.device,
                  dtype="float32")
    prompts = held_out_prompts(target, args.prompts, args.prompt_tokens)
    result = measure(target, methods(draft, args.ks, args.tree_topks, args.tree_depth, args.tree_tokens), prompts,
                     samplings(args.max_new_tokens, args.temperature), engine)
    print(f"\n{len(prompts)} held-out prompts of {args.prompt_tokens} tokens, {args.max_new_tokens} new tokens each; "
          f"{args.device}, fp32, backend {args.backend}, graph mode {args.graph_mode}\n")
    print(markdown_table(result.rows))
    for name, note in result.skipped.items():
        print(f"\nskipped {name}: {note}")
    mismatches = result.greedy_mismatches()
    if mismatches:
        names = ", ".join(f"{r.method} {r.shape}" for r in mismatches)
        raise SystemExit(f"\nFAILED: greedy outputs differ from those without speculation for {names}")
    print(f"\ngreedy outputs identical with and without speculation for all "
          f"{sum(r.sampling == 'greedy' for r in result.rows) - 1} speculative settings "
          f"({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
    main()
