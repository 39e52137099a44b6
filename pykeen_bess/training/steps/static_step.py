"""The static step: a whole BESS step with fixed shapes and no host read, replayed as one CUDA graph on a GPU.

The eager step (:class:`~pykeen_bess.training.steps.runner.StepRunner` and the optimizer callback) builds
each step's plan on the host, deduplicates the step's rows into a data-dependent number of rows and
reads the loss on the host every step. On a GPU that is hundreds of small host-side operations
around a fraction of a millisecond of device work. :class:`StaticStep` runs every step of an epoch
as one function of fixed shapes and no host synchronisation:

1. **plan**: the training triples live on the device in partition order. Per epoch the host draws
   the sort keys of the epoch's order and every step's negatives from the same seeded generators
   as the eager step (:meth:`~pykeen_bess.data.sampling.BessSampler.draw_epoch`, on a background
   thread, pinned), they are copied once (asynchronously) and the triples are sorted on the device
   (``argsort(pair + keys)``, the sampler's order); a step takes its slots' triples from the order
   at a device step counter, so the batches are those of the eager step. The padded steps at the
   end of an epoch are steps of their own :class:`~pykeen_bess.training.steps.device_plan.StepKind`: the
   same function with that kind's (fixed) padding slots left out of the loss and the update;
2. **rows**: every row this process looks up (heads and tails of its slots of the local blocks,
   the local shards' negatives) is its own leaf (``[N, W]`` per table, duplicates included), so no
   ``unique`` is needed; the scheme scores what it makes of them
   (:meth:`~pykeen_bess.schemes.ExchangeScheme.scored_rows`: the same rows, or with
   ``exchange="encoding_lookup"`` whole rows assembled from every column part's, fixed shapes);
3. **scores and loss**: the exchange scheme's own :meth:`~pykeen_bess.schemes.ExchangeScheme.scores`
   (its collectives have fixed shapes: balanced blocks) and the eager step's sub-batch loss, for
   every sub-batch in a fixed loop, so both steps compute the same function;
4. **gradients**: ``torch.autograd.grad`` for the leaves and the replicated parameters, summed over
   the sub-batches; the step's loss is summed over the processes (one scalar collective);
5. **row update** (:mod:`~pykeen_bess.training.steps.static_update`): the occurrences of a row are
   summed (over the replicas of the shard, too) by sorting the step's rows, gradient clipping acts
   on the sums, and the row rule runs on every occurrence with its row's sum; duplicates write
   identical values, so the result is the lazy row-sparse update of the eager step (same rows
   touched, same moments) up to rounding;
6. **dense update** of the replicated parameters, their gradients summed over the processes, and of
   the tables with ``sparse_updates=False``: on a GPU by the user's optimizer in its capturable form
   (or, for the replicated parameters of an optimizer without one, its rule), the step counts and
   learning rates as device tensors; on the CPU, and wherever neither reproduces the optimizer (tables
   updated densely by an optimizer without a capturable form, options without a device rule), by the
   user's optimizer itself after a host read of whether the step applies (on a GPU such a step runs
   uncaptured);
7. **bookkeeping on the device**: the loss is summed on the device and read once per epoch (every
   step while a callback asks for every step's loss); a step with a non-finite loss writes nothing,
   and neither does any later step of the epoch, so the epoch's end raises
   :class:`~pykeen.training.training_loop.NonFiniteLossError` with the parameters as they were
   before that step (as the eager step does).

Two executors run the step (:mod:`~pykeen_bess.training.steps.executors`): on CUDA every step kind is
captured once as a CUDA graph (after two warm-up steps on a side stream) and every further step of
the kind is one ``replay()``; elsewhere (and where capturing fails, logged with the reason) the
same function runs directly.

Tables in host memory or files are read and written through a
:class:`~pykeen_bess.storage.staging.RowAccess`: on a GPU every step's rows are staged into fixed device
buffers before the step and written back after it (:class:`~pykeen_bess.storage.staging.StagedRows`), so
the step itself reads device memory only. Every configuration of the loop runs on the static step; on a
GPU a few run it uncaptured (:attr:`StaticStep.capture_obstacle`: the user's optimizer on the dense
groups after a host read, typed negatives with a regularizer other than L2, host or file tables with
replicas or the encoding partition). A subclass that overrides
``_process_batch`` trains with the eager step, which calls that hook on the host for every sub-batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pykeen.training.callbacks import TrainingCallback

from ...data.batch import BessBatch, RowGather
from ...data.sampling import BessSampler, EpochDraws
from ...schemes import ExchangeScheme
from ...schemes.copies import CachedDeviceCopies
from ...schemes.regularization import add_term_gradients
from ...storage.staging import RowAccess, StagedRows, StagedTensor, TierRows
from ...tables.optim import BessOptimizer
from ..setup.sizes import resident_bytes
from .device_plan import DevicePlan, StepKind
from .static_update import Clipping, StaticUpdate
from .executors import CapturedSteps, DirectSteps
from .runner import BessOptimizerCallback, StepRunner
from ...tables.shard_tables import ShardTables

__all__ = [
    "STATIC_STEP_MODES",
    "StaticStep",
    "check_static_step",
    "per_step_hooks",
    "static_step_obstacle",
]

logger = logging.getLogger(__name__)

#: the values of the loop's ``static_step`` option: None (automatic: the static step wherever it applies,
#: captured as a CUDA graph on CUDA, else the eager step), True (the static step, or an error saying why
#: not), False (the eager step)
STATIC_STEP_MODES = (None, True, False)


def check_static_step(static_step: bool | None) -> bool | None:
    """Return the loop's ``static_step`` option, checked.

    :raises ValueError: unless it is None, True or False
    """
    if static_step not in STATIC_STEP_MODES or not isinstance(static_step, (bool, type(None))):
        raise ValueError(f"static_step must be None, True or False, not {static_step!r}.")
    return static_step


#: the per-step hooks of a training callback
_STEP_HOOKS = ("pre_batch", "on_batch", "pre_step", "post_batch")


def per_step_hooks(callbacks: Sequence[TrainingCallback]) -> list[str]:
    """Return the names of the callbacks that implement a per-step hook (they get every step's loss)."""
    return [
        type(callback).__name__
        for callback in callbacks
        if not isinstance(callback, BessOptimizerCallback)  # (the eager step's optimizer step)
        and any(getattr(type(callback), name) is not getattr(TrainingCallback, name) for name in _STEP_HOOKS)
    ]


def static_step_obstacle(optimizer: torch.optim.Optimizer) -> str | None:
    """Return why the static step cannot train this loop (None: it can).

    Every configuration of the loop runs on the static step (a few uncaptured on a GPU:
    :attr:`StaticStep.capture_obstacle`), given the loop's own optimizer; the eager step trains a subclass
    that overrides ``_process_batch`` (checked by the loop), and ``static_step=False``.

    :param optimizer: the loop's optimizer
    """
    if not isinstance(optimizer, BessOptimizer):
        return f"its optimizer is not a {BessOptimizer.__name__}"
    return None


def row_access(
    tables: ShardTables,
    topology: Any,
    optimizer: BessOptimizer,
    most: int,
    stage_rows: bool | None,
    tensors: Callable[[], Sequence[StagedTensor]],
    budget: int | None = None,
) -> RowAccess:
    """Return how a static step reads and writes its tables' rows: staged around each step, or from the tiers.

    Staging (:class:`~pykeen_bess.storage.staging.StagedRows`) applies to whole rows in a tier other than the
    device's, updated row by row by one process per shard: not to the encoding partition's column parts,
    replicas (the rows of the other replicas are known only inside the step) or tables the user's optimizer
    updates whole (``sparse_updates=False``).

    :param stage_rows: True: stage (or raise why not); None: stage where the tier's rows would cross to a GPU
    :param budget: the bytes the staging buffers may take on the device (None: see ``StagedRows``)
    :raises ValueError: if ``stage_rows`` is True and the configuration cannot stage
    """
    device = tables[0].compute_device
    obstacle = (
        "the tables are in the device tier"
        if tables.storage.captured_step_obstacle() is None
        else "the encoding partition's column parts"
        if any(table.column_part is not None for table in tables)
        else "replicas"
        if topology.replicas > 1
        else "dense updates of the tables (sparse_updates=False)"
        if not optimizer.sparse_groups
        else None
    )
    if stage_rows is None:
        stage_rows = device.type == "cuda" and obstacle is None
    if not stage_rows:
        return TierRows()
    if obstacle is not None:
        raise ValueError(f"A static step cannot stage its rows with {obstacle}.")
    return StagedRows(tensors, most, device, budget)


class StaticStep:
    """The steps of BESS epochs as one static function on the device (see the module docstring)."""

    def __init__(
        self,
        runner: StepRunner,
        tables: ShardTables,
        optimizer: BessOptimizer,
        model: Any,
        sampler: BessSampler,
        label_smoothing: float,
        capture: bool,
        sub_block_size: int | None = None,
        clipping: Clipping | None = None,
        stage_rows: bool | None = None,
        memory_budget: int | None = None,
    ):
        """Prepare the step for the sampler's blocks; nothing runs yet.

        :param runner: the eager step runner (its scheme, topology, loss and model hooks are used)
        :param tables: the shard tables
        :param optimizer: the loop's optimizer (its state tensors are updated in place)
        :param model: the model (``post_parameter_update`` runs after every update)
        :param sampler: the sampler of the epochs' plans
        :param label_smoothing: PyKEEN's label smoothing
        :param capture: capture the step as a CUDA graph (on CUDA only)
        :param sub_block_size: slots per block and sub-batch (default: the whole block)
        :param clipping: gradient clipping (default: none)
        :param stage_rows: stage every step's rows in device buffers (:class:`~pykeen_bess.storage.staging.StagedRows`);
            None: for tables in host memory or files on a GPU, where it lets a CUDA graph capture the step
        :param memory_budget: the device's bytes for staging and the replicated parameters (None: see StagedRows)
        """
        self.scheme: ExchangeScheme = runner.scheme
        self.topology = runner.topology
        self.runner = runner
        self.tables = tables
        self.optimizer = optimizer
        self.model = model
        self.sampler = sampler
        self.label_smoothing = label_smoothing
        self.clipping = clipping or Clipping()
        self.device = tables[0].compute_device
        #: the epochs' triples and draws on the device
        self.plan = DevicePlan(sampler, self.device)
        self.n, self.b = n, b = self.plan.n, self.plan.b
        #: the steps of every epoch
        self.num_steps = self.plan.num_steps
        topology = self.topology
        local = topology.n_local
        #: this process' slots of every block (its replica's share)
        self.slots = self.scheme.slot_range(b)
        first, last = self.slots
        sub = max(1, min(sub_block_size or b, b))
        #: the sub-batches, ``(start, stop)`` slots of every block
        self.sub_batches = [(start, min(start + sub, last)) for start in range(first, last, sub)]
        self.offsets = torch.arange(local, device=self.device) * tables[0].sharding.shard_size  # [L]
        #: the slots of every block whose rows this process looks up (those it scores, or more: see the scheme)
        self.looked_up_slots = self.scheme.looked_up_slots(b)
        k, blocks_i, blocks_j, m = self.plan.negative_shape
        slots = self.looked_up_slots[1] - self.looked_up_slots[0]
        sizes = [local * n * slots, local * n * slots, blocks_i * blocks_j * local * m]
        head_index, tail_index, negative_index = torch.arange(sum(sizes), device=self.device).split(sizes)
        #: the index of every role's rows into the step's rows (each occurrence is its own row; the
        #: negatives' rows are in the order the scores read them, ``[n(i), n(j), L(k), m]``)
        self.role_index = (
            head_index.view(local, n, slots),
            tail_index.view(local, n, slots),
            negative_index.view(blocks_i, blocks_j, local, m).permute(2, 0, 1, 3),
        )
        #: the rows a replica looks up at most (replicas all-gather that many)
        part = -(-b // topology.replicas)
        self.max_rows = 2 * local * n * part + sizes[2]
        #: how the step reads and writes its tables' rows (staged in device buffers for a host or file tier on a GPU)
        budget = memory_budget and memory_budget - resident_bytes(model, self.device)
        self.rows_io = row_access(tables, topology, optimizer, self.max_rows, stage_rows, self._staged_tensors, budget)
        #: the updates, on the optimizer's state
        self.update = StaticUpdate(optimizer, tables, model, topology, self.rows_io)
        self.healthy = torch.ones((), dtype=torch.bool, device=self.device)
        self.applied = torch.zeros((), dtype=torch.long, device=self.device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        #: the loss of the last step (summed over the processes)
        self.last_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        #: the plan and kind of the last step run directly or captured (a graph overwrites the plan's tensors)
        self.last_batch: tuple[BessBatch, StepKind] | None = None
        #: per step kind: whether each occurrence is looked up by a real slot or negative (None: all are)
        self.real = [self._real_rows(kind) for kind in self.plan.kinds]
        self.copies = CachedDeviceCopies()  # of the regularization groups' and valid slots' indices
        self._in_epoch = False  # between load_plan and finish_epoch
        #: why a CUDA graph cannot capture the step (None: it can): its rows cross from host memory or files
        #: to the GPU inside the step (not staged), the user's optimizer updates the dense groups after a host
        #: read, or typed negatives' regularization weights group the rows on the host
        self.capture_obstacle = (
            (None if self.rows_io.staged else tables.storage.captured_step_obstacle())
            or (
                f"the user's optimizer updates the dense groups ({self.update.dense.rule_obstacle})"
                if self.update.dense.by_the_optimizer
                else None
            )
            or (
                "its typed negatives' regularization weights group the rows on the host (a regularizer other than L2)"
                if sampler.num_candidate_types > 1 and not self.scheme.lookup.weighs_on_the_device
                else None
            )
        )
        #: what runs the step: captured as CUDA graphs, or directly
        self.executor: DirectSteps = (
            CapturedSteps(self.step, model, optimizer, self.device)
            if capture and self.device.type == "cuda" and self.capture_obstacle is None
            else DirectSteps(self.step, self.device)
        )

    @property
    def capture(self) -> bool:
        """Whether the steps are captured as CUDA graphs (False after a capture failed)."""
        return self.executor.captures

    def _real_rows(self, kind: StepKind) -> torch.Tensor | None:
        """Return whether every occurrence of a kind's steps is looked up by a real slot or negative (None: all are).

        A padding slot's head and tail are not real; a block's negatives are real if the block has a real
        slot among this process' slots (all blocks' slots when the step shares them), as the eager step has it.
        """
        topology = self.topology
        first, last = self.looked_up_slots
        valid = kind.valid[..., first:last]  # [n(i), n(j), b']
        heads = topology.select_local(valid, 0)
        tails = topology.select_local(valid, 1).transpose(0, 1)
        _, blocks, _, m = self.plan.negative_shape
        used = valid.any().view(1, 1) if blocks == 1 else valid.any(dim=-1)  # [B, B]
        negatives = used.view(blocks, blocks, 1, 1).expand(blocks, blocks, topology.n_local, m)
        real = torch.cat([heads.reshape(-1), tails.reshape(-1), negatives.reshape(-1)])
        return None if bool(real.all()) else real.to(self.device)

    # -- epochs ------------------------------------------------------------------------------------

    def host_plan(self, draws: EpochDraws) -> dict[str, torch.Tensor]:
        """Return what :meth:`load_plan` copies to the device (:meth:`DevicePlan.host_plan`; thread-safe)."""
        return self.plan.host_plan(draws)

    def load_plan(self, fields: dict[str, torch.Tensor]) -> None:
        """Start an epoch from what :meth:`host_plan` made of its draws (copied and sorted on the device)."""
        self.executor.rebind()
        self.plan.load(fields)
        self.loss_sum.zero_()
        self.applied.zero_()
        self.healthy.fill_(True)
        self.update.refresh_learning_rates()  # a scheduler changes them between epochs
        self.rows_io.start_epoch()
        self._in_epoch = True

    def load_epoch(self, epoch: int) -> EpochDraws:
        """Draw an epoch on the host and load it (:meth:`host_plan` and :meth:`load_plan` in one); return its draws."""
        draws = self.sampler.draw_epoch(epoch, self.num_steps)
        self.load_plan(self.host_plan(draws))
        return draws

    def run(self, steps: int, progress: Any = None, after_step: Callable[[int], None] | None = None) -> None:
        """Run the next ``steps`` steps of the loaded epoch (each kind captured as a CUDA graph once warm).

        :param steps: at most the loaded epoch's steps not yet run
        :param progress: a progress bar, advanced per step (no synchronisation)
        :param after_step: called with the step's index (0-based) after each step (it may read the step's loss,
            and the tables: staged rows are written back first)
        :raises ValueError: for more steps than the loaded epoch has left
        """
        start = self.plan.position
        self.plan.take(steps)
        rows_io = self.rows_io
        for index in range(start, start + steps):
            rows_io.stage(index, self._rows_of_steps, self.num_steps)
            self.executor.run(self.plan.kind_of(index))
            rows_io.write_back()
            if progress is not None:
                progress.update(1)
            if after_step is not None:
                rows_io.flush()
                after_step(index)

    def finish_epoch(self) -> tuple[float, int]:
        """Read the loss sum, the number of applied steps and the step counts (one host read); write the counts.

        :returns: the sum of the applied steps' losses, and how many were applied (fewer than run after a
            non-finite loss: that step and the later ones wrote nothing)
        """
        self.rows_io.flush()  # the tables' tiers hold every step's rows before anything reads them
        summary = torch.stack([self.loss_sum, self.applied.to(torch.float64), *self.update.step_counts.values()])
        loss_sum, applied, *counts = summary.tolist()
        self.update.step_counts.write(counts)
        self._in_epoch = False
        return loss_sum, int(applied)

    def callback_batch(self, epoch: int, step: int) -> BessBatch:
        """Return the plan of the last step as the eager step's batches are, for per-step callbacks."""
        if self.last_batch is None:
            raise RuntimeError("No static step has run yet.")
        batch, kind = self.last_batch
        return self.plan.callback_batch(batch, kind, epoch, step)

    def abandon(self) -> None:
        """After a failure within an epoch: leave the optimizer's step counts as far as steps were applied."""
        if self._in_epoch:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            try:
                self.rows_io.flush()
            except Exception:  # the failure being handled is the one to report
                logger.warning("BESS: writing the staged rows back failed as well.", exc_info=True)
            self.finish_epoch()

    # -- the step ----------------------------------------------------------------------------------

    def step(self, kind: StepKind | None = None) -> None:
        """Run one step: forward, backward, the updates and the bookkeeping, without host synchronisation.

        :param kind: the step's kind (default: the full steps')
        """
        kind = self.plan.kinds[0] if kind is None else kind
        real = self.real[kind.index]
        with torch.enable_grad():
            batch = self.plan.batch(kind)
            looked_up = self._gather(batch)
            leaves = self._trainable(looked_up.leaves)
            gathered = self.scheme.scored_rows(looked_up)
            # the sub-batches differentiate by the scored rows; those made of the looked-up rows pass it on once
            scored = leaves if gathered is looked_up else self._trainable(gathered.leaves)
            inputs = [*scored, *self.update.dense.parameters]
            weight_step: Any = 0.0 if batch.weights is None else batch.weights.sum(dtype=torch.float64)
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            grads: list[torch.Tensor | None] = [None] * len(inputs)
            for start, stop in self.sub_batches:
                loss, own = self.runner.slots_loss(
                    batch, gathered, start, stop, self.label_smoothing, weight_step, self.copies
                )
                if inputs and loss.requires_grad:
                    for index, grad in enumerate(torch.autograd.grad(loss, inputs, allow_unused=True)):
                        so_far = grads[index]
                        if grad is not None:
                            grads[index] = grad if so_far is None else so_far + grad
                value, own = loss.detach().to(total), own.to(total)
                total = total + (value - own) * self.scheme.replicated_share + own
                self.runner.post_forward_pass()
            add_term_gradients(gathered.term_gradients or (), inputs, grads)  # the L2 terms of the leaves
            if scored is not leaves:  # one table after the other (their backward passes may be collectives)
                for index, (rows, leaf) in enumerate(zip(scored, leaves)):
                    passed = grads[index]
                    grads[index] = None if passed is None else torch.autograd.grad(rows, leaf, passed)[0]
        with torch.no_grad():
            step_loss = self.topology.all_reduce(total)
            ok = torch.isfinite(step_loss) & self.healthy
            n_leaves = len(leaves)
            step_rows = self.update.row_gradients(looked_up.rows, leaves, grads[:n_leaves], real, self.max_rows)
            # the occurrences' values and gradients ([N, W] each) are summed: free them before the update
            del looked_up, gathered, leaves, inputs
            dense, present = self.update.dense.gradients(grads[n_leaves:])
            del grads
            if self.clipping.clips:
                self.update.clip(step_rows, dense, self.clipping)
            self.update.rows(step_rows, ok)
            self.update.dense.apply(dense, present, ok, step_rows)
            self.update.post_parameter_update()
            self.healthy.copy_(ok)
            self.applied.add_(ok.long())
            self.loss_sum.add_(torch.where(ok, step_loss, torch.zeros_like(step_loss)))
            self.last_loss.copy_(step_loss)
            self.plan.advance()
        self.last_batch = batch, kind

    def _trainable(self, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Return the leaves of the trainable tables."""
        return [leaf for leaf, table in zip(leaves, self.tables) if table.trainable]

    def _gather(self, batch: BessBatch) -> RowGather:
        """Look up every row this process uses, one leaf row per occurrence: ``[N, W]`` per table."""
        rows = self._step_rows(batch)  # each table's tier (or the staged rows) reads them to the compute device
        leaves = [self.rows_io.read(t.storage, t.weight, rows).requires_grad_(t.trainable) for t in self.tables]
        heads, tails, negatives_index = self.role_index
        return RowGather(
            rows=rows,
            leaves=leaves,
            heads=heads,
            tails=tails,
            negatives=negatives_index,
            first_real=0,
            first_slot=self.looked_up_slots[0],
            in_role_order=len(self.sub_batches) == 1,
            term_gradients=[],
        )

    def _step_rows(self, batch: BessBatch) -> torch.Tensor:
        """Return the flat local row ``[N]`` of every occurrence the step looks up (:func:`looked_up_rows`)."""
        return looked_up_rows(batch, self.topology, self.looked_up_slots, self.offsets)

    def _rows_of_steps(self, start: int, stop: int) -> torch.Tensor:
        """Return the looked-up rows of steps ``start`` to ``stop - 1`` of the loaded epoch, ``[stop - start, N]``."""
        return torch.stack([self._step_rows(self.plan.batch(self.plan.kind_of(i), at=i)) for i in range(start, stop)])

    def _staged_tensors(self) -> list[StagedTensor]:
        """Return the tensors a staged step reads: every table's weight, and the trainable tables' row state."""
        weights = [(table.storage, table.weight, table.trainable) for table in self.tables]
        return weights + self.update.row_state_tensors()


def looked_up_rows(batch: BessBatch, topology: Any, slots: tuple[int, int], offsets: torch.Tensor) -> torch.Tensor:
    """Return the flat local row ``[N]`` of every occurrence a step looks up: heads, tails, negatives.

    :param batch: the step's plan (heads and tails ``[n, n, b]``)
    :param topology: the process topology (its local shards)
    :param slots: the slots ``(first, last)`` of every block whose rows this process looks up
    :param offsets: shape: ``[L]``, the first row of every local shard in the tables
    :returns: the heads of blocks ``(l, *)`` ``[L, n, b']``, the tails of blocks ``(*, l)`` ``[L, n, b']`` and the
        negatives in the order the scores look them up ``[n(i), n(j), L(k), m]``, flattened and concatenated
    """
    first, last = slots
    head_rows = topology.select_local(batch.heads[..., first:last], 0) + offsets.view(-1, 1, 1)
    tail_rows = topology.select_local(batch.tails[..., first:last], 1).transpose(0, 1) + offsets.view(-1, 1, 1)
    negatives = batch.negatives
    if batch.shared_negatives:  # one set for all blocks: [n(k), 1, 1, m]
        negatives = negatives[:, :1, :1]
    negative_rows = topology.select_local(negatives, 0) + offsets.view(-1, 1, 1, 1)
    negative_rows = negative_rows.permute(1, 2, 0, 3)
    return torch.cat([head_rows.reshape(-1), tail_rows.reshape(-1), negative_rows.reshape(-1)])
