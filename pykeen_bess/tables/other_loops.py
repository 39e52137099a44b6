"""What training loops other than BESS's may not do to shard tables kept outside the model's parameters.

A table in host memory or files (the ``"host"`` and ``"mmap"`` storage tiers) is no parameter of the
model: after training the model still scores, predicts and evaluates with it, but PyKEEN's own loops
would re-initialise it at a fresh start and then never update it (their optimizer sees only the model's
parameters), silently. :class:`~pykeen_bess.tables.representation.ShardedEmbedding` refuses a
re-initialisation of a table that holds a training's values (:func:`refuse_another_loop`) unless BESS's
loop starts a fresh training of its own (:func:`resets_by_the_loop`), and the model refuses it before it
re-initialises anything (:func:`guard_model_reset`); continuing such a table with PyKEEN's loops is
refused by PyKEEN itself (its new optimizer has no state).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["LOOP_RESETS", "GuardedReset", "guard_model_reset", "refuse_another_loop", "resets_by_the_loop"]

#: set while BESS's training loop re-initialises its tables for a fresh training (:func:`resets_by_the_loop`)
LOOP_RESETS: contextvars.ContextVar[bool] = contextvars.ContextVar("pykeen_bess_loop_resets", default=False)


@contextlib.contextmanager
def resets_by_the_loop() -> Iterator[None]:
    """Let BESS's loop re-initialise tables that hold a training's values (a fresh training of its own)."""
    token = LOOP_RESETS.set(True)
    try:
        yield
    finally:
        LOOP_RESETS.reset(token)


def refuse_another_loop(table: Any, action: str) -> None:
    """Refuse to ``action`` a table kept by a storage tier outside the model's parameters (host memory, files).

    Another training loop (PyKEEN's own) would re-initialise such a table at a fresh start, and its
    optimizer would never see it: the entity rows would silently stay as they are. A table that is a
    parameter of the model (the device tier's) is an ordinary embedding and passes.

    :raises RuntimeError: naming the tier and what to do instead
    """
    if isinstance(table.weight, nn.Parameter):
        return
    raise RuntimeError(
        f"Another training loop cannot {action} this model's entity table: {type(table).__name__} keeps it in the "
        f"storage tier {table.storage.describe()}, outside the model's parameters, where only BESS's loop updates "
        f"it. Continue the BessTrainingLoop that trained it (train(..., continue_training=True) after training with "
        f"clear_optimizer=False) or its checkpoint, or make it an ordinary PyKEEN model first: "
        f"pykeen_bess.unshard_model(model) reads the table into its embedding (in memory; a new BessTrainingLoop "
        f"does the same). The model predicts and evaluates as it is."
    )


class GuardedReset:
    """A model's ``reset_parameters_`` that refuses (:func:`refuse_another_loop`) before it re-initialises anything.

    PyKEEN re-initialises a model's modules deepest first, so a relation embedding (``relation_representations.0
    ._embeddings``) was re-initialised before the entity table, one level up, refused: the trained model lost
    its relations. Pickled with the model (a model with such tables needs the plugin to load anyway).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self) -> Any:
        """Refuse if a table outside the model holds a training's values (unless BESS's loop resets), else reset."""
        if not LOOP_RESETS.get():
            for module in self.model.modules():
                if getattr(module, "holds_training", False):
                    refuse_another_loop(module, "re-initialise (and so lose)")
        return type(self.model).reset_parameters_(self.model)  # type: ignore[attr-defined]


def guard_model_reset(model: nn.Module, tables: Any) -> None:
    """Give ``model`` a :class:`GuardedReset` where one of ``tables`` is kept outside its parameters (host, files)."""
    if "reset_parameters_" in vars(model) or all(isinstance(table.weight, nn.Parameter) for table in tables):
        return
    model.reset_parameters_ = GuardedReset(model)  # type: ignore[assignment]
