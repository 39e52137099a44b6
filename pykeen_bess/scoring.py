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
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import torch
from pykeen.nn.modules import (
    DistMultInteraction,
    Interaction,
)

__all__ = [
    "Side",
    "SharedCandidateScorer",
    "InnerProductScorer",
    "BroadcastScorer",
    "DistMultScorer",
    "get_scorer",
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


class BroadcastScorer(SharedCandidateScorer):
    """Exact but slow fallback for any interaction without a fast scorer.

    Queries pack the flattened known-entity and relation representations, candidates the
    flattened candidate representations; :meth:`score` calls the interaction on broadcast
    representations in chunks of candidates, so that no intermediate exceeds
    :data:`MAX_CHUNK_ELEMENTS` elements. It is memory-bounded, not fast.
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
        return torch.cat(
            [_pack_parts(e, self._entity_specs(self._known_slot(side))), _pack_parts(r, self.relation_specs)],
            dim=-1,
        )

    def candidates(self, side: Side, e: Any) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        return _pack_parts(e, self._entity_specs(side))

    def score(self, side: Side, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_side(side)
        known_specs = self._entity_specs(self._known_slot(side))
        known_width = sum(_part_width(spec) for spec in known_specs)
        b, k = query.shape[-2], candidates.shape[-2]
        batch = math.prod(torch.broadcast_shapes(query.shape[:-2], candidates.shape[:-2]))
        width = max(query.shape[-1], candidates.shape[-1])
        chunk = max(1, MAX_CHUNK_ELEMENTS // max(batch * b * width, 1))
        # queries: [*B, b, 1, q], candidates: [*B, 1, k', c]
        query = query.unsqueeze(-2)
        e = _unpack_parts(query[..., :known_width], known_specs)
        r = _unpack_parts(query[..., known_width:], self.relation_specs)
        results = []
        for start in range(0, k, chunk):
            c = _unpack_parts(candidates[..., start : start + chunk, :].unsqueeze(-3), self._entity_specs(side))
            if side == "tail":
                results.append(self.interaction(h=e, r=r, t=c))
            else:
                results.append(self.interaction(h=c, r=r, t=e))
        return torch.cat(results, dim=-1)


# -- helpers for packing representations into flat feature tensors ----------------------------


def _part_width(spec: tuple[tuple[int, ...], bool]) -> int:
    shape, is_complex = spec
    return math.prod(shape) * (2 if is_complex else 1)


def _pack_parts(x: Any, specs: Sequence[tuple[tuple[int, ...], bool]]) -> torch.Tensor:
    """Pack representation part(s) into ``[*, f]`` (complex parts as interleaved real views)."""
    parts = list(x) if isinstance(x, (tuple, list)) else [x]
    if len(parts) != len(specs):
        raise ValueError(f"Expected {len(specs)} representation parts, got {len(parts)}.")
    flat = []
    for part, (shape, is_complex) in zip(parts, specs):
        if is_complex:
            part = torch.view_as_real(part)
            shape = (*shape, 2)
        batch_shape = part.shape[: part.ndim - len(shape)]
        flat.append(part.reshape(*batch_shape, math.prod(shape)))
    return torch.cat(flat, dim=-1) if len(flat) > 1 else flat[0]


def _unpack_parts(x: torch.Tensor, specs: Sequence[tuple[tuple[int, ...], bool]]) -> Any:
    """Invert :func:`_pack_parts`; returns one tensor or a tuple."""
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


# -- registry ----------------------------------------------------------------------------------

#: fast scorers by interaction class
SCORERS: dict[type[Interaction], type[SharedCandidateScorer]] = {}


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

    The scorer is looked up by the interaction's class (walking its MRO). Interactions without a
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
    for cls in type(interaction).__mro__:
        scorer_cls = SCORERS.get(cls)
        if scorer_cls is not None:
            return scorer_cls(interaction)
    if not allow_slow or entity_representations is None or relation_representations is None:
        raise NotImplementedError(
            f"There is no fast shared-candidate scorer for {type(interaction).__name__}. Supported interactions: "
            f"{', '.join(supported_interactions())}."
        )
    logger.warning(
        "No fast shared-candidate scorer for %s; using the exact but slow chunked broadcast fallback.",
        type(interaction).__name__,
    )
    return BroadcastScorer(
        interaction,
        entity_specs=[representation_spec(rep) for rep in entity_representations],
        relation_specs=[representation_spec(rep) for rep in relation_representations],
    )


register_scorer(DistMultScorer)
