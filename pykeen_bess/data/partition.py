"""Stage 2 of the pipeline: partitioning the triples into ``n_shard ** 2`` shardpairs.

A triple ``(h, r, t)`` belongs to shardpair ``(shard(h), shard(t))``. The head embedding of
every triple in shardpair ``(i, j)`` lives on worker ``i`` and the tail embedding on worker
``j``. The partition stores the triples grouped by shardpair, with local entity ids, so that a
block of triples can be drawn from any shardpair by plain indexing.
"""

from __future__ import annotations

import dataclasses

import torch

from .sharding import EntitySharding

__all__ = [
    "ShardPairPartition",
]


@dataclasses.dataclass(frozen=True, eq=False)
class ShardPairPartition:
    """Triples grouped by shardpair ``(head shard, tail shard)``, with local entity ids.

    Triples of shardpair ``p = i * n_shard + j`` occupy positions
    ``pair_offsets[p]:pair_offsets[p + 1]`` of the flat arrays.
    """

    #: the entity sharding the partition is based on
    sharding: EntitySharding
    #: shape: ``[T]``, local head ids (on the head's shard)
    heads: torch.Tensor
    #: shape: ``[T]``, relation ids
    relations: torch.Tensor
    #: shape: ``[T]``, local tail ids (on the tail's shard)
    tails: torch.Tensor
    #: shape: ``[T]``, the row of each triple in the input triples
    triple_ids: torch.Tensor
    #: shape: ``[n_shard ** 2 + 1]``, start offset of each shardpair in the flat arrays
    pair_offsets: torch.Tensor

    @classmethod
    def from_triples(cls, mapped_triples: torch.Tensor, sharding: EntitySharding) -> ShardPairPartition:
        """Partition id-based triples.

        This is a single stable sort, vectorised: about a second for ten million triples.

        :param mapped_triples: shape: ``[T, 3]``, global ``(h, r, t)`` ids
        :param sharding: the entity sharding
        :returns: the partition
        :raises ValueError: if the triples are malformed or use ids outside the sharding
        """
        mapped_triples = torch.as_tensor(mapped_triples).cpu()
        if mapped_triples.ndim != 2 or mapped_triples.shape[1] != 3:
            raise ValueError(f"Expected triples of shape [T, 3], got {tuple(mapped_triples.shape)}.")
        mapped_triples = mapped_triples.long()
        if mapped_triples.numel():
            entities = mapped_triples[:, [0, 2]]
            low, high = entities.min().item(), entities.max().item()
            if low < 0 or high >= sharding.num_entities:
                raise ValueError(
                    f"Triples use entity ids in [{low}, {high}], outside [0, {sharding.num_entities}) of the sharding."
                )
            if mapped_triples[:, 1].min().item() < 0:
                raise ValueError("Triples contain negative relation ids.")
        n = sharding.n_shard
        head_shard, head_local = sharding.to_local(mapped_triples[:, 0])
        tail_shard, tail_local = sharding.to_local(mapped_triples[:, 2])
        pair = head_shard * n + tail_shard
        order = torch.sort(pair, stable=True).indices
        counts = torch.bincount(pair, minlength=n * n)
        offsets = torch.zeros(n * n + 1, dtype=torch.long)
        torch.cumsum(counts, dim=0, out=offsets[1:])
        return cls(
            sharding=sharding,
            heads=head_local[order].contiguous(),
            relations=mapped_triples[order, 1].contiguous(),
            tails=tail_local[order].contiguous(),
            triple_ids=order,
            pair_offsets=offsets,
        )

    @property
    def n_shard(self) -> int:
        """The number of shards."""
        return self.sharding.n_shard

    @property
    def num_triples(self) -> int:
        """The number of triples."""
        return self.heads.shape[0]

    @property
    def pair_counts(self) -> torch.Tensor:
        """shape: ``[n_shard, n_shard]``, the number of triples in each shardpair."""
        return (self.pair_offsets[1:] - self.pair_offsets[:-1]).view(self.n_shard, self.n_shard)

    def global_triples(self) -> torch.Tensor:
        """Return the triples with global ids, in partition order.

        :returns: shape: ``[T, 3]``
        """
        n = self.n_shard
        pair = torch.repeat_interleave(torch.arange(n * n), self.pair_counts.view(-1))
        heads = self.sharding.to_global(pair // n, self.heads)
        tails = self.sharding.to_global(pair % n, self.tails)
        return torch.stack([heads, self.relations, tails], dim=1)
