"""No import circles inside tpattn/: every import, top-level or inside a function, is an edge from
one module to another; a strongly connected component of more than one module is a circle.

An import inside a function hides a circle from Python at import time but not from a reader: the
two modules still need each other. So both kinds count here."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "tpattn"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _edges(name: str, path: Path, known: set[str]) -> set[str]:
    """The tpattn modules `name` imports (a package's own submodules by `from . import x` too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in known:
                continue
            subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known}
            out |= subs
            if len(subs) < len(node.names):  # a name defined in the module (or package) itself
                out.add(target)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _edges(m, p, set(mods)) for m, p in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_late_and_relative_imports():
    g = import_graph()
    assert "tpattn.attention" in g["tpattn.attention.fused"]  # from . import CudaBackend
    assert "tpattn.config" in g["tpattn.memory"]
    assert "tpattn.attention" in g["tpattn.config"]  # imported inside a function


def test_no_import_circles_in_tpattn():
    found = circles(import_graph())
    assert not found, "import circles (move what both sides need down into a lower module, e.g. " \
                      f"tpattn/errors.py): {found}"
