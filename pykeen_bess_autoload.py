"""Loads pykeen-bess into PyKEEN without ``import pykeen_bess`` (target of a ``pykeen.datasets`` entry point).

PyKEEN reads only the ``pykeen.datasets`` entry-point group, while ``pykeen.datasets`` is being
imported, i.e. in the middle of PyKEEN's own import: importing the plugin's training loop from
here would be a circular import. This small top-level module (deliberately outside the
``pykeen_bess`` package, so that loading it does not run the package's ``__init__``, and importing
nothing of PyKEEN) therefore arranges for the plugin to register itself later, in two ways:

1. **A post-import hook.** Once a PyKEEN module finishes loading while no other PyKEEN module is
   still mid-import, and at least one module holding a resolver the plugin feeds
   (``pykeen.training``, ``pykeen.evaluation``, ``pykeen.nn.modules``, ``pykeen.models``) is
   loaded, ``pykeen_bess`` is imported and registers itself.
2. **A lookup fallback.** The hook only sees PyKEEN modules whose import *starts* after it was
   installed; when the entry point runs inside the import of the outermost PyKEEN module (e.g.
   ``import pykeen.training`` as a program's first PyKEEN import), no module may finish loading
   afterwards (nor when the plugin is imported first: its own import of PyKEEN's modules cannot
   register it midway). So a failing string lookup in one of those resolvers
   (``training_loop_resolver.lookup("bess")``, also through ``make`` and ``pipeline()``, and PyKEEN's
   training loop making ``optimizer="rowwise_adagrad"`` through the torch optimizer resolver of
   ``class_resolver``, which ``pykeen.optimizers`` re-exports) registers the plugin and retries, once
   PyKEEN is not mid-import. The fallback removes itself as soon as
   the plugin is registered.

Together they make every lookup of the plugin's names work, whatever PyKEEN module a program
imports first (tested for every top-level PyKEEN module). What can still miss the plugin is code
that reads a resolver's ``lookup_dict`` or ``options`` directly, before any lookup, in the case of
2. (``import pykeen``, ``pykeen.training``, ``pykeen.pipeline``, ... as the first PyKEEN import; PyKEEN's
``pykeen ls`` reads them so); ``import pykeen_bess`` (once) makes it certain.

The entry point names PyKEEN's own :class:`~pykeen.datasets.Nations` (already registered), so no
extra dataset appears in PyKEEN's dataset resolver.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
from types import ModuleType
from typing import Any

__all__ = [
    "Nations",  # noqa: F822 - provided lazily by __getattr__
    "RESOLVERS",
    "RESOLVER_ALIASES",
    "install_hook",
    "pykeen_idle",
    "ready",
]

logger = logging.getLogger(__name__)

#: (module, attribute) of the PyKEEN resolvers the plugin registers into
RESOLVERS: tuple[tuple[str, str], ...] = (
    ("pykeen.training", "training_loop_resolver"),
    ("pykeen.evaluation", "evaluator_resolver"),
    ("pykeen.nn.modules", "interaction_resolver"),
    ("pykeen.models", "model_resolver"),
    ("pykeen.optimizers", "optimizer_resolver"),
    ("pykeen.losses", "loss_resolver"),
    ("pykeen.triples.weights", "loss_weighter_resolver"),
)
#: where else PyKEEN's code takes some of those resolvers from: its training loop makes optimizers with
#: ``class_resolver.contrib.torch.optimizer_resolver`` (the object ``pykeen.optimizers`` re-exports), so a
#: program may look the plugin's optimizer up before ``pykeen.optimizers`` is imported at all
RESOLVER_ALIASES: tuple[tuple[str, str], ...] = (("class_resolver.contrib.torch", "optimizer_resolver"),)
#: PyKEEN modules that hold the resolvers the plugin registers into
REQUIRED_MODULES: tuple[str, ...] = tuple(sorted({module for module, _ in RESOLVERS}))


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
    """Whether the plugin may register now: PyKEEN is not mid-import and one of its resolvers is loaded.

    Registering imports the remaining resolver modules, which is safe once no PyKEEN module is
    mid-import.
    """
    if not pykeen_idle(finished):
        return False
    return any(name in sys.modules for name in REQUIRED_MODULES)


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
_original_lookup: Any = None


def _remove_hooks() -> None:
    """Remove the post-import hook and the lookup fallback (the plugin is registered)."""
    global _hook, _original_lookup
    if _hook is not None and _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
    _hook = None
    if _original_lookup is not None:
        from class_resolver import ClassResolver

        ClassResolver.lookup = _original_lookup  # type: ignore[method-assign]
        _original_lookup = None


def _registered() -> bool:
    registration = sys.modules.get("pykeen_bess.registration")
    return registration is not None and bool(registration.is_registered())


def _try_load(finished: str | None = None) -> bool:
    """Register the plugin if it is safe now; return whether it is registered afterwards."""
    if _registered():
        _remove_hooks()
        return True
    if not ready(finished):
        return False
    plugin = sys.modules.get("pykeen_bess")
    if plugin is not None and getattr(getattr(plugin, "__spec__", None), "_initializing", False):
        return False  # the package is being imported right now; its __init__ registers
    try:
        registration = importlib.import_module("pykeen_bess.registration")
        registration.register()
    except ImportError:
        # a module the plugin needs is itself mid-import; the next finished module retries
        logger.debug("pykeen-bess: loading deferred", exc_info=True)
        return False
    except Exception:
        logger.warning("pykeen-bess could not register itself in PyKEEN's resolvers", exc_info=True)
    _remove_hooks()
    return _registered()


def _is_plugin_resolver(resolver: Any) -> bool:
    """Whether ``resolver`` is one of the PyKEEN resolvers the plugin registers into."""
    return any(
        getattr(sys.modules.get(module), attribute, None) is resolver
        for module, attribute in (*RESOLVERS, *RESOLVER_ALIASES)
    )


def _install_lookup_fallback() -> None:
    """Make a failing string lookup in one of PyKEEN's plugin resolvers register the plugin and retry."""
    global _original_lookup
    if _original_lookup is not None:
        return
    try:
        from class_resolver import ClassResolver
    except ImportError:  # pragma: no cover - PyKEEN depends on class_resolver
        return
    original: Any = ClassResolver.lookup

    @functools.wraps(original)
    def lookup(self: Any, query: Any, default: Any = None) -> Any:
        try:
            return original(self, query, default)
        except KeyError:
            if not isinstance(query, str) or not _is_plugin_resolver(self) or not _try_load():
                raise
        return original(self, query, default)

    _original_lookup = original
    ClassResolver.lookup = lookup  # type: ignore[method-assign]


def install_hook() -> None:
    """Load the plugin now if it is safe, else as soon as it is (see the module docstring)."""
    global _hook
    if _try_load():
        return
    _install_lookup_fallback()
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
