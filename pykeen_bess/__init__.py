"""pykeen-bess: BESS (Balanced Entity Sampling and Sharing) training and sharded evaluation for PyKEEN.

Importing the package registers its training loop (``"bess"``), evaluator (``"bess"``),
interactions and models in PyKEEN's resolvers (see :mod:`pykeen_bess.registration`): at once if
PyKEEN is loaded, else as soon as it is (so ``import pykeen_bess`` alone, as the command line's
``--help`` does, costs no import of PyKEEN or torch). The public names below are imported lazily,
so that PyKEEN can load this package from its entry point in the middle of its own import without
a circular import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

from .registration import is_registered, register, register_when_ready

__version__ = "0.1.0"

#: public name -> module that defines it
_EXPORTS = {
    "BessTrainingLoop": "training",
    "BessEvaluator": "evaluation",
    "predict_top_k": "evaluation",
    "InterHTInteraction": "nn.interactions",
    "TranSInteraction": "nn.interactions",
    "InterHT": "nn.models",
    "TranS": "nn.models",
    "EntitySharding": "data.sharding",
    "ShardPairPartition": "data.partition",
    "BessSampler": "data.sampling",
    "Topology": "distributed",
    "LocalTopology": "distributed",
    "DistributedTopology": "distributed",
    "ShardedEmbedding": "tables.representation",
    "unshard_model": "tables.unshard",
    "get_scorer": "scoring",
    "CorruptCheckpointError": "storage.digests",
}

#: names of earlier releases -> (module, current name); they still work, with a DeprecationWarning
_RENAMED = {
    "LocalExchange": ("distributed", "LocalTopology"),
    "DistributedExchange": ("distributed", "DistributedTopology"),
}

#: modules of earlier versions -> where they live now
_MOVED_MODULES = {
    f"{__name__}.{name}": f"{__name__}.{package}.{name}"
    for package, names in {
        "data": ("balancing", "batch", "partition", "sampling", "seeds", "sharding"),
        "tables": ("encoding", "optim", "representation", "row_rules"),
        "nn": ("interactions", "loss", "models"),
        "runtime": ("allocator", "memory", "threads"),
    }.items()
    for name in names
}
# the state-dict hooks of shard tables outside the model (named by pickled models) and the file helpers
_MOVED_MODULES.update(
    {
        f"{__name__}.stored_tables": f"{__name__}.storage.state_dict",
        f"{__name__}.mapped_files": f"{__name__}.storage.files",
    }
)
# training/ by concern: its set-up, steps and checkpoints as sub-packages, the table sets in tables/
_MOVED_MODULES.update(
    {
        f"{__name__}.training.{old}": f"{__name__}.{new}"
        for old, new in {
            "config": "training.setup.config",
            "settings": "training.setup.settings",
            "assembly": "training.setup.assembly",
            "partitions": "training.setup.partitions",
            "sizes": "training.setup.sizes",
            "step": "training.steps.runner",
            "static_step": "training.steps.static_step",
            "static_plan": "training.steps.device_plan",
            "static_update": "training.steps.static_update",
            "static_rules": "training.steps.static_rules",
            "step_graphs": "training.steps.executors",
            "dense_update": "training.steps.dense_update",
            "host_rows": "training.steps.host_rows",
            "checkpoint_files": "training.checkpoints.files",
            "checkpoint_mismatch": "training.checkpoints.mismatch",
            "checkpointed": "training.checkpoints.checkpointed",
            "pbg_checkpoints": "training.checkpoints.pbg",
            "resharding": "training.checkpoints.resharding",
            "plan": "tables.memory_plan",
            "table_setup": "tables.creation",
            "tables": "tables.shard_tables",
            "column_tables": "tables.column_tables",
            "lent_rows": "tables.lent_rows",
        }.items()
    }
)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module's former name as the module itself, so imports and pickled models of earlier versions load.

    A pickled model names the classes of its shard tables, models and losses by module (e.g.
    ``pykeen_bess.representation.ShardedEmbedding``); the old name is imported only when asked for.
    """

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        return importlib.import_module(_MOVED_MODULES[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing: the module has run under its current name."""


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())

__all__ = [
    "BessEvaluator",
    "BessSampler",
    "BessTrainingLoop",
    "CorruptCheckpointError",
    "DistributedTopology",
    "EntitySharding",
    "InterHT",
    "InterHTInteraction",
    "LocalTopology",
    "ShardPairPartition",
    "ShardedEmbedding",
    "Topology",
    "TranS",
    "TranSInteraction",
    "get_scorer",
    "predict_top_k",
    "register",
    "register_when_ready",
    "unshard_model",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        renamed, current = _RENAMED[name]
        warnings.warn(
            f"pykeen_bess.{name} is now pykeen_bess.{current} (the collective back end is the process topology; "
            f"'exchange' names the exchange scheme)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(f".{renamed}", __name__), current)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pykeen_bess' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    if not is_registered():
        # the import above may be the program's first of PyKEEN: its modules finished loading while the
        # plugin's module was still mid-import, so the post-import hook could not register it then
        import pykeen_bess_autoload

        pykeen_bess_autoload.install_hook()
    return value


def __dir__() -> list[str]:
    return __all__


register_when_ready()
