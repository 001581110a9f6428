"""Each package states its public surface: ``__all__`` in every package and every name in it real.

A package's ``__all__`` names the names it re-exports or, for packages that import nothing on
purpose (the plugin path must stay light), its public modules. Every module of the library that
lists in ``__all__`` exactly its sorted public names. Without these, a reader cannot tell what a
package offers from what it happens to contain.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES: list[str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "packages"]
# Modules that import a dependency outside kvscope's extras on purpose (vLLM's connector API).
NEEDS_VLLM = {"kvscope.collector.vllm.connector"}


def _resolves(package: ModuleType, name: str) -> bool:
    if hasattr(package, name):
        return True
    try:
        importlib.import_module(f"{package.__name__}.{name}")
    except ModuleNotFoundError as exc:
        return exc.name != f"{package.__name__}.{name}"
    return True


@pytest.mark.parametrize("name", PACKAGES)
def test_every_package_states_its_surface(name: str) -> None:
    package = importlib.import_module(name)
    surface = getattr(package, "__all__", None)
    assert surface, f"{name}/__init__.py has no __all__"
    assert len(set(surface)) == len(surface), f"{name}.__all__ repeats a name"
    missing = [n for n in surface if not _resolves(package, n)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"


def _library_modules() -> list[str]:
    found: list[str] = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        found += [f"{name}.{info.name}" for info in pkgutil.iter_modules(package.__path__)
                  if not info.ispkg and info.name != "__main__"]
    return sorted(set(found) - NEEDS_VLLM)


def test_module_surfaces_name_only_what_they_define() -> None:
    wrong: dict[str, list[str]] = {}
    modules = _library_modules()
    assert len(modules) > 60  # the walk found the library, not an empty folder
    for name in modules:
        module = importlib.import_module(name)
        surface = getattr(module, "__all__", ())
        missing = [n for n in surface if not hasattr(module, n)]
        if missing:
            wrong[name] = missing
    assert not wrong, f"__all__ names undefined members: {wrong}"


def test_a_module_package_lists_each_public_module() -> None:
    """Packages whose surface is their modules list every public one (new modules included)."""
    unlisted: dict[str, list[str]] = {}
    for name in PACKAGES:
        package = importlib.import_module(name)
        surface = set(getattr(package, "__all__", ()))
        submodules = {info.name for info in pkgutil.iter_modules(package.__path__)
                      if not info.name.startswith("_")}
        if not surface & submodules:
            continue  # a package that re-exports names, not modules
        left = sorted(submodules - surface)
        if left:
            unlisted[name] = left
    assert not unlisted, f"public modules missing from their package's __all__: {unlisted}"


# --- every library module: __all__ is its sorted public names --------------------------------
# Read from the source (what the module defines at top level, not what it imports), as httpx's
# tests hold its surface to its names: a new public function or constant must be listed, a
# private one spelled with "_". A module's logger and its type variables are not its surface.
_NOT_SURFACE = {"logger"}


def _defined_names(tree: ast.Module) -> list[str]:
    names: set[str] = set()
    type_vars: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            targets = [el for t in node.targets
                       for el in (t.elts if isinstance(t, ast.Tuple) else [t])]
            found = {t.id for t in targets if isinstance(t, ast.Name)}
            names |= found
            call = node.value
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name | ast.Attribute) \
                    and (getattr(call.func, "id", None) or getattr(call.func, "attr", None)) \
                    in ("TypeVar", "ParamSpec"):
                type_vars |= found
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return sorted(n for n in names - type_vars - {"__all__"}
                  if not n.startswith("_") and n not in _NOT_SURFACE)


def _module_files() -> list[Path]:
    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"].values()
    return sorted(path for root in set(roots) for path in (ROOT / root).rglob("*.py")
                  if path.name not in ("__init__.py", "__main__.py")
                  and not any(part.startswith("_") for part in
                              path.relative_to(ROOT / root).with_suffix("").parts))


def test_every_module_lists_its_sorted_public_names() -> None:
    files = _module_files()
    assert len(files) > 90  # the walk found the library, not an empty folder
    wrong: dict[str, str] = {}
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        declared = [node for node in tree.body if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
        want = _defined_names(tree)
        have = ast.literal_eval(declared[-1].value) if declared else None
        if have != want:
            wrong[str(path.relative_to(ROOT))] = f"__all__ = {want!r}"
    assert not wrong, "modules whose __all__ is not their sorted public names:\n" + "\n".join(
        f"  {name}: {line}" for name, line in wrong.items())
