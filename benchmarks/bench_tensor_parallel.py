"""Tensor parallelism on one host: the all-reduce per message and the engine's decode step, TP N beside TP 1.

Three subcommands, each a separate process (a TP 1 and a TP N engine are measured in separate runs, same machine):

    python benchmarks/bench_tensor_parallel.py checkpoint --out DIR [--shape llama-8b]
        writes a random-weight bf16 HF checkpoint of the Llama-3.1-8B shape (seed 0) that both runs load;
        ``--shape llama-8b-rank-of-2`` (or ``-of-4``) writes the model one rank of TP 2 (4) holds: half (a quarter)
        of the heads, KV heads, MLP width and vocabulary. Its ``decode --tp 1`` on one GPU is a rank's compute
        without the all-reduces, so TP N's step less it is what the sums and the step broadcast cost;
    python benchmarks/bench_tensor_parallel.py all-reduce --world-size 2 [--out JSON]
        per-message latency of a bf16 sum over the GPUs at a decode step's sizes: NCCL launched eagerly, NCCL inside a
        CUDA graph, the library's op (``compile_attn::tp_all_reduce``, what the model runs) inside a graph, and torch's
        symmetric-memory one-shot all-reduce (no multicast) eagerly and inside a graph;
    python benchmarks/bench_tensor_parallel.py fused --world-size 2 [--out JSON]
        a layer boundary of a decode step (the row-parallel output summed, the residual added, RMSNorm) at 1 ... 256
        tokens inside a CUDA graph: the library's all-reduce op then a compiled add + RMSNorm (what the model runs),
        against FlashInfer's one-shot Lamport all-reduce alone and fused with the residual add and RMSNorm
        (``flashinfer.comm.trtllm_allreduce_fusion``);
    python benchmarks/bench_tensor_parallel.py decode --model DIR --tp N [--batch-sizes 1,64] [--out JSON]
        the engine's decode step at each batch size: ``LLM.generate`` of B prompts of ``--context`` random ids with
        ``ignore_eos``, run for two output lengths; the step is the difference of the wall times over the difference
        of the steps (prefill cancels; host work, the step broadcast and the graph replay are all in it);
        ``--profile-dir DIR`` then traces 24 steps per batch size on every rank (``LLM.start_profile``), for
        ``benchmarks/gpu_trace_summary.py`` (a worker's steps counted by ``--step-marker Broadcast``).

Keep multicast off on machines where it must be (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``): the script sets these defaults in its own environment before any process starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from common import rank_of

from compile_attn.bench.decode_step import LLAMA_8B

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

SHAPES = {"llama-8b": LLAMA_8B, "llama-8b-rank-of-2": rank_of(LLAMA_8B, 2), "llama-8b-rank-of-4": rank_of(LLAMA_8B, 4)}
# A decode step's all-reduce message is tokens x hidden bf16 values: 8 KiB at batch 1 and 512 KiB at batch 64 for
# hidden 4096; 2 KiB (hidden 1024) and 2 MiB (batch 256) bracket them.
SIZES_BYTES = (2048, 8192, 131072, 524288, 2097152)


def cmd_checkpoint(args: argparse.Namespace) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape])).to(torch.bfloat16).eval()
    model.save_pretrained(args.out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.shape} ({params / 1e9:.2f} B parameters) to {args.out} in {time.perf_counter() - start:.1f} s")


# ---------------------------------------------------------------------------------------------- all-reduce
def _per_op_us(fn, reps: int = 7) -> float:  # noqa: ANN001
    """Median over ``reps`` of the CUDA-event time of ``fn()`` (which runs ``n`` ops) divided by ``n``."""
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.distributed.barrier()
        torch.cuda.synchronize()
        begin.record()
        n = fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / n)
    return statistics.median(times)


def _graph_of(op, n: int) -> torch.cuda.CUDAGraph:  # noqa: ANN001
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            op()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            op()
    torch.cuda.synchronize()
    return graph


def _all_reduce_rank(rank: int, world_size: int, port: int, out_path: str | None) -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from compile_attn.distributed import init_tensor_parallel
    from compile_attn.distributed.state import tp_group, tp_group_name

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    init_tensor_parallel(rank, world_size, backend="nccl", timeout_s=120)
    group, name = tp_group(), tp_group_name()
    n = 100
    rows = []
    for nbytes in SIZES_BYTES:
        numel = nbytes // 2
        x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        row = dict(bytes=nbytes)

        def eager() -> int:
            for _ in range(n):
                dist.all_reduce(x, group=group)
            return n

        torch.manual_seed(0)
        x.copy_(torch.randn(numel, device="cuda", dtype=torch.bfloat16))
        row["nccl_eager_us"] = _per_op_us(eager)
        graph = _graph_of(lambda: dist.all_reduce(x, group=group), n)
        row["nccl_graph_us"] = _per_op_us(lambda: (graph.replay(), n)[1])
        src = torch.randn(numel, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))
        got: list[torch.Tensor] = []
        graph = _graph_of(lambda: got.append(torch.ops.compile_attn.tp_all_reduce(src, name)), n)
        row["library_op_graph_us"] = _per_op_us(lambda: (graph.replay(), n)[1])
        row["library_op_max_err"] = float((got[-1].float() - src.float() * world_size).abs().max())
        try:
            buf = symm_mem.empty(numel, device="cuda", dtype=torch.bfloat16)
            symm_mem.rendezvous(buf, name)
            one_shot = lambda: torch.ops.symm_mem.one_shot_all_reduce_copy(buf, src, "sum", name)  # noqa: E731
            out = one_shot()
            row["symm_one_shot_max_err"] = float((out.float() - src.float() * world_size).abs().max())
            row["symm_one_shot_eager_us"] = _per_op_us(lambda: ([one_shot() for _ in range(n)], n)[1])
            graph = _graph_of(one_shot, n)
            row["symm_one_shot_graph_us"] = _per_op_us(lambda: (graph.replay(), n)[1])
        except Exception as exc:  # noqa: BLE001  (reported, not fatal: NCCL's numbers stand)
            row["symm_one_shot_error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    if rank == 0:
        print(f"\nall-reduce of bf16 over {world_size} x {torch.cuda.get_device_name()} (per message, median us)")
        print("| bytes | NCCL eager | NCCL in graph | library op in graph | symm-mem one-shot eager | one-shot in graph |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            cells = [f"{r.get(k, float('nan')):.1f}" for k in ("nccl_eager_us", "nccl_graph_us", "library_op_graph_us",
                                                             "symm_one_shot_eager_us", "symm_one_shot_graph_us")]
            print(f"| {r['bytes']} | " + " | ".join(cells) + " |")
            if "symm_one_shot_error" in r:
                print("  one-shot:", r["symm_one_shot_error"])
        _save_rows(out_path, world_size, rows)
    dist.barrier()
    # A process group torn down after a symmetric-memory rendezvous can hang: leave it to the interpreter's exit.


def _save_rows(out_path: str | None, world_size: int, rows: list[dict]) -> None:
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(dict(world_size=world_size, device=torch.cuda.get_device_name(),
                                                  torch=torch.__version__, rows=rows), indent=1))


def _on_every_rank(target, args: argparse.Namespace) -> None:  # noqa: ANN001
    """``target(rank, world_size, port, out)`` in one spawned process per GPU."""
    import torch.multiprocessing as mp

    from compile_attn.engine.tensor_parallel.engine_group import _free_port

    mp.start_processes(target, args=(args.world_size, _free_port(), args.out), nprocs=args.world_size,
                       start_method="spawn", join=True)


def cmd_all_reduce(args: argparse.Namespace) -> None:
    _on_every_rank(_all_reduce_rank, args)


# ---------------------------------------------------------------------------------------------- fused boundary
FUSED_TOKENS = (1, 8, 64, 256, 1024, 2048)


def _fused_rank(rank: int, world_size: int, port: int, out_path: str | None) -> None:
    import torch.distributed as dist

    from compile_attn.distributed import init_tensor_parallel
    from compile_attn.distributed.state import tp_group, tp_group_name

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    init_tensor_parallel(rank, world_size, backend="nccl", timeout_s=120)
    group, name = tp_group(), tp_group_name()
    hidden, eps, n = LLAMA_8B["hidden_size"], 1e-5, 64
    gen = torch.Generator("cuda").manual_seed(1 + rank)
    gamma = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(0))

    @torch.compile(fullgraph=True, dynamic=False)
    def add_norm(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = residual + x
        v = h.float().pow(2).mean(-1, keepdim=True)
        return (h.float() * torch.rsqrt(v + eps)).to(h.dtype) * gamma, h

    rows = []
    fi = None
    try:
        import flashinfer.comm as fi

        _handles, workspace = fi.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            rank, world_size, max(FUSED_TOKENS), hidden, group=group)
    except Exception as exc:  # noqa: BLE001  (reported: the library op's numbers stand)
        fi_error = f"{type(exc).__name__}: {exc}"[:400]
        fi = None
    for tokens in FUSED_TOKENS:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        residual = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        full = x.clone()
        dist.all_reduce(full, group=group)  # the reference sum (NCCL, eager)
        ref_norm, ref_h = add_norm(full, residual)
        row: dict = dict(tokens=tokens, bytes=tokens * hidden * 2)
        got: list = []
        graph = _graph_of(lambda: got.append(add_norm(torch.ops.compile_attn.tp_all_reduce(x, name), residual)), n)
        row["op_then_add_norm_us"] = _per_op_us(lambda: (graph.replay(), n)[1])
        row["op_then_add_norm_err"] = float((got[-1][0].float() - ref_norm.float()).abs().max())
        graph = _graph_of(lambda: torch.ops.compile_attn.tp_all_reduce(x, name), n)
        row["op_alone_us"] = _per_op_us(lambda: (graph.replay(), n)[1])
        if fi is not None:
            try:
                out = torch.empty_like(x)
                norm_out, res_out = torch.empty_like(x), torch.empty_like(x)

                def fused(pattern: int) -> None:
                    fused_norm = pattern == fi.AllReduceFusionPattern.kARResidualRMSNorm
                    fi.trtllm_allreduce_fusion(
                        allreduce_in=x, world_size=world_size, world_rank=rank, token_num=tokens, hidden_dim=hidden,
                        workspace_ptrs=workspace, launch_with_pdl=False, trigger_completion_at_end=True,
                        fp32_acc=True, pattern_code=pattern, use_oneshot=None,
                        allreduce_out=None if fused_norm else out, residual_in=residual if fused_norm else None,
                        residual_out=res_out if fused_norm else None, norm_out=norm_out if fused_norm else None,
                        quant_out=None, scale_out=None, rms_gamma=gamma if fused_norm else None,
                        rms_eps=eps if fused_norm else None, scale_factor=None, layout_code=None)

                plain, fusednorm = fi.AllReduceFusionPattern.kAllReduce, fi.AllReduceFusionPattern.kARResidualRMSNorm
                graph = _graph_of(lambda: fused(plain), n)
                row["flashinfer_all_reduce_us"] = _per_op_us(lambda: (graph.replay(), n)[1])
                row["flashinfer_all_reduce_err"] = float((out.float() - full.float()).abs().max())
                graph = _graph_of(lambda: fused(fusednorm), n)
                row["flashinfer_fused_us"] = _per_op_us(lambda: (graph.replay(), n)[1])
                row["flashinfer_fused_err"] = float((norm_out.float() - ref_norm.float()).abs().max())
                row["flashinfer_fused_residual_err"] = float((res_out.float() - ref_h.float()).abs().max())
            except Exception as exc:  # noqa: BLE001
                row["flashinfer_error"] = f"{type(exc).__name__}: {exc}"[:400]
        rows.append(row)
    if rank == 0:
        print(f"\nlayer boundary (sum over {world_size} x {torch.cuda.get_device_name()}, residual add, RMSNorm) "
              f"inside a CUDA graph, bf16 hidden {hidden}, per boundary, median us")
        if fi is None:
            print("  flashinfer.comm:", fi_error)
        print("| tokens | op + add/norm | op alone | flashinfer all-reduce | flashinfer fused | errors (op, fi AR, fi fused) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            cells = [f"{r.get(k, float('nan')):.1f}" for k in ("op_then_add_norm_us", "op_alone_us",
                                                             "flashinfer_all_reduce_us", "flashinfer_fused_us")]
            errs = ", ".join(f"{r.get(k, float('nan')):.3g}" for k in (
                "op_then_add_norm_err", "flashinfer_all_reduce_err", "flashinfer_fused_err"))
            print(f"| {r['tokens']} | " + " | ".join(cells) + f" | {errs} |")
            if "flashinfer_error" in r:
                print("  flashinfer:", r["flashinfer_error"])
        _save_rows(out_path, world_size, rows)
    dist.barrier()


def cmd_fused(args: argparse.Namespace) -> None:
    _on_every_rank(_fused_rank, args)


# ---------------------------------------------------------------------------------------------- decode step
def cmd_decode(args: argparse.Namespace) -> None:
    from compile_attn import LLM, SamplingParams
    from compile_attn.bench.run_info import run_info

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    short, long = args.output_lens
    start = time.perf_counter()
    llm = LLM(args.model, tensor_parallel_size=args.tp, attn_backend=args.backend, dtype=torch.bfloat16,
              disable_custom_all_reduce=args.disable_custom_all_reduce,
              max_batch_size=max(sizes), max_num_tokens=max(2048, max(sizes)), max_context=args.context + long + 16,
              kv_cache_tokens=max(sizes) * (args.context + long + 16) + 4096)
    startup_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for bs in sizes:
            prompts = [torch.randint(0, 32000, (args.context,), generator=gen).tolist() for _ in range(bs)]
            walls = {}
            for new in (4, short, long, short, long):  # the first warms; the rest timed twice, the minimum kept
                steps = llm.num_steps
                t0 = time.perf_counter()
                outs = llm.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True), use_tqdm=False)
                torch.cuda.synchronize()
                walls.setdefault(new, []).append((time.perf_counter() - t0, llm.num_steps - steps))
            (t_s, n_s), (t_l, n_l) = min(walls[short]), min(walls[long])
            step_ms = (t_l - t_s) / (n_l - n_s) * 1e3
            rows.append(dict(batch_size=bs, context=args.context, step_ms=step_ms, steps=(n_s, n_l),
                             first_tokens=list(outs[0].token_ids[:16])))  # greedy: compare TP N with TP 1
            print(f"TP {args.tp} batch {bs}: decode step {step_ms:.3f} ms ({n_l - n_s} steps apart)", flush=True)
            if args.profile_dir:  # after the timings: profiling slows later replays in the same process
                llm.start_profile(args.profile_dir)
                llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), use_tqdm=False)
                rows[-1]["traces"] = llm.stop_profile()
    finally:
        llm.shutdown()
    result = dict(run_info=run_info(sys.argv), tp=args.tp, startup_s=startup_s, rows=rows,
                  custom_all_reduce=args.tp > 1 and not args.disable_custom_all_reduce,
                  device=torch.cuda.get_device_name())
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.set_defaults(func=cmd_checkpoint)
    p = sub.add_parser("all-reduce")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out")
    p.set_defaults(func=cmd_all_reduce)
    p = sub.add_parser("fused")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out")
    p.set_defaults(func=cmd_fused)
    p = sub.add_parser("decode")
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--output-lens", type=int, nargs=2, default=(32, 160))
    p.add_argument("--backend", default="triton")
    p.add_argument("--disable-custom-all-reduce", action="store_true", help="every all-reduce through NCCL")
    p.add_argument("--profile-dir", help="after timing each batch size, a torch.profiler trace per rank of 24 steps")
    p.add_argument("--out")
    p.set_defaults(func=cmd_decode)
    args = ap.parse_args()
    if args.cmd != "checkpoint" and not torch.cuda.is_available():
        raise SystemExit(f"bench_tensor_parallel.py {args.cmd} needs CUDA GPUs")
    args.func(args)


if __name__ == "__main__":
    main()
