"""The package's floors: every top-level package or module of `resadapt_eval` stands on a floor, and
imports only from floors below its own (never from its own floor's neighbours, never upward), so the
graph of its imports has no cycle. FLOORS below is where the order is written down; a new package
or module must be given a floor here, or this test fails naming it.

Imports are read from the source (nothing is imported): at module level and inside functions (a
lazy import is still a dependency); those under `if TYPE_CHECKING:` are annotations only and are
left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "resadapt_eval"

FLOORS = (
    # foundations: clocks and FLOP counting, run manifests, CAPO's rewards and losses, process groups,
    # the kept-token encoding of a record
    ("measure", "manifest", "capo", "guard", "kept"),
    # the paper's budget: token grids, plans, projection, scale policies, token budgets
    ("budget",),
    # reading videos; the baselines' algorithms; the Allocator model; a sweep cell's files
    ("video", "baselines", "allocator", "cells"),
    # FLOP and memory formulas; the engines (HF adapters, the vLLM engine, the hooks inside the LLM)
    ("compute", "backbones"),
    # method kinds; the tiny offline models
    ("kinds", "fixtures"),
    # the method registry
    ("methods",),
    # model_args resolved into a run spec
    ("runspec",),
    # the sidecar record; config-only rows
    ("record", "estimates"),
    # one request's flow
    ("pipeline",),
    # the front ends: lmms-eval model classes, the CAPO trainer
    ("lmms", "train"),
    # sweeps of lmms-eval runs, here and on a cluster
    ("sweep",),
    ("cluster",),
    # tables and plots from sweep folders
    ("report",),
    # commands built on all of the above
    ("needle", "profile"),
    ("tasks", "cli"),
)


def unit_of(module: str) -> str:
    """`resadapt_eval.backbones.qwen` -> `backbones`: the top-level package or module."""
    return module.split(".")[1]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path) -> list[tuple[str, int]]:
    """(imported module, line) of every import of the package in `path`, outside `if TYPE_CHECKING:`."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom):
                base = package[: len(package) - child.level + 1] if child.level else []
                target = ".".join(base + [child.module] if child.module else base) if child.level else child.module
                found.extend((f"{target}.{a.name}", child.lineno) for a in child.names)  # a name or a submodule
            elif isinstance(child, ast.Import):
                found.extend((a.name, child.lineno) for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return [(target, line) for target, line in found if target.split(".")[0] == root.name]


def import_graph(root: Path) -> dict[str, list[tuple[str, int]]]:
    """Module -> the package's modules it imports (with the line), for every module under `root`."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}

    def resolve(target: str) -> str | None:
        while target and target not in modules:  # `from pkg.mod import name`: the module, not the name
            target = target.rpartition(".")[0]
        return target or None

    return {
        name: sorted({(resolve(t), line) for t, line in imports_of(path, root) if resolve(t)})
        for name, path in modules.items()
    }


def floor_violations(root: Path, floors) -> list[str]:
    """Every import from the same floor or a higher one, and every unit without a floor."""
    floor = {unit: level for level, units in enumerate(floors) for unit in units}
    graph = import_graph(root)
    units = {unit_of(module) for module in graph if module != root.name}
    problems = [f"`{unit}` has no floor" for unit in sorted(units - set(floor))]
    for module, targets in graph.items():
        if module == root.name:
            continue
        source = unit_of(module)
        for target, line in targets:
            dest = unit_of(target) if target != root.name else None
            if dest is None or dest == source or source not in floor or dest not in floor:
                continue
            if floor[dest] == floor[source]:
                problems.append(f"{module}:{line} imports {target}: {dest} is on the floor of {source}")
            elif floor[dest] > floor[source]:
                problems.append(f"{module}:{line} imports {target}: {dest} is on a floor above {source}")
    return problems


def cycles(root: Path) -> list[list[str]]:
    """The import cycles between modules (strongly connected components of more than one module)."""
    graph = {m: sorted({t for t, _ in ts} - {m}) for m, ts in import_graph(root).items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                connect(w)
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
            connect(v)
    return found


def test_every_unit_has_one_floor_and_no_import_goes_up():
    units = [unit for floor in FLOORS for unit in floor]
    assert len(units) == len(set(units)), "a unit is on two floors"
    present = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    present.discard("__init__")
    assert set(units) == present, f"FLOORS names {sorted(set(units) - present)} that do not exist"
    graph = import_graph(PACKAGE)
    assert sum(len(t) for t in graph.values()) > 100  # the reader found the package's imports
    assert floor_violations(PACKAGE, FLOORS) == []


def test_the_package_has_no_import_cycle():
    assert len(import_graph(PACKAGE)) > 50
    assert cycles(PACKAGE) == []


def test_the_checks_catch_an_upward_import_a_neighbour_import_and_a_cycle(tmp_path):
    """The checker itself, on a small package with one of each fault."""
    root = tmp_path / "pkg"
    for folder in ("low", "high"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "low" / "a.py").write_text("from ..high import b\n")  # upward
    lazy_and_annotation = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..side import c\n\n"
    (root / "high" / "b.py").write_text(lazy_and_annotation + "def f():\n    from ..low import a\n")
    (root / "side.py").write_text("from .high.b import f\n")  # its own floor
    problems = floor_violations(root, (("low",), ("high", "side")))
    assert problems == [
        "pkg.low.a:1 imports pkg.high.b: high is on a floor above low",
        "pkg.side:1 imports pkg.high.b: high is on the floor of side",
    ]
    assert cycles(root) == [["pkg.high.b", "pkg.low.a"]]  # the lazy import closes it; TYPE_CHECKING's does not count
    assert floor_violations(root, (("low",),)) == ["`high` has no floor", "`side` has no floor"]
