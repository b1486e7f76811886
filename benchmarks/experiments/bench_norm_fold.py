"""Is RMSNorm worth folding into the one-token linear after it? A bs-1 decode question, before writing the pass.

At one token a decoder layer runs, between attention and the MLP, the o projection (a matrix-vector reduction),
the residual add + RMSNorm (one small reduction kernel that writes the new residual and the normalised row) and
the gate/up projection (a reduction reading the normalised row). RMSNorm's scale is one number per row, so it can
move past the product: ``W (g * h * r) = r * (W (g * h))`` with ``r = rsqrt(mean(h^2) + eps)``, and ``sum(h^2)``
can be summed in the same loop as the product (every program of the reduction reads all of ``h`` anyway). Then the
residual add can ride on the o projection's reduction as its epilogue (Inductor already does that for the down
projection) and the norm kernel disappears: two per layer (before attention and before the MLP), ~5% of a
layer's kernel time at bs 1 (docs/performance.md).

This times both forms of "o projection -> add + RMSNorm -> gate/up projection" at one token, each compiled by
Inductor with static shapes and the static compiles' patches (``compile_sizes.STATIC_PATCHES``), every call
reading another copy of the weights inside one CUDA graph (``common.graph_us``), and checks both against float64.
If the folded form is not clearly faster (Inductor may not put the two sums in one kernel), the pass is not worth
writing. Answered: it is not (docs/performance.md).

    python benchmarks/experiments/bench_norm_fold.py
    python benchmarks/experiments/bench_norm_fold.py --check   # both forms against float64, eager, tiny sizes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from compile_attn.bench.decode_step import LLAMA_1B
from compile_attn.compiler.compile_sizes import STATIC_PATCHES, linear_as_reduction

EPS = 1e-5


def unfolded(a: torch.Tensor, residual: torch.Tensor, w_o: torch.Tensor, gamma: torch.Tensor,
             w_gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate/up output, new residual) as the model computes them: o projection, add, HF's RMSNorm, gate/up."""
    h = linear_as_reduction(a, w_o) + residual
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)
    return linear_as_reduction(gamma * normed, w_gu), h


def folded(a: torch.Tensor, residual: torch.Tensor, w_o: torch.Tensor, gamma: torch.Tensor,
           w_gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same with the norm's scale applied after the product and ``sum(h^2)`` summed over the product's own
    [N, K] range (so that both sums can be one reduction)."""
    h = linear_as_reduction(a, w_o) + residual
    hf = h.float().unsqueeze(-2)  # [1, 1, K]
    w = w_gu.float()  # [N, K]
    dot = (hf * gamma.float() * w).sum(-1)  # [1, N]
    sq = (hf * hf).expand(*dot.shape, hf.shape[-1]).sum(-1)  # [1, N], every entry sum(h^2)
    return (dot * torch.rsqrt(sq / hf.shape[-1] + EPS)).to(h.dtype), h


def reference(a: torch.Tensor, residual: torch.Tensor, w_o: torch.Tensor, gamma: torch.Tensor,
              w_gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 throughout (no bf16 rounding between the steps)."""
    h = a.double() @ w_o.double().T + residual.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (gamma.double() * normed) @ w_gu.double().T, h


def make_inputs(hidden: int, inter2: int, device: str, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    """(attention output row, residual row, W_o, RMSNorm weight, W_gate_up) at one token."""
    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    return (rand(1, hidden), rand(1, hidden), rand(hidden, hidden, scale=hidden**-0.5), 1 + rand(hidden, scale=0.1),
            rand(inter2, hidden, scale=hidden**-0.5))


def check(device: str, hidden: int = 64, inter2: int = 96) -> dict[str, float]:
    """Max relative error of both forms against float64 (fp32 inputs: the forms' own arithmetic, not bf16's)."""
    gen = torch.Generator().manual_seed(0)
    inputs = make_inputs(hidden, inter2, device, torch.float32, gen)
    ref_out, ref_h = reference(*inputs)
    errors = {}
    for name, fn in (("unfolded", unfolded), ("folded", folded)):
        out, h = fn(*inputs)
        errors[name] = max(((out.double() - ref_out).abs().max() / ref_out.abs().max()).item(),
                           ((h.double() - ref_h).abs().max() / ref_h.abs().max()).item())
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=LLAMA_1B["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=LLAMA_1B["intermediate_size"],
                        help="gate/up has twice this many rows")
    parser.add_argument("--check", action="store_true", help="only check both forms against float64 (tiny sizes)")
    args = parser.parse_args()
    if args.check:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        errors = check(device)
        print(f"max relative error against float64 ({device}, fp32): " +
              ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
        return
    if not torch.cuda.is_available():
        raise SystemExit("timing needs a CUDA GPU (use --check on the CPU)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
    from common import BANDWIDTH, graph_us, num_copies
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(0)
    hidden, inter2 = args.hidden, 2 * args.intermediate
    weight_bytes = (hidden * hidden + inter2 * hidden) * 2
    # > 256 MB of weights in all: no L2 reuse between calls
    calls = [make_inputs(hidden, inter2, "cuda", torch.bfloat16, gen) for _ in range(num_copies(weight_bytes))]
    ref_out, _ = reference(*calls[0])
    print(f"one token, hidden {hidden}, gate/up {inter2} x {hidden}; weights {weight_bytes / 1e6:.1f} MB, "
          f"floor {weight_bytes / BANDWIDTH * 1e6:.1f} us at {BANDWIDTH / 1e12} TB/s")
    print("| form | us per call | kernels | max rel. error vs float64 |\n|---|---|---|---|")
    for name, fn in (("unfolded (o, add + RMSNorm, gate/up)", unfolded), ("folded", folded)):
        torch._dynamo.reset()
        compiled = torch.compile(fn, dynamic=False, options=dict(STATIC_PATCHES))
        (out, _), code = run_and_get_code(compiled, *calls[0])
        kernels = sum(src.count("@triton.jit") for src in code)
        err = ((out.double() - ref_out).abs().max() / ref_out.abs().max()).item()
        us = graph_us([lambda inputs=inputs: compiled(*inputs) for inputs in calls])  # each call on its own weights
        print(f"| {name} | {us:.1f} | {kernels} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
