"""A/B of ``compile-attn bench`` between two builds (or two environments), in alternating processes of one run.

The host part of a decode step moves between processes of one build by more than most changes, so a change is
only compared against a baseline measured in the same run, process after process: A, B, A, B, ...
A is the compile_attn tree at ``--base`` (a git revision, exported with ``git archive``) or ``--base-dir`` (an
exported tree, for a copy of the checkout without ``.git``), put first on ``PYTHONPATH``; B is this checkout. ``--env-b``
instead runs this checkout twice, B with extra environment variables (e.g. ``TORCHINDUCTOR_ENABLE_PDL=1``).
Every argument after ``--`` goes to ``compile-attn bench``. Prints one markdown row per process and system:
ms per step, graph replay in brackets; with ``--engine`` / ``--engine-only``, then one row per process and
engine start (cold, warm): seconds to ready, prefill ms and % of peak.

    python benchmarks/ab_bench.py --base 07f0f82 --runs 2 -- --backend triton --modes piecewise,full \\
        --batch-sizes 1,64 --hf "" --no-profile
    python benchmarks/ab_bench.py --env-b TORCHINDUCTOR_ENABLE_PDL=1 -- --backend triton --modes full
    python benchmarks/ab_bench.py --base 1168392 --runs 3 -- --engine-only --backend triton   # start time, prefill
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def export_tree(rev: str, into: Path) -> Path:
    """The ``compile_attn`` package at git revision ``rev``, extracted under ``into``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "compile_attn"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def prepend_path(env: dict[str, str], path: Path) -> None:
    """Put ``path`` first on ``env``'s ``PYTHONPATH``."""
    env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def package_path(env: dict[str, str], cwd: Path) -> str:
    """Where ``compile_attn`` is imported from under ``env`` (``python -m`` puts the working directory first on
    ``sys.path``, so the processes run in a directory without a compile_attn package)."""
    code = "import compile_attn, os; print(os.path.dirname(compile_attn.__file__))"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def run_bench(label: str, bench_args: list[str], env: dict[str, str], out: Path) -> dict:
    """One ``compile-attn bench`` process (in ``out``'s directory): the JSON it writes (``decode`` rows, and
    ``engine`` starts with ``--engine`` / ``--engine-only``)."""
    cmd = [sys.executable, "-m", "compile_attn.cli", "bench", *bench_args, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=out.parent, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{label}: compile-attn bench failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--base", help="git revision of build A")
    which.add_argument("--base-dir", help="a directory holding build A's compile_attn package")
    which.add_argument("--env-b", action="append", metavar="NAME=VALUE",
                       help="A and B are this checkout; B runs with these environment variables")
    parser.add_argument("--runs", type=int, default=2, help="A/B pairs (default 2)")
    args = parser.parse_args(own)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")

    with tempfile.TemporaryDirectory(prefix="ab_bench_") as tmp:
        tmp_path = Path(tmp) / "run"  # the processes' working directory: no compile_attn package in it
        tmp_path.mkdir()
        env_a, env_b = dict(os.environ), dict(os.environ)
        if args.env_b:
            for item in args.env_b:
                name, sep, value = item.partition("=")
                if not sep or not name:
                    parser.error(f"--env-b takes NAME=VALUE, got {item!r}")
                env_b[name] = value
            names = ("this checkout", "this checkout with " + " ".join(args.env_b))
        else:
            base = Path(args.base_dir) if args.base_dir else export_tree(args.base, Path(tmp))
            if not (base / "compile_attn" / "__init__.py").is_file():
                parser.error(f"no compile_attn package under {base}")
            prepend_path(env_a, base.resolve())
            names = (f"base {args.base or args.base_dir}", "this checkout")
        for env in (env_a, env_b) if args.env_b else (env_b,):
            prepend_path(env, REPO)
        paths = [package_path(env, tmp_path) for env in (env_a, env_b)]
        if not args.env_b and paths[0] == paths[1]:
            raise SystemExit(f"A and B both import compile_attn from {paths[0]}")
        if args.env_b and paths[0] != paths[1]:
            raise SystemExit(f"A imports compile_attn from {paths[0]}, B from {paths[1]}: expected this checkout")
        print(f"A = {names[0]} ({paths[0]}); B = {names[1]} ({paths[1]}); "
              f"compile-attn bench {shlex.join(bench_args)}\n")
        print("| process | system | bs | ms / step (graph replay) |\n|---|---|---|---|")
        starts = []  # engine rows, printed after the decode table
        for i in range(1, args.runs + 1):
            for label, env in (("A", env_a), ("B", env_b)):
                report = run_bench(f"{label}{i}", bench_args, env, tmp_path / f"{label}{i}.json")
                for row in report["decode"]["rows"]:
                    replay = f" ({row['replay_ms']:.3f})" if row.get("replay_ms") else ""
                    print(f"| {label}{i} | {row['system']} | {row['batch_size']} | {row['ms']:.3f}{replay} |",
                          flush=True)
                for start, r in (report.get("engine") or {}).items():
                    starts.append(f"| {label}{i} | {start} | {r['ready_s']:.1f} | {r['prefill_ms']:.1f} | "
                                  f"{r['prefill_pct_peak']:.0f}% |")
        if starts:
            print("\n| process | engine start | ready s | prefill ms | % of peak |\n|---|---|---|---|---|")
            print("\n".join(starts))


if __name__ == "__main__":
    main()
