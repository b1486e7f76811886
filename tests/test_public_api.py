"""The public API: what the README and docs import from ``compile_attn`` (or call as ``compile_attn.name``) exists
there, every exported name resolves, and the KV cache's internals are not exported."""

from __future__ import annotations

import re
from pathlib import Path

import compile_attn

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]


def _names_the_docs_use() -> dict[str, set[str]]:
    """name -> the files whose text imports it from ``compile_attn`` or calls ``compile_attn.<name>``."""
    found: dict[str, set[str]] = {}
    for path in DOCS:
        text = path.read_text()
        blocks = re.findall(r"from compile_attn import (?:\(([\w,\s]+)\)|([\w, ]+))", text)
        imported = [n for block in blocks for n in re.findall(r"\w+", "".join(block))]
        called = re.findall(r"\bcompile_attn\.([A-Za-z_]\w*)\(", text)
        for name in imported + called:
            found.setdefault(name, set()).add(path.name)
    return found


def test_what_the_docs_use_is_exported() -> None:
    used = _names_the_docs_use()
    assert {"LLM", "SamplingParams", "KVCache", "create_backend", "GraphRunner", "load_model"} <= set(used)
    missing = {n: sorted(files) for n, files in used.items() if not hasattr(compile_attn, n)}
    assert not missing, f"the docs use names compile_attn does not export: {missing}"


def test_every_exported_name_resolves_and_internals_are_not_exported() -> None:
    for name in compile_attn.__all__:
        assert getattr(compile_attn, name) is not None, name
    for doc_name in ("GraphRunner", "compile_model", "HFModelAdapter", "load_model", "LLM", "SamplingParams",
                     "EngineConfig"):
        assert doc_name in compile_attn.__all__
    for internal in ("PAD_SLOT", "PAD_REQUEST", "PagedKVPool", "PageAllocator", "ReqToTokenPool", "ForwardContext"):
        assert internal not in compile_attn.__all__ and not hasattr(compile_attn, internal), internal
