"""The arguments a BESS training loop is built from: :class:`LoopSettings`.

The loop keeps its constructor's arguments (checked) as :class:`LoopSettings`; the set-up of a
partition (:func:`~pykeen_bess.training.setup.assembly.assemble`) is built from them, and again
when ``exchange="auto"`` chooses another partition or a resumed checkpoint brings its seed
(``dataclasses.replace``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pykeen.models import ERModel
from pykeen.nn.representation import Embedding
from pykeen.triples import CoreTriplesFactory

from ...data.sampling import DEFAULT_NEGATIVES, BessSampler, Corruption
from ...data.sharding import ShardingStrategy
from ...distributed import ProcessGroupHint
from ...pbg.schema import GraphSchema
from ...schemes import ExchangeScheme
from ...storage import TableStorage

__all__ = ["LoopSettings"]


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
