"""The dense side of a static step: the replicated parameters, and the tables with ``sparse_updates=False``.

:class:`DenseUpdate` updates the parameters of the optimizer's dense groups
(:attr:`~pykeen_bess.tables.optim.BessOptimizer.dense_groups`) inside a static step
(:mod:`~pykeen_bess.training.steps.static_step`), their gradients summed over the processes, in one of three ways:

* **by the user's optimizer in its capturable form** (:attr:`DenseUpdate.capturable`, on a GPU, for every
  ``torch.optim`` class with a ``capturable`` option: Adam, AdamW, RMSprop, ...): its own ``step`` with
  ``capturable=True`` and the learning rate as a device tensor, both set for the call only, so that its step
  count stays on the device and nothing reads the host. A step with a non-finite loss (``ok`` False) must
  write nothing: the parameters and their state are copied before and kept where ``ok`` is False (the
  replicated parameters are small; a table updated densely, ``sparse_updates=False``, is copied whole with
  its state, on the device, which costs about what the optimizer's own whole-table update costs, and is
  done only while those copies take at most :data:`DENSE_COPY_SHARE` of the available memory). A table's
  dense gradient ``[R, W]`` is built from its rows' sums (zero elsewhere, as the eager step builds it), and
  its constraint applies to every entity's row afterwards (the update moves rows outside the step too, and
  PyKEEN constrains the whole table). The first step of a parameter creates its state and reads ``ok`` on
  the host (a warm-up step, before a graph is captured);
* **by a device rule** (on a GPU, for the optimizers torch has no capturable form of: Adagrad, SGD,
  row-wise Adagrad): the row rule (:data:`~pykeen_bess.tables.row_rules.RULES`) applied to the whole tensor,
  with the step count and learning rate as device tensors, gated by ``ok`` without a host read;
* **by the user's optimizer itself** (:attr:`DenseUpdate.by_the_optimizer`): on the CPU, where reading
  ``ok`` costs no synchronisation, and where neither of the above reproduces the update: tables updated
  densely by an optimizer without a capturable form (the device rules update the replicated parameters
  only) or too large to copy, tables outside the device (host memory or files), and options of the optimizers without a
  capturable form (SGD's momentum, Adagrad's weight decay). The tables' gradients and constraints are those
  of the capturable form. On a GPU such a step runs uncaptured (the read of ``ok`` synchronises).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ...distributed import Topology
from ...runtime.memory import available_memory
from ...tables.optim import DENSE_REQUIRED_OPTIONS, SPARSE_RULES, BessOptimizer
from ...tables.representation import ShardedEmbedding
from ...tables.row_rules import RULES, state_shapes
from .static_rules import FusedRule, StepCounts, StepRows

__all__ = [
    "DENSE_COPIES",
    "DENSE_COPY_SHARE",
    "DenseUpdate",
    "dense_rule_obstacle",
    "has_capturable_form",
]


#: the copies a captured dense update of a table takes per step: the table and up to three optimizer state
#: tensors of its size (Adam's moments, AMSGrad's maximum), kept to undo a step with a non-finite loss
DENSE_COPIES = 4
#: tables are updated densely in the capturable form only if their copies take at most this share of the
#: device's available memory (else the user's optimizer after a host read, uncaptured, as without copies)
DENSE_COPY_SHARE = 0.25


class DenseUpdate:
    """The update of the dense groups of the loop's optimizer within a static step."""

    def __init__(
        self,
        optimizer: BessOptimizer,
        trainable: Sequence[ShardedEmbedding],
        topology: Topology,
        step_counts: StepCounts,
        learning_rates: Sequence[torch.Tensor],
        on_the_host: Callable[[], bool],
        fused: FusedRule,
    ):
        """Find the dense groups' parameters and how to update them.

        :param optimizer: the loop's optimizer (its dense groups and state)
        :param trainable: the trainable shard tables (those in the dense groups are updated here)
        :param topology: the process topology (the replicated parameters' gradients are summed over it)
        :param step_counts: the device step counts (the device rules count the parameters' steps there)
        :param learning_rates: one device learning rate per parameter group of the optimizer
        :param on_the_host: whether the step runs its updates on the host (the CPU's static step), asked each step
        :param fused: the step's gated rule (compiled on CUDA)
        """
        self.optimizer = optimizer
        self.topology = topology
        self.step_counts = step_counts
        self.learning_rates = learning_rates
        self.on_the_host = on_the_host
        self.fused = fused
        in_dense_groups = {id(p) for group in optimizer.dense_groups for p in group["params"] if p.requires_grad}
        #: the trainable tables in the dense groups (``sparse_updates=False``): the user's optimizer updates them whole
        self.tables = [table for table in trainable if id(table.optimizer_parameter) in in_dense_groups]
        #: per trainable table (in order), whether it is updated here
        self.updates_table = [id(table.optimizer_parameter) in in_dense_groups for table in trainable]
        tables = {id(table.optimizer_parameter) for table in self.tables}
        #: the replicated parameters (the step differentiates its loss by them)
        self.parameters = [
            p for group in optimizer.dense_groups for p in group["params"] if p.requires_grad and id(p) not in tables
        ]
        copies = DENSE_COPIES * sum(table.weight.numel() * table.weight.element_size() for table in self.tables)
        available = available_memory(self.tables[0].weight.device) if self.tables else None
        copies_fit = available is None or copies <= DENSE_COPY_SHARE * available
        #: whether the user's optimizer updates the dense groups in its capturable form (off the CPU): the
        #: replicated parameters and the tables updated densely, if those are on the device and their copies fit
        self.capturable = (
            has_capturable_form(optimizer)
            and all(table.optimizer_parameter is table.weight for table in self.tables)
            and copies_fit
        )
        #: why neither the capturable form nor a device rule reproduces the dense groups' update (None: one does)
        self.rule_obstacle = (
            None
            if self.capturable
            else f"dense table updates by {optimizer.optimizer_cls.__name__}"
            if self.tables and (copies_fit or not has_capturable_form(optimizer))
            else f"dense table updates: their copies to undo a non-finite step ({copies / 2**30:.2f} GiB) would take "
            f"more than {DENSE_COPY_SHARE:.0%} of the available memory"
            if self.tables
            else dense_rule_obstacle(optimizer)
        )

    @property
    def by_the_optimizer(self) -> bool:
        """Whether the user's optimizer itself updates the dense groups (its ``step``), gated by a host read of ``ok``.

        On the CPU always (a host read costs no synchronisation there); elsewhere where no device rule
        reproduces the optimizer (:attr:`rule_obstacle`), and the step then runs uncaptured.
        """
        return self.on_the_host() or self.rule_obstacle is not None

    def gradients(self, grads: Sequence[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], Any]:
        """Sum the replicated parameters' gradients over the processes (one collective per dtype).

        :returns: the gradients (None: no process has one), and whether each parameter has one: None in
            one process (every gradient that is not None), else a float64 tensor ``[P]`` (> 0: present)
        """
        if not self.topology.is_distributed or not self.parameters:
            return list(grads), None
        device = self.learning_rates[0].device
        present = torch.tensor([grad is not None for grad in grads], dtype=torch.float64, device=device)
        values = [grad if grad is not None else torch.zeros_like(p) for p, grad in zip(self.parameters, grads)]
        present, *summed = self.topology.all_reduce_coalesced([present, *values])
        return list(summed), present

    def apply(self, grads: list[torch.Tensor | None], present: Any, ok: torch.Tensor, step_rows: StepRows) -> None:
        """Update the replicated parameters (and the tables updated densely) as the user's optimizer does.

        :param grads: the gradients of :attr:`parameters`, in order (None: no gradient)
        :param present: from :meth:`gradients`: None, or which parameters have a gradient on some process
        :param ok: whether to write
        :param step_rows: the step's rows with their summed gradients (the gradients of :attr:`tables`)
        """
        if not self.parameters and not self.tables:
            return
        if self.by_the_optimizer:
            self._optimizer_step(grads, present, ok, step_rows)
            return
        if self.capturable:
            self._capturable_step(grads, present, ok, step_rows)
            return
        rule = RULES[SPARSE_RULES[self.optimizer.optimizer_cls]].apply
        params = iter(zip(grads, range(len(self.parameters))))
        for index, group in enumerate(self.optimizer.dense_groups):
            lr = self.learning_rates[index]
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                grad, position = next(params)
                if grad is None:
                    continue
                apply = ok if present is None else ok & (present[position] > 0)
                state = self._state(param, group)
                names = [name for name in state if name != "step"]
                step = self.step_counts.count(param, state, apply) if "step" in state else lr  # SGD counts no steps
                old_state = {name: state[name] for name in names}
                new, new_state = self.fused(lr.device, rule, param.detach(), grad, old_state, group, step, lr, apply)
                param.copy_(new)
                for name in names:
                    state[name].copy_(new_state[name])

    def _capturable_step(
        self, grads: list[torch.Tensor | None], present: Any, ok: torch.Tensor, step_rows: StepRows
    ) -> None:
        """Run the user's optimizer in its capturable form, then keep the old values where ``ok`` is False.

        A parameter without state yet (its first step) has it created by this call: then ``ok`` is read on the
        host instead (:meth:`_optimizer_step`), as only a warm-up step, before any capture, can be a first step.
        """
        state = self.optimizer.state
        weights = [table.optimizer_parameter for table in self.tables]
        table_grads = self._table_gradients(step_rows)
        updated = [*zip(self.parameters, grads), *zip(weights, table_grads)]
        if any(grad is not None and not state.get(param) for param, grad in updated):
            with self._capturable_groups():
                self._optimizer_step(grads, present, ok, step_rows)
            return
        kept: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []
        for position, (param, grad) in enumerate(updated):
            if grad is None:
                continue
            param_state = state[param]
            step = param_state.get("step")
            if torch.is_tensor(step) and step.device != param.device:  # a state loaded on the host
                param_state["step"] = step.to(param.device)
            tensors = [param.detach(), *(value for value in param_state.values() if torch.is_tensor(value))]
            apply = ok if present is None or position >= len(self.parameters) else ok & (present[position] > 0)
            kept.append((apply, tensors, [tensor.clone() for tensor in tensors]))
            param.grad = grad
        with self._capturable_groups():
            self.optimizer.dense_step()
        for param, _ in updated:
            param.grad = None
        self._constrain_tables(step_rows)
        for apply, tensors, old in kept:
            for tensor, value in zip(tensors, old):
                tensor.copy_(torch.where(apply, tensor, value))

    def _table_gradients(self, step_rows: StepRows) -> list[torch.Tensor | None]:
        """Return the dense gradient ``[R, W]`` of every table updated here: its rows' sums, zero elsewhere."""
        summed_of_tables = [summed for summed, here in zip(step_rows.summed, self.updates_table) if here]
        gradients: list[torch.Tensor | None] = []
        for table, summed in zip(self.tables, summed_of_tables):
            if summed is not None and not self.on_the_host():  # every occurrence carries its row's sum: count one
                summed = summed * step_rows.first.to(summed.dtype).unsqueeze(1)
            weight = table.optimizer_parameter
            gradients.append(None if summed is None else torch.zeros_like(weight).index_add_(0, step_rows.rows, summed))
        return gradients

    def _constrain_tables(self, step_rows: StepRows) -> None:
        """Apply the tables' constraints to every entity's row, with fixed shapes (no host read).

        A dense update moves rows outside the step too (Adam's and momentum's running averages, weight decay):
        PyKEEN constrains the whole table after every step, and so does this (its entities' rows, not the
        padding). The runs of entity rows are found at the first (warm-up) step, before a graph is captured.
        """
        for table in self.tables:
            table.constrain_entity_rows()

    @contextlib.contextmanager
    def _capturable_groups(self) -> Iterator[None]:
        """Within the block, the dense groups are capturable and their learning rates the device tensors.

        A captured graph keeps what the call computed with: the device learning rates (refreshed every epoch)
        instead of the numbers a scheduler sets, and the step counts in the state on the device.
        """
        groups = self.optimizer.dense_groups
        saved = [(group["lr"], group["capturable"]) for group in groups]
        try:
            for group, lr in zip(groups, self.learning_rates):
                dtype = next((p.dtype for p in group["params"] if p.is_floating_point()), lr.dtype)
                group["lr"] = lr.to(dtype)
                group["capturable"] = not group.get("fused")  # (fused kernels keep their step on the device)
            with warnings.catch_warnings():  # torch's advice for a capturable step run uncaptured (a warm-up step)
                warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
                yield
        finally:
            for group, (lr, capturable) in zip(groups, saved):
                group["lr"], group["capturable"] = lr, capturable

    def _optimizer_step(
        self, grads: list[torch.Tensor | None], present: Any, ok: torch.Tensor, step_rows: StepRows
    ) -> None:
        """Hand the dense groups their gradients and run the user's optimizer (nothing if ``ok`` is False).

        A table updated densely gets the dense gradient ``[R, W]`` of its rows' sums (zero elsewhere, as the eager
        step builds it); after the update its constraint applies to every entity's row, as the eager step's.
        """
        if not bool(ok):
            return
        flags = [True] * len(self.parameters) if present is None else [flag > 0 for flag in present.tolist()]
        for param, grad, flag in zip(self.parameters, grads, flags):
            param.grad = grad if flag else None
        for table, grad in zip(self.tables, self._table_gradients(step_rows)):
            table.optimizer_parameter.grad = grad
        self.optimizer.dense_step()
        for param in self.parameters:
            param.grad = None
        for table in self.tables:  # every entity's row: the update moved rows outside the step too
            table.optimizer_parameter.grad = None
            table.constrain_entity_rows()

    def _state(self, param: torch.Tensor, group: dict) -> dict:
        """Return a replicated parameter's optimizer state (created as its optimizer creates it at its first step)."""
        state = self.optimizer.state[param]
        rule = SPARSE_RULES[self.optimizer.optimizer_cls]
        for name, (shape, fill) in state_shapes(rule, param.shape, group).items():
            if name not in state:
                state[name] = torch.full(shape, fill, dtype=param.dtype, device=param.device)
        if "step" not in state and rule != "sgd":
            # torch.optim's optimizers count in the default scalar dtype, RowwiseAdagrad in float32
            state["step"] = torch.zeros((), dtype=_scalar_dtype() if rule != "rowwise_adagrad" else torch.float32)
        return state


def has_capturable_form(optimizer: BessOptimizer) -> bool:
    """Whether the dense groups' ``torch.optim`` class has a capturable form (a ``capturable`` option) for them."""
    groups = optimizer.dense_groups
    return bool(groups) and all("capturable" in group and not group.get("differentiable") for group in groups)


def dense_rule_obstacle(optimizer: BessOptimizer) -> str | None:
    """Return why no device rule (:data:`~pykeen_bess.tables.row_rules.RULES`) reproduces the dense update."""
    if not optimizer.dense_groups:
        return None
    rule = SPARSE_RULES.get(optimizer.optimizer_cls)
    if rule is None:
        return f"no device rule for {optimizer.optimizer_cls.__name__}"
    required_options = {**RULES[rule].required_options, **DENSE_REQUIRED_OPTIONS}
    for group in optimizer.dense_groups:
        for key, required in required_options.items():
            if key in group and group[key] != required:
                return f"no device rule for {optimizer.optimizer_cls.__name__}({key}={group[key]!r})"
    return None


def _scalar_dtype() -> torch.dtype:
    """Return the dtype of an optimizer's step count (as ``torch.optim`` creates it)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
