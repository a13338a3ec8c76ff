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


def test_no_two_modules_import_each_other():
    edges = {module: {n for n in _imports(module, path)} for module, path in MODULES}
    known = set(edges)
    pairs = sorted(
        (a, b)
        for a, targets in edges.items()
        for b in targets
        if b in known and a < b and (a in edges.get(b, set()) or any(t == a for t in edges.get(b, set())))
    )
    assert not pairs, f"modules importing each other: {pairs}"
