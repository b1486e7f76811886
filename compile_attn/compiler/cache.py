"""Persistent compile cache: Inductor artifacts of compiled pieces, saved and loaded with PyTorch's own API.

Each unique piece is saved with ``CompiledArtifact.save`` (from ``torch._inductor.standalone_compile``)
under ``<cache_dir>/pieces-v1/<key>.bin``; the key hashes the piece's structural key (what the model
code traced to), torch and compile_attn versions, the Inductor config, grad mode and GPU model. The
cache dir is ``GraphConfig.cache_dir`` (default ``$COMPILE_ATTN_CACHE_DIR`` or ``~/.cache/compile_attn``);
clear it by deleting the directory or with ``clear_cache()``. Broken entries are ignored and replaced.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from compile_attn.compiler.piece_key import PieceKey

logger = logging.getLogger(__name__)

CACHE_SUBDIR = "pieces-v1"


def environment_fingerprint(devices: Iterable[torch.device], compiler_options: dict[str, Any]) -> str:
    """What besides the piece itself decides the compiled code: versions, configs, grad mode, GPU model."""
    import torch._inductor.config as inductor_config

    from compile_attn.version import __version__

    parts = [
        f"torch={torch.__version__}",
        f"compile_attn={__version__}",
        f"python={sys.version_info[:2]}",
        f"grad={torch.is_grad_enabled()}",
        f"inductor={sorted(inductor_config.save_config_portable().items())!r}",
        f"options={sorted(compiler_options.items())!r}",
    ]
    for device in sorted({str(d) for d in devices if torch.device(d).type == "cuda"}):
        props = torch.cuda.get_device_properties(torch.device(device))
        parts.append(f"{device}={props.name}/sm{props.major}{props.minor}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class CompileCache:
    """Artifacts of compiled pieces in one directory; ``None`` from ``entry_key`` means: do not cache."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(cache_dir).expanduser() / CACHE_SUBDIR

    def entry_key(self, piece: PieceKey, fingerprint: str) -> str | None:
        if not piece.stable:
            return None
        return hashlib.sha256(f"{piece.digest}\n{fingerprint}".encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.bin"

    def load(self, key: str) -> Callable[..., Any] | None:
        """The saved artifact for ``key``, or None (missing, or unreadable: then it is removed)."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            from torch._inductor import CompiledArtifact

            return CompiledArtifact.load(path=str(path), format="binary")
        except Exception as exc:  # noqa: BLE001 - any failure means: recompile
            logger.warning("compile_attn: ignoring unreadable cache entry %s (%s); rebuilding it", path, exc)
            path.unlink(missing_ok=True)
            return None

    def save(self, key: str, artifact: Any) -> bool:
        """Write ``artifact`` (a CompiledArtifact); False when it cannot be saved.

        An artifact PyTorch cannot serialise (its graph made AOTAutograd's cache skip it: ``is_saveable()`` is
        False) is not saved; it is compiled again at the next start, where Inductor's own FX graph cache serves
        its code. That is logged once per process at debug level; other failures (a full disk, permissions)
        are warnings."""
        is_saveable = getattr(artifact, "is_saveable", None)
        if is_saveable is not None and not is_saveable():
            _log_unsaveable_once(self.path(key))
            return False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            artifact.save(path=str(self.path(key)), format="binary")
            return True
        except Exception as exc:  # noqa: BLE001 - caching is best effort
            logger.warning("compile_attn: could not save compiled piece to %s (%s)", self.path(key), exc)
            return False


_unsaveable_logged = False


def _log_unsaveable_once(path: Path) -> None:
    global _unsaveable_logged
    if _unsaveable_logged:
        return
    _unsaveable_logged = True
    logger.debug("compile_attn: a compiled piece PyTorch cannot serialise (first: %s) is not saved; it is compiled "
                 "at each start from Inductor's own caches (logged once)", path)


def clear_cache(cache_dir: str | os.PathLike[str] | None = None) -> int:
    """Delete the pieces saved under ``cache_dir`` (default: GraphConfig's); returns how many."""
    if cache_dir is None:
        from compile_attn import env

        cache_dir = env.cache_dir()
    target = Path(cache_dir).expanduser() / CACHE_SUBDIR
    if not target.is_dir():
        return 0
    count = sum(1 for p in target.rglob("*") if p.is_file())
    shutil.rmtree(target)
    logger.info("compile_attn: removed %d cached piece(s) from %s", count, target)
    return count
