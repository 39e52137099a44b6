"""One BESS training step: forward and backward, gradient hand-off, then the optimizer step as callbacks.

:class:`StepRunner` runs the forward and backward passes of a step (all sub-batches of the slot
axis) and returns this process' loss, which the loop all-reduces and checks; then
:meth:`StepRunner.hand_off_gradients` gives the gathered rows' gradients to the shard tables
(coalesced row-sparse, or dense with ``sparse_updates=False``) and sums the replicated
parameters' gradients over the processes, in one collective per dtype (a parameter without a
gradient in every process keeps none, so the optimizer skips it as in one process).

The optimizer step is a training callback, as PyKEEN composes its own (``OptimizerTrainingCallback``
with pre-step callbacks for clipping): :class:`BessOptimizerCallback` runs the clipping callbacks
(:class:`GlobalNormClippingCallback`: by the norm over all shards and replicated parameters, one
collective; :class:`ValueClippingCallback`), the optimizer step, the constraints of densely
updated rows and the model's ``post_parameter_update``.

This *eager* step builds its plan on the host and deduplicates the step's rows into a
data-dependent number of rows; on a GPU it copies the plan's indices to the device every step (from
pageable memory, which synchronises) and reads the loss on the host. It is the step of the CPU,
of process groups and of the configurations the static step does not cover; on a GPU the full
steps of an epoch otherwise run as :mod:`~pykeen_bess.training.steps.static_step`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pykeen.training import TrainingLoop
from pykeen.losses import Loss
from pykeen.models.nbase import _NewAbstractModel
from pykeen.regularizers import Regularizer
from pykeen.training.callbacks import TrainingCallback

from ...data.batch import BessBatch, RowGather
from ...distributed import Topology
from ...nn.loss import block_loss
from ...tables.optim import row_sparse_grad
from ...schemes import ExchangeScheme
from ...schemes.copies import UNCACHED, DeviceCopies
from ...tables.shard_tables import ShardTables

__all__ = [
    "BessOptimizerCallback",
    "GlobalNormClippingCallback",
    "StepRunner",
    "ValueClippingCallback",
    "held_terms",
]


def held_terms(model: Any) -> Callable[[], torch.Tensor | float]:
    """Return the model's ``collect_regularization_term``, popping only the regularizers that hold a term.

    A representation's regularizer is never updated in a BESS step (the scheme weighs its terms
    itself), so popping it adds ``weight * 0`` for a dozen operations per step; regularizers that
    were updated or track parameters are popped as PyKEEN pops them. A model with its own
    ``collect_regularization_term`` keeps it.
    """
    if type(model).collect_regularization_term is not _NewAbstractModel.collect_regularization_term:
        return model.collect_regularization_term
    regularizers = [module for module in model.modules() if isinstance(module, Regularizer)]

    def collect() -> torch.Tensor | float:
        return sum(
            regularizer.pop_regularization_term()
            for regularizer in regularizers
            if regularizer.updated or regularizer.tracked_parameters
        )

    return collect


class StepRunner:
    """Forward and backward of the sub-batches of a step, on one process."""

    def __init__(
        self,
        scheme: ExchangeScheme,
        loss: Loss,
        tables: ShardTables,
        sparse_updates: bool,
        collect_regularization_term: Any,
        post_forward_pass: Any,
        weighted: bool = False,
    ):
        """Bind the runner to a scheme and a loss.

        :param scheme: the exchange scheme (model, tables, scorer, topology)
        :param loss: the PyKEEN loss
        :param tables: the shard tables (and the replicated parameters)
        :param sparse_updates: hand row-sparse gradients to the tables (else dense ones)
        :param collect_regularization_term: the model's method returning (and resetting) the terms the
            scheme does not weigh itself (e.g. weight regularizers of replicated parameters)
        :param post_forward_pass: the model's hook after each forward pass
        :param weighted: the loop has a loss weighter (batches without weights are refused)
        """
        self.scheme = scheme
        self.loss = loss
        self.tables = tables
        self.topology = scheme.topology
        self.sparse_updates = sparse_updates
        self.num_entities = scheme.model.num_entities
        self.collect_regularization_term = collect_regularization_term
        self.post_forward_pass = post_forward_pass
        #: the loop has a loss weighter: every batch must carry the positives' weights
        self.weighted = weighted
        #: the rows of the step being run
        self.rows: RowGather | None = None
        #: the step being run (within :meth:`forward_backward`)
        self.batch: BessBatch | None = None
        #: the part of the last sub-batch's loss every process computes in full (see :meth:`sub_batch_loss`)
        self._own: torch.Tensor | None = None
        #: the local rows the step updates (of all replicas of the shard), shape: ``[U]``; set by
        #: :meth:`hand_off_gradients`
        self.updated_rows: torch.Tensor | None = None

    def hand_off_gradients(self) -> None:
        """Give the step's row gradients to the shard tables and sum gradients over the processes.

        Row gradients are summed over the replicas of each shard, the replicated parameters'
        gradients over all processes.
        """
        if self.rows is not None:
            self.scheme.set_row_gradients(self.rows, dense=not self.sparse_updates)
        self.updated_rows = self.rows.real_rows if self.rows is not None else None
        if self.topology.replicas > 1:
            self._sum_over_replicas()
        parameters = self.tables.replicated_parameters()
        if not self.topology.is_distributed or not parameters:
            return
        present = torch.tensor([p.grad is not None for p in parameters], dtype=torch.float64)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        present, *summed = self.topology.all_reduce_coalesced([present, *grads])
        for parameter, flag, grad in zip(parameters, present.tolist(), summed):
            parameter.grad = grad if flag > 0 else None

    def _sum_over_replicas(self) -> None:
        """Sum every shard table's gradient over the replicas of the shard (every replica takes part)."""
        if not self.sparse_updates:  # the rows to constrain after a dense update: those of every replica
            rows = self.updated_rows
            if rows is None:
                rows = torch.zeros(0, dtype=torch.long, device=self.tables[0].compute_device)
            flags = torch.ones((rows.numel(), 1), dtype=torch.float32, device=rows.device)
            self.updated_rows = self.topology.replica_reduce_rows(rows, flags)[0]
        for table in self.tables:
            weight = table.weight
            if not self.sparse_updates:
                grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
                weight.grad = self.topology.replica_all_reduce(grad)
                continue
            if table.gradient is None:
                rows = torch.zeros(0, dtype=torch.long, device=table.compute_device)
                values = torch.zeros((0, weight.shape[1]), dtype=weight.dtype, device=table.compute_device)
            else:
                grad = table.gradient.coalesce()
                rows, values = grad._indices()[0], grad._values()
            rows, values = self.topology.replica_reduce_rows(rows, values)
            table.gradient = row_sparse_grad(weight, rows, values) if rows.numel() else None
            table.touched_values = None  # the union of the replicas' rows: read by the optimizer

    def forward_backward(
        self,
        batch: BessBatch,
        sub_block_size: int,
        label_smoothing: float,
        process_batch: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run forward and backward of all sub-batches of this process' part of a step.

        The part is this replica's slots of every block (all slots without replicas), in sub-batches.

        :param batch: the step's plan
        :param sub_block_size: slots per block and sub-batch
        :param label_smoothing: PyKEEN's label smoothing
        :param process_batch: what computes a sub-batch's loss, called as PyKEEN calls a training loop's
            ``_process_batch`` (``batch=, start=, stop=, label_smoothing=, slice_size=``); None:
            :meth:`sub_batch_loss`. A non-finite loss it returns is not backpropagated (the step's loss
            is then non-finite, and the loop raises).
        :returns: this process' share of the step loss, a float64 scalar on the topology's device
        """
        first, last = self.scheme.slot_range(batch.block_size)
        self.rows = self.scheme.gather(batch, first, last)
        self.batch = batch
        total = torch.zeros((), dtype=torch.float64, device=self.topology.device)
        replicated = self.scheme.replicated_share
        try:
            for start in range(first, last, sub_block_size):
                stop = min(start + sub_block_size, last)
                self._own = None
                if process_batch is None:
                    loss = self.sub_batch_loss(batch, start, stop, label_smoothing)
                    loss.backward()
                else:
                    loss = process_batch(
                        batch=batch, start=start, stop=stop, label_smoothing=label_smoothing, slice_size=None
                    )
                    loss = loss.sum()
                    if bool(torch.isfinite(loss.detach())):
                        loss.backward()
                # terms every process computes in full (the encoding scheme's scores) count with its share
                own = self._own if self._own is not None else torch.zeros((), dtype=total.dtype)
                total += (loss.detach().to(total) - own.to(total)) * replicated + own.to(total)
                self.post_forward_pass()
        finally:
            self.batch = None
        return total

    def sub_batch_loss(self, batch: BessBatch, start: int, stop: int, label_smoothing: float) -> torch.Tensor:
        """Return the loss of the slots ``start:stop`` of every block of the step being run (not backpropagated).

        The loss is the sub-batch's share of the step loss (PyKEEN's reduction over the step's valid
        slots, loss weights and regularization terms included), a scalar.

        :raises RuntimeError: outside :meth:`forward_backward` of ``batch`` (the step's rows are gathered there)
        """
        rows = self.rows
        if self.batch is not batch or rows is None:
            raise RuntimeError(
                "A BESS sub-batch's loss is computed within its step (StepRunner.forward_backward), which gathers "
                "the step's rows first."
            )
        weight_step = 0.0 if batch.weights is None else float(batch.weights.sum(dtype=torch.float64))  # CPU plan
        loss, self._own = self.slots_loss(batch, rows, start, stop, label_smoothing, weight_step)
        return loss

    def slots_loss(
        self,
        batch: BessBatch,
        rows: RowGather,
        start: int,
        stop: int,
        label_smoothing: float,
        weight_step: float | torch.Tensor,
        copies: DeviceCopies = UNCACHED,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the loss of the slots ``start:stop`` of every block (not backpropagated), and its own part.

        The loss is the sub-batch's share of the step loss (PyKEEN's reduction over the step's valid
        slots, loss weights and regularization terms included), a scalar. Its own part is what every
        process computes in full (see :meth:`forward_backward`). Reads nothing on the host: the static
        step calls it, too.

        :param batch: the step's plan
        :param rows: the step's rows (from the scheme's gather, or the static step's)
        :param start: the first slot of every block
        :param stop: the end slot (exclusive)
        :param label_smoothing: PyKEEN's label smoothing
        :param weight_step: the sum of the loss weights of the whole step's positives (0 without weights)
        :param copies: how the step's masks and weights reach the device (the static step keeps them)
        :raises ValueError: if the loop has a loss weighter and the batch carries no weights
        """
        if batch.weights is None and self.weighted:
            raise ValueError("The loop has a loss weighter, but its sampler's batches carry no weights.")
        scores = self.scheme.scores(batch, rows, start, stop, copies)
        loss = block_loss(
            self.loss,
            scores,
            num_valid_step=batch.num_valid,
            label_smoothing=label_smoothing,
            num_entities=self.num_entities,
            weight_step=weight_step,
        )
        # the terms the scheme did not weigh (e.g. weight regularizers) are replicated: add this
        # process' share of this sub-batch
        replicated = self.scheme.replicated_share
        share = (stop - start) / batch.block_size * self.topology.n_local / self.topology.n_shard * replicated
        extra = self.collect_regularization_term() * share
        loss = (loss + extra).sum()  # regularizer terms have shape [1]
        own = extra + scores.replicated_regularization
        # a Python number is filled in on the loss' device (no host-to-device copy: a CUDA graph captures it)
        own = own.sum().detach() if torch.is_tensor(own) else torch.full((), own, dtype=loss.dtype, device=loss.device)
        return loss, own


class GlobalNormClippingCallback(TrainingCallback):
    """Pre-step: clip all gradients by their global norm (all shards, replicated parameters once).

    Equals :func:`torch.nn.utils.clip_grad_norm_` over all parameters of the unsharded model.
    """

    def __init__(
        self,
        tables: ShardTables,
        topology: Topology,
        max_norm: float,
        norm_type: float | None = None,
    ):
        """Clip to ``max_norm`` in the ``norm_type`` norm (default 2)."""
        super().__init__()
        self.tables = tables
        self.topology = topology
        self.max_norm = float(max_norm)
        self.norm_type = float(norm_type or 2.0)

    def pre_step(self, **kwargs: Any) -> None:  # noqa: D102
        sharded = [_values(table.gradient) for table in self.tables if table.gradient is not None]
        replicated = [p.grad for p in self.tables.replicated_parameters() if p.grad is not None]
        if not sharded and not replicated:
            return
        p = self.norm_type
        device = (sharded or replicated)[0].device
        if math.isinf(p):
            local = _reduce([g.abs().max() for g in sharded if g.numel()], torch.amax, device)
            shared = _reduce([g.abs().max() for g in replicated if g.numel()], torch.amax, device)
            # each shard once: the replicas of a shard hold the same (summed) gradient
            total = torch.maximum(self.topology.shard_all_reduce(local, op="max"), shared)
        else:
            local = _reduce([torch.linalg.vector_norm(g, p, dtype=torch.float64) ** p for g in sharded], sum, device)
            shared = _reduce(
                [torch.linalg.vector_norm(g, p, dtype=torch.float64) ** p for g in replicated], sum, device
            )
            total = (self.topology.shard_all_reduce(local) + shared) ** (1.0 / p)
        coefficient = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
        for grad in [*sharded, *replicated]:
            grad.mul_(coefficient.to(grad.dtype))


class ValueClippingCallback(TrainingCallback):
    """Pre-step: clip every gradient value to ``[-max_abs_value, max_abs_value]``."""

    def __init__(self, tables: ShardTables, max_abs_value: float):
        """Clip the tables' and the replicated parameters' gradients."""
        super().__init__()
        self.tables = tables
        self.max_abs_value = float(max_abs_value)

    def pre_step(self, **kwargs: Any) -> None:  # noqa: D102
        grads = [_values(table.gradient) for table in self.tables if table.gradient is not None]
        grads += [p.grad for p in self.tables.replicated_parameters() if p.grad is not None]
        for grad in grads:
            grad.clamp_(-self.max_abs_value, self.max_abs_value)


class BessOptimizerCallback(TrainingCallback):
    """The optimizer step of a BESS step, after its pre-step callbacks (PyKEEN's ``OptimizerTrainingCallback``)."""

    def __init__(
        self,
        runner: StepRunner,
        tables: ShardTables,
        pre_step_callbacks: Sequence[TrainingCallback],
        constrain_rows: bool,
    ):
        """Compose the step.

        :param runner: the step runner (the rows of the current step)
        :param tables: the shard tables
        :param pre_step_callbacks: run in order before the optimizer step
        :param constrain_rows: apply the tables' constraints to every entity's row after the update
            (dense updates, which move rows outside the step too; the row-sparse rules constrain within the update)
        """
        super().__init__()
        self.runner = runner
        self.tables = tables
        self.pre_step_callbacks = tuple(pre_step_callbacks)
        self.constrain_rows = constrain_rows

    def register_training_loop(self, training_loop: TrainingLoop) -> None:  # noqa: D102
        super().register_training_loop(training_loop)
        for callback in self.pre_step_callbacks:
            callback.register_training_loop(training_loop)

    def pre_batch(self, **kwargs: Any) -> None:  # noqa: D102
        self.optimizer.zero_grad(set_to_none=True)

    def post_batch(self, epoch: int, batch: Any, **kwargs: Any) -> None:  # noqa: D102
        for callback in self.pre_step_callbacks:
            callback.pre_step(epoch=epoch, **kwargs)
        self.optimizer.step()
        if self.constrain_rows and self.runner.updated_rows is not None:  # the update moved rows outside the step
            self.tables.constrain_entity_rows()
        self.model.post_parameter_update()
        self.optimizer.zero_grad(set_to_none=True)
        self.runner.rows = self.runner.updated_rows = None


def _values(grad: torch.Tensor) -> torch.Tensor:
    """Return the stored values of a gradient (a row-sparse gradient's values, modified in place by clipping)."""
    return grad._values() if grad.is_sparse else grad


def _reduce(values: list[torch.Tensor], reduce: Any, device: torch.device) -> torch.Tensor:
    """Reduce scalars on the device without reading them on the host (0 for none)."""
    if not values:
        return torch.zeros((), dtype=torch.float64, device=device)
    stacked = torch.stack([v.to(torch.float64) for v in values])
    return reduce(stacked) if reduce is not sum else stacked.sum()
