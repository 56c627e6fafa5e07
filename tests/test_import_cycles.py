"""The wdsllm package has no import cycle: modules form layers, and a lazy import inside a function
is an import like any other (it only hides the cycle until the function runs).

Every module's AST is read (nothing is imported), each ``import`` and ``from ... import`` of a
wdsllm module becomes an edge wherever it sits, in a function or not, and the graph must be
acyclic. Only imports under ``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import wdsllm

ROOT = Path(wdsllm.__file__).resolve().parent
PACKAGE = "wdsllm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at any depth, except those under ``if TYPE_CHECKING``."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return found


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The wdsllm modules an import statement runs (a name imported from a package is its
    submodule when one exists, else the package's ``__init__``)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        origin = ".".join(base + ([node.module] if node.module else []))
    else:
        origin = node.module or ""
    out = set()
    for alias in node.names:
        sub = f"{origin}.{alias.name}"
        if sub in known:
            out.add(sub)
        elif origin in known:
            out.add(origin)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    known = set(paths)
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _imports(tree):
            edges |= _targets(module, is_package, node, known)
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]], within: set[str] | None = None) -> list[str] | None:
    """One cycle of the graph among the modules ``within`` (all: None), the first module repeated
    at the end; None when there is none."""
    nodes = set(graph) if within is None else within
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(nodes):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph[start] & nodes))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
                continue
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, set()) & nodes)))
    return None


def cyclic_groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """The modules that import each other, directly or through others: every strongly connected
    component of more than one module."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, pending = set(), [start]
        while pending:
            for nxt in graph.get(pending.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    pending.append(nxt)
        reach[start] = seen
    groups: list[set[str]] = []
    for module in sorted(graph):
        if module in reach[module] and not any(module in g for g in groups):
            groups.append({m for m in reach[module] if module in reach[m]})
    return groups


def test_the_graph_sees_lazy_imports() -> None:
    """A function-level import is an edge: the checker would see a cycle hidden that way."""
    tree = ast.parse("def f():\n    from . import a\n")
    assert _targets("pkg.b", False, _imports(tree)[0], {"pkg.a", "pkg.b"}) == {"pkg.a"}
    graph = {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    assert cyclic_groups(graph) == [{"pkg.a", "pkg.b"}]


def test_no_import_cycle_in_load() -> None:
    graph = import_graph()
    assert "wdsllm.load.loader" in graph
    load = {m for m in graph if m.startswith("wdsllm.load")}
    cycle = find_cycle(graph, load)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_in_wdsllm() -> None:
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
