"""What the benchmark scripts share: the model shape they measure, the GPU limits they compare against,
per-launch timing inside a CUDA graph, and the small CPU engine the host-time profiles run. The shape is the library's ``compile_attn.bench.decode_step.LLAMA_1B`` (what
``compile-attn bench`` and ``compile-attn throughput`` run), so every script measures the same model.

Scripts in this folder import it as ``from common import ...`` (Python puts a script's folder first on its path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from compile_attn.bench.decode_step import LLAMA_1B, LLAMA_8B, TINY, BenchConfig
from compile_attn.bench.engine_start import PEAK_BF16_FLOPS
from compile_attn.models import ToyDecoderConfig

__all__ = ["BANDWIDTH", "HEAD_DIM", "LLAMA_1B", "NUM_HEADS", "NUM_KV_HEADS", "PEAK_BF16_FLOPS", "PEAK_TB_S",
           "TINY", "HOST_VOCAB", "graph_us", "host_decode_llm", "linear_shapes", "num_copies", "rank_of", "require_cuda",
           "toy_decoder_config"]

BANDWIDTH = BenchConfig.bandwidth  # bytes/s a step's floor is computed with (measured: benchmarks/RESULTS.md)
PEAK_TB_S = BANDWIDTH / 1e12
NUM_HEADS = LLAMA_1B["num_attention_heads"]
NUM_KV_HEADS = LLAMA_1B["num_key_value_heads"]
HEAD_DIM = LLAMA_1B["head_dim"]
ROPE_THETA = 500000.0  # Llama 3's


def toy_decoder_config(shape: dict | None = None, **overrides) -> ToyDecoderConfig:
    """The ``ToyDecoder`` of an HF-style ``shape`` (default ``LLAMA_1B``), with ``overrides`` on top."""
    shape = LLAMA_1B if shape is None else shape
    fields = dict(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                  num_layers=shape["num_hidden_layers"], num_heads=shape["num_attention_heads"],
                  num_kv_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                  intermediate_size=shape["intermediate_size"], rope_theta=ROPE_THETA)
    return ToyDecoderConfig(**(fields | overrides))


def rank_of(shape: dict, tp: int) -> dict:
    """The HF-style shape of the model one of ``tp`` tensor-parallel ranks holds, as the library shards it
    (``compile_attn.distributed.plan_for``: heads and MLP split, KV heads split or replicated where there are fewer
    than ranks, the vocabulary padded to a multiple of ``tp`` and split). Raises what ``plan_for`` raises for a
    shape that does not split."""
    from types import SimpleNamespace

    from compile_attn.distributed import plan_for

    plan = plan_for(SimpleNamespace(**shape), rank=0, world_size=tp)
    return dict(shape, num_attention_heads=plan.local_heads, num_key_value_heads=plan.local_kv_heads,
                intermediate_size=plan.intermediate_size // tp, vocab_size=plan.padded_vocab_size // tp)


def linear_shapes(shape: dict | None = None, tp: int = 1) -> list[tuple[str, int, int]]:
    """(name, in features K, out features N) of one decoder layer's linear layers after q/k/v and gate/up are
    fused, and of the LM head, for ``shape`` (default ``LLAMA_1B``) as one of ``tp`` tensor-parallel ranks holds
    them (``rank_of``): q/k/v, gate/up and the LM head split by output, o and down by input."""
    rank = rank_of(LLAMA_1B if shape is None else shape, tp)
    hidden, inter, head_dim = rank["hidden_size"], rank["intermediate_size"], rank["head_dim"]
    q_out = rank["num_attention_heads"] * head_dim
    kv_out = rank["num_key_value_heads"] * head_dim
    return [("qkv", hidden, q_out + 2 * kv_out), ("o", q_out, hidden), ("gate_up", hidden, 2 * inter),
            ("down", inter, hidden), ("lm_head", hidden, rank["vocab_size"])]


SHAPES = {"llama-1b": LLAMA_1B, "llama-8b": LLAMA_8B}


def require_cuda(script: str) -> None:
    """Exit with a one-line message when there is no GPU: ``script`` times CUDA kernels."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU (torch.cuda.is_available() is False)")


def num_copies(nbytes: float, min_total: float = 256e6, cap: int = 256) -> int:
    """Copies of ``nbytes`` of inputs that one pass over does not fit in L2, at most ``cap``."""
    return max(2, min(cap, int(min_total // nbytes) + 1))


def graph_us(launches: list[Callable[[], object]], rep: int = 100) -> float:
    """Microseconds per launch: ``launches`` back to back in one CUDA graph, the median of its replays
    (``do_bench``) over their number. One launch per graph would also time the graph's launch and the write-back
    of the dirty lines ``do_bench``'s L2 flush leaves (docs/performance.md, "Measuring")."""
    import triton.testing

    for launch in launches:
        launch()  # compile / warm up outside any capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=rep, return_mode="median") * 1e3 / len(launches)


HOST_VOCAB = 512  # the host-time profiles' vocabulary: small, so that the CPU's logits and argmax cost little


def host_decode_llm(bs: int, prompt_len: int, new_tokens: int, *, stub_decode: bool = False):  # -> LLM
    """A tiny HF Llama (``HOST_VOCAB`` tokens) on the CPU behind ``LLM`` (torch_native, no graphs) sized for ``bs``
    requests of ``prompt_len`` + ``new_tokens``: what the host-time profiles run. ``stub_decode``: decode steps skip
    the model call and take zero logits, so a decode step is host work only."""
    from compile_attn.bench import decode_step as bench
    from compile_attn.engine import LLM

    context = prompt_len + new_tokens + 8
    shape = dict(TINY, vocab_size=HOST_VOCAB, max_position_embeddings=context)
    model = bench._hf_model(BenchConfig(shape=shape, device="cpu"), "sdpa", torch.float32)
    llm = LLM(model, attn_backend="torch_native", max_batch_size=bs, max_num_tokens=bs * prompt_len,
              kv_cache_tokens=bs * context, max_context=context, device="cpu", dtype=torch.float32, compile=False,
              graph_mode="none")
    if stub_decode:
        run, zeros = llm.step_runner.run, torch.zeros(bs, HOST_VOCAB)

        def stub_run(fb, keep, feed=None):  # noqa: ANN001, ANN202
            return zeros[:fb.batch_size] if fb.forward_mode.is_decode() else run(fb, keep, feed)

        llm.step_runner.run = stub_run
    return llm
