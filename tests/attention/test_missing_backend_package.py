"""A backend whose kernel package is missing (triton, flashinfer, sgl_kernel for fa3) is one error for every backend:
a one-line BackendUnavailableError naming the extra to install, from ``LLM`` / ``EngineConfig``, ``create_backend``
and the command line alike, raised before the model loads (registry.check_backend_installed). The package's absence
is simulated: in this process by the registry's view of what is installed, in a subprocess by hiding the package
from the import system (so the backend's own module would fail to import)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compile_attn import AttentionLayer, KVCache, create_backend
from compile_attn.attention import check_backend_installed, registry
from compile_attn.engine import LLM, EngineConfig
from compile_attn.errors import BackendUnavailableError
from tests.hidden_packages import run_python

EXTRA = {"triton": "triton", "flashinfer": "flashinfer", "fa3": "fa3"}
PACKAGE = {"triton": "triton", "flashinfer": "flashinfer", "fa3": "sgl_kernel"}


class NotLoaded(torch.nn.Module):
    def attention_layers(self) -> list:
        raise AssertionError("the model was loaded")


@pytest.fixture
def nothing_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = registry.module_available
    monkeypatch.setattr(registry, "module_available",
                        lambda module: module not in PACKAGE.values() and real(module))


def _kv() -> KVCache:
    return KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=2, max_context=32, kv_cache_tokens=64,
                   page_size=1, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "fa3", "fa3+flashinfer", "auto+triton"])
def test_every_entry_point_raises_the_same_one_line_error(nothing_installed: None, backend: str) -> None:
    name = next(part for part in backend.split("+") if part in PACKAGE)
    expected = (f"the {name} attention backend needs the {PACKAGE[name]} package, which is not installed: "
                f'pip install "compile-attn[{EXTRA[name]}]"')
    messages = []
    for attempt in (lambda: check_backend_installed(backend), lambda: EngineConfig(attn_backend=backend),
                    lambda: LLM(NotLoaded(), attn_backend=backend),  # before the model loads
                    lambda: create_backend(backend, _kv(), [AttentionLayer(0, 4, 2, 64)])):
        with pytest.raises(BackendUnavailableError) as exc:
            attempt()
        messages.append(str(exc.value))
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith(expected) and "\n" not in messages[0], messages[0]
    assert messages[0].endswith("or pick another backend: auto, torch_native")


def test_installed_backends_and_auto_pass(nothing_installed: None) -> None:
    for name in ("auto", "torch_native", "auto+torch_native"):
        check_backend_installed(name)
        EngineConfig(attn_backend=name, device="cpu")


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "fa3"])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_command_line_says_it_in_one_line_before_loading(command: str, backend: str, tmp_path: Path) -> None:
    """With the package hidden from the import system: exit 1 and one line naming the extra (no traceback), before
    any model loads (generate's built-in model warns when it is built; serve's model does not even exist)."""
    argv = (["generate", "--device", "cpu"] if command == "generate" else ["serve", str(tmp_path / "no-model"),
                                                                           "--device", "cpu"])
    code = f"import sys\nfrom compile_attn.cli import main\nsys.exit(main({[*argv, '--backend', backend]!r}))\n"
    out = run_python(code, hidden=("triton", "flashinfer", "sgl_kernel"))
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"compile-attn {command}: error: BackendUnavailableError: the {backend} attention "
                               f"backend needs the {PACKAGE[backend]} package, which is not installed: pip install "
                               f'"compile-attn[{EXTRA[backend]}]"'), lines
    assert lines[0].endswith("or pick another backend: auto, torch_native"), lines
