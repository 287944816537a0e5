"""The import graph of the package: no cycles inside a layer, no private names across modules.

The graph is read from the source (every ``import`` statement, those inside functions included), so a
deferred import that only hides a cycle counts as the cycle it is.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "torchneuron"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement of a module."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:   # annotations only: never imported at run time
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub, []) if sub in MODULES else (base, [a.name]))
    return found


def _graph(package: str) -> dict[str, set[str]]:
    """Edges between the modules of ``package`` (an import of ``a.b.c`` is an edge to each module named)."""
    inside = {m for m in MODULES if m == package or m.startswith(package + ".")}
    graph: dict[str, set[str]] = {m: set() for m in inside}
    for m in inside:
        for target, _ in _imports(MODULES[m]):
            while target and target not in inside:
                target = target.rpartition(".")[0]
            # a package's __init__ re-exporting its modules is not an edge back into the package
            if target and target != m and not (MODULES[m].name == "__init__.py" and target.startswith(m + ".")):
                graph[m].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules, or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


@pytest.mark.parametrize("package", ["torchneuron.ops", "torchneuron.nki", "torchneuron.nki.legacy", "torchneuron.sim",
                                     "torchneuron.runtime", "torchneuron.kernels"])
def test_no_import_cycle(package):
    cycle = _cycle(_graph(package))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_ops_module_imports_private_names_of_another():
    private = []
    for m, path in MODULES.items():
        if not m.startswith("torchneuron.ops."):
            continue
        for target, names in _imports(path):
            if target.startswith("torchneuron.ops.") and target != m:
                private += [f"{m} imports {target}.{n}" for n in names if n.startswith("_")]
    assert not private, "\n".join(private)


def test_the_simulator_imports_nothing_above_it():
    above = ("torchneuron.config", "torchneuron._C", "torchneuron.runtime", "torchneuron.nki", "torchneuron.kernels",
             "torchneuron.ops", "torchneuron.neuron", "torchneuron.compiler", "torchneuron.distributed")
    found = [f"{m} imports {full}" for m, path in MODULES.items() if m.startswith("torchneuron.sim")
             for target, names in _imports(path)
             for full in [target] + [f"{target}.{n}" for n in names]
             if full.startswith(above)]
    assert not found, "\n".join(found)
