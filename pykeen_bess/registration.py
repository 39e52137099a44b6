"""Registration of the plugin in PyKEEN's class resolvers.

PyKEEN's resolvers (``training_loop_resolver``, ``evaluator_resolver``, ``interaction_resolver``,
``model_resolver``) are snapshots of PyKEEN's own subclasses taken when PyKEEN is imported; a
plugin's classes must be registered explicitly. :func:`register` does so idempotently and also
loads the entry-point groups ``pykeen.training_loops``, ``pykeen.evaluators``,
``pykeen.interactions`` and ``pykeen.models`` of every installed distribution (this package
declares its classes there).

PyKEEN itself only reads the ``pykeen.datasets`` group. This package's entry point in that group
(:mod:`pykeen_bess.autoload`) installs a post-import hook that calls :func:`register` as soon as
PyKEEN's resolvers have finished loading, so ``pipeline(training_loop="bess")``,
``pipeline_from_config``, ``hpo_pipeline`` and the ``pykeen`` command line find the plugin without
``import pykeen_bess``. Registration must never import a PyKEEN module that is still being
initialised (that is a circular import), so it waits until none is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = [
    "register",
    "register_when_ready",
    "is_registered",
    "ENTRY_POINT_GROUPS",
]

logger = logging.getLogger(__name__)

#: entry-point group -> (module, resolver attribute) of the PyKEEN resolver it feeds
ENTRY_POINT_GROUPS: dict[str, tuple[str, str]] = {
    "pykeen.training_loops": ("pykeen.training", "training_loop_resolver"),
    "pykeen.evaluators": ("pykeen.evaluation", "evaluator_resolver"),
    "pykeen.interactions": ("pykeen.nn.modules", "interaction_resolver"),
    "pykeen.models": ("pykeen.models", "model_resolver"),
}

#: PyKEEN modules that must be fully initialised before registering
REQUIRED_MODULES: tuple[str, ...] = tuple(sorted({module for module, _ in ENTRY_POINT_GROUPS.values()}))

_lock = threading.RLock()
_registered = False
_registering = False


def _plugin_classes() -> dict[str, Sequence[type]]:
    """The plugin's own classes per entry-point group (imported lazily)."""
    from .training import BessTrainingLoop

    result: dict[str, Sequence[type]] = {"pykeen.training_loops": [BessTrainingLoop]}
    try:  # TEMPORARY while the evaluator and interactions are being written
        from .evaluation import BessEvaluator

        result["pykeen.evaluators"] = [BessEvaluator]
    except ImportError:
        pass
    try:
        from .interactions import InterHTInteraction, TranSInteraction
        from .models import InterHT, TranS

        result["pykeen.interactions"] = [InterHTInteraction, TranSInteraction]
        result["pykeen.models"] = [InterHT, TranS]
    except ImportError:
        pass
    return result


def _resolver(group: str) -> Any:
    module_name, attribute = ENTRY_POINT_GROUPS[group]
    return getattr(importlib.import_module(module_name), attribute)


def _register_class(resolver: Any, cls: type) -> None:
    """Register ``cls`` unless it already is; a different class under the same key is an error."""
    key = resolver.normalize_cls(cls)
    existing = resolver.lookup_dict.get(key)
    if existing is cls:
        return
    if existing is not None and existing.__module__ == cls.__module__ and existing.__qualname__ == cls.__qualname__:
        # the same class from a re-imported module (e.g. importlib.reload): keep the newest
        resolver.lookup_dict[key] = cls
        return
    resolver.register(cls)


def register() -> None:
    """Register the plugin's training loop, evaluator, interactions and models (idempotent).

    :raises class_resolver.RegistrationNameConflict: if another class is registered under one
        of the plugin's keys (``bess``, ``interht``, ``trans``)
    """
    global _registered, _registering
    with _lock:
        if _registered or _registering:
            return
        _registering = True
        try:
            for group, classes in _plugin_classes().items():
                resolver = _resolver(group)
                # other plugins' entry points, and ours when the package is installed
                resolver.register_entrypoint(group)
                for cls in classes:
                    _register_class(resolver, cls)
            _registered = True
        finally:
            _registering = False
        logger.debug("registered pykeen-bess in PyKEEN's resolvers")


def is_registered() -> bool:
    """Return whether :func:`register` has run."""
    return _registered


def _initializing(name: str, finished: str | None = None) -> bool:
    """Whether a module is being imported right now (``finished`` has just completed)."""
    if name == finished:
        return False
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and bool(getattr(spec, "_initializing", False))


def _pykeen_idle(finished: str | None = None) -> bool:
    """Whether no PyKEEN module is mid-import (importing PyKEEN now would not be circular)."""
    return not any(
        _initializing(name, finished) for name in list(sys.modules) if name == "pykeen" or name.startswith("pykeen.")
    )


def _ready(finished: str | None = None) -> bool:
    """Whether registering now is safe: PyKEEN's resolvers exist and no PyKEEN module is mid-import."""
    if any(name not in sys.modules or _initializing(name, finished) for name in REQUIRED_MODULES):
        return False
    return _pykeen_idle(finished)


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Calls :func:`register` after a watched PyKEEN module has finished executing."""

    def __init__(self) -> None:
        self._finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:  # noqa: D102
        if not (fullname == "pykeen" or fullname.startswith("pykeen.")) or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        finally:
            self._finding.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _NotifyingLoader(spec.loader)
        return spec


class _NotifyingLoader(importlib.abc.Loader):
    """Delegates to a loader and tries to register once the module has executed."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:  # noqa: D102
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:  # noqa: D102
        self._loader.exec_module(module)
        _try_register(finished=module.__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


_hook: _PostImportHook | None = None


def _remove_hook() -> None:
    global _hook
    if _hook is not None and _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
    _hook = None


def _try_register(finished: str | None = None) -> None:
    if _registered:
        _remove_hook()
        return
    if _registering:
        # PyKEEN is being imported by register() itself; it finishes the job
        return
    if not _ready(finished):
        return
    try:
        register()
    except Exception:  # noqa: BLE001 - an import hook must never break the user's import
        logger.warning("pykeen-bess could not register itself in PyKEEN's resolvers", exc_info=True)
    finally:
        if _registered:
            _remove_hook()


def register_when_ready() -> None:
    """Register now if PyKEEN can be imported safely, else as soon as it has finished loading."""
    global _hook
    if _registered:
        return
    if _pykeen_idle():
        register()
        return
    if _hook is None:
        _hook = _PostImportHook()
        sys.meta_path.insert(0, _hook)
