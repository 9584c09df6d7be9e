"""No import cycles in ``src``: every import counts, at top level, inside functions and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def import_graph(root: Path, package: str = "src") -> dict[str, set[str]]:
    """``module -> modules it imports`` within ``package`` under ``root``, read from every import in each file.

    ``from pkg import name`` where ``name`` is a submodule is an edge to that submodule (and to ``pkg``); importing
    ``pkg.sub`` runs ``pkg/__init__.py`` too, so it is an edge to every package above ``pkg.sub``, except the
    importing module's own packages (they ran before it). ``from pkg import name`` of a name ``pkg/__init__.py``
    defines needs that ``__init__`` itself: an edge to ``pkg`` from anywhere.
    """
    files = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    packages = {name for name, p in files.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {name: set() for name in files}

    def add(source: str, target: str) -> None:
        if target in files and target != source:
            graph[source].add(target)
        parts = target.split(".")
        for i in range(1, len(parts)):  # the packages above it run first, unless they are the source's own
            prefix = ".".join(parts[:i])
            if prefix in files and prefix != source and not source.startswith(prefix + "."):
                graph[source].add(prefix)

    for name, path in files.items():
        here = name if name in packages else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(name, alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                submodules = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in files]
                if len(submodules) < len(node.names):  # a name that pkg/__init__.py defines
                    add(name, module)
                for submodule in submodules:  # pkg/__init__.py first (unless it is the importer's own), then it
                    add(name, submodule)
    return graph


def strongly_connected(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph.get(target, ()))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def cycles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    return sorted(c for c in strongly_connected(graph) if len(c) > 1)


@pytest.mark.fast
def test_the_cycle_finder_on_a_known_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.fast
def test_the_graph_counts_imports_in_functions_type_checking_and_submodules(tmp_path):
    pkg = tmp_path / "src"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from src.sub import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from ..top import x\n")
    (pkg / "top.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.leaf import f\n")
    (pkg / "sub" / "other.py").write_text("from src.sub import leaf\n")  # a sibling: src.sub's __init__ ran
    graph = import_graph(tmp_path)
    assert graph["src.top"] == {"src.sub", "src.sub.leaf"}  # src.sub's __init__ runs first; src is its own
    assert graph["src.sub.leaf"] == {"src.top"}
    assert graph["src.sub.other"] == {"src.sub.leaf"}
    assert cycles(graph) == [["src.sub", "src.sub.leaf", "src.top"]]


@pytest.mark.fast
def test_no_import_cycles_in_src():
    found = cycles(import_graph(ROOT))
    assert found == [], "import cycles:\n" + "\n".join("  " + " <-> ".join(c) for c in found)
