"""What a checkpoint store reads and writes of its training loop: :class:`CheckpointedLoop`.

The stores (:mod:`~pykeen_bess.training.checkpoints.stores`, :mod:`~pykeen_bess.training.checkpoints.pbg`)
write PyKEEN's checkpoint dictionary through the loop's own ``_save_state`` and ``_load_state``, so
they hold the loop; this protocol names the parts of it they use, so that mypy checks every access
and a reader sees what a checkpoint depends on. :class:`~pykeen_bess.training.BessTrainingLoop` is one.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from pykeen.models import Model

from ...distributed import Topology
from ...data.sharding import EntitySharding
from ...tables.shard_tables import ShardTables

if TYPE_CHECKING:  # the configuration module resolves partitions, whose checkpoint stores see this protocol
    from ..setup.config import BessConfig

__all__ = ["CheckpointedLoop", "checksum", "optimizer_text", "scheduler_settings", "scheduler_text"]


def optimizer_text(optimizer: torch.optim.Optimizer | None) -> str:
    """Return the optimizer's ``repr`` as PyKEEN's checkpoint checksum hashes it, at its initial learning rates.

    PyKEEN hashes ``str(optimizer)``, which shows every group's current learning rate and, once a
    learning-rate scheduler was made for it, the ``initial_lr`` it records: a checkpoint written after
    a scheduler changed the rate never matched the fresh optimizer that resumes it. Here a group that
    records ``initial_lr`` shows that rate as its ``lr`` and no ``initial_lr``; without a scheduler the
    text is PyKEEN's own (earlier checkpoints keep their checksum).
    """
    if optimizer is None:
        return str(optimizer)
    groups = optimizer.param_groups
    saved = [dict(group) for group in groups]
    try:
        for group in groups:
            if "initial_lr" in group:
                group["lr"] = group.pop("initial_lr")
        return str(optimizer)
    finally:
        for group, before in zip(groups, saved):
            group.clear()
            group.update(before)


#: a scheduler's state entries that change as it steps, or do not configure it
_SCHEDULER_STATE = frozenset({"optimizer", "last_epoch", "verbose"})


def scheduler_settings(state: Mapping[str, Any] | None, cls: type) -> dict[str, Any] | None:
    """Return the settings of a learning-rate scheduler of class ``cls`` in a scheduler state dict (None: none).

    The entries of the state named as arguments of the class's constructor, but for the epoch it reached:
    two schedulers of one class with equal settings schedule alike; another class's state lacks entries.
    """
    if state is None:
        return None
    accepted = inspect.signature(cls).parameters  # the constructor's
    return {key: value for key, value in state.items() if key in accepted and key not in _SCHEDULER_STATE}


def scheduler_text(scheduler: Any) -> str:
    """Return the text of a learning-rate scheduler the checkpoint checksum covers (``""`` without one).

    Its class and settings (:func:`scheduler_settings`): a checkpoint resumed with another scheduler, or
    other settings, would schedule with the checkpoint's state loaded into it (PyKEEN loads the state
    blindly), and one written without a scheduler cannot resume with one. Without a scheduler the
    checksum is as before.
    """
    if scheduler is None:
        return ""
    settings = scheduler_settings(scheduler.state_dict(), type(scheduler)) or {}
    return f"{type(scheduler).__name__}({', '.join(f'{k}={v!r}' for k, v in sorted(settings.items()))})"


def checksum(model: str, optimizer: str, scheduler: str = "") -> str:
    """Return PyKEEN's checkpoint checksum of a model's and an optimizer's text, and a scheduler's.

    PyKEEN hashes ``str(model)`` and ``str(optimizer)``; the loop hashes :func:`optimizer_text` and the scheduler's
    text too (empty without a scheduler: the checksum is then PyKEEN's formula).
    """
    digest = hashlib.md5(model.encode("utf-8"))
    digest.update(optimizer.encode("utf-8"))
    digest.update(scheduler.encode("utf-8"))
    return digest.hexdigest()


class CheckpointedLoop(Protocol):
    """The parts of a BESS training loop that its checkpoints hold or check."""

    #: the model (a ``pykeen.models.ERModel``) whose state a checkpoint holds
    model: Model
    #: the optimizer whose state a checkpoint holds (None after PyKEEN's ``clear_optimizer``)
    optimizer: torch.optim.Optimizer
    #: the class and hyper-parameters of the user's optimizer
    optimizer_cls: type[torch.optim.Optimizer]
    optimizer_kwargs: dict[str, Any]
    #: the learning-rate scheduler whose state a checkpoint holds (None: none)
    lr_scheduler: Any
    #: the completed epochs
    _epoch: int
    #: the loss of every completed epoch
    losses_per_epochs: list[float]
    #: whether the last checkpoint loaded was written by PyTorch-BigGraph
    resumed_from_pbg: bool

    def resume_at(self, epoch: int, from_pbg: bool) -> None:
        """Continue after ``epoch`` completed epochs of a loaded checkpoint (PyTorch-BigGraph's: no losses)."""

    @property
    def checksum(self) -> str:
        """PyKEEN's checksum of the model and optimizer (a checkpoint resumes into the same)."""

    @property
    def topology(self) -> Topology:
        """The process topology."""

    @property
    def config(self) -> BessConfig:
        """The validated configuration (its seed)."""

    @property
    def sharding(self) -> EntitySharding:
        """The entity sharding."""

    @property
    def tables(self) -> ShardTables:
        """The shard tables of this process."""
