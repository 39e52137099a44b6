"""Score-moving: the queries move to every shard, the negatives' scores move back."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..scoring import Side
from .base import ExchangeScheme

__all__ = [
    "ScoreMovingScheme",
]


class ScoreMovingScheme(ExchangeScheme):
    """Gather the queries everywhere, score them against each shard's own negatives, move the scores back.

    ``all_gather([L(i), n(j), b', q]) -> [L(k), n(i), n(j), b', q]``, every shard scores against its
    local negatives, ``[L(k), n(i), n(j), b', m]``, and ``all_to_all -> [L(i), n(k), n(j), b', m]``,
    viewed as ``[L(i), n(j), b', K]``. No entity row of a negative ever moves.
    """

    synonyms: ClassVar[tuple[str, ...]] = ("score",)

    @classmethod
    def negative_cost(cls, n: int, b: int, k: int, entity_width: int, query_width: int) -> int:
        """Count the queries, ``(n - 1) * n * b * q``, and the scores, ``(n - 1) * b * K``."""
        return (n - 1) * n * b * query_width + (n - 1) * b * k

    def negative_scores(  # noqa: D102
        self, side: Side, query: torch.Tensor, negatives: torch.Tensor, cache: dict[str, Any]
    ) -> torch.Tensor:
        candidates = self.candidate_parts(side, negatives)
        # [L(k), n(i), n(j), b', m] -> [L(i), n(k), n(j), b', m] -> [L(i), n(j), b', K]
        scores = self.topology.all_to_all(self.scorer.score(side, self.topology.all_gather(query), candidates))
        scores = scores.permute(0, 2, 3, 1, 4)
        return scores.reshape(*scores.shape[:3], -1)
