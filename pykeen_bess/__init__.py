"""pykeen-bess: BESS (Balanced Entity Sampling and Sharing) training and sharded evaluation for PyKEEN.

Importing the package registers its training loop (``"bess"``), evaluator (``"bess"``),
interactions and models in PyKEEN's resolvers (see :mod:`pykeen_bess.registration`). The public
names below are imported lazily, so that PyKEEN can load this package from its entry point in the
middle of its own import without a circular import.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from .registration import register, register_when_ready

__version__ = "0.1.0"

#: public name -> module that defines it
_EXPORTS = {
    "BessTrainingLoop": "training",
    "BessEvaluator": "evaluation",
    "predict_top_k": "evaluation",
    "InterHTInteraction": "interactions",
    "TranSInteraction": "interactions",
    "InterHT": "models",
    "TranS": "models",
    "EntitySharding": "sharding",
    "ShardPairPartition": "partition",
    "BessSampler": "sampling",
    "Topology": "distributed",
    "LocalTopology": "distributed",
    "DistributedTopology": "distributed",
    "ShardedEmbedding": "representation",
    "get_scorer": "scoring",
}

#: names of earlier releases -> (module, current name); they still work, with a DeprecationWarning
_RENAMED = {
    "LocalExchange": ("distributed", "LocalTopology"),
    "DistributedExchange": ("distributed", "DistributedTopology"),
}

__all__ = [
    "BessEvaluator",
    "BessSampler",
    "BessTrainingLoop",
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
    return value


def __dir__() -> list[str]:
    return __all__


register_when_ready()
