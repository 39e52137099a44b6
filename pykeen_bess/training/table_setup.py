"""Choosing and creating the shard tables' back end (:mod:`~pykeen_bess.training.tables`) for a run."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from pykeen.models import ERModel
from pykeen.nn.representation import Embedding

from ..distributed import Topology
from ..sharding import EntitySharding
from ..storage import TableStorage
from .column_tables import ColumnShardTables
from .plan import MemoryPlan
from .tables import DistributedShardTables, LocalShardTables, ShardTables, StoredShardTables

__all__ = ["create_tables", "shard_tables_kind"]

logger = logging.getLogger(__name__)


def shard_tables_kind(topology: Topology, storage: TableStorage | None) -> type[ShardTables]:
    """Choose the back end by what this process holds and where the tables live (see :mod:`.tables`)."""
    if not topology.holds_all_columns:
        return ColumnShardTables
    if not topology.holds_all_shards:
        return DistributedShardTables
    if storage is not None and not storage.copies_back_after_training:
        return StoredShardTables
    return LocalShardTables


def create_tables(
    model: ERModel,
    embeddings: Sequence[Embedding],
    sharding: EntitySharding,
    topology: Topology,
    seed: int,
    optimizer: torch.optim.Optimizer,
    storage: TableStorage,
) -> tuple[ShardTables, MemoryPlan]:
    """Plan the shard tables, check that the storage tier can hold them, then create them.

    :returns: the tables and the memory plan (bytes per entity, tables and optimizer state)
    :raises MemoryError: with advice, if the tier cannot hold the tables and their optimizer state
    """
    plan = MemoryPlan.create(embeddings, topology.n_local * sharding.shard_size, optimizer)
    logger.info("BESS storage %s: %s", storage.describe(), plan.describe())
    storage.compute_device = embeddings[0]._embeddings.weight.device
    try:
        storage.check_capacity(plan.table_bytes + plan.state_bytes)
    except MemoryError as error:
        raise MemoryError(f"{error} (optimizer: {type(optimizer).__name__}; {plan.describe()})") from None
    kind = shard_tables_kind(topology, storage)
    return kind(model, embeddings, sharding, topology, seed, storage), plan
