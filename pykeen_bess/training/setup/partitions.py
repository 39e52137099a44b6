"""How the entity tables are split over the ``n`` parts: the token (rows) and the encoding (columns) partition.

A :class:`TablePartition` is a strategy, resolved from ``partition=`` by :data:`partition_resolver`:

* :class:`TokenPartition` (``"token"``, the default): BESS's row shards; a process holds the rows of
  its shards (:class:`~pykeen_bess.tables.shard_tables.ShardTables`), the token schemes exchange rows or scores.
* :class:`EncodingPartition` (``"encoding"``): every part holds ``d / n`` coordinates of all entities
  (:mod:`pykeen_bess.tables.encoding`); over several processes each holds one column part of every row
  (:class:`~pykeen_bess.tables.column_tables.ColumnShardTables`, with replicas: ``R`` ranks per
  part); its checkpoints are the token partition's files of the row shards the parts make.

The assembly of a run (:func:`~pykeen_bess.training.setup.assembly.assemble`) asks the partition to build
its part (:meth:`TablePartition.build`: the exchange scheme checked against the model, the topology and
the tables' back end), to check the negative sampler and to make the checkpoint store
(:meth:`TablePartition.checkpoint_store`). A new partition is one new class here.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from class_resolver import ClassResolver
from pykeen.models import ERModel

from ...data.sharding import EntitySharding
from ...distributed import Topology, make_topology
from ...pbg.graph import TypedGraph
from ...tables.encoding import ColumnSplit, check_encoding_model
from ...data.sampling import TypedBessSampler
from ...schemes import AUTO, EncodingScheme
from ...storage import TableStorage
from ..checkpoints.checkpointed import CheckpointedLoop
from ..checkpoints.pbg import PbgCheckpointStore
from ..checkpoints.stores import (
    CHECKPOINT_FORMATS,
    CHECKPOINT_RETRIEVALS,
    CheckpointStore,
    FileCheckpointStore,
    RankCheckpointStore,
    RowShardCheckpointStore,
)
from .arguments import LoopSettings
from ...tables.column_tables import ColumnShardTables
from ...tables.shard_tables import DistributedShardTables, LocalShardTables, ShardTables, StoredShardTables

__all__ = ["EncodingPartition", "PartitionPart", "TablePartition", "TokenPartition", "partition_resolver"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PartitionPart:
    """What a partition builds of a run's set-up before the tables exist (:meth:`TablePartition.build`)."""

    #: the exchange scheme to build (a name, a class, ``"auto"``, or None for the configuration's default)
    exchange: Any
    #: the processes of the run
    topology: Topology
    #: the tables' back end
    tables_kind: type[ShardTables]
    #: the split, for the set-up's log line (empty for rows)
    description: str


class TablePartition(ABC):
    """How the entity tables are split over the parts of a run."""

    #: the partition's name (``partition="token"``)
    name: ClassVar[str]

    def build(self, settings: LoopSettings) -> PartitionPart:
        """Build this partition's part of a run: the exchange scheme (checked against the model), topology, back end.

        :raises ValueError: for a model the partition cannot split, settings that do not fit the processes,
            or more shards than entities
        """
        model = settings.model
        exchange = self.exchange(model, settings.exchange)
        self.check_model(model, exchange)
        shards = settings.num_shards
        if isinstance(shards, int) and not isinstance(shards, bool) and shards > model.num_entities:
            raise ValueError(  # (before a topology of that many shards is laid out)
                f"num_shards={shards} is larger than the number of entities ({model.num_entities})."
            )
        topology = self.topology(settings)
        if topology.n_shard > model.num_entities:
            raise ValueError(
                f"num_shards={topology.n_shard} is larger than the number of entities ({model.num_entities})."
            )
        return PartitionPart(exchange, topology, self.tables_kind(topology, settings.storage), self.describe(topology))

    def checkpoint_store(
        self,
        checkpointed: CheckpointedLoop,
        settings: LoopSettings,
        topology: Topology,
        sharding: EntitySharding,
        tables: ShardTables,
    ) -> CheckpointStore:
        """Return the loop's checkpoint store: by the layout, and by whether one process holds every shard.

        :raises ValueError: for an unknown layout or retrieval mode, or a layout the run cannot write
        """
        if settings.checkpoint_retrieval not in CHECKPOINT_RETRIEVALS:
            raise ValueError(
                f"Unknown checkpoint_retrieval={settings.checkpoint_retrieval!r}; "
                f"expected one of {CHECKPOINT_RETRIEVALS}."
            )
        if settings.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"Unknown checkpoint_format={settings.checkpoint_format!r}; expected one of {CHECKPOINT_FORMATS}."
            )
        all_replicas = settings.checkpoint_retrieval == "all_replicas"
        obstacle = self.checkpoint_obstacle(topology, settings.checkpoint_format)
        if obstacle is not None:
            raise ValueError(obstacle)
        if settings.checkpoint_format == "pbg":
            if settings.storage.keeps_files:
                raise ValueError("checkpoint_format='pbg' supports storage='device' and 'host' (not 'mmap' yet).")
            schema = settings.schema
            if schema is None:
                if topology.n_shard > 1:
                    raise ValueError(
                        f"checkpoint_format='pbg' writes shard k as partition k of every entity type; the training "
                        f"triples have no partitions. Build a typed graph with {topology.n_shard} partitions: "
                        f"pykeen_bess.pbg.TypedGraph.from_factories(training, ..., num_partitions={topology.n_shard})."
                    )
                schema = TypedGraph.from_factories(settings.factory).schema
            return PbgCheckpointStore(
                checkpointed, schema, settings.factory, topology, sharding, all_replicas=all_replicas
            )
        if topology.is_distributed:
            return self.rank_checkpoint_store(checkpointed, tables, all_replicas)
        return FileCheckpointStore(checkpointed)

    @abstractmethod
    def exchange(self, model: ERModel, exchange: Any) -> Any:
        """Return the exchange scheme to build (a name, a class, ``"auto"`` or None for the configuration's default)."""

    def check_model(self, model: ERModel, exchange: Any) -> None:  # noqa: B027
        """Raise :class:`ValueError` if the partition cannot split the model's tables for this exchange."""

    @abstractmethod
    def topology(self, settings: LoopSettings) -> Topology:
        """Return the process topology of the run's settings."""

    def check_sampler(self, sampler: type, negatives: Any) -> None:  # noqa: B027
        """Raise :class:`ValueError` for a negative sampler the partition cannot train with."""

    def tables_kind(self, topology: Topology, storage: TableStorage | None) -> type[ShardTables]:
        """Return the tables' back end: by what this process holds and where the tables live."""
        if not topology.holds_all_shards:
            return DistributedShardTables
        if storage is not None and not storage.copies_back_after_training:
            return StoredShardTables
        return LocalShardTables

    def checkpoint_obstacle(self, topology: Topology, checkpoint_format: str) -> str | None:
        """Why this run cannot write checkpoints of ``checkpoint_format`` (None: it can)."""
        return None

    def rank_checkpoint_store(self, loop: CheckpointedLoop, tables: ShardTables, all_replicas: bool) -> CheckpointStore:
        """Return the checkpoint store of a run over processes: the token partition's files of its row shards."""
        return RankCheckpointStore(loop, all_replicas=all_replicas)

    def describe(self, topology: Topology) -> str:
        """Describe the split for logs (empty for rows)."""
        return ""


class TokenPartition(TablePartition):
    """Row shards: a process holds the rows of its shards (BESS's partition, the default)."""

    name = "token"

    def exchange(self, model: ERModel, exchange: Any) -> Any:  # noqa: D102
        return exchange

    def topology(self, settings: LoopSettings) -> Topology:
        """Return the topology of row shards (the ranks' shards and replicas are logged on the main process)."""
        topology = make_topology(
            num_shards=settings.num_shards,
            process_group=settings.process_group,
            replicas=settings.replicas,
            replica_grouping=settings.replica_grouping,
        )
        layout = getattr(topology, "layout", None)
        if layout is not None and topology.is_main_process:
            logger.info("BESS ranks:\n%s", layout.describe())
        return topology


class EncodingPartition(TablePartition):
    """Column parts: every part holds ``d / n`` coordinates of all entities (partial scores, or whole rows)."""

    name = "encoding"

    def exchange(self, model: ERModel, exchange: Any) -> Any:
        """Partial scores where the interaction is separable, else whole rows (when no scheme is given)."""
        if exchange is None:
            return "encoding" if EncodingScheme.applies(model) else "encoding_lookup"
        return exchange

    def check_model(self, model: ERModel, exchange: Any) -> None:  # noqa: D102
        partial_scores = exchange == AUTO and EncodingScheme.applies(model) or exchange in ("encoding", EncodingScheme)
        check_encoding_model(model, partial_scores=partial_scores)

    def topology(self, settings: LoopSettings) -> Topology:  # noqa: D102
        topology = make_topology(
            num_shards=settings.num_shards,
            process_group=settings.process_group,
            replicas=settings.replicas,
            replica_grouping=settings.replica_grouping,
            columns=True,
        )
        # at most one part per coordinate
        ColumnSplit(check_encoding_model(settings.model, partial_scores=False), topology.n_column)
        return topology

    def check_sampler(self, sampler: type, negatives: Any) -> None:  # noqa: D102
        if issubclass(sampler, TypedBessSampler):
            raise ValueError(
                f"negatives={negatives!r} needs partition='token' (the encoding partition draws uniform negatives)."
            )

    def tables_kind(self, topology: Topology, storage: TableStorage | None) -> type[ShardTables]:
        """Column parts over processes; in one process the token partition's back ends."""
        if not topology.holds_all_columns:
            return ColumnShardTables
        return super().tables_kind(topology, storage)

    def checkpoint_obstacle(self, topology: Topology, checkpoint_format: str) -> str | None:  # noqa: D102
        if checkpoint_format == "pbg":
            return "checkpoint_format='pbg' writes row shards as partitions; it needs partition='token'."
        return None

    def rank_checkpoint_store(self, loop: CheckpointedLoop, tables: ShardTables, all_replicas: bool) -> CheckpointStore:
        """Return the store of the row shards the column parts make (the token partition's files)."""
        if isinstance(tables, ColumnShardTables):
            return RowShardCheckpointStore(loop, tables, all_replicas=all_replicas)
        return super().rank_checkpoint_store(loop, tables, all_replicas)

    def describe(self, topology: Topology) -> str:  # noqa: D102
        return f"{topology.n_column} column parts of every row, "


#: resolves ``partition=`` names (``"token"``, ``"encoding"``) and classes
partition_resolver: ClassResolver[TablePartition] = ClassResolver(
    [TokenPartition, EncodingPartition],
    base=TablePartition,  # type: ignore[type-abstract]
    suffix="Partition",
)
