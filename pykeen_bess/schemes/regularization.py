"""Regularization terms of a step's rows: PyKEEN's regularizers on the looked-up rows, and the L2 fast path.

:class:`Accumulator` sums a step's weighted terms. :func:`regularize` runs any PyKEEN regularizer once
per group of rows of one weight. PyKEEN's L2 regularizer (``LpRegularizer`` with ``p = 2``, ComplEx's and
DistMult's default) takes a shorter path (:func:`is_plain_l2`): its term is computed once per row on the
real view, either through one autograd node that passes the rows through (:func:`l2_term`), or, where
the rows are the step's own leaves (or a parameter viewed whole) and the caller differentiates them by
itself (the static step), as a value whose gradient the step adds after the backward pass
(:class:`RowTermGradient`, :func:`add_term_gradients`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from pykeen.regularizers import LpRegularizer
from pykeen.utils import get_expected_norm
from torch.autograd.function import once_differentiable

from .copies import UNCACHED, DeviceCopies

__all__ = [
    "Accumulator",
    "RowTermGradient",
    "add_term_gradients",
    "is_plain_l2",
    "is_plain_l2_regularizer",
    "l2_term",
    "regularize",
]


@dataclasses.dataclass(eq=False)
class RowTermGradient:
    """The gradient ``coefficient[:, None] * values`` of an L2 term on rows the caller differentiates by itself."""

    #: the tensor the gradient belongs to: a leaf of the step, or a parameter
    target: torch.Tensor
    #: shape: ``[N, W]``, the target's values (its real view), as the term saw them
    values: torch.Tensor
    #: shape: ``[N]``, ``d term / d row = coefficient * row``
    coefficient: torch.Tensor

    def add_to(self, gradient: torch.Tensor | None) -> torch.Tensor:
        """Return ``gradient + coefficient[:, None] * values``, in the target's shape (one fused ``addcmul``)."""
        factor = self.coefficient.unsqueeze(-1)
        return self.values * factor if gradient is None else torch.addcmul(gradient, self.values, factor)

    def add_into(self, gradient: torch.Tensor) -> None:
        """Add ``coefficient[:, None] * values`` to a gradient in place (one fused ``addcmul_``)."""
        gradient.addcmul_(self.values, self.coefficient.unsqueeze(-1))


class Accumulator:
    """Sums weighted regularization terms.

    With ``gradients`` (a list; the static step's), the L2 terms of rows the step differentiates by
    itself (its leaves, and parameters viewed whole) are added as values without an autograd node, and
    their gradients are appended there (:class:`RowTermGradient`) for the step to add to the leaves'
    and parameters' gradients: the same ``addcmul`` as the term's own backward, without the node.
    """

    def __init__(self, gradients: list[RowTermGradient] | None = None) -> None:
        self.value: torch.Tensor | float = 0.0
        self.gradients = gradients

    def add(self, term: torch.Tensor | float) -> None:
        """Add a weighted term."""
        self.value = self.value + term

    def add_l2(
        self, regularizer: Any, rows: torch.Tensor, row_weights: torch.Tensor, target: torch.Tensor | None
    ) -> bool:
        """Add the L2 term of rows that view ``target`` whole (in its layout) with its gradient deferred, if it can.

        :param rows: shape: ``[N, d]``, real or complex, a view of ``target`` (``[N, W]``, real)
        :param row_weights: shape: ``[N]``
        :param target: the leaf or parameter the rows view, or None
        :returns: whether the term was added (else the caller adds it through autograd)
        """
        if self.gradients is None or target is None:
            return False
        values = rows.detach()  # (no autograd node: the gradient is the step's to add)
        if values.is_complex():
            values = torch.view_as_real(values).flatten(-2)
        if (values.data_ptr(), values.shape, values.stride()) != (target.data_ptr(), target.shape, target.stride()):
            return False
        term, coefficient = _norms_term(values, row_weights, regularizer.weight, _scale(regularizer, rows.shape[-1]))
        self.add(term)
        if target.requires_grad:
            self.gradients.append(RowTermGradient(target, values, coefficient))
        return True


def regularize(
    regularizer: Any, x: torch.Tensor, weights: torch.Tensor, accumulator: Accumulator, copies: DeviceCopies = UNCACHED
) -> None:
    """Add ``sum_rows weight(row) * g(row)`` for a regularizer that averages a per-row value ``g``.

    The rows are grouped by weight (a step has few distinct weights), and each group costs one
    regularizer call: ``mean_group(g) * |group| * weight``. Group selection uses indices computed on
    the CPU, so no device synchronisation happens.

    :param regularizer: a PyKEEN regularizer
    :param x: shape: ``[*weights.shape, *row_shape]``, the looked-up rows
    :param weights: shape: ``s``, CPU, the weight of each row (0: not regularized)
    :param accumulator: receives the weighted terms
    :param copies: how the groups' indices reach the device (the static step keeps them)
    """
    flat_weights = weights.reshape(-1)
    rows_all = x.reshape(-1, *x.shape[weights.ndim :])
    promote_term(regularizer, x)
    for value in torch.unique(flat_weights[flat_weights > 0]).tolist():
        selected = flat_weights == value
        if bool(selected.all()):
            rows = rows_all
        else:
            rows = rows_all.index_select(0, copies.index(selected, x.device))
        regularizer.update(rows)
        accumulator.add(regularizer.pop_regularization_term() * (rows.shape[0] * value))


def promote_term(regularizer: Any, rows: torch.Tensor) -> None:
    """Keep the regularizer's term in the rows' real dtype where that is wider (float64 rows: a float64 term).

    PyKEEN registers ``regularization_term`` as a float32 buffer whatever the default dtype, and ``update`` adds
    each ``forward(rows)`` to it, which type promotion keeps float32: a float64 model built under
    ``torch.set_default_dtype(torch.float64)`` would get its terms and their gradients' coefficients rounded to
    float32, differently as processes group their rows differently (``.double()`` converts the buffer). The buffer
    is converted once, as ``.double()`` would; narrower rows (bfloat16) leave it as it is.

    :param rows: the rows the regularizer is about to see
    """
    term = regularizer.regularization_term
    real = rows.real.dtype if rows.is_complex() else rows.dtype
    wider = torch.promote_types(term.dtype, real)
    if wider != term.dtype:
        regularizer.regularization_term = term.to(wider)


def is_plain_l2(regularizer: Any, rows: torch.Tensor) -> bool:
    """Whether the regularizer is PyKEEN's L2 norm of rows (ComplEx's and DistMult's default), for :func:`l2_term`.

    :func:`regularize` runs the regularizer once per group of rows with the same weight, on the looked-up
    rows: every group costs dozens of small operations, and ``torch`` computes the norm of complex rows
    and its gradient tens of times slower on the CPU than that of their real view (the same value).
    Only where :meth:`~pykeen.regularizers.Regularizer.update` would add ``forward(rows)`` and
    :meth:`~pykeen.regularizers.Regularizer.pop_regularization_term` return ``weight`` times it,
    ``forward`` being :class:`~pykeen.regularizers.LpRegularizer`'s with ``p = 2`` over each row.

    :param rows: shape: ``[N, *row_shape]``
    """
    return (
        (rows.is_complex() or rows.is_floating_point())
        and rows.ndim == 2
        and is_plain_l2_regularizer(regularizer)
        and regularizer.training
        and torch.is_grad_enabled()
    )


#: the methods of :class:`~pykeen.regularizers.LpRegularizer` whose work the L2 fast path does itself
_L2_PATH_METHODS = ("forward", "update", "pop_regularization_term", "reset")


def is_plain_l2_regularizer(regularizer: Any) -> bool:
    """Whether a regularizer is :class:`~pykeen.regularizers.LpRegularizer`'s L2 norm of each row, weighed per step.

    A subclass that overrides how the terms are collected or weighed (``update``, ``pop_regularization_term``,
    ``reset``) takes the general path (:func:`regularize`), which calls them.
    """
    cls = type(regularizer)
    return (
        all(getattr(cls, name) is getattr(LpRegularizer, name) for name in _L2_PATH_METHODS)
        and regularizer.dim == -1
        and float(regularizer.p) == 2.0
        and not regularizer.apply_only_once
        and not regularizer.tracked_parameters
    )


def _scale(regularizer: Any, dim: int) -> float:
    """Return the factor of the regularizer's norms of rows of ``dim`` (complex: their complex) dimensions."""
    return 1.0 / get_expected_norm(p=regularizer.p, d=dim) if regularizer.normalize else 1.0


def _norms_term(
    x: torch.Tensor, w: torch.Tensor, weight: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``weight * scale * sum_rows w_row * ||row||_2`` (shape ``[1]``) and ``weight * scale * w / ||row||``.

    The coefficients are 0 for zero rows (torch's gradient of a zero norm): ``d term / d row = coefficient * row``.

    :param x: shape: ``[N, W]``, real rows
    :param w: shape: ``[N]``, the rows' weights
    """
    if not weight.is_floating_point():  # an integer weight (RESCAL's default 10) times a float gave the default dtype
        weight = weight.to(torch.promote_types(x.dtype, torch.get_default_dtype()))
    norm = torch.linalg.vector_norm(x, ord=2, dim=-1)
    coefficient = (w * (weight * scale) / norm).masked_fill_(norm == 0, 0)
    return (weight * (torch.dot(norm, w) * scale)).reshape(1), coefficient


def l2_term(regularizer: Any, rows: torch.Tensor, row_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the rows and their regularization term ``weight * sum_rows row_weight * g(row)`` (:func:`is_plain_l2`).

    The rows are returned as they are, through the term's autograd node: where the caller goes on with them,
    their gradient and the term's are added in that node by one fused operation (instead of the autograd
    engine adding a separate gradient of the term to theirs).

    :param rows: shape: ``[N, d]``, real or complex
    :param row_weights: shape: ``[N]``, on the rows' device, in their real dtype
    :returns: the rows ``[N, d]`` (a view of ``rows``) and the term, shape: ``[1]``, as PyKEEN's terms
    """
    return _WeightedRowNorms.apply(rows, row_weights, regularizer.weight, _scale(regularizer, rows.shape[-1]))


class _WeightedRowNorms(torch.autograd.Function):
    """The rows ``[N, d]`` and ``weight * scale * sum_rows w_row * ||row||_2`` (complex rows on their real view).

    The gradient is ``torch``'s (0 for a zero row): ``torch.linalg.vector_norm``'s backward masks zero
    norms on the broadcast ``[N, 2 d]`` tensor, which costs a millisecond per step on the CPU; this
    masks the ``N`` norms. One autograd node for the whole term, which also passes the rows through:
    their gradient from later uses and the term's are summed by one ``addcmul``. The rows it returns are
    a view made by a custom function: they must not be modified in place. Differentiable once.
    """

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, w: torch.Tensor, weight: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.complex = rows.is_complex()
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not as zeros
        x = torch.view_as_real(rows).flatten(-2) if ctx.complex else rows
        # d term / d row = weight * scale * w_row * row / ||row|| (0 for a zero row), up to the incoming gradient
        term, coefficient = _norms_term(x, w, weight, scale)
        ctx.save_for_backward(x, coefficient)
        return rows.view_as(rows), term

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_rows: torch.Tensor | None, grad: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None]:
        x, coefficient = ctx.saved_tensors
        if grad is None:  # the term does not reach the loss: the rows' own gradient passes through
            return grad_rows, None, None, None
        factor = (coefficient * grad).unsqueeze(-1)
        if grad_rows is None:
            rows = x * factor
        else:
            passed = torch.view_as_real(grad_rows.resolve_conj()).flatten(-2) if ctx.complex else grad_rows
            rows = torch.addcmul(passed, x, factor)
        return (torch.view_as_complex(rows.view(*x.shape[:-1], -1, 2)) if ctx.complex else rows), None, None, None


def add_term_gradients(
    term_gradients: Sequence[RowTermGradient], inputs: Sequence[torch.Tensor], grads: list[torch.Tensor | None]
) -> None:
    """Add the deferred L2 terms' gradients to the gradients of the inputs they belong to (in place in ``grads``).

    A term of a tensor that is no input (a table the step does not differentiate) has no gradient to add.

    :param term_gradients: the terms' gradients (an :class:`Accumulator`'s ``gradients``)
    :param inputs: the tensors differentiated
    :param grads: their gradients (None: none yet), in the order of ``inputs``
    """
    with torch.no_grad():  # (a gradient the backward pass returned may be a view made without grad mode)
        for term_gradient in term_gradients:
            position = next((i for i, x in enumerate(inputs) if x is term_gradient.target), None)
            if position is None:
                continue
            gradient = grads[position]
            if gradient is not None and _owned(gradient, grads, position):
                term_gradient.add_into(gradient)
            else:
                grads[position] = term_gradient.add_to(gradient)


def _owned(gradient: torch.Tensor, grads: Sequence[torch.Tensor | None], position: int) -> bool:
    """Whether a gradient may be modified in place: its own memory, which no other input's gradient shares.

    The backward pass may return one tensor for several inputs (the gradients of ``a + b``), or one value
    broadcast to every element (of ``a.sum()``).
    """
    if not gradient.is_contiguous():
        return False
    storage = gradient.untyped_storage().data_ptr()
    return not any(
        other is not None and other.untyped_storage().data_ptr() == storage
        for index, other in enumerate(grads)
        if index != position
    )
