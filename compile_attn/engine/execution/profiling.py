"""torch.profiler traces of engine steps on every rank: what ``LLM.start_profile()`` / ``LLM.stop_profile()`` run.

Each rank (rank 0 in the ``LLM``'s process, each tensor-parallel worker in its own) profiles host and device
activity between the start and the stop and writes one Chrome trace, ``rank{r}-{n:03d}.trace.json`` in the
directory given to the start (``n`` counts this engine's profiles, the same on every rank), readable in Perfetto or
``chrome://tracing`` and by ``benchmarks/gpu_trace_summary.py``. Rank 0 decides the directory and sends it to the
workers with the start (``distributed/step_message.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from compile_attn.env import PROFILER_DIR_ENV, profiler_dir

logger = logging.getLogger(__name__)


def resolve_profile_dir(directory: str | Path | None) -> Path:
    """``directory``, else ``$COMPILE_ATTN_TORCH_PROFILER_DIR`` (or vLLM's ``$VLLM_TORCH_PROFILER_DIR``); made if
    missing. Raises ValueError when none is given."""
    chosen = directory if directory is not None else profiler_dir()
    if not chosen:
        raise ValueError(f"LLM.start_profile() needs a directory for its traces: pass start_profile(directory) or set "
                         f"${PROFILER_DIR_ENV}")
    path = Path(chosen).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def trace_path(directory: Path, rank: int, count: int) -> Path:
    """Where rank ``rank`` writes the trace of this engine's ``count``-th profile (0 first)."""
    return directory / f"rank{rank}-{count:03d}.trace.json"


class StepProfiler:
    """One rank's profiler: ``start(directory)``, then ``stop()`` writes the trace and returns its path."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.count = 0  # profiles written so far
        self._profile: torch.profiler.profile | None = None
        self._directory: Path | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, directory: Path) -> None:
        if self._profile is not None:
            raise RuntimeError("the profiler is already running: call LLM.stop_profile() before starting it again")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()
        self._directory = directory

    def stop(self) -> Path:
        if self._profile is None or self._directory is None:
            raise RuntimeError("the profiler is not running: call LLM.start_profile() first")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the launched steps' kernels end inside the trace
        profile, self._profile = self._profile, None
        profile.stop()
        path = trace_path(self._directory, self.rank, self.count)
        profile.export_chrome_trace(str(path))
        self.count += 1
        logger.info("rank %d: profile written to %s", self.rank, path)
        return path


class EngineProfiler:
    """Rank 0's side of ``LLM.start_profile`` / ``stop_profile``: its own profiler, and the workers' through the
    tensor-parallel group (``group.profile(directory)``; None with one process)."""

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.local = StepProfiler(0, device)
        self.group = group
        self.world_size = 1 if group is None else group.size

    def start(self, directory: str | Path | None) -> None:
        path = resolve_profile_dir(directory)
        self.local.start(path)  # refuses a second start before the workers hear of it
        if self.group is not None:
            self.group.profile(str(path))

    def stop(self) -> list[str]:
        """The traces' paths, rank 0's first (the workers write theirs as they stop)."""
        count = self.local.count
        first = self.local.stop()  # refuses a stop without a start before the workers hear of it
        if self.group is not None:
            self.group.profile(None)
        return [str(first)] + [str(trace_path(first.parent, r, count)) for r in range(1, self.world_size)]
