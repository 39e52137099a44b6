"""The row rules of :class:`~pykeen_bess.tables.optim.BessOptimizer`: lazy Adam, Adagrad, row-wise Adagrad, SGD.

A rule takes the rows ``[U, *]`` of a table, their gradient, the rows of its state tensors and
the step count, and returns the new rows and state rows; it never sees the table itself, so the
same rule updates a table on the device, in host memory or in files (:mod:`pykeen_bess.storage`).
The rows and state rows it is given are copies read for it, which it may update in place; the
gradient is only read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "DENSE_RULES",
    "RULES",
    "STATIC_RULES",
    "count_step",
    "state_shapes",
]


def state_shapes(rule: str, shape: Sequence[int], group: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], float]]:
    """Return the state tensors a rule keeps for a parameter of ``shape``: name -> (shape, initial value)."""
    shape = tuple(shape)
    if rule == "adam":
        return {"exp_avg": (shape, 0.0), "exp_avg_sq": (shape, 0.0)}
    if rule == "adagrad":
        return {"sum": (shape, float(group["initial_accumulator_value"]))}
    if rule == "rowwise_adagrad":
        row_shape = shape[:1] if len(shape) >= 2 else shape
        return {"sum": (row_shape, float(group["initial_accumulator_value"]))}
    return {}


def _adam(
    weight: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], group: Mapping[str, Any], step: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Lazy Adam on rows (``torch.optim.SparseAdam`` semantics, bias correction by the global step).

    The rows and state rows are the rule's own copies (read from the tier) and are updated in
    place. Where PyTorch has a fused Adam kernel for them (floating-point rows on the CPU or a
    GPU), one pass of that kernel does the update: its ``eps`` is added after dividing by
    ``sqrt(1 - beta2^t)``, so it is given ``eps / sqrt(1 - beta2^t)``, which is SparseAdam's rule
    exactly (up to rounding).
    """
    beta1, beta2 = group["betas"]
    bias_correction2 = 1 - beta2**step
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    if _fused_adam_applies(weight, grad, exp_avg, exp_avg_sq):
        as_real = torch.view_as_real if weight.is_complex() else (lambda x: x)
        torch._fused_adam_(
            [as_real(weight)],
            [as_real(grad)],
            [as_real(exp_avg)],
            [as_real(exp_avg_sq)],
            [],
            [torch.tensor(float(step), device=weight.device)],
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
    return weight.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(group["eps"]), value=-step_size), {
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
    }


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
    """Whether ``torch._fused_adam_`` runs on this device type (tried once on a single value)."""
    if device_type not in _FUSED_ADAM:
        available = hasattr(torch, "_fused_adam_") and device_type in ("cpu", "cuda")
        if available:
            values = [torch.zeros(1, device=device_type) for _ in range(4)]
            try:
                torch._fused_adam_(
                    [values[0]], [values[1]], [values[2]], [values[3]], [], [torch.ones((), device=device_type)],
                    lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                )  # fmt: skip
            except (NotImplementedError, RuntimeError):
                available = False
        _FUSED_ADAM[device_type] = available
    return _FUSED_ADAM[device_type]


def _adagrad_lr(group: Mapping[str, Any], step: float) -> float:
    """Return the learning rate of an Adagrad rule at ``step`` (``lr_decay``)."""
    return group["lr"] / (1 + (step - 1) * group["lr_decay"])


def _adagrad(
    weight: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], group: Mapping[str, Any], step: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Adagrad on rows (``torch.optim.Adagrad`` with a sparse gradient)."""
    if group["maximize"]:
        grad = -grad
    squares = state["sum"].addcmul_(grad, grad)  # the rule's own copy of the state rows
    return weight.addcdiv_(grad, squares.sqrt().add_(group["eps"]), value=-_adagrad_lr(group, step)), {"sum": squares}


def _rowwise_adagrad(
    weight: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    group: Mapping[str, Any],
    step: float,
    row_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Row-wise Adagrad on rows ``[U, ...]`` (state ``sum``: ``[U]``); without rows (0-1 dimensions) plain Adagrad.

    ``weight`` itself is left unchanged (:class:`~pykeen_bess.tables.optim.RowwiseAdagrad` passes a dense
    parameter here and copies the result in). ``row_mean`` (``[U, ...] -> [U]``, default: the mean over
    each row's entries) is a column part's mean over its whole rows.
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
    return weight.addcdiv(grad, std, value=-_adagrad_lr(group, step)), {"sum": squares}


def _sgd(
    weight: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], group: Mapping[str, Any], step: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain SGD on rows."""
    return weight.add(grad, alpha=group["lr"] if group["maximize"] else -group["lr"]), {}


#: the rules whose state is one value per whole row (they take the table's ``row_mean``)
WHOLE_ROW_RULES = frozenset({"rowwise_adagrad"})

#: the row rules by name
RULES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {
    "adam": _adam,
    "adagrad": _adagrad,
    "sgd": _sgd,
    "rowwise_adagrad": _rowwise_adagrad,
}


def count_step(state: dict[str, Any]) -> float:
    """Count one step in a parameter's optimizer state; return the new count."""
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32)
    state["step"] += 1
    return float(state["step"])


# -- rules with the step count and learning rate as device tensors (static and captured steps) ----------
#
# A captured step (a CUDA graph) bakes every Python number into the graph; the step count and the
# learning rate change between replays, so these rules take them as 0-dimensional tensors on the
# rows' device and never read them on the host. They compute the same values as the rules above
# (up to rounding) and return new tensors: the caller decides whether to write them (a step with a
# non-finite loss writes nothing). ``step`` is the count including this step.


def _adam_moments(
    grad: torch.Tensor, state: Mapping[str, torch.Tensor], group: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """Return Adam's new first and second moments (new tensors) for a gradient (negated with ``maximize``)."""
    beta1, beta2 = group["betas"]
    if group["maximize"]:
        grad = -grad
    return {
        "exp_avg": torch.lerp(state["exp_avg"], grad, 1 - beta1),
        "exp_avg_sq": torch.addcmul(state["exp_avg_sq"] * beta2, grad, grad, value=1 - beta2),
    }


def _static_adam(
    weight: torch.Tensor,
    grad: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    group: Mapping[str, Any],
    step: torch.Tensor,
    lr: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Lazy Adam on rows (``torch.optim.SparseAdam``): ``eps`` is added before the bias correction."""
    beta1, beta2 = group["betas"]
    moments = _adam_moments(grad, state, group)
    step_size = lr * torch.sqrt(1 - beta2**step) / (1 - beta1**step)
    update = moments["exp_avg"] / (moments["exp_avg_sq"].sqrt() + group["eps"])
    return weight - step_size.to(weight.dtype) * update, moments


def _static_dense_adam(
    weight: torch.Tensor,
    grad: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    group: Mapping[str, Any],
    step: torch.Tensor,
    lr: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``torch.optim.Adam`` (no weight decay, no AMSGrad): ``eps`` is added after the bias correction."""
    beta1, beta2 = group["betas"]
    moments = _adam_moments(grad, state, group)
    step_size = lr / (1 - beta1**step)
    denominator = moments["exp_avg_sq"].sqrt() / torch.sqrt(1 - beta2**step).to(weight.dtype) + group["eps"]
    return weight - step_size.to(weight.dtype) * (moments["exp_avg"] / denominator), moments


def _static_adagrad_lr(group: Mapping[str, Any], step: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
    """Return the learning rate of an Adagrad rule at ``step`` (``lr_decay``), a tensor."""
    return lr / (1 + (step - 1) * group["lr_decay"])


def _static_adagrad(
    weight: torch.Tensor,
    grad: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    group: Mapping[str, Any],
    step: torch.Tensor,
    lr: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Adagrad on rows (``torch.optim.Adagrad``, sparse or dense gradient)."""
    if group["maximize"]:
        grad = -grad
    squares = torch.addcmul(state["sum"], grad, grad)
    step_size = _static_adagrad_lr(group, step, lr).to(weight.dtype)
    return weight - step_size * grad / (squares.sqrt() + group["eps"]), {"sum": squares}


def _static_rowwise_adagrad(
    weight: torch.Tensor,
    grad: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    group: Mapping[str, Any],
    step: torch.Tensor,
    lr: torch.Tensor,
    squared_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Row-wise Adagrad on rows ``[U, ...]`` (state ``sum``: ``[U]``); without rows (0-1 dimensions) plain Adagrad.

    ``squared_mean`` (``[U]``, default: computed from ``grad``) is the mean of every row's squared gradient over
    its whole row, which a column part of a row takes from all parts
    (:meth:`~pykeen_bess.tables.optim.StoredTable.row_mean`).
    """
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
    step_size = _static_adagrad_lr(group, step, lr).to(weight.dtype)
    return weight - step_size * grad / std, {"sum": squares}


def _static_sgd(
    weight: torch.Tensor,
    grad: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    group: Mapping[str, Any],
    step: torch.Tensor,
    lr: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain SGD (no momentum, no weight decay)."""
    step_size = lr.to(weight.dtype)
    return (weight + step_size * grad if group["maximize"] else weight - step_size * grad), {}


#: the row rules of :data:`RULES` with the step count and learning rate as device tensors
STATIC_RULES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {
    "adam": _static_adam,
    "adagrad": _static_adagrad,
    "sgd": _static_sgd,
    "rowwise_adagrad": _static_rowwise_adagrad,
}

#: the dense updates of the replicated parameters as the user's optimizer does them, by rule name
#: (``torch.optim.Adam``'s differs from the lazy row rule in where ``eps`` is added)
DENSE_RULES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {
    "adam": _static_dense_adam,
    "adagrad": _static_adagrad,
    "sgd": _static_sgd,
    "rowwise_adagrad": _static_rowwise_adagrad,
}
