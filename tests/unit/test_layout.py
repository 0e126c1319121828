"""The shape a maintainer relies on: kvctl/core in a dozen rooms, and no import circle anywhere in kvctl
(lazy imports inside functions count: they hide a circle, they do not remove it)."""

import ast
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "kvctl"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The kvctl modules `path` imports, at any depth of its code."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(above + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(paths)) for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
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
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circle_in_kvctl():
    assert circles(import_graph()) == []


def test_the_circle_finder_sees_a_lazy_import():
    """The check above could pass by seeing nothing: a circle closed inside a function is found."""
    graph = import_graph()
    graph["kvctl.core.errors"] = graph["kvctl.core.errors"] | {"kvctl.core.instance.opening"}
    assert any("kvctl.core.errors" in circle and "kvctl.core.instance.opening" in circle
               for circle in circles(graph))
    assert "kvctl.core.instance.protocol" in import_graph()["kvctl.core.instance.opening"]


def test_core_has_at_most_a_dozen_entries():
    entries = sorted(path.name for path in (PACKAGE / "core").iterdir() if path.name != "__pycache__")
    assert len(entries) <= 12, entries
