"""The package's import graph has no cycles: not between modules, and not between its layers (the top-level
modules and subpackages of ``compile_attn``), and no layer imports one above it.

Every ``import`` / ``from ... import`` statement of every module is read with ``ast``, at module level and inside
functions alike (a function-level import that closes a cycle is still a cycle, only a deferred one). Imports
under ``if TYPE_CHECKING:`` never run and are left out. Nothing is imported to build the graph.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = "compile_attn"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
# The layers the library reads in, lowest first; a module may import from its own layer and the ones below.
# Top-level modules (config, context, batch, errors, ...) are the lowest layer, "base"; the KV cache sits on it.
# The applications on top of the library come last: the HTTP server, then the benchmarks (which may start a server).
LAYER_ORDER = ("base", "kv", "ops", "passes", "attention", "compiler", "graph_runner", "hf", "distributed", "engine",
               "server", "bench")
APPLICATIONS = ("server", "bench")  # the root modules only they import (cli_options) are not "base"
BASE_PACKAGES = ("batch",)  # folders of the base layer (a step's batch and its vocabulary)
BACKENDS = ("torch_native", "triton", "flashinfer", "fa3")  # attention/<name>/: one folder per backend
MAX_ROOT_MODULES = 14  # the package root keeps the base and the CLI; every other concept is a folder


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST, typing: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that can run (module level and in functions), without ``if TYPE_CHECKING:`` bodies
    (with them where ``typing``)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if not typing and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_edges(typing: bool = False) -> dict[str, set[str]]:
    """module -> the compile_attn modules it imports (``from pkg import name`` means ``pkg.name`` when that is a
    module, else ``pkg``); with ``typing`` the imports under ``if TYPE_CHECKING:`` too."""
    modules = module_names()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _runtime_imports(ast.parse(path.read_text(), str(path)), typing):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # "import compile_attn.x.y" names module x.y
                    target = target.rpartition(".")[0]
                if target.split(".")[0] == PACKAGE and target != name:
                    edges[name].add(target)
    return edges


def layer_of(module: str) -> str:
    """``compile_attn.<sub>`` for a subpackage's modules, ``compile_attn.<module>`` for a top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2])


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph ``edges`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def _layer_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for src, targets in edges.items():
        for dst in targets:
            if layer_of(src) != layer_of(dst) and PACKAGE not in (src, dst):  # the facade is not a layer
                out[layer_of(src)].add(layer_of(dst))
    return out


def _witness(edges: dict[str, set[str]], src_layer: str, dst_layer: str) -> str:
    return next(f"{s} -> {d}" for s, ts in sorted(edges.items()) for d in sorted(ts)
                if layer_of(s) == src_layer and layer_of(d) == dst_layer)


def test_the_graph_builder_sees_known_imports() -> None:
    """The check itself: imports in functions, relative imports and ``from pkg import module`` are all found."""
    edges = import_edges()
    assert f"{PACKAGE}.ops.split_registry" in edges[f"{PACKAGE}.ops.attention"]  # from pkg.mod import name
    assert f"{PACKAGE}.ops.attention" in edges[f"{PACKAGE}.ops"]  # a package __init__ re-exporting
    assert f"{PACKAGE}.attention.kernels" in edges[f"{PACKAGE}.attention.kernel_loader"]  # inside a function
    assert f"{PACKAGE}.graph_runner.runner" not in edges[f"{PACKAGE}.graph_runner.verify"]  # TYPE_CHECKING only
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_import_cycle_between_modules() -> None:
    cycle = find_cycle(import_edges())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_between_modules_in_type_hints() -> None:
    """Imports for type hints only close no cycle either: a module that the other imports is typed by a protocol
    of what it uses (``graph_runner.protocol``, ``engine.intake.Intake``)."""
    edges = import_edges(typing=True)
    protocol, backend = f"{PACKAGE}.graph_runner.protocol", f"{PACKAGE}.attention.base"
    assert backend in edges[protocol] and backend not in import_edges()[protocol]  # imported for hints only
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle in type hints: " + " -> ".join(cycle or [])


def test_no_import_cycle_between_layers() -> None:
    edges = import_edges()
    layers = _layer_edges(edges)
    cycle = find_cycle(layers)
    if cycle is not None:
        steps = [_witness(edges, a, b) for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle between layers: " + " -> ".join(cycle) + "\n  " + "\n  ".join(steps))


def layer_ranks(edges: dict[str, set[str]]) -> dict[str, int]:
    """Rank of each ranked layer: its index in LAYER_ORDER; a top-level module that a ranked library subpackage
    imports is "base" (rank 0), and so are the ``BASE_PACKAGES``. The command line (cli, cli_options) and models
    are not ranked."""
    rank = {f"{PACKAGE}.{name}": i for i, name in enumerate(LAYER_ORDER) if name != "base"}
    rank.update({f"{PACKAGE}.{name}": 0 for name in BASE_PACKAGES})
    for src, targets in _layer_edges(edges).items():
        if src in rank and src.split(".")[1] not in APPLICATIONS:
            for dst in targets:
                if dst not in rank and dst.count(".") == 1 and not module_names()[dst].name == "__init__.py":
                    rank[dst] = 0
    return rank


def test_no_layer_imports_a_layer_above_it() -> None:
    """base (config, context, batch, ...) -> kv -> ops -> passes -> attention -> compiler -> graph_runner -> hf ->
    distributed -> engine -> server -> bench: every import between ranked layers points down (or stays in the
    layer); the server imports nothing of the benchmarks."""
    edges = import_edges()
    rank = layer_ranks(edges)
    assert rank[f"{PACKAGE}.config"] == 0 and rank[f"{PACKAGE}.context"] == 0
    assert rank[f"{PACKAGE}.batch"] == 0 and rank[f"{PACKAGE}.draft_tree"] == 0
    upward = sorted(_witness(edges, src, dst) for src, targets in _layer_edges(edges).items() if src in rank
                    for dst in targets if dst in rank and rank[dst] > rank[src])
    assert not upward, "imports of a higher layer: " + "; ".join(upward)


def test_draft_tree_builds_on_errors_only() -> None:
    """``draft_tree`` (a verification step's trees, which ``batch`` checks) imports nothing of compile_attn but its
    errors: the batch's own layer stays a leaf."""
    assert import_edges()[f"{PACKAGE}.draft_tree"] <= {f"{PACKAGE}.errors"}


def test_no_backend_imports_another() -> None:
    """``attention/<backend>/`` imports no other backend's folder (shared pieces live beside them: ``base``,
    ``registry``, ``kernels``, ``kernel_loader``)."""
    edges = import_edges()
    crossing = sorted(f"{src} -> {dst}" for src, targets in edges.items() for dst in targets
                      if (a := _backend_of(src)) and (b := _backend_of(dst)) and a != b)
    assert not crossing, "a backend imports another: " + "; ".join(crossing)


def _backend_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "attention" and parts[2] in BACKENDS else None


def test_package_root_is_small() -> None:
    root = sorted(p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {root}"
