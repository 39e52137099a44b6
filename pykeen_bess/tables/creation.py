"""Creating the shard tables (:mod:`~pykeen_bess.tables.shard_tables`) of a run, once their tier can hold them."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from pykeen.models import ERModel
from pykeen.nn.representation import Embedding

from ..distributed import Topology
from ..data.sharding import EntitySharding
from ..storage import TableStorage
from .memory_plan import MemoryPlan
from .shard_tables import ShardTables

__all__ = ["create_tables"]

logger = logging.getLogger(__name__)


def create_tables(
    model: ERModel,
    embeddings: Sequence[Embedding],
    sharding: EntitySharding,
    topology: Topology,
    seed: int,
    optimizer: torch.optim.Optimizer,
    storage: TableStorage,
    kind: type[ShardTables],
) -> tuple[ShardTables, MemoryPlan]:
    """Plan the shard tables, check that the storage tier can hold them, then create them.

    :param kind: the tables' back end (chosen by the partition, see :mod:`~pykeen_bess.training.setup.partitions`)
    :returns: the tables and the memory plan (bytes per entity, tables and optimizer state)
    :raises MemoryError: with advice, if the tier cannot hold the tables and their optimizer state
    """
    plan = MemoryPlan.create(embeddings, topology.n_local * sharding.shard_size, optimizer)
    logger.info("BESS storage %s: %s", storage.describe(), plan.describe())
    try:
        storage.check_capacity(plan.table_bytes + plan.state_bytes, embeddings[0]._embeddings.weight.device)
    except MemoryError as error:
        raise MemoryError(f"{error} (optimizer: {type(optimizer).__name__}; {plan.describe()})") from None
    return kind(model, embeddings, sharding, topology, seed, storage), plan
