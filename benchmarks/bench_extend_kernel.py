"""The Triton extend (prefill) attention kernel against torch's flash SDPA and the FLOP limit, per tile config.

Times ``extend_attention_fwd`` with ``triton.testing.do_bench`` (median) on a batch of equal requests with a
cached prefix (paged, page size 1) and causal new tokens, next to ``F.scaled_dot_product_attention`` (flash
backend, bf16, no prefix: what a user of plain PyTorch would call) on the same shapes. Each tile config given
with ``--configs`` replaces the kernel's default for the run; every output is checked against the fp32 math of
SDPA on the gathered K/V (max abs error printed). ``--kernel-file`` loads another version of the kernel module
(an A/B against an older commit).

    python benchmarks/bench_extend_kernel.py --requests 8 --extend 1024 --prefix 0
    python benchmarks/bench_extend_kernel.py --configs '[[64,64,4,2],[128,64,8,3]]'
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from types import ModuleType

import torch
import torch.nn.functional as F
import triton

from common import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, PEAK_BF16_FLOPS, require_cuda

PEAK_TFLOPS = PEAK_BF16_FLOPS / 1e12


def load_kernel_module(path: str | None) -> ModuleType:
    if path is None:
        from compile_attn.attention.kernels import extend_attention

        return extend_attention
    spec = importlib.util.spec_from_file_location("extend_attention_alt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def attention_flops(requests: int, prefix: int, extend: int, heads: int, head_dim: int) -> float:
    """QK^T and PV over the visible keys: prefix + causal triangle (incl. diagonal) per query."""
    visible = requests * (extend * prefix + extend * (extend + 1) / 2)
    return 4.0 * visible * heads * head_dim


def make_inputs(args: argparse.Namespace) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    r, p, e, hq, hkv, d = args.requests, args.prefix, args.extend, args.q_heads, args.kv_heads, args.head_dim
    dt = torch.bfloat16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dt, generator=gen)

    slots = r * (p + e) + 1  # slot 0 unused
    k_buf, v_buf = randn(slots, hkv, d), randn(slots, hkv, d)
    perm = torch.randperm(slots - 1, device="cuda", generator=gen) + 1  # prefix slots scattered over the pool
    kv_indices = perm[: r * p].to(torch.int32)
    return dict(
        q=randn(r * e, hq, d), k=randn(r * e, hkv, d), v=randn(r * e, hkv, d), k_buffer=k_buf, v_buffer=v_buf,
        qo_indptr=torch.arange(0, r * e + 1, e, device="cuda", dtype=torch.int32),
        kv_indptr=torch.arange(0, r * p + 1, p, device="cuda", dtype=torch.int32) if p else
        torch.zeros(r + 1, device="cuda", dtype=torch.int32),
        kv_indices=kv_indices,
    )


def reference(inputs: dict, args: argparse.Namespace) -> torch.Tensor:
    """fp32 SDPA per request over the gathered prefix + new K/V (causal among the new tokens)."""
    r, p, e, group = args.requests, args.prefix, args.extend, args.q_heads // args.kv_heads
    outs = []
    for b in range(r):
        idx = inputs["kv_indices"][b * p:(b + 1) * p].long()
        k = torch.cat([inputs["k_buffer"][idx], inputs["k"][b * e:(b + 1) * e]]).float()
        v = torch.cat([inputs["v_buffer"][idx], inputs["v"][b * e:(b + 1) * e]]).float()
        q = inputs["q"][b * e:(b + 1) * e].float()
        mask = torch.ones(e, p + e, dtype=torch.bool, device="cuda").tril(diagonal=p)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, 0),
            v.transpose(0, 1).repeat_interleave(group, 0), attn_mask=mask,
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--extend", type=int, default=1024)
    parser.add_argument("--prefix", type=int, default=0)
    parser.add_argument("--q-heads", type=int, default=NUM_HEADS)
    parser.add_argument("--kv-heads", type=int, default=NUM_KV_HEADS)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--configs", default="[]",
                        help="JSON list of [BLOCK_M, BLOCK_N, num_warps, num_stages]; [] = the kernel's default")
    parser.add_argument("--kernel-file", default=None, help="another extend_attention.py to time instead")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    require_cuda("bench_extend_kernel.py")

    module = load_kernel_module(args.kernel_file)
    inputs = make_inputs(args)
    ref = reference(inputs, args)
    flops = attention_flops(args.requests, args.prefix, args.extend, args.q_heads, args.head_dim)
    out = torch.empty_like(inputs["q"])
    default_config = module._extend_config
    configs = [dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), c)) for c in json.loads(args.configs)]
    rows = []

    def record(name: str, fn, err: float | None) -> None:
        ms = triton.testing.do_bench(fn, warmup=25, rep=200)
        tflops = flops / ms / 1e9
        rows.append(dict(name=name, us=ms * 1e3, tflops=tflops, pct_peak=100 * tflops / PEAK_TFLOPS, max_err=err))

    for cfg in configs or [None]:
        module._extend_config = default_config if cfg is None else (lambda *_, c=cfg: dict(c))

        def run() -> None:
            module.extend_attention_fwd(
                inputs["q"], inputs["k"], inputs["v"], out, inputs["k_buffer"], inputs["v_buffer"],
                inputs["qo_indptr"], inputs["kv_indptr"], inputs["kv_indices"], args.extend,
                1 / math.sqrt(args.head_dim),
            )

        try:
            run()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is reported, not fatal
            rows.append(dict(name=f"triton {cfg}", error=str(exc).splitlines()[0][:120]))
            continue
        record(f"triton {cfg or 'default'}", run, (out.float() - ref).abs().max().item())
    module._extend_config = default_config

    if args.prefix == 0:  # torch's flash SDPA has no paged prefix: compare on the no-prefix case only
        r, e, hq, hkv, d = args.requests, args.extend, args.q_heads, args.kv_heads, args.head_dim
        q = inputs["q"].view(r, e, hq, d).transpose(1, 2)
        k = inputs["k"].view(r, e, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
        v = inputs["v"].view(r, e, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            record("torch SDPA flash (K/V repeated per group)",
                   lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                   (o.transpose(1, 2).reshape_as(ref).float() - ref).abs().max().item())

    print(f"## extend attention, {args.requests} x {args.extend} new tokens over {args.prefix} cached, "
          f"{args.q_heads}/{args.kv_heads} heads, head_dim {args.head_dim}, bf16\n")
    print("| kernel | us | TFLOP/s | % of peak | max abs err |\n|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['name']} | failed: {row['error']} | | | |")
        else:
            print(f"| {row['name']} | {row['us']:.1f} | {row['tflops']:.0f} | {row['pct_peak']:.0f}% | "
                  f"{row['max_err']:.3g} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
