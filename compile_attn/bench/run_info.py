"""What a benchmark result needs to be reproduced: the command, the package versions, the device and (in a git
checkout) the commit, recorded next to the numbers in ``compile-attn bench --out``'s JSON."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess

import torch


def package_version(pkg: str) -> str:
    """The installed version of distribution ``pkg``, or "not installed"."""
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def package_versions() -> dict[str, str | None]:
    """compile_attn, Python, torch (and its CUDA) and the kernel libraries compile_attn can use, by name."""
    return {
        "compile_attn": package_version("compile-attn"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": package_version("triton"),
        "transformers": package_version("transformers"),
        "flashinfer": package_version("flashinfer-python"),
        "sglang-kernel": package_version("sglang-kernel") or package_version("sgl-kernel"),
    }


def git_commit(path: str | None = None) -> str | None:
    """HEAD of the git checkout holding ``path`` (default: this package), "+dirty" when tracked files changed;
    None outside a checkout (a pip install, or a tree copied without ``.git``)."""
    where = path or os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def run_info(argv: list[str]) -> dict[str, object]:
    """The command ``compile-attn`` ran with ``argv``, when, where and with what."""
    cuda = torch.cuda.is_available()
    return {
        "command": shlex.join(["compile-attn", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "versions": package_versions(),
    }
