"""The row rules of :class:`~pykeen_bess.tables.optim.BessOptimizer`: lazy Adam, Adagrad, row-wise Adagrad, SGD.

A rule (:class:`RowRule`) is one optimizer's update of the rows ``[U, *]`` of a table, given their
gradient, the rows of the rule's state tensors and the step count. It never sees the table itself,
so the same rule updates a table on the device, in host memory or in files
(:mod:`pykeen_bess.storage`). Each rule has two forms of the same arithmetic:

* :meth:`RowRule.update_`, **in place** with the step count a Python number: the eager step's
  optimizer and the CPU's static step (:mod:`~pykeen_bess.training.steps.host_rows`) read rows into
  copies the rule may update; lazy Adam runs as one pass of PyTorch's fused Adam kernel there;
* :meth:`RowRule.apply`, **new tensors** with the step count and learning rate as 0-dimensional
  device tensors: a captured step (a CUDA graph) bakes every Python number into the graph, and the
  caller decides whether to write the result (a step with a non-finite loss writes nothing).

:data:`RULES` is the one registry, by name (:data:`~pykeen_bess.tables.optim.SPARSE_RULES` maps
the optimizer classes to these names). The replicated parameters are not updated by these rules but by
the user's ``torch.optim`` optimizer itself (in its capturable form on a GPU, see
:mod:`~pykeen_bess.training.steps.dense_update`), except for the optimizers torch has no capturable form of
(Adagrad, SGD, row-wise Adagrad), whose rules are the same on a whole tensor. A new optimizer is one new
subclass here plus its registry entries.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch.optim.adam import adam as functional_adam

__all__ = [
    "RULES",
    "RowRule",
    "count_step",
    "state_shapes",
]

#: the result of a rule: the new rows and the new state rows, by name
Update = tuple[torch.Tensor, dict[str, torch.Tensor]]


class RowRule(ABC):
    """One optimizer's update of rows, in place (host step counts) or as new tensors (device step counts)."""

    #: the state holds one value per whole row (a column part of the rows needs the mean over whole rows)
    whole_rows: ClassVar[bool] = False
    #: the rule's hyper-parameters and their defaults (those of the optimizer it stands for)
    defaults: ClassVar[dict[str, Any]] = {}
    #: the optimizer's options the rule has no meaning for, with the values they must have (e.g. no weight decay)
    required_options: ClassVar[dict[str, Any]] = {}

    def state_shapes(self, shape: Sequence[int], group: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], float]]:
        """Return the state tensors the rule keeps for a parameter of ``shape``: name -> (shape, initial value)."""
        return {}

    @abstractmethod
    def update_(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        group: Mapping[str, Any],
        step: float,
        row_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Update:
        """Update rows in place (the rows and state rows are the rule's own copies; the gradient is only read).

        :param weight: shape: ``[U, *]``, the rows
        :param grad: shape: ``[U, *]``, their gradient
        :param state: the rule's state rows by name
        :param group: the hyper-parameters
        :param step: the step count including this step
        :param row_mean: the mean over whole rows ``[U, *] -> [U]`` (rules with :attr:`whole_rows`; default: the
            rows' own)
        :returns: the new rows and state rows
        """

    @abstractmethod
    def apply(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        group: Mapping[str, Any],
        step: torch.Tensor,
        lr: torch.Tensor,
        squared_mean: torch.Tensor | None = None,
    ) -> Update:
        """Return the updated rows and state rows as new tensors, the step count and learning rate device tensors.

        :param weight: shape: ``[U, *]``, the rows
        :param grad: shape: ``[U, *]``, their gradient
        :param state: the rule's state rows by name
        :param group: the hyper-parameters
        :param step: the step count including this step (0-dimensional)
        :param lr: the learning rate (0-dimensional)
        :param squared_mean: shape: ``[U]``, the mean of every row's squared gradient over its whole row (rules
            with :attr:`whole_rows`; default: computed from ``grad``)
        """


class AdamRule(RowRule):
    """Lazy Adam (``torch.optim.SparseAdam``): a row's moments change only in the steps that touch it.

    The bias correction uses the global step count.
    """

    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, maximize=False)
    required_options = dict(weight_decay=0, amsgrad=False)

    def state_shapes(self, shape: Sequence[int], group: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], float]]:
        return {"exp_avg": (tuple(shape), 0.0), "exp_avg_sq": (tuple(shape), 0.0)}

    def update_(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        group: Mapping[str, Any],
        step: float,
        row_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Update:
        # Where PyTorch has a fused Adam kernel for the rows (floating-point rows on the CPU or a GPU), one pass of
        # it does the update. Its ``eps`` is added after dividing by ``sqrt(1 - beta2^t)``: the lazy rule gives it
        # ``eps / sqrt(1 - beta2^t)``, which is SparseAdam's rule exactly (up to rounding).
        beta1, beta2 = group["betas"]
        bias_correction2 = 1 - beta2**step
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if _fused_adam_applies(weight, grad, exp_avg, exp_avg_sq):
            as_real = torch.view_as_real if weight.is_complex() else (lambda x: x)
            functional_adam(  # torch's functional Adam; it counts the step itself (hence step - 1)
                [as_real(weight)],
                [as_real(grad)],
                [as_real(exp_avg)],
                [as_real(exp_avg_sq)],
                [],
                [torch.tensor(float(step) - 1, device=weight.device)],
                fused=True,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=0.0,
                eps=group["eps"] / math.sqrt(bias_correction2),
                amsgrad=False,
                maximize=group["maximize"],
            )
            return weight, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        if group["maximize"]:
            grad = -grad
        exp_avg = exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq = exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = group["lr"] * math.sqrt(bias_correction2) / (1 - beta1**step)
        weight = weight.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(group["eps"]), value=-step_size)
        return weight, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    def apply(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        group: Mapping[str, Any],
        step: torch.Tensor,
        lr: torch.Tensor,
        squared_mean: torch.Tensor | None = None,
    ) -> Update:
        beta1, beta2 = group["betas"]
        if group["maximize"]:
            grad = -grad
        moments = {
            "exp_avg": torch.lerp(state["exp_avg"], grad, 1 - beta1),
            "exp_avg_sq": torch.addcmul(state["exp_avg_sq"] * beta2, grad, grad, value=1 - beta2),
        }
        step_size = lr * torch.sqrt(1 - beta2**step) / (1 - beta1**step)
        update = moments["exp_avg"] / (moments["exp_avg_sq"].sqrt() + group["eps"])
        return weight - step_size.to(weight.dtype) * update, moments


def _fused_adam_applies(*tensors: torch.Tensor) -> bool:
    """Whether PyTorch's fused Adam kernel can update these rows in place (same device and dtype, contiguous)."""
    first = tensors[0]
    return (
        (first.is_floating_point() or first.is_complex())
        and all(t.device == first.device and t.dtype == first.dtype and t.is_contiguous() for t in tensors)
        and _has_fused_adam(first.device.type)
    )


#: per device type, whether this torch has a fused Adam kernel for it (CPU: torch 2.4 and later)
_FUSED_ADAM: dict[str, bool] = {}


def _has_fused_adam(device_type: str) -> bool:
    """Whether torch's fused Adam (``functional_adam(fused=True)``) runs on this device type (tried once)."""
    if device_type not in _FUSED_ADAM:
        available = device_type in ("cpu", "cuda")
        if available:
            values = [torch.zeros(1, device=device_type) for _ in range(4)]
            try:
                functional_adam(
                    [values[0]], [values[1]], [values[2]], [values[3]], [], [torch.zeros((), device=device_type)],
                    fused=True, lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                    maximize=False,
                )  # fmt: skip
            except (NotImplementedError, RuntimeError):
                available = False
        _FUSED_ADAM[device_type] = available
    return _FUSED_ADAM[device_type]


def _adagrad_lr(group: Mapping[str, Any], step: Any, lr: Any) -> Any:
    """Return the learning rate of an Adagrad rule at ``step`` (``lr_decay``), a number or a tensor."""
    return lr / (1 + (step - 1) * group["lr_decay"])


class AdagradRule(RowRule):
    """Adagrad on rows (``torch.optim.Adagrad``, sparse or dense gradient): a row's sum grows when it is touched."""

    defaults = dict(lr=1e-2, lr_decay=0, eps=1e-10, initial_accumulator_value=0, maximize=False)
    required_options = dict(weight_decay=0)

    def state_shapes(self, shape: Sequence[int], group: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], float]]:
        return {"sum": (tuple(shape), float(group["initial_accumulator_value"]))}

    def update_(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        group: Mapping[str, Any],
        step: float,
        row_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Update:
        if group["maximize"]:
            grad = -grad
        squares = state["sum"].addcmul_(grad, grad)  # the rule's own copy of the state rows
        step_size = _adagrad_lr(group, step, group["lr"])
        return weight.addcdiv_(grad, squares.sqrt().add_(group["eps"]), value=-step_size), {"sum": squares}

    def apply(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        group: Mapping[str, Any],
        step: torch.Tensor,
        lr: torch.Tensor,
        squared_mean: torch.Tensor | None = None,
    ) -> Update:
        if group["maximize"]:
            grad = -grad
        squares = torch.addcmul(state["sum"], grad, grad)
        step_size = _adagrad_lr(group, step, lr).to(weight.dtype)
        return weight - step_size * grad / (squares.sqrt() + group["eps"]), {"sum": squares}


class RowwiseAdagradRule(RowRule):
    """Row-wise Adagrad on rows ``[U, ...]`` (state ``sum``: ``[U]``): PyTorch-BigGraph's ``RowAdagrad``.

    Without rows (0-1 dimensions) it is plain Adagrad. The state holds one value per whole row, the mean of
    the row's squared gradient summed over the steps; a column part of the rows takes that mean over its
    whole rows (``row_mean``, ``squared_mean``).
    """

    whole_rows = True
    defaults = dict(lr=1e-2, lr_decay=0, eps=1e-10, initial_accumulator_value=0, maximize=False)

    def state_shapes(self, shape: Sequence[int], group: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], float]]:
        row_shape = tuple(shape[:1]) if len(shape) >= 2 else tuple(shape)
        return {"sum": (row_shape, float(group["initial_accumulator_value"]))}

    def update_(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        group: Mapping[str, Any],
        step: float,
        row_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Update:
        """Row-wise Adagrad in place of its state rows; ``weight`` itself is left unchanged.

        (:class:`~pykeen_bess.tables.optim.RowwiseAdagrad` passes a dense parameter here and copies the result in.)
        """
        if group["maximize"]:
            grad = -grad
        squared = grad * grad
        row_wise = weight.dim() >= 2
        if row_wise:
            squared = row_mean(squared) if row_mean is not None else squared.mean(dim=tuple(range(1, grad.dim())))
        squares = state["sum"].add_(squared)  # the rule's own copy of the state rows
        std = squares.sqrt().add_(group["eps"])
        if row_wise:
            std = std.view(-1, *([1] * (grad.dim() - 1)))
        return weight.addcdiv(grad, std, value=-_adagrad_lr(group, step, group["lr"])), {"sum": squares}

    def apply(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        group: Mapping[str, Any],
        step: torch.Tensor,
        lr: torch.Tensor,
        squared_mean: torch.Tensor | None = None,
    ) -> Update:
        if group["maximize"]:
            grad = -grad
        squared = grad * grad
        row_wise = weight.dim() >= 2
        if row_wise:
            squared = squared_mean if squared_mean is not None else squared.mean(dim=tuple(range(1, grad.dim())))
        squares = state["sum"] + squared
        std = squares.sqrt() + group["eps"]
        if row_wise:
            std = std.view(-1, *([1] * (grad.dim() - 1)))
        step_size = _adagrad_lr(group, step, lr).to(weight.dtype)
        return weight - step_size * grad / std, {"sum": squares}


class SGDRule(RowRule):
    """Plain SGD on rows (no momentum, no weight decay)."""

    defaults = dict(lr=1e-3, maximize=False)
    required_options = dict(momentum=0, weight_decay=0, nesterov=False)

    def update_(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        group: Mapping[str, Any],
        step: float,
        row_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Update:
        return weight.add(grad, alpha=group["lr"] if group["maximize"] else -group["lr"]), {}

    def apply(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        group: Mapping[str, Any],
        step: torch.Tensor,
        lr: torch.Tensor,
        squared_mean: torch.Tensor | None = None,
    ) -> Update:
        step_size = lr.to(weight.dtype)
        return (weight + step_size * grad if group["maximize"] else weight - step_size * grad), {}


#: the one registry of row rules, by name
RULES: dict[str, RowRule] = {
    "adam": AdamRule(),
    "adagrad": AdagradRule(),
    "sgd": SGDRule(),
    "rowwise_adagrad": RowwiseAdagradRule(),
}


def state_shapes(rule: str, shape: Sequence[int], group: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], float]]:
    """Return the state tensors rule ``rule`` keeps for a parameter of ``shape``: name -> (shape, initial value)."""
    return RULES[rule].state_shapes(shape, group)


def count_step(state: dict[str, Any]) -> float:
    """Count one step in a parameter's optimizer state; return the new count."""
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32)
    state["step"] += 1
    return float(state["step"])
