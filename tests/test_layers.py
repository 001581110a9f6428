"""Imports go down the layers only: core < collector < emulator; core < analysis < dashboards < cli.

Every ``import`` in kvscope's packages is read from the source (lazy imports inside functions
included). A module may import its own package and the layers below it; ``analysis`` never
imports the emulator or the collector (it reads spans, and the reuse rules from core).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"kvscope": "kvscope", "collector": "kvscope.collector", "analysis": "kvscope.analysis",
           "dashboards": "kvscope.dashboards", "emulator": "kvscope.emulator"}

CORE, COLLECTOR, EMULATOR, ANALYSIS, DASHBOARDS, CLI = (
    "core", "collector", "emulator", "analysis", "dashboards", "cli")
# What each layer may import besides itself.
ALLOWED: dict[str, set[str]] = {
    CORE: set(),
    COLLECTOR: {CORE},
    EMULATOR: {CORE, COLLECTOR},
    ANALYSIS: {CORE},
    DASHBOARDS: {CORE, ANALYSIS},
    CLI: {CORE, COLLECTOR, EMULATOR, ANALYSIS, DASHBOARDS},
}
# Known exceptions, each with the issue that removes it (a new one fails the test). None left.
EXCEPTIONS: set[tuple[str, str]] = set()


def layer(module: str) -> str | None:
    """The layer of a kvscope module name, or None for anything outside kvscope."""
    parts = module.split(".")
    if parts[0] != "kvscope":
        return None
    if len(parts) == 1:
        return CORE
    second = parts[1]
    if second in (COLLECTOR, EMULATOR, ANALYSIS, DASHBOARDS):
        return second
    if second in ("cli", "__main__"):
        return CLI
    return CORE


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    dotted = ".".join((FOLDERS[rel.parts[0]], *rel.parts[1:]))[: -len(".py")]
    return dotted.removesuffix(".__init__")


def _base(node: ast.ImportFrom, package: str) -> str:
    """The module an ``from ... import`` names, relative imports resolved from ``package``."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base]) if base else ".".join(anchor)
    return base


def _package(path: Path, module: str) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imports(path: Path, module: str) -> set[str]:
    """Every kvscope module ``path`` imports (absolute and relative, at any depth)."""
    found = set()
    package = _package(path, module)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("kvscope")}


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def violations() -> list[str]:
    found = []
    for path in sources():
        module = module_name(path)
        own = layer(module)
        assert own is not None
        for target in sorted(imports(path, module)):
            other = layer(target)
            if other is None or other == own or other in ALLOWED[own]:
                continue
            if any(module == a and target.startswith(b) for a, b in EXCEPTIONS):
                continue
            found.append(f"{module} ({own}) imports {target} ({other})")
    return found


def test_no_module_imports_a_higher_layer() -> None:
    assert violations() == []


@pytest.mark.parametrize(("module", "expected"), [
    ("kvscope.reuse.params", CORE), ("kvscope.store.writer", CORE), ("kvscope.cli", CLI),
    ("kvscope.cli.demo", CLI), ("kvscope.collector.proxy.app", COLLECTOR),
    ("kvscope.analysis.ledger", ANALYSIS), ("opentelemetry.trace", None),
])
def test_layer_of_a_module(module: str, expected: str | None) -> None:
    assert layer(module) == expected


def test_the_check_sees_a_lazy_upward_import(tmp_path: Path) -> None:
    """The scan reads imports inside functions (the kind that dodged cycles before)."""
    text = "def f():\n    from kvscope.emulator import reuse_model\n"
    fake = tmp_path / "ledger.py"
    fake.write_text(text, encoding="utf-8")
    assert "kvscope.emulator.reuse_model" in imports(fake, "kvscope.analysis.ledger")


def test_every_reuse_rule_name_is_defined_once() -> None:
    """The params keys, the expiry margin and the outcome labels are assigned in one module."""
    names = ("D_TO_P_REQUIRED_KEYS", "PARAMS_FIELDS", "KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S",
             "MISS_PARAMS", "REUSED_INVALID", "PREFIX_DIVERGED", "OUTCOMES")
    homes: dict[str, list[str]] = {name: [] for name in names}
    for path in sources():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            for target in targets:
                if isinstance(target, ast.Name) and target.id in homes:
                    homes[target.id].append(module_name(path))
    assert {name: where for name, where in homes.items() if len(where) != 1} == {}
    assert all(where[0].startswith("kvscope.reuse.") for where in homes.values())


def test_no_module_spells_an_outcome_label() -> None:
    """Outcome labels are written in kvscope/reuse/outcomes.py only (a label that is also a
    semconv value, such as the decision ``below_threshold``, is that value there)."""
    from kvscope import semconv
    from kvscope.reuse import outcomes

    shared = {v for k, v in vars(semconv).items() if k.isupper() and isinstance(v, str)}
    labels = set(outcomes.OUTCOMES) - shared - {"unknown"}  # also a history state, a word
    home = ROOT / "kvscope" / "reuse" / "outcomes.py"
    found = [f"{module_name(path)}:{node.lineno}: {node.value!r}"
             for path in sources() if path != home
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Constant) and node.value in labels]
    assert found == []


# Library modules that still hold a command's argument building or entry point (issue #21 moves
# them into kvscope/cli; a new one fails the test).
ENTRY_POINTS_LEFT: set[str] = set()


def entry_points() -> set[str]:
    """Library modules (outside kvscope.cli) that build arguments or define an entry point."""
    found = set()
    for path in sources():
        module = module_name(path)
        if module.startswith("kvscope.cli"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            named_main = isinstance(node, ast.FunctionDef) and (
                node.name == "main" or node.name.startswith("main_")
                or node.name.endswith("_arguments") or node.name == "build_parser")
            guard = isinstance(node, ast.If) and ast.unparse(node.test) in (
                "__name__ == '__main__'", "'__main__' == __name__")
            argparse_import = isinstance(node, ast.Import | ast.ImportFrom) and "argparse" in (
                [a.name for a in node.names] + [getattr(node, "module", None) or ""])
            if named_main or guard or argparse_import:
                found.add(module)
    return found


def test_no_library_module_defines_a_command() -> None:
    assert entry_points() <= ENTRY_POINTS_LEFT, sorted(entry_points() - ENTRY_POINTS_LEFT)
    assert ENTRY_POINTS_LEFT <= entry_points(), "moved: drop from ENTRY_POINTS_LEFT " + str(
        sorted(ENTRY_POINTS_LEFT - entry_points()))


def runtime_imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The kvscope modules of ``known`` that importing ``path`` may import (lazy imports in
    functions included, ``if TYPE_CHECKING:`` blocks not). ``from package import module`` is an
    edge to the module alone: a package's ``__init__`` facade loads its names lazily."""
    package = _package(path, module)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, package)
            submodules = {f"{base}.{a.name}" for a in node.names} & known
            found |= submodules
            if len(submodules) < len(node.names):
                found.add(base)
    return (found & known) - {module}


def import_cycles() -> list[list[str]]:
    """Every import cycle among kvscope's modules, each as the path that closes it."""
    paths = {module_name(p): p for p in sources()}
    graph = {m: runtime_imports(p, m, set(paths)) for m, p in paths.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    """No import cycle (the store's reader and its ClickHouse reader imported each other)."""
    assert import_cycles() == []


def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    a = tmp_path / "a.py"
    a.write_text("from kvscope.store import b\n", encoding="utf-8")
    b = tmp_path / "b.py"
    b.write_text("def f():\n    from kvscope.store.a import x\n", encoding="utf-8")
    known = {"kvscope.store.a", "kvscope.store.b"}
    assert runtime_imports(a, "kvscope.store.a", known) == {"kvscope.store.b"}
    assert runtime_imports(b, "kvscope.store.b", known) == {"kvscope.store.a"}
