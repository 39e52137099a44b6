"""The candidates of a scoring's local shards: their columns on the host and the id tables on the device.

:class:`~pykeen_bess.evaluation.sharded.ShardedScoring` numbers the candidates of each local shard
by *columns* ``0..C_p - 1`` (``p``: the position of the shard among the local shards): all real
local ids in order, or only those of ``restrict_entities_to``, or the local ids sorted by global id
(``order_by_id``). :meth:`CandidateColumns.create` builds this numbering on the host, once per
scoring; :meth:`DeviceTables.build` builds the id tables the scoring needs on the compute device
(which local shard, local id and column holds each entity; the global and local id of each column)
and copies them there, once per device
(:meth:`~pykeen_bess.evaluation.sharded.ShardedScoring.device_tables` keeps one per device). These
are the scoring's only host-to-device copies of ids. :class:`ScoringLayouts` keeps the most recent
sharding, columns and tables for the next scoring (an evaluator's next evaluation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..data.sharding import EntitySharding

__all__ = [
    "CandidateColumns",
    "DeviceTables",
    "ScoringLayouts",
]


@dataclasses.dataclass(frozen=True, eq=False)
class CandidateColumns:
    """The columns of the candidates of each local shard, on the host."""

    #: per local shard, the local id of each column (None: the columns are the local ids ``0..count - 1``)
    candidate_local: list[torch.Tensor | None]
    #: per local shard, shape ``[shard_size]``: the column of each local id, ``-1`` for non-candidates
    #: (None: the columns are the local ids)
    column_of_local: list[torch.Tensor | None]
    #: per local shard, the number of candidates ``C_p``
    candidate_counts: list[int]
    #: shape: ``[num_entities]``, bool, whether each entity is a candidate (None: all are)
    candidate_mask: torch.Tensor | None
    #: the number of candidates of all shards (local or not)
    num_candidates: int

    @classmethod
    def create(
        cls,
        sharding: EntitySharding,
        local_shards: Sequence[int],
        restrict_entities_to: torch.Tensor | None = None,
        order_by_id: bool = False,
    ) -> CandidateColumns:
        """Return the columns of the local shards' candidates.

        :param sharding: the entity sharding
        :param local_shards: the shards processed here, in the order of their positions
        :param restrict_entities_to: shape: ``[E']``, sorted unique global ids of the only candidates
        :param order_by_id: number the candidates of each shard by ascending global id
        :returns: the columns
        """
        candidate_local: list[torch.Tensor | None] = []
        column_of_local: list[torch.Tensor | None] = []
        allowed = None
        if restrict_entities_to is not None:
            allowed = torch.zeros(sharding.num_entities, dtype=torch.bool)
            allowed[restrict_entities_to.cpu()] = True
        for shard in local_shards:
            count = int(sharding.shard_counts[shard])
            entities = sharding.shard_entities[shard, :count]
            local = torch.arange(count)
            if allowed is not None:
                local = local[allowed[entities]]
            if order_by_id:
                local = local[torch.argsort(entities[local])]
            if allowed is None and not order_by_id:
                candidate_local.append(None)
                column_of_local.append(None)
                continue
            column = torch.full((sharding.shard_size,), -1, dtype=torch.long)
            column[local] = torch.arange(local.shape[0])
            candidate_local.append(local)
            column_of_local.append(column)
        candidate_counts = [
            int(sharding.shard_counts[shard]) if local is None else int(local.shape[0])
            for shard, local in zip(local_shards, candidate_local)
        ]
        num_candidates = sharding.num_entities if allowed is None else int(allowed.sum())
        return cls(candidate_local, column_of_local, candidate_counts, allowed, num_candidates)


@dataclasses.dataclass(frozen=True, eq=False)
class DeviceTables:
    """The id tables of a scoring on one device (built once per device)."""

    #: shape: ``[E]``, the position of each entity's shard among the local shards, ``-1`` if not local
    entity_position: torch.Tensor
    #: shape: ``[E]``, each entity's local id within its shard
    entity_local: torch.Tensor
    #: shape: ``[E]``, each entity's column among its shard's candidates, ``-1`` if it is no local candidate
    entity_column: torch.Tensor
    #: shape: ``[E]``, bool, whether each entity is a candidate (of any shard)
    is_candidate: torch.Tensor
    #: per local shard, shape ``[C_p]``: the global id of each column
    column_ids: tuple[torch.Tensor, ...]
    #: per local shard, shape ``[C_p]``: the local id of each column (None: columns are local ids)
    column_local: tuple[torch.Tensor | None, ...]

    @classmethod
    def build(
        cls,
        sharding: EntitySharding,
        local_shards: Sequence[int],
        columns: CandidateColumns,
        device: torch.device,
    ) -> DeviceTables:
        """Build the id tables on the host and copy them to ``device``.

        :param sharding: the entity sharding
        :param local_shards: the shards processed here, in the order of their positions
        :param columns: the columns of the local shards' candidates
        :param device: the compute device
        :returns: the tables on ``device``
        """
        num_entities = sharding.num_entities
        position = torch.full((num_entities,), -1, dtype=torch.long)
        column = torch.full((num_entities,), -1, dtype=torch.long)
        column_ids = []
        for index, shard in enumerate(local_shards):
            count = int(sharding.shard_counts[shard])
            entities = sharding.shard_entities[shard, :count]
            position[entities] = index
            local = columns.candidate_local[index]
            ids = entities if local is None else entities[local]
            column[ids] = torch.arange(ids.shape[0])
            column_ids.append(ids.to(device))
        is_candidate = (
            torch.ones(num_entities, dtype=torch.bool) if columns.candidate_mask is None else columns.candidate_mask
        )
        return cls(
            entity_position=position.to(device),
            entity_local=sharding.entity_local.to(device),
            entity_column=column.to(device),
            is_candidate=is_candidate.to(device),
            column_ids=tuple(column_ids),
            column_local=tuple(None if local is None else local.to(device) for local in columns.candidate_local),
        )


class ScoringLayouts:
    """The id layouts of a scoring, kept for the next one: entity sharding, candidate columns, device id tables.

    An evaluator that ranks the same model again (early stopping's checks) needs the same layouts each
    time: they depend on the number of entities, the shards, the candidates and the device, not on the
    model's values. Built anew they cost a few dozen small host operations (a random permutation of the
    entities, scatters into id maps) and host-to-device copies per evaluation. Only the most recent
    layout of each kind is kept, and none for restricted candidates (``restrict_entities_to``).
    """

    def __init__(self) -> None:
        """Start empty."""
        self._sharding: tuple[tuple[int, int, int], EntitySharding] | None = None
        self._columns: tuple[tuple, CandidateColumns] | None = None
        self._tables: tuple[tuple, DeviceTables] | None = None

    def sharding(self, num_entities: int, num_shards: int, seed: int) -> EntitySharding:
        """Return ``EntitySharding.create(num_entities, num_shards, seed=seed)``, created once."""
        key = (num_entities, num_shards, seed)
        if self._sharding is None or self._sharding[0] != key:
            self._sharding = key, EntitySharding.create(num_entities, num_shards, seed=seed)
        return self._sharding[1]

    def columns(
        self,
        sharding: EntitySharding,
        local_shards: Sequence[int],
        restrict_entities_to: torch.Tensor | None,
        order_by_id: bool,
    ) -> CandidateColumns:
        """Return :meth:`CandidateColumns.create`'s columns, created once per sharding object and arguments."""
        if restrict_entities_to is not None:
            return CandidateColumns.create(sharding, local_shards, restrict_entities_to, order_by_id)
        # the sharding object itself is part of the key (held, so that its identity is not reused)
        key = (sharding, tuple(local_shards), order_by_id)
        if self._columns is None or not _same_key(self._columns[0], key):
            self._columns = key, CandidateColumns.create(sharding, local_shards, None, order_by_id)
        return self._columns[1]

    def tables(
        self, sharding: EntitySharding, local_shards: Sequence[int], columns: CandidateColumns, device: torch.device
    ) -> DeviceTables:
        """Return :meth:`DeviceTables.build`'s tables, built once per columns object and device."""
        key = (sharding, tuple(local_shards), columns, device)
        if self._tables is None or not _same_key(self._tables[0], key):
            self._tables = key, DeviceTables.build(sharding, local_shards, columns, device)
        return self._tables[1]


def _same_key(kept: tuple, key: tuple) -> bool:
    """Whether two keys are equal, their objects (sharding, columns) compared by identity."""
    return len(kept) == len(key) and all(
        a is b if isinstance(a, (EntitySharding, CandidateColumns)) else a == b for a, b in zip(kept, key)
    )
