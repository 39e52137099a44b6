"""What a BESS training loop is built from, and what it builds: :class:`LoopSettings` and :class:`TrainingSetup`.

The loop keeps the constructor's arguments as :class:`LoopSettings`;
:func:`~pykeen_bess.training.setup.assembly.assemble` turns them into a :class:`TrainingSetup` for a
partition: the process topology, the validated configuration, the entity sharding, the shard
tables and their memory plan, the scorer, the checkpoint store and the step sizes. The setup is
immutable: choosing another partition (``exchange="auto"``) or adopting a checkpoint's seed builds
a new one, and a new number of negatives per step replaces its configuration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pykeen.models import ERModel
from pykeen.nn.representation import Embedding
from pykeen.triples import CoreTriplesFactory

from ...distributed import ProcessGroupHint, Topology
from ...pbg.schema import GraphSchema
from ...data.sampling import DEFAULT_NEGATIVES, BessSampler, Corruption
from ...schemes import ExchangeScheme
from ...scoring import SharedCandidateScorer
from ...data.sharding import EntitySharding, ShardingStrategy
from ...storage import TableStorage
from ..checkpoints.stores import CheckpointStore
from .config import BessConfig
from .partitions import TablePartition
from ...tables.memory_plan import MemoryPlan
from .sizes import StepSizes
from ...tables.shard_tables import ShardTables

__all__ = ["LoopSettings", "TrainingSetup"]


@dataclasses.dataclass
class LoopSettings:
    """The constructor arguments of a loop that its partition-dependent parts are built from."""

    model: ERModel
    embeddings: Sequence[Embedding]
    storage: TableStorage
    num_shards: int | None
    process_group: ProcessGroupHint
    replicas: int | None
    replica_grouping: str | None
    exchange: str | type[ExchangeScheme] | None
    #: None: the loop chooses (``exchange="auto"`` across partitions, see :func:`~.assembly.choose_partition`)
    partition: str | None
    corruption: Corruption
    num_negs_per_pos: int | None
    seed: int | None
    sparse_updates: bool
    memory_budget: int | None
    checkpoint_retrieval: str
    #: the training triples the loop was built for (their labels name the entities of PBG checkpoints)
    factory: CoreTriplesFactory
    #: the graph schema of the training triples (entity types, partitions), if typed
    schema: GraphSchema | None = None
    #: the negative sampler (a name in :data:`~pykeen_bess.data.sampling.NEGATIVES` or a sampler class)
    negatives: str | type[BessSampler] = DEFAULT_NEGATIVES
    #: the checkpoint layout (``"pykeen"``, ``"pbg"``)
    checkpoint_format: str = "pykeen"
    #: how entities are dealt to shards (``"balanced"``, ``"random"``, a strategy; None: the default)
    sharding: str | ShardingStrategy | None = None


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
    """The parts of a BESS run for one partition, built once by :func:`~.assembly.assemble`."""

    #: how the entity tables are split over the parts (rows or columns)
    table_partition: TablePartition
    #: the processes and every collective between them
    topology: Topology
    #: the validated configuration (shards, scheme, sampler, negatives, seed, ...)
    config: BessConfig
    #: which entity lives in which shard
    sharding: EntitySharding
    #: this process' shard tables of the model's entity embeddings
    tables: ShardTables
    #: the bytes of the tables and their optimizer state, checked before allocation
    memory_plan: MemoryPlan
    #: scores a block's queries against shared candidates
    scorer: SharedCandidateScorer
    #: writes and reads the loop's checkpoints
    checkpoints: CheckpointStore
    #: the batch and sub-batch sizes (and the automatic memory search)
    sizes: StepSizes
