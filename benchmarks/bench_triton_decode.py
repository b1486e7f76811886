"""Decode attention time of the Triton kernels against torch SDPA (and FlashInfer when installed).

Batch sizes x context lengths over a paged bf16 cache (page size 1, slots shuffled as after a while
of serving), the Llama-3.2-1B attention shape by default (``common``). Each kernel is timed per launch inside a
CUDA graph (how decode runs in serving; it hides Python launch cost), over copies of the case's q/K/V so that no
launch reads from L2 what the one before it loaded (``graph_us``), and, for Triton, also eagerly (one Python
launch). Times are medians of triton.testing.do_bench. Bandwidth counts the K and V bytes each kernel must read
once. Prints a markdown table and writes JSON to --out. Launch parameters are swept by ``sweep_triton_decode.py``.

``--kv-dtypes bf16,fp8_e4m3`` times the Triton kernel over each cache dtype in the same run (same slots, same
queries; an fp8 cache holds the bf16 values quantised with per-head amax scales) and reports, per shape, each
dtype's time, bytes read, TB/s and its speed-up over the first dtype; the reference backends run over bf16 only.

    python benchmarks/bench_triton_decode.py --out decode.json
    python benchmarks/bench_triton_decode.py --batch-sizes 64 256 --contexts 4096 --kv-dtypes bf16,fp8_e4m3 \
        --out decode_fp8.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.testing

from common import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, PEAK_TB_S, graph_us, num_copies, require_cuda
from compile_attn.attention.kernels import (  # noqa: E402
    FP8_PROGRAMS_PER_SM,
    compute_num_kv_splits,
    decode_attention_fwd,
    decode_semaphores,
)
from compile_attn.kv.fp8 import fp8_max, quantize

KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

def eager_us(fn, rep: int = 200) -> float:
    """Median microseconds of fn() launched from Python (``graph_us`` for launches inside a CUDA graph)."""
    fn()  # compile / warm up
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


def copies_of(case: dict) -> list[dict]:
    """``case`` and copies of it with their own q, K and V (same slots and lengths), as many as ``num_copies`` of
    its K/V bytes: launches over them in turn read from HBM, not from L2."""
    fresh = ("q", "k_buffer", "v_buffer")
    n = num_copies(case["k_buffer"].nbytes + case["v_buffer"].nbytes)
    return [case] + [{**case, **{k: torch.randn_like(case[k]) for k in fresh}} for _ in range(n - 1)]


def make_case(bs, ctx, num_q_heads, num_kv_heads, head_dim, shuffled, gen):
    num_slots = bs * ctx + 1  # slot 0 is scratch
    slots = torch.randperm(num_slots - 1, generator=gen) + 1 if shuffled else torch.arange(1, num_slots)
    k_buffer = torch.randn(num_slots, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v_buffer = torch.randn(num_slots, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    return {
        "q": torch.randn(bs, num_q_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
        "k_buffer": k_buffer,
        "v_buffer": v_buffer,
        "seq_lens": torch.full((bs,), ctx, dtype=torch.int32, device="cuda"),
        "kv_indptr": (torch.arange(bs + 1, dtype=torch.int32) * ctx).cuda(),
        "kv_indices": slots.to(torch.int32).cuda(),
    }


def as_kv_dtype(cases: list[dict], dtype: torch.dtype) -> list[dict]:
    """``cases`` with their K/V in ``dtype``: bf16 as they are; fp8 quantised with per-head scales at each head's
    largest magnitude (``k_scale``/``v_scale``), as a calibrated cache holds them."""
    if dtype == torch.bfloat16:
        return cases
    out = []
    for c in cases:
        scales = {name: c[buf].float().abs().amax(dim=(0, 2)) / fp8_max(dtype)
                  for name, buf in (("k_scale", "k_buffer"), ("v_scale", "v_buffer"))}
        out.append({**c, "k_buffer": quantize(c["k_buffer"], scales["k_scale"], dtype),
                    "v_buffer": quantize(c["v_buffer"], scales["v_scale"], dtype), **scales})
    return out


def bench_triton(cases, max_kv_splits, num_sms, graph=True, rep=200, one_launch=False):
    """(us per launch over ``cases``, copies of one case; eagerly: one Python launch on the first, output). Cases
    with ``k_scale``/``v_scale`` are fp8 caches. ``one_launch``: the splits merge inside the split kernel
    (semaphores), as the triton backend runs decode."""
    case = cases[0]
    q, k_buffer = case["q"], case["k_buffer"]
    bs, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    logits = torch.empty(bs, num_q_heads, max_kv_splits, head_dim, device="cuda")
    lse = torch.empty(bs, num_q_heads, max_kv_splits, device="cuda")
    fp8 = case.get("k_scale") is not None  # the triton backend's split policy over an fp8 cache
    splits = compute_num_kv_splits(case["seq_lens"], num_sms, max_kv_splits, num_kv_heads=k_buffer.shape[1],
                                   programs_per_sm=FP8_PROGRAMS_PER_SM if fp8 else None)
    semaphores = decode_semaphores(bs, num_q_heads, "cuda") if one_launch else None

    def launch(c):
        scales = {k: c[k] for k in ("k_scale", "v_scale") if k in c}
        return lambda: decode_attention_fwd(c["q"], c["k_buffer"], c["v_buffer"], out, c["kv_indptr"],
                                            c["kv_indices"], splits, max_kv_splits, logits, lse,
                                            1 / math.sqrt(head_dim), semaphores=semaphores, **scales)

    if not graph:
        return eager_us(launch(case), rep=rep), out
    us = graph_us([launch(c) for c in cases], rep=rep)
    launch(case)()  # the output of the first copy, for the comparisons
    return us, out


def bench_sdpa(cases):
    """SDPA over each copy's KV gathered once into contiguous [B, Hkv, ctx, D] (the gather is not timed)."""
    q = cases[0]["q"]
    bs, _num_q_heads, head_dim = q.shape
    ctx = cases[0]["kv_indices"].numel() // bs
    out = torch.empty_like(q[:, :, None, :])

    def launch(c):
        idx = c["kv_indices"].long()
        k = c["k_buffer"][idx].view(bs, ctx, -1, head_dim).transpose(1, 2)
        v = c["v_buffer"][idx].view(bs, ctx, -1, head_dim).transpose(1, 2)
        qs = c["q"][:, :, None, :]
        return lambda: out.copy_(torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True))

    try:
        launches = [launch(c) for c in cases]
        us = graph_us(launches)
        launches[0]()  # the output of the first copy, for the comparisons
    except RuntimeError as exc:  # e.g. out of memory at the largest shapes
        return None, str(exc).splitlines()[0]
    return us, out[:, :, 0, :]


def bench_flashinfer(cases):
    try:
        import flashinfer
    except ImportError:
        return None, None
    case = cases[0]
    q = case["q"]
    bs, num_q_heads, head_dim = q.shape
    num_kv_heads = case["k_buffer"].shape[1]
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    wrapper.plan(
        case["kv_indptr"],
        case["kv_indices"],
        torch.ones(bs, dtype=torch.int32, device="cuda"),
        num_q_heads,
        num_kv_heads,
        head_dim,
        1,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )
    out = torch.empty_like(q)

    def launch(c):
        paged = (c["k_buffer"][:, None], c["v_buffer"][:, None])  # page size 1: [pages, 1, Hkv, D]
        return lambda: wrapper.run(c["q"], paged, out=out)

    launches = [launch(c) for c in cases]
    try:
        us = graph_us(launches)
    except Exception:  # noqa: BLE001  (capture unsupported in this version: time it eagerly)
        us = eager_us(launches[0])
    launches[0]()  # the output of the first copy, for the comparisons
    return us, out


def max_rel_diff(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--num-q-heads", type=int, default=NUM_HEADS)
    parser.add_argument("--num-kv-heads", type=int, default=NUM_KV_HEADS)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--max-kv-splits", type=int, default=16)
    parser.add_argument("--contiguous", action="store_true", help="slots in order instead of shuffled")
    parser.add_argument("--one-launch", action="store_true",
                        help="the --kv-dtypes timings with the merge inside the split kernel, as the backend runs")
    parser.add_argument("--kv-dtypes", default="bf16",
                        help=f"comma-separated cache dtypes for the Triton kernel, first = baseline ({', '.join(KV_DTYPES)})")
    args = parser.parse_args()
    kv_dtypes = args.kv_dtypes.split(",")
    for name in kv_dtypes:
        if name not in KV_DTYPES:
            parser.error(f"--kv-dtypes: unknown dtype {name!r}; choose from {', '.join(KV_DTYPES)}")
    require_cuda("bench_triton_decode.py")

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    results = []
    for bs in args.batch_sizes:
        for ctx in args.contexts:
            kv_bytes = 2 * bs * ctx * args.num_kv_heads * args.head_dim * 2
            case = copies_of(make_case(bs, ctx, args.num_q_heads, args.num_kv_heads, args.head_dim,
                                       not args.contiguous, gen))
            per_dtype = {}
            for name in kv_dtypes:  # the same case (slots, queries) over each cache dtype, back to back
                dtype_cases = as_kv_dtype(case, KV_DTYPES[name])
                us, dtype_out = bench_triton(dtype_cases, args.max_kv_splits, num_sms, one_launch=args.one_launch)
                nbytes = kv_bytes // 2 * dtype_cases[0]["k_buffer"].element_size()
                per_dtype[name] = {"us": us, "kv_bytes": nbytes, "tb_s": nbytes / us / 1e6, "out": dtype_out}
                del dtype_cases
            base = per_dtype[kv_dtypes[0]]
            triton_us, out = bench_triton(case, args.max_kv_splits, num_sms)
            eager_us, _ = bench_triton(case, args.max_kv_splits, num_sms, graph=False)
            sdpa_us, sdpa_out = bench_sdpa(case)
            fi_us, fi_out = bench_flashinfer(case)
            row = {
                "kv_dtypes": {
                    name: {"us": d["us"], "kv_bytes": d["kv_bytes"], "tb_s": d["tb_s"],
                           "speedup_vs_" + kv_dtypes[0]: base["us"] / d["us"],
                           "rel_diff_vs_bf16": max_rel_diff(d["out"], out)}
                    for name, d in per_dtype.items()
                },
                "bs": bs,
                "ctx": ctx,
                "kv_bytes": kv_bytes,
                "triton_us": triton_us,
                "triton_eager_us": eager_us,
                "triton_tb_s": kv_bytes / triton_us / 1e6,
                "sdpa_us": sdpa_us,
                "flashinfer_us": fi_us,
                "diff_vs_sdpa": max_rel_diff(out, sdpa_out) if isinstance(sdpa_out, torch.Tensor) else None,
                "diff_vs_flashinfer": max_rel_diff(out, fi_out) if fi_out is not None else None,
            }
            results.append(row)
            del case
            torch.cuda.empty_cache()

    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    print(
        f"\nDecode, bf16, Hq={args.num_q_heads}, Hkv={args.num_kv_heads}, D={args.head_dim}, page 1, "
        f"{'contiguous' if args.contiguous else 'shuffled'} slots, {torch.cuda.get_device_name()}; "
        "median us per launch inside a CUDA graph (triton eager: one launch from Python)"
    )
    print(
        f"| bs | ctx | triton us | triton TB/s | % of {PEAK_TB_S} TB/s | triton eager us | SDPA (gathered KV) us "
        "| FlashInfer us | rel diff vs SDPA | rel diff vs FlashInfer |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['bs']} | {r['ctx']} | {r['triton_us']:.1f} | {r['triton_tb_s']:.2f} | "
            f"{100 * r['triton_tb_s'] / PEAK_TB_S:.0f}% | {r['triton_eager_us']:.1f} | {fmt(r['sdpa_us'])} | "
            f"{fmt(r['flashinfer_us'])} | {fmt(r['diff_vs_sdpa'], '.1e')} | {fmt(r['diff_vs_flashinfer'], '.1e')} |"
        )
    if kv_dtypes != ["bf16"]:
        print(f"\nTriton decode by KV cache dtype (same run, same cases; speed-up over {kv_dtypes[0]}; bytes = K and V "
              f"read once; rel diff = max |out - out_bf16| / max |out_bf16|, the quantisation's effect)")
        print("| bs | ctx | kv dtype | us | KV MB | TB/s | % of peak | speed-up | rel diff vs bf16 |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in results:
            for name, d in r["kv_dtypes"].items():
                print(f"| {r['bs']} | {r['ctx']} | {name} | {d['us']:.1f} | {d['kv_bytes'] / 1e6:.0f} | "
                      f"{d['tb_s']:.2f} | {100 * d['tb_s'] / PEAK_TB_S:.0f}% | "
                      f"{d['speedup_vs_' + kv_dtypes[0]]:.2f}x | {d['rel_diff_vs_bf16']:.1e} |")
    report = {"device": torch.cuda.get_device_name(), "args": vars(args), "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
