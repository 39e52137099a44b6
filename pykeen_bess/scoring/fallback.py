"""Scorers without a matrix-product form: the exact broadcast fallback, and wrappers of other scorers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
import torch.utils.checkpoint
from pykeen.nn.modules import (
    ClampedInteraction,
    Interaction,
)

from .base import (
    SharedCandidateScorer,
    Side,
    check_side,
    chunked_pairwise,
)


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
        check_side(side)
        return _pack_parts(
            [*_as_parts(e), *_as_parts(r)], [*self._entity_specs(self._known_slot(side)), *self.relation_specs]
        )

    def candidates(self, side: Side, e: Any) -> torch.Tensor:  # noqa: D102
        check_side(side)
        return _pack_parts(_as_parts(e), self._entity_specs(side))

    def score(self, side: Side, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_side(side)
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


__all__ = [
    "BroadcastScorer",
    "ClampedScorer",
]


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
        clamp = cast(Any, self.interaction).clamp_score
        return scores if clamp is None else torch.clamp(scores, min=clamp[0], max=clamp[1])
