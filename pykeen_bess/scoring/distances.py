"""Scorers of distance interactions: L2 by norm expansion (matrix products), other norms in chunks."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import torch
import torch.utils.checkpoint
from pykeen.nn.modules import (
    Interaction,
    LineaREInteraction,
    PairREInteraction,
    RotatEInteraction,
    TransEInteraction,
    TripleREInteraction,
    UMInteraction,
)
from pykeen.utils import ensure_complex, negative_norm

from ..nn.interactions import InterHTInteraction, TranSInteraction
from .base import (
    SharedCandidateScorer,
    Side,
    check_side,
    chunked_pairwise,
    difference_candidate_features,
    difference_query_features,
    matmul_scores,
    negative_l2,
    product_sum_candidate_features,
    product_sum_query_features,
)


class NormScorer(SharedCandidateScorer, ABC):
    """Scorers of ``-||x||_p`` (``-||x||_p^p`` with ``power_norm``) with the interaction's ``p`` and ``power_norm``.

    For ``p=2`` the query and candidate features expand the squared norm into one matrix product
    (:func:`negative_l2`); otherwise :meth:`pair_scores` computes the explicit ``x`` in chunks
    (:func:`chunked_pairwise`), with PyKEEN's own :func:`pykeen.utils.negative_norm`.
    """

    @property
    def p(self) -> int | float | str:
        """The norm's ``p``."""
        return cast(Any, self.interaction).p

    @property
    def power_norm(self) -> bool:
        """Whether to return ``-||x||_p^p``."""
        return bool(cast(Any, self.interaction).power_norm)

    @property
    def l2(self) -> bool:
        """Whether scores are computed by the L2 norm expansion."""
        return not isinstance(self.p, str) and self.p == 2

    @property
    def fast(self) -> bool:  # type: ignore[override]
        """Whether scores avoid the chunked explicit computation (here: for ``p=2``)."""
        return self.l2

    @property
    def bounded_by_feature_norms(self) -> bool:  # type: ignore[override]
        """Whether scores are ``-sqrt(max(x, 0))`` or ``-x`` of one product of features (here: for ``p=2``)."""
        return self.l2

    def pair_scores(self, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Score explicitly (non-L2 norms).

        :param query: shape: ``[*B, b', 1, q]``, non-L2 query features
        :param candidates: shape: ``[*B, 1, k', c]``, non-L2 candidate features
        :returns: shape: ``[*B, b', k']``
        """
        raise NotImplementedError(f"{type(self).__name__} supports only p=2.")

    def score(self, side: Side, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_side(side)
        if self.l2:
            return negative_l2(matmul_scores(query, candidates), power_norm=self.power_norm)
        return chunked_pairwise(query, candidates, self.pair_scores, checkpoint=True)


logger = logging.getLogger(__name__)

__all__ = [
    "DifferenceScorer",
    "InterHTScorer",
    "LineaREScorer",
    "NormScorer",
    "PairREScorer",
    "ProductSumScorer",
    "RotatEScorer",
    "TranSScorer",
    "TransEScorer",
    "TripleREScorer",
    "UMScorer",
    "l1_distances",
]


class DifferenceScorer(NormScorer, ABC):
    """Translational scorers ``-||q - c||_p`` with a query vector ``q`` and the candidate vector ``c``.

    Features, ``d`` being the vector dimension: ``[*, d + 2]`` for ``p=2``
    (:func:`difference_query_features`), the vectors themselves otherwise; ``p=1`` uses
    :func:`torch.cdist` (also for ``power_norm``, as ``|x|^1 = |x|``).
    """

    @abstractmethod
    def query_vector(self, side: Side, e: Any, r: Any) -> torch.Tensor:
        """Return ``q``, shape: ``[*, d]``."""

    def candidate_vector(self, side: Side, e: Any) -> torch.Tensor:
        """Return ``c``, shape: ``[*, d]``; the candidate entity by default."""
        return e

    def query(self, side: Side, e: Any, r: Any) -> torch.Tensor:  # noqa: D102
        check_side(side)
        q = self.query_vector(side, e, r)
        return difference_query_features(q) if self.l2 else q

    def candidates(self, side: Side, e: Any) -> torch.Tensor:  # noqa: D102
        check_side(side)
        c = self.candidate_vector(side, e)
        return difference_candidate_features(c) if self.l2 else c

    def pair_scores(self, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return negative_norm(query - candidates, p=self.p, power_norm=self.power_norm)

    @property
    def l1(self) -> bool:
        """Whether scores are computed by :func:`torch.cdist` with ``p=1``."""
        return not isinstance(self.p, str) and self.p == 1

    @property
    def fast(self) -> bool:  # type: ignore[override]
        """Whether scores avoid the chunked explicit computation (here: for ``p`` in 1, 2)."""
        return self.l2 or self.l1

    def score(self, side: Side, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if self.l1:
            check_side(side)
            return -l1_distances(query, candidates)
        return super().score(side, query, candidates)


def l1_distances(query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Return ``||q - c||_1`` for all pairs: ``[*B, b, d] x [*B, k, d] -> [*B, b, k]``.

    :func:`torch.cdist`, except for training on a GPU: there ``cdist``'s backward for ``p=1`` writes a
    ``[*B, k, b, d]`` buffer and runs far slower than its forward, so the distances are one kernel
    compiled by ``torch.compile`` (forward and backward each a fused reduction; nothing of size
    ``b k d`` is stored); if compiling fails, ``cdist`` (logged once). Half-precision rows on the CPU, where
    ``cdist`` has no kernel for them, are measured in float32 and the distances rounded to their dtype.
    """
    global _compiled_l1
    if query.device.type == "cpu" and query.dtype in (torch.float16, torch.bfloat16):
        # the CPU's cdist has no half-precision kernel: computed in float32, rounded once (differentiable)
        return torch.cdist(query.float(), candidates.float(), p=1).to(query.dtype)
    training = torch.is_grad_enabled() and (query.requires_grad or candidates.requires_grad)
    if query.device.type != "cuda" or not training or _compiled_l1 is False:
        return torch.cdist(query, candidates, p=1)
    if _compiled_l1 is None:
        _compiled_l1 = torch.compile(_pairwise_l1)
    try:
        return _compiled_l1(query, candidates)
    except Exception as error:  # noqa: BLE001 - a compiler failure falls back to the exact same function, uncompiled
        _compiled_l1 = False
        logger.warning("L1 distances: torch.compile failed (%s); using torch.cdist.", error)
        return torch.cdist(query, candidates, p=1)


def _pairwise_l1(query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """``||q - c||_1`` written as a broadcast reduction (what the compiler fuses)."""
    return (query.unsqueeze(-2) - candidates.unsqueeze(-3)).abs().sum(dim=-1)


#: the compiled :func:`_pairwise_l1` (None: not compiled yet; False: compiling failed)
_compiled_l1: Any = None


class ProductSumScorer(NormScorer, ABC):
    """Scorers ``-||q_0 + sum_k q_k * c_k||_p`` with per-query ``q_0, q_k`` and candidate ``c_k``, all ``[*, d]``.

    This covers the "weighted difference" forms ``a - b * c`` (``q_0 = a``, ``q_1 = -b``) of
    PairRE, TripleRE and LineaRE, and the two-factor forms of InterHT and TranS. Features: for
    ``p=2`` :func:`product_sum_query_features` / :func:`product_sum_candidate_features`;
    otherwise the concatenations ``[q_0, q_1, ..., q_K]`` (``[*, (K + 1) d]``) and
    ``[c_1, ..., c_K]`` (``[*, K d]``).
    """

    @abstractmethod
    def query_terms(self, side: Side, e: Any, r: Any) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
        """Return ``q_0`` and the factors ``(q_1, ..., q_K)``, each of shape ``[*, d]``."""

    def candidate_terms(self, side: Side, e: Any) -> Sequence[torch.Tensor]:
        """Return the candidate factors ``(c_1, ..., c_K)``, each ``[*, d]``; by default the representation(s)."""
        return list(e) if isinstance(e, (tuple, list)) else [e]

    def query(self, side: Side, e: Any, r: Any) -> torch.Tensor:  # noqa: D102
        check_side(side)
        q0, factors = self.query_terms(side, e, r)
        return product_sum_query_features(q0, factors) if self.l2 else torch.cat([q0, *factors], dim=-1)

    def candidates(self, side: Side, e: Any) -> torch.Tensor:  # noqa: D102
        check_side(side)
        factors = self.candidate_terms(side, e)
        return product_sum_candidate_features(factors) if self.l2 else torch.cat(list(factors), dim=-1)

    def pair_scores(self, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:  # noqa: D102
        d = query.shape[-1] - candidates.shape[-1]
        q0, *factors = query.split(d, dim=-1)
        x = q0 + sum(q * c for q, c in zip(factors, candidates.split(d, dim=-1)))
        return negative_norm(x, p=self.p, power_norm=self.power_norm)


class TransEScorer(DifferenceScorer):
    """TransE: ``-||h + r - t||_p``; tail queries ``h + r``, head queries ``t - r``."""

    interactions = (TransEInteraction,)

    def query_vector(self, side: Side, e: torch.Tensor, r: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return e + r if side == "tail" else e - r


class UMScorer(DifferenceScorer):
    """UM: ``-||h - t||_p`` (no relation); queries are the known entity."""

    interactions = (UMInteraction,)

    def query_vector(self, side: Side, e: torch.Tensor, r: Any) -> torch.Tensor:  # noqa: D102
        return e


class RotatEScorer(NormScorer):
    """RotatE: ``-||h * r - t||_2`` on complex ``[*, d]`` (PyKEEN's ``p`` and ``power_norm`` are ignored).

    Tails: the translation ``||q - t||`` with ``q = h * r`` (:func:`difference_query_features`,
    ``[*, 2d + 2]``). Heads, exact for any modulus of ``r``: ``x = r * h - t``, the product-sum form
    with ``q_0 = -t``, ``q_1 = r``, i.e. query features ``[R(-2 t conj(r)), |r|^2, |t|^2]`` (the first
    block is ``[-2 Re w, 2 Im w]`` for ``w = r conj(t)``) against ``[R(h), |h|^2, 1]``
    (``[*, 3d + 1]``): ``|r h - t|^2 = |t|^2 - 2 Re(w h) + |r|^2 |h|^2`` elementwise.
    """

    interactions = (RotatEInteraction,)
    p = 2
    power_norm = False

    def query(self, side: Side, e: torch.Tensor, r: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_side(side)
        e, r = ensure_complex(e, r)
        if side == "tail":
            return difference_query_features(e * r)
        return product_sum_query_features(-e, [r])

    def candidates(self, side: Side, e: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_side(side)
        (e,) = ensure_complex(e)
        return difference_candidate_features(e) if side == "tail" else product_sum_candidate_features([e])


class PairREScorer(ProductSumScorer):
    """PairRE: ``-||h * r_h - t * r_t||_p``; tails: ``q_0 = h r_h, q_1 = -r_t``; heads: ``q_0 = -t r_t, q_1 = r_h``."""

    interactions = (PairREInteraction,)

    def query_terms(  # noqa: D102
        self, side: Side, e: torch.Tensor, r: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
        r_h, r_t = r
        if side == "tail":
            return e * r_h, [-r_t]
        return -e * r_t, [r_h]


def _offset(x: torch.Tensor, u: float | None) -> torch.Tensor:
    """Add the scalar offset ``u`` (``None`` for none), as PyKEEN's TripleRE does."""
    return x if u is None else x + u


class LineaREScorer(ProductSumScorer):
    """LineaRE: ``-||h * r_h - t * r_t + r_m||_p`` with ``r = (r_h, r_m, r_t)``.

    Tails: ``q_0 = h r_h + r_m``, ``q_1 = -r_t``; heads: ``q_0 = r_m - t r_t``, ``q_1 = r_h``.
    """

    interactions: ClassVar[tuple[type[Interaction], ...]] = (LineaREInteraction,)

    @property
    def u(self) -> float | None:
        """The offset added to ``r_h`` and ``r_t`` (TripleRE's ``u``; none for LineaRE)."""
        return None

    def query_terms(  # noqa: D102
        self, side: Side, e: torch.Tensor, r: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
        r_head, r_mid, r_tail = r
        r_head, r_tail = _offset(r_head, self.u), _offset(r_tail, self.u)
        if side == "tail":
            return e * r_head + r_mid, [-r_tail]
        return r_mid - e * r_tail, [r_head]


class TripleREScorer(LineaREScorer):
    """TripleRE: LineaRE with ``r_h + u`` and ``r_t + u``."""

    interactions = (TripleREInteraction,)

    @property
    def u(self) -> float | None:  # noqa: D102
        return cast(Any, self.interaction).u


class InterHTScorer(ProductSumScorer):
    """InterHT: ``-||h * (t_a + u) - t * (h_a + u) + r||_p`` with entities ``(e, e_a)``.

    Candidate factors ``(c, c_a)``. Tails: ``q_0 = u h + r``, factors ``(-(h_a + u), h)``; heads:
    ``q_0 = r - u t``, factors ``(t_a + u, -t)``.
    """

    interactions = (InterHTInteraction,)

    def query_terms(  # noqa: D102
        self, side: Side, e: Sequence[torch.Tensor], r: torch.Tensor
    ) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
        u = cast(Any, self.interaction).offset
        entity, aux = e
        if side == "tail":
            return u * entity + r, [-(aux + u), entity]
        return r - u * entity, [aux + u, -entity]


class TranSScorer(ProductSumScorer):
    """TranS: ``-||h * (t_~ + u + r_bar) - t * (h_~ + u - r_hat) + r||_p`` with entities ``(e, e_~)``.

    Candidate factors ``(c, c_~)``. Tails: ``q_0 = h (u + r_bar) + r``, factors
    ``(-(h_~ + u - r_hat), h)``; heads: ``q_0 = r - t (u - r_hat)``, factors ``(t_~ + u + r_bar, -t)``.
    """

    interactions = (TranSInteraction,)

    def query_terms(  # noqa: D102
        self, side: Side, e: Sequence[torch.Tensor], r: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
        u = cast(Any, self.interaction).offset
        entity, tilde = e
        relation, r_bar, r_hat = r
        if side == "tail":
            return entity * (r_bar + u) + relation, [-(tilde + u - r_hat), entity]
        return relation - entity * (u - r_hat), [tilde + u + r_bar, -entity]
