"""The table partitions as strategies: what each answers the assembly of a run."""

from __future__ import annotations

import pytest

from pykeen_bess.distributed import LocalTopology
from pykeen_bess.storage import DeviceStorage, HostStorage
from pykeen_bess.training.checkpoints.stores import RankCheckpointStore
from pykeen_bess.training.setup.config import PARTITIONS
from pykeen_bess.training.setup.partitions import EncodingPartition, TokenPartition, partition_resolver
from pykeen_bess.tables.shard_tables import LocalShardTables, StoredShardTables


def test_partitions_resolve_by_name() -> None:
    assert PARTITIONS == ("token", "encoding")
    # the configuration names the partitions without importing their strategies (which import the stores)
    assert PARTITIONS == tuple(cls.name for cls in partition_resolver)
    assert isinstance(partition_resolver.make("token"), TokenPartition)
    assert isinstance(partition_resolver.make("encoding"), EncodingPartition)


@pytest.mark.parametrize("partition", [TokenPartition(), EncodingPartition()], ids=["token", "encoding"])
def test_in_one_process_both_partitions_use_the_row_back_ends(partition) -> None:
    topology = LocalTopology(4, n_column=4) if isinstance(partition, EncodingPartition) else LocalTopology(4)
    assert topology.holds_all_columns
    assert partition.tables_kind(topology, DeviceStorage()) is LocalShardTables
    assert partition.tables_kind(topology, HostStorage()) is StoredShardTables
    tables = object.__new__(LocalShardTables)  # row tables: the token partition's files of their shards
    store = partition.rank_checkpoint_store(None, tables, all_replicas=True)
    assert type(store) is RankCheckpointStore and store.all_replicas


def test_the_encoding_partition_says_what_it_cannot_do() -> None:
    topology = LocalTopology(1, n_column=2)
    assert EncodingPartition().checkpoint_obstacle(topology, "pbg") is not None
    assert EncodingPartition().checkpoint_obstacle(topology, "pykeen") is None
    assert TokenPartition().checkpoint_obstacle(topology, "pbg") is None
    assert EncodingPartition().describe(topology) == "2 column parts of every row, "
    assert TokenPartition().describe(topology) == ""
    assert TokenPartition().exchange(None, None) is None  # the configuration's default
