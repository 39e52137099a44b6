"""The optimizer side of a static step: gradients summed per row, clipping, row and dense updates.

:class:`StaticUpdate` applies the optimizer's rules inside a static step
(:mod:`~pykeen_bess.training.static_step`) on the very state tensors of the loop's
:class:`~pykeen_bess.tables.optim.BessOptimizer`, in place, so that its ``state_dict``
(checkpoints) sees the optimizer as the eager step leaves it:

* **rows summed without a host read**: a step's ``N`` looked-up rows arrive with one gradient per
  occurrence ``[N, W]``. :func:`occurrence_groups` sorts the rows (fixed size ``N``) and numbers
  their distinct values; ``index_add_`` sums the occurrences of every row into its group, and
  every occurrence reads its row's sum back (:class:`StepRows`). With replicas the occurrences of
  all replicas of the shard are all-gathered first (a fixed size per replica), so every replica
  sums the same occurrences and updates the union of their rows, as the eager step's replica sum
  does;
* **clipping** (:meth:`StaticUpdate.clip`): by the global norm over the rows (each row once) and the
  replicated parameters, summed over the shards by one scalar collective, or by value;
* **rows**: the row rule (:data:`~pykeen_bess.tables.row_rules.STATIC_RULES`) runs on every
  occurrence with its row's summed gradient; all occurrences of a row compute the same new values,
  so their writes agree. Rows only padding slots looked up are left as they are. The result is
  the eager step's lazy row-sparse update (same rows, same moments) up to rounding;
* **dense**: the replicated parameters with the user's optimizer's rule
  (:data:`~pykeen_bess.tables.row_rules.DENSE_RULES`), their gradients summed over the processes;
* **gated**: every write keeps the old value where ``ok`` is False (a non-finite loss);
* **fused on a GPU**: a rule, its constraint and the gate are one function (:func:`gated_rule`),
  which ``torch.compile`` fuses into a few kernels on CUDA (about ten elementwise passes over the
  step's rows otherwise); on the CPU, and if compiling fails (logged once), it runs as written;
* **step counts and learning rates** are float64 device tensors: the counts start from the
  optimizer state's host counts and are written back into it at the end of every epoch
  (:meth:`StaticUpdate.write_step_counts`); the learning rates are refreshed per epoch (a scheduler
  changes them between epochs).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from pykeen.nn.representation import Embedding
from torch.optim import SGD, Adagrad, Adam, SparseAdam

from ..distributed import Topology
from ..tables.optim import BessOptimizer, RowwiseAdagrad
from ..tables.representation import ShardedEmbedding
from ..tables.row_rules import DENSE_RULES, STATIC_RULES, state_shapes
from .tables import ShardTables

__all__ = [
    "DENSE_CLASSES",
    "DENSE_OPTIONS",
    "Clipping",
    "StaticUpdate",
    "StepRows",
    "gated_rule",
    "occurrence_groups",
]

logger = logging.getLogger(__name__)

#: the user's optimizer classes whose dense update the static step reproduces, with their rule
DENSE_CLASSES: dict[type, str] = {
    Adam: "adam",
    SparseAdam: "adam",
    Adagrad: "adagrad",
    SGD: "sgd",
    RowwiseAdagrad: "rowwise_adagrad",
}

#: options of the user's optimizer that must have these values for the static step's dense update
DENSE_OPTIONS: dict[str, dict[str, Any]] = {
    "adam": dict(weight_decay=0, amsgrad=False, differentiable=False),
    "adagrad": dict(weight_decay=0, differentiable=False),
    "sgd": dict(momentum=0, weight_decay=0, nesterov=False, differentiable=False),
    "rowwise_adagrad": {},
}


def _gate(mask: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``where(mask, new, old)`` with a 0-dimensional mask or one value per leading row (``[U]``)."""
    if mask.dim() == 1 and new.dim() > 1:
        mask = mask.view(-1, *([1] * (new.dim() - 1)))
    return torch.where(mask, new, old)


def gated_rule(
    rule: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
    old: torch.Tensor,
    grad: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    group: Mapping[str, Any],
    step: torch.Tensor,
    lr: torch.Tensor,
    ok: torch.Tensor,
    constraint: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Apply a rule and a constraint to values ``[U, *]``; return the new values, or the old ones where ``ok`` is False.

    :param rule: a rule of :data:`~pykeen_bess.tables.row_rules.STATIC_RULES` or
        :data:`~pykeen_bess.tables.row_rules.DENSE_RULES`
    :param old: the current values
    :param grad: their gradient
    :param state: the rule's state of the values
    :param group: the hyper-parameters
    :param step: the step count including this step (a 0-dimensional tensor)
    :param lr: the learning rate (a 0-dimensional tensor)
    :param ok: whether to apply the step: a 0-dimensional bool tensor, or one per row ``[U]``
    :param constraint: applied to the new values (e.g. a projection to unit norm), or None
    :returns: the values and the state to write
    """
    new, new_state = rule(old, grad, state, group, step, lr)
    if constraint is not None:
        new = constraint(new)
    return _gate(ok, new, old), {name: _gate(ok, value, state[name]) for name, value in new_state.items()}


class _Fused:
    """:func:`gated_rule` compiled by ``torch.compile`` on CUDA; as written elsewhere, or once compiling failed."""

    #: compile on every device (tests compile on the CPU)
    everywhere = False

    def __init__(self) -> None:
        self.compiled: Any = None
        self.failed = False

    def __call__(self, device: torch.device, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.failed or (device.type != "cuda" and not self.everywhere):
            return gated_rule(*args, **kwargs)
        if self.compiled is None:
            self.compiled = torch.compile(gated_rule)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a compiler failure falls back to the same function, uncompiled
            self.failed = True
            logger.warning("BESS: the static step's updates could not be compiled (%s); they run uncompiled.", error)
            return gated_rule(*args, **kwargs)


#: the fused rule of the static steps (one compiled function, specialised per rule and shapes by its guards)
fused_rule = _Fused()


def occurrence_groups(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the number of every occurrence's row among the distinct rows, without a host read (fixed shapes).

    :param rows: shape: ``[N]``, rows with repetitions
    :returns: ``group`` ``[N]``, the number (``0 .. G - 1``, in sorted order) of every occurrence's row, and
        ``first`` ``[N]``, whether an occurrence is the first of its row (one per row)
    """
    ordered, order = torch.sort(rows, stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    group = torch.empty_like(rows).scatter_(0, order, torch.cumsum(starts, 0) - 1)
    first = torch.empty_like(starts).scatter_(0, order, starts)
    return group, first


@dataclasses.dataclass(eq=False)
class StepRows:
    """The rows a step updates: every occurrence with its row's summed gradient (:meth:`StaticUpdate.row_gradients`)."""

    #: shape: ``[M]``, the flat local row of every occurrence (``M = N``, or ``R * N`` over ``R`` replicas)
    rows: torch.Tensor
    #: shape: ``[M]``, whether an occurrence is the first of its row (norms count each row once)
    first: torch.Tensor
    #: shape: ``[M]``, whether an occurrence's row is updated (a real slot or negative looked it up); None: all are
    real: torch.Tensor | None
    #: per trainable table, shape: ``[M, W]``, the rows' values before the step
    old: list[torch.Tensor]
    #: per trainable table, shape: ``[M, W]``, the row's gradient summed over its occurrences (None: no gradient)
    summed: list[torch.Tensor | None]


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

    def __init__(self, optimizer: BessOptimizer, tables: ShardTables, model: Any, topology: Topology):
        """Bind to the optimizer; create the tables' missing row state as the optimizer would at its first step.

        :param optimizer: the loop's optimizer (its state tensors are updated in place)
        :param tables: the shard tables
        :param model: the model (``post_parameter_update`` runs after every update)
        :param topology: the process topology (replicas' and processes' gradient sums, clipping norms)
        """
        self.optimizer = optimizer
        self.tables = tables
        self.model = model
        self.topology = topology
        self.device = tables[0].compute_device
        self.trainable = [table for table in tables if table.trainable]
        #: the replicated parameters the dense rule updates
        self.dense = [p for group in optimizer.dense_groups for p in group["params"] if p.requires_grad]
        for group in optimizer.sparse_groups:
            for table in self.trainable:
                row_state = self._row_state(table)
                weight = table.weight
                for name, (shape, fill) in state_shapes(group["rule"], weight.shape, group).items():
                    if name not in row_state:  # (a stored table's tier holds its row state from the start)
                        row_state[name] = torch.full(shape, fill, dtype=weight.dtype, device=weight.device)
        #: one learning rate per parameter group, read by the step (a captured step reads these tensors)
        self.learning_rates = [torch.zeros((), dtype=torch.float64, device=self.device) for _ in optimizer.param_groups]
        self._step_counts: dict[int, torch.Tensor] = {}  # the same on the device
        #: the parameters with a step count, and their optimizer state
        self.counted: list[tuple[torch.Tensor, dict]] = []

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
        group, first = occurrence_groups(rows)
        if real is not None:  # a row is updated if any occurrence is real
            count = torch.zeros_like(rows).index_add_(0, group, real.long())
            real = count.index_select(0, group) > 0
        summed = [
            None if grad is None else torch.zeros_like(grad).index_add_(0, group, grad).index_select(0, group)
            for grad in grads
        ]
        return StepRows(rows=rows, first=first, real=real, old=old, summed=summed)

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
        old = [table.read_rows(all_rows) for table in self.trainable]
        return all_rows, all_real, old, summed

    def dense_gradients(self, grads: Sequence[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], Any]:
        """Sum the replicated parameters' gradients over the processes (one collective per dtype).

        :returns: the gradients (None: no process has one), and whether each parameter has one: None in
            one process (every gradient that is not None), else a float64 tensor ``[P]`` (> 0: present)
        """
        if not self.topology.is_distributed or not self.dense:
            return list(grads), None
        present = torch.tensor([grad is not None for grad in grads], dtype=torch.float64, device=self.device)
        values = [grad if grad is not None else torch.zeros_like(p) for p, grad in zip(self.dense, grads)]
        present, *summed = self.topology.all_reduce_coalesced([present, *values])
        return list(summed), present

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
        if all(grad is None for grad in step_rows.summed):
            return
        rows = step_rows.rows
        mask = ok if step_rows.real is None else ok & step_rows.real
        group = self.optimizer.sparse_groups[0]
        lr = self.learning_rates[len(self.optimizer.dense_groups)]
        rule = STATIC_RULES[group["rule"]]
        for table, old, summed in zip(self.trainable, step_rows.old, step_rows.summed):
            if summed is None:
                continue
            param, storage = table.optimizer_parameter, table.storage
            row_state = self._row_state(table)
            step = self._count(param, self.optimizer.state[param], ok)
            names = list(state_shapes(group["rule"], table.weight.shape, group))
            old_state = {name: storage.read(row_state[name], rows) for name in names}
            constraint = self.optimizer._row_constraints.get(id(param))
            new, new_state = fused_rule(self.device, rule, old, summed, old_state, group, step, lr, mask, constraint)
            # every occurrence of a row writes the same values; rows in host memory or files are written back
            storage.write(table.weight, rows, new)
            for name in names:
                storage.write(row_state[name], rows, new_state[name])

    def _row_state(self, table: ShardedEmbedding) -> dict[str, Any]:
        """Return the dictionary of a table's row state (the optimizer's state, or the table's own in its tier)."""
        return table.storage.row_state(table, self.optimizer.state[table.optimizer_parameter])

    def dense_parameters(self, grads: list[torch.Tensor | None], present: Any, ok: torch.Tensor) -> None:
        """Update the replicated parameters with the user's optimizer's rule.

        :param grads: the gradients of :attr:`dense`, in order (None: no gradient)
        :param present: from :meth:`dense_gradients`: None, or which parameters have a gradient on some process
        :param ok: whether to write
        """
        if not self.dense:
            return
        rule = DENSE_RULES[DENSE_CLASSES[self.optimizer.optimizer_cls]]
        params = iter(zip(self.dense, grads, range(len(self.dense))))
        for index, group in enumerate(self.optimizer.dense_groups):
            lr = self.learning_rates[index]
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                _, grad, position = next(params)
                if grad is None:
                    continue
                apply = ok if present is None else ok & (present[position] > 0)
                state = self._dense_state(param, group)
                names = [name for name in state if name != "step"]
                step = self._count(param, state, apply) if "step" in state else lr  # SGD counts no steps
                old_state = {name: state[name] for name in names}
                new, new_state = fused_rule(self.device, rule, param.detach(), grad, old_state, group, step, lr, apply)
                param.copy_(new)
                for name in names:
                    state[name].copy_(new_state[name])

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

    def _dense_state(self, param: torch.Tensor, group: dict) -> dict:
        """Return a replicated parameter's optimizer state (created as its optimizer creates it at its first step)."""
        state = self.optimizer.state[param]
        rule = DENSE_CLASSES[self.optimizer.optimizer_cls]
        for name, (shape, fill) in state_shapes(rule, param.shape, group).items():
            if name not in state:
                state[name] = torch.full(shape, fill, dtype=param.dtype, device=param.device)
        if "step" not in state and rule != "sgd":
            # torch.optim's optimizers count in the default scalar dtype, RowwiseAdagrad in float32
            state["step"] = torch.zeros((), dtype=_scalar_dtype() if rule != "rowwise_adagrad" else torch.float32)
        return state

    def _count(self, param: torch.Tensor, state: dict, ok: torch.Tensor) -> torch.Tensor:
        """Count a step of ``param`` on the device (if it is applied); return the count including it.

        The count starts from the optimizer state's (a host tensor, read when the step is first traced).
        """
        key = id(param)
        if key not in self._step_counts:
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)  # as BessOptimizer counts a table's steps
            self._step_counts[key] = torch.full((), float(state["step"]), dtype=torch.float64, device=self.device)
            self.counted.append((param, state))
        count = self._step_counts[key]
        current = count + 1
        count.copy_(torch.where(ok, current, count))
        return current

    def step_counts(self) -> list[torch.Tensor]:
        """Return the device step counts of the counted parameters (:attr:`counted`'s order)."""
        return [self._step_counts[id(param)] for param, _ in self.counted]

    def write_step_counts(self, counts: Sequence[float]) -> None:
        """Write the step counts (read from :meth:`step_counts`) into the optimizer's state (at the end of an epoch)."""
        for (_, state), count in zip(self.counted, counts):
            state["step"].fill_(count)


def _stack_reduce(values: list[torch.Tensor], op: str, zero: torch.Tensor) -> torch.Tensor:
    """Reduce scalars on the device without reading them on the host (``zero`` for none)."""
    if not values:
        return zero
    stacked = torch.stack(values)
    return stacked.amax() if op == "max" else stacked.sum()


def _scalar_dtype() -> torch.dtype:
    """Return the dtype of an optimizer's step count (as ``torch.optim`` creates it)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
