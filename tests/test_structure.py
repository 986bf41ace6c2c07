"""The package's structure: layers import only downwards, and no module imports another that
imports it back.

Read with :mod:`ast` (nothing is imported), counting every import of a package module: at the
top, inside functions (lazy imports) and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fslr_func

ROOT = Path(fslr_func.__file__).parent
PACKAGE = "fslr_func"


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level:
        base = base[: len(base) - (level - 1)]
        return ".".join([*base, module] if module else base)
    return module or ""


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Package modules that ``name`` imports."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, is_package, node.level, node.module)
            for alias in node.names:  # `from . import distributed` imports a module
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules along it, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


#: The layers, bottom to top; a module may import from its own subpackage and from lower layers.
#: ``parallel`` and ``io`` share a level and may not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("stats",),
    ("probe",),
    ("parallel", "io"),
    ("training",),
    ("integrations",),
    ("experiments",),
)
_LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}


def _layer(module: str) -> str | None:
    """The layer subpackage of a module; ``None`` for the top-level facade modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in _LEVEL else None


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the layer order, as ``importer -> imported``."""
    bad = []
    for importer, imported in sorted(graph.items()):
        own = _layer(importer)
        if own is None:  # the facade (fslr_func, fslr_func.distributed) may import any layer
            continue
        for target in sorted(imported):
            layer = _layer(target)
            if layer == own:
                continue
            if layer is None or _LEVEL[layer] >= _LEVEL[own]:
                bad.append(f"{importer} -> {target}")
    return bad


def test_the_graph_is_read() -> None:
    graph = _graph()
    assert "fslr_func.parallel.data_parallel" in graph["fslr_func.distributed"]
    assert "fslr_func.training.wrapper" in graph["fslr_func.training.wrap"]
    assert set(_LEVEL) == {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}


def test_layers_import_only_downwards() -> None:
    assert _upward_imports(_graph()) == []


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {
        "fslr_func.stats.estimator": {"fslr_func.training.flerm"},
        "fslr_func.io.record": {"fslr_func.parallel.fsdp", "fslr_func.probe.names"},
        "fslr_func.training.flerm": {"fslr_func"},
    }
    assert _upward_imports(graph) == [
        "fslr_func.io.record -> fslr_func.parallel.fsdp",
        "fslr_func.stats.estimator -> fslr_func.training.flerm",
        "fslr_func.training.flerm -> fslr_func",
    ]


def test_no_import_cycles() -> None:
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]


def test_every_exported_name_exists() -> None:
    """``from module import *`` works: each name of a module's ``__all__`` is defined there
    (``fslr_func.distributed`` builds its ``__all__`` from another module's, and a name added
    there only broke its star import and the documentation build)."""
    import importlib

    missing = [
        f"{name}.{export}"
        for name in _modules()
        for export in getattr(importlib.import_module(name), "__all__", ())
        if not hasattr(importlib.import_module(name), export)
    ]
    assert missing == []
