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
    sides; then ``[L(i), n(j), b', q] x [L(i), n(j), K, c] -> [L(i), n(j), b', K]``. Negatives shared
    by all blocks (:attr:`~pykeen_bess.data.batch.BessBatch.shared_negatives`) are all-gathered instead,
    ``[L(k), m, D] -> [n(k), m, D]``, once per process (:meth:`~pykeen_bess.distributed.Topology.all_gather_once`),
    and one product scores all local queries: ``[L(i) * n(j) * b', q] x [K, c]``.
    """

    synonyms: ClassVar[tuple[str, ...]] = ("embedding",)

    @classmethod
    def negative_cost(cls, n: int, b: int, k: int, entity_width: int, query_width: int, shared: bool = False) -> int:
        """Count the negatives' rows: ``(n - 1) * K * D``; ``(n - 1) * m * D`` shared by all blocks."""
        return (n - 1) * (k // n if shared else k) * entity_width

    def negative_scores(  # noqa: D102
        self, side: Side, query: torch.Tensor, negatives: torch.Tensor, cache: dict[str, Any]
    ) -> torch.Tensor:
        n = self.topology.n_shard
        if negatives.shape[1] < n:  # shared by all blocks: [L(k), 1, 1, m, D]
            if "moved" not in cache:
                # [L(k), m, D] -> [n(k), m, D] -> [K, D]: every local shard would receive the same K rows,
                # so the process takes them once (candidates computed once, one product)
                moved = self.topology.all_gather_once(negatives[:, 0, 0])
                cache["moved"] = moved.reshape(-1, moved.shape[-1])
            local, blocks, slots, width = query.shape
            if local > 1 and self.sums_per_shard:
                # every local shard's queries against its own copy of the candidates (one batched product), as a
                # process holding only that shard scores them: the candidates' gradient is summed per shard, then
                # over the shards in shard order (the expand's backward, as the all-gather's backward sums the
                # processes' parts)
                if "per_shard" not in cache:  # one expand for both sides: each shard sums its sides' parts first
                    cache["per_shard"] = cache["moved"].expand(local, *cache["moved"].shape)
                candidates = self.candidate_parts(side, cache["per_shard"])  # [L, K, c]
                scores = self.scorer.score(side, query.reshape(local, blocks * slots, width), candidates)
                return scores.reshape(local, blocks, slots, -1)
            candidates = self.candidate_parts(side, cache["moved"])  # [K, c]
            return self.scorer.score(side, query.reshape(local * blocks * slots, width), candidates).reshape(
                local, blocks, slots, -1
            )
        if "moved" not in cache:  # [L(k), n(i), n(j), m, D] -> [L(i), n(k), n(j), m, D] -> [L(i), n(j), K, D]
            moved = self.topology.all_to_all(negatives).transpose(1, 2)
            cache["moved"] = moved.reshape(moved.shape[0], n, -1, moved.shape[-1])
        return self.scorer.score(side, query, self.candidate_parts(side, cache["moved"]))
