"""The optimizer side of a static step: gradients summed per row, clipping, row and dense updates.

:class:`StaticUpdate` applies the optimizer's rules inside a static step
(:mod:`~pykeen_bess.training.steps.static_step`) on the very state tensors of the loop's
:class:`~pykeen_bess.tables.optim.BessOptimizer`, in place, so that its ``state_dict``
(checkpoints) sees the optimizer as the eager step leaves it:

* **rows summed without a host read**: a step's ``N`` looked-up rows arrive with one gradient per
  occurrence ``[N, W]``. :func:`~pykeen_bess.training.steps.static_rules.occurrence_groups` sorts the
  rows (fixed size ``N``) and numbers their distinct values; ``index_add_`` sums the occurrences of
  every row into its group, and every occurrence reads its row's sum back (:class:`StepRows`). With
  replicas the occurrences of all replicas of the shard are all-gathered first (a fixed size per
  replica), so every replica sums the same occurrences and updates the union of their rows, as the
  eager step's replica sum does. On the CPU (:attr:`StaticUpdate.host_rules`) the distinct rows are
  found on the host instead and updated once each, by the eager step's in-place rules, in buffers
  kept across steps (:class:`~pykeen_bess.training.steps.host_rows.HostRows`);
* **clipping** (:meth:`StaticUpdate.clip`): by the global norm over the rows (each row once) and the
  replicated parameters, summed over the shards by one scalar collective, or by value;
* **rows**: the row rule (:meth:`~pykeen_bess.tables.row_rules.RowRule.apply`) runs on every
  occurrence with its row's summed gradient; all occurrences of a row compute the same new values,
  so their writes agree. Rows only padding slots looked up are left as they are. The result is
  the eager step's lazy row-sparse update (same rows, same moments) up to rounding;
* **dense**: the replicated parameters, and the tables with ``sparse_updates=False``
  (:class:`~pykeen_bess.training.steps.dense_update.DenseUpdate`: on a GPU the user's optimizer in its
  capturable form, or for the replicated parameters the row rule of one torch has no capturable form
  of; the user's optimizer itself on the CPU and for tables no capturable form updates);
* **gated**: every write keeps the old value where ``ok`` is False (a non-finite loss);
* **fused on a GPU**: a rule, its constraint and the gate are one function
  (:func:`~pykeen_bess.training.steps.static_rules.gated_rule`), which ``torch.compile`` fuses into a few
  kernels on CUDA (about ten elementwise passes over the step's rows otherwise); on the CPU, and if
  compiling fails (logged once), it runs as written;
* **step counts and learning rates** are float64 device tensors: the counts start from the
  optimizer state's host counts and are written back into it at the end of every epoch
  (:class:`~pykeen_bess.training.steps.static_rules.StepCounts`); the learning rates are refreshed
  per epoch (a scheduler changes them between epochs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from pykeen.nn.representation import Embedding

from ...distributed import Topology
from ...tables.optim import BessOptimizer
from ...tables.representation import ShardedEmbedding
from ...tables.row_rules import RULES, state_shapes
from .host_rows import HostRows
from .dense_update import DenseUpdate
from ...storage.staging import RowAccess, TierRows
from .static_rules import FusedRule, StepCounts, StepRows, occurrence_groups
from ...tables.shard_tables import ShardTables

__all__ = [
    "Clipping",
    "StaticUpdate",
    "StepRows",
]


@dataclasses.dataclass(frozen=True)
class Clipping:
    """Gradient clipping of a step, PyKEEN's ``train()`` options (None: not clipped that way)."""

    #: clip by the global norm of all gradients (every shard's rows once, the replicated parameters once)
    max_norm: float | None = None
    #: the norm's order (default 2; ``inf`` for the largest absolute value)
    norm_type: float | None = None
    #: clip every gradient value to ``[-max_abs_value, max_abs_value]``
    max_abs_value: float | None = None

    @property
    def clips(self) -> bool:
        """Whether gradients are clipped at all."""
        return self.max_norm is not None or self.max_abs_value is not None


class StaticUpdate:
    """The updates of a static step, on the state of the loop's optimizer."""

    #: on the CPU, sum the gradients of the step's distinct rows (a host-side ``unique``), update them with the
    #: eager step's in-place rules and skip a non-finite step on the host (a value read costs no synchronisation
    #: there); False: the fixed shapes, device-tensor rules and gates a GPU runs
    host_rules = True

    def __init__(
        self,
        optimizer: BessOptimizer,
        tables: ShardTables,
        model: Any,
        topology: Topology,
        rows_io: RowAccess | None = None,
    ):
        """Bind to the optimizer; create the tables' missing row state as the optimizer would at its first step.

        :param optimizer: the loop's optimizer (its state tensors are updated in place)
        :param tables: the shard tables
        :param model: the model (``post_parameter_update`` runs after every update)
        :param topology: the process topology (replicas' and processes' gradient sums, clipping norms)
        :param rows_io: how the rows and their state are read and written (default: each table's tier)
        """
        #: how the rows and their state are read and written (each table's tier, or the step's staged rows)
        self.rows_io = rows_io or TierRows()
        self.optimizer = optimizer
        self.tables = tables
        self.model = model
        self.topology = topology
        self.device = tables[0].compute_device
        self.trainable = [table for table in tables if table.trainable]
        for group in optimizer.sparse_groups:
            for table in self.trainable:
                row_state = self._row_state(table)
                weight = table.weight
                for name, (shape, fill) in state_shapes(group["rule"], weight.shape, group).items():
                    if name not in row_state:  # (a stored table's tier holds its row state from the start)
                        row_state[name] = torch.full(shape, fill, dtype=weight.dtype, device=weight.device)
        #: one learning rate per parameter group, read by the step (a captured step reads these tensors)
        self.learning_rates = [torch.zeros((), dtype=torch.float64, device=self.device) for _ in optimizer.param_groups]
        #: the step counts of the tables and the replicated parameters, on the device
        self.step_counts = StepCounts(self.device)
        #: the gated rule, compiled for this step's rules on CUDA (its own copy: see FusedRule)
        self.fused = FusedRule()
        #: the CPU's updates of the step's distinct rows (:attr:`on_the_host`)
        self.host_rows = HostRows(optimizer, self.trainable)
        #: the update of the dense groups: the replicated parameters (and the tables with ``sparse_updates=False``)
        self.dense = DenseUpdate(
            optimizer,
            self.trainable,
            topology,
            self.step_counts,
            self.learning_rates,
            lambda: self.on_the_host,
            self.fused,
        )

    def refresh_learning_rates(self) -> None:
        """Copy the parameter groups' learning rates into the device tensors the step reads."""
        for buffer, group in zip(self.learning_rates, self.optimizer.param_groups):
            buffer.fill_(float(group["lr"]))

    # -- gradients ---------------------------------------------------------------------------------

    def row_gradients(
        self,
        rows: torch.Tensor,
        leaves: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        real: torch.Tensor | None,
        size: int,
    ) -> StepRows:
        """Sum every trainable table's gradient per row (over the replicas of the shard, too).

        :param rows: shape: ``[N]``, the flat local row of every occurrence the step looked up
        :param leaves: per trainable table, shape: ``[N, W]``, the looked-up values
        :param grads: per trainable table, shape: ``[N, W]``, the occurrences' gradients (None: no gradient)
        :param real: shape: ``[N]``, whether an occurrence belongs to a real slot or negative (None: all do)
        :param size: ``N`` of the replica with the most occurrences (replicas all-gather that many)
        """
        topology = self.topology
        if topology.replicas > 1:
            rows, real, old, grads = self._all_replicas(rows, real, grads, size)
        else:
            old = [leaf.detach() for leaf in leaves]
        if self.on_the_host:  # the distinct rows themselves, as the eager step's optimizer has them
            return self.host_rows.sums(rows, old, grads, real)
        group, first = occurrence_groups(rows)
        if real is not None:  # a row is updated if any occurrence is real
            count = torch.zeros_like(rows).index_add_(0, group, real.long())
            real = count.index_select(0, group) > 0
        summed = [
            None if grad is None else torch.zeros_like(grad).index_add_(0, group, grad).index_select(0, group)
            for grad in grads
        ]
        return StepRows(rows=rows, first=first, real=real, old=old, summed=summed, most=rows.numel())

    def _all_replicas(
        self,
        rows: torch.Tensor,
        real: torch.Tensor | None,
        grads: Sequence[torch.Tensor | None],
        size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor | None]]:
        """All-gather the occurrences of every replica of the shard (padded to ``size``); read their old values."""
        topology = self.topology
        count = rows.numel()
        pad = size - count
        real = torch.ones_like(rows, dtype=torch.bool) if real is None else real
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad)])
            real = torch.cat([real, real.new_zeros(pad)])
        # (as bytes: gloo has no bool collectives)
        flags = topology.replica_all_gather(real.to(torch.uint8)).reshape(-1).bool()
        gathered = [topology.replica_all_gather(rows).reshape(-1), flags]
        summed: list[torch.Tensor | None] = []
        for table, grad in zip(self.trainable, grads):
            if grad is None:
                grad = torch.zeros((count, table.weight.shape[1]), dtype=table.weight.dtype, device=self.device)
            if pad:
                grad = torch.cat([grad, grad.new_zeros((pad, grad.shape[1]))])
            summed.append(topology.replica_all_gather(grad).reshape(-1, grad.shape[1]))
        all_rows, all_real = gathered
        old = [self.rows_io.read(table.storage, table.weight, all_rows) for table in self.trainable]
        return all_rows, all_real, old, summed

    def clip(self, step_rows: StepRows, dense: list[torch.Tensor | None], clipping: Clipping) -> None:
        """Clip the summed row gradients and the replicated parameters' gradients in place (as the eager step does).

        The norm counts every updated row once (its first occurrence) and is summed over the shards; the
        replicated parameters count once.
        """
        sharded = [grad for grad in step_rows.summed if grad is not None]
        replicated = [grad for grad in dense if grad is not None]
        if clipping.max_norm is not None and (sharded or replicated):
            once = step_rows.first if step_rows.real is None else step_rows.first & step_rows.real
            weight = once.to(torch.float64).view(-1, 1)
            p = float(clipping.norm_type or 2.0)
            zero = torch.zeros((), dtype=torch.float64, device=self.device)
            if math.isinf(p):
                local = _stack_reduce([(g.abs().to(torch.float64) * weight).amax() for g in sharded], "max", zero)
                shared = _stack_reduce([g.abs().amax().to(torch.float64) for g in replicated if g.numel()], "max", zero)
                total = torch.maximum(self.topology.shard_all_reduce(local, op="max"), shared)
            else:
                local = _stack_reduce(
                    [
                        (torch.linalg.vector_norm(g, p, dim=1, dtype=torch.float64) ** p * weight.view(-1)).sum()
                        for g in sharded
                    ],
                    "sum",
                    zero,
                )
                shared = _stack_reduce(
                    [torch.linalg.vector_norm(g, p, dtype=torch.float64) ** p for g in replicated], "sum", zero
                )
                total = (self.topology.shard_all_reduce(local) + shared) ** (1.0 / p)
            coefficient = torch.clamp(clipping.max_norm / (total + 1e-6), max=1.0)
            for grad in [*sharded, *replicated]:
                grad.mul_(coefficient.to(grad.dtype))
        if clipping.max_abs_value is not None:
            for grad in [*sharded, *replicated]:
                grad.clamp_(-clipping.max_abs_value, clipping.max_abs_value)

    # -- updates -----------------------------------------------------------------------------------

    def rows(self, step_rows: StepRows, ok: torch.Tensor) -> None:
        """Apply the row rule to the step's rows, every occurrence with its row's summed gradient.

        :param step_rows: from :meth:`row_gradients`
        :param ok: whether to write (a 0-dimensional bool tensor)
        """
        if not self.optimizer.sparse_groups or all(grad is None for grad in step_rows.summed):
            return
        if self.on_the_host:
            counts = [
                None if summed is None else self.step_counts.count(table.optimizer_parameter, self._state(table), ok)
                for table, summed in zip(self.trainable, step_rows.summed)
            ]
            self.host_rows.update(step_rows, bool(ok), counts)
            return
        rows = step_rows.rows
        mask = ok if step_rows.real is None else ok & step_rows.real
        group = self.optimizer.sparse_groups[0]
        lr = self.learning_rates[len(self.optimizer.dense_groups)]
        rule = RULES[group["rule"]]
        for table, old, summed in zip(self.trainable, step_rows.old, step_rows.summed):
            if summed is None:
                continue
            param, storage = table.optimizer_parameter, table.storage
            row_state = self._row_state(table)
            step = self.step_counts.count(param, self.optimizer.state[param], ok)
            names = list(state_shapes(group["rule"], table.weight.shape, group))
            old_state = {name: self.rows_io.read(storage, row_state[name], rows) for name in names}
            constraint = self.optimizer._row_constraints.get(id(param))
            whole_rows: dict[str, torch.Tensor] = {}
            if rule.whole_rows and table.column_part is not None:  # a collective of the parts
                whole_rows["squared_mean"] = table.row_mean(summed * summed)
            new, new_state = self.fused(
                self.device, rule.apply, old, summed, old_state, group, step, lr, mask, constraint, **whole_rows
            )
            # every occurrence of a row writes the same values; rows in host memory or files are written back
            self.rows_io.write(storage, table.weight, rows, new)
            for name in names:
                self.rows_io.write(storage, row_state[name], rows, new_state[name])

    @property
    def on_the_host(self) -> bool:
        """Whether the rows are updated by the host-side path (:attr:`host_rules` on the CPU)."""
        return self.device.type == "cpu" and self.host_rules and not self.fused.everywhere and not self.rows_io.staged

    def row_state_tensors(self) -> list[tuple[Any, torch.Tensor, bool]]:
        """Return the trainable tables' row state tensors, each with its tier (all written by the update)."""
        tensors = []
        for group in self.optimizer.sparse_groups:
            for table in self.trainable:
                row_state = self._row_state(table)
                for name in state_shapes(group["rule"], table.weight.shape, group):
                    tensors.append((table.storage, row_state[name], True))
        return tensors

    def _state(self, table: ShardedEmbedding) -> dict[str, Any]:
        """Return the optimizer's state of a table's parameter (its step count)."""
        return self.optimizer.state[table.optimizer_parameter]

    def _row_state(self, table: ShardedEmbedding) -> dict[str, Any]:
        """Return the dictionary of a table's row state (the optimizer's state, or the table's own in its tier)."""
        return table.storage.row_state(table, self.optimizer.state[table.optimizer_parameter])

    def post_parameter_update(self) -> None:
        """Run the model's ``post_parameter_update``, with the constraints of PyKEEN's embeddings applied in place.

        PyKEEN's :meth:`~pykeen.nn.representation.Embedding.post_parameter_update` rebinds the weight's
        ``.data`` to the constrained values; a captured graph would keep reading the old memory. The same
        values are written into the weight instead. (The shard tables constrain their rows in the row update.)
        """
        for module in self.model.modules():
            if module is self.model or not hasattr(module, "post_parameter_update"):
                continue
            if isinstance(module, Embedding) and not isinstance(module, ShardedEmbedding):
                if module.constrainer is not None:
                    x = module.constrainer(module._plain_forward())
                    if module.is_complex:
                        x = torch.view_as_real(x)
                    weight = module._embeddings.weight
                    weight.copy_(x.view(weight.shape))
                continue
            module.post_parameter_update()


def _stack_reduce(values: list[torch.Tensor], op: str, zero: torch.Tensor) -> torch.Tensor:
    """Reduce scalars on the device without reading them on the host (``zero`` for none)."""
    if not values:
        return zero
    stacked = torch.stack(values)
    return stacked.amax() if op == "max" else stacked.sum()
