"""Stage 1 of the pipeline: entity sharding.

BESS splits the entity table into ``n_shard`` shards of equal size, one per worker. Entities are
assigned by a seeded random permutation: the entity at position ``p`` of the permutation goes to
shard ``p % n_shard`` with local id ``p // n_shard``. Every shard therefore holds either
``ceil(N / n)`` or ``floor(N / n)`` real entities; all shard tables are allocated with
``shard_size = ceil(N / n)`` rows and the missing rows (at most one per shard) are *padding*:
they belong to no entity, are never sampled and never ranked.

Relations are not sharded (they are replicated on every worker).

How entities are dealt to shards is a :class:`ShardingStrategy` (one class per strategy):
:class:`RandomSharding` (the permutation above), :class:`BalancedSharding` (the training loop's
default: the permutation above, then a few swaps of entities between shards until the ``n ** 2``
shardpairs hold about equally many training triples, see :mod:`pykeen_bess.data.balancing`) and
:class:`TypedSharding` (graphs with entity types, :mod:`pykeen_bess.pbg`): every shard holds an
equal share of every entity type, its rows grouped type by type, or, with as many shards as the
graph has partitions, shard ``k`` is partition ``k`` of every type (PyTorch-BigGraph's layout).
Every strategy puts a shard's real rows first and its padding rows last, so a shard's real rows
are local ids ``0 .. count - 1``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from .balancing import balance_shards

__all__ = [
    "BalancedSharding",
    "EntitySharding",
    "RandomSharding",
    "SHARDINGS",
    "ShardingStrategy",
    "TypedSharding",
    "resolve_sharding",
]


class ShardingStrategy(ABC):
    """How the entities are dealt to the shards (stage 1's variants)."""

    @abstractmethod
    def deal(self, num_entities: int, n_shard: int, generator: torch.Generator) -> torch.Tensor:
        """Return the global id of every (shard, local id).

        :param num_entities: the number of entities ``N``
        :param n_shard: the number of shards ``n``, ``1 <= n <= N``
        :param generator: the sharding's random stream
        :returns: shape: ``[n_shard, shard_size]``, every entity exactly once, each shard's real rows
            first and ``-1`` (padding) after them
        """

    def check(self, num_entities: int, n_shard: int) -> None:  # noqa: B027 - optional hook
        """Raise a ``ValueError`` if the strategy cannot shard ``num_entities`` entities ``n_shard`` ways."""

    def describe(self) -> str:
        """Return a short description for logs."""
        return "random"


class RandomSharding(ShardingStrategy):
    """A seeded random permutation: position ``p`` goes to shard ``p % n`` with local id ``p // n``."""

    def deal(self, num_entities: int, n_shard: int, generator: torch.Generator) -> torch.Tensor:  # noqa: D102
        permutation = torch.randperm(num_entities, generator=generator)
        return _deal(permutation, n_shard)


@dataclasses.dataclass(frozen=True, eq=False)
class BalancedSharding(ShardingStrategy):
    """:class:`RandomSharding`'s permutation, then swaps until the shardpairs hold equally many triples.

    An epoch has as many steps as the largest shardpair needs (:mod:`pykeen_bess.data.sampling`); with a
    random permutation, hub entities make some shardpairs several percent larger than the mean,
    and the other shardpairs' slots of the extra steps are padding. The swaps
    (:func:`~pykeen_bess.data.balancing.balance_shards`) keep every shard's size; within a shard the
    entities keep the permutation's order.
    """

    #: shape: ``[T, 3]``, the training triples (head, relation, tail); held by reference, not copied
    triples: torch.Tensor
    #: stop once the largest shardpair holds at most ``1 + tolerance`` times the mean
    tolerance: float = 0.003

    @classmethod
    def from_triples(cls, mapped_triples: torch.Tensor, **kwargs) -> BalancedSharding:
        """Balance the shardpairs of ``mapped_triples`` (shape: ``[T, 3]``, columns head, relation, tail)."""
        return cls(triples=mapped_triples, **kwargs)

    def check(self, num_entities: int, n_shard: int) -> None:  # noqa: D102
        ends = self.triples[:, 0::2]
        if ends.numel() and int(ends.max()) >= num_entities:
            raise ValueError(
                f"The training triples name entity id {int(ends.max())}, but the model has {num_entities} entities: "
                f"train with the triples factory the model was built from (triples_factory=...), whose ids are the "
                f"model's."
            )

    def deal(self, num_entities: int, n_shard: int, generator: torch.Generator) -> torch.Tensor:  # noqa: D102
        permutation = torch.randperm(num_entities, generator=generator)
        if n_shard == 1:
            return _deal(permutation, n_shard)
        position = torch.empty(num_entities, dtype=torch.long)
        position[permutation] = torch.arange(num_entities)
        shard = position % n_shard
        triples = self.triples.cpu()
        heads, tails = triples[:, 0].contiguous(), triples[:, 2].contiguous()
        shard = balance_shards(shard, heads, tails, n_shard, generator, tolerance=self.tolerance)
        # grouped by shard, in the permutation's order within a shard
        order = torch.argsort(shard * num_entities + position)
        return _stack_ragged(order.split(torch.bincount(shard, minlength=n_shard).tolist()))

    def describe(self) -> str:  # noqa: D102
        return "balanced shardpairs"


def _deal(order: torch.Tensor, n_shard: int, first_shard: int = 0) -> torch.Tensor:
    """Deal ``order`` like cards from ``first_shard`` on: element ``p`` to shard ``(first_shard + p) % n``.

    :returns: shape: ``[n_shard, ceil(len(order) / n_shard)]``, element ``p`` at local id ``p // n``, -1 after
        each shard's elements
    """
    positions = torch.arange(order.numel())
    table = torch.full((n_shard, -(-order.numel() // n_shard)), fill_value=-1, dtype=torch.long)
    table[(first_shard + positions) % n_shard, positions // n_shard] = order
    return table


def _stack_ragged(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack 1-d tensors into ``[len(rows), longest]``, padded with -1 after each."""
    table = torch.full((len(rows), max((row.numel() for row in rows), default=0)), fill_value=-1, dtype=torch.long)
    for index, row in enumerate(rows):
        table[index, : row.numel()] = row
    return table


def _concat_shards(parts: Sequence[torch.Tensor], n_shard: int) -> torch.Tensor:
    """Concatenate the real rows of ``[n_shard, *]`` parts shard by shard, padding at the end."""
    return _stack_ragged([torch.cat([part[shard][part[shard] >= 0] for part in parts]) for shard in range(n_shard)])


@dataclasses.dataclass(frozen=True, eq=False)
class TypedSharding(ShardingStrategy):
    """Every shard holds an equal share of every entity type, its rows grouped type by type.

    Types are dealt one after the other, continuing where the previous type stopped, so the shards'
    totals differ by at most one entity and every type's by at most one. Within a type the order is
    a seeded random permutation, except with ``n_shard == num_partitions``: shard ``k`` is then
    partition ``k`` of every partitioned type, in the order of the global ids (the partitions of the
    graph, e.g. PyTorch-BigGraph's); types with one partition are dealt randomly.
    """

    #: shape: ``[N]``, the type of every entity
    entity_types: torch.Tensor
    #: shape: ``[N]``, the partition of every entity (within its type), or None
    entity_partitions: torch.Tensor | None = None
    #: the number of partitions of every type (1: unpartitioned); () without partitions
    type_partitions: tuple[int, ...] = ()

    @property
    def num_types(self) -> int:
        """The number of entity types."""
        return max(len(self.type_partitions), int(self.entity_types.max()) + 1 if self.entity_types.numel() else 0)

    @property
    def num_partitions(self) -> int:
        """The number of partitions of the partitioned types (1 if none is partitioned)."""
        return max(self.type_partitions, default=1)

    def uses_partitions(self, n_shard: int) -> bool:
        """Whether ``n_shard`` shards are the graph's partitions (shard ``k`` = partition ``k`` of every type)."""
        return self.entity_partitions is not None and self.num_partitions > 1 and n_shard == self.num_partitions

    def check(self, num_entities: int, n_shard: int) -> None:  # noqa: D102
        if self.entity_types.shape != (num_entities,):
            raise ValueError(
                f"The entity types describe {self.entity_types.numel()} entities, but there are {num_entities}."
            )

    def deal(self, num_entities: int, n_shard: int, generator: torch.Generator) -> torch.Tensor:  # noqa: D102
        by_type = torch.sort(self.entity_types, stable=True).indices
        counts = torch.bincount(self.entity_types, minlength=self.num_types).tolist()
        parts = []
        first = 0
        for type_index, ids in enumerate(by_type.split(counts)):
            partitioned = self.uses_partitions(n_shard) and self.type_partitions[type_index] > 1
            if partitioned:  # shard k = partition k of the type, in the order of the global ids
                assert self.entity_partitions is not None
                partitions = self.entity_partitions[ids]
                sizes = torch.bincount(partitions, minlength=n_shard).tolist()
                parts.append(_stack_ragged(ids[torch.sort(partitions, stable=True).indices].split(sizes)))
                continue
            parts.append(_deal(ids[torch.randperm(ids.numel(), generator=generator)], n_shard, first))
            first = (first + ids.numel()) % n_shard
        return _concat_shards(parts, n_shard)

    def describe(self) -> str:  # noqa: D102
        return f"stratified by {self.num_types} entity types"


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
    #: how the entities were dealt (rebuilds the sharding for another number of shards, e.g. to reshard)
    strategy: ShardingStrategy = dataclasses.field(default_factory=RandomSharding)

    @classmethod
    def create(
        cls, num_entities: int, n_shard: int, seed: int = 0, strategy: ShardingStrategy | None = None
    ) -> EntitySharding:
        """Shard ``num_entities`` entities into ``n_shard`` shards.

        :param num_entities: the number of entities, ``N >= 1``
        :param n_shard: the number of shards, ``1 <= n_shard <= N``
        :param seed: the seed of the strategy's random draws
        :param strategy: how entities are dealt; default: a random permutation (:class:`RandomSharding`)
        :returns: the sharding
        :raises ValueError: for an invalid number of shards (also a fractional one), a negative or fractional
            seed, or one the strategy cannot deal
        :raises TypeError: for a strategy that is not a :class:`ShardingStrategy` (a loop's ``sharding`` takes
            names: :func:`resolve_sharding`)
        """
        num_entities = int(num_entities)
        n_shard = _whole_number("num_shards", n_shard)
        seed = _whole_number("seed", seed)
        if seed < 0:
            raise ValueError(f"seed must be an integer >= 0, but is {seed}.")
        strategy = RandomSharding() if strategy is None else strategy
        if not isinstance(strategy, ShardingStrategy):
            raise TypeError(
                f"strategy must be a ShardingStrategy (e.g. RandomSharding(), BalancedSharding.from_triples(...)), not "
                f"{strategy!r}; the names {SHARDINGS} are resolved by resolve_sharding()."
            )
        if num_entities < 1:
            raise ValueError(f"Cannot shard {num_entities=}: there must be at least one entity.")
        if not 1 <= n_shard <= num_entities:
            raise ValueError(
                f"num_shards must be between 1 and the number of entities ({num_entities}), but is {n_shard}."
            )
        strategy.check(num_entities, n_shard)
        shard_entities = strategy.deal(num_entities, n_shard, torch.Generator().manual_seed(int(seed)))
        real = shard_entities >= 0
        shard_counts = real.sum(dim=1)
        # every shard's real rows first: the samplers draw local ids below a shard's count
        if not bool((real == (torch.arange(shard_entities.shape[1]) < shard_counts.view(-1, 1))).all()):
            raise AssertionError(f"{type(strategy).__name__} put padding rows before real rows.")
        entity_shard = torch.full((num_entities,), fill_value=-1, dtype=torch.long)
        entity_local = torch.empty(num_entities, dtype=torch.long)
        for shard, count in enumerate(shard_counts.tolist()):
            ids = shard_entities[shard, :count]
            entity_shard[ids] = shard
            entity_local[ids] = torch.arange(count)
        if int(shard_counts.sum()) != num_entities or bool((entity_shard < 0).any()):
            raise AssertionError(f"{type(strategy).__name__} did not deal every entity exactly once.")
        return cls(
            num_entities=num_entities,
            n_shard=n_shard,
            seed=int(seed),
            entity_shard=entity_shard,
            entity_local=entity_local,
            shard_entities=shard_entities.contiguous(),
            shard_counts=shard_counts,
            strategy=strategy,
        )

    def with_shards(self, n_shard: int) -> EntitySharding:
        """Return the sharding of the same entities, seed and strategy into ``n_shard`` shards."""
        return EntitySharding.create(self.num_entities, n_shard, seed=self.seed, strategy=self.strategy)

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

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identify the assignment: shards, seed and a digest of which entity is where (not the strategy's name).

        Part of the shard tables' ``repr`` and so of PyKEEN's checkpoint checksum: a checkpoint
        resumes only into the same assignment, whichever strategy produced it.
        """
        digest = hashlib.sha1(self.shard_entities.numpy().tobytes()).hexdigest()[:12]
        return f"shards={self.n_shard}, seed={self.seed}, assignment={digest}"

    def describe(self) -> str:
        """Return a one-line human-readable summary."""
        counts = self.shard_counts.tolist()
        strategy = "" if isinstance(self.strategy, RandomSharding) else f", {self.strategy.describe()}"
        return (
            f"{self.num_entities:,} entities in {self.n_shard} shards of {self.shard_size:,} rows "
            f"({min(counts):,}-{max(counts):,} real entities per shard, seed={self.seed}{strategy})"
        )


def _whole_number(name: str, value: Any) -> int:
    """Return an integer (also a NumPy integer or a one-element integer tensor); refuse fractions and booleans."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, but is {value!r}.") from None


#: the names of the sharding strategies a loop accepts
SHARDINGS = ("balanced", "random")


def resolve_sharding(hint: Any, schema: Any, factory: Any) -> ShardingStrategy:
    """Return the sharding strategy of a loop.

    :param hint: ``"balanced"`` (the default: shardpairs with equally many training triples),
        ``"random"`` (a random permutation), a :class:`~pykeen_bess.data.sharding.ShardingStrategy`, or None
    :param schema: the graph schema of a typed graph (:class:`~pykeen_bess.pbg.schema.GraphSchema`: sharded by
        type through its ``sharding_strategy()``; only None or a strategy allowed), or None
    :param factory: the training triples (balanced: their shardpairs)
    :raises ValueError: for an unknown name, or a name with a typed graph
    """
    if isinstance(hint, ShardingStrategy):
        return hint
    if hint is not None and hint not in SHARDINGS:
        raise ValueError(f"Unknown sharding={hint!r}; expected one of {SHARDINGS} or a ShardingStrategy.")
    if schema is not None:
        if hint is not None:
            raise ValueError(
                f"sharding={hint!r} does not apply to a typed graph: its shards hold an equal share of every entity "
                "type (or its partitions); leave sharding unset."
            )
        return schema.sharding_strategy()
    if hint == "random" or factory is None:
        return RandomSharding()
    # the triples the loop trains on: with inverse triples if the factory adds them (as the partition does)
    return BalancedSharding.from_triples(factory._add_inverse_triples_if_necessary(factory.mapped_triples))
