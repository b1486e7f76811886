"""Chain verify attention: B requests x Q tokens over a context, in the decode kernel's verify mode
(``tokens_per_request=Q``: one program reads a KV tile once for all Q tokens) against the same tokens as B * Q decode
rows (seq_len ctx + 1 .. ctx + Q, how ``graph_runner/verify_unroll.py`` runs a verify step today), with plain decode
of the B requests (one token, seq_len ctx + 1) for scale.

Paged bf16 cache, page size 1, shuffled slots, the Llama-3.2-1B attention shape by default (``common``); the split
counts from ``compute_num_kv_splits`` over each form's own lengths (the triton backend's policy); the merge inside the
split kernel (semaphores) unless ``--two-launch``. Each form is timed per launch inside a CUDA graph over copies of
the case's q/K/V (``graph_us``). Prints a markdown table; ``--out`` also writes JSON.

    python benchmarks/bench_verify_attention.py
    python benchmarks/bench_verify_attention.py --batch-sizes 1 64 256 --tokens 3 5 --contexts 512 4096 --out v.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from common import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, graph_us, num_copies, require_cuda
from compile_attn.attention.kernels import compute_num_kv_splits, decode_attention_fwd, decode_semaphores


def make_case(bs: int, tokens: int, ctx: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
              gen: torch.Generator) -> dict:
    """B requests of ``ctx + tokens`` keys each (the drafts' K/V already stored) on shuffled slots (0 is scratch)."""
    length = ctx + tokens
    slots = (torch.randperm(bs * length, generator=gen) + 1).view(bs, length)
    return {
        "q": torch.randn(bs * tokens, num_q_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
        "k_buffer": torch.randn(bs * length + 1, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
        "v_buffer": torch.randn(bs * length + 1, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
        "slots": slots,
    }


def forms(case: dict, tokens: int, ctx: int) -> dict[str, dict]:
    """Per form: its query rows (a slice of the case's), kv_indptr, kv_indices, lengths and tokens_per_request."""
    slots = case["slots"]
    bs = slots.shape[0]
    unrolled_lens = [ctx + 1 + t for _ in range(bs) for t in range(tokens)]
    unrolled_idx = torch.cat([slots[b, :ctx + 1 + t] for b in range(bs) for t in range(tokens)])
    per_form = {
        "decode": (case["q"][:bs], [ctx + 1] * bs, slots[:, :ctx + 1].flatten(), 1),
        "unrolled": (case["q"], unrolled_lens, unrolled_idx, 1),
        "verify": (case["q"], [ctx + tokens] * bs, slots.flatten(), tokens),
    }
    out = {}
    for name, (q, lens, idx, q_per_req) in per_form.items():
        lens_t = torch.tensor(lens, dtype=torch.int32)
        out[name] = {"q": q, "seq_lens": lens_t.cuda(), "tokens_per_request": q_per_req,
                     "kv_indptr": torch.cat([torch.zeros(1, dtype=torch.int32), lens_t.cumsum(0).int()]).cuda(),
                     "kv_indices": idx.to(torch.int32).cuda()}
    return out


def time_form(copies: list[dict], form: dict, num_sms: int, max_kv_splits: int, one_launch: bool):
    """(us per launch over the copies' K/V, output of the first copy) of one form."""
    q = form["q"]
    rows, num_q_heads, head_dim = q.shape
    num_kv_heads = copies[0]["k_buffer"].shape[1]
    out = torch.empty_like(q)
    logits = torch.empty(rows, num_q_heads, max_kv_splits, head_dim, device="cuda")
    lse = torch.empty(rows, num_q_heads, max_kv_splits, device="cuda")
    splits = compute_num_kv_splits(form["seq_lens"], num_sms, max_kv_splits, num_kv_heads=num_kv_heads)
    semaphores = decode_semaphores(rows, num_q_heads, "cuda") if one_launch else None

    def launch(c: dict):
        cq = c["q"][:rows]
        return lambda: decode_attention_fwd(cq, c["k_buffer"], c["v_buffer"], out, form["kv_indptr"],
                                            form["kv_indices"], splits, max_kv_splits, logits, lse,
                                            1 / math.sqrt(head_dim), semaphores=semaphores,
                                            tokens_per_request=form["tokens_per_request"])

    us = graph_us([launch(c) for c in copies])
    launch(copies[0])()
    return us, out.clone()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--tokens", type=int, nargs="+", default=[5], help="tokens per request (1 + drafts)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096], help="prefix tokens per request")
    parser.add_argument("--num-q-heads", type=int, default=NUM_HEADS)
    parser.add_argument("--num-kv-heads", type=int, default=NUM_KV_HEADS)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--max-kv-splits", type=int, default=16)
    parser.add_argument("--two-launch", action="store_true", help="the merge as its own kernel (no semaphores)")
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args(argv)
    if args.num_q_heads % args.num_kv_heads:
        parser.error(f"--num-q-heads {args.num_q_heads} is not a multiple of --num-kv-heads {args.num_kv_heads}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require_cuda("bench_verify_attention.py")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    results = []
    for bs in args.batch_sizes:
        for tokens in args.tokens:
            for ctx in args.contexts:
                case = make_case(bs, tokens, ctx, args.num_q_heads, args.num_kv_heads, args.head_dim, gen)
                n = num_copies(case["k_buffer"].nbytes + case["v_buffer"].nbytes)
                copies = [case] + [{**case, **{k: torch.randn_like(case[k]) for k in ("q", "k_buffer", "v_buffer")}}
                                   for _ in range(n - 1)]
                timed = {name: time_form(copies, form, num_sms, args.max_kv_splits, not args.two_launch)
                         for name, form in forms(case, tokens, ctx).items()}
                verify_out, unrolled_out = timed["verify"][1].float(), timed["unrolled"][1].float()
                diff = ((verify_out - unrolled_out).abs().max() / unrolled_out.abs().max()).item()
                results.append({"bs": bs, "tokens": tokens, "ctx": ctx, "rel_diff_verify_vs_unrolled": diff,
                                **{f"{name}_us": us for name, (us, _) in timed.items()}})
                del case, copies, timed
                torch.cuda.empty_cache()

    print(f"\nVerify attention, bf16, Hq={args.num_q_heads}, Hkv={args.num_kv_heads}, D={args.head_dim}, page 1, "
          f"shuffled slots, {'two launches' if args.two_launch else 'one launch'}, {torch.cuda.get_device_name()}; "
          "median us per launch inside a CUDA graph")
    print("| B | Q | ctx | decode (B rows) us | unrolled (B*Q rows) us | verify mode us | unrolled / verify "
          "| verify / decode | unrolled / decode | rel diff verify vs unrolled |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['bs']} | {r['tokens']} | {r['ctx']} | {r['decode_us']:.1f} | {r['unrolled_us']:.1f} | "
              f"{r['verify_us']:.1f} | {r['unrolled_us'] / r['verify_us']:.2f}x | "
              f"{r['verify_us'] / r['decode_us']:.2f}x | {r['unrolled_us'] / r['decode_us']:.2f}x | "
              f"{r['rel_diff_verify_vs_unrolled']:.1e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
