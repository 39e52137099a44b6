"""Stage 6 of the pipeline: the loss of a BESS step, from PyKEEN's loss classes.

Each process evaluates the user's :class:`pykeen.losses.Loss` on the real (non-padding) slots of
its local blocks, ``[V', 1]`` positive and ``[V', K]`` negative scores, through the loss's own
:meth:`~pykeen.losses.Loss.process_slcwa_scores`. Softplus / BCE (pointwise), margin ranking
(pairwise), NSSA (self-adversarial) and cross entropy (a sampled softmax over the positive and its
``K`` shared negatives) therefore behave exactly as in PyKEEN's sLCWA loop.

With ``reduction="mean"`` the local value is weighted by ``V' / V`` (``V`` the real positives of the
whole step), so that the values of all processes and all sub-batches add up to the mean over the
step, and the gradients to the gradient of that mean.

**Loss weights.** With a PyKEEN loss weighter (``training_loop_kwargs=dict(loss_weighter=...)``)
every positive carries a weight (:attr:`~pykeen_bess.data.batch.BessBatch.weights`), passed to the loss
as PyKEEN's sLCWA loop does (``pos_weights``; its negatives weigh the same, ``neg_weights``, see
:func:`partition_weights`). PyKEEN's adversarial losses (NSSA) refuse weights, so :mod:`~pykeen_bess.nn.weighting` adds
:class:`~pykeen_bess.nn.weighting.WeightedNSSALoss` (``loss="weightednssa"``), which weights a positive's
whole term (its own and its negatives'), and :class:`~pykeen_bess.nn.weighting.SubsamplingLossWeighter`
(``loss_weighter="subsampling"``), the frequency-based weights of Sun et al.'s RotatE code (both
importable from here too).
"""

from __future__ import annotations

import copy
import math
import weakref

import torch
from pykeen.losses import (
    DeltaPointwiseLoss,
    Loss,
    NoSampleWeightSupportError,
    PointwiseLoss,
)
from pykeen.triples.weights import LossWeighter, RelationLossWeighter

from .weighting import LcwaWeightsError, SubsamplingLossWeighter, WeightedNSSALoss
from ..data.batch import BlockScores
from ..data.partition import ShardPairPartition

__all__ = [
    "LcwaWeightsError",
    "SubsamplingLossWeighter",
    "WeightedNSSALoss",
    "block_loss",
    "delta_pointwise_loss",
    "summed_loss",
    "partition_weights",
    "weight_convention",
]


def block_loss(
    loss: Loss,
    scores: BlockScores,
    num_valid_step: int,
    label_smoothing: float = 0.0,
    num_entities: int | None = None,
    weight_step: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Compute this process' share of the step loss (plus the regularization term).

    With ``reduction="mean"`` and no loss weights the share is the loss's *sum* over this process' values
    times ``1 / (V c)``, ``V`` the step's real positives and ``c`` the values per positive the loss
    averages over (:func:`summed_loss`): every value's gradient is then that one constant in every
    process, however the step's positives are split over processes, local shards and sub-batches (a
    mean over this process' values scaled by its share, ``(V' / V) / (V' c)``, rounds differently for
    every split, and a model whose gradients are signs, such as TransE's, turns an ulp into another run).

    :param loss: the PyKEEN loss
    :param scores: the block scores of (a sub-batch of) the step
    :param num_valid_step: the number of real positives in the whole step, over all processes
    :param label_smoothing: PyKEEN's label smoothing (pointwise losses only)
    :param num_entities: the number of entities (needed for label smoothing)
    :param weight_step: the sum of the loss weights of the whole step's positives (with a loss weighter)
        (every negative triple weighs what its positive weighs, see :func:`partition_weights`); a
        0-dimensional tensor on the scores' device is not read on the host
    :returns: a scalar; summing it over sub-batches and processes gives the step loss
    """
    num_valid = scores.num_valid  # known on the host: no device synchronisation
    positive = scores.positive.reshape(-1, 1)
    negative = scores.negative.reshape(-1, scores.negative.shape[-1])
    weights = None if scores.weights is None else scores.weights.reshape(-1).to(positive)
    if scores.valid_index is not None:
        positive = positive.index_select(0, scores.valid_index)
        negative = negative.index_select(0, scores.valid_index)
        weights = None if weights is None else weights.index_select(0, scores.valid_index)
    if num_valid == 0:
        # keep the autograd graph connected: its backward runs collectives that every process joins
        return (scores.positive.sum() + scores.negative.sum()) * 0.0 + scores.regularization
    if loss.reduction == "mean" and weights is None:
        summed = summed_loss(loss, positive, negative, label_smoothing, num_entities)
        if summed is not None:
            total, per_positive = summed
            return total * (1.0 / (max(num_valid_step, 1) * per_positive)) + scores.regularization
    direct = None if label_smoothing or weights is not None else delta_pointwise_loss(loss, positive, negative)
    value = (
        direct
        if direct is not None
        else loss.process_slcwa_scores(
            positive_scores=positive,
            negative_scores=negative,
            label_smoothing=label_smoothing or None,
            num_entities=num_entities,
            pos_weights=weights,
            # PyKEEN's sLCWA loop weighs every negative triple, too: here each weighs its positive's weight
            neg_weights=_negative_weights(loss, weights, negative),
        )
    )
    if loss.reduction == "mean":
        if weights is not None and weight_convention(loss) == "sum":
            # PyKEEN's weighted mean divides by the weights' sum, (1 + K) times the positives' weights
            # (a step whose positives all weigh 0 has the value 0, as PyKEEN's clamped division gives)
            if torch.is_tensor(weight_step):  # the static step's, on the device
                step_sum = weight_step.to(weights.dtype)
                value = value * (weights.sum() / torch.where(step_sum > 0, step_sum, torch.ones_like(step_sum)))
            else:
                value = value * (weights.sum() / (weight_step if weight_step > 0 else 1.0))
        else:
            value = value * (num_valid / max(num_valid_step, 1))
    return value + scores.regularization


def summed_loss(
    loss: Loss,
    positive: torch.Tensor,
    negative: torch.Tensor,
    label_smoothing: float = 0.0,
    num_entities: int | None = None,
) -> tuple[torch.Tensor, int] | None:
    """Return the sum of a mean-reduced loss's values (unweighted) and the values per positive its mean divides by.

    PyKEEN's losses average over ``c`` values per positive: ``1 + K`` for the pointwise ones (the positive
    and its negatives), ``K`` for the pairwise ones, 1 for NSSA and cross entropy. The sum is that of a
    copy of the loss with ``reduction="sum"`` (:func:`delta_pointwise_loss` for margin-activation losses);
    ``c`` is measured once per loss class and ``K``, comparing the copy with the loss on a small batch.

    :param loss: a loss with ``reduction="mean"``
    :param positive: shape: ``[V, 1]``
    :param negative: shape: ``[V, K]``
    :returns: the sum and ``c``, or None where the loss's mean is not a sum over a fixed number of values
        per positive (then the caller scales the mean)
    """
    per_positive = _values_per_positive(loss, negative.shape[-1])
    if per_positive is None:
        return None
    direct = None if label_smoothing else delta_pointwise_loss(loss, positive, negative, reduce=False)
    if direct is not None:
        return direct, per_positive
    value = _summing(loss).process_slcwa_scores(
        positive_scores=positive,
        negative_scores=negative,
        label_smoothing=label_smoothing or None,
        num_entities=num_entities,
    )
    return value, per_positive


#: per loss, a shallow copy that sums instead of averaging (its submodules and buffers are the loss's)
_SUMMING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: per loss class and number of negatives, the values per positive its mean divides by (measured on an instance)
_PER_POSITIVE: dict[tuple[type, int], int] = {}
#: per loss instance, the numbers of negatives for which it measured no count (not such a mean, or its
#: settings gave a zero mean: another instance of the class may measure it)
_NO_COUNT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _summing(loss: Loss) -> Loss:
    """Return a shallow copy of ``loss`` that sums its values (PyKEEN's ``reduction="sum"``).

    The copy takes the loss's current attributes at every call: a callback may change a margin or a
    temperature between steps (a copy made once kept the first step's).
    """
    summing = _SUMMING.get(loss)
    if summing is None:
        summing = _SUMMING[loss] = copy.copy(loss)
    summing.__dict__.update(loss.__dict__)
    summing.reduction = "sum"
    summing._reduction_method = torch.sum
    return summing


def _values_per_positive(loss: Loss, num_negatives: int) -> int | None:
    """Measure ``c`` of :func:`summed_loss`: the summing copy's value over the loss's, on two positives."""
    key = (type(loss), num_negatives)
    if key not in _PER_POSITIVE and num_negatives not in _NO_COUNT.get(loss, ()):
        buffer = next(iter(loss.buffers()), None)
        device = buffer.device if buffer is not None else torch.device("cpu")
        generator = torch.Generator().manual_seed(0)
        positive = torch.randn(2, 1, generator=generator, dtype=torch.float64).to(device)
        negative = torch.randn(2, num_negatives, generator=generator, dtype=torch.float64).to(device)
        result = None
        try:
            with torch.no_grad():
                mean = float(loss.process_slcwa_scores(positive_scores=positive, negative_scores=negative))
                total = float(_summing(loss).process_slcwa_scores(positive_scores=positive, negative_scores=negative))
            count = total / mean / 2 if mean else float("nan")
            if math.isfinite(count) and round(count) >= 1 and math.isclose(count, round(count), rel_tol=1e-6):
                result = round(count)
        except (RuntimeError, ValueError, TypeError, AttributeError):  # a loss that cannot sum: the mean stays
            result = None
        if result is None:  # for this instance only: a class's count stays what a measurable instance gave
            _NO_COUNT.setdefault(loss, set()).add(num_negatives)
        else:
            _PER_POSITIVE[key] = result
    return _PER_POSITIVE.get(key)


def _negative_weights(loss: Loss, weights: torch.Tensor | None, negative: torch.Tensor) -> torch.Tensor | None:
    """shape: ``[V, K]``, every negative's loss weight, its positive's (None where the loss does not use them)."""
    if weights is None or isinstance(loss, WeightedNSSALoss):
        return None
    return weights.unsqueeze(-1).expand_as(negative).contiguous()


def delta_pointwise_loss(
    loss: Loss, positive: torch.Tensor, negative: torch.Tensor, reduce: bool = True
) -> torch.Tensor | None:
    """PyKEEN's sLCWA value of a margin-activation pointwise loss, without concatenating scores and labels.

    For :class:`~pykeen.losses.DeltaPointwiseLoss` (softplus, pointwise hinge, soft pointwise hinge)
    PyKEEN concatenates the ``V`` positive and ``V * K`` negative scores with labels ``1`` / ``0``
    and reduces ``act(margin - (2 label - 1) x)``; this computes the same reduction as
    ``act(margin - positive)`` and ``act(margin + negative)`` directly, about ten full-size
    elementwise passes (forward and backward) fewer. Equal up to rounding (``tests/test_loss.py``).

    :param loss: the PyKEEN loss
    :param positive: shape: ``[V, 1]``
    :param negative: shape: ``[V, K]``
    :param reduce: apply the loss's reduction (False: the sum, whatever the reduction)
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
    # a margin of 0 (softplus) adds nothing: the activation's arguments are the scores themselves (one
    # full-size pass less, forward and backward; -0.0 and 0.0 activate alike)
    shifted_positive = margin - positive if margin else -positive
    shifted_negative = margin + negative if margin else negative
    total = loss.margin_activation(shifted_positive).sum() + loss.margin_activation(shifted_negative).sum()
    return total / (positive.numel() + negative.numel()) if reduce and loss.reduction == "mean" else total


def _weighs_by_relation(weighter: LossWeighter) -> bool:
    """Whether a weighter weighs by the relation alone, as PyKEEN's ``RelationLossWeighter`` does.

    Then its weight of a negative triple is its positive's. A subclass that overrides ``__call__`` may weigh by
    the entities, so it does not count.
    """
    return isinstance(weighter, RelationLossWeighter) and type(weighter).__call__ is RelationLossWeighter.__call__


def partition_weights(weighter: LossWeighter | None, loss: Loss, partition: ShardPairPartition) -> torch.Tensor | None:
    """Return the loss weight of every training triple, in partition order (the sampler's ``weights``).

    A :class:`SubsamplingLossWeighter` built without triples is fitted (a copy of it) on the
    partition's triples, those the loop trains on (inverse triples included if the model uses them).

    PyKEEN's sLCWA loop also weighs every negative triple with the weighter. BESS gives a negative
    its positive's weight, which is the same for PyKEEN's :class:`~pykeen.triples.weights.RelationLossWeighter`
    (a negative keeps its positive's relation); other weighters are refused with a loss that would
    use the negatives' own weights, i.e. any but :class:`WeightedNSSALoss` (whose negatives share
    their positive's weight by definition).

    :param weighter: the loop's resolved PyKEEN loss weighter (None: unweighted)
    :param loss: the loss (checked to accept weights)
    :param partition: the training triples by shardpair
    :returns: shape: ``[T]``, in the weighter's floating dtype; None without a weighter
    :raises ValueError: if the loss refuses weights, if it would weigh negatives by a weighter that
        depends on their entities, or if the weighter returns other than ``T`` finite, non-negative weights
    """
    if weighter is None:
        return None
    weight_convention(loss)  # refuses a loss without weights, or with a weighted mean of unknown form
    if not isinstance(loss, WeightedNSSALoss) and not _weighs_by_relation(weighter):
        raise ValueError(
            f"BESS gives every negative triple its positive's loss weight. With {type(loss).__name__}, PyKEEN weighs "
            f"each negative triple by the weighter itself, which for {type(weighter).__name__} depends on the "
            f"negative entity; BESS supports this weighter with loss='weightednssa' only (PyKEEN's "
            f"RelationLossWeighter works with any loss that takes weights)."
        )
    triples = partition.global_triples()
    if isinstance(weighter, RelationLossWeighter) and triples.numel():
        largest, given = int(triples[:, 1].max()), torch.as_tensor(weighter.weights).numel()
        if given <= largest:
            raise ValueError(
                f"The RelationLossWeighter has {given} weights, but the loop trains with relation ids up to "
                f"{largest} (inverse triples count too): give one weight per relation id."
            )
    if isinstance(weighter, SubsamplingLossWeighter) and not weighter.fitted:
        weighter = copy.copy(weighter).fit(triples)
    elif isinstance(weighter, SubsamplingLossWeighter) and int(triples[:, 1].max()) >= weighter.num_relation_ids:
        raise ValueError(
            f"The SubsamplingLossWeighter was fitted on relation ids below {weighter.num_relation_ids}, but the loop "
            f"trains with relation ids up to {int(triples[:, 1].max())} (inverse triples?). Pass it unfitted (or "
            f"loss_weighter='subsampling') so that the loop fits it on the triples it trains on."
        )
    weights = torch.as_tensor(weighter.weight_triples(triples)).detach().cpu().reshape(-1)
    if not weights.is_floating_point():
        weights = weights.to(torch.get_default_dtype())
    name = type(weighter).__name__
    if weights.numel() != partition.num_triples:
        raise ValueError(
            f"The loss weighter {name} returned {weights.numel()} weights for {partition.num_triples} triples."
        )
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()) or not bool(weights.sum() > 0):
        raise ValueError(
            f"The loss weighter {name} must return finite, non-negative weights, not all 0 (got values from "
            f"{float(weights.min())} to {float(weights.max())})."
        )
    return weights


#: per loss class and reduction, its weight convention (a "sum" reduction answers "count" for its class only)
_CONVENTIONS: dict[tuple[type, str], str] = {}


def weight_convention(loss: Loss) -> str:
    """How the loss's weighted mean is normalised: ``"sum"`` (by the weights' sum) or ``"count"`` (by their number).

    PyKEEN's margin-activation pointwise losses, its MSE and focal loss reduce weighted values with
    :func:`~pykeen.losses.weighted_reduction` (``sum(w * l) / sum(w)`` over the positives' and the
    negatives' weights); BCE uses torch's weighted mean (``sum(w * l) / N``) and
    :class:`WeightedNSSALoss` averages over the positives. :func:`block_loss` splits the mean over
    blocks accordingly. Measured (so a user's loss is handled, too) by evaluating the loss on a
    small batch with the weights ``w`` and ``2 w`` (every negative weighing its positive's weight,
    as BESS passes them): a value that stays is divided by the weights' sum, one that doubles by
    their number. Cached per loss class and reduction.

    :raises ValueError: if the loss refuses weights (PyKEEN's pairwise and adversarial losses), or its
        value neither stays nor doubles
    """
    cls = type(loss)
    key = (cls, str(loss.reduction))
    if key in _CONVENTIONS:
        return _CONVENTIONS[key]
    buffer = next(iter(loss.buffers()), None)
    device = buffer.device if buffer is not None else torch.device("cpu")
    dtype = buffer.dtype if buffer is not None and buffer.is_floating_point() else torch.get_default_dtype()
    positive = torch.tensor([[0.3], [-0.2]], device=device, dtype=dtype)
    negative = torch.tensor([[0.1, -0.4], [0.5, 0.2]], device=device, dtype=dtype)
    weights = torch.tensor([0.5, 1.5], device=device, dtype=dtype)
    try:
        with torch.no_grad():
            values = [
                float(
                    loss.process_slcwa_scores(
                        positive_scores=positive,
                        negative_scores=negative,
                        pos_weights=scale * weights,
                        neg_weights=_negative_weights(loss, scale * weights, negative),
                    )
                )
                for scale in (1.0, 2.0)
            ]
    except NoSampleWeightSupportError as error:
        raise ValueError(
            f"The loss {cls.__name__} does not support loss weights (loss_weighter). Use a pointwise "
            f"loss (e.g. 'bcewithlogits', 'softplus') or 'weightednssa' (NSSA weighting each positive's term)."
        ) from error
    if loss.reduction != "mean" or math.isclose(values[1], 2 * values[0], rel_tol=1e-5):
        convention = "count"  # (a sum reduction needs no normalisation)
    elif math.isclose(values[1], values[0], rel_tol=1e-5):
        convention = "sum"
    else:
        raise ValueError(
            f"The loss {cls.__name__} weighs its values neither by the weights' sum nor by their number "
            f"(value {values[0]} with weights w, {values[1]} with 2 w); BESS cannot split its mean over blocks."
        )
    _CONVENTIONS[key] = convention
    return convention
