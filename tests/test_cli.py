"""The ``compile-attn`` command: ``info``, ``generate`` against an independent greedy recompute, and bad options
refused with a usage error before any model is built."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from compile_attn import cli
from tests.greedy_reference import greedy_by_recompute

FAST = ["--no-compile", "--graph-mode", "none", "--device", "cpu"]


def test_info_lists_versions_and_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out.splitlines())
    assert rows["torch"].startswith("2.")
    assert "torch_native" in rows["backends"]
    assert rows["auto backend"] in rows["backends"]


def generated(out: str) -> list[tuple[str, int, str, bytes]]:
    """(prompt, token count, finish reason, text bytes) per prompt from ``generate``'s output."""
    found = re.findall(r"--- '(.*?)' -> \((\d+) tokens, (\w+)\)\n(.*?)\n(?=--- )", out, flags=re.S)
    return [(p, int(n), reason, text.encode("latin-1")) for p, n, reason, text in found]


def test_generate_matches_greedy_recompute_for_every_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["ab", "compile_attn"]
    argv = ["generate", *FAST, "--max-new-tokens", "5", "--ignore-eos"]
    for p in prompts:
        argv += ["--prompt", p]
    assert cli.main(argv) == 0
    rows = generated(capsys.readouterr().out)
    assert [r[0] for r in rows] == prompts
    model = cli._tiny_model().eval()
    for prompt, count, reason, text in rows:
        assert (count, reason) == (5, "length")
        expected = greedy_by_recompute(model, list(prompt.encode()), 5)
        assert list(text) == [t % 256 for t in expected]


def test_generate_with_a_seed_samples_the_same_tokens_twice(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", *FAST, "--max-new-tokens", "6", "--ignore-eos", "--temperature", "1.5", "--seed", "3"]
    outs = []
    for _ in range(2):
        assert cli.main(argv) == 0
        outs.append(generated(capsys.readouterr().out))
    assert outs[0] == outs[1] and outs[0][0][1] == 6


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_generate_with_an_fp8_kv_cache(kv_cache_dtype: str, capsys: pytest.CaptureFixture[str],
                                       caplog: pytest.LogCaptureFixture) -> None:
    argv = ["generate", *FAST, "--max-new-tokens", "5", "--ignore-eos", "--kv-cache-dtype", kv_cache_dtype,
            "--prompt", "compile_attn"]
    with caplog.at_level("INFO", logger="compile_attn"):
        assert cli.main(argv) == 0
    (row,) = generated(capsys.readouterr().out)
    assert row[1:3] == (5, "length")
    want = "float8_e4m3fn" if kv_cache_dtype == "fp8" else "float8_e5m2"
    assert f"({want})" in caplog.text or f", {want})" in caplog.text  # the "LLM ready" line names the KV dtype
    assert "calibrated on the first prefill" in caplog.text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--backend", "nope"], "unknown attention backend 'nope'"),
        (["generate", "--backend", "triton+nope"], "unknown attention backend 'nope' in 'triton+nope'"),
        (["generate", "--graph-mode", "fast"], "unknown graph mode 'fast'"),
        (["generate", "--temperature", "-1"], "temperature must be >= 0"),
        (["generate", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["generate", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
        (["generate", "--page-size", "0"], "--page-size must be >= 1"),
        (["bench", "--batch-sizes", "1,x"], "--batch-sizes takes comma-separated integers, got '1,x'"),
        (["bench", "--batch-sizes", "0"], "--batch-sizes values must be >= 1"),
        (["bench", "--modes", "full,fast"], "unknown graph mode 'fast'"),
        (["bench", "--hf", "eager,vllm"], "unknown HF baseline(s) ['vllm']"),
        (["bench", "--inductor-config", "{bad"], "--inductor-config must be a JSON object"),
        (["bench", "--static-inductor-config", "[1]"], "--static-inductor-config must be a JSON object"),
        (["bench", "--compile-sizes", "one"], "compile sizes must be 'auto', 'none'"),
        (["generate", "--device", "tpu"], "--device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        (["generate", "--prompt", ""], "--prompt must not be empty"),
        (["generate", "--seed", "-1"], "--seed must be in [0, 2**63)"),
        (["generate", "--max-context", "8"], "--max-new-tokens 32 leaves no room for a prompt in --max-context 8"),
        (["generate", "--kv-cache-dtype", "int8"],
         "--kv-cache-dtype must be auto, fp8_e4m3 (or fp8) or fp8_e5m2, got 'int8'"),
        (["generate", "--kv-scales-path", "s.json"], "--kv-scales-path scales an fp8 KV cache: pass --kv-cache-dtype"),
        (["bench", "--inductor-config", '{"no_such_knob": 1}'], "unknown Inductor option(s) ['no_such_knob']"),
        (["bench", "--static-inductor-config", '{"triton.no_such_knob": true}'],
         "unknown Inductor option(s) ['triton.no_such_knob']"),
    ],
)
def test_bad_options_are_a_usage_error_before_anything_is_built(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_run(args: object) -> int:
        raise AssertionError("the command ran despite a bad option")

    monkeypatch.setattr(cli, "cmd_generate", must_not_run)
    monkeypatch.setattr(cli, "cmd_bench", must_not_run)
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()  # one line, naming the value
    assert len(err) == 1 and err[0].startswith(f"compile-attn {argv[0]}: error:") and message in err[0]


def test_a_missing_model_directory_is_one_line_and_exit_status_1(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-model")
    run = subprocess.run([sys.executable, "-m", "compile_attn.cli", "generate", "--model", missing, *FAST],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()  # no traceback: one line naming the path and what a model dir holds
    assert len(lines) == 1 and lines[0].startswith("compile-attn generate: error: ModelNotFoundError:")  # a
    assert missing in lines[0] and "config.json" in lines[0]  # FileNotFoundError, with every command's message


def test_a_request_too_large_for_the_cache_is_one_line_and_exit_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", *FAST, "--max-context", "8", "--max-new-tokens", "2", "--prompt", "longer than eight bytes"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("compile-attn generate: error: RequestTooLargeError: request 0 needs")
    assert "raise kv_cache_tokens / max_context" in err[0]


def test_errors_raised_on_purpose_share_the_base_class_the_cli_catches() -> None:
    from compile_attn.engine import RequestTooLargeError
    from compile_attn.errors import CompileAttnError
    from compile_attn.graph_runner.segments import GraphCaptureError

    assert issubclass(RequestTooLargeError, CompileAttnError) and issubclass(RequestTooLargeError, ValueError)
    assert issubclass(GraphCaptureError, CompileAttnError) and issubclass(GraphCaptureError, RuntimeError)


def test_bench_of_the_full_size_model_without_a_gpu_warns_and_names_tiny(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli, "cmd_bench", lambda args: 0)
    with caplog.at_level("WARNING", logger="compile_attn.cli"):
        assert cli.main(["bench", "--hf", ""]) == 0
        assert cli.main(["bench", "--tiny", "--hf", ""]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "compile_attn.cli"]
    assert len(warnings) == 1 and "no CUDA GPU" in warnings[0] and "--tiny" in warnings[0]


def test_python_dash_m_compile_attn_runs_the_command() -> None:
    run = subprocess.run([sys.executable, "-m", "compile_attn", "--help"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("usage: compile-attn")
    assert all(cmd in run.stdout for cmd in ("info", "generate", "bench"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_device_cuda_without_a_gpu_is_one_line_and_no_model_loads() -> None:
    run = subprocess.run([sys.executable, "-m", "compile_attn", "generate", "--device", "cuda"],
                         capture_output=True, text=True, timeout=300)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("compile-attn generate: error: --device cuda:") and "--device cpu" in lines[0]
    assert run.stdout == ""  # nothing generated


def test_a_bad_inductor_option_is_refused_before_the_benchmark_builds_anything(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from compile_attn.bench import decode_step as bench

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark started despite a bad option")

    monkeypatch.setattr(bench, "run", must_not_run)
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--tiny", "--hf", "", "--inductor-config", '{"no_such_knob": 1, "combo_kernels": true}'])
    elapsed = time.perf_counter() - start
    assert exc.value.code == 2 and "['no_such_knob']" in capsys.readouterr().err
    assert elapsed < 60, f"refusing the option took {elapsed:.1f} s"  # importing Inductor's config, no model


def test_known_inductor_options_pass_the_check() -> None:
    assert cli._inductor_patches("--inductor-config", '{"combo_kernels": true, "triton.enable_pdl": true}') == {
        "combo_kernels": True, "triton.enable_pdl": True}


def test_random_weights_say_so_once(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="compile_attn.cli"):
        assert cli.main(["generate", *FAST, "--max-new-tokens", "2"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "compile_attn.cli"]
    assert len(warnings) == 1 and warnings[0].startswith("random weights: the text is meaningless;")
    assert cli.TRAINED_MODEL in warnings[0]


def test_cli_runs_without_the_server_stack() -> None:
    """`compile-attn throughput` and the other commands must run where FastAPI / uvicorn are not installed."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None\n"
            "from compile_attn.cli import build_parser\n"
            "args = build_parser().parse_args(['throughput', 'fixed', '--tiny'])\n"
            "print(args.command if hasattr(args, 'command') else 'parsed')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
