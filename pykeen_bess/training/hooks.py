"""PyKEEN's training-loop hooks, as :class:`~pykeen_bess.training.BessTrainingLoop` answers them.

PyKEEN's ``TrainingLoop`` calls hooks to write and read checkpoints (``_save_state``,
``_load_state``: through the loop's checkpoint store), for one batch's loss (``_process_batch``), its size
(``_get_batch_size``), slicing, and, in its ``evaluation-loss`` callback, a data loader of given
triples (``_create_training_data_loader``) and an epoch over it (``_train_epoch`` with
``backward=False``). BESS trains on its own balanced steps (:mod:`~pykeen_bess.training.epochs`);
:class:`PyKEENHooks` gives these hooks their BESS meaning: the loss of a sub-batch of the step being
run, and the loss of given triples as PyKEEN's ``SLCWATrainingLoop`` computes it.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch
from pykeen.stoppers import Stopper
from pykeen.training import SLCWATrainingLoop
from pykeen.training.callbacks import (
    EvaluationLossTrainingCallback,
    MultiTrainingCallback,
    TrainingCallback,
    TrainingCallbackHint,
    callback_resolver,
)
from pykeen.training.training_loop import NonFiniteLossError
from pykeen.triples import CoreTriplesFactory
from pykeen.triples.instances import BatchedSLCWAInstances
from torch.utils.data import DataLoader

from ..data.batch import BessBatch
from ..distributed import Topology
from ..scoring import SharedCandidateScorer
from ..data.sharding import EntitySharding
from .checkpoints.checkpointed import checksum, optimizer_text, scheduler_text
from .checkpoints.stores import CheckpointStore
from .setup.config import BessConfig
from ..tables.memory_plan import MemoryPlan
from .setup.arguments import LoopSettings
from .setup.settings import TrainingSetup
from .setup.sizes import StepSizes
from .steps.runner import StepRunner
from ..tables.shard_tables import ShardTables

__all__ = ["UNCALLED_HOOKS", "PyKEENHooks", "asks_evaluation_loss"]

#: PyKEEN's training-loop hooks that a BESS step does not call (see :mod:`pykeen_bess.training.epochs`, point 8;
#: ``_train_epoch`` computes only the evaluation-loss callback's loss)
UNCALLED_HOOKS = ("_train_epoch", "_forward_pass")


class PyKEENHooks(SLCWATrainingLoop):
    """PyKEEN's per-batch hooks of the BESS loop (a base class of :class:`~pykeen_bess.training.BessTrainingLoop`)."""

    #: the constructor's arguments the setup is built from
    settings: LoopSettings
    #: the parts of the run for the current partition (see :func:`~pykeen_bess.training.setup.assembly.assemble`)
    setup: TrainingSetup
    #: the step runner of the current (or last) training
    runner: StepRunner | None

    @property
    def topology(self) -> Topology:
        """The process topology (of :attr:`setup`)."""
        return self.setup.topology

    @property
    def config(self) -> BessConfig:
        """The validated configuration (of :attr:`setup`)."""
        return self.setup.config

    @property
    def sharding(self) -> EntitySharding:
        """The entity sharding (of :attr:`setup`)."""
        return self.setup.sharding

    @property
    def tables(self) -> ShardTables:
        """The shard tables of this process (of :attr:`setup`)."""
        return self.setup.tables

    @property
    def memory_plan(self) -> MemoryPlan:
        """The memory plan of the tables and their optimizer state (of :attr:`setup`)."""
        return self.setup.memory_plan

    @property
    def scorer(self) -> SharedCandidateScorer:
        """The scorer of the model's interaction (of :attr:`setup`)."""
        return self.setup.scorer

    @property
    def checkpoints(self) -> CheckpointStore:
        """The checkpoint store (of :attr:`setup`)."""
        return self.setup.checkpoints

    @property
    def sizes(self) -> StepSizes:
        """The step sizes and the memory search (of :attr:`setup`)."""
        return self.setup.sizes

    def _save_state(
        self,
        path: Any,
        stopper: Stopper | None = None,
        best_epoch_model_checkpoint_file_path: pathlib.Path | None = None,
        triples_factory: CoreTriplesFactory | None = None,
    ) -> None:
        """Write a checkpoint through the loop's checkpoint store (collective under a process group)."""
        self.checkpoints.save(pathlib.Path(path), stopper, best_epoch_model_checkpoint_file_path, triples_factory)

    @property
    def checksum(self) -> str:
        """PyKEEN's checksum of the model and the optimizer (at its initial learning rates), and of the scheduler.

        A checkpoint written after a learning-rate scheduler changed the rate resumes (see
        :func:`~pykeen_bess.training.checkpoints.checkpointed.optimizer_text`); PyKEEN's own loops refuse it.
        The scheduler's class and settings count (:func:`~.checkpoints.checkpointed.scheduler_text`).
        """
        return checksum(str(self.model), optimizer_text(self.optimizer), scheduler_text(self.lr_scheduler))

    def _load_state(self, path: str | pathlib.Path, triples_factory: CoreTriplesFactory | None = None) -> Any:
        """Load a checkpoint through the loop's checkpoint store; the shard tables then hold the weights."""
        self.checkpoints.resharded_from = None
        result = self.checkpoints.load(pathlib.Path(path), triples_factory)
        self.tables.now_hold_weights()
        return result

    def refuse_uncalled_hooks(self) -> None:
        """Refuse a subclass that overrides a hook the training steps never call (:data:`UNCALLED_HOOKS`).

        :raises NotImplementedError: naming the overridden hooks and the one to override instead
        """
        ignored = [name for name in UNCALLED_HOOKS if getattr(type(self), name) is not getattr(PyKEENHooks, name)]
        if ignored:
            raise NotImplementedError(
                f"{type(self).__name__} overrides {', '.join(ignored)}, which BessTrainingLoop's steps never "
                f"call (they gather their rows once for all sub-batches and check the loss over all of them and "
                f"all processes). Override _process_batch (one sub-batch's loss) instead."
            )

    def _create_training_data_loader(
        self,
        triples_factory: CoreTriplesFactory,
        *,
        batch_size: int,
        sampler: str | None = None,
        drop_last: bool = False,
        **kwargs: Any,
    ) -> DataLoader:
        """Return PyKEEN's sLCWA batches of the triples, with this loop's negatives (PyKEEN's hook).

        BESS trains on its own balanced batches (:meth:`epoch_batches`); PyKEEN calls this hook for
        the loss of other triples (its ``evaluation-loss`` callback, with :meth:`_train_epoch`). The
        negatives are PyKEEN's basic sampler's, ``num_negs_per_pos`` per positive drawn uniformly from
        all entities on the sides ``corruption`` names, unfiltered.

        :raises NotImplementedError: under a process group (see :meth:`check_evaluation_loss`)
        """
        self.check_evaluation_loss()
        if sampler is not None:
            raise ValueError(f"BessTrainingLoop computes the loss of given triples with sampler=None, not {sampler!r}.")
        sides = {"h": ("head",), "t": ("tail",), "ht": ("head", "tail")}[self.settings.corruption]
        return DataLoader(
            dataset=BatchedSLCWAInstances.from_triples_factory(
                triples_factory,
                batch_size=batch_size,
                shuffle=kwargs.pop("shuffle", True),
                drop_last=drop_last,
                negative_sampler="basic",
                negative_sampler_kwargs=dict(num_negs_per_pos=self.config.num_negs_per_pos, corruption_scheme=sides),
                loss_weighter=self.loss_weighter,
                loss_weighter_kwargs=self.loss_weighter_kwargs,
            ),
            batch_size=None,  # the dataset yields whole batches
            batch_sampler=None,
            **kwargs,
        )

    def _train_epoch(
        self,
        batches: DataLoader,
        callbacks: MultiTrainingCallback,
        sub_batch_size: int | None,
        label_smoothing: float,
        slice_size: int | None,
        epoch: int,
        only_size_probing: bool,
        backward: bool = True,
    ) -> float:
        """Return the mean loss of PyKEEN's sLCWA batches (``backward=False``: what the evaluation-loss callback asks).

        BESS's steps never run through this hook (see :mod:`~pykeen_bess.training.epochs`); it computes
        the loss of given triples as PyKEEN's ``SLCWATrainingLoop`` does, on the model as it is (its
        entity rows looked up in the shard tables), without gradients and without changing any
        parameter or optimizer state.

        :raises NotImplementedError: with ``backward=True`` (training runs through ``train()``)
        :raises NonFiniteLossError: if a batch's loss is non-finite
        """
        if backward:
            raise NotImplementedError("BessTrainingLoop trains through train(); _train_epoch computes losses only.")
        self.check_evaluation_loss()
        total, count = 0.0, 0
        with torch.no_grad():
            for batch in batches:
                callbacks.pre_batch()
                loss = SLCWATrainingLoop._process_batch_static(
                    model=self.model,
                    loss=self.loss,
                    mode=None,
                    batch=batch,
                    start=None,
                    stop=None,
                    label_smoothing=label_smoothing,
                )
                if not torch.isfinite(loss):
                    raise NonFiniteLossError("Loss is non-finite.")
                batch_loss = loss.item()
                self.model.post_forward_pass()
                total += batch_loss
                count += 1
                callbacks.on_batch(epoch=epoch, batch=batch, batch_loss=batch_loss)
                callbacks.pre_step()
                callbacks.post_batch(epoch=epoch, batch=batch)
                if only_size_probing and count > 1:
                    break
        return total / max(count, 1)

    def check_evaluation_loss(self) -> None:
        """Refuse the loss of given triples where no process holds the whole model.

        :raises NotImplementedError: under a process group (each process holds some shards, and PyKEEN's
            evaluation-loss callback computes its loss in every process alone)
        """
        if self.topology.is_distributed:
            raise NotImplementedError(
                "PyKEEN's evaluation-loss callback (the loss of given triples) needs the whole model in one process; "
                "under a process group each process holds only some shards. Evaluate with a stopper (early stopping) "
                "or after training instead."
            )

    @staticmethod
    def _get_batch_size(batch: BessBatch) -> int:  # type: ignore[override]
        """Return the slots of a block (PyKEEN's sub-batching splits them)."""
        return batch.block_size

    def _process_batch(  # type: ignore[override]
        self,
        batch: BessBatch,
        start: int,
        stop: int,
        label_smoothing: float = 0.0,
        slice_size: int | None = None,
    ) -> torch.Tensor:
        """Return the loss of the slots ``start:stop`` of every block of the step being run (PyKEEN's hook).

        The loss is this sub-batch's share of the step loss (already reduced over the whole step, so
        the sub-batches' losses add up to the step loss), a scalar; the step backpropagates it. A
        subclass may override this hook (e.g. to change or check the loss): the loop then calls it for
        every sub-batch of every step (the eager step; the static step does not run then). A
        non-finite loss raises :class:`~pykeen.training.training_loop.NonFiniteLossError` after the
        step's sub-batches, and the step is not applied.

        :raises RuntimeError: when called outside a step (the step's rows are gathered at its start)
        """
        if slice_size is not None:
            raise ValueError("BessTrainingLoop does not support slice_size; use sub_batch_size.")
        if self.runner is None:
            raise RuntimeError("BessTrainingLoop._process_batch computes the loss of a step being run by train().")
        return self.runner.sub_batch_loss(batch, start, stop, label_smoothing)

    def stop_after_this_epoch(self) -> None:
        """Stop training after the current epoch (what PyKEEN's stopper callback asks by setting ``_should_stop``)."""
        self._should_stop = True

    @property
    def overrides_process_batch(self) -> bool:
        """Whether a subclass overrides :meth:`_process_batch` (the steps then call it for every sub-batch)."""
        return type(self)._process_batch is not PyKEENHooks._process_batch

    def _slice_size_search(self, **kwargs: Any) -> int:
        raise MemoryError("BessTrainingLoop does not support slicing; use sub-batching.")


def asks_evaluation_loss(callbacks: TrainingCallbackHint) -> bool:
    """Return whether the ``callbacks`` of ``train()`` include PyKEEN's evaluation-loss callback."""
    hints: list[Any] = list(callbacks) if isinstance(callbacks, list | tuple) else [callbacks]
    for hint in hints:
        if hint is None:
            continue
        if isinstance(hint, TrainingCallback):
            kind: type = type(hint)
        else:
            try:
                kind = callback_resolver.lookup(hint)
            except (KeyError, ValueError, TypeError):
                continue  # PyKEEN's resolver raises its own error when it makes the callbacks
        if issubclass(kind, EvaluationLossTrainingCallback):
            return True
    return False
