"""The optimizer side of a static step: row and dense updates with device step counts and learning rates.

:class:`StaticUpdate` applies the optimizer's rules inside a static step
(:mod:`~pykeen_bess.training.static_step`) on the very state tensors of the loop's
:class:`~pykeen_bess.tables.optim.BessOptimizer`, in place, so that its ``state_dict`` (checkpoints) and the
eager step, which runs an epoch's padded steps, see one optimizer:

* **rows**: a step's ``N`` looked-up rows arrive with one gradient per occurrence ``[N, W]``. A
  persistent row-to-slot map ``[R]`` gives every occurrence of a row one representative slot (the
  slot whose write to the map survived), ``index_add_`` sums the occurrences there, and the row rule
  (:data:`~pykeen_bess.tables.row_rules.STATIC_RULES`) runs on every occurrence with its row's summed
  gradient. All occurrences of a row compute the same new values, so their writes agree: the
  result is the eager step's lazy row-sparse update (same rows, same moments) up to rounding;
* **dense**: the replicated parameters with the user's optimizer's rule
  (:data:`~pykeen_bess.tables.row_rules.DENSE_RULES`);
* **gated**: every write keeps the old value where ``ok`` is False (a non-finite loss);
* **fused on a GPU**: a rule, its constraint and the gate are one function (:func:`gated_rule`),
  which ``torch.compile`` fuses into a few kernels on CUDA (about ten elementwise passes over the
  step's rows otherwise); on the CPU, and if compiling fails (logged once), it runs as written;
* **step counts and learning rates** are float64 device tensors: the counts start from the
  optimizer state's host counts and are handed back to it (:meth:`StaticUpdate.write_step_counts`,
  :meth:`StaticUpdate.read_step_counts`); the learning rates are refreshed per epoch (a scheduler
  changes them between epochs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from pykeen.nn.representation import Embedding
from torch.optim import SGD, Adagrad, Adam, SparseAdam

from ..data.batch import RowGather
from ..tables.optim import BessOptimizer, RowwiseAdagrad
from ..tables.representation import ShardedEmbedding
from ..tables.row_rules import DENSE_RULES, STATIC_RULES, state_shapes
from .tables import ShardTables

__all__ = [
    "DENSE_CLASSES",
    "DENSE_OPTIONS",
    "StaticUpdate",
    "gated_rule",
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
    :param ok: whether to apply the step (a 0-dimensional bool tensor)
    :param constraint: applied to the new values (e.g. a projection to unit norm), or None
    :returns: the values and the state to write
    """
    new, new_state = rule(old, grad, state, group, step, lr)
    if constraint is not None:
        new = constraint(new)
    return torch.where(ok, new, old), {name: torch.where(ok, value, state[name]) for name, value in new_state.items()}


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


class StaticUpdate:
    """The updates of a static step, on the state of the loop's optimizer."""

    def __init__(self, optimizer: BessOptimizer, tables: ShardTables, model: Any, num_rows: int):
        """Bind to the optimizer; create the tables' missing row state as the optimizer would at its first step.

        :param optimizer: the loop's optimizer (its state tensors are updated in place)
        :param tables: the shard tables
        :param model: the model (``post_parameter_update`` runs after every update)
        :param num_rows: ``N``, the rows a step looks up (occurrences)
        """
        self.optimizer = optimizer
        self.tables = tables
        self.model = model
        self.device = tables[0].compute_device
        self.trainable = [table for table in tables if table.trainable]
        #: the replicated parameters the dense rule updates
        self.dense = [p for group in optimizer.dense_groups for p in group["params"] if p.requires_grad]
        for group in optimizer.sparse_groups:
            for param in group["params"]:
                state = optimizer.state[param]
                for name, (shape, fill) in state_shapes(group["rule"], param.shape, group).items():
                    if name not in state:
                        state[name] = torch.full(shape, fill, dtype=param.dtype, device=param.device)
        #: one learning rate per parameter group, read by the step (a captured step reads these tensors)
        self.learning_rates = [torch.zeros((), dtype=torch.float64, device=self.device) for _ in optimizer.param_groups]
        #: shape: ``[N]``, the slots of a step's rows
        self.slots = torch.arange(num_rows, device=self.device)
        #: shape: ``[R]``, a slot of the current step for every table row (stale outside the step's rows)
        self.slot_of_row = torch.zeros(tables[0].weight.shape[0], dtype=torch.long, device=self.device)
        self._host_steps: dict[int, float] = {}  # the optimizer's step count of every counted parameter
        self._step_counts: dict[int, torch.Tensor] = {}  # the same on the device
        #: the parameters with a step count, and their optimizer state
        self.counted: list[tuple[torch.Tensor, dict]] = []

    def refresh_learning_rates(self) -> None:
        """Copy the parameter groups' learning rates into the device tensors the step reads."""
        for buffer, group in zip(self.learning_rates, self.optimizer.param_groups):
            buffer.fill_(float(group["lr"]))

    def rows(self, gathered: RowGather, grads: list[torch.Tensor | None], ok: torch.Tensor) -> None:
        """Apply the row rule to the step's rows, every occurrence with its row's summed gradient.

        :param gathered: the step's rows ``[N]`` and leaves ``[N, W]`` (of all tables)
        :param grads: the trainable tables' leaves' gradients ``[N, W]`` (None: no gradient)
        :param ok: whether to write (a 0-dimensional bool tensor)
        """
        rows = gathered.rows
        if all(grad is None for grad in grads):
            return
        # one representative slot per row: the slot whose write to the map survived
        self.slot_of_row.index_put_((rows,), self.slots)
        representative = self.slot_of_row.index_select(0, rows)
        group = self.optimizer.sparse_groups[0]
        lr = self.learning_rates[len(self.optimizer.dense_groups)]
        rule = STATIC_RULES[group["rule"]]
        leaves = [leaf for leaf in gathered.leaves if leaf.requires_grad]
        for table, leaf, grad in zip(self.trainable, leaves, grads):
            if grad is None:
                continue
            param = table.weight
            summed = torch.zeros_like(grad).index_add_(0, representative, grad).index_select(0, representative)
            state = self.optimizer.state[param]
            step = self._count(param, state, ok)
            names = list(state_shapes(group["rule"], param.shape, group))
            old_state = {name: state[name].index_select(0, rows) for name in names}
            constraint = self.optimizer._row_constraints.get(id(param))
            new, new_state = fused_rule(
                self.device, rule, leaf.detach(), summed, old_state, group, step, lr, ok, constraint
            )
            param.index_put_((rows,), new)
            for name in names:
                state[name].index_put_((rows,), new_state[name])

    def dense_parameters(self, grads: list[torch.Tensor | None], ok: torch.Tensor) -> None:
        """Update the replicated parameters with the user's optimizer's rule.

        :param grads: the gradients of :attr:`dense`, in order (None: no gradient)
        :param ok: whether to write
        """
        if not self.dense:
            return
        rule = DENSE_RULES[DENSE_CLASSES[self.optimizer.optimizer_cls]]
        params = iter(zip(self.dense, grads))
        for index, group in enumerate(self.optimizer.dense_groups):
            lr = self.learning_rates[index]
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                _, grad = next(params)
                if grad is None:
                    continue
                state = self._dense_state(param, group)
                names = [name for name in state if name != "step"]
                step = self._count(param, state, ok) if "step" in state else lr  # SGD counts no steps
                old_state = {name: state[name] for name in names}
                new, new_state = fused_rule(self.device, rule, param.detach(), grad, old_state, group, step, lr, ok)
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
            self._host_steps[key] = float(state["step"])
            self._step_counts[key] = torch.full((), self._host_steps[key], dtype=torch.float64, device=self.device)
            self.counted.append((param, state))
        count = self._step_counts[key]
        current = count + 1
        count.copy_(torch.where(ok, current, count))
        return current

    def count_applied(self, applied: int) -> None:
        """Add ``applied`` steps to the host step counts and write them into the optimizer's state."""
        for key in self._host_steps:
            self._host_steps[key] += applied
        self.write_step_counts()

    def write_step_counts(self) -> None:
        """Write the step counts into the optimizer's state (before the eager step or a checkpoint uses it)."""
        for param, state in self.counted:
            state["step"].fill_(self._host_steps[id(param)])

    def read_step_counts(self) -> None:
        """Take the step counts back from the optimizer's state (after eager steps advanced them)."""
        for param, state in self.counted:
            count = float(state["step"])  # a host tensor
            self._host_steps[id(param)] = count
            self._step_counts[id(param)].fill_(count)


def _scalar_dtype() -> torch.dtype:
    """Return the dtype of an optimizer's step count (as ``torch.optim`` creates it)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
