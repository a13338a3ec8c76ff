"""The package layers stay layers: each may import only what is below it (read from the source, lazy imports too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# installed names of the folders (pyproject's package-dir)
FOLDERS = {"smartgen": "smartgen", "cli": "smartgen.cli", "store": "smartgen.store", "tui": "smartgen.tui"}
UPPER = ("smartgen.roles", "smartgen.apps", "smartgen.cli", "smartgen.tui")
# layer -> packages it must never import
FORBIDDEN = {
    "smartgen.lanes": ("smartgen.engine", "smartgen.runtime", "smartgen.selectors", "smartgen.store", *UPPER),
    "smartgen.engine": ("smartgen.runtime", "smartgen.selectors", "smartgen.store", *UPPER),
    "smartgen.selectors": ("smartgen.runtime", "smartgen.store", *UPPER),
    "smartgen.runtime": ("smartgen.store", *UPPER),
    "smartgen.store": ("smartgen.engine.decode", "smartgen.engine.prefill", "smartgen.runtime", *UPPER),
    "smartgen.roles": ("smartgen.apps", "smartgen.cli", "smartgen.tui"),
    "smartgen.apps": ("smartgen.cli", "smartgen.tui"),
}


def _modules() -> list[tuple[str, Path]]:
    found = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append((".".join((package, *parts)), path))
    return found


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("smartgen")}


MODULES = _modules()


def test_every_layer_has_modules():
    layers = {layer for layer in FORBIDDEN if any(m == layer or m.startswith(layer + ".") for m, _ in MODULES)}
    assert layers == set(FORBIDDEN)


@pytest.mark.parametrize("module, path", MODULES, ids=[m for m, _ in MODULES])
def test_no_module_imports_a_layer_above_it(module, path):
    for layer, forbidden in FORBIDDEN.items():
        if module == layer or module.startswith(layer + "."):
            bad = sorted(
                name for name in _imports(module, path) for f in forbidden if name == f or name.startswith(f + ".")
            )
            assert not bad, f"{module} ({layer}) imports {', '.join(bad)}"


def _resolve(name: str, known: set[str]) -> str | None:
    """The module an imported name lives in: the longest known module it starts with ("a.b.C" -> "a.b")."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative): every import
    cycle, of any length, lies within one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
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
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_import_cycles_are_found_at_any_length():
    ring = {"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"a"}, "e": {"a"}, "f": {"f"}}
    assert import_cycles(ring) == [["a", "b", "c", "d"]]
    assert import_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_modules_import_each_other_in_a_cycle_of_any_length():
    """Lazy imports inside functions count: a ring that only closes at run time is still a ring."""
    known = {module for module, _ in MODULES}
    edges = {
        module: {target for name in _imports(module, path) if (target := _resolve(name, known)) not in (None, module)}
        for module, path in MODULES
    }
    cycles = import_cycles(edges)
    assert not cycles, f"modules importing each other in a cycle: {cycles}"
