"""``LLM(..., tensor_parallel_size=N)`` on the CPU (gloo, spawned workers): greedy tokens equal
``tensor_parallel_size=1``'s for three families and several graph modes, through chunked prefill, mixed
prefill/decode steps, overlap and prefix-cache hits (a second call of the same prompts); a worker killed mid-run
ends in one error naming its rank, with no process left; shutdown leaves no process; a model whose heads do not
split is refused before any worker starts.

Starting the workers costs more than most checks: the checks of the eager 2-rank llama share one LLM
(``TestEagerLlamaOnTwoRanks``), and the speculative tests share one reference run."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from tests.hf.hf_tiny_models import build_pair

from compile_attn.batch import ForwardMode
from compile_attn.distributed import tp_size
from compile_attn.engine import LLM, SamplingParams
from compile_attn.engine.requests.errors import EngineOptionError
from compile_attn.engine.tensor_parallel.engine_group import TensorParallelError
from compile_attn.errors import UnsupportedConfigError

SHARED = [(7 * j + 3) % 96 for j in range(13)]
PROMPTS = [SHARED + [(5 * i + 3 * j + 1) % 96 for j in range(n)] for i, n in enumerate([2, 17, 5, 30, 9])]
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
OPTIONS = dict(device="cpu", max_batch_size=4, max_num_tokens=32, max_context=64, page_size=4,
               compile_options={"compiler": "eager"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for family in ("llama", "qwen3", "gemma2"):
        model, _ = build_pair(family)
        out[family] = tmp_path_factory.mktemp(family)
        model.save_pretrained(out[family])
    return out


def generate_twice(llm: LLM) -> list[list[int]]:
    """The prompts, then the same prompts again (their prefixes now cached)."""
    return [o.token_ids for _ in range(2) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm._tp.processes.values()]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    left = [c.cmdline() for c in psutil.Process().children(recursive=True) if c.pid in pids or not _helper(c)]
    assert not left, f"a child process outlived the LLM: {left}"


def _helper(process: psutil.Process) -> bool:
    """multiprocessing's resource tracker, which lives as long as the test process (not a worker)."""
    return any("resource_tracker" in part for part in process.cmdline())


def check_greedy_equals_one_rank(llm: LLM, want: list[list[int]], what: str) -> None:
    """``generate_twice`` on the 2-rank ``llm`` gives ``want`` (one process's tokens, computed while no group
    exists); a step mixed prefill with decode and the second call hit the prefix cache (counted over this call:
    the LLM may be shared)."""
    mixed, hits = llm.steps_by_mode[ForwardMode.MIXED], llm.kv_cache.prefix_cache.num_hit_tokens
    got = generate_twice(llm)
    assert llm.steps_by_mode[ForwardMode.MIXED] > mixed, f"{what}: no step mixed prefill with decode"
    hit = llm.kv_cache.prefix_cache.num_hit_tokens - hits
    assert hit >= len(PROMPTS) * 12, f"{what}: the second call reused no prefix ({hit} tokens hit)"
    assert got == want, what


@pytest.mark.parametrize(("family", "graph_mode", "compile", "overlap"), [
    ("llama", "piecewise", True, False),
    ("qwen3", "full_and_piecewise", False, True),
    ("gemma2", "none", False, True),
])  # and llama, "none", no compile, overlap: TestEagerLlamaOnTwoRanks.test_greedy_equals_one_rank
def test_greedy_equals_one_rank(checkpoints: dict[str, Path], family: str, graph_mode: str, compile: bool,
                                overlap: bool) -> None:
    options = dict(OPTIONS, graph_mode=graph_mode, compile=compile, overlap=overlap)
    want = generate_twice(LLM(str(checkpoints[family]), **options))
    with LLM(str(checkpoints[family]), tensor_parallel_size=2, **options) as llm:
        pids = worker_pids(llm)
        check_greedy_equals_one_rank(llm, want, f"{family} {graph_mode}")
    assert_gone(pids)
    assert tp_size() == 1


def test_config_model_on_four_ranks() -> None:
    """A config (random weights, rank 0 writes them once for every rank) on 4 ranks, one KV head per rank."""
    model, _ = build_pair("llama")
    torch.manual_seed(1)
    want = generate_twice(LLM(model.config, **OPTIONS, graph_mode="none", compile=False))
    torch.manual_seed(1)
    with LLM(model.config, tensor_parallel_size=4, **OPTIONS, graph_mode="none", compile=False) as llm:
        assert llm.model.attention_layers()[0].num_heads == 1
        got = generate_twice(llm)
        pids = worker_pids(llm)
    assert got == want
    assert_gone(pids)


EAGER = dict(OPTIONS, graph_mode="none", compile=False)  # overlap on: the default


class SharedLLM:
    """A 2-rank LLM that consecutive tests share (``get``); a new one starts if a test stopped the last one.
    ``want``: one process's ``generate_twice`` with the same options, computed before any worker starts."""

    def __init__(self, model: str, options: dict[str, Any]) -> None:
        self.model, self.options, self.llm = model, options, None
        self.want = generate_twice(LLM(model, **options))

    def get(self) -> LLM:
        if self.llm is None or self.llm._tp._closed:
            self.close()
            self.llm = LLM(self.model, tensor_parallel_size=2, **self.options)
        return self.llm

    def close(self) -> None:
        """Shut the LLM down: no worker process is left and this process leaves the group."""
        if self.llm is not None:
            pids = worker_pids(self.llm)
            self.llm.shutdown()
            self.llm = None
            assert_gone(pids)
            assert tp_size() == 1


@pytest.fixture(scope="class")
def eager_llama(checkpoints: dict[str, Path]) -> Iterator[SharedLLM]:
    shared = SharedLLM(str(checkpoints["llama"]), EAGER)
    yield shared
    shared.close()


class TestEagerLlamaOnTwoRanks:
    """llama on 2 ranks, eager, no graphs, overlap: one LLM for these checks, in this order (the last kills a
    worker); its shutdown at the end leaves no process."""

    def test_greedy_equals_one_rank(self, eager_llama: SharedLLM) -> None:
        check_greedy_equals_one_rank(eager_llama.get(), eager_llama.want, "llama none")

    def test_profile_writes_a_trace_per_rank(self, eager_llama: SharedLLM, tmp_path: Path) -> None:
        """``start_profile`` reaches the worker: after ``stop_profile`` each rank's trace holds the matrix
        products of its own shard (rank 1's forward ran while its profiler was on). Rank 1 writes its trace as it
        reads the stop, before the next step, so a step after ``stop_profile`` waits for the trace."""
        import json

        llm = eager_llama.get()
        llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
        llm.start_profile(str(tmp_path))
        llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
        paths = llm.stop_profile()
        llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)  # its collectives need rank 1, past writing its trace
        assert [Path(p).name for p in paths] == ["rank0-000.trace.json", "rank1-000.trace.json"]
        for path in paths:
            events = json.loads(Path(path).read_text())["traceEvents"]
            assert sum(e.get("name") in ("aten::mm", "aten::addmm", "aten::linear") for e in events) >= 2 * 2, path

    def test_killed_worker_gives_one_error_and_no_process_left(self, eager_llama: SharedLLM) -> None:
        llm = eager_llama.get()
        pids = worker_pids(llm)
        for p in PROMPTS:
            llm.add_request(p, PARAMS)
        llm.step()
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(TensorParallelError, match=r"rank 1: .*died \(killed by SIGKILL\)"):
            while llm.has_work():
                llm.step()
        assert_gone(pids)
        with pytest.raises(TensorParallelError, match="has stopped"):
            llm.generate(PROMPTS[:1], PARAMS)
        llm.shutdown()
        assert tp_size() == 1


def test_refusals_before_any_worker_starts(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(UnsupportedConfigError, match="num_attention_heads 4 cannot be split over tensor_parallel_size 3"):
        LLM(str(checkpoints["llama"]), tensor_parallel_size=3, **OPTIONS)
    with pytest.raises(EngineOptionError, match="speculative_config"):
        LLM(str(checkpoints["llama"]), tensor_parallel_size=2, **OPTIONS,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "topk": 2})
    with pytest.raises(EngineOptionError, match="positive int"):
        LLM(str(checkpoints["llama"]), tensor_parallel_size=0, **OPTIONS)
    assert not [c for c in psutil.Process().children(recursive=True) if not _helper(c)]


CHAIN_OPTIONS = dict(OPTIONS, graph_mode="none", compile=False, max_context=96)  # the reference: one process, eager
CHAIN_PROMPTS = [p * 2 for p in PROMPTS[:3]]  # repeats: prompt lookup finds its n-grams
CHAIN_PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def chain_reference(checkpoints: dict[str, Path]) -> list[list[int]]:
    """One process's greedy tokens without speculation, the reference of every speculative method."""
    llm = LLM(str(checkpoints["llama"]), **CHAIN_OPTIONS)
    return [o.token_ids for o in llm.generate(CHAIN_PROMPTS, CHAIN_PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_chains_equal_one_rank(checkpoints: dict[str, Path], chain_reference: list[list[int]],
                                           method: str) -> None:
    """Chain verify steps on 2 ranks (the workers run them as rank 0 sends them; the draft model runs on rank 0
    alone) give one process's greedy tokens without speculation, and verify steps did run."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:
        spec["model"] = str(checkpoints["llama"])  # the target drafting for itself: every draft accepted
    graphs = "full_and_piecewise" if method == "ngram" else "none"  # verify steps in the full decode graphs
    with LLM(str(checkpoints["llama"]), tensor_parallel_size=2, speculative_config=spec,
             **(CHAIN_OPTIONS | {"graph_mode": graphs})) as llm:
        pids = worker_pids(llm)
        got = [o.token_ids for o in llm.generate(CHAIN_PROMPTS, CHAIN_PARAMS, use_tqdm=False)]
        assert llm.steps_by_mode[ForwardMode.TARGET_VERIFY] > 0, f"{method}: no verify step ran"
    assert got == chain_reference, method
    assert_gone(pids)


def test_fp8_kv_cache_equals_one_rank(checkpoints: dict[str, Path]) -> None:
    """An fp8 KV cache on 2 ranks: each rank calibrates its own KV heads on the first prefill; greedy tokens equal
    one process's with the same cache dtype."""
    options = dict(OPTIONS, graph_mode="none", kv_cache_dtype="fp8_e4m3")
    want = generate_twice(LLM(str(checkpoints["qwen3"]), **options))
    with LLM(str(checkpoints["qwen3"]), tensor_parallel_size=2, **options) as llm:
        got = generate_twice(llm)
        assert llm.kv_cache.pool.quantized
    assert got == want
