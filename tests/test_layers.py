"""Layers import downward only: no import cycle between doeks' modules (imports inside functions count too, since
they are how a cycle hides). On the commit before this test there were two: eks <-> identity <-> storage, and
jobspec <-> trainimage <-> preflight. Until issue 37 the graph missed `from .package import module` (it recorded only
the package), and two cycles stood: cluster.images -> efa -> cluster.operators -> cluster.images, and container ->
local.runtime -> local.jobs -> jobspec -> trainimage -> container."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "doeks"


def import_graph() -> dict[str, set[str]]:
    raw: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        module = ".".join(("doeks",) + path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("doeks")):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                # `from X import name`: name may be a module of package X (then that module is the dependency), or
                # a name defined in X (then X is): both are recorded and known() keeps what exists
                found |= {target} | {f"{target}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("doeks")}
        raw[module] = found
    modules = set(raw)

    def known(name: str) -> str | None:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    # a module importing its own package (or a parent) is Python's, not a layer crossing
    return {m: {k for d in deps if (k := known(d)) and k != m and not m.startswith(k + ".")} for m, deps in raw.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_doeks_modules():
    assert cycles(import_graph()) == []


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between doeks' top-level modules and packages (doeks.cluster, doeks.pod, ...): each package one node."""
    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    rooms: dict[str, set[str]] = {room(m): set() for m in graph}
    for module, deps in graph.items():
        rooms[room(module)] |= {room(d) for d in deps} - {room(module)}
    return rooms


def test_no_import_cycle_between_doeks_packages():
    """A package is a room: nothing below it imports it back. Before issue 53 one circle held 26 of them (the pod's
    torchrun read tracebacks through doeks.targets, the catalog found its cache through doeks.cluster, aws started moto
    through doeks.local)."""
    assert cycles(package_graph(import_graph())) == []


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert package_graph({"doeks.p.x": {"doeks.q"}, "doeks.q": {"doeks.p.y"}, "doeks.p.y": set()}) == \
        {"doeks.p": {"doeks.q"}, "doeks.q": {"doeks.p"}}


def test_no_source_file_over_700_lines():
    """A room holds one idea (issue 53: checkpoints.py had 1,480 lines, cluster/node.py 1,005 before they were split)."""
    sizes = {str(p.relative_to(ROOT.parent)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert {path: n for path, n in sizes.items() if n > 700} == {}
