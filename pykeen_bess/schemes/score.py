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
    viewed as ``[L(i), n(j), b', K]``. No entity row of a negative ever moves. Negatives shared by all
    blocks (:attr:`~pykeen_bess.data.batch.BessBatch.shared_negatives`) are scored by every shard in one
    product, ``[L(k), n(i) * n(j) * b', q] x [L(k), m, c]``.
    """

    synonyms: ClassVar[tuple[str, ...]] = ("score",)

    @classmethod
    def negative_cost(cls, n: int, b: int, k: int, entity_width: int, query_width: int, shared: bool = False) -> int:
        """Count the queries, ``(n - 1) * n * b * q``, and the scores, ``(n - 1) * b * K`` (shared or not)."""
        return (n - 1) * n * b * query_width + (n - 1) * b * k

    def negative_scores(  # noqa: D102
        self, side: Side, query: torch.Tensor, negatives: torch.Tensor, cache: dict[str, Any]
    ) -> torch.Tensor:
        gathered = self.topology.all_gather(query)  # [L(k), n(i), n(j), b', q]
        if negatives.shape[1] < self.topology.n_shard:  # shared: [L(k), 1, 1, m, D]
            candidates = self.candidate_parts(side, negatives[:, 0, 0])  # [L(k), m, c]
            local, n, _, slots, width = gathered.shape
            scores = self.scorer.score(side, gathered.reshape(local, n * n * slots, width), candidates)
            scores = scores.reshape(local, n, n, slots, -1)
        else:
            scores = self.scorer.score(side, gathered, self.candidate_parts(side, negatives))
        # [L(k), n(i), n(j), b', m] -> [L(i), n(k), n(j), b', m] -> [L(i), n(j), b', K]
        scores = self.topology.all_to_all(scores).permute(0, 2, 3, 1, 4)
        return scores.reshape(*scores.shape[:3], -1)
