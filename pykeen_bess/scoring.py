"""Stage 5 of the pipeline: fast scoring of queries against *shared* candidates.

In BESS every positive of a block is scored against the same ``K`` negative entities, and in
evaluation every query is scored against all entities of a shard. PyKEEN's interactions answer
"B queries x K shared candidates" by broadcasting to a ``[B, K, d]`` intermediate, which is
100-200x slower than a matrix product for DistMult, TransE or RotatE. A
:class:`SharedCandidateScorer` splits an interaction into

* :meth:`~SharedCandidateScorer.query`: per-query features, ``[*, q]``, computed from the known
  entity and the relation (``(h, r)`` when tails are predicted, ``(r, t)`` when heads are);
* :meth:`~SharedCandidateScorer.candidates`: per-candidate features, ``[*, c]``;
* :meth:`~SharedCandidateScorer.score`: ``[*B, b, q] x [*B, k, c] -> [*B, b, k]``, a batched
  matrix product (inner-product models, L2 distances by norm expansion) or a memory-bounded
  chunked computation (L1 distances).

Queries and candidates are single tensors so that the exchange stage can move them between
workers (score-moving all-gathers the queries). Scores equal PyKEEN's own interaction on the same
parameters up to floating point rounding (see ``tests/test_scoring.py``).

Representations are passed exactly as :meth:`pykeen.models.ERModel._get_representations` returns
them: one tensor, or a tuple of tensors for interactions with several entity or relation
representations; complex-valued tensors for ComplEx and RotatE.

Use :func:`get_scorer` to obtain the scorer of an interaction instance.

Formulations (``q``: query vector, ``c``: candidate vector, ``R(.)``: real view of a complex vector):

* inner products (DistMult, ComplEx, RESCAL, SimplE, CP, DistMA, TransF): ``score = <f(q), g(c)>``,
  one matrix product;
* translations ``-||q - c||_p`` (TransE, UM, RotatE tails): for ``p=2`` the norm expansion
  ``|q|^2 - 2 <q, c> + |c|^2`` as one matrix product of ``[-2q, |q|^2, 1]`` and ``[c, 1, |c|^2]``;
  ``p=1`` by :func:`torch.cdist`; other ``p`` chunked;
* sums of elementwise products ``-||q_0 + sum_k q_k * c_k||_p`` (RotatE heads, PairRE, TripleRE,
  LineaRE, InterHT, TranS): for ``p=2`` the expansion of the squared norm into inner products of
  query and candidate features (:func:`product_sum_query_features`), other ``p`` chunked.

The chunked exact computation (:func:`chunked_pairwise`) materialises the explicit
``[*B, b', k', d]`` difference for blocks of queries and candidates with at most
:data:`MAX_CHUNK_ELEMENTS` elements, and recomputes the blocks in the backward pass (activation
checkpointing) so that training memory stays bounded too.
"""

from __future__ import annotations

import itertools
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import torch
import torch.utils.checkpoint
from pykeen.nn.modules import (
    ClampedInteraction,
    ComplExInteraction,
    CPInteraction,
    DistMAInteraction,
    DistMultInteraction,
    Interaction,
    LineaREInteraction,
    PairREInteraction,
    RESCALInteraction,
    RotatEInteraction,
    SimplEInteraction,
    TransEInteraction,
    TransFInteraction,
    TripleREInteraction,
    UMInteraction,
)
from pykeen.utils import ensure_complex, negative_norm

from .interactions import InterHTInteraction, TranSInteraction

__all__ = [
    "BroadcastScorer",
    "CPScorer",
    "ClampedScorer",
    "ComplExScorer",
    "DifferenceScorer",
    "DistMAScorer",
    "DistMultScorer",
    "InnerProductScorer",
    "InterHTScorer",
    "LineaREScorer",
    "NormScorer",
    "PairREScorer",
    "ProductSumScorer",
    "RESCALScorer",
    "RotatEScorer",
    "SharedCandidateScorer",
    "Side",
    "SimplEScorer",
    "TranSScorer",
    "TransEScorer",
    "TransFScorer",
    "TripleREScorer",
    "UMScorer",
    "chunked_pairwise",
    "difference_candidate_features",
    "difference_query_features",
    "get_scorer",
    "product_sum_candidate_features",
    "product_sum_query_features",
    "register_scorer",
    "supported_interactions",
]

logger = logging.getLogger(__name__)

#: the side that is predicted (or corrupted): "tail" scores ``(h, r, ?)``, "head" scores ``(?, r, t)``
Side = Literal["head", "tail"]
SIDES: tuple[Side, Side] = ("head", "tail")

#: the maximum number of elements of an intermediate tensor in chunked (non-matmul) scoring
MAX_CHUNK_ELEMENTS = 1 << 24


def _check_side(side: str) -> None:
    if side not in SIDES:
        raise ValueError(f"Invalid side={side!r}; expected one of {SIDES}.")


class SharedCandidateScorer(ABC):
    """Scores queries against shared candidates for one PyKEEN interaction.

    Subclasses implement :meth:`query`, :meth:`candidates` and :meth:`score`; all methods accept
    arbitrary leading batch dimensions.
    """

    #: the interaction classes this scorer handles (used by :func:`register_scorer`)
    interactions: ClassVar[tuple[type[Interaction], ...]] = ()

    #: whether the scores are computed by matrix products (False: chunked fallback)
    fast: ClassVar[bool] = True

    def __init__(self, interaction: Interaction):
        """Bind the scorer to an interaction instance (whose parameters, e.g. ``p``, it reads)."""
        self.interaction = interaction

    def score_triples(self, h: Any, r: Any, t: Any) -> torch.Tensor:
        """Score aligned triples with PyKEEN's own interaction.

        :param h: shape: ``[*, *head_shape]``, head representation(s)
        :param r: shape: ``[*, *relation_shape]``, relation representation(s)
        :param t: shape: ``[*, *tail_shape]``, tail representation(s)
        :returns: shape: ``[*]``
        """
        return self.interaction(h=h, r=r, t=t)

    @abstractmethod
    def query(self, side: Side, e: Any, r: Any) -> torch.Tensor:
        """Compute query features.

        :param side: the predicted side
        :param e: shape: ``[*, *entity_shape]``, the *known* entity: the head when ``side="tail"``,
            the tail when ``side="head"``
        :param r: shape: ``[*, *relation_shape]``, the relation representation(s)
        :returns: shape: ``[*, q]``
        """

    @abstractmethod
    def candidates(self, side: Side, e: Any) -> torch.Tensor:
        """Compute candidate features.

        :param side: the predicted side
        :param e: shape: ``[*, *entity_shape]``, candidate entity representation(s)
        :returns: shape: ``[*, c]``
        """

    @abstractmethod
    def score(self, side: Side, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Score every query against every candidate of its batch element.

        :param side: the predicted side
        :param query: shape: ``[*B, b, q]``, from :meth:`query`
        :param candidates: shape: ``[*B, k, c]``, from :meth:`candidates`; ``*B`` broadcasts
            against the query's batch dimensions
        :returns: shape: ``[*B, b, k]``
        """

    def score_candidates(self, side: Side, e: Any, r: Any, candidate: Any) -> torch.Tensor:
        """Score queries against shared candidates from representations (convenience).

        :param side: the predicted side
        :param e: shape: ``[*B, b, *entity_shape]``, the known entity
        :param r: shape: ``[*B, b, *relation_shape]``
        :param candidate: shape: ``[*B, k, *entity_shape]``
        :returns: shape: ``[*B, b, k]``
        """
        return self.score(side, self.query(side, e, r), self.candidates(side, candidate))


def _matmul_scores(query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Compute ``[*B, b, q] @ [*B, k, q]^T -> [*B, b, k]`` with broadcasting batch dimensions."""
    return torch.matmul(query, candidates.transpose(-1, -2))


# -- shared math ---------------------------------------------------------------------------------


def _real_view(x: torch.Tensor) -> torch.Tensor:
    """Return a real tensor: ``[*, d]`` real stays, ``[*, d]`` complex becomes ``[*, 2d]`` (re, im interleaved).

    For complex ``w, z``: ``Re(sum_i w_i z_i) = <_real_view(conj(w)), _real_view(z)>``.
    """
    if x.is_complex():
        return torch.view_as_real(x.resolve_conj()).flatten(-2)
    return x


def _squared_modulus(x: torch.Tensor) -> torch.Tensor:
    """Elementwise ``|x|^2`` (real output, differentiable everywhere); shape: ``[*, d] -> [*, d]``."""
    if x.is_complex():
        return torch.view_as_real(x.resolve_conj()).square().sum(dim=-1)
    return x.square()


def _sum_column(x: torch.Tensor) -> torch.Tensor:
    """Sum the last dimension into a single feature column: ``[*, d] -> [*, 1]``."""
    return x.sum(dim=-1, keepdim=True)


def _ones_column(x: torch.Tensor) -> torch.Tensor:
    """Return a constant feature column of ones with ``x``'s batch shape and real dtype: ``[*, d] -> [*, 1]``."""
    return torch.ones(*x.shape[:-1], 1, dtype=x.real.dtype, device=x.device)


def _negative_l2(squared: torch.Tensor, power_norm: bool) -> torch.Tensor:
    """Turn expanded squared distances ``[*]`` into scores ``-||x||_2`` (or ``-||x||_2^2``).

    Expanded squared distances can be slightly negative by cancellation; they are clamped at zero,
    and, before the square root, at ``eps**2`` (``eps``: the dtype's machine epsilon) so that the
    gradient stays finite at zero distance (it is zero there, as PyKEEN's). Values above
    ``eps**2`` are untouched.
    """
    if power_norm:
        return -squared.clamp_min(0.0)
    return -squared.clamp_min(torch.finfo(squared.dtype).eps ** 2).sqrt()


def difference_query_features(q: torch.Tensor) -> torch.Tensor:
    """Query features of the norm expansion of ``||q - c||^2 = |q|^2 - 2 <q, c> + |c|^2``.

    :param q: shape: ``[*, d]``, real or complex
    :returns: shape: ``[*, w + 2]``: ``[-2 R(q), |q|^2, 1]`` with ``w = d`` (real) or ``2d`` (complex)
    """
    q_real = _real_view(q)
    return torch.cat([-2 * q_real, _sum_column(q_real.square()), _ones_column(q_real)], dim=-1)


def difference_candidate_features(c: torch.Tensor) -> torch.Tensor:
    """Candidate features matching :func:`difference_query_features`.

    :param c: shape: ``[*, d]``, real or complex
    :returns: shape: ``[*, w + 2]``: ``[R(c), 1, |c|^2]``
    """
    c_real = _real_view(c)
    return torch.cat([c_real, _ones_column(c_real), _sum_column(c_real.square())], dim=-1)


def product_sum_query_features(q0: torch.Tensor, factors: Sequence[torch.Tensor]) -> torch.Tensor:
    r"""Query features of the expansion of ``||x||^2`` with ``x = q_0 + sum_k q_k * c_k``.

    With elementwise products and ``<a, b> = sum_i a_i b_i``,

    .. math::

        \|x\|^2 = |q_0|^2 + \sum_k 2 Re<\bar{q}_0 q_k, c_k> + \sum_k <|q_k|^2, |c_k|^2>
                  + \sum_{k < l} 2 Re<\bar{q}_k q_l, \bar{c}_k c_l>

    which is one inner product of the query features
    ``[|q_0|^2, R(2 q_0 conj(q_k))_k, (|q_k|^2)_k, R(2 q_k conj(q_l))_{k<l}]`` with
    :func:`product_sum_candidate_features` ``[1, R(c_k)_k, (|c_k|^2)_k, R(conj(c_k) c_l)_{k<l}]``.
    Works for real and complex tensors.

    :param q0: shape: ``[*, d]``, the candidate-independent term
    :param factors: ``K`` tensors of shape ``[*, d]``, the per-query factors ``q_k``
    :returns: shape: ``[*, 1 + K w + K d + K (K - 1) / 2 w]``, ``w = d`` (real) or ``2d`` (complex)
    """
    parts = [_sum_column(_squared_modulus(q0))]
    parts.extend(_real_view(2 * q0 * q.conj()) for q in factors)
    parts.extend(_squared_modulus(q) for q in factors)
    parts.extend(_real_view(2 * q_k * q_l.conj()) for q_k, q_l in itertools.combinations(factors, 2))
    return torch.cat(parts, dim=-1)


def product_sum_candidate_features(candidates: Sequence[torch.Tensor]) -> torch.Tensor:
    """Candidate features matching :func:`product_sum_query_features`.

    :param candidates: ``K`` tensors of shape ``[*, d]``, the candidate factors ``c_k``
    :returns: shape: ``[*, 1 + K w + K d + K (K - 1) / 2 w]``
    """
    parts = [_ones_column(candidates[0])]
    parts.extend(_real_view(c) for c in candidates)
    parts.extend(_squared_modulus(c) for c in candidates)
    parts.extend(_real_view(c_k.conj() * c_l) for c_k, c_l in itertools.combinations(candidates, 2))
    return torch.cat(parts, dim=-1)


def chunked_pairwise(
    query: torch.Tensor,
    candidates: torch.Tensor,
    pair_scores: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    width: int | None = None,
    checkpoint: bool = False,
) -> torch.Tensor:
    """Score all query-candidate pairs in blocks whose intermediates stay below :data:`MAX_CHUNK_ELEMENTS`.

    Candidates are split into chunks of ``k'`` (and, if one query row is already too large, queries
    into chunks of ``b'``) such that ``prod(*B) * b' * k' * width <= MAX_CHUNK_ELEMENTS`` (at least
    one query and one candidate per block).

    :param query: shape: ``[*B, b, q]``
    :param candidates: shape: ``[*B, k, c]``; ``*B`` broadcasts against the query's batch dims
    :param pair_scores: maps a query block ``[*B, b', 1, q]`` and a candidate block
        ``[*B, 1, k', c]`` to scores ``[*B, b', k']``
    :param width: the number of elements per pair of the largest intermediate of ``pair_scores``;
        defaults to ``max(q, c)``
    :param checkpoint: whether to recompute each block in the backward pass instead of keeping
        its intermediates (only for pure functions; used when gradients are required and there is
        more than one block)
    :returns: shape: ``[*B, b, k]``
    """
    b, k = query.shape[-2], candidates.shape[-2]
    if b == 0 or k == 0:
        return pair_scores(query.unsqueeze(-2), candidates.unsqueeze(-3))
    batch = math.prod(torch.broadcast_shapes(query.shape[:-2], candidates.shape[:-2]))
    per_pair = max(batch * (width or max(query.shape[-1], candidates.shape[-1])), 1)
    k_chunk = min(k, max(1, MAX_CHUNK_ELEMENTS // (per_pair * b)))
    b_chunk = min(b, max(1, MAX_CHUNK_ELEMENTS // (per_pair * k_chunk)))
    if b_chunk == b and k_chunk == k:
        return pair_scores(query.unsqueeze(-2), candidates.unsqueeze(-3))
    if checkpoint and torch.is_grad_enabled() and (query.requires_grad or candidates.requires_grad):

        def fn(q: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(pair_scores, q, c, use_reentrant=False)

    else:
        fn = pair_scores
    rows = []
    for b_start in range(0, b, b_chunk):
        q = query[..., b_start : b_start + b_chunk, :].unsqueeze(-2)
        rows.append(
            torch.cat(
                [
                    fn(q, candidates[..., k_start : k_start + k_chunk, :].unsqueeze(-3))
                    for k_start in range(0, k, k_chunk)
                ],
                dim=-1,
            )
        )
    return torch.cat(rows, dim=-2)


# -- inner-product scorers -----------------------------------------------------------------------


class InnerProductScorer(SharedCandidateScorer, ABC):
    """Scorers whose score is an inner product of query and candidate features."""

    def score(self, side: Side, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return _matmul_scores(query, candidates)


class DistMultScorer(InnerProductScorer):
    """DistMult: ``<h * r, t>``; tail queries are ``h * r``, head queries ``r * t``."""

    interactions = (DistMultInteraction,)

    def query(self, side: Side, e: torch.Tensor, r: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return e * r

    def candidates(self, side: Side, e: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return e


class ComplExScorer(InnerProductScorer):
    """ComplEx: ``Re(<h, r, conj(t)>)`` on real views.

    Tail queries ``R(h * r)`` against ``R(t)`` (``Re(sum w conj(t)) = <R(w), R(t)>``); head queries
    ``R(conj(r) * t)`` against ``R(h)`` (``Re(sum h w) = <R(conj(w)), R(h)>`` with ``w = r conj(t)``).
    Shapes: ``[*, d]`` complex -> ``[*, 2d]`` real.
    """

    interactions = (ComplExInteraction,)

    def query(self, side: Side, e: torch.Tensor, r: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return _real_view(e * r if side == "tail" else r.conj() * e)

    def candidates(self, side: Side, e: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return _real_view(e)


class RESCALScorer(InnerProductScorer):
    """RESCAL: ``h^T R t``; tail queries ``h^T R``, head queries ``R t``; ``R``: ``[*, d, d]``, queries ``[*, d]``."""

    interactions = (RESCALInteraction,)

    def query(self, side: Side, e: torch.Tensor, r: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        if side == "tail":
            return torch.einsum("...d,...de->...e", e, r)
        return torch.einsum("...de,...e->...d", r, e)

    def candidates(self, side: Side, e: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return e


class SimplEScorer(InnerProductScorer):
    """SimplE: ``(<h_0, r_0, t_0> + <t_1, r_1, h_1>) / 2`` with ``e = (e_0, e_1)``, ``r = (r_0, r_1)``.

    Both sides: queries ``[e_0 * r_0, e_1 * r_1] / 2``, candidates ``[e_0, e_1]``; ``[*, 2d]``.
    """

    interactions = (SimplEInteraction,)

    def query(self, side: Side, e: Sequence[torch.Tensor], r: Sequence[torch.Tensor]) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return 0.5 * torch.cat([e[0] * r[0], e[1] * r[1]], dim=-1)

    def candidates(self, side: Side, e: Sequence[torch.Tensor]) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return torch.cat(list(e), dim=-1)


class CPScorer(InnerProductScorer):
    """CP: ``sum_{k,d} h r t`` on ``[*, k, d]``; queries ``e * r``, candidates ``e``, flattened to ``[*, kd]``.

    The known and candidate entities are the head-role / tail-role representations that
    :meth:`~pykeen.models.ERModel._get_representations` selects.
    """

    interactions = (CPInteraction,)

    def query(self, side: Side, e: torch.Tensor, r: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return (e * r).flatten(-2)

    def candidates(self, side: Side, e: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return e.flatten(-2)


class _AffineInnerProductScorer(InnerProductScorer, ABC):
    """Scores ``<a, c> + beta`` with per-query ``a`` and ``beta``: queries ``[a, beta]``, candidates ``[c, 1]``."""

    @abstractmethod
    def affine(self, side: Side, e: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``a``, shape ``[*, d]``, and ``beta``, shape ``[*, 1]``."""

    def query(self, side: Side, e: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """Return ``[a, beta]``, shape: ``[*, d + 1]``."""
        _check_side(side)
        return torch.cat(self.affine(side, e, r), dim=-1)

    def candidates(self, side: Side, e: torch.Tensor) -> torch.Tensor:
        """Return ``[c, 1]``, shape: ``[*, d + 1]``."""
        _check_side(side)
        return torch.cat([e, _ones_column(e)], dim=-1)


class DistMAScorer(_AffineInnerProductScorer):
    """DistMA: ``<h, r> + <r, t> + <h, t> = <e + r, c> + <e, r>`` on both sides."""

    interactions = (DistMAInteraction,)

    def affine(self, side: Side, e: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        return e + r, _sum_column(e * r)


class TransFScorer(_AffineInnerProductScorer):
    """TransF: ``2<h, t> + <r, t> - <h, r>``; tails: ``<2h + r, t> - <h, r>``, heads: ``<2t - r, h> + <r, t>``."""

    interactions = (TransFInteraction,)

    def affine(self, side: Side, e: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        if side == "tail":
            return 2 * e + r, -_sum_column(e * r)
        return 2 * e - r, _sum_column(e * r)


# -- norm-based scorers --------------------------------------------------------------------------


class NormScorer(SharedCandidateScorer, ABC):
    """Scorers of ``-||x||_p`` (``-||x||_p^p`` with ``power_norm``) with the interaction's ``p`` and ``power_norm``.

    For ``p=2`` the query and candidate features expand the squared norm into one matrix product
    (:func:`_negative_l2`); otherwise :meth:`pair_scores` computes the explicit ``x`` in chunks
    (:func:`chunked_pairwise`), with PyKEEN's own :func:`pykeen.utils.negative_norm`.
    """

    @property
    def p(self) -> int | float | str:
        """The norm's ``p``."""
        return self.interaction.p

    @property
    def power_norm(self) -> bool:
        """Whether to return ``-||x||_p^p``."""
        return self.interaction.power_norm

    @property
    def l2(self) -> bool:
        """Whether scores are computed by the L2 norm expansion."""
        return not isinstance(self.p, str) and self.p == 2

    @property
    def fast(self) -> bool:  # type: ignore[override]
        """Whether scores avoid the chunked explicit computation (here: for ``p=2``)."""
        return self.l2

    def pair_scores(self, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Score explicitly (non-L2 norms).

        :param query: shape: ``[*B, b', 1, q]``, non-L2 query features
        :param candidates: shape: ``[*B, 1, k', c]``, non-L2 candidate features
        :returns: shape: ``[*B, b', k']``
        """
        raise NotImplementedError(f"{type(self).__name__} supports only p=2.")

    def score(self, side: Side, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        if self.l2:
            return _negative_l2(_matmul_scores(query, candidates), power_norm=self.power_norm)
        return chunked_pairwise(query, candidates, self.pair_scores, checkpoint=True)


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
        _check_side(side)
        q = self.query_vector(side, e, r)
        return difference_query_features(q) if self.l2 else q

    def candidates(self, side: Side, e: Any) -> torch.Tensor:  # noqa: D102
        _check_side(side)
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
            _check_side(side)
            return -torch.cdist(query, candidates, p=1)
        return super().score(side, query, candidates)


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
        _check_side(side)
        q0, factors = self.query_terms(side, e, r)
        return product_sum_query_features(q0, factors) if self.l2 else torch.cat([q0, *factors], dim=-1)

    def candidates(self, side: Side, e: Any) -> torch.Tensor:  # noqa: D102
        _check_side(side)
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
    with ``q_0 = -t``, ``q_1 = r``, i.e. query features ``[|t|^2, R(-2 t conj(r)), |r|^2]`` (the middle
    block is ``[-2 Re w, 2 Im w]`` for ``w = r conj(t)``) against ``[1, R(h), |h|^2]``
    (``[*, 3d + 1]``): ``|r h - t|^2 = |t|^2 - 2 Re(w h) + |r|^2 |h|^2`` elementwise.
    """

    interactions = (RotatEInteraction,)
    p = 2
    power_norm = False

    def query(self, side: Side, e: torch.Tensor, r: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        e, r = ensure_complex(e, r)
        if side == "tail":
            return difference_query_features(e * r)
        return product_sum_query_features(-e, [r])

    def candidates(self, side: Side, e: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
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

    interactions = (LineaREInteraction,)

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
        return self.interaction.u


class InterHTScorer(ProductSumScorer):
    """InterHT: ``-||h * (t_a + u) - t * (h_a + u) + r||_p`` with entities ``(e, e_a)``.

    Candidate factors ``(c, c_a)``. Tails: ``q_0 = u h + r``, factors ``(-(h_a + u), h)``; heads:
    ``q_0 = r - u t``, factors ``(t_a + u, -t)``.
    """

    interactions = (InterHTInteraction,)

    def query_terms(  # noqa: D102
        self, side: Side, e: Sequence[torch.Tensor], r: torch.Tensor
    ) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
        u = self.interaction.offset
        e, e_aux = e
        if side == "tail":
            return u * e + r, [-(e_aux + u), e]
        return r - u * e, [e_aux + u, -e]


class TranSScorer(ProductSumScorer):
    """TranS: ``-||h * (t_~ + u + r_bar) - t * (h_~ + u - r_hat) + r||_p`` with entities ``(e, e_~)``.

    Candidate factors ``(c, c_~)``. Tails: ``q_0 = h (u + r_bar) + r``, factors
    ``(-(h_~ + u - r_hat), h)``; heads: ``q_0 = r - t (u - r_hat)``, factors ``(t_~ + u + r_bar, -t)``.
    """

    interactions = (TranSInteraction,)

    def query_terms(  # noqa: D102
        self, side: Side, e: Sequence[torch.Tensor], r: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
        u = self.interaction.offset
        e, e_tilde = e
        r, r_bar, r_hat = r
        if side == "tail":
            return e * (r_bar + u) + r, [-(e_tilde + u - r_hat), e]
        return r - e * (u - r_hat), [e_tilde + u + r_bar, -e]


# -- slow exact fallback -------------------------------------------------------------------------


class BroadcastScorer(SharedCandidateScorer):
    """Exact but slow fallback for any interaction without a fast scorer.

    Queries pack the flattened known-entity and relation representations, candidates the
    flattened candidate representations; :meth:`score` calls the interaction on broadcast
    representations in blocks of queries and candidates (:func:`chunked_pairwise`), so that no
    representation block exceeds :data:`MAX_CHUNK_ELEMENTS` elements. It is memory-bounded, not fast.
    """

    fast = False

    def __init__(
        self,
        interaction: Interaction,
        entity_specs: Sequence[tuple[tuple[int, ...], bool]],
        relation_specs: Sequence[tuple[tuple[int, ...], bool]],
    ):
        """Bind the scorer.

        :param interaction: the interaction
        :param entity_specs: ``(shape, is_complex)`` of each entity representation, with the shape
            as the representation reports it (a complex dimension counts once)
        :param relation_specs: ``(shape, is_complex)`` of each relation representation
        """
        super().__init__(interaction)
        self.entity_specs = [(tuple(shape), bool(c)) for shape, c in entity_specs]
        self.relation_specs = [(tuple(shape), bool(c)) for shape, c in relation_specs]

    def _entity_specs(self, slot: Literal["head", "tail"]) -> list[tuple[tuple[int, ...], bool]]:
        indices = self.interaction.head_indices if slot == "head" else self.interaction.tail_indices
        return [self.entity_specs[i] for i in indices]

    @staticmethod
    def _known_slot(side: Side) -> Literal["head", "tail"]:
        return "head" if side == "tail" else "tail"

    def query(self, side: Side, e: Any, r: Any) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return _pack_parts(
            [*_as_parts(e), *_as_parts(r)], [*self._entity_specs(self._known_slot(side)), *self.relation_specs]
        )

    def candidates(self, side: Side, e: Any) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return _pack_parts(_as_parts(e), self._entity_specs(side))

    def score(self, side: Side, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        known_specs = self._entity_specs(self._known_slot(side))
        candidate_specs = self._entity_specs(side)
        known_width = sum(_part_width(spec) for spec in known_specs)

        def pair_scores(q: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            # q: [*B, b', 1, q], c: [*B, 1, k', c]
            e = _unpack_parts(q[..., :known_width], known_specs)
            r = _unpack_parts(q[..., known_width:], self.relation_specs)
            c = _unpack_parts(c, candidate_specs)
            return self.interaction(h=e, r=r, t=c) if side == "tail" else self.interaction(h=c, r=r, t=e)

        return chunked_pairwise(query, candidates, pair_scores)


# -- helpers for packing representations into flat feature tensors ----------------------------


def _part_width(spec: tuple[tuple[int, ...], bool]) -> int:
    shape, is_complex = spec
    return math.prod(shape) * (2 if is_complex else 1)


def _as_parts(x: Any) -> list[torch.Tensor]:
    """Return representation(s) as a list of tensors (empty for an empty tuple, e.g. UM's relation)."""
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _pack_parts(parts: Sequence[torch.Tensor], specs: Sequence[tuple[tuple[int, ...], bool]]) -> torch.Tensor:
    """Pack representation parts into ``[*, f]`` (complex parts as interleaved real views)."""
    if len(parts) != len(specs):
        raise ValueError(f"Expected {len(specs)} representation parts, got {len(parts)}.")
    if not parts:
        raise ValueError("There are no representations to pack.")
    flat = []
    for part, (shape, is_complex) in zip(parts, specs):
        if is_complex:
            part = torch.view_as_real(part.resolve_conj())
            shape = (*shape, 2)
        batch_shape = part.shape[: part.ndim - len(shape)]
        flat.append(part.reshape(*batch_shape, math.prod(shape)))
    return torch.cat(flat, dim=-1) if len(flat) > 1 else flat[0]


def _unpack_parts(x: torch.Tensor, specs: Sequence[tuple[tuple[int, ...], bool]]) -> Any:
    """Invert :func:`_pack_parts`; returns one tensor or a tuple (empty for no specs)."""
    parts = []
    offset = 0
    batch_shape = x.shape[:-1]
    for shape, is_complex in specs:
        width = _part_width((shape, is_complex))
        part = x[..., offset : offset + width]
        offset += width
        if is_complex:
            part = torch.view_as_complex(part.reshape(*batch_shape, *shape, 2).contiguous())
        else:
            part = part.reshape(*batch_shape, *shape)
        parts.append(part)
    return parts[0] if len(parts) == 1 else tuple(parts)


# -- wrappers ----------------------------------------------------------------------------------


class ClampedScorer(SharedCandidateScorer):
    """PyKEEN's :class:`~pykeen.nn.modules.ClampedInteraction` (e.g. SimplE's): the base scorer, then the clamp.

    Clamping acts on each score separately, so the wrapped interaction's fast scorer stays exact.
    """

    def __init__(self, interaction: ClampedInteraction, base: SharedCandidateScorer):
        """Wrap the scorer of the clamped interaction's base."""
        super().__init__(interaction)
        self.base = base

    @property
    def fast(self) -> bool:  # type: ignore[override]
        """Whether the base scorer is fast."""
        return self.base.fast

    def query(self, side: Side, e: Any, r: Any) -> torch.Tensor:  # noqa: D102
        return self.base.query(side, e, r)

    def candidates(self, side: Side, e: Any) -> torch.Tensor:  # noqa: D102
        return self.base.candidates(side, e)

    def score(self, side: Side, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:  # noqa: D102
        scores = self.base.score(side, query, candidates)
        clamp = self.interaction.clamp_score
        return scores if clamp is None else torch.clamp(scores, min=clamp[0], max=clamp[1])


# -- registry ----------------------------------------------------------------------------------

#: fast scorers by interaction class
SCORERS: dict[type[Interaction], type[SharedCandidateScorer]] = {}
#: interactions whose slow fallback was announced (a warning once per process)
_WARNED_FALLBACKS: set[str] = set()


def register_scorer(scorer_cls: type[SharedCandidateScorer]) -> type[SharedCandidateScorer]:
    """Register a fast scorer for the interaction classes it lists (usable as a decorator)."""
    for interaction_cls in scorer_cls.interactions:
        SCORERS[interaction_cls] = scorer_cls
    return scorer_cls


def supported_interactions() -> list[str]:
    """Return the names of the interactions with a fast scorer."""
    return sorted(cls.__name__ for cls in SCORERS)


def representation_spec(representation: torch.nn.Module) -> tuple[tuple[int, ...], bool]:
    """Return ``(shape, is_complex)`` of a PyKEEN representation module."""
    is_complex = bool(getattr(representation, "is_complex", False))
    return tuple(representation.shape), is_complex


def get_scorer(
    interaction: Interaction,
    *,
    entity_representations: Sequence[torch.nn.Module] | None = None,
    relation_representations: Sequence[torch.nn.Module] | None = None,
    allow_slow: bool = True,
) -> SharedCandidateScorer:
    """Return the shared-candidate scorer for an interaction instance.

    The scorer is looked up by the interaction's exact class: a subclass may change ``forward``, so
    it does not inherit its parent's fast scorer unless registered itself. Interactions without a
    fast scorer get the exact but slow :class:`BroadcastScorer`, which needs the model's
    representations to know their shapes.

    :param interaction: the interaction instance
    :param entity_representations: the model's entity representations (for the fallback)
    :param relation_representations: the model's relation representations (for the fallback)
    :param allow_slow: whether to fall back to :class:`BroadcastScorer`
    :returns: the scorer
    :raises NotImplementedError: if there is no fast scorer and the fallback is not allowed or
        not possible
    """
    if type(interaction) is ClampedInteraction:
        base = get_scorer(
            interaction.base,
            entity_representations=entity_representations,
            relation_representations=relation_representations,
            allow_slow=allow_slow,
        )
        return ClampedScorer(interaction, base)
    scorer_cls = SCORERS.get(type(interaction))
    if scorer_cls is not None:
        return scorer_cls(interaction)
    if not allow_slow or entity_representations is None or relation_representations is None:
        raise NotImplementedError(
            f"There is no fast shared-candidate scorer for {type(interaction).__name__}. Supported interactions: "
            f"{', '.join(supported_interactions())}."
        )
    name = type(interaction).__name__
    if name not in _WARNED_FALLBACKS:  # once per interaction and process (training and evaluation both ask)
        _WARNED_FALLBACKS.add(name)
        logger.warning("No fast shared-candidate scorer for %s; using the exact but slow chunked broadcast fallback.", name)
    return BroadcastScorer(
        interaction,
        entity_specs=[representation_spec(rep) for rep in entity_representations],
        relation_specs=[representation_spec(rep) for rep in relation_representations],
    )


for _scorer_cls in (
    DistMultScorer,
    ComplExScorer,
    RESCALScorer,
    SimplEScorer,
    CPScorer,
    DistMAScorer,
    TransFScorer,
    TransEScorer,
    UMScorer,
    RotatEScorer,
    PairREScorer,
    LineaREScorer,
    TripleREScorer,
    InterHTScorer,
    TranSScorer,
):
    register_scorer(_scorer_cls)
