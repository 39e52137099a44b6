"""The package's layout: one topology owns torch.distributed, modules and classes stay small, stages are documented,
the import graph has no cycles and the process layer imports nothing else of the package."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).parent.parent / "pykeen_bess"
MODULES = sorted(PACKAGE.rglob("*.py"))
#: the process topology: the only modules that may use torch.distributed
TOPOLOGY = {PACKAGE / "distributed" / name for name in ("topology.py", "process_group.py", "launch.py", "factory.py")}
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


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[ast.AST]:
    """The statements under ``if TYPE_CHECKING:`` (they never run)."""
    nodes: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                nodes.update(ast.walk(statement))
    return nodes


def _import_graph(type_checking: bool = True) -> dict[str, set[str]]:
    """Every module's imports of the package's modules: module level and in functions; for type checking if asked."""
    modules = {_module_name(path): path for path in MODULES}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = set() if type_checking else _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if node in skipped:
                continue
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                candidates = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for candidate in candidates:
                while candidate and candidate not in modules:  # a name imported from a module: the module
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != name:
                    targets.add(candidate)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

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
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_import_graph_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _import_graph()
    assert "pykeen_bess.training.loop" in graph["pykeen_bess.training"]
    assert "pykeen_bess.storage.base" in graph["pykeen_bess.storage.device"]
    checkpointed, config = "pykeen_bess.training.checkpoints.checkpointed", "pykeen_bess.training.setup.config"
    assert config in graph[checkpointed]  # an annotation's import (under TYPE_CHECKING) counts
    assert config not in _import_graph(type_checking=False)[checkpointed]


def test_the_package_has_no_import_cycles() -> None:
    """No cycles of imports, counting those of annotations (TYPE_CHECKING): the type graph has no circles either."""
    assert _cycles(_import_graph()) == []


def test_the_process_layer_imports_nothing_else_of_the_package() -> None:
    outside = {
        (name, target)
        for name, targets in _import_graph().items()
        if name.startswith("pykeen_bess.distributed")
        for target in targets
        if not target.startswith("pykeen_bess.distributed")
    }
    assert outside == set()


def test_former_module_names_import_the_moved_modules() -> None:
    """Code and pickled models of earlier versions name modules that moved into the layers' folders."""
    import importlib
    import pickle

    import pykeen_bess
    from pykeen_bess.tables.representation import ShardedEmbedding

    for old, new in pykeen_bess._MOVED_MODULES.items():
        assert importlib.import_module(old) is importlib.import_module(new)
    data = pickle.dumps(ShardedEmbedding, protocol=2)
    old = data.replace(b"pykeen_bess.tables.representation\n", b"pykeen_bess.representation\n")
    assert old != data and pickle.loads(old) is ShardedEmbedding
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pykeen_bess.no_such_module")
    # names that moved out of a module stay importable from it
    from pykeen_bess.training.config import UnsupportedModelError, check_model  # noqa: F401
    from pykeen_bess.training.setup import config, models

    assert all(getattr(config, name) is getattr(models, name) for name in config._MOVED_TO_MODELS)
    with pytest.raises(ImportError):
        from pykeen_bess.training.setup.config import no_such_name  # noqa: F401


def test_the_epochs_and_steps_see_the_loop_through_what_they_use() -> None:
    """The epochs are typed against :class:`EpochLoop`; steps and the run's start take explicit parts."""
    graph = _import_graph()
    loop_modules = {"pykeen_bess.training.loop", "pykeen_bess.training.parts", "pykeen_bess.training.hooks"}
    users = {
        name
        for name in graph
        if name.startswith(("pykeen_bess.training.steps", "pykeen_bess.training.epoch"))
        or name == "pykeen_bess.training.training_run"
    }
    assert {"pykeen_bess.training.epochs", "pykeen_bess.training.epoch_steps"} <= users
    assert {(name, target) for name in users for target in graph[name] & loop_modules} == set()
    from pykeen_bess.training.epochs import EpochLoop

    members = {name for name in vars(EpochLoop) if not name.startswith(("__", "_abc", "_is_"))}
    members |= set(EpochLoop.__annotations__)
    assert len(members) <= 13, sorted(members)


#: the loop's own modules: BessTrainingLoop and the classes it is made of
LOOP_MODULES = {PACKAGE / "training" / name for name in ("loop.py", "parts.py", "hooks.py")}
LOOP_NAMES = {"loop", "training_loop"}


def _assigns_loop_attributes(tree: ast.AST) -> list[str]:
    """Assignments (and augmented ones) to an attribute of a name ``loop`` / ``training_loop`` (or ``self.loop``)."""
    found = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign | ast.AnnAssign)
            else []
        )
        for target in targets:
            if not isinstance(target, ast.Attribute):
                continue
            owner = target.value
            if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self":
                owner = ast.Name(id=owner.attr)
            if isinstance(owner, ast.Name) and owner.id in LOOP_NAMES:
                found.append(f"line {target.lineno}: {owner.id}.{target.attr}")
    return found


def test_the_loop_check_sees_assignments() -> None:
    tree = ast.parse("loop.optimizer = 1\nself.training_loop._epoch += 1\nloop.model.train()\nx = loop.tables")
    assert _assigns_loop_attributes(tree) == ["line 1: loop.optimizer", "line 2: training_loop._epoch"]


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_nothing_outside_the_loop_assigns_its_attributes(path: pathlib.Path) -> None:
    """The epochs, steps, set-up and checkpoints ask the loop to change (its methods); they never assign to it."""
    if path in LOOP_MODULES:
        return
    assert _assigns_loop_attributes(ast.parse(path.read_text(encoding="utf-8"))) == []
