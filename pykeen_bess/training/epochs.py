"""The epochs of BESS training: :func:`run_epochs` is the training loop's ``_train``.

It follows PyKEEN 1.11's :meth:`pykeen.training.TrainingLoop._train` step by step (callbacks for
the tracker, the stopper, the optimizer step and the learning-rate scheduler; reset or continue;
the batch size; the epochs with checkpoints, the stopper and the failure branch) and differs
deliberately in these points:

1. The step loss is summed over the sub-batches and the processes before it is checked, so a
   non-finite loss raises :class:`~pykeen.training.training_loop.NonFiniteLossError` in every
   process at once (PyKEEN checks each sub-batch's local loss: one rank would raise while the
   others wait in a collective). The step is then not applied, and no checkpoint is written for it
   (PyKEEN's failure branch would write one).
2. ``on_batch`` receives the step's loss once per step (PyKEEN: each sub-batch's share); the epoch
   loss is the mean of the step losses.
3. Between backward and the callbacks' ``pre_step``, the gathered rows' gradients are handed to the
   shard tables and replicated gradients are summed over the processes; gradient clipping uses the
   global norm over all shards (PyKEEN's callbacks compute a local norm).
4. ``batch_size=None`` searches on the CPU too (with a memory budget) and all processes agree on
   the outcome; PyKEEN uses 256 on the CPU. Sub-batches are searched unless ``sub_batch_size`` is
   given.
5. Only the main process shows progress bars and logs to the result tracker.
6. ``slice_size``, ``sampler``, ``num_workers``, ``drop_last`` and ``pin_memory`` do not apply:
   BESS draws its own balanced, padded batches in the main process. As in PyKEEN, ``drop_last=True``
   with a ``batch_size`` larger than the training triples raises
   :class:`~pykeen.training.training_loop.NoTrainingBatchError` (PyKEEN would drop its only batch).
7. Under a process group a failure writes no failure checkpoint (the other ranks may be
   unreachable); checkpoints are written by the loop's checkpoint store (atomic or versioned).

8. PyKEEN's per-batch hooks: a subclass's ``_process_batch`` (one sub-batch's loss) is called for every
   sub-batch of every step (by the eager step, which then trains every step). ``_train_epoch`` and
   ``_forward_pass`` are not called: a BESS step gathers its rows once for all its sub-batches and
   checks the loss summed over them and over the processes (point 1), so a loop refuses a subclass
   that overrides them when it is created. PyKEEN's ``evaluation-loss`` callback calls the loop's
   ``_create_training_data_loader`` and ``_train_epoch`` (``backward=False``) after every epoch: they
   compute the loss of its triples as PyKEEN's ``SLCWATrainingLoop`` does (PyKEEN's sLCWA batches with
   the loop's ``num_negs_per_pos`` and ``corruption``, on the model's current tables, without
   gradients or updates), in one process; under a process group the callback is refused when
   training starts.
9. The stopper evaluates the tables as row shards: the encoding partition over processes lends the
   model the row shards its column parts make while the stopper evaluates, keeps the best epoch
   and, stopping, loads it (:class:`RowShardStopperCallback`); other tables already are row shards.
   The best epoch's state dict holds tables in files by value (PyKEEN's stopper keeps the model's
   state dict, which otherwise names the live files, whose values change).

The failure branch otherwise matches PyKEEN's: a ``RuntimeError`` or ``MemoryError`` writes the
failure checkpoint (handing it the best-epoch model when there is one), deletes the temporary
best-epoch file, and re-raises.
"""

from __future__ import annotations

import logging
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any

from pykeen.stoppers import Stopper
from pykeen.training.callbacks import (
    LearningRateSchedulerTrainingCallback,
    MultiTrainingCallback,
    StopperTrainingCallback,
    TrackerTrainingCallback,
    TrainingCallback,
    TrainingCallbackHint,
    TrainingCallbackKwargsHint,
)
from pykeen.training.training_loop import NonFiniteLossError, NoTrainingBatchError
from pykeen.triples import CoreTriplesFactory
from tqdm.autonotebook import tqdm, trange

from ..data.partition import ShardPairPartition
from .parts import LoopParts
from .setup.config import verify_same_configuration
from .epoch_steps import EpochBatches, EpochPlans, eager_step, make_static_step, static_steps
from .setup.sizes import block_size_for
from .steps.static_step import StaticStep, per_step_hooks
from .steps.static_update import Clipping
from .steps.runner import BessOptimizerCallback, GlobalNormClippingCallback, StepRunner, ValueClippingCallback

__all__ = [
    "EpochBatches",
    "run_epochs",
]

logger = logging.getLogger(__name__)


def run_epochs(
    loop: LoopParts,
    triples_factory: CoreTriplesFactory,
    num_epochs: int = 1,
    batch_size: int | None = None,
    slice_size: int | None = None,
    label_smoothing: float = 0.0,
    sampler: str | None = None,
    continue_training: bool = False,
    only_size_probing: bool = False,
    use_tqdm: bool = True,
    use_tqdm_batch: bool = True,
    tqdm_kwargs: Mapping[str, Any] | None = None,
    stopper: Stopper | None = None,
    sub_batch_size: int | None = None,
    num_workers: int | None = None,
    save_checkpoints: bool = False,
    checkpoint_path: None | str | pathlib.Path = None,
    checkpoint_frequency: int | None = None,
    checkpoint_on_failure_file_path: None | str | pathlib.Path = None,
    best_epoch_model_file_path: pathlib.Path | None = None,
    last_best_epoch: int | None = None,
    drop_last: bool | None = None,
    callbacks: TrainingCallbackHint = None,
    callbacks_kwargs: TrainingCallbackKwargsHint = None,
    gradient_clipping_max_norm: float | None = None,
    gradient_clipping_norm_type: float | None = None,
    gradient_clipping_max_abs_value: float | None = None,
    pin_memory: bool = True,
) -> list[float] | None:
    """Train a :class:`~pykeen_bess.training.BessTrainingLoop` for its epochs (the arguments of PyKEEN's ``_train``).

    PyKEEN's ``TrainingLoop._train`` in its order; the numbers name the differences of the module docstring.
    """
    partition = loop.partition(triples_factory)
    _refuse_what_does_not_apply(slice_size, sampler, num_workers, drop_last, batch_size, partition)  # 6.
    topology = loop.topology
    best = best_epoch_model_file_path if last_best_epoch is not None else None
    callback = _pykeen_callbacks(  # 5.
        loop, triples_factory, callbacks, callbacks_kwargs, stopper, last_best_epoch, best_epoch_model_file_path
    )
    if topology.is_distributed:  # every rank trains with the same settings
        arguments: dict[str, Any] = dict(num_epochs=num_epochs, batch_size=batch_size, sub_batch_size=sub_batch_size)
        arguments.update(label_smoothing=label_smoothing, continue_training=continue_training)
        # the static and the eager step, and clipping, run different collectives
        arguments.update(static_step=loop.static_step, gradient_clipping_max_norm=gradient_clipping_max_norm)
        arguments.update(gradient_clipping_norm_type=gradient_clipping_norm_type)
        arguments.update(gradient_clipping_max_abs_value=gradient_clipping_max_abs_value)
        verify_same_configuration(topology, loop.run_configuration(triples_factory, **arguments))
    _reset_or_continue(loop, continue_training)
    block_size, sub_block_size = _step_sizes(  # 4.
        loop, partition, batch_size, sub_batch_size, label_smoothing, probing=only_size_probing or continue_training
    )
    batches = loop.epoch_batches(triples_factory, batch_size=block_size * topology.n_shard**2)
    runner = loop.make_runner(block_size)
    clipping = Clipping(gradient_clipping_max_norm, gradient_clipping_norm_type, gradient_clipping_max_abs_value)
    static = make_static_step(
        loop.static_step,
        type(loop).__name__ if loop.overrides_process_batch else None,
        loop.optimizer,
        loop.tables,
        loop.model,
        loop.settings.memory_budget,
        runner,
        batches,
        block_size,
        sub_block_size,
        label_smoothing,
        clipping,
        only_size_probing,
    )
    loop.use_steps(runner, static)
    _register_step_callbacks(loop, callback, runner, clipping, eager=static is None)  # 3.
    callback.register_training_loop(loop)
    if topology.is_main_process and not only_size_probing:
        _log_plan(loop, batches, runner, block_size, sub_block_size)
    plans = EpochPlans(batches.sampler, static, loop._epoch + 1, num_epochs) if static is not None else None
    show = use_tqdm and topology.is_main_process and not only_size_probing  # 5.
    epochs = trange(
        loop._epoch + 1,
        1 + num_epochs,
        initial=loop._epoch,
        total=num_epochs,
        **{"desc": f"Training epochs on {loop.device}", "unit": "epoch", "disable": not show, **(tqdm_kwargs or {})},
    )
    last_checkpoint = time.time()
    try:  # the thread drawing the next epochs' plans stops however training ends
        for epoch in epochs:
            try:
                loop.model.train()
                epoch_loss = _run_epoch(
                    loop, runner, callback, batches, static, plans, epoch, sub_block_size, label_smoothing,
                    show and use_tqdm_batch, only_size_probing,
                )  # fmt: skip
                if epoch_loss is None:  # size probing: one step
                    return None
                previous = loop.losses_per_epochs[-1] if loop.losses_per_epochs else float("nan")
                loop.finish_epoch(epoch, epoch_loss)
                epochs.set_postfix(dict(loss=epoch_loss, prev_loss=previous))
            except (MemoryError, RuntimeError) as error:
                if static is not None:
                    static.abandon()  # the optimizer's step counts as far as steps were applied
                if only_size_probing or isinstance(error, NonFiniteLossError):  # 1.: no partial update to checkpoint
                    raise
                _after_failure(loop, error, epoch, checkpoint_on_failure_file_path, stopper, best, triples_factory)
                _remove(best_epoch_model_file_path)
                raise
            callback.post_epoch(epoch=epoch, epoch_loss=epoch_loss)
            if save_checkpoints and checkpoint_path is not None:
                minutes = (time.time() - last_checkpoint) // 60
                if minutes >= (checkpoint_frequency or 0) or loop._should_stop or epoch == num_epochs:
                    loop._save_state(checkpoint_path, stopper, best, triples_factory)  # 7.: the store's files
                    last_checkpoint = time.time()
            if loop._should_stop:
                _restore_best(loop, best)
                return loop.losses_per_epochs
    finally:
        if plans is not None:
            plans.close()
    callback.post_train(losses=loop.losses_per_epochs)
    if stopper is not None:
        _restore_best(loop, best)
    return loop.losses_per_epochs


def _pykeen_callbacks(
    loop: LoopParts,
    triples_factory: CoreTriplesFactory,
    callbacks: TrainingCallbackHint,
    callbacks_kwargs: TrainingCallbackKwargsHint,
    stopper: Stopper | None,
    last_best_epoch: int | None,
    best_epoch_model_file_path: pathlib.Path | None,
) -> MultiTrainingCallback:
    """Return the user's callbacks, the tracker's (difference 5: main process only) and the stopper's, as PyKEEN's."""
    callback = MultiTrainingCallback(callbacks=callbacks, callbacks_kwargs=callbacks_kwargs)
    if loop.result_tracker is not None and loop.topology.is_main_process:
        callback.register_callback(TrackerTrainingCallback())
    if stopper is not None:
        callback.register_callback(
            RowShardStopperCallback(  # 9.
                stopper,
                triples_factory=triples_factory,
                last_best_epoch=last_best_epoch,
                best_epoch_model_file_path=best_epoch_model_file_path,
            )
        )
    return callback


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
        # it keeps them as the model's state dict, in which tables in files must be values, not the live files
        with tables.row_shards(loop.optimizer, write=True), tables.values_in_state_dict():
            super().post_epoch(epoch=epoch, epoch_loss=epoch_loss, **kwargs)


def _refuse_what_does_not_apply(
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


def _reset_or_continue(loop: LoopParts, continue_training: bool) -> None:
    """Fresh parameters and optimizer unless training continues, as PyKEEN does (over the shard tables).

    :raises ValueError: for ``continue_training`` of a loop that never trained
    """
    if continue_training:
        if not loop.optimizer.state and not loop.resumed_from_pbg:
            raise ValueError("Cannot continue_training without being trained once.")
        return
    loop.model.reset_parameters_()
    loop.tables.constrain_all()  # the loop defers the tables' constraints; apply them once to all rows
    for parameter in loop.tables.replicated_parameters():  # replicated: every process starts from rank 0's
        loop.topology.broadcast_(parameter)
    loop.tables.now_hold_weights()
    loop.fresh_optimizer()


def _step_sizes(
    loop: LoopParts,
    partition: ShardPairPartition,
    batch_size: int | None,
    sub_batch_size: int | None,
    label_smoothing: float,
    probing: bool,
) -> tuple[int, int]:
    """Difference 4: slots per block and per sub-batch; ``batch_size=None`` searches on the CPU too.

    The batch size is logged to the result tracker as it trains, after rounding (an HPO study records
    the values it suggested).
    """
    n2 = loop.topology.n_shard**2
    if batch_size is None:
        if loop.automatic_memory_optimization:
            batch_size = loop.sizes.batch_size(partition, label_smoothing, loop.device)
        else:
            batch_size = 256
            logger.info("No batch_size provided. Setting batch_size=%d.", batch_size)
    block_size = block_size_for(batch_size, loop.topology.n_shard)
    if sub_batch_size is not None:
        sub_block_size = max(1, min(block_size, sub_batch_size // n2))
    elif loop.automatic_memory_optimization and not probing:
        sub_block_size = loop.sizes.sub_block_size(partition, block_size, label_smoothing, loop.device)
    else:
        sub_block_size = block_size
    return block_size, sub_block_size


def _register_step_callbacks(
    loop: LoopParts, callback: MultiTrainingCallback, runner: StepRunner, clipping: Clipping, eager: bool
) -> None:
    """Difference 3: BESS's optimizer step (gradients of gathered rows to the tables, global-norm clipping).

    The static step updates and clips within the step; the eager step's optimizer step is a callback.
    """
    if eager:
        pre_step: list[TrainingCallback] = []
        if clipping.max_norm is not None:
            pre_step.append(
                GlobalNormClippingCallback(loop.tables, loop.topology, clipping.max_norm, clipping.norm_type)
            )
        if clipping.max_abs_value is not None:
            pre_step.append(ValueClippingCallback(loop.tables, clipping.max_abs_value))
        callback.register_callback(
            BessOptimizerCallback(runner, loop.tables, pre_step, constrain_rows=not loop.config.sparse_updates)
        )
    if loop.lr_scheduler is not None:
        callback.register_callback(LearningRateSchedulerTrainingCallback())


def _log_plan(loop: LoopParts, batches: EpochBatches, runner: StepRunner, block_size: int, sub_block_size: int) -> None:
    """Log the steps of an epoch, the trained sizes (to the result tracker too) and the rows a step moves."""
    topology, sampler = loop.topology, batches.sampler
    if loop.result_tracker is not None:
        trained = dict(batch_size=block_size * topology.n_shard**2, num_negs_per_pos=loop.config.num_negs_per_pos)
        loop.result_tracker.log_params(params=dict(bess=dict(trained, num_shards=topology.n_shard)))
    logger.info(
        "BESS: %d steps per epoch of %d blocks x %d slots (sub-batches of %d), %d negatives per positive "
        "(%d per shard), exchange=%s, padding %.1f%%",
        len(batches),
        topology.n_shard**2,
        block_size,
        sub_block_size,
        loop.config.num_negs_per_pos,
        sampler.negatives_per_shard,
        type(runner.scheme).get_name(),
        100 * sampler.padding_fraction,
    )
    # a step's rows: heads and tails of the local blocks, the local shards' negatives of all blocks
    n, local = topology.n_shard, topology.n_local
    negative_sets = 1 if sampler.shares_negatives else n * n
    step_rows = min(local * (2 * n * block_size + negative_sets * sampler.negatives_per_shard), loop.memory_plan.rows)
    logger.info(
        "BESS storage %s: at most %d unique rows per step and table set, %.1f MiB moved from the tier per "
        "step (and back); %s",
        loop.tables.storage.describe(),
        step_rows,
        loop.memory_plan.step_bytes(step_rows) / 2**20,
        loop.memory_plan.describe(),
    )


def _run_epoch(
    loop: LoopParts,
    runner: StepRunner,
    callback: MultiTrainingCallback,
    batches: EpochBatches,
    static: StaticStep | None,
    plans: EpochPlans | None,
    epoch: int,
    sub_block_size: int,
    label_smoothing: float,
    show: bool,
    only_size_probing: bool,
) -> float | None:
    """Run the steps of one epoch; return the mean step loss (None after the one step of a size probe).

    The steps run as static steps where there is one, else eagerly (difference 2: ``on_batch`` gets each
    step's loss once).
    """
    progress = tqdm(
        total=len(batches), desc=f"Training batches on {loop.device}", leave=False, unit="batch", disable=not show
    )
    with progress:
        if static is not None:
            assert plans is not None
            _, fields = plans.get(epoch)
            per_step = callback if per_step_hooks(callback.callbacks) else None
            epoch_loss = static_steps(static, epoch, len(batches), fields, progress, per_step, loop.thread_policy.unit)
            return epoch_loss / len(batches)
        epoch_loss = 0.0
        process_batch = loop._process_batch if loop.overrides_process_batch else None
        for batch in batches.epoch(epoch):
            with loop.thread_policy.unit():
                epoch_loss += eager_step(
                    runner,
                    callback,
                    batch,
                    sub_block_size,
                    label_smoothing,
                    len(batches),
                    loop.optimizer,
                    process_batch,
                )
            progress.update(1)
            if only_size_probing:
                return None
    return epoch_loss / len(batches)


def _after_failure(
    loop: LoopParts,
    error: BaseException,
    epoch: int,
    checkpoint_on_failure_file_path: None | str | pathlib.Path,
    stopper: Stopper | None,
    best: pathlib.Path | None,
    triples_factory: CoreTriplesFactory,
) -> None:
    """PyKEEN's failure branch: the failure checkpoint, except under a process group (difference 7)."""
    logger.warning("The training loop failed during epoch %d: %s", epoch, error)
    if checkpoint_on_failure_file_path and not loop.topology.is_distributed:
        loop.checkpoints.save(pathlib.Path(checkpoint_on_failure_file_path), stopper, best, triples_factory)
        logger.warning(
            "Saved a failure checkpoint (the current parameters, epoch counter at the last finished "
            "epoch) to %s; pass it as checkpoint_name (in its directory) to resume.",
            checkpoint_on_failure_file_path,
        )


def _restore_best(loop: LoopParts, best_epoch_model_file_path: pathlib.Path | None) -> None:
    """Load the best epoch's model the stopper kept, and delete its temporary file (as PyKEEN does)."""
    if best_epoch_model_file_path is not None:
        loop._load_state(path=best_epoch_model_file_path)
        _remove(best_epoch_model_file_path)


def _remove(path: pathlib.Path | None) -> None:
    """Delete the temporary best-epoch file (PyKEEN does so on failure and after loading it)."""
    if path is not None and pathlib.Path(path).is_file():
        os.remove(path)
