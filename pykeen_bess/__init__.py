"""pykeen-bess: BESS (Balanced Entity Sampling and Sharing) training and sharded evaluation for PyKEEN.

Importing the package registers its training loop (``"bess"``), evaluator (``"bess"``),
interactions and models in PyKEEN's resolvers (see :mod:`pykeen_bess.registration`). The public
names below are imported lazily, so that PyKEEN can load this package from its entry point in the
middle of its own import without a circular import.
"""

from __future__ import annotations

import importlib
from typing import Any

from .registration import register, register_when_ready

__version__ = "0.1.0"

#: public name -> module that defines it
_EXPORTS = {
    "BessTrainingLoop": "training",
    "BessEvaluator": "evaluation",
    "predict_top_k": "prediction",
    "InterHTInteraction": "interactions",
    "TranSInteraction": "interactions",
    "InterHT": "models",
    "TranS": "models",
    "EntitySharding": "sharding",
    "ShardPairPartition": "partition",
    "BessSampler": "sampling",
    "LocalExchange": "exchange",
    "DistributedExchange": "exchange",
    "ShardedEmbedding": "representation",
    "get_scorer": "scoring",
}

__all__ = [
    "BessEvaluator",
    "BessSampler",
    "BessTrainingLoop",
    "DistributedExchange",
    "EntitySharding",
    "InterHT",
    "InterHTInteraction",
    "LocalExchange",
    "ShardPairPartition",
    "ShardedEmbedding",
    "TranS",
    "TranSInteraction",
    "get_scorer",
    "predict_top_k",
    "register",
    "register_when_ready",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pykeen_bess' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


register_when_ready()
