"""What a BESS training loop builds from its arguments for a partition: :class:`TrainingSetup`.

The loop keeps the constructor's arguments as :class:`~pykeen_bess.training.setup.arguments.LoopSettings`;
:func:`~pykeen_bess.training.setup.assembly.assemble` turns them into a :class:`TrainingSetup` for a
partition: the process topology, the validated configuration, the entity sharding, the shard
tables and their memory plan, the scorer, the checkpoint store and the step sizes. The setup is
immutable: choosing another partition (``exchange="auto"``) or adopting a checkpoint's seed builds
a new one, and a new number of negatives per step replaces its configuration.
"""

from __future__ import annotations

import dataclasses

from ...distributed import Topology
from ...scoring import SharedCandidateScorer
from ...data.sharding import EntitySharding
from ..checkpoints.stores import CheckpointStore
from .config import BessConfig
from .partitions import TablePartition
from ...tables.memory_plan import MemoryPlan
from .sizes import StepSizes
from ...tables.shard_tables import ShardTables

__all__ = ["TrainingSetup"]


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
