"""The steps of an epoch: the static step, the eager step and the plans of the coming epochs.

:func:`make_static_step` decides whether the steps of the epochs run as the static step
(:mod:`~pykeen_bess.training.steps.static_step`, wherever the configuration allows) and
:func:`static_steps` runs an epoch of them; :func:`eager_step` runs one step of the configurations
it cannot train (forward and backward over its sub-batches, the loss summed over the sub-batches
and the processes and checked, the gradients handed to the tables, then the callbacks with the
optimizer step); :class:`EpochPlans` draws the next epoch's plan on a thread while an epoch
trains; :class:`EpochBatches` is what PyKEEN's data loader is to its loop.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from pykeen.training.callbacks import MultiTrainingCallback
from pykeen.training.training_loop import NonFiniteLossError

from ..data.batch import BessBatch
from ..tables.optim import BessOptimizer
from ..data.sampling import BessSampler, EpochDraws
from ..runtime.threads import one_thread_here
from .steps.static_step import StaticStep, static_step_obstacle
from .steps.static_update import Clipping
from .steps.runner import StepRunner
from ..tables.shard_tables import ShardTables

__all__ = ["EpochBatches", "EpochPlans", "eager_step", "make_static_step", "static_steps"]

logger = logging.getLogger(__name__)


def eager_step(
    runner: StepRunner,
    callback: MultiTrainingCallback,
    batch: Any,
    sub_block_size: int,
    label_smoothing: float,
    num_steps: int,
    optimizer: torch.optim.Optimizer,
    process_batch: Callable[..., Any] | None = None,
) -> float:
    """One step: forward and backward, the global loss, then the callbacks (the optimizer step among them).

    :param process_batch: the loop's own ``_process_batch`` where a subclass overrides it (None: BESS's)
    """
    callback.pre_batch()
    local_loss = runner.forward_backward(batch, sub_block_size, label_smoothing, process_batch)
    step_loss = float(runner.topology.all_reduce(local_loss))
    if step_loss != step_loss or step_loss in (float("inf"), float("-inf")):
        optimizer.zero_grad(set_to_none=True)
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


def make_static_step(
    mode: bool | None,
    loop_name: str | None,
    optimizer: torch.optim.Optimizer,
    tables: ShardTables,
    model: Any,
    memory_budget: int | None,
    runner: StepRunner,
    batches: Any,
    block_size: int,
    sub_block_size: int,
    label_smoothing: float,
    clipping: Clipping,
    only_size_probing: bool,
) -> StaticStep | None:
    """Return the static step of this training, or None where the eager step runs (the reason logged).

    :param mode: the loop's ``static_step`` (True: required, None: where it applies, False: never)
    :param loop_name: the loop's class name where a subclass overrides ``_process_batch`` (None: it does not)
    :param memory_budget: the device's bytes for staging and the replicated parameters (None: the default)
    :raises ValueError: if the loop asks for the static step (``static_step=True``) and it cannot apply
    """
    if mode is False or only_size_probing:
        return None
    if loop_name is not None:  # the hook runs on the host for every sub-batch: the eager step calls it
        if mode:
            raise ValueError(
                f"static_step=True: {loop_name} overrides _process_batch, which only the eager step calls; "
                f"pass static_step=False or None."
            )
        logger.info("BESS: the eager step trains this loop, whose subclass overrides _process_batch.")
        return None
    obstacle = static_step_obstacle(optimizer)
    if obstacle is not None:
        if mode:
            raise ValueError(f"static_step=True: the static step cannot train this configuration: {obstacle}.")
        logger.info("BESS: the eager step trains this configuration; the static step cannot, as %s.", obstacle)
        return None
    assert isinstance(optimizer, BessOptimizer)  # static_step_obstacle refuses any other
    static = StaticStep(
        runner,
        tables,
        optimizer,
        model,
        batches.sampler,
        label_smoothing,
        capture=mode is None,
        sub_block_size=sub_block_size,
        clipping=clipping,
        memory_budget=memory_budget,
    )
    padded = len(static.plan.kinds) - 1
    logger.info(
        "BESS: the static step trains all %d steps per epoch%s%s.",
        len(batches),
        f" ({padded} with padding, each its own step kind)" if padded else "",
        " (captured as CUDA graphs)" if static.capture else "",
    )
    if mode is None and static.device.type == "cuda" and static.capture_obstacle is not None:
        logger.info("BESS: the static step runs uncaptured: %s.", static.capture_obstacle)
    if static.rows_io.staged:  # (chooses the staging depth: a budget too small for it raises here)
        logger.info("BESS: %s.", static.rows_io.describe())
    return static


def static_steps(
    static: StaticStep,
    epoch: int,
    num_steps: int,
    fields: dict[str, torch.Tensor],
    progress: Any,
    callback: MultiTrainingCallback | None,
    unit: Callable[[], contextlib.AbstractContextManager],
) -> float:
    """Run the steps of an epoch as static steps; return the sum of their losses (one host read).

    :param callback: the callbacks, if one of them has a per-step hook: they are called around every
        step (``pre_batch`` before it; ``on_batch`` with its loss, read on the host, ``pre_step`` and
        ``post_batch`` after it, the update done); None: the loss is read once, at the end
    :param unit: a context manager around every step (the thread policy's unit of work)
    :raises NonFiniteLossError: if a step's loss was non-finite (that step and the later ones wrote nothing)
    """
    static.load_plan(fields)
    for index in range(static.num_steps):
        if callback is not None:
            callback.pre_batch()
        with unit():
            static.run(1, progress)
        if callback is not None:
            static.rows_io.flush()  # a callback may read the tables: their tiers hold this step's rows
            loss = float(static.last_loss)
            if not math.isfinite(loss):
                raise NonFiniteLossError(_non_finite(epoch, index, num_steps, f"The loss is non-finite ({loss})"))
            batch = static.callback_batch(epoch, index)
            callback.on_batch(epoch=epoch, batch=batch, batch_loss=loss)
            callback.pre_step()
            callback.post_batch(epoch=epoch, batch=batch)
    loss_sum, applied = static.finish_epoch()
    if applied < static.num_steps:
        raise NonFiniteLossError(_non_finite(epoch, applied, num_steps, "The loss is non-finite"))
    return loss_sum


def _non_finite(epoch: int, index: int, num_steps: int, what: str) -> str:
    """Return the message of a non-finite loss in step ``index`` (0-based) of an epoch of the static step."""
    return (
        f"{what} in epoch {epoch}, step {index + 1}/{num_steps} (global step {(epoch - 1) * num_steps + index + 1}). "
        f"Neither that step nor a later one was applied, and no checkpoint was written for it. Lower the learning "
        f"rate, add gradient clipping or check the model's constraints."
    )


class EpochPlans:
    """The plans of the epochs ``first..last``, each drawn (and pinned) on a thread while the epoch before trains.

    Every draw runs on a thread of its own, which ends with the draw, and its torch operations on one
    thread (:func:`~pykeen_bess.runtime.threads.one_thread_here`). A thread that stays alive after running
    parallel torch operations keeps its OpenMP team: GNU OpenMP then manages more threads than there are
    cores and makes every parallel region of the training step sleep and wake its threads instead of
    spinning (measured on a 2-core machine with 2 intra-op threads: about 100 context switches per step,
    the step 1.6x slower than with one thread, at ``n = 4`` where the draw's operations are parallel).
    """

    def __init__(self, sampler: BessSampler, static: StaticStep, first: int, last: int):
        self.sampler = sampler
        self.static = static
        self.last = last
        self._pending: dict[int, concurrent.futures.Future] = {}
        if first <= last:
            self._submit(first)

    def _draw(self, epoch: int) -> tuple[EpochDraws, dict[str, torch.Tensor]]:
        draws = self.sampler.draw_epoch(epoch, self.static.num_steps)
        return draws, self.static.host_plan(draws)

    def _submit(self, epoch: int) -> None:
        if epoch <= self.last and epoch not in self._pending:
            executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="bess-plan", initializer=one_thread_here
            )
            self._pending[epoch] = executor.submit(self._draw, epoch)
            executor.shutdown(wait=False)  # its thread ends after the draw (see the class docstring)

    def get(self, epoch: int) -> tuple[EpochDraws, dict[str, torch.Tensor]]:
        """Return the plan of ``epoch`` (and its device-ready tensors) and start drawing the next one."""
        self._submit(epoch)
        result = self._pending.pop(epoch).result()
        self._submit(epoch + 1)
        return result

    def close(self) -> None:
        """Stop drawing plans."""
        running = [future for future in self._pending.values() if not future.cancel()]
        self._pending.clear()
        concurrent.futures.wait(running)


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
