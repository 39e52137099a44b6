"""Stage 1 of the pipeline: entity sharding.

BESS splits the entity table into ``n_shard`` shards of equal size, one per worker. Entities are
assigned by a seeded random permutation: the entity at position ``p`` of the permutation goes to
shard ``p % n_shard`` with local id ``p // n_shard``. Every shard therefore holds either
``ceil(N / n)`` or ``floor(N / n)`` real entities; all shard tables are allocated with
``shard_size = ceil(N / n)`` rows and the missing rows (at most one per shard) are *padding*:
they belong to no entity, are never sampled and never ranked.

Relations are not sharded (they are replicated on every worker).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

__all__ = [
    "EntitySharding",
]


@dataclasses.dataclass(frozen=True, eq=False)
class EntitySharding:
    """The assignment of entities to shards.

    Create it with :meth:`EntitySharding.create`; all tensors are int64 on the CPU.
    """

    #: the number of (real) entities
    num_entities: int
    #: the number of shards
    n_shard: int
    #: the seed of the permutation
    seed: int
    #: shape: ``[num_entities]``, the shard of each entity
    entity_shard: torch.Tensor
    #: shape: ``[num_entities]``, the local id of each entity within its shard
    entity_local: torch.Tensor
    #: shape: ``[n_shard, shard_size]``, the global id of each (shard, local id); ``-1`` for padding
    shard_entities: torch.Tensor
    #: shape: ``[n_shard]``, the number of real entities in each shard
    shard_counts: torch.Tensor

    @classmethod
    def create(cls, num_entities: int, n_shard: int, seed: int = 0) -> EntitySharding:
        """Shard ``num_entities`` entities into ``n_shard`` shards by a random permutation.

        :param num_entities: the number of entities, ``N >= 1``
        :param n_shard: the number of shards, ``1 <= n_shard <= N``
        :param seed: the seed of the permutation
        :returns: the sharding
        :raises ValueError: for an invalid number of shards
        """
        num_entities = int(num_entities)
        n_shard = int(n_shard)
        if num_entities < 1:
            raise ValueError(f"Cannot shard {num_entities=}: there must be at least one entity.")
        if not 1 <= n_shard <= num_entities:
            raise ValueError(
                f"num_shards must be between 1 and the number of entities ({num_entities}), but is {n_shard}."
            )
        generator = torch.Generator().manual_seed(int(seed))
        # position of each entity in the random order
        permutation = torch.randperm(num_entities, generator=generator)
        shard_size = -(-num_entities // n_shard)
        positions = torch.arange(num_entities)
        shard_entities = torch.full((shard_size * n_shard,), fill_value=-1, dtype=torch.long)
        # slot (shard s, local l) is position l * n_shard + s of the padded table
        shard_entities[positions] = permutation
        shard_entities = shard_entities.view(shard_size, n_shard).t().contiguous()
        entity_shard = torch.empty(num_entities, dtype=torch.long)
        entity_local = torch.empty(num_entities, dtype=torch.long)
        entity_shard[permutation] = positions % n_shard
        entity_local[permutation] = positions // n_shard
        shard_counts = (shard_entities >= 0).sum(dim=1)
        return cls(
            num_entities=num_entities,
            n_shard=n_shard,
            seed=int(seed),
            entity_shard=entity_shard,
            entity_local=entity_local,
            shard_entities=shard_entities,
            shard_counts=shard_counts,
        )

    @property
    def shard_size(self) -> int:
        """The number of rows of every shard table (real entities plus padding)."""
        return self.shard_entities.shape[1]

    @property
    def num_padding(self) -> int:
        """The total number of padding rows over all shards."""
        return self.n_shard * self.shard_size - self.num_entities

    def to_local(self, entities: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Map global entity ids to ``(shard, local id)``.

        :param entities: shape: ``s``, global ids
        :returns: two tensors of shape ``s``: the shard and the local id
        """
        entities = entities.cpu()
        return self.entity_shard[entities], self.entity_local[entities]

    def to_global(self, shard: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Map ``(shard, local id)`` to global entity ids (``-1`` for padding rows).

        :param shard: shape: ``s``, shard ids
        :param local: shape: ``s``, local ids
        :returns: shape: ``s``, the global ids
        """
        return self.shard_entities[shard.cpu(), local.cpu()]

    def padding_mask(self, shards: Sequence[int] | None = None) -> torch.Tensor:
        """Return a mask of the real (non-padding) rows.

        :param shards: the shards to include, defaults to all
        :returns: shape: ``[len(shards), shard_size]``, True for rows holding an entity
        """
        table = self.shard_entities if shards is None else self.shard_entities[list(shards)]
        return table >= 0

    def describe(self) -> str:
        """Return a one-line human-readable summary."""
        counts = self.shard_counts.tolist()
        return (
            f"{self.num_entities:,} entities in {self.n_shard} shards of {self.shard_size:,} rows "
            f"({min(counts):,}-{max(counts):,} real entities per shard, seed={self.seed})"
        )
