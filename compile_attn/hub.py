"""Where a model's (or a tokenizer's) files are: a local directory, or a Hugging Face model id (``org/name``)
resolved through ``huggingface_hub`` as vLLM does: a copy in the local Hugging Face cache is used as it is (no network,
so it works offline), else the files are downloaded into that cache (unless ``HF_HUB_OFFLINE=1``).

``LLM(...)``, ``load_model`` and every command (``generate --model``, ``serve MODEL``, ``throughput --model``, ...)
resolve through ``resolve_model`` / ``resolve_tokenizer``, so one mistake gets one message everywhere
(``ModelNotFoundError``: what was tried, and the way out). Imports huggingface_hub only for a model id.
"""

from __future__ import annotations

import os
from pathlib import Path

from compile_attn.errors import ModelNotFoundError

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# what a download fetches: config and generation config, safetensors weights and their index, tokenizer files and
# chat templates (no .bin / .pt duplicates of the weights, no Python code: trust_remote_code is refused)
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


def resolve_model(name: str | os.PathLike[str], *, revision: str | None = None) -> str:
    """The local directory holding checkpoint ``name`` (with its config.json): ``name`` itself when it is a local
    directory, else the snapshot of Hugging Face model id ``name`` at ``revision`` (None: the default branch) in the
    local cache, downloaded there first when it is missing and downloads are allowed. ModelNotFoundError otherwise."""
    return _resolve(name, revision, "model", (CONFIG_FILE,))


def resolve_tokenizer(name: str | os.PathLike[str], *, revision: str | None = None) -> str:
    """The local directory holding the tokenizer ``name`` (a local directory or a Hugging Face model id, like
    ``resolve_model``) with its tokenizer files."""
    return _resolve(name, revision, "tokenizer", TOKENIZER_FILES)


def _resolve(name: str | os.PathLike[str], revision: str | None, what: str, needs: tuple[str, ...]) -> str:
    text = os.fspath(name)
    path = Path(text).expanduser()
    needs_text = " or ".join(needs)
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(f"{what} {text!r} is a file, not a checkpoint directory; pass the directory that "
                                     f"holds its {needs_text}")
        if not any((path / f).is_file() for f in needs):
            raise ModelNotFoundError(f"{what} {text!r} is a local directory without a {needs_text}, so not an HF "
                                     f"{what} directory; pass the directory that holds it (config.json, safetensors "
                                     f"weights, tokenizer files)")
        return str(path)
    tried = f"not a local directory ({path.resolve()} does not exist)"
    if not _is_repo_id(text):
        raise ModelNotFoundError(f"{what} {text!r} is {tried}, nor a Hugging Face model id (org/name); pass a local "
                                 f"checkpoint directory (config.json, safetensors weights, tokenizer files), or a "
                                 f"model id such as meta-llama/Llama-3.2-1B")
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise ModelNotFoundError(f"{what} {text!r} is {tried}; as a Hugging Face model id it needs huggingface_hub: "
                                 f"pip install 'compile-attn[hf]'") from None
    snapshot, why = _snapshot(text, revision)
    at = f" at revision {revision!r}" if revision else ""
    if snapshot is None:
        raise ModelNotFoundError(
            f"{what} {text!r} is {tried}, and the Hugging Face model {text}{at} is not in the local cache "
            f"({_cache_dir()}) {why}; download it first (`hf download {text}"
            f"{f' --revision {revision}' if revision else ''}`, with network access), or pass a local directory")
    if not any((Path(snapshot) / f).is_file() for f in needs):
        raise ModelNotFoundError(f"the Hugging Face model {text}{at} in the local cache ({snapshot}) has no "
                                 f"{needs_text}; download it again (`hf download {text}`), or pass a local directory")
    return snapshot


def _is_repo_id(text: str) -> bool:
    """``org/name`` (or ``name``) as Hugging Face spells model ids; a path-like text (``./x``, ``/x``, ``~/x``,
    ``a/b/c``) is not one."""
    if text.startswith((".", "/", "~")) or os.sep != "/" and os.sep in text:
        return False
    try:
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        return text.count("/") <= 1
    try:
        validate_repo_id(text)
    except ValueError:  # HFValidationError
        return False
    return True


def _snapshot(repo_id: str, revision: str | None) -> tuple[str | None, str]:
    """(the snapshot directory, "") or (None, why it is missing): the cache first (no network), then a download
    unless HF_HUB_OFFLINE is set."""
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=True), ""
    except (OSError, ValueError):  # LocalEntryNotFoundError (a FileNotFoundError), a bad revision
        pass
    if constants.HF_HUB_OFFLINE:
        return None, "and HF_HUB_OFFLINE is set, so it is not downloaded"
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=DOWNLOAD_PATTERNS), ""
    except Exception as exc:  # noqa: BLE001 - no network, unknown or gated repo, bad revision: said in one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, f"and downloading it failed ({type(exc).__name__}{': ' + reason[:200] if reason else ''})"


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
