"""The package's layout is its architecture: imports only point down the floors
(entrypoints -> engine -> executor -> worker -> models -> layers -> parallel ->
kernels -> the shared types), and no module imports itself back through others.
The benchmarks (bench/) sit on top: they may use anything public, and nothing in
the product imports them; the ``ctxpar`` command (ctxpar/cli.py) is where the two
meet.

The import graph is read from the source (every ``import`` statement, those
inside functions included), not from what Python happened to load; so the
commands and benchmarks are loaded by import statements, not from strings.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ctxpar

ROOT = Path(ctxpar.__file__).parent
# Lowest first. Modules directly under ctxpar/ are the shared types and helpers.
FLOORS = [
    "kernels",
    "parallel",
    "layers",
    "costmodel",
    "models",
    "worker",
    "executor",
    "engine",
    "entrypoints",
    "bench",
]
# The package's public re-exports may import from any floor.
REEXPORTS = {"ctxpar", "ctxpar.cli"}
BENCH = "ctxpar.bench"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> int:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in FLOORS:
        return FLOORS.index(parts[1]) + 1
    return 0  # ctxpar.config, ctxpar.errors, ...


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t.split(".")[0] == "ctxpar" and t != name)
        graph[name] = deps
    return graph


def test_every_import_points_down_or_sideways():
    upward = [
        f"{m} (floor {floor(m)}) imports {d} (floor {floor(d)})"
        for m, deps in import_graph().items()
        if m not in REEXPORTS
        for d in deps
        if floor(d) > floor(m)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = import_graph()
    # Packages' __init__ modules count as their own module only; a cycle through
    # them would still be seen via the modules that import each other.
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d in REEXPORTS:
                continue
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state and m not in REEXPORTS:
            visit(m, [m])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_floors_are_the_folders():
    """Every subpackage is a floor (a new folder must be placed in FLOORS)."""
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(FLOORS)


def test_nothing_in_the_product_imports_the_benchmarks():
    """Only the ``ctxpar`` command registers them (`ctxpar bench`)."""
    product = [
        f"{m} imports {d}"
        for m, deps in import_graph().items()
        if m != "ctxpar.cli" and not m.startswith(BENCH)
        for d in deps
        if d == BENCH or d.startswith(BENCH + ".")
    ]
    assert not product, "\n".join(product)


def private_names_imported(path: Path) -> list[str]:
    """``from ctxpar.X import _name`` in the file at ``path``: another module's private name."""
    return [
        f"{node.module}.{a.name}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ctxpar")
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]


def test_the_benchmarks_use_only_public_names():
    """A benchmark measures what a user can run: it imports no module's private name (where it
    needs the engine's internals, its comment says why)."""
    private = [f"{p.relative_to(ROOT)}: {n}" for p in (ROOT / "bench").rglob("*.py") for n in private_names_imported(p)]
    assert not private, "\n".join(private)


def test_every_command_and_benchmark_is_an_import_the_graph_sees():
    """The command tables load their modules by import statements (not importlib strings),
    so the tests above check what each command and benchmark imports."""
    from ctxpar.bench.catalog import BENCHMARKS
    from ctxpar.entrypoints.cli.main import COMMANDS

    graph = import_graph()
    for table, where in ((COMMANDS, "ctxpar.entrypoints.cli.main"), (BENCHMARKS, "ctxpar.bench.catalog")):
        modules = {table.load(name).__name__ for name in table.help}
        assert modules <= graph[where], modules - graph[where]
