"""The environment switches the library reads (every ``COMPILE_ATTN_*`` variable), each by one function here.

Every switch is read when its function is called (where a component is set up), never at import, so a test or a
script may set the variable just before. Nothing else in the package reads ``os.environ`` for these names; this
module imports nothing of compile_attn.
"""

from __future__ import annotations

import os

HOST_SHORTCUTS_ENV = "COMPILE_ATTN_HOST_SHORTCUTS"  # 0 / false / off / no: every host-time shortcut off
DEBUG_DIR_ENV = "COMPILE_ATTN_DEBUG_DIR"  # the default of GraphConfig.debug_dir
CACHE_DIR_ENV = "COMPILE_ATTN_CACHE_DIR"  # the default of GraphConfig.cache_dir (and the tiny model's home)
PDL_ENV = "COMPILE_ATTN_PDL"  # 0: the Triton decode kernel does not launch as a programmatic dependent launch
ONE_LAUNCH_ENV = "COMPILE_ATTN_DECODE_ONE_LAUNCH"  # 0: the triton backend's decode merges splits in a second launch
CASCADE_ENV = "COMPILE_ATTN_CASCADE_DECODE"  # 1 / true / on / yes: shared-prefix decode on where not set otherwise
SAMPLER_COMPILE_ENV = "COMPILE_ATTN_SAMPLER_COMPILE"  # 1 / 0: compile the portable sampler or not (default: CUDA)
START_PROFILE_ENV = "COMPILE_ATTN_START_PROFILE"  # a file prefix: `compile-attn bench --engine` profiles each start
VERIFY_MODE_ENV = "COMPILE_ATTN_VERIFY_MODE"  # 0 / false / off / no: triton chain verify steps as decode rows, not in the kernel's verify mode
MIXED_DECODE_ENV = "COMPILE_ATTN_MIXED_DECODE_ROWS"  # 0 / false / off / no: triton runs a mixed batch's decode rows in the extend kernel
GEMV_ENV = "COMPILE_ATTN_GEMV_KERNEL"  # 0 / false / off / no: one-token pieces run one-row linears as Inductor reductions
PROFILER_DIR_ENV = "COMPILE_ATTN_TORCH_PROFILER_DIR"  # where LLM.start_profile() writes traces by default
VLLM_PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"  # vLLM's name for it, read when PROFILER_DIR_ENV is not set
API_KEY_ENV = "COMPILE_ATTN_API_KEY"  # the server's key when --api-key is not given (a key on the command line shows)
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's name for it, read when API_KEY_ENV is not set


def switched_off(name: str) -> bool:
    """Whether environment variable ``name`` turns a default-on switch off: ``0``, ``false``, ``off`` or ``no``
    (any case); unset or anything else leaves it on."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", "no")


def host_shortcuts_enabled() -> bool:
    """The one switch of the host-time shortcuts (``attention/kernels/launch.py``, ``passes/fuse_linears.py``,
    ``compiler/shortcuts.py``, ``graph_runner/shortcuts.py``; table in docs/graph_runner.md): on unless
    ``$COMPILE_ATTN_HOST_SHORTCUTS`` is 0 / false / off / no. Off, every step takes the plain path (Dynamo's frame
    and guards, ``torch.ops`` calls, ``kernel[grid]`` launches); results are the same. Read where each shortcut is
    set up (a backend, a compile, a runner, a kernel launcher)."""
    return not switched_off(HOST_SHORTCUTS_ENV)


def debug_dir() -> str | None:
    """``$COMPILE_ATTN_DEBUG_DIR`` or None: the default of ``GraphConfig.debug_dir``."""
    return os.environ.get(DEBUG_DIR_ENV) or None


def cache_dir() -> str:
    """``$COMPILE_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/compile_attn``, else ``~/.cache/compile_attn``."""
    if os.environ.get(CACHE_DIR_ENV):
        return os.environ[CACHE_DIR_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "compile_attn")


def pdl_turned_off() -> bool:
    """``COMPILE_ATTN_PDL`` is 0 (or false, off, no)."""
    return switched_off(PDL_ENV)


def gemv_kernel() -> bool:
    """Whether one-token compiles run one-row linears through ``compile_attn.gemv`` (the default) rather than as
    Inductor's multiply-and-sum reductions (``COMPILE_ATTN_GEMV_KERNEL=0``)."""
    return not switched_off(GEMV_ENV)


def one_launch_decode() -> bool:
    """The default of the triton backend's ``one_launch_decode``: on unless ``COMPILE_ATTN_DECODE_ONE_LAUNCH`` is 0."""
    return not switched_off(ONE_LAUNCH_ENV)


def cascade_decode() -> bool:
    """The default of ``EngineConfig.cascade_decode`` (the one switch): on when ``COMPILE_ATTN_CASCADE_DECODE`` says so, else off."""
    return os.environ.get(CASCADE_ENV, "0").strip().lower() in ("1", "true", "on", "yes")


def verify_mode() -> bool:
    """Whether the triton backend runs uniform chain verify steps in its decode kernel's verify mode (and the graph
    runner captures verify graphs for them): on unless ``COMPILE_ATTN_VERIFY_MODE`` = 0 / false / off / no, which
    runs those steps as decode rows in the decode graphs (docs/speculative.md, "Verify graphs")."""
    return os.environ.get(VERIFY_MODE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def mixed_decode_rows() -> bool:
    """The default of the triton backend's ``mixed_decode_rows``: a mixed batch's leading decode rows run in the
    decode kernel (``attention/triton/mixed.py``); on unless ``COMPILE_ATTN_MIXED_DECODE_ROWS`` = 0 / false / off /
    no (A/B runs)."""
    return not switched_off(MIXED_DECODE_ENV)


def sampler_compile() -> bool | None:
    """``COMPILE_ATTN_SAMPLER_COMPILE``: True for 1, False for 0, None when unset; ValueError for anything else."""
    env = os.environ.get(SAMPLER_COMPILE_ENV, "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    if env:
        raise ValueError(f"{SAMPLER_COMPILE_ENV}={env!r} is not a switch; set it to 1 or 0, or unset it")
    return None


def start_profile_prefix() -> str | None:
    """``$COMPILE_ATTN_START_PROFILE``: the file prefix where ``compile-attn bench --engine`` writes each start's
    cProfile, or None."""
    return os.environ.get(START_PROFILE_ENV) or None


def profiler_dir() -> str | None:
    """``$COMPILE_ATTN_TORCH_PROFILER_DIR``, else ``$VLLM_TORCH_PROFILER_DIR``, else None: where
    ``LLM.start_profile()`` writes its traces when given no directory."""
    return os.environ.get(PROFILER_DIR_ENV) or os.environ.get(VLLM_PROFILER_DIR_ENV) or None


def api_key() -> str | None:
    """The server's API key where ``--api-key`` is not given: ``COMPILE_ATTN_API_KEY``, else vLLM's ``VLLM_API_KEY``
    (so a vLLM deployment's environment carries over), or None (no key) if neither is set and non-empty."""
    return os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV) or None
