"""The start of a training run: what the epochs need before the first one, built in PyKEEN's ``_train`` order.

:meth:`~pykeen_bess.training.parts.LoopParts.start_training` builds a :class:`TrainingRun` with these
functions (each takes the parts it uses; the numbers name the differences from PyKEEN listed in
:mod:`~pykeen_bess.training.epochs`): the arguments that do not apply (6), PyKEEN's callbacks with the
tracker on the main process only (5) and the stopper evaluating row shards (9), the step sizes (4),
BESS's optimizer step and clipping as callbacks of the eager step (3), and the log of the plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
from pykeen.stoppers import Stopper
from pykeen.trackers import ResultTracker
from pykeen.training.callbacks import (
    CheckpointTrainingCallback,
    GradientAbsClippingTrainingCallback,
    GradientNormClippingTrainingCallback,
    LearningRateSchedulerTrainingCallback,
    MultiTrainingCallback,
    StopperTrainingCallback,
    TrackerTrainingCallback,
    TrainingCallback,
    TrainingCallbackHint,
    TrainingCallbackKwargsHint,
)
from pykeen.training.training_loop import NoTrainingBatchError
from pykeen.triples import CoreTriplesFactory

from ..data.partition import ShardPairPartition
from ..distributed import Topology
from ..tables.memory_plan import MemoryPlan
from ..tables.shard_tables import ShardTables
from .checkpoints.stopper_weights import process_suffix
from .epoch_steps import EpochBatches
from .setup.config import BessConfig
from .setup.sizes import StepSizes, block_size_for
from .steps.runner import BessOptimizerCallback, GlobalNormClippingCallback, StepRunner, ValueClippingCallback
from .steps.static_step import StaticStep
from .steps.static_update import Clipping

__all__ = [
    "RowShardStopperCallback",
    "TrainingRun",
    "TrainingStart",
    "log_plan",
    "pykeen_callbacks",
    "pykeen_layout_checkpoints",
    "refuse_what_does_not_apply",
    "register_step_callbacks",
    "step_sizes",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainingStart:
    """The arguments of one ``train()`` call (PyKEEN's ``_train``) that shape its run, before the first epoch."""

    num_epochs: int
    batch_size: int | None
    sub_batch_size: int | None
    label_smoothing: float
    continue_training: bool
    #: whether the call only probes sizes (one step)
    only_size_probing: bool
    clipping: Clipping
    #: PyKEEN's callbacks and stopper
    callbacks: TrainingCallbackHint = None
    callbacks_kwargs: TrainingCallbackKwargsHint = None
    stopper: Stopper | None = None
    last_best_epoch: int | None = None
    best_epoch_model_file_path: pathlib.Path | None = None
    #: PyKEEN's data-loader arguments (difference 6: refused or without effect)
    slice_size: int | None = None
    sampler: str | None = None
    num_workers: int | None = None
    drop_last: bool | None = None

    def shared(self) -> dict[str, Any]:
        """Return the settings every rank must share (the steps and clipping run different collectives)."""
        clipping = self.clipping
        return dict(
            num_epochs=self.num_epochs,
            batch_size=self.batch_size,
            sub_batch_size=self.sub_batch_size,
            label_smoothing=self.label_smoothing,
            continue_training=self.continue_training,
            gradient_clipping_max_norm=clipping.max_norm,
            gradient_clipping_norm_type=clipping.norm_type,
            gradient_clipping_max_abs_value=clipping.max_abs_value,
        )


@dataclasses.dataclass
class TrainingRun:
    """The parts of one ``train()`` call the epochs use, built before the first epoch."""

    #: the user's callbacks with PyKEEN's and BESS's (the eager step's optimizer step among them)
    callback: MultiTrainingCallback
    #: the balanced batches of the epochs
    batches: EpochBatches
    #: the step runner (the eager step; the static step's source of the scheme and loss)
    runner: StepRunner
    #: the static step, None where the eager step trains
    static: StaticStep | None
    #: slots per block of a sub-batch
    sub_block_size: int
    #: PyKEEN's label smoothing of the run
    label_smoothing: float
    #: the loop's own ``_process_batch`` where a subclass overrides it (None: BESS's)
    process_batch: Callable[..., Any] | None


def refuse_what_does_not_apply(
    slice_size: int | None,
    sampler: str | None,
    num_workers: int | None,
    drop_last: bool | None,
    batch_size: int | None,
    partition: ShardPairPartition,
) -> None:
    """Difference 6: BESS draws its own balanced, padded batches in the main process.

    :raises ValueError: for ``slice_size`` or a ``sampler``
    :raises NoTrainingBatchError: for ``drop_last=True`` with a batch larger than the training triples
    """
    if slice_size is not None:
        raise ValueError("BessTrainingLoop does not support slice_size; use sub_batch_size.")
    if sampler is not None:
        raise ValueError(f"BessTrainingLoop draws its own balanced batches; sampler={sampler!r} is not supported.")
    if num_workers:
        logger.info("num_workers has no effect: BESS sampling is vectorised in the main process.")
    if drop_last:
        if batch_size is not None and batch_size > partition.num_triples:
            # PyKEEN's data loader would drop its only, incomplete batch: no batch at all
            raise NoTrainingBatchError()
        logger.info("drop_last has no effect: BESS steps never have incomplete batches (they are padded).")


def pykeen_callbacks(
    result_tracker: ResultTracker | None,
    topology: Topology,
    triples_factory: CoreTriplesFactory,
    callbacks: TrainingCallbackHint,
    callbacks_kwargs: TrainingCallbackKwargsHint,
    stopper: Stopper | None,
    last_best_epoch: int | None,
    best_epoch_model_file_path: pathlib.Path | None,
) -> MultiTrainingCallback:
    """Return the user's callbacks, the tracker's (difference 5: main process only) and the stopper's, as PyKEEN's."""
    callback = MultiTrainingCallback(callbacks=callbacks, callbacks_kwargs=callbacks_kwargs)
    if result_tracker is not None and topology.is_main_process:
        callback.register_callback(TrackerTrainingCallback())
    if stopper is not None:
        own_best_model_path(stopper, topology)
        callback.register_callback(
            RowShardStopperCallback(  # 9.
                stopper,
                triples_factory=triples_factory,
                last_best_epoch=last_best_epoch,
                best_epoch_model_file_path=best_epoch_model_file_path,
            )
        )
    return callback


def pykeen_layout_checkpoints(callback: MultiTrainingCallback, tables: ShardTables) -> None:
    """Difference 11: PyKEEN's checkpoint callback saves the model in PyKEEN's layout, or is refused before training.

    During training the model's entity representations are the shard tables: a state dict taken then holds
    them (shard order, padded rows), which no PyKEEN model loads. The callback's saves run with the model's
    own embeddings holding the tables' rows meanwhile (:meth:`ShardTables.pykeen_embeddings`: one process
    holding every shard on its device). Elsewhere no process can give the model its embeddings during
    training, and the callback is refused.

    :raises ValueError: for PyKEEN's checkpoint callback where the tables cannot lend PyKEEN's layout
    """
    for member in callback.callbacks:
        if not isinstance(member, CheckpointTrainingCallback):
            continue
        if tables.pykeen_layout_obstacle is not None:
            raise ValueError(
                f"PyKEEN's checkpoint callback saves the model during training, where {tables.pykeen_layout_obstacle}: "
                "its files would hold the shard tables, which no PyKEEN model loads. Use BESS's checkpoints "
                "(training_kwargs checkpoint_name=..., checkpoint_directory=...), which resume, or save the model "
                "after training."
            )
        if getattr(member, "bess_layout", False):  # (a callback object given to an earlier train() call)
            continue
        save = member.post_epoch

        def post_epoch(*args: Any, _save: Any = save, _member: Any = member, **kwargs: Any) -> None:
            tables = getattr(_member.training_loop, "tables", None)  # the loop's current run's (none: PyKEEN's loop)
            with contextlib.nullcontext() if tables is None else tables.pykeen_embeddings():
                _save(*args, **kwargs)

        member.post_epoch = post_epoch  # type: ignore[method-assign]
        member.bess_layout = True  # type: ignore[attr-defined]


def own_best_model_path(stopper: Stopper, topology: Topology) -> None:
    """Give every rank its own file for the early stopper's best weights (``NAME.rankR-of-W.pt``).

    Each rank saves its own shards' rows there and loads them back when the stopper stops; a path the
    user gave is one file for all ranks otherwise, whose last writer's shards every rank would load (or
    the first rank to finish would delete before the others read it).
    """
    path = getattr(stopper, "best_model_path", None)
    if path is None or not topology.is_distributed:
        return
    own = process_suffix(topology)
    path = pathlib.Path(path)
    if not path.stem.endswith(own):
        stopper.best_model_path = path.with_name(f"{path.stem}{own}{path.suffix}")  # type: ignore[attr-defined]


class RowShardStopperCallback(StopperTrainingCallback):
    """PyKEEN's stopper callback; it evaluates the model with the tables as row shards (difference 9)."""

    def post_epoch(self, epoch: int, epoch_loss: float, **kwargs: Any) -> None:
        """Evaluate (and keep the best epoch) as PyKEEN does, the model holding row shards meanwhile."""
        if not self.stopper.should_evaluate(epoch):
            super().post_epoch(epoch=epoch, epoch_loss=epoch_loss, **kwargs)
            return
        loop = self.training_loop
        tables = loop.tables  # type: ignore[attr-defined]
        # written back: PyKEEN's EarlyStopper loads the best epoch's weights into the model when it stops;
        # it keeps them as the model's state dict (which holds tables in files by value)
        with tables.row_shards(loop.optimizer, write=True):
            try:
                super().post_epoch(epoch=epoch, epoch_loss=epoch_loss, **kwargs)
            except FileNotFoundError as error:
                # a run resumed on another layout of shards may have no copy of the best weights (difference 10):
                # its training is kept, with the last epoch's weights, rather than lost at its end
                if not getattr(self.stopper, "stopped", False):
                    raise
                logger.warning(
                    "The early stopper stopped at epoch %d, but the best epoch's (%s) weights are not there (%s): the "
                    "checkpoint this run resumed was written by another layout of shards, whose copies of them could "
                    "not be resharded for this run (see the warning at the start). The model keeps epoch %d's weights.",
                    epoch,
                    getattr(self.stopper, "best_epoch", None),
                    error,
                    epoch,
                )
                loop.stop_after_this_epoch()  # type: ignore[attr-defined]
                self.model._free_graph_and_cache()


def step_sizes(
    sizes: StepSizes,
    topology: Topology,
    device: torch.device,
    automatic_memory_optimization: bool,
    partition: ShardPairPartition,
    batch_size: int | None,
    sub_batch_size: int | None,
    label_smoothing: float,
    probing: bool,
) -> tuple[int, int]:
    """Difference 4: slots per block and per sub-batch; ``batch_size=None`` searches on the CPU too.

    The batch size is logged to the result tracker as it trains, after rounding (an HPO study records
    the values it suggested).

    :param sizes: the memory search of the loop's step sizes
    :param device: the device the search probes
    :param probing: whether this call only probes sizes or continues training (no sub-batch search)
    """
    n2 = topology.n_shard**2
    if batch_size is None:
        if automatic_memory_optimization:
            batch_size = sizes.batch_size(partition, label_smoothing, device)
        else:
            batch_size = 256
            logger.info("No batch_size provided. Setting batch_size=%d.", batch_size)
    block_size = block_size_for(batch_size, topology.n_shard)
    largest = max(int(partition.pair_counts.max()), 1)  # a block of more slots than its shardpair's triples pads
    if block_size > largest:
        logger.info(
            "batch_size=%d holds more than every shardpair's triples: the steps use blocks of %d slots (one step per "
            "epoch, batch_size=%d).",
            batch_size,
            largest,
            largest * n2,
        )
        block_size = largest
    if sub_batch_size is not None:
        sub_block_size = max(1, min(block_size, sub_batch_size // n2))
        used = sub_block_size * n2
        if used != sub_batch_size and sub_block_size < block_size and not probing:
            # a sub-batch takes the same slots of every block: a multiple of num_shards**2 slots
            log = logger.warning if used > sub_batch_size else logger.info
            log(
                "sub_batch_size=%d %s to %d: a sub-batch takes the same slots of each of the %d blocks "
                "(num_shards**2), here %d each.",
                sub_batch_size,
                "raised" if used > sub_batch_size else "rounded down",
                used,
                n2,
                sub_block_size,
            )
    elif automatic_memory_optimization and not probing:
        sub_block_size = sizes.sub_block_size(partition, block_size, label_smoothing, device)
    else:
        sub_block_size = block_size
    return block_size, sub_block_size


def register_step_callbacks(
    callback: MultiTrainingCallback,
    runner: StepRunner,
    tables: ShardTables,
    topology: Topology,
    clipping: Clipping,
    eager: bool,
    sparse_updates: bool,
    lr_scheduler: Any,
) -> None:
    """Difference 3: BESS's optimizer step (gradients of gathered rows to the tables, global-norm clipping).

    The static step updates and clips within the step; the eager step's optimizer step is a callback.

    :raises ValueError: for PyKEEN's gradient-clipping callbacks (their ``pre_step`` edits the gradients
        ``optimizer.step()`` would read: the static step has applied them before the callbacks run, the eager
        step's row gradients are sparse), unless the eager step updates densely; under the static step other
        callbacks with a ``pre_step`` get a warning
    """
    for given in callback.callbacks:
        clipping_callback = (GradientNormClippingTrainingCallback, GradientAbsClippingTrainingCallback)
        if isinstance(given, clipping_callback) and not (eager and not sparse_updates):
            option = "max_norm" if isinstance(given, GradientNormClippingTrainingCallback) else "max_abs_value"
            raise ValueError(
                f"{type(given).__name__} clips the gradients before optimizer.step(), which BESS's steps do not "
                f"call (they update the tables themselves): pass training_kwargs=dict(gradient_clipping_{option}=...) "
                "instead, which BESS applies to every step's gradients (over all shards)."
            )
        if not eager and type(given).pre_step is not TrainingCallback.pre_step:
            warnings.warn(
                f"{type(given).__name__}.pre_step runs after BESS's update of the step (the gradients have been "
                "applied): changing gradients there has no effect.",
                UserWarning,
                stacklevel=2,
            )
    if eager:
        pre_step: list[TrainingCallback] = []
        if clipping.max_norm is not None:
            pre_step.append(GlobalNormClippingCallback(tables, topology, clipping.max_norm, clipping.norm_type))
        if clipping.max_abs_value is not None:
            pre_step.append(ValueClippingCallback(tables, clipping.max_abs_value))
        callback.register_callback(BessOptimizerCallback(runner, tables, pre_step, constrain_rows=not sparse_updates))
    if lr_scheduler is not None:
        callback.register_callback(BessLearningRateScheduling())


class BessLearningRateScheduling(LearningRateSchedulerTrainingCallback):
    """PyKEEN's learning-rate scheduler callback, after an epoch of BESS's steps.

    The steps update the parameters through the loop's own rules, not through ``optimizer.step()``, whose
    calls torch's schedulers count to warn that they run first (which would skip the schedule's first
    rate): the optimizer is marked as stepped before the scheduler steps, as its own ``step`` would.
    """

    def post_epoch(self, epoch: int, epoch_loss: float, **kwargs: Any) -> None:
        """Mark the optimizer as stepped (torch's ``_opt_called``), then step the scheduler as PyKEEN does."""
        optimizer: Any = self.training_loop.optimizer
        optimizer._opt_called = True
        super().post_epoch(epoch=epoch, epoch_loss=epoch_loss, **kwargs)


def log_plan(
    topology: Topology,
    config: BessConfig,
    tables: ShardTables,
    memory_plan: MemoryPlan,
    result_tracker: ResultTracker | None,
    batches: EpochBatches,
    runner: StepRunner,
    block_size: int,
    sub_block_size: int,
) -> None:
    """Log the steps of an epoch, the trained sizes (to the result tracker too) and the rows a step moves."""
    sampler = batches.sampler
    if result_tracker is not None:
        trained = dict(batch_size=block_size * topology.n_shard**2, num_negs_per_pos=config.num_negs_per_pos)
        result_tracker.log_params(params=dict(bess=dict(trained, num_shards=topology.n_shard)))
    logger.info(
        "BESS: %d steps per epoch of %d blocks x %d slots (sub-batches of %d), %d negatives per positive "
        "(%d per shard), exchange=%s, padding %.1f%%",
        len(batches),
        topology.n_shard**2,
        block_size,
        sub_block_size,
        config.num_negs_per_pos,
        sampler.negatives_per_shard,
        type(runner.scheme).get_name(),
        100 * sampler.padding_fraction,
    )
    # a step's rows: heads and tails of the local blocks, the local shards' negatives of all blocks
    n, local = topology.n_shard, topology.n_local
    negative_sets = 1 if sampler.shares_negatives else n * n
    step_rows = min(local * (2 * n * block_size + negative_sets * sampler.negatives_per_shard), memory_plan.rows)
    logger.info(
        "BESS storage %s: at most %d unique rows per step and table set, %.1f MiB moved from the tier per "
        "step (and back); %s",
        tables.storage.describe(),
        step_rows,
        memory_plan.step_bytes(step_rows) / 2**20,
        memory_plan.describe(),
    )
