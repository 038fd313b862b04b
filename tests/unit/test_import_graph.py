"""The package's modules import one another without circles.

The graph is read from the source with `ast`, not by importing anything. Every
import statement counts, wherever it stands: at module level, inside a function
(a lazy import) or under `if TYPE_CHECKING:`. A lazy import still ties the two
layers together (the lower one cannot be read, tested or moved without the
upper one), it only hides the circle from the interpreter. An edge goes from
the importing module to the most specific project module the statement names
(`from megatron_rl.models.mapping import Shard` -> megatron_rl.models.mapping;
`from megatron_rl.models import families` -> megatron_rl.models.families); the
parent packages Python also runs (`megatron_rl/models/__init__.py`) are not
edges, and neither are `importlib.import_module` calls.

A circle is a strongly connected set of two or more modules; the failure
names every one, as a path `a -> b -> a` with the file and line of each import.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

ALLOWED_CIRCLES: list[frozenset[str]] = []
"""Circles tolerated for now: each must still exist (a stale entry fails), and no other circle may."""

Edge = tuple[str, int]
"""(path relative to the root, line) of one import statement."""


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under root/package (a package is its __init__.py)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _innermost(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.stmt, importer: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The project modules one import statement names."""
    if isinstance(node, ast.Import):
        return {t for t in (_innermost(alias.name, modules) for alias in node.names) if t}
    assert isinstance(node, ast.ImportFrom)
    if node.level:  # relative: from the importer's package, one level up per extra dot
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    targets = set()
    for alias in node.names:
        target = f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else _innermost(module, modules)
        if target:
            targets.add(target)
    return targets


def import_graph(root: Path, package: str) -> dict[str, dict[str, Edge]]:
    """module -> {imported project module: where the first statement importing it stands}."""
    modules = package_modules(root, package)
    graph: dict[str, dict[str, Edge]] = {}
    for name, path in modules.items():
        edges: dict[str, Edge] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, name, path.name == "__init__.py", modules):
                    if target != name:
                        edges.setdefault(target, (str(path.relative_to(root)), node.lineno))
        graph[name] = edges
    return graph


def strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; singletons included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def circles(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Every set of two or more modules that import one another, directly or around a loop."""
    return sorted(c for c in strongly_connected(graph) if len(c) > 1)


def describe(circle: list[str], graph: dict[str, dict[str, Edge]]) -> str:
    """One loop through a circle, `a -> b -> a`, with where each import stands (breadth-first back to the start)."""
    members, start = set(circle), circle[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in previous:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target in members and target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    path = [start]
    while path[-1] != start or len(path) == 1:
        path.append(previous[path[-1]])
    path.reverse()
    steps = [f"{a} -> {b} ({graph[a][b][0]}:{graph[a][b][1]})" for a, b in zip(path, path[1:])]
    return f"circle of {len(circle)} modules {sorted(circle)}: " + "; ".join(steps)


def test_the_package_has_no_import_circle():
    graph = import_graph(REPO, "megatron_rl")
    found = circles(graph)
    allowed = [c for c in found if frozenset(c) in ALLOWED_CIRCLES]
    unexpected = [describe(c, graph) for c in found if frozenset(c) not in ALLOWED_CIRCLES]
    assert not unexpected, "import circles (move what each side needs to the lower layer):\n" + "\n".join(unexpected)
    stale = [sorted(c) for c in ALLOWED_CIRCLES if c not in {frozenset(a) for a in allowed}]
    assert not stale, f"ALLOWED_CIRCLES lists circles that no longer exist, remove them: {stale}"


def test_circles_are_found_and_named(tmp_path):
    """A hand-built package: a -> b lazily inside a function, b -> a at module level (relative), c -> a only.

    The one circle is {a, b}; c imports into it without being part of it; d -> d (itself) is no circle.
    """
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os\n\n\ndef f():\n    from pkg.b import g\n    return g\n")
    (pkg / "b.py").write_text("from . import a\n\n\ndef g():\n    return a\n")
    (pkg / "c.py").write_text("from pkg.a import f\n")
    (pkg / "d.py").write_text("import pkg.d\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b": ("pkg/a.py", 5)}
    assert graph["pkg.b"] == {"pkg.a": ("pkg/b.py", 1)}
    assert graph["pkg.c"] == {"pkg.a": ("pkg/c.py", 1)}
    assert graph["pkg.d"] == {}
    assert circles(graph) == [["pkg.a", "pkg.b"]]
    assert describe(["pkg.a", "pkg.b"], graph) == (
        "circle of 2 modules ['pkg.a', 'pkg.b']: pkg.a -> pkg.b (pkg/a.py:5); pkg.b -> pkg.a (pkg/b.py:1)"
    )
