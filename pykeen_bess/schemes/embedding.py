"""Embedding-moving: the negatives' embeddings move to the heads' shard."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..scoring import Side
from .base import ExchangeScheme

__all__ = [
    "EmbeddingMovingScheme",
]


class EmbeddingMovingScheme(ExchangeScheme):
    """Move negative embeddings to the heads' shard; score every query against its block's ``K`` negatives there.

    ``all_to_all([L(k), n(i), n(j), m, D]) -> [L(i), n(k), n(j), m, D]``, once per slice for both
    sides; then ``[L(i), n(j), b', q] x [L(i), n(j), K, c] -> [L(i), n(j), b', K]``.
    """

    synonyms: ClassVar[tuple[str, ...]] = ("embedding",)

    @classmethod
    def negative_cost(cls, n: int, b: int, k: int, entity_width: int, query_width: int) -> int:
        """Count the negatives' rows: ``(n - 1) * K * D``."""
        return (n - 1) * k * entity_width

    def negative_scores(  # noqa: D102
        self, side: Side, query: torch.Tensor, negatives: torch.Tensor, cache: dict[str, Any]
    ) -> torch.Tensor:
        if "moved" not in cache:
            # [L(k), n(i), n(j), m, D] -> [L(i), n(k), n(j), m, D] -> [L(i), n(j), K, D]
            moved = self.topology.all_to_all(negatives).transpose(1, 2)
            cache["moved"] = moved.reshape(moved.shape[0], self.topology.n_shard, -1, moved.shape[-1])
        return self.scorer.score(side, query, self.candidate_parts(side, cache["moved"]))
