"""Loads pykeen-bess into PyKEEN without ``import pykeen_bess`` (target of a ``pykeen.datasets`` entry point).

PyKEEN reads only the ``pykeen.datasets`` entry-point group, while ``pykeen.datasets`` is being
imported, i.e. in the middle of PyKEEN's own import: importing the plugin's training loop from
here would be a circular import. This small top-level module (deliberately outside the
``pykeen_bess`` package, so that loading it does not run the package's ``__init__``) installs a
post-import hook instead: once the modules holding PyKEEN's resolvers (``pykeen.training``,
``pykeen.evaluation``, ``pykeen.nn.modules``, ``pykeen.models``) have finished loading, it imports
``pykeen_bess``, which registers itself.

The entry point names PyKEEN's own :class:`~pykeen.datasets.Nations` (already registered), so no
extra dataset appears in PyKEEN's dataset resolver.

Limitation: when ``pykeen.training`` is the *first* PyKEEN module imported, the hook is installed
in the middle of that import and no PyKEEN module finishes loading afterwards; then
``import pykeen_bess`` is needed (once) before looking up ``"bess"``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
from types import ModuleType
from typing import Any

__all__ = [
    "Nations",  # noqa: F822 - provided lazily by __getattr__
    "install_hook",
    "ready",
]

logger = logging.getLogger(__name__)

#: PyKEEN modules that hold the resolvers the plugin registers into
REQUIRED_MODULES: tuple[str, ...] = ("pykeen.evaluation", "pykeen.models", "pykeen.nn.modules", "pykeen.training")


def _initializing(name: str, finished: str | None = None) -> bool:
    """Whether a module is being imported right now (``finished`` has just completed)."""
    if name == finished:
        return False
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and bool(getattr(spec, "_initializing", False))


def pykeen_idle(finished: str | None = None) -> bool:
    """Whether no PyKEEN module is mid-import (so importing PyKEEN now is not circular)."""
    return not any(
        _initializing(name, finished) for name in list(sys.modules) if name == "pykeen" or name.startswith("pykeen.")
    )


def ready(finished: str | None = None) -> bool:
    """Whether the modules holding PyKEEN's resolvers have finished loading.

    Another PyKEEN module (e.g. ``pykeen.pipeline``) may still be mid-import: the plugin only
    imports PyKEEN's core modules, which these have loaded completely.
    """
    return all(name in sys.modules and not _initializing(name, finished) for name in REQUIRED_MODULES)


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loaders of PyKEEN modules so that the plugin loads after one has executed."""

    def __init__(self) -> None:
        self._finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
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
    """Delegates to a loader and tries to load the plugin once the module has executed."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _try_load(finished=module.__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


_hook: _PostImportHook | None = None


def _remove_hook() -> None:
    global _hook
    if _hook is not None and _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
    _hook = None


def _try_load(finished: str | None = None) -> None:
    if not ready(finished):
        return
    plugin = sys.modules.get("pykeen_bess")
    if plugin is not None and getattr(getattr(plugin, "__spec__", None), "_initializing", False):
        return  # the package is being imported right now; its __init__ registers
    try:
        registration = importlib.import_module("pykeen_bess.registration")
        registration.register()
    except ImportError:
        # a module the plugin needs is itself mid-import; the next finished module retries
        logger.debug("pykeen-bess: loading deferred", exc_info=True)
        return
    except Exception:
        logger.warning("pykeen-bess could not register itself in PyKEEN's resolvers", exc_info=True)
    _remove_hook()


def install_hook() -> None:
    """Load the plugin now if PyKEEN's resolvers exist, else as soon as they do."""
    global _hook
    if ready():
        _try_load()
        return
    if _hook is None:
        _hook = _PostImportHook()
        sys.meta_path.insert(0, _hook)


def __getattr__(name: str) -> Any:
    # the entry point's target, imported lazily: this module must not import PyKEEN itself
    if name == "Nations":
        from pykeen.datasets.nations import Nations

        return Nations
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


install_hook()
