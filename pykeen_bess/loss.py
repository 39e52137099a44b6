"""Stage 6 of the pipeline: the loss of a BESS step, from PyKEEN's loss classes.

Each process evaluates the user's :class:`pykeen.losses.Loss` on the real (non-padding) slots of
its local blocks, ``[V', 1]`` positive and ``[V', K]`` negative scores, through the loss's own
:meth:`~pykeen.losses.Loss.process_slcwa_scores`. Softplus / BCE (pointwise), margin ranking
(pairwise), NSSA (self-adversarial) and cross entropy (a sampled softmax over the positive and its
``K`` shared negatives) therefore behave exactly as in PyKEEN's sLCWA loop.

With ``reduction="mean"`` the local value is weighted by ``V' / V`` (``V`` the real positives of the
whole step), so that the values of all processes and all sub-batches add up to the mean over the
step, and the gradients to the gradient of that mean.
"""

from __future__ import annotations

import torch
from pykeen.losses import DeltaPointwiseLoss, Loss, PointwiseLoss

from .batch import BlockScores

__all__ = [
    "block_loss",
    "delta_pointwise_loss",
]


def block_loss(
    loss: Loss,
    scores: BlockScores,
    num_valid_step: int,
    label_smoothing: float = 0.0,
    num_entities: int | None = None,
) -> torch.Tensor:
    """Compute this process' share of the step loss (plus the regularization term).

    :param loss: the PyKEEN loss
    :param scores: the block scores of (a sub-batch of) the step
    :param num_valid_step: the number of real positives in the whole step, over all processes
    :param label_smoothing: PyKEEN's label smoothing (pointwise losses only)
    :param num_entities: the number of entities (needed for label smoothing)
    :returns: a scalar; summing it over sub-batches and processes gives the step loss
    """
    num_valid = scores.num_valid  # known on the host: no device synchronisation
    positive = scores.positive.reshape(-1, 1)
    negative = scores.negative.reshape(-1, scores.negative.shape[-1])
    if scores.valid_index is not None:
        positive = positive.index_select(0, scores.valid_index)
        negative = negative.index_select(0, scores.valid_index)
    if num_valid == 0:
        # keep the autograd graph connected: its backward runs collectives that every process joins
        value = (scores.positive.sum() + scores.negative.sum()) * 0.0
    else:
        direct = None if label_smoothing else delta_pointwise_loss(loss, positive, negative)
        value = (
            direct
            if direct is not None
            else loss.process_slcwa_scores(
                positive_scores=positive,
                negative_scores=negative,
                label_smoothing=label_smoothing or None,
                num_entities=num_entities,
            )
        )
        if loss.reduction == "mean":
            value = value * (num_valid / max(num_valid_step, 1))
    return value + scores.regularization


def delta_pointwise_loss(loss: Loss, positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor | None:
    """PyKEEN's sLCWA value of a margin-activation pointwise loss, without concatenating scores and labels.

    For :class:`~pykeen.losses.DeltaPointwiseLoss` (softplus, pointwise hinge, soft pointwise hinge)
    PyKEEN concatenates the ``V`` positive and ``V * K`` negative scores with labels ``1`` / ``0``
    and reduces ``act(margin - (2 label - 1) x)``; this computes the same reduction as
    ``act(margin - positive)`` and ``act(margin + negative)`` directly, about ten full-size
    elementwise passes (forward and backward) fewer. Equal up to rounding (``tests/test_loss.py``).

    :param loss: the PyKEEN loss
    :param positive: shape: ``[V, 1]``
    :param negative: shape: ``[V, K]``
    :returns: the loss value (PyKEEN's reductions: mean or sum), or None where the loss is not such
        a loss with PyKEEN's own forward and score processing (a subclass overriding either)
    """
    cls = type(loss)
    if not (
        isinstance(loss, DeltaPointwiseLoss)
        and cls.forward is DeltaPointwiseLoss.forward
        and cls.process_slcwa_scores is PointwiseLoss.process_slcwa_scores
        and cls.process_lcwa_scores is PointwiseLoss.process_lcwa_scores
        and loss.margin is not None
    ):
        return None
    margin = loss.margin
    total = loss.margin_activation(margin - positive).sum() + loss.margin_activation(margin + negative).sum()
    return total / (positive.numel() + negative.numel()) if loss.reduction == "mean" else total
