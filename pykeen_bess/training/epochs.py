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

The failure branch otherwise matches PyKEEN's: a ``RuntimeError`` or ``MemoryError`` writes the
failure checkpoint (handing it the best-epoch model when there is one), deletes the temporary
best-epoch file, and re-raises.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pathlib
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

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
import torch
from tqdm.autonotebook import tqdm, trange

from ..batch import BessBatch
from ..optim import BessOptimizer
from .config import run_configuration, verify_same_configuration
from .sizes import block_size_for
from ..sampling import BessSampler, EpochDraws
from .static_step import StaticStep, static_step_obstacle
from .step import BessOptimizerCallback, GlobalNormClippingCallback, StepRunner, ValueClippingCallback

if TYPE_CHECKING:
    from .loop import BessTrainingLoop

__all__ = [
    "EpochBatches",
    "run_epochs",
]

logger = logging.getLogger(__name__)


def run_epochs(  # noqa: C901  # PyKEEN's TrainingLoop._train restated with its differences named, to become PyKEEN's hooks
    loop: BessTrainingLoop,
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
    """Train a :class:`~pykeen_bess.training.BessTrainingLoop` for its epochs (the arguments of PyKEEN's ``_train``)."""
    if slice_size is not None:
        raise ValueError("BessTrainingLoop does not support slice_size; use sub_batch_size.")
    if sampler is not None:
        raise ValueError(f"BessTrainingLoop draws its own balanced batches; sampler={sampler!r} is not supported.")
    if num_workers:
        logger.info("num_workers has no effect: BESS sampling is vectorised in the main process.")
    topology = loop.topology
    main = topology.is_main_process
    partition = loop.partition(triples_factory)
    if drop_last:
        if batch_size is not None and batch_size > partition.num_triples:
            # PyKEEN's data loader would drop its only, incomplete batch: no batch at all
            raise NoTrainingBatchError()
        logger.info("drop_last has no effect: BESS steps never have incomplete batches (they are padded).")

    callback = MultiTrainingCallback(callbacks=callbacks, callbacks_kwargs=callbacks_kwargs)
    if loop.result_tracker is not None and main:
        callback.register_callback(TrackerTrainingCallback())
    if stopper is not None:
        callback.register_callback(
            StopperTrainingCallback(
                stopper,
                triples_factory=triples_factory,
                last_best_epoch=last_best_epoch,
                best_epoch_model_file_path=best_epoch_model_file_path,
            )
        )

    if topology.is_distributed:
        settings = run_configuration(
            loop,
            triples_factory,
            num_epochs=num_epochs,
            batch_size=batch_size,
            sub_batch_size=sub_batch_size,
            label_smoothing=label_smoothing,
            continue_training=continue_training,
        )
        verify_same_configuration(topology, settings)
    if not continue_training:
        loop.model.reset_parameters_()
        loop.tables.constrain_all()  # the loop defers the tables' constraints; apply them once to all rows
        for parameter in loop.tables.replicated_parameters():  # replicated: every process starts from rank 0's
            topology.broadcast_(parameter)
        loop.tables.now_hold_weights()
        loop.optimizer = loop.build_optimizer()
        if loop.lr_scheduler is not None:
            loop.lr_scheduler = loop.rebuild_lr_scheduler()
    elif not loop.optimizer.state and not loop.resumed_from_pbg:
        raise ValueError("Cannot continue_training without being trained once.")

    if batch_size is None:
        if loop.automatic_memory_optimization:
            batch_size = loop.sizes.batch_size(partition, label_smoothing, loop.device)
        else:
            batch_size = 256
            logger.info("No batch_size provided. Setting batch_size=%d.", batch_size)
    block_size = block_size_for(batch_size, topology.n_shard)
    if sub_batch_size is not None:
        sub_block_size = max(1, min(block_size, sub_batch_size // topology.n_shard**2))
    elif loop.automatic_memory_optimization and not only_size_probing and not continue_training:
        sub_block_size = loop.sizes.sub_block_size(partition, block_size, label_smoothing, loop.device)
    else:
        sub_block_size = block_size

    batches = loop.epoch_batches(triples_factory, batch_size=block_size * topology.n_shard**2)
    if main and not only_size_probing and loop.result_tracker is not None:
        # the sizes that train, after rounding (an HPO study records the values it suggested)
        trained = dict(batch_size=block_size * topology.n_shard**2, num_negs_per_pos=loop.config.num_negs_per_pos)
        loop.result_tracker.log_params(params=dict(bess=dict(trained, num_shards=topology.n_shard)))
    runner = loop.runner = loop.make_runner(block_size)
    pre_step: list[TrainingCallback] = []
    if gradient_clipping_max_norm is not None:
        pre_step.append(
            GlobalNormClippingCallback(loop.tables, topology, gradient_clipping_max_norm, gradient_clipping_norm_type)
        )
    if gradient_clipping_max_abs_value is not None:
        pre_step.append(ValueClippingCallback(loop.tables, gradient_clipping_max_abs_value))
    callback.register_callback(
        BessOptimizerCallback(runner, loop.tables, pre_step, constrain_rows=not loop.config.sparse_updates)
    )
    if loop.lr_scheduler is not None:
        callback.register_callback(LearningRateSchedulerTrainingCallback())
    callback.register_training_loop(loop)
    if main and not only_size_probing:
        logger.info(
            "BESS: %d steps per epoch of %d blocks x %d slots (sub-batches of %d), %d negatives per positive "
            "(%d per shard), exchange=%s, padding %.1f%%",
            len(batches),
            topology.n_shard**2,
            block_size,
            sub_block_size,
            loop.config.num_negs_per_pos,
            batches.sampler.negatives_per_shard,
            type(runner.scheme).get_name(),
            100 * batches.sampler.padding_fraction,
        )
        # a step's rows: heads and tails of the local blocks, the local shards' negatives of all blocks
        n, local = topology.n_shard, topology.n_local
        negative_sets = 1 if batches.sampler.shares_negatives else n * n
        step_rows = min(
            local * (2 * n * block_size + negative_sets * batches.sampler.negatives_per_shard), loop.memory_plan.rows
        )
        logger.info(
            "BESS storage %s: at most %d unique rows per step and table set, %.1f MiB moved from the tier per "
            "step (and back); %s",
            loop.tables.storage.describe(),
            step_rows,
            loop.memory_plan.step_bytes(step_rows) / 2**20,
            loop.memory_plan.describe(),
        )

    static = _static_step(
        loop, runner, batches, callback, block_size, sub_block_size, label_smoothing, only_size_probing
    )
    loop.static = static
    plans = _EpochPlans(batches.sampler, static, loop._epoch + 1, num_epochs) if static is not None else None

    show_epochs = use_tqdm and main and not only_size_probing
    epoch_kwargs = dict(desc=f"Training epochs on {loop.device}", unit="epoch", disable=not show_epochs)
    epoch_kwargs.update(tqdm_kwargs or {})
    epochs = trange(loop._epoch + 1, 1 + num_epochs, initial=loop._epoch, total=num_epochs, **epoch_kwargs)
    last_checkpoint = time.time()
    try:  # the thread drawing the next epochs' plans stops however training ends
        for epoch in epochs:
            try:
                loop.model.train()
                progress = tqdm(
                    total=len(batches),
                    desc=f"Training batches on {loop.device}",
                    leave=False,
                    unit="batch",
                    disable=not (show_epochs and use_tqdm_batch),
                )
                with progress:
                    if static is None:
                        steps = batches.epoch(epoch)
                        epoch_loss = 0.0
                    else:  # the full steps as one static step each, the steps with padding eagerly
                        assert plans is not None
                        draws, fields = plans.get(epoch)
                        epoch_loss = _static_steps(static, epoch, len(batches), fields, progress)
                        steps = batches.sampler.remaining_steps(draws, static.order_lookup, static.num_steps).batches()
                    for batch in steps:
                        with loop.thread_policy.unit():
                            epoch_loss += _step(
                                runner, callback, batch, sub_block_size, label_smoothing, len(batches), loop
                            )
                        progress.update(1)
                        if only_size_probing:
                            return None
                    if static is not None:
                        static.resume_after_eager()
                epoch_loss /= len(batches)
                loop.losses_per_epochs.append(epoch_loss)
                previous = loop.losses_per_epochs[-2] if len(loop.losses_per_epochs) > 1 else float("nan")
                epochs.set_postfix(dict(loss=epoch_loss, prev_loss=previous))
                loop._epoch = epoch
            except (MemoryError, RuntimeError) as error:
                if static is not None:
                    static.abandon()  # the optimizer's step counts as far as steps were applied
                if only_size_probing or isinstance(error, NonFiniteLossError):
                    # a non-finite loss leaves no partial update behind and must not be checkpointed
                    raise
                logger.warning("The training loop failed during epoch %d: %s", epoch, error)
                if checkpoint_on_failure_file_path and not topology.is_distributed:
                    best = best_epoch_model_file_path if last_best_epoch is not None else None
                    loop.checkpoints.save(pathlib.Path(checkpoint_on_failure_file_path), stopper, best, triples_factory)
                    logger.warning(
                        "Saved a failure checkpoint (the current parameters, epoch counter at the last finished "
                        "epoch) to %s; pass it as checkpoint_name (in its directory) to resume.",
                        checkpoint_on_failure_file_path,
                    )
                _remove(best_epoch_model_file_path)
                raise

            callback.post_epoch(epoch=epoch, epoch_loss=epoch_loss)
            if save_checkpoints and checkpoint_path is not None:
                minutes = (time.time() - last_checkpoint) // 60
                if minutes >= (checkpoint_frequency or 0) or loop._should_stop or epoch == num_epochs:
                    best = best_epoch_model_file_path if last_best_epoch is not None else None
                    loop._save_state(checkpoint_path, stopper, best, triples_factory)
                    last_checkpoint = time.time()
            if loop._should_stop:
                if last_best_epoch is not None and best_epoch_model_file_path is not None:
                    loop._load_state(path=best_epoch_model_file_path)
                    _remove(best_epoch_model_file_path)
                return loop.losses_per_epochs

    finally:
        if plans is not None:
            plans.close()

    callback.post_train(losses=loop.losses_per_epochs)
    if stopper is not None and last_best_epoch is not None and best_epoch_model_file_path is not None:
        loop._load_state(path=best_epoch_model_file_path)
        _remove(best_epoch_model_file_path)
    return loop.losses_per_epochs


def _step(
    runner: StepRunner,
    callback: MultiTrainingCallback,
    batch: Any,
    sub_block_size: int,
    label_smoothing: float,
    num_steps: int,
    loop: BessTrainingLoop,
) -> float:
    """One step: forward and backward, the global loss, then the callbacks (the optimizer step among them)."""
    callback.pre_batch()
    process_batch = loop._process_batch if loop.overrides_process_batch else None
    local_loss = runner.forward_backward(batch, sub_block_size, label_smoothing, process_batch)
    step_loss = float(runner.topology.all_reduce(local_loss))
    if step_loss != step_loss or step_loss in (float("inf"), float("-inf")):
        loop.optimizer.zero_grad(set_to_none=True)
        runner.rows = None
        raise NonFiniteLossError(
            f"The loss is non-finite ({step_loss}) in epoch {batch.epoch}, step {batch.step + 1}/{num_steps} "
            f"(global step {(batch.epoch - 1) * num_steps + batch.step + 1}). The step was not applied, and no "
            f"checkpoint was written for it. Lower the learning rate, add gradient clipping or check the model's "
            f"constraints."
        )
    runner.hand_off_gradients()
    callback.on_batch(epoch=batch.epoch, batch=batch, batch_loss=step_loss)
    callback.pre_step()
    callback.post_batch(epoch=batch.epoch, batch=batch)
    return step_loss


def _remove(path: pathlib.Path | None) -> None:
    """Delete the temporary best-epoch file (PyKEEN does so on failure and after loading it)."""
    if path is not None and pathlib.Path(path).is_file():
        os.remove(path)


def _static_step(
    loop: BessTrainingLoop,
    runner: StepRunner,
    batches: Any,
    callback: MultiTrainingCallback,
    block_size: int,
    sub_block_size: int,
    label_smoothing: float,
    only_size_probing: bool,
) -> StaticStep | None:
    """Return the static step of this training, or None where the eager step runs (the reason logged).

    :raises ValueError: if the loop asks for the static step (``static_step=True``) and it cannot apply
    """
    mode = loop.static_step
    if mode is False or only_size_probing or (mode is None and loop.device.type != "cuda"):
        return None
    if loop.overrides_process_batch:  # the hook runs on the host for every sub-batch: the eager step calls it
        if mode:
            raise ValueError(
                f"static_step=True: {type(loop).__name__} overrides _process_batch, which only the eager step calls; "
                f"pass static_step=False or None."
            )
        logger.info("BESS: the eager step trains this loop, whose subclass overrides _process_batch.")
        return None
    obstacle = static_step_obstacle(
        runner,
        loop.tables,
        loop.optimizer,
        batches.sampler,
        sub_block_size=sub_block_size,
        block_size=block_size,
        callbacks=callback.callbacks,
        weighted=loop.loss_weighter is not None,
    )
    if obstacle is not None:
        if mode:
            raise ValueError(f"static_step=True: the static step cannot train this configuration: {obstacle}.")
        logger.info("BESS: the eager step trains this configuration; the static step cannot, as %s.", obstacle)
        return None
    optimizer = loop.optimizer
    assert isinstance(optimizer, BessOptimizer)  # static_step_obstacle refuses any other
    static = StaticStep(
        runner, loop.tables, optimizer, loop.model, batches.sampler, label_smoothing, capture=mode is None
    )
    logger.info(
        "BESS: %d of %d steps per epoch run as the static step%s; the rest (with padding) eagerly.",
        static.num_steps,
        len(batches),
        " (captured as a CUDA graph)" if static.capture else "",
    )
    return static


def _static_steps(
    static: StaticStep, epoch: int, num_steps: int, fields: dict[str, torch.Tensor], progress: Any
) -> float:
    """Run the full steps of an epoch as static steps; return the sum of their losses (one host read).

    :raises NonFiniteLossError: if a step's loss was non-finite (that step and the later ones wrote nothing)
    """
    static.load_plan(fields)
    static.run(static.num_steps, progress)
    loss_sum, applied = static.finish_epoch()
    if applied < static.num_steps:
        raise NonFiniteLossError(
            f"The loss is non-finite in epoch {epoch}, step {applied + 1}/{num_steps} (global step "
            f"{(epoch - 1) * num_steps + applied + 1}). Neither that step nor a later one was applied, and no "
            f"checkpoint was written for it. Lower the learning rate, add gradient clipping or check the model's "
            f"constraints."
        )
    return loss_sum


class _EpochPlans:
    """The plans of the epochs ``first..last``, each drawn (and pinned) on a thread while the epoch before trains."""

    def __init__(self, sampler: BessSampler, static: StaticStep, first: int, last: int):
        self.sampler = sampler
        self.static = static
        self.last = last
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bess-plan")
        self._pending: dict[int, concurrent.futures.Future] = {}
        if first <= last:
            self._submit(first)

    def _draw(self, epoch: int) -> tuple[EpochDraws, dict[str, torch.Tensor]]:
        draws = self.sampler.draw_epoch(epoch, self.static.num_steps)
        return draws, self.static.host_plan(draws)

    def _submit(self, epoch: int) -> None:
        if epoch <= self.last and epoch not in self._pending:
            self._pending[epoch] = self._executor.submit(self._draw, epoch)

    def get(self, epoch: int) -> tuple[EpochDraws, dict[str, torch.Tensor]]:
        """Return the plan of ``epoch`` (and its device-ready tensors) and start drawing the next one."""
        self._submit(epoch)
        result = self._pending.pop(epoch).result()
        self._submit(epoch + 1)
        return result

    def close(self) -> None:
        """Stop drawing plans."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._executor.shutdown(wait=True)


class EpochBatches:
    """The batches of consecutive epochs (what PyKEEN's data loader is to its loop).

    :meth:`epoch` gives the steps of a given epoch; iterating gives those of the next epoch, from
    ``first_epoch`` on, as iterating a data loader once per epoch does.
    """

    def __init__(self, sampler: BessSampler, first_epoch: int):
        """Start at ``first_epoch`` (1-based)."""
        self.sampler = sampler
        self.next_epoch = first_epoch

    def __len__(self) -> int:
        return len(self.sampler)

    def epoch(self, epoch: int) -> Iterator[BessBatch]:
        """Return the steps of ``epoch`` (1-based); the next iteration continues after it."""
        self.next_epoch = epoch + 1
        return self.sampler.epoch(epoch)

    def __iter__(self) -> Iterator[BessBatch]:
        return self.epoch(self.next_epoch)
