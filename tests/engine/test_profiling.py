"""``LLM.start_profile`` / ``LLM.stop_profile`` in one process: a Chrome trace of the profiled steps' operators, the
directory from the argument or the environment (vLLM's variable too), and clear errors out of order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compile_attn.engine import LLM, SamplingParams
from tests.hf.hf_tiny_models import build_pair

PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    model, _ = build_pair("llama")
    return LLM(model, device="cpu", max_batch_size=2, max_num_tokens=32, max_context=64, graph_mode="none",
               compile=False)


def test_trace_holds_the_profiled_steps(llm: LLM, tmp_path: Path) -> None:
    llm.start_profile(str(tmp_path / "traces"))
    llm.generate([[1, 2, 3, 4, 5]], PARAMS, use_tqdm=False)
    (path,) = llm.stop_profile()
    assert Path(path) == tmp_path / "traces" / "rank0-000.trace.json"
    names = [e.get("name") for e in json.loads(Path(path).read_text())["traceEvents"]]
    assert sum(n in ("aten::mm", "aten::addmm", "aten::linear") for n in names) >= 4  # layers x steps
    llm.start_profile(str(tmp_path / "traces"))  # a second profile: the next file
    assert Path(llm.stop_profile()[0]).name == "rank0-001.trace.json"


def test_directory_from_the_environment(llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COMPILE_ATTN_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "vllm"))
    llm.start_profile()
    assert Path(llm.stop_profile()[0]).parent == tmp_path / "vllm"
    monkeypatch.setenv("COMPILE_ATTN_TORCH_PROFILER_DIR", str(tmp_path / "ours"))
    llm.start_profile()
    assert Path(llm.stop_profile()[0]).parent == tmp_path / "ours"


def test_errors_name_the_way_out(llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COMPILE_ATTN_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(ValueError, match="COMPILE_ATTN_TORCH_PROFILER_DIR"):
        llm.start_profile()
    with pytest.raises(RuntimeError, match=r"start_profile\(\) first"):
        llm.stop_profile()
    llm.start_profile(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"stop_profile\(\) before"):
        llm.start_profile(str(tmp_path))
    llm.stop_profile()
