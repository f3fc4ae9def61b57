"""The manager's packages stand in layers: no package imports one that imports it back, directly or
through others. An import inside a function counts the same: it only hides the circle."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "manager"


def _part(module: str) -> str | None:
    """The top-level part of ``manager`` a module belongs to (a subpackage, or a module of its own)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "manager" and len(parts) > 1 else None


def import_graph() -> dict[str, dict[str, list[str]]]:
    """part -> imported part -> where (file:line)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT)
        if relative.parts[0] == "migrations":
            continue
        source = relative.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
                if node.module == "manager":
                    modules = [f"manager.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                target = _part(module)
                if target is not None and target != source:
                    graph[source][target].append(f"{relative}:{node.lineno}")
    return graph


def circles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The groups of parts that reach each other through imports (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(part: str) -> None:
        index[part] = low[part] = len(index)
        stack.append(part)
        for target in graph.get(part, {}):
            if target not in index:
                visit(target)
                low[part] = min(low[part], low[target])
            elif target in stack:
                low[part] = min(low[part], index[target])
        if low[part] == index[part]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == part:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for part in sorted(graph):
        if part not in index:
            visit(part)
    return found


def test_no_package_of_the_manager_imports_one_that_imports_it_back():
    graph = import_graph()
    found = circles(graph)
    lines = []
    for group in found:
        for source in group:
            for target in group:
                if target in graph[source]:
                    lines.append(f"{source} -> {target}: {', '.join(graph[source][target][:3])}")
    assert not found, "import circles among the manager's packages:\n" + "\n".join(lines)


def test_the_check_sees_a_circle_hidden_in_a_function():
    graph: dict[str, dict[str, list[str]]] = {"a": {"b": ["a.py:1"]}, "b": {"c": ["b.py:9"]}, "c": {"a": ["c.py:3"]}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b": ["a.py:1"]}, "b": {}}) == []
