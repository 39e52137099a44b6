"""Row-sparse optimizer updates for the shard tables.

A BESS step touches a few thousand rows of an entity table that may hold millions. Updating the
whole table densely every step, as ``torch.optim.Adam`` does for a dense gradient, caps
throughput, so :class:`BessOptimizer` combines

* the user's optimizer (same class and hyper-parameters) for the *replicated* parameters
  (relations, interaction parameters), updated densely; and
* a lazy, row-sparse rule for the shard tables, applied to the rows a step touched only, with the
  semantics of PyTorch's own sparse-gradient optimizers (as PyTorch-BigGraph and DGL-KE do):

  ========== ================================================================================
  optimizer  row-sparse rule
  ========== ================================================================================
  Adam       lazy Adam, as ``torch.optim.SparseAdam``: the moments of a row are updated only
             in the steps that touch the row; the bias correction uses the global step count
  SparseAdam the same
  Adagrad    ``torch.optim.Adagrad`` with a sparse gradient: the squared-gradient sum of a row
             grows only when it is touched; ``lr_decay`` follows the global step count
  SGD        ``torch.optim.SGD`` with a sparse gradient (plain SGD)
  Rowwise-   :class:`RowwiseAdagrad` (``optimizer="rowwise_adagrad"``): Adagrad with one
  Adagrad    accumulator per row, the mean of the row's squared gradient (PyTorch-BigGraph's
             ``RowAdagrad``); its state is one float per row instead of one per value
  ========== ================================================================================

  Options that have no row-sparse meaning (weight decay, AMSGrad, momentum) raise an error;
  pass ``sparse_updates=False`` to the training loop to update the shard tables densely with any
  optimizer instead.

The training loop hands the gradient of a shard table to the optimizer as a *coalesced sparse*
``grad`` (unique rows, summed values). :class:`BessOptimizer` is a ``torch.optim.Optimizer``:
learning-rate schedulers, ``state_dict`` / ``load_state_dict`` and PyKEEN's checkpoints work
unchanged; its parameter groups are the dense groups followed by one group of shard tables.

Each rule is one function of a step's rows ``[U, W]``, their gradient, the rows of the rule's
state tensors, the hyper-parameters and the step count (module :mod:`pykeen_bess.tables.row_rules`:
:data:`~pykeen_bess.tables.row_rules.RULES`, each a :class:`~pykeen_bess.tables.row_rules.RowRule`).
:class:`BessOptimizer` reads those rows from the table's storage tier (:mod:`pykeen_bess.storage`:
the device, host memory or files) as copies the rule may update in place, applies the rule on the
compute device and writes rows and state back, so every tier runs the same arithmetic. Lazy Adam
runs as one pass of PyTorch's fused Adam kernel where it has one (CPU and CUDA), with ``eps``
rescaled so that the update is SparseAdam's. A table kept
outside the model is represented in the optimizer by a handle (an empty parameter carrying the
step count); its state tensors stay in its tier, never in the optimizer's ``state``.
"""

from __future__ import annotations

import numbers

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
from torch.optim import SGD, Adagrad, Adam, Optimizer, SparseAdam

from .row_rules import RULES, count_step, state_shapes
from ..storage import DeviceStorage, HeldTable, TableStorage

__all__ = [
    "RULES",
    "DENSE_REQUIRED_OPTIONS",
    "SPARSE_RULES",
    "StoredTable",
    "BessOptimizer",
    "RowwiseAdagrad",
]


class StoredTable(HeldTable, Protocol):
    """A shard table as the row rules see it (:class:`~pykeen_bess.tables.representation.ShardedEmbedding`).

    Its rows, row state and gradient are where its tier keeps them (:class:`~pykeen_bess.storage.HeldTable`).
    """

    #: the storage tier
    storage: TableStorage
    #: the row-sparse gradient ``[R, W]`` (through the tier: a parameter's ``grad`` or the stored gradient)
    gradient: torch.Tensor | None
    #: shape: ``[U, W]``, the current values of the rows the gradient touches, if already read (else None)
    touched_values: torch.Tensor | None

    def row_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Return the mean of every row's entries ``[U, W] -> [U]`` over whole rows."""


class RowwiseAdagrad(Optimizer):
    """Adagrad with one accumulator per row: PyTorch-BigGraph's ``RowAdagrad``, for embedding tables.

    For a parameter with rows (2 or more dimensions, rows along the first), step ``t`` with
    gradient ``g`` (the rows a sparse gradient touches, all rows of a dense one) does::

        sum[r] += mean(g[r] ** 2)                       # one float of state per row
        p[r]   -= lr / (1 + (t - 1) * lr_decay) * g[r] / (sqrt(sum[r]) + eps)

    so a table's optimizer state is ``4 * rows`` bytes (0.4 GB for 100M rows) instead of
    Adam's two full copies of the table. Parameters without rows (0 or 1 dimensions) keep one
    accumulator per value (plain Adagrad); complex parameters count as their real view. Rows of a
    dense gradient that are all zero are left unchanged, as with a sparse gradient. Registered in
    PyKEEN's ``optimizer_resolver`` as ``"rowwise_adagrad"``; the BESS training loop updates shard
    tables with the same rule, row-sparsely.

    A table whose rows are split into column parts over processes (the encoding partition) takes
    the mean over its whole rows from :attr:`row_means` (set by :class:`BessOptimizer` for the
    tables it updates densely).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        maximize: bool = False,
    ):
        """Create the optimizer.

        :param params: the parameters (or parameter groups)
        :param lr: the learning rate
        :param lr_decay: the learning-rate decay per step
        :param eps: added to the square root of the accumulator
        :param initial_accumulator_value: the accumulators' start value
        :param maximize: maximize the objective instead of minimizing it
        :raises ValueError: for negative values, ``maximize`` other than True or False, or ``eps=0`` with
            ``initial_accumulator_value=0`` (a row whose gradients are all zero so far would divide 0 by 0)
        """
        for name, value in (("lr", lr), ("lr_decay", lr_decay), ("eps", eps)):
            if not value >= 0:
                raise ValueError(f"RowwiseAdagrad needs {name} >= 0, not {value!r}.")
        if not isinstance(maximize, bool | numbers.Integral) or maximize not in (0, 1):  # not "no"
            raise ValueError(f"RowwiseAdagrad needs maximize=True or False, not {maximize!r}.")
        if not initial_accumulator_value >= 0:
            raise ValueError(f"RowwiseAdagrad needs initial_accumulator_value >= 0, not {initial_accumulator_value!r}.")
        if eps == 0 and initial_accumulator_value == 0:
            raise ValueError(
                "RowwiseAdagrad with eps=0 needs initial_accumulator_value > 0: a row whose gradients are all zero so "
                "far would be divided by 0 (NaN)."
            )
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            eps=eps,
            initial_accumulator_value=initial_accumulator_value,
            maximize=bool(maximize),
        )
        super().__init__(params, defaults)
        #: per parameter (by ``id``): the mean over each row's entries ``[U, *] -> [U]`` (default: the row's own)
        self.row_means: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                real = torch.view_as_real(param) if param.is_complex() else param  # complex: its real view
                if "sum" not in state:
                    shape = state_shapes("rowwise_adagrad", real.shape, group)["sum"][0]
                    state["sum"] = torch.full(
                        shape, group["initial_accumulator_value"], dtype=real.dtype, device=param.device
                    )
                step = count_step(state)
                row_mean = self.row_means.get(id(param))
                if param.grad.is_sparse:
                    rows, values = _sparse_rows(param.grad)
                    old = {"sum": state["sum"].index_select(0, rows)}
                    weight, new = RULES["rowwise_adagrad"].update_(
                        param.index_select(0, rows), values, old, group, step, row_mean
                    )
                    param.index_copy_(0, rows, weight)
                    state["sum"].index_copy_(0, rows, new["sum"])
                else:  # complex parameters as their real view: rows of real values
                    grad = torch.view_as_real(param.grad) if param.grad.is_complex() else param.grad
                    rule = RULES["rowwise_adagrad"]
                    weight, new = rule.update_(real, grad, {"sum": state["sum"]}, group, step, row_mean)
                    real.copy_(weight)
                    state["sum"].copy_(new["sum"])  # in place: a captured step reads this tensor
        return loss


#: the one registry of the optimizers BESS updates itself: each supported class's rule, by which the shard tables
#: are updated row-sparsely (:data:`~pykeen_bess.tables.row_rules.RULES`); a captured static step also updates the
#: replicated parameters by it where torch has no capturable form of the optimizer (Adagrad, SGD, row-wise Adagrad)
SPARSE_RULES: dict[type[Optimizer], str] = {
    Adam: "adam",
    SparseAdam: "adam",
    Adagrad: "adagrad",
    SGD: "sgd",
    RowwiseAdagrad: "rowwise_adagrad",
}

#: the options a captured static step needs of the replicated parameters' optimizer (it differentiates nothing)
DENSE_REQUIRED_OPTIONS: dict[str, Any] = dict(differentiable=False)


def optimizer_hyperparameters(optimizer: Optimizer, scheduled: bool = False) -> dict[str, Any]:
    """Return the hyper-parameters of an optimizer's first parameter group (without parameters).

    :param scheduled: a learning-rate scheduler made for the optimizer will be made again for the loop's: it
        recorded the rate it was given as ``initial_lr`` and may have scaled ``lr`` already (``LinearLR``,
        ``ConstantLR``: by their start factor), so the rate is the given one, which the rebuilt scheduler
        scales once (without a scheduler, the optimizer's current rate)
    """
    group = optimizer.param_groups[0] if optimizer.param_groups else optimizer.defaults
    accepted = inspect.signature(type(optimizer).__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    # a group may hold keys its class' constructor does not take (torch's AdamW keeps Adam's decoupled_weight_decay)
    settings = {
        key: value
        for key, value in group.items()
        if key not in {"params", "initial_lr"} and (takes_any or key in accepted)
    }
    if scheduled and "initial_lr" in group and "lr" in settings:
        settings["lr"] = group["initial_lr"]
    return settings


class BessOptimizer(Optimizer):
    """Dense updates for replicated parameters plus lazy row-sparse updates for shard tables."""

    def __init__(
        self,
        optimizer_cls: type[Optimizer],
        dense_params: Iterable[torch.nn.Parameter],
        table_params: Iterable[torch.nn.Parameter],
        hyperparameters: Mapping[str, Any] | None = None,
        sparse_updates: bool = True,
        row_constraints: Mapping[torch.nn.Parameter, Callable[[torch.Tensor], torch.Tensor]] | None = None,
        tables: Mapping[torch.nn.Parameter, StoredTable] | None = None,
    ):
        """Create the optimizer.

        :param optimizer_cls: the user's optimizer class (e.g. ``torch.optim.Adam``)
        :param dense_params: the replicated parameters, updated by ``optimizer_cls``
        :param table_params: the shard tables (2-D parameters)
        :param hyperparameters: the optimizer's keyword arguments (``lr``, ``betas``, ...)
        :param sparse_updates: whether to update the shard tables row-sparsely; if False, they are
            updated densely by ``optimizer_cls`` like every other parameter
        :param row_constraints: per shard table, a function applied to the updated rows
            ``[U, D]`` within each row-sparse update (e.g. a projection to unit norm)
        :param tables: per entry of ``table_params``, the stored table it stands for: its rows and
            row state are read and written through the table's storage tier (for a table kept
            outside the model, the entry is a handle: an empty parameter that carries the step count)
        :raises ValueError: if the optimizer (or one of its options) has no row-sparse rule
        """
        self._row_constraints = {id(param): constraint for param, constraint in (row_constraints or {}).items()}
        self._tables = {id(param): table for param, table in (tables or {}).items()}
        hyperparameters = dict(hyperparameters or {})
        dense_params = [p for p in dense_params if p.requires_grad]
        table_params = [p for p in table_params if p.requires_grad]
        self.optimizer_cls = optimizer_cls
        self.sparse_updates = sparse_updates
        dense_cls = Adam if optimizer_cls is SparseAdam else optimizer_cls
        if not sparse_updates:
            dense_params = dense_params + table_params
            table_params = []
        groups: list[dict[str, Any]] = []
        self._dense: Optimizer | None = None
        if dense_params:
            self._dense = dense_cls(dense_params, **hyperparameters)
            groups.extend(self._dense.param_groups)
            if isinstance(self._dense, RowwiseAdagrad):  # tables updated densely: the mean over whole rows
                self._dense.row_means = {key: table.row_mean for key, table in self._tables.items()}
        self._num_dense_groups = len(groups)
        if table_params:
            rule = SPARSE_RULES.get(optimizer_cls)
            if rule is None:
                raise ValueError(
                    f"There is no row-sparse update rule for {optimizer_cls.__name__}. Use one of "
                    f"{sorted(c.__name__ for c in SPARSE_RULES)}, or pass sparse_updates=False (command line: "
                    f"--dense-updates) to update the entity shard tables densely (slower)."
                )
            required_options = RULES[rule].required_options
            defaults = dict(RULES[rule].defaults)
            defaults.update({k: v for k, v in hyperparameters.items() if k in defaults or k in required_options})
            for key, required in required_options.items():
                if key in defaults and defaults.pop(key) != required:
                    cycled = " (OneCycleLR and CyclicLR set it, unless cycle_momentum=False)" * (key == "momentum")
                    raise ValueError(
                        f"{optimizer_cls.__name__}({key}={hyperparameters[key]!r}) has no row-sparse meaning; use "
                        f"{key}={required!r}{cycled}, or pass sparse_updates=False (command line: --dense-updates) "
                        f"to update the shard tables densely."
                    )
            groups.append(dict(params=table_params, rule=rule, **defaults))
        if not groups:
            raise ValueError("The model has no trainable parameters.")
        super().__init__(groups, defaults=dict(hyperparameters))
        for group in self.sparse_groups:  # tables outside the model: fresh row state in their tier, now
            for param in group["params"]:
                table = self._tables.get(id(param))
                if table is not None:
                    table.storage.reset_row_state(table, state_shapes(group["rule"], table.weight.shape, group))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of all parameters and of the tables kept outside the model."""
        super().zero_grad(set_to_none=set_to_none)
        for table in self._tables.values():
            table.touched_values = None
            table.storage.clear_gradient(table)

    @property
    def dense_groups(self) -> list[dict[str, Any]]:
        """The parameter groups updated by the user's optimizer."""
        return self.param_groups[: self._num_dense_groups]

    @property
    def sparse_groups(self) -> list[dict[str, Any]]:
        """The parameter groups of shard tables, updated row-sparsely."""
        return self.param_groups[self._num_dense_groups :]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update the dense parameters with the user's optimizer, the shard tables row-sparsely."""
        if closure is not None:
            raise ValueError("BessOptimizer does not support closures.")
        self.dense_step()
        for group in self.sparse_groups:
            for param in group["params"]:
                self._update_rows(param, group)
        return None

    @torch.no_grad()
    def dense_step(self) -> None:
        """Update the parameters of the dense groups that have a gradient with the user's optimizer itself."""
        if self._dense is not None:
            # the dense optimizer works on our groups and state (load_state_dict replaces both)
            self._dense.param_groups = self.dense_groups
            self._dense.state = self.state
            self._dense.step()

    def _update_rows(self, param: torch.nn.Parameter, group: dict[str, Any]) -> None:
        """Apply a group's row rule to the rows of one table the step touched.

        A table kept in a storage tier outside the model (host memory, files) is represented in
        the group by a handle; its rows, state rows and gradient are those of the stored table, read
        to the compute device and written back through its tier. Every other table is the
        parameter itself, with its state in this optimizer's state.
        """
        table = self._tables.get(id(param))
        state = self.state[param]
        # a parameter without a table is read and written like the device tier
        storage = table.storage if table is not None else _PARAMETER_STORAGE
        grad = table.gradient if table is not None else param.grad
        if grad is None:
            return
        rows, values = _sparse_rows(grad)
        rule = group["rule"]
        weight: torch.Tensor = table.weight if table is not None else param
        row_state: dict[str, Any] = storage.row_state(table, state) if table is not None else state
        shapes = state_shapes(rule, weight.shape, group)
        for name, (shape, fill) in shapes.items():
            if name not in row_state:  # a parameter's state, created at its first step (stored tables': in __init__)
                row_state[name] = torch.full(shape, fill, dtype=weight.dtype, device=weight.device)
        step = count_step(state)
        cached = table.touched_values if table is not None else None
        if cached is not None and cached.shape[0] != rows.shape[0]:
            cached = None  # a callback changed the gradient's rows (e.g. zeroed it: a sparse zero_ drops every row)
        old = cached if cached is not None else storage.read(weight, rows)
        state_rows = {name: storage.read(row_state[name], rows) for name in shapes}
        row_mean = table.row_mean if table is not None and RULES[rule].whole_rows else None
        new, new_state = RULES[rule].update_(old, values, state_rows, group, step, row_mean)
        constraint = self._row_constraints.get(id(param))
        if constraint is not None:
            new = constraint(new)
        storage.write(weight, rows, new)
        for name in shapes:
            storage.write(row_state[name], rows, new_state[name])


#: reads and writes the rows of parameters the optimizer updates without a shard table
_PARAMETER_STORAGE = DeviceStorage()


def _sparse_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rows, values)`` of a sparse gradient (coalescing if necessary): its touched rows, whole.

    A gradient sparse in more dimensions than the rows (e.g. ``dense.to_sparse()``, every value its own entry)
    is gathered into its touched rows, the entries it does not hold 0.
    """
    if not grad.is_sparse:
        raise ValueError("Shard tables expect row-sparse gradients; the training loop sets them.")
    if not grad.is_coalesced():
        grad = grad.coalesce()
    indices = grad._indices()
    if grad.sparse_dim() == 1:
        return indices[0], grad._values()
    rows, position = torch.unique(indices[0], return_inverse=True)
    values = grad._values().new_zeros(rows.shape[0], *grad.shape[1:])
    values.index_put_((position, *indices[1:]), grad._values())
    return rows, values


def row_sparse_grad(param: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Build the coalesced sparse gradient of a 2-D parameter from unique rows and their values.

    :param param: shape: ``[R, D]``
    :param rows: shape: ``[U]``, unique, sorted row ids
    :param values: shape: ``[U, D]``
    :returns: a sparse COO tensor of shape ``[R, D]``
    """
    return torch.sparse_coo_tensor(
        rows.unsqueeze(0), values, size=param.shape, is_coalesced=True, check_invariants=False
    )
