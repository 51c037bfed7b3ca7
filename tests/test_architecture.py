"""The layout's rules (ARCHITECTURE.md), checked on the source: no import circle under
``harness/``, nothing under ``harness/`` importing ``suites``, ``specs`` free of torch, and no
module over 600 lines.

Every import counts, a function's lazy import too: a circle that only closes at run time is
still a circle a reader has to untangle. ``from package import name`` is an edge to the
module ``package.name`` where that is a module, else to ``package``; a module's parent
packages are not edges of their own.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600
ENGINE = (
    "harness.cli",
    "harness.session",
    "harness.config",
    "harness.plugin",
    "harness.mutation",
    "harness.report",
    "harness.bench",
    "harness.forked",
    "harness.outcome.junit",
    "harness.outcome.review",
)
BELOW_THE_ENGINE = (
    "harness.parity",
    "harness.outcome.results",
    "harness.outcome.outputs",
    "harness.outcome.verdict",
    "harness.catalogue",
    "harness.outcome.expectations",
    "harness.outcome.triage",
    "harness.outcome.noise",
    "harness.profiles",
    "harness.faults",
)
LAYERS = {
    # part: prefixes of distconf modules it must not import
    "harness.errors": ("harness", "specs", "suites"),
    "specs": ("harness", "suites"),
    "harness.cases": (*ENGINE, "harness.strategies", "harness.runners", "harness.torchkit"),
    "harness.torchkit": (*ENGINE, "harness.strategies", "harness.runners"),
    "harness.runners": (*ENGINE, "harness.strategies"),
    "harness.strategies": (*ENGINE, "harness.runners"),
    **{part: ENGINE for part in BELOW_THE_ENGINE},
    # the suites see Worlds through the public face (harness.World), never a runner
    "suites": ("harness.runners", "harness.plugin", *ENGINE[:3], "harness.mutation"),
}
ALLOWED = {"specs": ("harness.errors",)}


def modules(*packages: str) -> dict[str, Path]:
    """Every module of ``packages`` (dotted name -> file), packages by their ``__init__``."""
    found = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    return [f"{base}.{alias.name}" for alias in node.names] or [base]


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The deepest known module ``name`` refers to (``pkg.mod.func`` -> ``pkg.mod``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``known`` it imports (anywhere in its body)."""
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for name in _imported(node, module, path.name == "__init__.py"):
                    target = _resolve(name, known)
                    if target is not None and target != module:
                        targets.add(target)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def graph_figures(*packages: str) -> dict[str, int]:
    """Modules, edges and circles of the import graph of ``packages`` (for the record)."""
    graph = import_graph(modules(*packages))
    edges = sum(len(targets) for targets in graph.values())
    return {"modules": len(graph), "edges": edges, "circles": len(circles(graph))}


def test_no_import_circle_under_harness() -> None:
    graph = import_graph(modules("harness"))
    assert len(graph) > 50, f"found only {len(graph)} modules under harness/: wrong root?"
    assert circles(graph) == [], "import circles under harness/ (each a set of modules)"


def test_harness_never_imports_suites() -> None:
    known = modules("harness", "suites")
    graph = import_graph(known)
    upward = {
        module: sorted(t for t in targets if t.split(".")[0] == "suites")
        for module, targets in graph.items()
        if module.split(".")[0] == "harness"
    }
    assert {m: t for m, t in upward.items() if t} == {}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_each_part_imports_only_what_lies_below_it() -> None:
    graph = import_graph(modules("harness", "specs", "suites"))
    wrong = {}
    for module, targets in graph.items():
        for part, forbidden in LAYERS.items():
            if not _within(module, part):
                continue
            allowed = ALLOWED.get(part, ())
            bad = sorted(
                t
                for t in targets
                if any(_within(t, f) for f in forbidden) and not any(_within(t, a) for a in allowed)
            )
            if bad:
                wrong[module] = bad
    assert wrong == {}


def _imports_of(module: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in _imported(node, module, path.name == "__init__.py")
    ]


def test_cases_never_import_torch() -> None:
    found = {
        module: names
        for module, path in modules("harness").items()
        if _within(module, "harness.cases")
        and (names := sorted(n for n in _imports_of(module, path) if _within(n, "torch")))
    }
    assert found == {}


def test_one_module_per_purpose_touches_torch_testing_internal() -> None:
    """The threaded process group and the OpInfo database, each behind one module."""
    found = {
        module
        for module, path in modules("harness", "suites", "specs").items()
        if any(_within(n, "torch.testing._internal") for n in _imports_of(module, path))
    }
    assert found == {"harness.runners._threaded_pg", "harness.torchkit.op_db"}


@pytest.mark.parametrize(
    ("statement", "absent"),
    [
        # specs stand alone: the errors they raise come without the harness behind them
        ("import specs.placements, specs.modules, specs.chunking", ("torch", "pytest")),
        ("import harness, harness.plugin, harness.cli", ("torch",)),
    ],
)
def test_light_imports_stay_light(statement: str, absent: tuple[str, ...]) -> None:
    code = f"import sys; {statement}; print([m for m in {absent!r} if m in sys.modules])"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", f"{statement} loaded {done.stdout.strip()}"


def test_specs_never_import_torch() -> None:
    offenders = {}
    for module, path in modules("specs").items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = [
            name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for name in _imported(node, module, path.name == "__init__.py")
        ]
        torch = sorted({n for n in names if n.split(".")[0] == "torch"})
        if torch:
            offenders[module] = torch
    assert offenders == {}


@pytest.mark.parametrize("package", ["harness", "specs", "suites", "tests"])
def test_no_module_over_the_line_limit(package: str) -> None:
    lengths = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for path in modules(package).values()
    }
    assert lengths, f"no modules found under {package}/"
    assert {p: n for p, n in lengths.items() if n > MAX_LINES} == {}


def test_the_graph_check_sees_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    """The checks above can fail: a planted circle and a planted upward import are found."""
    for name, text in {
        "a.py": "from pkg import b\n",
        "b.py": "def f():\n    from pkg.c import g\n",
        "c.py": "import pkg.a\n",
        "__init__.py": "",
    }.items():
        (tmp_path / "pkg").mkdir(exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    known = {
        f"pkg.{p.stem}" if p.stem != "__init__" else "pkg": p
        for p in (tmp_path / "pkg").glob("*.py")
    }
    assert circles(import_graph(known)) == [["pkg.a", "pkg.b", "pkg.c"]]
