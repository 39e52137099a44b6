"""The static step: a whole BESS step on the device, with fixed shapes, replayed as one CUDA graph.

The eager step (:class:`~pykeen_bess.training.step.StepRunner` and the optimizer callback) builds
each step's plan on the host, deduplicates the step's rows into a data-dependent number of rows and
reads the loss on the host every step. On a GPU that is hundreds of small host-side operations
around a fraction of a millisecond of device work. :class:`StaticStep` runs the *full* steps of an
epoch (those without padding, :attr:`~pykeen_bess.data.sampling.BessSampler.full_steps`: all but at
most the last few with the default balanced sharding) as one function of fixed shapes and no host
synchronisation:

1. **plan**: the training triples live on the device in partition order. Per epoch the host draws
   the sort keys of the epoch's order and the full steps' negatives from the same seeded generators
   as the eager step (:meth:`~pykeen_bess.data.sampling.BessSampler.draw_epoch`, on a background thread,
   pinned), they are copied once (asynchronously) and the triples are sorted on the device
   (``argsort(pair + keys)``, the sampler's order); a step takes its slots' triples from the order
   at a device step counter, so the batches are those of the eager step;
2. **rows**: every looked-up row is its own leaf (``[N, W]`` per table, ``N = 2 n^2 b`` head and
   tail slots plus the negatives' rows, duplicates included), so no ``unique`` is needed;
3. **scores and loss**: the exchange scheme's own :meth:`~pykeen_bess.schemes.ExchangeScheme.scores`
   and :func:`~pykeen_bess.nn.loss.block_loss` (all slots real: no masks), so both steps compute the same
   function;
4. **gradients**: ``torch.autograd.grad`` for the leaves and the replicated parameters;
5. **row update**: the occurrences of a row are summed with a persistent row-to-slot map (every
   occurrence of a row finds one representative slot, ``index_add_`` sums into it) and the row
   rule (:data:`~pykeen_bess.tables.row_rules.STATIC_RULES`) runs on every occurrence with its row's summed
   gradient; duplicates write identical values, so the result is the lazy row-sparse update of the
   eager step (same rows touched, same moments) up to rounding;
6. **dense update** of the replicated parameters with the user's optimizer's rule
   (:data:`~pykeen_bess.tables.row_rules.DENSE_RULES`), the step counts and learning rates as device tensors;
7. **bookkeeping on the device**: the loss is summed on the device and read once per epoch; a step
   with a non-finite loss writes nothing, and neither does any later step of the epoch, so the
   epoch's end raises :class:`~pykeen.training.training_loop.NonFiniteLossError` with the parameters
   as they were before that step (as the eager step does).

On CUDA the step is captured once as a CUDA graph (:class:`torch.cuda.CUDAGraph`, after two
warm-up steps on a side stream) and every further step is one ``replay()``; elsewhere (and where
capturing fails, logged with the reason) the same function runs eagerly. The steps with padding at
the end of an epoch run through the eager step, whose optimizer state the static step hands over
(step counts) before and takes back after.

Where the static step cannot reproduce the eager step (other processes, replicas, the encoding
partition, tables in host memory or files, dense updates, optimizers without a rule here,
dropout, loss weights, sub-batches, gradient clipping, callbacks that need every step's loss), the
loop trains eagerly and logs why (:func:`static_step_obstacle`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from pykeen.losses import Loss
from pykeen.regularizers import Regularizer
from pykeen.training.callbacks import TrainingCallback

from ..data.batch import BessBatch, RowGather
from ..distributed import LocalTopology
from ..nn.loss import block_loss
from ..tables.optim import BessOptimizer
from ..tables.row_rules import STATIC_RULES
from ..data.sampling import BessSampler, EpochDraws
from ..schemes import ExchangeScheme
from ..schemes.lookup import static_indices
from .static_plan import DevicePlan
from .static_update import DENSE_CLASSES, DENSE_OPTIONS, StaticUpdate
from .step import BessOptimizerCallback, StepRunner
from .tables import ShardTables

__all__ = [
    "STATIC_STEP_MODES",
    "StaticStep",
    "check_static_step",
    "static_step_obstacle",
]

logger = logging.getLogger(__name__)

#: the values of the loop's ``static_step`` option: None (automatic: a captured static step on CUDA
#: where it applies, else the eager step), True (the static step, or an error saying why not), False
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


def static_step_obstacle(
    runner: StepRunner,
    tables: ShardTables,
    optimizer: torch.optim.Optimizer,
    sampler: BessSampler,
    sub_block_size: int,
    block_size: int,
    callbacks: Sequence[TrainingCallback],
    weighted: bool,
) -> str | None:
    """Return why the static step cannot train this loop (None: it can).

    :param runner: the eager step runner (scheme, loss, tables)
    :param tables: the shard tables
    :param optimizer: the loop's optimizer
    :param sampler: the epochs' sampler
    :param sub_block_size: slots per block and sub-batch
    :param block_size: slots per block
    :param callbacks: the registered training callbacks
    :param weighted: whether the loop has a loss weighter
    """
    scheme, topology = runner.scheme, runner.topology
    if not isinstance(topology, LocalTopology) or topology.replicas != 1 or not topology.holds_all_shards:
        return "it runs in one process (this loop trains in a process group)"
    if scheme.partition != "token":
        return f"it supports the token partition (exchange={type(scheme).get_name()!r})"
    obstacle = tables.storage.captured_step_obstacle()
    if obstacle is not None:
        return obstacle
    if not isinstance(optimizer, BessOptimizer) or not optimizer.sparse_updates:
        return "it updates the tables row-sparsely (sparse_updates=False)"
    for group in optimizer.sparse_groups:
        if group["rule"] not in STATIC_RULES:
            return f"it has no row rule {group['rule']!r}"
    obstacle = _dense_obstacle(optimizer)
    if obstacle is not None:
        return obstacle
    model = scheme.model
    if any(table.dropout is not None for table in tables) or any(
        representation.dropout is not None for representation in model.relation_representations
    ):
        return "it draws no random numbers (the model has dropout)"
    if weighted:
        return "it does not weigh positives (the loop has a loss weighter)"
    if sub_block_size < block_size:
        return f"it runs a step as one batch (sub-batches of {sub_block_size} slots per block)"
    if sampler.num_candidate_types > 1 and scheme.lookup.regularized:
        return "its regularization weights do not depend on the step (typed negatives with a regularizer)"
    obstacle = _callback_obstacle(callbacks)
    if obstacle is not None:
        return obstacle
    if not _sync_free_loss(runner.loss):
        return f"it supports PyKEEN's own losses ({type(runner.loss).__name__})"
    return None


def _callback_obstacle(callbacks: Sequence[TrainingCallback]) -> str | None:
    """Return why the static step cannot run these callbacks (per-step hooks, gradient clipping)."""
    for callback in callbacks:
        if isinstance(callback, BessOptimizerCallback):  # the static step does what it does, except clipping
            if callback.pre_step_callbacks:
                return "it does not clip gradients (gradient_clipping_max_norm / gradient_clipping_max_abs_value)"
            continue
        hooks = [name for name in _STEP_HOOKS if getattr(type(callback), name) is not getattr(TrainingCallback, name)]
        if hooks:
            name = type(callback).__name__
            return f"it reads no loss and runs no callback per step ({name} implements {', '.join(hooks)})"
    return None


def _dense_obstacle(optimizer: BessOptimizer) -> str | None:
    """Return why the static step cannot reproduce the dense update of the replicated parameters."""
    if not optimizer.dense_groups:
        return None
    rule = DENSE_CLASSES.get(optimizer.optimizer_cls)
    if rule is None:
        return f"it has no dense rule for {optimizer.optimizer_cls.__name__}"
    for group in optimizer.dense_groups:
        for key, required in DENSE_OPTIONS[rule].items():
            if key in group and group[key] != required:
                return f"it has no dense rule for {optimizer.optimizer_cls.__name__}({key}={group[key]!r})"
    return None


def _sync_free_loss(loss: Loss) -> bool:
    """Whether the loss is one of PyKEEN's (or this package's), whose sLCWA scores are processed without host reads."""
    module = type(loss).__module__
    return module.startswith("pykeen.") or module.startswith("pykeen_bess.")


class StaticStep:
    """The full steps of BESS epochs as one static function on the device (see the module docstring)."""

    #: real steps run before a CUDA graph is captured (cuBLAS and the autograd engine warm up)
    warmup_steps = 2

    def __init__(
        self,
        runner: StepRunner,
        tables: ShardTables,
        optimizer: BessOptimizer,
        model: Any,
        sampler: BessSampler,
        label_smoothing: float,
        capture: bool,
    ):
        """Prepare the step for the sampler's blocks; nothing runs yet.

        :param runner: the eager step runner (its scheme, loss and model hooks are used)
        :param tables: the shard tables
        :param optimizer: the loop's optimizer (its state tensors are updated in place)
        :param model: the model (``post_parameter_update`` runs after every update)
        :param sampler: the sampler of the epochs' plans
        :param label_smoothing: PyKEEN's label smoothing
        :param capture: capture the step as a CUDA graph (on CUDA only)
        """
        self.scheme: ExchangeScheme = runner.scheme
        self.runner = runner
        self.tables = tables
        self.optimizer = optimizer
        self.model = model
        self.sampler = sampler
        self.label_smoothing = label_smoothing
        self.device = tables[0].compute_device
        self.capture = capture and self.device.type == "cuda"
        #: the epochs' triples and draws on the device
        self.plan = DevicePlan(sampler, self.device)
        n, b = self.plan.n, self.plan.b
        self.n, self.b = n, b
        #: the full steps of every epoch
        self.num_steps = self.plan.num_steps
        self.offsets = torch.arange(n, device=self.device) * tables[0].sharding.shard_size  # [n]
        k, blocks_i, blocks_j, m = self.plan.negative_shape
        sizes = [n * n * b, n * n * b, k * blocks_i * blocks_j * m]
        head_index, tail_index, negative_index = torch.arange(sum(sizes), device=self.device).split(sizes)
        #: the index of every role's rows into the step's rows (each occurrence is its own row; the
        #: negatives' rows are in the order the scores read them, ``[n(i), n(j), n(k), m]``)
        self.role_index = (
            head_index.view(n, n, b),
            tail_index.view(n, n, b),
            negative_index.view(blocks_i, blocks_j, k, m).permute(2, 0, 1, 3),
        )
        #: the updates, on the optimizer's state
        self.update = StaticUpdate(optimizer, tables, model, sum(sizes))
        self.healthy = torch.ones((), dtype=torch.bool, device=self.device)
        self.applied = torch.zeros((), dtype=torch.long, device=self.device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._indices: dict = {}  # device copies of the regularization groups' indices
        self._graph: Any = None
        self._runs = 0
        self._in_epoch = False  # between load_plan and finish_epoch
        self._held: list[torch.Tensor] = []  # the regularizers' zero terms a captured graph reads
        self._parameters: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its memory at capture)
        self._state_tensors: list[tuple[dict, str, torch.Tensor]] = []  # optimizer state tensors at capture

    # -- epochs ------------------------------------------------------------------------------------

    def host_plan(self, draws: EpochDraws) -> dict[str, torch.Tensor]:
        """Return what :meth:`load_plan` copies to the device (:meth:`DevicePlan.host_plan`; thread-safe)."""
        return self.plan.host_plan(draws)

    def load_plan(self, fields: dict[str, torch.Tensor]) -> None:
        """Start an epoch from what :meth:`host_plan` made of its draws (copied and sorted on the device)."""
        self.plan.load(fields)
        self.loss_sum.zero_()
        self.applied.zero_()
        self.update.refresh_learning_rates()  # a scheduler changes them between epochs
        self._in_epoch = True

    def load_epoch(self, epoch: int) -> EpochDraws:
        """Draw an epoch on the host and load it (:meth:`host_plan` and :meth:`load_plan` in one); return its draws."""
        draws = self.sampler.draw_epoch(epoch, self.num_steps)
        self.load_plan(self.host_plan(draws))
        return draws

    def order_lookup(self, position_in_order: torch.Tensor) -> torch.Tensor:
        """Return the partition positions at positions of the loaded epoch's order (a host read, for eager steps)."""
        return self.plan.order_lookup(position_in_order)

    def run(self, steps: int, progress: Any = None) -> None:
        """Run the next ``steps`` full steps of the loaded epoch (captured as a CUDA graph once warm).

        :param steps: at most the loaded epoch's full steps not yet run
        :param progress: a progress bar, advanced per step (no synchronisation)
        :raises ValueError: for more steps than the loaded epoch has left
        """
        self.plan.take(steps)
        for _ in range(steps):
            if self.capture and self._graph is None and self._runs >= self.warmup_steps:
                self._capture()
            if self._graph is not None:
                self._graph.replay()
            elif self.device.type == "cuda":
                stream = self._side_stream()
                with torch.cuda.stream(stream):
                    self.step()
                torch.cuda.current_stream(self.device).wait_stream(stream)
            else:
                self.step()
            self._runs += 1
            if progress is not None:
                progress.update(1)

    def finish_epoch(self) -> tuple[float, int]:
        """Read the loss sum and the number of applied steps (one host read); hand the step counts to the optimizer.

        :returns: the sum of the applied steps' losses, and how many were applied (fewer than run after a
            non-finite loss: that step and the later ones wrote nothing)
        """
        summary = torch.stack([self.loss_sum, self.applied.to(torch.float64)]).cpu()
        loss_sum, applied = float(summary[0]), int(summary[1])
        self.loss_sum.zero_()
        self.applied.zero_()
        self.update.count_applied(applied)
        self._in_epoch = False
        return loss_sum, applied

    def abandon(self) -> None:
        """After a failure within an epoch: leave the optimizer's step counts as far as steps were applied."""
        if self._in_epoch:  # static steps of this epoch ran: count those applied
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.finish_epoch()
        else:  # eager steps ran after them: their counts are the optimizer's
            self.update.read_step_counts()

    def resume_after_eager(self) -> None:
        """After eager steps: take the step counts back, and move rebound parameters and state back into place.

        PyKEEN's embeddings rebind their weight's ``.data`` when they apply a constraint, and an optimizer
        may replace a state tensor; the captured graph works on the memory it was captured with, so the
        new values are copied there and the tensors rebound to it.
        """
        self.update.read_step_counts()
        with torch.no_grad():
            for param, memory in self._parameters:
                if param.data_ptr() != memory.data_ptr():
                    memory.copy_(param.detach())
                    param.data = memory
            for state, name, value in self._state_tensors:
                current = state.get(name)
                if current is not value and current is not None:
                    value.copy_(current)
                    state[name] = value

    # -- the step ----------------------------------------------------------------------------------

    def step(self) -> None:
        """Run one full step: forward, backward, the updates and the bookkeeping, without host synchronisation."""
        with static_indices(self._indices), torch.enable_grad():
            batch = self.plan.batch()
            gathered = self._gather(batch)
            loss = self._loss(batch, gathered)
            leaves = [leaf for leaf, table in zip(gathered.leaves, self.tables) if table.trainable]
            inputs = [*leaves, *self.update.dense]
            grads = torch.autograd.grad(loss, inputs, allow_unused=True) if inputs else ()
        with torch.no_grad():
            value = loss.detach().to(torch.float64)
            ok = torch.isfinite(value) & self.healthy
            self.update.rows(gathered, list(grads[: len(leaves)]), ok)
            self.update.dense_parameters(list(grads[len(leaves) :]), ok)
            self.update.post_parameter_update()
            self.healthy.copy_(ok)
            self.applied.add_(ok.long())
            self.loss_sum.add_(torch.where(ok, value, torch.zeros_like(value)))
            self.plan.advance()

    def _gather(self, batch: BessBatch) -> RowGather:
        """Look up every row the step uses, one leaf row per occurrence: ``[N, W]`` per table."""
        offsets = self.offsets
        head_rows = batch.heads + offsets.view(-1, 1, 1)  # blocks (i, *): shard i's rows
        tail_rows = batch.tails.transpose(0, 1) + offsets.view(-1, 1, 1)  # blocks (*, j): shard j's rows
        negative_rows = batch.negatives + offsets.view(-1, 1, 1, 1)  # shard k's negatives of every block
        # the negatives in the order the scores look them up, [n(i), n(j), n(k), m]
        negative_rows = negative_rows.permute(1, 2, 0, 3)
        rows = torch.cat([head_rows.reshape(-1), tail_rows.reshape(-1), negative_rows.reshape(-1)])
        leaves = [table.weight.detach().index_select(0, rows).requires_grad_(table.trainable) for table in self.tables]
        heads, tails, negatives = self.role_index
        return RowGather(
            rows=rows, leaves=leaves, heads=heads, tails=tails, negatives=negatives, first_real=0, in_role_order=True
        )

    def _loss(self, batch: BessBatch, gathered: RowGather) -> torch.Tensor:
        """Return the step's loss as :meth:`StepRunner.forward_backward` computes it (one sub-batch, all slots real)."""
        b = self.b
        scores = self.scheme.scores(batch, gathered, 0, b)
        loss = block_loss(
            self.runner.loss,
            scores,
            num_valid_step=self.n * self.n * b,
            label_smoothing=self.label_smoothing,
            num_entities=self.runner.num_entities,
        )
        loss = (loss + self.runner.collect_regularization_term()).sum()
        self.runner.post_forward_pass()
        return loss

    # -- CUDA graphs -------------------------------------------------------------------------------

    def _side_stream(self) -> Any:
        """Return the stream of the warm-up steps (PyTorch's recipe for capturing whole steps)."""
        if not hasattr(self, "_stream"):
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._stream

    def _capture(self) -> None:
        """Capture :meth:`step` as a CUDA graph; on failure, keep running it eagerly (logged).

        A graph reads and writes the memory its tensors had when it was captured. Two kinds of PyKEEN
        state are therefore pinned down first: a regularizer replaces its term tensor at every update
        (the graph would read the one current at capture, freed afterwards), so each gets a zero term
        this step holds; and the parameters and optimizer state are recorded, so that after eager steps
        (which may rebind a weight's ``.data``) :meth:`resume_after_eager` moves them back.
        """
        for module in self.model.modules():
            if isinstance(module, Regularizer):
                held = torch.zeros_like(module.regularization_term)
                module.regularization_term = held
                self._held.append(held)
        self._parameters = [(param, param.data) for param in self.model.parameters()]
        self._state_tensors = [
            (state, name, value)
            for state in self.optimizer.state.values()
            for name, value in state.items()
            if torch.is_tensor(value) and value.device.type == "cuda"
        ]
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize(self.device)
            # thread-local: the thread that draws the next epoch may pin memory meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.step()
        except Exception as error:  # noqa: BLE001 - any capture failure falls back to the same step, uncaptured
            self.capture = False
            self.model.collect_regularization_term()  # drop terms a failed capture left behind
            torch.cuda.synchronize(self.device)
            logger.warning(
                "BESS: the static step could not be captured as a CUDA graph (%s); it runs uncaptured.", error
            )
            return
        self._graph = graph
        logger.info("BESS: captured the static step as a CUDA graph; every further full step is one replay.")
