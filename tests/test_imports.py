"""The map of the code in docs/concepts.md is the import rule, and the tree keeps it.

Every import in the tree (at any depth of a module, type-only imports aside) goes only where
its folder's "May import:" line in the map allows, and no import circle runs inside `raypar/`.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "concepts.md"

# Folder of the checkout -> the package it installs as (pyproject's package-dir).
FOLDERS = {"raypar": "raypar", "raypar/driver": "raypar.driver", "actors": "raypar.actors",
           "checkpoint": "raypar.checkpoint", "kernels": "raypar.kernels"}
# The parts an import can land in: the core is raypar outside these packages.
PARTS = ("raypar.driver", "raypar.actors", "raypar.checkpoint", "raypar.kernels")
# The core's entry points, which the map lets import the driver.
ENTRY_POINTS = {"raypar", "raypar.__main__", "raypar.train"}


def part_of(module: str) -> str | None:
    """The part of the project (or `ray`) that `module` belongs to; None for anything else."""
    if module == "ray" or module.startswith("ray."):
        return "ray"
    for part in PARTS:
        if module == part or module.startswith(part + "."):
            return part
    if module == "raypar" or module.startswith("raypar."):
        return "raypar"
    return None


def module_files() -> dict[str, Path]:
    """Every module of the project by its import name."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
        for sub in sorted(p for p in (ROOT / folder).iterdir() if (p / "__init__.py").is_file()):
            if f"{folder}/{sub.name}" in FOLDERS:
                continue
            for path in sorted(sub.rglob("*.py")):
                rel = path.relative_to(ROOT / folder).with_suffix("")
                parts = [p for p in rel.parts if p != "__init__"]
                found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import in `path` outside `if TYPE_CHECKING:` blocks.
    `from pkg import sub` counts as importing `pkg.sub` when that is a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.stem == "__init__"
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only |= {id(n) for child in node.body for n in ast.walk(child)}
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full if full in known else base, node.lineno))
    return found


def folder_of(name: str) -> str:
    """The folder of the map a module sits in (the innermost of FOLDERS that holds it)."""
    return max((f for f, pkg in FOLDERS.items() if name == pkg or name.startswith(pkg + ".")),
               key=lambda f: len(FOLDERS[f]))


def allowed_by_map(text: str) -> dict[str, set[str]]:
    """Folder -> what its "May import:" line allows, from the map's paragraphs."""
    section = text.split("## Map of the code", 1)[1].split("\n## ", 1)[0]
    rules = {}
    for paragraph in section.split("\n\n"):
        head = re.match(r"\*\*`([\w/]+?)/?`\*\*", paragraph.strip())
        may = re.search(r"May import: (.*?)\.\s*$", paragraph.strip(), re.S)
        if head and may:
            rules[head.group(1)] = set(re.findall(r"`([\w.]+)`", may.group(1)))
    return rules


RULES = allowed_by_map(MAP.read_text(encoding="utf-8"))
MODULES = module_files()


def violations(modules: dict[str, Path], rules: dict[str, set[str]]) -> list[str]:
    known = set(modules)
    out = []
    for name, path in modules.items():
        folder = folder_of(name)
        allowed = set(rules[folder]) | ({"raypar.driver"} if name in ENTRY_POINTS else set())
        for target, line in imports(name, path, known):
            part = part_of(target)
            if part is not None and part not in allowed:
                shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                out.append(f"{shown}:{line} imports {target} ({part}); "
                           f"{folder}/ may import {sorted(rules[folder])}")
    return out


def test_the_map_names_every_folder():
    assert set(RULES) == set(FOLDERS), f"docs/concepts.md's map has rules for {sorted(RULES)}, the tree has {sorted(FOLDERS)}"


def test_every_import_follows_the_map():
    assert violations(MODULES, RULES) == []


def test_the_rule_catches_a_core_module_that_imports_ray_or_the_driver(tmp_path):
    """The check is not vacuous: a core module importing Ray, or the driver, is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("import ray\n\ndef f():\n    from raypar.driver import Trainer\n")
    found = violations({"raypar.bad": bad}, RULES)
    assert len(found) == 2 and "ray (ray)" in found[0] and "raypar.driver" in found[1]
    typed = tmp_path / "typed.py"
    typed.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from raypar.driver import Trainer\n")
    assert violations({"raypar.typed": typed}, RULES) == []


def cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Import circles among `modules` (Tarjan's strongly connected components of size > 1)."""
    known = set(modules)
    graph = {name: sorted({t for t, _ in imports(name, path, known) if t in known and t != name})
             for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_inside_raypar():
    assert cycles(MODULES) == []


def test_the_circle_check_finds_a_circle(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from raypar.b import x\n")
    b.write_text("def f():\n    import raypar.a\n")
    assert cycles({"raypar.a": a, "raypar.b": b}) == [["raypar.a", "raypar.b"]]


@pytest.mark.parametrize("module", ["raypar.runtime.report", "raypar.driver.records"])
def test_the_driver_reads_reports_without_the_executor(module):
    """The step report's room imports no executor: the driver never builds a stage to read one."""
    known = set(MODULES)
    direct = {t for t, _ in imports(module, MODULES[module], known)}
    assert "raypar.runtime.stage" not in direct
