"""The scorer interface and the math the scorers share.

A :class:`SharedCandidateScorer` splits an interaction into :meth:`~SharedCandidateScorer.query`
(``[*, q]`` features of the known entity and the relation), :meth:`~SharedCandidateScorer.candidates`
(``[*, c]`` features of the candidates) and :meth:`~SharedCandidateScorer.score`
(``[*B, b, q] x [*B, k, c] -> [*B, b, k]``). The helpers build query / candidate features for L2
distances by norm expansion and compute other norms exactly in memory-bounded chunks
(:func:`chunked_pairwise`, at most :data:`MAX_CHUNK_ELEMENTS` elements per intermediate).
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
    Interaction,
)

__all__ = [
    "MAX_CHUNK_ELEMENTS",
    "SIDES",
    "SharedCandidateScorer",
    "Side",
    "check_side",
    "chunked_pairwise",
    "difference_candidate_features",
    "difference_query_features",
    "matmul_scores",
    "negative_l2",
    "ones_column",
    "product_sum_candidate_features",
    "product_sum_query_features",
    "real_view",
    "squared_modulus",
    "sum_column",
]

logger = logging.getLogger(__name__)

#: the side that is predicted (or corrupted): "tail" scores ``(h, r, ?)``, "head" scores ``(?, r, t)``
Side = Literal["head", "tail"]
SIDES: tuple[Side, Side] = ("head", "tail")

#: the maximum number of elements of an intermediate tensor in chunked (non-matmul) scoring
MAX_CHUNK_ELEMENTS = 1 << 24


def check_side(side: str) -> None:
    """Raise an error unless ``side`` is ``"head"`` or ``"tail"``."""
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

    #: whether :meth:`candidates` and :meth:`score` do not depend on the side: the queries of both sides can
    #: then be scored against the same candidates in one product
    side_free_candidates: ClassVar[bool] = False

    #: whether every score is a finite-preserving function (e.g. a sigmoid, a square root of a clamped value) of
    #: the inner product of a query's and a candidate's features, so that ``|product| <= ||q|| ||c||`` bounds
    #: it: finite features with a product of norms far below the dtype's largest value give finite scores
    bounded_by_feature_norms: ClassVar[bool] = False

    def __init__(self, interaction: Interaction):
        """Bind the scorer to an interaction instance (whose parameters, e.g. ``p``, it reads)."""
        self.interaction = interaction

    def aligned_scores(self, side: Side, query: torch.Tensor, e: Any) -> torch.Tensor | None:
        """Score each query against its own entity from the query's features, ``[*, q] -> [*]``; None: not this way.

        A scorer whose score is the inner product of its features returns it here (nothing else is
        computed otherwise), and a training step then scores its positives with the queries it built for
        the negatives (one query computation per positive instead of two). Other scorers (e.g. distances
        by norm expansion, which would lose the precision of small distances) return None: their
        positives are scored by :meth:`score_triples`.

        :param side: the predicted side
        :param query: shape: ``[*, q]``, from :meth:`query`
        :param e: shape: ``[*, *entity_shape]``, each query's own entity of the predicted side
        """
        return None

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

    def score_into(self, side: Side, query: torch.Tensor, candidates: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:meth:`score` 2-D queries against 2-D candidates, written into ``out`` where the scorer can.

        Scorers whose scores are one matrix product write them into ``out`` (no allocation per block;
        the evaluator reuses one buffer for all its blocks); the others return :meth:`score`.

        :param side: the predicted side
        :param query: shape: ``[b, q]``
        :param candidates: shape: ``[k, c]``
        :param out: shape: ``[b', k']`` with ``b' >= b`` and ``k' >= k``, contiguous, of the query's dtype and device
        :returns: shape: ``[b, k]`` (a view of ``out`` if written there)
        """
        return self.score(side, query, candidates)

    def score_candidates(self, side: Side, e: Any, r: Any, candidate: Any) -> torch.Tensor:
        """Score queries against shared candidates from representations (convenience).

        :param side: the predicted side
        :param e: shape: ``[*B, b, *entity_shape]``, the known entity
        :param r: shape: ``[*B, b, *relation_shape]``
        :param candidate: shape: ``[*B, k, *entity_shape]``
        :returns: shape: ``[*B, b, k]``
        """
        return self.score(side, self.query(side, e, r), self.candidates(side, candidate))


#: on the CPU, score rows of at least this many candidates get a row stride rounded up to a multiple of it
SCORE_ROW_ALIGNMENT = 64


def matmul_scores(query: torch.Tensor, candidates: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Compute ``[*B, b, q] @ [*B, k, q]^T -> [*B, b, k]`` with broadcasting batch dimensions.

    With ``out`` (2-D operands without gradients; a contiguous ``[b', k']`` buffer, ``b' >= b``, ``k' >= k``,
    of their dtype and device) the product is written into ``out[:b, :k]`` (rows of stride ``k'``)
    and that view returned: no allocation, and on the CPU no fresh pages for the kernel to clear.

    Without gradients, a 2-D product on the CPU with ``k >= SCORE_ROW_ALIGNMENT`` candidates that
    are not a multiple of it is written into rows padded to the next multiple (the result is a
    ``[b, k]`` view with row stride ``>= k``): the BLAS product into rows of an odd width ran at
    about half speed (``[2000, 256] x [256, 3627]``: 50 GFLOP/s on one thread; 95 into rows of 3,648).
    """
    if query.dtype != candidates.dtype:  # promoted as elementwise products are (e.g. a model moved to float64 whose
        # entity table stays float32 in host memory, as PyKEEN's scoring of it promotes)
        dtype = torch.promote_types(query.dtype, candidates.dtype)
        query, candidates = query.to(dtype), candidates.to(dtype)
    k = candidates.shape[-2]
    if (
        out is not None
        and query.dim() == 2
        and candidates.dim() == 2
        and out.dim() == 2
        and out.is_contiguous()
        and out.shape[0] >= query.shape[0]
        and out.shape[1] >= k
        and out.dtype == query.dtype == candidates.dtype
        and out.device == query.device
        and not (torch.is_grad_enabled() and (query.requires_grad or candidates.requires_grad))
    ):
        return torch.mm(query, candidates.t(), out=out[: query.shape[0], :k])
    if (
        query.dim() == 2
        and candidates.dim() == 2
        and query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.float64)
        and candidates.dtype == query.dtype
        and k > SCORE_ROW_ALIGNMENT
        and k % SCORE_ROW_ALIGNMENT
        and not (torch.is_grad_enabled() and (query.requires_grad or candidates.requires_grad))
    ):
        padded = -(-k // SCORE_ROW_ALIGNMENT) * SCORE_ROW_ALIGNMENT
        out = query.new_empty(query.shape[0], padded)[:, :k]
        return torch.mm(query, candidates.t(), out=out)
    return torch.matmul(query, candidates.transpose(-1, -2))


# -- shared math ---------------------------------------------------------------------------------


def real_view(x: torch.Tensor) -> torch.Tensor:
    """Return a real tensor: ``[*, d]`` real stays, ``[*, d]`` complex becomes ``[*, 2d]`` (re, im interleaved).

    For complex ``w, z``: ``Re(sum_i w_i z_i) = <real_view(conj(w)), real_view(z)>``.
    """
    if x.is_complex():
        return torch.view_as_real(x.resolve_conj()).flatten(-2)
    return x


def squared_modulus(x: torch.Tensor) -> torch.Tensor:
    """Elementwise ``|x|^2`` (real output, differentiable everywhere); shape: ``[*, d] -> [*, d]``."""
    if x.is_complex():
        return torch.view_as_real(x.resolve_conj()).square().sum(dim=-1)
    return x.square()


def sum_column(x: torch.Tensor) -> torch.Tensor:
    """Sum the last dimension into a single feature column: ``[*, d] -> [*, 1]``."""
    return x.sum(dim=-1, keepdim=True)


def ones_column(x: torch.Tensor) -> torch.Tensor:
    """Return a constant feature column of ones with ``x``'s batch shape and real dtype: ``[*, d] -> [*, 1]``."""
    return torch.ones(*x.shape[:-1], 1, dtype=x.real.dtype, device=x.device)


def negative_l2(squared: torch.Tensor, power_norm: bool) -> torch.Tensor:
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
    q_real = real_view(q)
    return torch.cat([-2 * q_real, sum_column(q_real.square()), ones_column(q_real)], dim=-1)


def difference_candidate_features(c: torch.Tensor) -> torch.Tensor:
    """Candidate features matching :func:`difference_query_features`.

    :param c: shape: ``[*, d]``, real or complex
    :returns: shape: ``[*, w + 2]``: ``[R(c), 1, |c|^2]``
    """
    c_real = real_view(c)
    return torch.cat([c_real, ones_column(c_real), sum_column(c_real.square())], dim=-1)


def product_sum_query_features(q0: torch.Tensor, factors: Sequence[torch.Tensor]) -> torch.Tensor:
    r"""Query features of the expansion of ``||x||^2`` with ``x = q_0 + sum_k q_k * c_k``.

    With elementwise products and ``<a, b> = sum_i a_i b_i``,

    .. math::

        \|x\|^2 = |q_0|^2 + \sum_k 2 Re<\bar{q}_0 q_k, c_k> + \sum_k <|q_k|^2, |c_k|^2>
                  + \sum_{k < l} 2 Re<\bar{q}_k q_l, \bar{c}_k c_l>

    which is one inner product of the query features
    ``[R(2 q_0 conj(q_k))_k, R(2 q_k conj(q_l))_{k<l}, (|q_k|^2)_k, |q_0|^2]`` with
    :func:`product_sum_candidate_features` ``[R(c_k)_k, R(conj(c_k) c_l)_{k<l}, (|c_k|^2)_k, 1]``.
    Works for real and complex tensors. The real views of complex blocks come first: each starts at an
    even column, as the backward pass of a complex tensor's real view needs of a single row's gradient.

    :param q0: shape: ``[*, d]``, the candidate-independent term
    :param factors: ``K`` tensors of shape ``[*, d]``, the per-query factors ``q_k``
    :returns: shape: ``[*, K w + K (K - 1) / 2 w + K d + 1]``, ``w = d`` (real) or ``2d`` (complex)
    """
    parts = [real_view(2 * q0 * q.conj()) for q in factors]
    parts.extend(real_view(2 * q_k * q_l.conj()) for q_k, q_l in itertools.combinations(factors, 2))
    parts.extend(squared_modulus(q) for q in factors)
    parts.append(sum_column(squared_modulus(q0)))
    return torch.cat(parts, dim=-1)


def product_sum_candidate_features(candidates: Sequence[torch.Tensor]) -> torch.Tensor:
    """Candidate features matching :func:`product_sum_query_features`.

    :param candidates: ``K`` tensors of shape ``[*, d]``, the candidate factors ``c_k``
    :returns: shape: ``[*, K w + K (K - 1) / 2 w + K d + 1]``
    """
    parts = [real_view(c) for c in candidates]
    parts.extend(real_view(c_k.conj() * c_l) for c_k, c_l in itertools.combinations(candidates, 2))
    parts.extend(squared_modulus(c) for c in candidates)
    parts.append(ones_column(candidates[0]))
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
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = pair_scores
    if checkpoint and torch.is_grad_enabled() and (query.requires_grad or candidates.requires_grad):

        def fn(q: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(pair_scores, q, c, use_reentrant=False)

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
