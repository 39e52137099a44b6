"""The package's layout: one topology owns torch.distributed, modules and classes stay small, stages are documented."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).parent.parent / "pykeen_bess"
MODULES = sorted(PACKAGE.rglob("*.py"))
#: the process topology: the only modules that may use torch.distributed
TOPOLOGY = {PACKAGE / "distributed" / name for name in ("topology.py", "process_group.py", "launch.py")}
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300


def _imports_torch_distributed(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("torch.distributed"):
                return True
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                return True
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "torch" and node.attr == "distributed":
                return True
    return False


def test_the_package_has_modules() -> None:
    assert len(MODULES) > 20


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_only_the_topology_uses_torch_distributed(path: pathlib.Path) -> None:
    uses = _imports_torch_distributed(ast.parse(path.read_text(encoding="utf-8")))
    assert uses == (path in TOPOLOGY) or (not uses), f"{path} uses torch.distributed outside the process topology"


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_modules_and_classes_are_small(path: pathlib.Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_MODULE_LINES
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno + 1 <= MAX_CLASS_LINES, f"class {node.name} of {path}"


@pytest.mark.parametrize("package", sorted(p.parent for p in PACKAGE.rglob("__init__.py")), ids=str)
def test_every_subpackage_says_what_its_stage_does(package: pathlib.Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8")))
    assert docstring and len(docstring) > 80
