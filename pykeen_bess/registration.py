"""Registration of the plugin in PyKEEN's class resolvers.

PyKEEN's resolvers (``training_loop_resolver``, ``evaluator_resolver``, ``interaction_resolver``,
``model_resolver``) are snapshots of PyKEEN's own subclasses taken when PyKEEN is imported; a
plugin's classes must be registered explicitly. :func:`register` does so idempotently and also
loads the entry-point groups ``pykeen.training_loops``, ``pykeen.evaluators``,
``pykeen.interactions`` and ``pykeen.models`` of every installed distribution (this package
declares its classes there).

PyKEEN itself only reads the ``pykeen.datasets`` group. This package's entry point in that group
(:mod:`pykeen_bess_autoload`) installs a post-import hook and a lookup fallback that register the
plugin as soon as it is safe, so ``pipeline(training_loop="bess")``, ``pipeline_from_config``,
``hpo_pipeline``, ``pykeen experiments run`` and any resolver lookup find the plugin without
``import pykeen_bess``, whatever PyKEEN module is imported first (see :mod:`pykeen_bess_autoload`).
``pykeen train`` does not: its options fix their choices (and its model commands) while ``pykeen.cli``
is being imported, before the plugin can register.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

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
    "pykeen.optimizers": ("pykeen.optimizers", "optimizer_resolver"),
    "pykeen.losses": ("pykeen.losses", "loss_resolver"),
    "pykeen.loss_weighters": ("pykeen.triples.weights", "loss_weighter_resolver"),
}

_lock = threading.RLock()
_registered = False
_registering = False


def _plugin_classes() -> dict[str, Sequence[type]]:
    """Return the plugin's own classes per entry-point group (imported lazily)."""
    from .evaluation import BessEvaluator
    from .nn.interactions import InterHTInteraction, TranSInteraction
    from .nn.loss import SubsamplingLossWeighter, WeightedNSSALoss
    from .nn.models import InterHT, TranS
    from .tables.optim import RowwiseAdagrad
    from .training import BessTrainingLoop

    return {
        "pykeen.training_loops": [BessTrainingLoop],
        "pykeen.evaluators": [BessEvaluator],
        "pykeen.interactions": [InterHTInteraction, TranSInteraction],
        "pykeen.models": [InterHT, TranS],
        "pykeen.optimizers": [RowwiseAdagrad],
        "pykeen.losses": [WeightedNSSALoss],
        "pykeen.loss_weighters": [SubsamplingLossWeighter],
    }


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


def _register_hpo_defaults() -> None:
    """Give ``hpo_pipeline`` the plugin optimizer's default search space: Adagrad's (the learning rate).

    PyKEEN keeps its optimizers' spaces in a table of its own (``optimizers_hpo_defaults``), which ``hpo_pipeline``
    reads for any optimizer it is given: without an entry it failed with a bare ``KeyError``.
    """
    import torch
    from pykeen.optimizers import optimizers_hpo_defaults

    from .tables.optim import RowwiseAdagrad

    defaults = cast(dict[type[torch.optim.Optimizer], Mapping[str, Any]], optimizers_hpo_defaults)  # a dict
    defaults.setdefault(RowwiseAdagrad, dict(defaults[torch.optim.Adagrad]))


def register() -> None:
    """Register the plugin's training loop, evaluator, interactions, models and optimizer (idempotent).

    :raises class_resolver.RegistrationNameConflict: if another class is registered under one
        of the plugin's keys (``bess``, ``interht``, ``trans``, ``rowwiseadagrad``)
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
            _register_hpo_defaults()
            _registered = True
        finally:
            _registering = False
        logger.debug("registered pykeen-bess in PyKEEN's resolvers")
    import pykeen_bess_autoload

    pykeen_bess_autoload._remove_hooks()  # the post-import hook and the lookup fallback are done


def is_registered() -> bool:
    """Return whether :func:`register` has run."""
    return _registered


def register_when_ready() -> None:
    """Register now if PyKEEN is loaded and idle; else as soon as PyKEEN has loaded.

    Registering imports PyKEEN's training, evaluation and model modules; doing so while one of
    them is still being imported would be circular, and doing so before anything imports PyKEEN
    would cost every ``import pykeen_bess`` seconds (the command line's ``--help`` and argument
    errors come before PyKEEN is imported). In both cases the post-import hook of
    :mod:`pykeen_bess_autoload` registers as soon as a PyKEEN module has finished loading (and a
    failing lookup in one of PyKEEN's resolvers registers, too).
    """
    import pykeen_bess_autoload

    if _registered:
        return
    if "pykeen" in sys.modules and pykeen_bess_autoload.pykeen_idle():
        register()
    else:
        pykeen_bess_autoload.install_hook()
