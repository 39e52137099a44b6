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
   The best epoch's state dict holds tables in files by value (as every state dict outside a
   checkpoint does).
10. The stopper's best weights are kept beside every checkpoint and given back to the stopper of a
    resumed run (:mod:`~pykeen_bess.training.checkpoints.stopper_weights`): PyKEEN's checkpoint keeps the
    stopper's best epoch but not its weights file, and a run resumed after its best epoch failed when it
    stopped. A checkpoint read from another layout of shards reshards the copies with it.
11. PyKEEN's checkpoint callback saves the model with its own embeddings holding the tables' rows
    (PyKEEN's layout, which a fresh PyKEEN model loads; :func:`pykeen_layout_checkpoints`): during
    training the model's entity representations are the shard tables. Where no process holds every
    shard on its device (process groups, tables in host memory or files, the encoding partition) the
    callback is refused before training.
12. The early stopper's best-weights file left after training (``best_model_path``: training ended without
    stopping, or ``clean_up_checkpoint=False``) is rewritten as the trained model's state dict (PyKEEN's
    keys and entity order where the model holds its own embeddings again; :func:`stopper_file_layout`),
    and back in the tables' layout when a later training with the same stopper starts. Only a file the
    stopper wrote; in one process (under a process group every rank keeps its own shards' file).

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
from typing import Any, Protocol

import torch
from pykeen.stoppers import Stopper
from pykeen.training.callbacks import TrainingCallbackHint, TrainingCallbackKwargsHint
from pykeen.training.training_loop import NonFiniteLossError
from pykeen.triples import CoreTriplesFactory
from tqdm.autonotebook import tqdm, trange

from ..distributed import Topology
from ..runtime.threads import ThreadPolicy
from .checkpoints.stores import CheckpointStore
from .checkpoints.stopper_weights import (
    copy_suffix,
    keep_stopper_weights,
    layout_suffixes,
    prune_stopper_weights,
    reshard_stopper_weights,
    restore_stopper_weights,
    table_keys,
)
from .epoch_steps import EpochPlans, eager_step, static_steps
from .steps.static_step import per_step_hooks
from .steps.static_update import Clipping
from .training_run import TrainingRun, TrainingStart

__all__ = [
    "EpochLoop",
    "run_epochs",
]

logger = logging.getLogger(__name__)


class EpochLoop(Protocol):
    """What the epochs use of the training loop (:class:`~pykeen_bess.training.BessTrainingLoop` is one)."""

    #: the trained model
    model: Any
    #: the optimizer of the tables and the replicated parameters
    optimizer: torch.optim.Optimizer
    #: how many intra-op threads the steps run with
    thread_policy: ThreadPolicy
    #: the last completed epoch
    _epoch: int
    #: the mean step loss of every completed epoch
    losses_per_epochs: list[float]
    #: set by PyKEEN's stopper callback to end training
    _should_stop: bool

    @property
    def device(self) -> torch.device:
        """The device the steps run on."""

    @property
    def topology(self) -> Topology:
        """The processes that train together."""

    @property
    def checkpoints(self) -> CheckpointStore:
        """The checkpoint store (the failure checkpoint; the layout a resumed checkpoint was read from)."""

    def start_training(self, triples_factory: CoreTriplesFactory, start: TrainingStart) -> TrainingRun:
        """Build the run's batches, steps and callbacks before its first epoch."""

    def finish_epoch(self, epoch: int, loss: float) -> None:
        """Record a completed epoch."""

    def _save_state(self, path: Any, stopper: Stopper | None, best: Any, triples_factory: CoreTriplesFactory) -> None:
        """Write a checkpoint (PyKEEN's hook)."""

    def _load_state(self, path: Any) -> Any:
        """Load a checkpoint (PyKEEN's hook)."""


def run_epochs(
    loop: EpochLoop,
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
    """Train a loop for its epochs (the arguments of PyKEEN's ``_train``); the loop builds the run's parts first.

    PyKEEN's ``TrainingLoop._train`` in its order; the numbers name the differences of the module docstring.
    """
    topology = loop.topology
    best = best_epoch_model_file_path if last_best_epoch is not None else None
    clipping = Clipping(gradient_clipping_max_norm, gradient_clipping_norm_type, gradient_clipping_max_abs_value)
    start = TrainingStart(
        num_epochs, batch_size, sub_batch_size, label_smoothing, continue_training, only_size_probing, clipping,
        callbacks, callbacks_kwargs, stopper, last_best_epoch, best_epoch_model_file_path,
        slice_size, sampler, num_workers, drop_last,
    )  # fmt: skip
    run = loop.start_training(triples_factory, start)  # 3.-6.
    if stopper is not None and save_checkpoints and checkpoint_path is not None:  # 10.: a resumed run's
        _restore_stopper_weights(loop, pathlib.Path(checkpoint_path), stopper)
    callback = run.callback
    static = run.static
    plans = EpochPlans(run.batches.sampler, static, loop._epoch + 1, num_epochs) if static is not None else None
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
                epoch_loss = _run_epoch(loop, run, plans, epoch, show and use_tqdm_batch, only_size_probing)
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
                    _checkpoint(loop, pathlib.Path(checkpoint_path), stopper, best, triples_factory)  # 7., 10.
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


def _run_epoch(
    loop: EpochLoop, run: TrainingRun, plans: EpochPlans | None, epoch: int, show: bool, only_size_probing: bool
) -> float | None:
    """Run the steps of one epoch; return the mean step loss (None after the one step of a size probe).

    The steps run as static steps where there is one, else eagerly (difference 2: ``on_batch`` gets each
    step's loss once).
    """
    batches, callback = run.batches, run.callback
    progress = tqdm(
        total=len(batches), desc=f"Training batches on {loop.device}", leave=False, unit="batch", disable=not show
    )
    with progress:
        if run.static is not None:
            assert plans is not None
            _, fields = plans.get(epoch)
            per_step = callback if per_step_hooks(callback.callbacks) else None
            epoch_loss = static_steps(
                run.static, epoch, len(batches), fields, progress, per_step, loop.thread_policy.unit
            )
            return epoch_loss / len(batches)
        epoch_loss = 0.0
        for batch in batches.epoch(epoch):
            with loop.thread_policy.unit():
                epoch_loss += eager_step(
                    run.runner,
                    callback,
                    batch,
                    run.sub_block_size,
                    run.label_smoothing,
                    len(batches),
                    loop.optimizer,
                    run.process_batch,
                )
            progress.update(1)
            if only_size_probing:
                return None
    return epoch_loss / len(batches)


def _after_failure(
    loop: EpochLoop,
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
        _checkpoint(loop, pathlib.Path(checkpoint_on_failure_file_path), stopper, best, triples_factory)
        logger.warning(
            "Saved a failure checkpoint (the current parameters, epoch counter at the last finished "
            "epoch) to %s; pass it as checkpoint_name (in its directory) to resume.",
            checkpoint_on_failure_file_path,
        )


def _checkpoint(
    loop: EpochLoop, path: pathlib.Path, stopper: Stopper | None, best: pathlib.Path | None, triples_factory: Any
) -> None:
    """Write a checkpoint through the loop's store (7.), the stopper's best weights beside it (10.)."""
    suffix = copy_suffix(loop.topology)
    keep_stopper_weights(path, stopper, suffix)
    loop._save_state(path, stopper, best, triples_factory)
    loop.checkpoints.mark_written(path)  # (the failure checkpoint: resuming it takes the run's files)
    prune_stopper_weights(path, stopper, suffix, layout_suffixes(loop.topology))


def _restore_stopper_weights(loop: EpochLoop, checkpoint: pathlib.Path, stopper: Stopper) -> None:
    """Give a resumed run's stopper its best weights (10.): its copies, or resharded from the checkpoint's layout's."""
    store, topology = loop.checkpoints, loop.topology
    files = store.resharded_from
    resharded = None
    if files is not None:  # the checkpoint's copies hold other shards than this process'

        def resharded(target: pathlib.Path, epoch: int) -> bool:
            keys = table_keys(loop.model, store.held_tables())
            return reshard_stopper_weights(
                checkpoint, epoch, target, files, store.sharding, topology.local_shards, keys
            )

    restore_stopper_weights(checkpoint, stopper, topology, resharded)


def _restore_best(loop: EpochLoop, best_epoch_model_file_path: pathlib.Path | None) -> None:
    """Load the best epoch's model the stopper kept, and delete its temporary file (as PyKEEN does)."""
    if best_epoch_model_file_path is not None:
        loop._load_state(path=best_epoch_model_file_path)
        _remove(best_epoch_model_file_path)


def _remove(path: pathlib.Path | None) -> None:
    """Delete the temporary best-epoch file (PyKEEN does so on failure and after loading it)."""
    if path is not None and pathlib.Path(path).is_file():
        os.remove(path)
