"""Compile every Triton kernel of ``triton_ops`` for an H100 (sm_90) on a machine without a GPU.

Run as a script in a process without ``TRITON_INTERPRET`` (so the kernels are real ``JITFunction``s):
the public wrappers are called on CPU tensors with their launches recorded instead of run, and each
recorded launch (its exact arguments, constexprs and options) is compiled through Triton's frontend,
optimiser and ptxas down to a cubin. The interpreter accepts code that the compiler rejects (types of
branches, loop-carried values, constexpr misuse), so this catches before a GPU session what the CPU
tests cannot. Prints one line per compiled launch; exits non-zero on the first failure, 3 when the
installed Triton's compile API is not the one used here.
"""

from __future__ import annotations

import math
import os
import sys

assert "TRITON_INTERPRET" not in os.environ, "run without TRITON_INTERPRET: the kernels must be compiled ones"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from compile_attn.attention import kernels as triton_ops  # noqa: E402
from compile_attn.attention.kernels import (  # noqa: E402
    cascade_attention, cascade_index, decode_attention, decode_metadata, extend_attention, kv_index, launch,
)

_PTR_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
              torch.int64: "*i64", torch.uint8: "*u8", torch.bool: "*i1", torch.float8_e4m3fn: "*fp8e4nv",
              torch.float8_e5m2: "*fp8e5"}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl")


def _type_of(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return _PTR_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def compile_launch(kernel, args: tuple, kwargs: dict, target: GPUTarget) -> object:  # noqa: ANN001
    names = kernel.arg_names
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
    signature, constexprs = {}, {}
    for i, name in enumerate(names):
        if i < len(args):
            signature[name] = _type_of(args[i])
        else:
            signature[name] = "constexpr"
            constexprs[(i,)] = kwargs[name]
    try:
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    except TypeError as exc:
        print(f"UNSUPPORTED_TRITON_API {triton.__version__}: {exc}")
        sys.exit(3)
    return triton.compile(source, target=target, options=options)


def record_launches() -> list[tuple[object, tuple, dict, str]]:
    """Call every public wrapper on CPU tensors; return the launches they would make."""
    launches: list[tuple[object, tuple, dict, str]] = []
    label = [""]

    def record(self, grid, *args, **kwargs) -> None:  # noqa: ANN001
        launches.append((self.kernel, args, dict(kwargs), label[0]))

    launch.CachedLaunch.__call__ = record
    for module in (decode_attention, decode_metadata, extend_attention, kv_index, cascade_attention):
        module.check_device = lambda *tensors: None  # CPU tensors stand in for CUDA ones; nothing runs
    decode_attention._use_pdl = lambda q: True  # as on an H100: one-launch decode as a dependent launch

    gen = torch.Generator().manual_seed(0)
    slots, ctx = 64, 40
    # (q heads, kv heads, head dim, v head dim, dtype, softcap, fused store)
    decode_cases = [
        (32, 8, 64, 64, torch.bfloat16, 0.0, "store"),  # Llama-3.2-1B: GQA 4, tl.dot path
        (32, 8, 128, 128, torch.float16, 30.0, "attend"),  # fused new token without the store, softcap
        (8, 8, 64, 64, torch.float32, 0.0, None),  # group 1: no tl.dot, fp32 (IEEE dots), unfused
        (128, 1, 64, 64, torch.bfloat16, 0.0, "store"),  # group 128: two head blocks per KV head
        (16, 2, 192, 128, torch.bfloat16, 0.0, "store"),  # K 192 / V 128
        (8, 2, 256, 256, torch.bfloat16, 0.0, "store"),
    ]
    # fp8 caches (KV dtype last): the Llama shape with the fused store in both formats and both batch-size tiles,
    # group 1 over fp32 queries, head dim 128 with softcap
    fp8_decode_cases = [
        (32, 8, 64, 64, torch.bfloat16, 0.0, "store", torch.float8_e4m3fn),
        (32, 8, 64, 64, torch.bfloat16, 0.0, "store", torch.float8_e5m2),
        (8, 8, 64, 64, torch.float32, 0.0, None, torch.float8_e4m3fn),
        (32, 8, 128, 128, torch.float16, 30.0, "attend", torch.float8_e4m3fn),
    ]
    for hq, hkv, d, dv, dtype, cap, fused, *kv_dtype in decode_cases + fp8_decode_cases:
        kv_dtype = kv_dtype[0] if kv_dtype else dtype
        label[0] = f"decode Hq{hq} Hkv{hkv} D{d}/{dv} {dtype} cap{cap} {fused} kv {kv_dtype}"
        bs, splits = 2, 4
        q = torch.randn(bs, hq, d, generator=gen).to(dtype)
        kb = torch.randn(slots, hkv, d, generator=gen).to(kv_dtype)
        vb = torch.randn(slots, hkv, dv, generator=gen).to(kv_dtype)
        scales = {} if kv_dtype == dtype else dict(k_scale=torch.ones(hkv), v_scale=torch.ones(hkv))
        new = {}
        if fused:
            new = dict(k_new=torch.randn(bs, hkv, d).to(dtype), v_new=torch.randn(bs, hkv, dv).to(dtype),
                       new_loc=torch.arange(bs) if fused == "store" else None)
        triton_ops.decode_attention_fwd(
            q, kb, vb, torch.empty(bs, hq, dv, dtype=dtype), torch.tensor([0, ctx, 2 * ctx], dtype=torch.int32),
            torch.arange(2 * ctx, dtype=torch.int32), torch.full((bs,), 2, dtype=torch.int32), splits,
            torch.empty(bs, hq, splits, dv), torch.empty(bs, hq, splits), 1 / math.sqrt(d), cap, **new,
            semaphores=torch.zeros(bs, hq, dtype=torch.int32) if fused == "store" else None,  # one launch
            batch_invariant=kv_dtype == torch.float8_e5m2, **scales)  # e5m2: the large-batch tiles
    # Chain verify (tokens_per_request 5): the Llama shape with the merge in the kernel and as its own launch, group 1
    # over an fp8 cache; draft trees (a tree mask) in one and two launches
    for hq, hkv, kv_dtype, one_launch, tree in ((32, 8, torch.bfloat16, True, False),
                                                (32, 8, torch.bfloat16, False, False),
                                                (8, 8, torch.float8_e4m3fn, True, False),
                                                (32, 8, torch.bfloat16, True, True),
                                                (32, 8, torch.bfloat16, False, True)):
        label[0] = f"verify Q5 Hq{hq} Hkv{hkv} one_launch{one_launch} kv {kv_dtype} tree {tree}"
        rows, splits = 10, 4
        scales = {} if kv_dtype == torch.bfloat16 else dict(k_scale=torch.ones(hkv), v_scale=torch.ones(hkv))
        triton_ops.decode_attention_fwd(
            torch.randn(rows, hq, 64).to(torch.bfloat16), torch.randn(slots, hkv, 64).to(kv_dtype),
            torch.randn(slots, hkv, 64).to(kv_dtype), torch.empty(rows, hq, 64, dtype=torch.bfloat16),
            torch.tensor([0, ctx, 2 * ctx], dtype=torch.int32), torch.arange(2 * ctx, dtype=torch.int32),
            torch.full((2,), 2, dtype=torch.int32), splits, torch.empty(rows, hq, splits, 64),
            torch.empty(rows, hq, splits), 0.125, tokens_per_request=5,
            semaphores=torch.zeros(rows, hq, dtype=torch.int32) if one_launch else None,
            tree_mask=torch.tensor([1, 3, 5, 9, 19] * 2, dtype=torch.int64) if tree else None, **scales)
    # (q heads, kv heads, head dim, dtype, causal, window, softcap, custom mask: False, True or "tree" (over the new
    # keys only, with the new tokens' positions for the window))
    extend_cases = [
        (32, 8, 64, torch.bfloat16, True, -1, 0.0, False),
        (16, 4, 128, torch.float32, True, 9, 30.0, False),
        (8, 8, 64, torch.float16, False, -1, 0.0, True),
        (16, 4, 128, torch.bfloat16, True, 9, 30.0, "tree"),
        (16, 4, 64, torch.bfloat16, True, -1, 0.0, "tree"),
        (32, 8, 64, torch.bfloat16, True, -1, 0.0, False, torch.float8_e4m3fn),
        (16, 4, 128, torch.bfloat16, True, 9, 30.0, "tree", torch.float8_e5m2),
    ]
    for hq, hkv, d, dtype, causal, window, cap, masked, *kv_dtype in extend_cases:
        kv_dtype = kv_dtype[0] if kv_dtype else dtype
        scales = {} if kv_dtype == dtype else dict(k_scale=torch.ones(hkv), v_scale=torch.ones(hkv))
        label[0] = (f"extend Hq{hq} Hkv{hkv} D{d} {dtype} causal{causal} window{window} cap{cap} mask{masked} "
                    f"kv {kv_dtype}")
        qo = torch.tensor([0, 5, 12], dtype=torch.int32)
        kv = torch.tensor([0, 7, 10], dtype=torch.int32)
        t = int(qo[-1])
        mask = None
        tree = {}
        if masked == "tree":
            mask = torch.ones(5 * 5 + 7 * 7, dtype=torch.uint8)
            tree = dict(mask_indptr=torch.tensor([0, 25, 74]), mask_new_keys_only=True,
                        positions=torch.tensor([7, 8, 8, 9, 9, 3, 4, 4, 5, 5, 5, 6], dtype=torch.int32))
        elif masked:
            mask = torch.ones(int(extend_attention.build_mask_indptr(qo, kv)[-1]), dtype=torch.uint8)
        triton_ops.extend_attention_fwd(
            torch.randn(t, hq, d).to(dtype), torch.randn(t, hkv, d).to(dtype), torch.randn(t, hkv, d).to(dtype),
            torch.empty(t, hq, d, dtype=dtype), torch.randn(slots, hkv, d).to(kv_dtype),
            torch.randn(slots, hkv, d).to(kv_dtype), qo, kv, torch.arange(10, dtype=torch.int32), 7,
            1 / math.sqrt(d), is_causal=causal, sliding_window=window, logit_cap=cap, custom_mask=mask, **tree,
            **scales)
    label[0] = "store_kv bf16"
    triton_ops.store_kv(torch.zeros(slots, 8, 64, dtype=torch.bfloat16), torch.zeros(slots, 8, 64, dtype=torch.bfloat16),
                        torch.arange(3), torch.randn(3, 8, 64).to(torch.bfloat16), torch.randn(3, 8, 64))
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        label[0] = f"store_kv {kv_dtype}"
        triton_ops.store_kv(torch.zeros(slots, 8, 64, dtype=kv_dtype), torch.zeros(slots, 8, 64, dtype=kv_dtype),
                            torch.arange(3), torch.randn(3, 8, 64).to(torch.bfloat16), torch.randn(3, 8, 64),
                            k_scale=torch.ones(8), v_scale=torch.ones(8))
    label[0] = "build_kv_indices"
    triton_ops.build_kv_indices(torch.zeros(4, 128, dtype=torch.int32), torch.tensor([1, 3]),
                                torch.tensor([5, 9], dtype=torch.int32), torch.tensor([0, 5, 14], dtype=torch.int32),
                                torch.empty(14, dtype=torch.int32))
    for window, deterministic in ((None, False), (16, True)):
        label[0] = f"build_decode_metadata window{window} deterministic{deterministic}"
        triton_ops.build_decode_metadata(
            torch.zeros(4, 128, dtype=torch.int32), torch.tensor([1, 3]), torch.tensor([5, 9], dtype=torch.int32),
            torch.empty(3, dtype=torch.int32), torch.empty(14, dtype=torch.int32), torch.empty(2, dtype=torch.int32),
            num_sms=132, max_kv_splits=16, deterministic=deterministic, num_kv_heads=8, window=window,
            kv_start=torch.empty(2, dtype=torch.int32) if window else None)
    # Shared-prefix decode: (q heads, kv heads, head dim, dtype, softcap, level-1 tile overrides); each case with the
    # levels fused (level 2 merges) and split (level 2 writes a partial, a third kernel merges)
    cascade_cases = [
        (32, 8, 64, torch.bfloat16, 0.0, {}),  # Llama-3.2-1B, default tiles
        (32, 8, 64, torch.bfloat16, 0.0, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8}),  # benchmark sweep
        (32, 8, 64, torch.bfloat16, 0.0, {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4}),
        (32, 8, 128, torch.float16, 30.0, {}),
        (8, 8, 64, torch.float32, 0.0, {}),  # group 1: level 2 without tl.dot
        (32, 8, 64, torch.bfloat16, 0.0, {}, torch.float8_e4m3fn),
        (8, 8, 64, torch.float32, 0.0, {}, torch.float8_e5m2),
    ]
    table = torch.arange(4 * 128, dtype=torch.int32).view(4, 128)
    table[:, :20] = table[0, :20]
    for hq, hkv, d, dtype, cap, tiles, *kv_dtype in cascade_cases:
        kv_dtype = kv_dtype[0] if kv_dtype else dtype
        scales = {} if kv_dtype == dtype else dict(k_scale=torch.ones(hkv), v_scale=torch.ones(hkv))
        label[0] = f"cascade Hq{hq} Hkv{hkv} D{d} {dtype} cap{cap} {tiles} kv {kv_dtype}"
        index = cascade_index.build_cascade_index(
            table, torch.arange(3), torch.tensor([25, 30, 40], dtype=torch.int32), [([0, 2], 20)],
            req_pool_indices_cpu=[0, 1, 2], seq_lens_cpu=[25, 30, 40])
        for split_levels in (False, True):
            cascade_attention.cascade_decode_fwd(
                torch.randn(3, hq, d).to(dtype), torch.randn(512, hkv, d).to(kv_dtype),
                torch.randn(512, hkv, d).to(kv_dtype), torch.empty(3, hq, d, dtype=dtype), index, 1 / math.sqrt(d),
                cap, num_prefix_splits=2, prefix_config=tiles, split_levels=split_levels, **scales)
    return launches


_LAUNCHES: list[tuple[object, tuple, dict, str]] = []


def _compile_one(index: int) -> str:
    kernel, args, kwargs, label = _LAUNCHES[index]
    compiled = compile_launch(kernel, args, kwargs, GPUTarget("cuda", 90, 32))
    if "cubin" not in compiled.asm:
        raise RuntimeError(f"{kernel.__name__} ({label}): compiled without a cubin")
    return f"ok {kernel.__name__} ({label})"


def main() -> None:
    import multiprocessing

    _LAUNCHES.extend(record_launches())
    workers = min(len(_LAUNCHES), os.cpu_count() or 1)
    # fork: the workers inherit the recorded launches (kernels are not picklable); nothing here touches CUDA
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for line in pool.imap(_compile_one, range(len(_LAUNCHES))):
            print(line, flush=True)
    print(f"compiled {len(_LAUNCHES)} launches for sm_90")


if __name__ == "__main__":
    main()
