"""The import graph of src/agentvm has no cycle.

Every import counts - at module level or inside a function (a function-level import is still a
dependency: it only moves the failure from import time to the first call) - except those under
``if TYPE_CHECKING:`` (never run). A cycle is printed as the chain of modules that closes it,
each with the line of the import that leads to the next."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "agentvm"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in (SRC / PACKAGE).rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.body:
                out.update(id(n) for n in ast.walk(child))
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` mod
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else origin for a in node.names]
            for t in targets:
                if t != PACKAGE and not t.startswith(PACKAGE + "."):
                    continue
                dep = resolve(t)
                if dep is not None and dep != mod:
                    graph[mod].setdefault(dep, node.lineno)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan), as
    the list of modules around it (the first again at the end)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # iterative enough for a tree this size (depth < 100)
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:
        members = set(comp)
        # a shortest path from the component's first module back to itself, inside it
        start = comp[0]
        prev: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        found = v
                        break
                    if w in members and w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        v = found
        while v is not None and v != start:
            path.insert(1, v)
            v = prev.get(v)
        cycles.append(path + [start])
    return cycles


def describe(graph, cycle: list[str]) -> str:
    src = {m: p for m, p in _modules().items()}
    steps = [f"{a} ({src[a].relative_to(SRC)}:{graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    return "\n    ".join(steps)


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in src/agentvm (break each by moving the shared part below both):\n  " + \
        "\n  ".join(describe(graph, c) for c in cycles)


def test_the_graph_sees_function_level_imports_and_ignores_type_checking_ones(tmp_path):
    """The checker itself: a cycle closed by an import inside a function is found; one closed
    only under TYPE_CHECKING is not."""
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from agentvm import b\n")
    (pkg / "b.py").write_text("def f():\n    from agentvm.a import x\n")
    (pkg / "c.py").write_text("from agentvm.d import y\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agentvm import c\n")
    globals()["SRC"], old = tmp_path, SRC
    try:
        cycles = find_cycles(import_graph())
    finally:
        globals()["SRC"] = old
    assert cycles == [["agentvm.a", "agentvm.b", "agentvm.a"]]
