"""Entity rows for scoring: the (normalized) representations of a process' shards, addressed by local id.

:class:`ShardTableRows` reads a model's :class:`~pykeen_bess.representation.ShardedEmbedding`
tables directly (a slice of local ids is a view); :class:`ForwardRows` reads any PyKEEN
representation through its ``forward`` on the global ids of a (virtual) sharding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from ..representation import ShardedEmbedding
from ..sharding import EntitySharding

__all__ = [
    "EntityRows",
    "ForwardRows",
    "ShardTableRows",
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
        result = []
        for table in self.tables:
            weight = table.weight.detach()
            if not table.storage.is_parameter:  # host memory or files: read the rows to the compute device
                if isinstance(local, slice):
                    stored = table.read_rows(slice(offset + local.start, offset + local.stop))
                else:
                    stored = table.read_rows(local.cpu() + offset)
            elif isinstance(local, slice):
                stored = weight[offset + local.start : offset + local.stop]
            else:
                stored = weight.index_select(0, local.to(weight.device) + offset)
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

    def rows(self, position: int, local: slice | torch.Tensor) -> list[torch.Tensor]:  # noqa: D102
        shard = self.local_shards[position]
        ids = self.sharding.shard_entities[shard, local]
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
