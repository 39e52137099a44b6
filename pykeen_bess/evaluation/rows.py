"""Entity rows for scoring: the (normalized) representations of a process' shards, addressed by local id.

:class:`ShardTableRows` reads a model's :class:`~pykeen_bess.tables.representation.ShardedEmbedding`
tables directly (a slice of local ids is a view); :class:`ForwardRows` reads any PyKEEN
representation through its ``forward`` on the global ids of a (virtual) sharding.

Local ids may be a ``slice`` or a long tensor on the compute device; rows of parameters are then
read on the device without any host synchronisation (:class:`ForwardRows` keeps a copy of the
shard tables' global ids on each device it is asked for). Only tables held in host memory or files
(:class:`ShardTableRows` over a non-parameter storage) read their rows through the host, which
waits for the device's ids.

:func:`gather_entities` reads the rows of arbitrary entities by global id: the shard that owns an
entity contributes its row, the others zeros, and the topology sums them. In one process all
shards are local and the sum is a copy; under a process group each rank holds one shard of the
tables and the same code is correct.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..tables.representation import ShardedEmbedding
from ..data.sharding import EntitySharding

if TYPE_CHECKING:
    from ..distributed import Topology
    from .candidates import DeviceTables

__all__ = [
    "EntityRows",
    "ForwardRows",
    "ShardTableRows",
    "gather_entities",
    "module_device",
]


class EntityRows(ABC):
    """The (normalized) entity representations of the local shards, addressed by local id."""

    #: the entity sharding
    sharding: EntitySharding
    #: the shards held here, in the order of the ``position`` argument
    local_shards: tuple[int, ...]

    @abstractmethod
    def rows(self, position: int, local: slice | torch.Tensor) -> list[torch.Tensor]:
        """Return the representations of entities of one local shard.

        :param position: the position of the shard in :attr:`local_shards`
        :param local: the local ids, a ``slice`` or a long tensor of shape ``[k]`` (real entities only)
        :returns: one tensor of shape ``[k, *shape]`` per entity representation of the model, as
            the representation's ``forward`` would return it in evaluation mode
        """

    @abstractmethod
    def rows_of(self, entities: torch.Tensor, position: torch.Tensor, local: torch.Tensor) -> list[torch.Tensor]:
        """Return the representations of entities that are all held in local shards, in one read.

        :param entities: shape: ``[B]``, their global ids
        :param position: shape: ``[B]``, the position of each entity's shard in :attr:`local_shards` (none ``-1``)
        :param local: shape: ``[B]``, each entity's local id in its shard
        :returns: one tensor of shape ``[B, *shape]`` per entity representation, as :meth:`rows` returns them
        """


class ShardTableRows(EntityRows):
    """Rows read directly from a model's :class:`ShardedEmbedding` tables (no full-table copy).

    A slice of local ids is a view of the table (for a table in host memory or files, the slice is
    read to the compute device, so candidates stream slice by slice); the representation's
    normalizer is applied as :meth:`pykeen.nn.representation.Representation.forward` would.
    """

    def __init__(self, tables: Sequence[ShardedEmbedding]):
        """Wrap the shard tables (all with the same sharding and local shards)."""
        self.tables = list(tables)
        first = self.tables[0]
        for table in self.tables[1:]:
            if table.sharding is not first.sharding or table.local_shards != first.local_shards:
                raise ValueError("All entity shard tables of a model must share the sharding and the local shards.")
        self.sharding = first.sharding
        self.local_shards = first.local_shards

    def rows(self, position: int, local: slice | torch.Tensor) -> list[torch.Tensor]:  # noqa: D102
        offset = position * self.sharding.shard_size
        # a view of a parameter on the device, or rows read from host memory or files to the compute device
        return self._read(
            slice(offset + local.start, offset + local.stop) if isinstance(local, slice) else local + offset
        )

    def rows_of(  # noqa: D102
        self, entities: torch.Tensor, position: torch.Tensor, local: torch.Tensor
    ) -> list[torch.Tensor]:
        return self._read(position * self.sharding.shard_size + local)  # the local shards lie one after another

    def _read(self, flat: slice | torch.Tensor) -> list[torch.Tensor]:
        """Return the rows at flat indices of the local shards' tables (normalized)."""
        result = []
        for table in self.tables:
            stored = table.storage.lookup_rows(table.weight.detach(), flat)
            x = table.view_rows(stored)
            if table.normalizer is not None:
                x = table.normalizer(x)
            result.append(x)
        return result


class ForwardRows(EntityRows):
    """Rows of any PyKEEN representation, via its ``forward`` on the global ids of a virtual sharding."""

    def __init__(
        self, representations: Sequence[torch.nn.Module], sharding: EntitySharding, local_shards: Sequence[int]
    ):
        """Wrap the model's entity representations.

        :param representations: the model's entity representations (all entities addressable)
        :param sharding: the (virtual) sharding that splits the entities into shards
        :param local_shards: the shards processed here
        """
        self.representations = list(representations)
        self.sharding = sharding
        self.local_shards = tuple(int(s) for s in local_shards)
        #: shape: ``[n_shard, shard_size]``, the sharding's global ids per device (``-1`` padding clamped to 0)
        self._shard_entities: dict[torch.device, torch.Tensor] = {}

    def shard_entities(self, device: torch.device) -> torch.Tensor:
        """Return the global id of every ``(shard, local id)`` on ``device``, shape ``[n_shard, shard_size]``.

        Padding rows (``-1`` in the sharding) read entity 0: callers discard them.
        """
        table = self._shard_entities.get(device)
        if table is None:
            table = self._shard_entities[device] = self.sharding.shard_entities.clamp_min(0).to(device)
        return table

    def rows(self, position: int, local: slice | torch.Tensor) -> list[torch.Tensor]:  # noqa: D102
        shard = self.local_shards[position]
        if isinstance(local, slice):  # the ids of a slice on the representations' device: no copy per block
            home = next((d for d in map(module_device, self.representations) if d is not None), torch.device("cpu"))
            ids = self.shard_entities(home)[shard, local]
        else:
            ids = self.shard_entities(local.device)[shard, local]
        return self._forward(ids)

    def rows_of(  # noqa: D102
        self, entities: torch.Tensor, position: torch.Tensor, local: torch.Tensor
    ) -> list[torch.Tensor]:
        return self._forward(entities)  # every entity is addressable by its global id

    def _forward(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Return the representations of global ids (through each representation's ``forward``)."""
        result = []
        for representation in self.representations:
            device = module_device(representation)
            result.append(representation(indices=ids.to(device) if device is not None else ids))
        return result


def module_device(module: torch.nn.Module) -> torch.device | None:
    """Return the device of a module's first parameter or buffer (None if it has neither)."""
    for parameter in module.parameters():
        return parameter.device
    for buffer in module.buffers():
        return buffer.device
    return None


def gather_entities(
    rows: EntityRows, tables: DeviceTables, entities: torch.Tensor, topology: Topology
) -> list[torch.Tensor]:
    """Return the representations of arbitrary entities, contributed by the shards that own them.

    Each local shard reads the rows of all ``B`` entities (entity 0 of the shard standing in for
    those it does not own) and keeps those it owns (``torch.where``), so that the shapes do not
    depend on the ids and the host never waits for the device; the topology sums over
    processes: every process obtains all rows while holding only its shards. A process that holds
    every shard reads the ``B`` rows at once (:meth:`EntityRows.rows_of`).

    :param rows: the entity rows of the local shards
    :param tables: the id tables on the device of ``entities`` (which local shard and local id holds each entity)
    :param entities: shape: ``[B]``, global ids (on the compute device)
    :param topology: the topology to sum with (its local shards are those of ``rows``)
    :returns: one tensor of shape ``[B, *shape]`` per entity representation
    """
    local = tables.entity_local[entities]
    if topology.holds_all_shards:  # every entity is in a local shard: one read (the sum below is a copy)
        result = rows.rows_of(entities, tables.entity_position[entities], local)
    else:
        position = tables.entity_position[entities]
        parts: list[torch.Tensor] | None = None
        for index in range(len(rows.local_shards)):
            owned = position == index
            values = rows.rows(index, torch.where(owned, local, 0))
            if parts is None:
                parts = [torch.zeros_like(v) for v in values]
            parts = [
                torch.where(owned.view(-1, *([1] * (v.ndim - 1))).to(v.device), v, p) for v, p in zip(values, parts)
            ]
        assert parts is not None
        result = parts
    return [topology.shard_all_reduce(x) for x in result]
