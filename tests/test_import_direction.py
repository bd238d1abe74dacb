"""Imports point one way: operations -> stages -> money -> common -> eagle3_resources, and no module cycle.

    eagle3_resources                   layer 0: wrappers and engines of external systems; imports no eagle3_assets
    eagle3_assets, eagle3_assets.common layer 1: plumbing shared by the stages
    eagle3_assets.money                layer 2: every dollar and every cap
    eagle3_assets.stages               layer 3: one folder per asset (a stage may import another stage)
    eagle3_assets.operations, .definitions  layer 4: the command, status, instance, sensors, the code location

Every module is parsed with `ast` and every import counts, also one inside a function (a lazy import still ties the
two modules: `status -> cli` closed the cycle `cli -> definitions -> quality -> status -> cli` that way). `from P import
n` is an import of `P.n` when that is a module, else of `P`. A package's `__init__` running before its submodules is
Python's own order and is not counted as an edge. A module of `eagle3_assets` outside the layers fails too, so a new
one has to be placed.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle3_resources", "eagle3_assets")
LAYERS = {  # longest matching prefix wins
    "eagle3_resources": (0, "eagle3_resources"),
    "eagle3_assets": (1, "common"),
    "eagle3_assets.common": (1, "common"),
    "eagle3_assets.money": (2, "money"),
    "eagle3_assets.stages": (3, "stages"),
    "eagle3_assets.operations": (4, "operations"),
    "eagle3_assets.definitions": (4, "operations"),
}


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Every module of the two packages under root: dotted name -> (file, is a package's __init__)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            is_pkg = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return found


def layer(module: str) -> tuple[int, str] | None:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    if best == "eagle3_assets" and module != "eagle3_assets":
        return None  # a module of eagle3_assets in no layer's folder
    return LAYERS[best] if best else None


def imports_of(module: str, path: Path, is_pkg: bool, known: dict) -> list[tuple[str, int]]:
    """(imported module of the two packages, line) for every import statement anywhere in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = module.split(".") if is_pkg else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES:
                out.append((name, node.lineno))
    return out


def problems(root: Path) -> dict[str, list[str]]:
    known = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in known}
    upward, unplaced, unknown = [], [], []
    for module, (path, is_pkg) in known.items():
        here = layer(module)
        if here is None:
            unplaced.append(f"{module} ({path.relative_to(root)}) is in no layer")
            continue
        for target, line in imports_of(module, path, is_pkg, known):
            if target not in known:
                unknown.append(f"{path.relative_to(root)}:{line} imports {target}, no module of the tree")
                continue
            graph[module].add(target)
            there = layer(target)
            if there is not None and there[0] > here[0]:
                upward.append(f"{path.relative_to(root)}:{line}: {module} ({here[1]}) imports {target} ({there[1]})")
    return {"upward": upward, "unplaced": unplaced, "unknown": unknown, "cycles": cycles(graph)}


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """One cycle per strongly connected component of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[str] = []

    def connect(v: str) -> None:  # Tarjan, iterative enough for this graph's depth
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(" -> ".join(one_cycle(graph, component)))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path back to the component's first module, through the component only."""
    start = min(component)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & component):
            if w == start:
                return [*path, start]
            if w not in seen:
                seen.add(w)
                paths.append([*path, w])
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_imports_point_one_way_and_close_no_cycle():
    found = problems(REPO)
    assert found == {"upward": [], "unplaced": [], "unknown": [], "cycles": []}


def test_the_checker_sees_every_module_of_both_packages():
    known = modules(REPO)
    assert {
        "eagle3_assets.definitions",
        "eagle3_assets.operations.cli",
        "eagle3_assets.money",
        "eagle3_assets.stages.completions.run",
        "eagle3_resources.storage",
    } <= set(known)
    assert all(layer(m) is not None for m in known)


def tree_copy(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def add_line(path: Path, after: str, line: str) -> None:
    text = path.read_text()
    assert after in text, f"{after!r} not in {path}"
    path.write_text(text.replace(after, after + line, 1))


def test_an_upward_import_inside_a_function_is_reported(tmp_path):
    """The checker itself, on a copy of the tree with one lazy import from money up to operations."""
    root = tree_copy(tmp_path)
    add_line(
        root / "eagle3_assets/money/__init__.py",
        "def open_ledger(layout: DataLayout) -> SpendLedger:\n",
        "    from eagle3_assets.operations.instance import dagster_home  # noqa: F401\n",
    )
    found = problems(root)
    assert len(found["upward"]) == 1
    assert "eagle3_assets.money (money) imports eagle3_assets.operations.instance (operations)" in found["upward"][0]
    assert found["cycles"] == []


def test_the_old_status_to_cli_cycle_is_reported(tmp_path):
    """status.py importing cli again (as it once did for `cli._ledger`) closes cli -> definitions -> quality -> status
    -> cli; the checker names that cycle."""
    root = tree_copy(tmp_path)
    add_line(
        root / "eagle3_assets/operations/status.py",
        "def status_command(as_json_output: bool = False) -> int:\n",
        "    from eagle3_assets.operations.cli import main  # noqa: F401\n",
    )
    found = problems(root)
    assert found["upward"] == []
    assert found["cycles"] == [
        "eagle3_assets.definitions -> eagle3_assets.operations.quality -> "
        "eagle3_assets.operations.status -> eagle3_assets.operations.cli -> eagle3_assets.definitions"
    ]


def test_resources_importing_eagle3_assets_is_upward(tmp_path):
    root = tree_copy(tmp_path)
    add_line(
        root / "eagle3_resources/storage.py",
        "from __future__ import annotations\n",
        "from eagle3_assets.common.registry import DATASETS  # noqa: F401\n",
    )
    assert [p.split(": ", 1)[1] for p in problems(root)["upward"]] == [
        "eagle3_resources.storage (eagle3_resources) imports eagle3_assets.common.registry (common)"
    ]
