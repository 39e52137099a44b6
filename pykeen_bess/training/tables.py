"""The model's entity embeddings as shard tables while BESS trains.

:class:`ShardTables` creates one :class:`~pykeen_bess.representation.ShardedEmbedding` per entity
embedding of the model and swaps them in for training (:meth:`ShardTables.installed`, a context
manager). What happens afterwards is the one thing that differs between the back ends, chosen once:

* :class:`LocalShardTables` (one process holds every shard): the tables are written back into the
  original embeddings, so the trained model is an ordinary PyKEEN model;
* :class:`DistributedShardTables` (each process holds some shards): no process holds the full
  table, so the model stays sharded (see :mod:`pykeen_bess.distributed.export`).

While the tables are installed they own the weights; the full original tables are released once
the shard tables hold valid weights (an error before that loses nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import cast

import torch
from pykeen.models import ERModel
from pykeen.nn.representation import Embedding

from ..distributed import Topology
from ..representation import ShardedEmbedding
from ..sharding import EntitySharding

__all__ = [
    "DistributedShardTables",
    "LocalShardTables",
    "ShardTables",
]


class ShardTables:
    """The shard tables of a model's entity embeddings, and their installation in the model."""

    def __init__(
        self,
        model: ERModel,
        embeddings: Sequence[Embedding],
        sharding: EntitySharding,
        topology: Topology,
        seed: int,
    ):
        """Create (uninitialised) shard tables for the embeddings.

        :param model: the model whose ``entity_representations`` are the embeddings
        :param embeddings: the model's entity embeddings
        :param sharding: the entity sharding
        :param topology: the process topology (its local shards are held here)
        :param seed: the run's seed (initial values)
        """
        self.model = model
        self.embeddings = list(embeddings)
        self.tables = [
            ShardedEmbedding(embedding, sharding, topology.local_shards, seed=seed, table_index=index)
            for index, embedding in enumerate(self.embeddings)
        ]
        for table in self.tables:
            table.topology = topology
        self.topology = topology
        self.sharding = sharding
        self.is_installed = False
        self.hold_weights = False

    @classmethod
    def create(
        cls,
        model: ERModel,
        embeddings: Sequence[Embedding],
        sharding: EntitySharding,
        topology: Topology,
        seed: int,
    ) -> ShardTables:
        """Choose the back end by whether this process holds every shard."""
        kind = LocalShardTables if topology.holds_all_shards else DistributedShardTables
        return kind(model, embeddings, sharding, topology, seed)

    def __iter__(self) -> Iterator[ShardedEmbedding]:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self.tables)

    def __getitem__(self, index: int) -> ShardedEmbedding:
        return self.tables[index]

    def weights(self) -> list[torch.nn.Parameter]:
        """Return the tables' parameters."""
        return [table.weight for table in self.tables]

    def replicated_parameters(self) -> list[torch.nn.Parameter]:
        """Return the model's trainable parameters that are not entity tables (replicated on every process)."""
        excluded = {id(embedding._embeddings.weight) for embedding in self.embeddings}
        excluded.update(id(table.weight) for table in self.tables)
        return [p for p in self.model.parameters() if p.requires_grad and id(p) not in excluded]

    @contextlib.contextmanager
    def installed(self, copy_weights: bool) -> Iterator[ShardTables]:
        """Swap the model's entity embeddings for the shard tables while the block runs.

        :param copy_weights: copy the embeddings' weights into the tables (continued training);
            if False the tables are initialised or loaded later, and the original weights are kept
            until then (see :meth:`now_hold_weights`)
        :yields: these tables
        """
        self.install(copy_weights)
        try:
            yield self
        finally:
            self.uninstall()

    def install(self, copy_weights: bool) -> None:
        """Swap the model's entity embeddings for the shard tables (idempotent)."""
        for table in self.tables:
            table.defer_constraints = True  # the loop constrains the updated rows itself
        if self.is_installed:
            return
        representations = cast(torch.nn.ModuleList, self.model.entity_representations)
        for index, (embedding, table) in enumerate(zip(self.embeddings, self.tables)):
            table.to(embedding._embeddings.weight.device)
            representations[index] = table
        self.is_installed = True
        self.hold_weights = False
        if copy_weights:
            for embedding, table in zip(self.embeddings, self.tables):
                table.copy_from(embedding)
            self.now_hold_weights()

    def now_hold_weights(self) -> None:
        """Mark the shard tables as the weights' owner and release the full tables meanwhile."""
        if self.hold_weights:
            return
        for embedding, table in zip(self.embeddings, self.tables):
            weight = embedding._embeddings.weight
            weight.data = weight.data.new_empty(0, table.row_width)
        self.hold_weights = True

    def constrain_all(self) -> None:
        """Apply the tables' constraints to every real row (after a reset)."""
        for table in self.tables:
            table.constrain_rows(table.real_rows())

    def constrain(self, rows: torch.Tensor) -> None:
        """Apply the tables' constraints to the given flat rows (after a dense update)."""
        for table in self.tables:
            table.constrain_rows(rows)

    def uninstall(self) -> None:
        """End training: what happens to the tables depends on the back end."""
        raise NotImplementedError


class LocalShardTables(ShardTables):
    """All shards in one process: write the tables back into the model's embeddings."""

    def uninstall(self) -> None:  # noqa: D102
        if not self.is_installed:
            return
        representations = cast(torch.nn.ModuleList, self.model.entity_representations)
        for index, (embedding, table) in enumerate(zip(self.embeddings, self.tables)):
            table.defer_constraints = False
            if self.hold_weights:
                table.copy_to(embedding)
            representations[index] = embedding
        # BessEvaluator evaluates with the training's sharding by default
        setattr(self.model, "bess_sharding", dict(num_shards=self.sharding.n_shard, seed=self.sharding.seed))  # noqa: B010
        self.is_installed = False
        self.hold_weights = False


class DistributedShardTables(ShardTables):
    """Some shards per process: the model stays sharded (no process holds the full table)."""

    def uninstall(self) -> None:  # noqa: D102
        for table in self.tables:
            table.defer_constraints = False
