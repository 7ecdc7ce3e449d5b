"""The package's layering, read from its source: imports point one way, and only the seam imports deepmd.

The order is the README's layout list; a module may import its own layer and the layers
above it. Imports inside functions count too: they are arrows all the same. Imports for type
annotations only (``if TYPE_CHECKING:``) do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "deepmd_hybridmuon"

#: Top to bottom, as README.md lists them.
LAYERS = [
    "functional",
    "options",
    "validation",
    "dtensor",
    "state",
    "step",
    "loop",
    "kernels",
    "engine",
    "distributed",
    "optimizer",
    "schema",
    "plugin",
    "cli",
    "hooks",
    "__init__",
    "__main__",
]
#: Inside a layer that is a package, its modules in the README's order (``__init__`` gathers them).
SUBLAYERS = {
    "engine": ["compilation", "layout", "batched", "execution", "group", "__init__"],
    "distributed": ["plan", "local", "fsdp", "__init__"],
}
#: The back arrow the README names: ``dp check`` is added to ``dp`` by the plugin, and runs the CLI.
ALLOWED_BACK_ARROWS = {("plugin", "cli")}
#: The modules that may import deepmd (inside functions only).
DEEPMD_SEAM = {"plugin", "cli"}


def _layer_of(path: Path) -> str:
    part = path.relative_to(PACKAGE).parts[0]
    return part.removesuffix(".py")


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level)`` of every import in ``path``, package-relative or absolute."""
    tree = ast.parse(path.read_text())
    package_parts = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    top_level = {id(node) for node in tree.body}
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for child in node.body
        for inner in ast.walk(child)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
                if node.module is None:  # from . import a, b
                    found += [(f"{module}.{alias.name}", node.lineno, id(node) in top_level) for alias in node.names]
                    continue
            else:
                module = node.module or ""
                if module == "deepmd_hybridmuon":  # from deepmd_hybridmuon import optimizer, ...
                    found += [(f"{module}.{alias.name}", node.lineno, id(node) in top_level) for alias in node.names]
                    continue
            found.append((module, node.lineno, id(node) in top_level))
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    assert {_layer_of(p) for p in SOURCES} <= set(LAYERS)
    for package, order in SUBLAYERS.items():
        assert {p.stem for p in (PACKAGE / package).glob("*.py")} == set(order), package


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_one_way(path: Path):
    layer = _layer_of(path)
    for module, line, _ in _imports(path):
        parts = module.split(".")
        if parts[0] != "deepmd_hybridmuon" or module == "deepmd_hybridmuon.__version__":
            continue  # the version string (package metadata) may be read anywhere
        # a module of the package, or a name its __init__ defines (``import deepmd_hybridmuon`` too)
        target = parts[1] if len(parts) > 1 and parts[1] in LAYERS else "__init__"
        arrow_is_back = LAYERS.index(target) > LAYERS.index(layer)
        assert not arrow_is_back or (layer, target) in ALLOWED_BACK_ARROWS, (
            f"{path.relative_to(PACKAGE)}:{line} ({layer}) imports {module} ({target}), a layer below it"
        )
        if target == layer and layer in SUBLAYERS and len(parts) > 2:  # within engine/ or distributed/
            order = SUBLAYERS[layer]
            assert order.index(parts[2]) <= order.index(path.stem), (
                f"{path.relative_to(PACKAGE)}:{line} imports {module}, listed below {path.stem} in the README"
            )


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_seam_imports_deepmd_and_only_inside_functions(path: Path):
    for module, line, module_level in _imports(path):
        if module.split(".")[0] != "deepmd":
            continue
        where = f"{path.relative_to(PACKAGE)}:{line} imports {module}"
        assert _layer_of(path) in DEEPMD_SEAM, where
        assert not module_level, where + " at import time"
