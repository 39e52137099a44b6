"""Loss weights for PyKEEN's sLCWA training: :class:`WeightedNSSALoss` and :class:`SubsamplingLossWeighter`.

PyKEEN's adversarial losses (NSSA) refuse loss weights: :class:`WeightedNSSALoss` (``loss="weightednssa"``)
weights a positive's whole term (its own and its negatives'), as Sun et al.'s RotatE code does, and
:class:`SubsamplingLossWeighter` (``loss_weighter="subsampling"``) gives that code's frequency-based weights.
Both work in the BESS loop (:mod:`~pykeen_bess.nn.loss` hands the weights to the loss) and in PyKEEN's own
sLCWA loop.
"""

from __future__ import annotations

import numbers

from typing import Any

import torch
from pykeen.losses import NoSampleWeightSupportError, NSSALoss, UnsupportedLabelSmoothingError
from pykeen.triples.weights import LossWeighter
from pykeen.typing import BoolTensor, FloatTensor, LongTensor, MappedTriples
from torch.nn import functional

__all__ = ["LcwaWeightsError", "SubsamplingLossWeighter", "WeightedNSSALoss"]


class LcwaWeightsError(NoSampleWeightSupportError):
    """PyKEEN's LCWA loop passed loss weights to :class:`WeightedNSSALoss`, which weighs sLCWA positives only."""

    def __str__(self) -> str:
        return (
            f"{type(self.instance).__name__} weighs the positives of sLCWA training (training_loop='slcwa' or 'bess'); "
            f"PyKEEN's LCWA loop passes one weight per label, which it does not take. Train with sLCWA, or without "
            f"a loss weighter."
        )


class WeightedNSSALoss(NSSALoss):
    """PyKEEN's self-adversarial negative sampling loss, with per-positive loss weights.

    Without weights it equals :class:`~pykeen.losses.NSSALoss`. With ``pos_weights`` ``w`` (shape
    ``[V]`` or ``[V, 1]``), the positive's term and its negatives' adversarially weighted term are
    both multiplied by its weight, as in Sun et al.'s code (``subsampling_weight``); the negatives
    share their positive's weight, so ``neg_weights`` (which PyKEEN's sLCWA loop passes too, the
    weighter's values for the negative triples) are not used:
    ``factor * (reduce(w * -log sigma(m + p)) + reduce(w * sum_k a_k * -log sigma(-m - n_k)))``,
    reduced over the positives (mean or sum, as PyKEEN; Sun et al. divide by the batch's weight sum
    instead, which :class:`SubsamplingLossWeighter`'s normalisation to mean 1 approximates).

    ---
    name: Weighted self-adversarial negative sampling
    """

    synonyms = {"WeightedNSSA"}

    def process_slcwa_scores(  # noqa: D102
        self,
        positive_scores: FloatTensor,
        negative_scores: FloatTensor,
        label_smoothing: float | None = None,
        batch_filter: BoolTensor | None = None,
        num_entities: int | None = None,
        pos_weights: FloatTensor | None = None,
        neg_weights: FloatTensor | None = None,
    ) -> FloatTensor:
        if pos_weights is None:
            return super().process_slcwa_scores(
                positive_scores=positive_scores,
                negative_scores=negative_scores,
                label_smoothing=label_smoothing,
                batch_filter=batch_filter,
                num_entities=num_entities,
                neg_weights=neg_weights,
            )
        if label_smoothing:
            raise UnsupportedLabelSmoothingError(self)
        if batch_filter is not None:
            raise NotImplementedError("WeightedNSSALoss does not support filtered negatives with weights.")
        weights = pos_weights.reshape(-1)
        positive = -functional.logsigmoid(self.margin + positive_scores.reshape(-1))
        attention = negative_scores.detach().mul(self.inverse_softmax_temperature).softmax(dim=-1)
        negative = (attention * self.negative_loss_term_unreduced(negative_scores)).sum(dim=-1)
        return self.factor * (self._reduction_method(weights * positive) + self._reduction_method(weights * negative))

    def process_lcwa_scores(  # noqa: D102
        self,
        predictions: FloatTensor,
        labels: FloatTensor,
        label_smoothing: float | None = None,
        num_entities: int | None = None,
        weights: FloatTensor | None = None,
    ) -> FloatTensor:
        if weights is not None:
            raise LcwaWeightsError(self)
        return super().process_lcwa_scores(
            predictions=predictions, labels=labels, label_smoothing=label_smoothing, num_entities=num_entities
        )


class SubsamplingLossWeighter(LossWeighter):
    """The frequency-based loss weights of Sun et al.'s RotatE code (``subsampling_weight``).

    A triple ``(h, r, t)`` weighs ``c / sqrt(#(h, r) + #(t, r) + 2 * (start - 1))``, with
    ``#(h, r)`` the number of fitted (training) triples with head ``h`` and relation ``r``,
    ``#(t, r)`` those with tail ``t`` and relation ``r`` (Sun et al.'s ``count_frequency`` with
    ``start=4``), and ``c`` such that the fitted triples' weights average 1. Rare ``(entity,
    relation)`` pairs weigh more than frequent ones.

    Fitted on construction (``mapped_triples``) or by the BESS training loop, which fits it on the
    triples it trains on when it is built without triples (``loss_weighter="subsampling"`` in a
    configuration). Memory: two sorted key tensors of at most ``T`` entries.
    """

    def __init__(self, mapped_triples: MappedTriples | None = None, start: int = 4, normalize: bool = True):
        """Create the weighter.

        :param mapped_triples: shape: ``[T, 3]``, the triples to count (None: fitted later by :meth:`fit`)
        :param start: the count of a pair's first occurrence (Sun et al.: 4), an integer ``>= 1``
        :param normalize: scale the weights to mean 1 over the fitted triples
        :raises ValueError: if ``start`` is not an integer ``>= 1`` (below, a triple whose pairs occur once
            would weigh ``c / 0``)
        """
        super().__init__()
        whole = start if isinstance(start, numbers.Integral) and not isinstance(start, bool) else None
        if whole is None or whole < 1:
            raise ValueError(f"SubsamplingLossWeighter's start must be an integer >= 1, but is {start!r}.")
        self.start: int = int(whole)
        self.normalize: bool = normalize
        self.scale: float = 1.0
        self._counts: tuple[Any, ...] | None = None
        if mapped_triples is not None:
            self.fit(mapped_triples)

    @property
    def fitted(self) -> bool:
        """Whether the weighter has counted its triples."""
        return self._counts is not None

    @property
    def num_relation_ids(self) -> int:
        """One more than the largest relation id of the fitted triples (0 before fitting)."""
        return 0 if self._counts is None else int(self._counts[0])

    def fit(self, mapped_triples: MappedTriples) -> SubsamplingLossWeighter:
        """Count the ``(head, relation)`` and ``(tail, relation)`` pairs of the triples.

        :param mapped_triples: shape: ``[T, 3]``
        :returns: the weighter
        """
        triples = mapped_triples.cpu().long()
        width = int(triples[:, 1].max()) + 1 if triples.numel() else 1
        self._counts = (width,) + tuple(
            torch.unique(triples[:, column] * width + triples[:, 1], return_counts=True) for column in (0, 2)
        )
        self.scale = 1.0
        if self.normalize and triples.numel():
            self.scale = 1.0 / float(self.weight_triples(triples).double().mean())
        return self

    def _count(self, keys: torch.Tensor, unique: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Return the count of every key (0 for a key never seen)."""
        position = torch.searchsorted(unique, keys).clamp_max(max(unique.numel() - 1, 0))
        found = unique[position] == keys if unique.numel() else torch.zeros_like(keys, dtype=torch.bool)
        return torch.where(found, counts[position], 0)

    def __call__(self, h: LongTensor | None, r: LongTensor | None, t: LongTensor | None) -> FloatTensor:
        """Return the weights of the (broadcast) triples ``(h, r, t)``.

        :raises ValueError: if the weighter is not fitted, an argument is None (all entities or relations: not
            supported), or a relation id is beyond the fitted triples' (a loop training with inverse triples:
            relation ``r``'s ids are ``2r`` and ``2r + 1`` there, so every count would be another relation's)
        """
        if self._counts is None:
            raise ValueError("SubsamplingLossWeighter is not fitted: pass mapped_triples or call fit().")
        if h is None or r is None or t is None:
            raise ValueError("SubsamplingLossWeighter weighs given triples only (h, r and t must not be None).")
        width, (head_keys, head_counts), (tail_keys, tail_counts) = self._counts
        device = h.device
        h, r, t = torch.broadcast_tensors(h.cpu().long(), r.cpu().long(), t.cpu().long())
        if r.numel() and int(r.max()) >= width:
            raise ValueError(
                f"The SubsamplingLossWeighter was fitted on relation ids below {width}, but weighs relation id "
                f"{int(r.max())}: fit it on the triples the loop trains on (with inverse triples: "
                f"factory._add_inverse_triples_if_necessary(factory.mapped_triples)), or pass it unfitted to the BESS "
                f"loop (loss_weighter='subsampling'), which fits it so."
            )
        count = (
            self._count(h * width + r, head_keys, head_counts)
            + self._count(t * width + r, tail_keys, tail_counts)
            + 2 * (self.start - 1)
        )
        return (count.to(torch.float64).rsqrt() * self.scale).to(torch.get_default_dtype()).to(device)
