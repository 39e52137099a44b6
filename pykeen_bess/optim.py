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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.optim import SGD, Adagrad, Adam, Optimizer, SparseAdam

__all__ = [
    "SPARSE_RULES",
    "BessOptimizer",
    "RowwiseAdagrad",
]


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
        :raises ValueError: for negative values
        """
        for name, value in (("lr", lr), ("lr_decay", lr_decay), ("eps", eps)):
            if not value >= 0:
                raise ValueError(f"RowwiseAdagrad needs {name} >= 0, not {value!r}.")
        if not initial_accumulator_value >= 0:
            raise ValueError(f"RowwiseAdagrad needs initial_accumulator_value >= 0, not {initial_accumulator_value!r}.")
        defaults = dict(
            lr=lr, lr_decay=lr_decay, eps=eps, initial_accumulator_value=initial_accumulator_value, maximize=maximize
        )
        super().__init__(params, defaults)

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
                if param.grad.is_sparse:
                    rows, values = _sparse_rows(param.grad)
                    update, scale = _rowwise_adagrad(rows, values, self.state[param], group, param)
                    param.index_add_(0, rows, update, alpha=scale)
                else:  # complex parameters as their real view: rows of real values
                    real = torch.view_as_real(param) if param.is_complex() else param
                    grad = torch.view_as_real(param.grad) if param.grad.is_complex() else param.grad
                    update, scale = _rowwise_adagrad(None, grad, self.state[param], group, real)
                    real.add_(update, alpha=scale)
        return loss


#: the row-sparse rule used for each supported optimizer class
SPARSE_RULES: dict[type[Optimizer], str] = {
    Adam: "adam",
    SparseAdam: "adam",
    Adagrad: "adagrad",
    SGD: "sgd",
    RowwiseAdagrad: "rowwise_adagrad",
}

#: hyper-parameters that must have these values for a row-sparse rule
_UNSUPPORTED_OPTIONS: dict[str, dict[str, Any]] = {
    "adam": dict(weight_decay=0, amsgrad=False),
    "adagrad": dict(weight_decay=0),
    "sgd": dict(momentum=0, weight_decay=0, nesterov=False),
    "rowwise_adagrad": {},
}


def optimizer_hyperparameters(optimizer: Optimizer) -> dict[str, Any]:
    """Return the hyper-parameters of an optimizer's first parameter group (without parameters)."""
    group = optimizer.param_groups[0] if optimizer.param_groups else optimizer.defaults
    return {key: value for key, value in group.items() if key not in {"params", "initial_lr"}}


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
        :raises ValueError: if the optimizer (or one of its options) has no row-sparse rule
        """
        self._row_constraints = {id(param): constraint for param, constraint in (row_constraints or {}).items()}
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
        self._num_dense_groups = len(groups)
        if table_params:
            rule = SPARSE_RULES.get(optimizer_cls)
            if rule is None:
                raise ValueError(
                    f"There is no row-sparse update rule for {optimizer_cls.__name__}. Use one of "
                    f"{sorted(c.__name__ for c in SPARSE_RULES)}, or pass sparse_updates=False (command line: "
                    f"--dense-updates) to update the entity shard tables densely (slower)."
                )
            defaults = dict(_sparse_defaults(optimizer_cls))
            defaults.update(
                {k: v for k, v in hyperparameters.items() if k in defaults or k in _UNSUPPORTED_OPTIONS[rule]}
            )
            for key, required in _UNSUPPORTED_OPTIONS[rule].items():
                if key in defaults and defaults.pop(key) != required:
                    raise ValueError(
                        f"{optimizer_cls.__name__}({key}={hyperparameters[key]!r}) has no row-sparse meaning; use "
                        f"{key}={required!r}, or pass sparse_updates=False (command line: --dense-updates) to "
                        f"update the shard tables densely."
                    )
            groups.append(dict(params=table_params, rule=rule, **defaults))
        if not groups:
            raise ValueError("The model has no trainable parameters.")
        super().__init__(groups, defaults=dict(hyperparameters))

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
        if self._dense is not None:
            # the dense optimizer works on our groups and state (load_state_dict replaces both)
            self._dense.param_groups = self.dense_groups
            self._dense.state = self.state
            self._dense.step()
        for group in self.sparse_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                rows, values = _sparse_rows(param.grad)
                update, scale = _APPLY[group["rule"]](rows, values, self.state[param], group, param)
                constraint = self._row_constraints.get(id(param))
                if constraint is None:
                    param.index_add_(0, rows, update, alpha=scale)
                else:
                    old = param.index_select(0, rows)
                    param.index_add_(0, rows, constraint(old.add(update, alpha=scale)).sub_(old))
        return None


def _sparse_defaults(optimizer_cls: type[Optimizer]) -> dict[str, Any]:
    """Hyper-parameters of the row-sparse rule and their defaults."""
    rule = SPARSE_RULES[optimizer_cls]
    if rule == "adam":
        return dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, maximize=False)
    if rule in ("adagrad", "rowwise_adagrad"):
        return dict(lr=1e-2, lr_decay=0, eps=1e-10, initial_accumulator_value=0, maximize=False)
    return dict(lr=1e-3, maximize=False)


def _sparse_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rows, values)`` of a row-sparse gradient (coalescing if necessary)."""
    if not grad.is_sparse:
        raise ValueError("Shard tables expect row-sparse gradients; the training loop sets them.")
    if not grad.is_coalesced():
        grad = grad.coalesce()
    return grad._indices()[0], grad._values()


def _adam(
    rows: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, param: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Lazy Adam on the touched rows (``torch.optim.SparseAdam`` semantics); returns (update, scale)."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)
    state["step"] += 1
    step = float(state["step"])
    beta1, beta2 = group["betas"]
    if group["maximize"]:
        grad = -grad
    # as SparseAdam: add the changes of the touched rows (rows are unique; index_add_ is the
    # fastest scatter on the CPU)
    exp_avg = state["exp_avg"].index_select(0, rows)
    exp_avg_sq = state["exp_avg_sq"].index_select(0, rows)
    exp_avg_change = (grad - exp_avg).mul_(1 - beta1)
    exp_avg_sq_change = (grad * grad).sub_(exp_avg_sq).mul_(1 - beta2)
    state["exp_avg"].index_add_(0, rows, exp_avg_change)
    state["exp_avg_sq"].index_add_(0, rows, exp_avg_sq_change)
    exp_avg.add_(exp_avg_change)
    exp_avg_sq.add_(exp_avg_sq_change)
    step_size = group["lr"] * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    return exp_avg.div_(exp_avg_sq.sqrt_().add_(group["eps"])), -step_size


def _adagrad_step(grad: torch.Tensor, state: dict, group: dict) -> tuple[torch.Tensor, float]:
    """Count a step of an Adagrad rule; return the (sign-adjusted) gradient and the decayed learning rate."""
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32)
    state["step"] += 1
    step = float(state["step"])
    clr = group["lr"] / (1 + (step - 1) * group["lr_decay"])
    return (-grad if group["maximize"] else grad), clr


def _adagrad(
    rows: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, param: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Row-sparse Adagrad (``torch.optim.Adagrad`` with a sparse gradient); returns (update, scale)."""
    if not state:
        state["sum"] = torch.full_like(param, group["initial_accumulator_value"])
    grad, clr = _adagrad_step(grad, state, group)
    squared = grad * grad
    state["sum"].index_add_(0, rows, squared)
    squares = state["sum"].index_select(0, rows)
    return grad / squares.sqrt_().add_(group["eps"]), -clr


def _rowwise_adagrad(
    rows: torch.Tensor | None, grad: torch.Tensor, state: dict, group: dict, param: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Row-wise Adagrad on the touched rows (all rows if ``rows`` is None); returns (update, scale).

    :param rows: shape: ``[U]``, unique rows, or None for a dense gradient
    :param grad: shape: ``[U, ...]`` (``param.shape`` for a dense gradient)
    """
    row_wise = param.dim() >= 2
    if not state:
        shape = param.shape[:1] if row_wise else param.shape
        state["sum"] = torch.full(shape, group["initial_accumulator_value"], dtype=param.dtype, device=param.device)
    grad, clr = _adagrad_step(grad, state, group)
    squared = grad * grad
    if row_wise:
        squared = squared.mean(dim=tuple(range(1, grad.dim())))
    if rows is None:
        state["sum"].add_(squared)
        squares = state["sum"].clone()
    else:
        state["sum"].index_add_(0, rows, squared)
        squares = state["sum"].index_select(0, rows)
    std = squares.sqrt_().add_(group["eps"])
    if row_wise:
        std = std.view(-1, *([1] * (grad.dim() - 1)))
    return grad / std, -clr


def _sgd(
    rows: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, param: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Row-sparse plain SGD; returns (update, scale)."""
    return grad, group["lr"] if group["maximize"] else -group["lr"]


_APPLY = {
    "adam": _adam,
    "adagrad": _adagrad,
    "sgd": _sgd,
    "rowwise_adagrad": _rowwise_adagrad,
}


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
