"""The model's entity embeddings as shard tables while BESS trains.

:class:`ShardTables` creates one :class:`~pykeen_bess.tables.representation.ShardedEmbedding` per entity
embedding of the model and swaps them in for training (:meth:`ShardTables.installed`, a context
manager). What happens afterwards is the one thing that differs between the back ends, chosen once
(:func:`~pykeen_bess.tables.creation.create_tables`):

* :class:`LocalShardTables` (one process holds every shard): the tables are written back into the
  original embeddings, so the trained model is an ordinary PyKEEN model;
* :class:`DistributedShardTables` (each process holds some shards): no process holds the full
  table, so the model stays sharded (see :mod:`pykeen_bess.distributed.export`);
* :class:`~pykeen_bess.tables.column_tables.ColumnShardTables` (each process holds a column part
  of every row, the encoding partition): after training the parts become row shards;
* :class:`StoredShardTables` (one process holds every shard, in host memory or files,
  :mod:`pykeen_bess.storage`): the tables stay in their tier and in the model, which answers
  every lookup by reading rows to its device (the full table need not fit there).

While the tables are installed they own the weights; the full original tables are released once
the shard tables hold valid weights (an error before that loses nothing). Meanwhile the model's state
dict holds the tables (shard order, padded rows): :meth:`ShardTables.pykeen_embeddings` gives the model
its own embeddings back for a while where one process holds every shard on the device (PyKEEN's
checkpoint callback saves them).
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
from collections.abc import Iterator, Sequence
from typing import cast

import torch
from pykeen.models import ERModel
from pykeen.nn.representation import Embedding

from ..distributed import Topology
from .optim import BessOptimizer
from .representation import ShardedEmbedding, constrain_all_rows
from ..data.sharding import EntitySharding
from ..storage import DeviceStorage, TableStorage

__all__ = [
    "DistributedShardTables",
    "LocalShardTables",
    "ShardTables",
    "StoredShardTables",
    "materialize",
]

logger = logging.getLogger(__name__)


def materialize(model: torch.nn.Module, storage: TableStorage, device: torch.device) -> None:
    """Give a model built on the meta device real parameters on ``device``, except its full entity tables.

    Building the model under ``with torch.device("meta"):`` keeps PyKEEN's constructor from
    allocating and initialising the full entity tables. Here the entity embeddings keep a
    ``[0, d]`` placeholder (the shard tables, allocated by the storage tier, replace them); every
    other parameter is allocated uninitialised and initialised when training starts
    (``model.reset_parameters_()``, as every fresh training does).

    :raises ValueError: for the device tier (its tables are parameters of the model), and for a
        model with buffers (their values, e.g. a regularizer's weight, were never computed on the
        meta device)
    """
    storage.check_meta_model()
    buffers = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if buffers:
        raise ValueError(
            f"The model was built on the meta device, where its buffers {buffers} have no values (e.g. a "
            f"regularizer's weight). Build it without them (e.g. regularizer=None) or on the CPU."
        )
    for embedding in getattr(model, "entity_representations", []):
        if not isinstance(embedding, Embedding):
            continue
        weight = embedding._embeddings.weight
        weight.data = torch.empty(0, weight.shape[1], dtype=weight.dtype, device="meta")
    model.to_empty(device=device)
    check_reset_initialises(model, device)
    logger.info("Materialised the meta-device model on %s (its entity tables are in storage=%r).", device, storage.name)


def check_reset_initialises(model: torch.nn.Module, device: torch.device) -> None:
    """Check that the model's reset writes every parameter (but its entity tables) of a model off the meta device.

    A value the model's constructor set without its ``reset_parameters`` (CrossE's bias: zeros) never existed on
    the meta device: the parameter would train from uninitialised memory. The parameters are filled with NaN and
    reset once as PyKEEN's ``reset_parameters_`` resets them (each module's ``reset_parameters``, innermost first;
    the entity tables are placeholders here, reset when training starts), the random state restored afterwards.

    :raises ValueError: naming the parameters the reset leaves as they were
    """
    # the entity representations: placeholders, reset when training starts (or refused, if not Embeddings)
    placeholders = {id(m) for r in getattr(model, "entity_representations", []) for m in r.modules()}
    skipped = {id(p) for r in getattr(model, "entity_representations", []) for p in r.parameters()}
    parameters = {
        name: parameter
        for name, parameter in model.named_parameters()
        if (parameter.is_floating_point() or parameter.is_complex())
        and parameter.numel() > 0
        and id(parameter) not in skipped
    }
    resets = [
        (name.count("."), module)
        for name, module in model.named_modules()
        if module is not model and id(module) not in placeholders and hasattr(module, "reset_parameters")
    ]
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for parameter in parameters.values():
            parameter.fill_(float("nan"))
        for _, module in sorted(resets, key=lambda depth_module: -depth_module[0]):
            module.reset_parameters()
    untouched = [name for name, parameter in parameters.items() if bool(torch.isnan(parameter).all())]
    if untouched:
        raise ValueError(
            f"The model was built on the meta device, and its reset does not initialise {untouched} (values its "
            f"constructor set, which the meta device never held; e.g. CrossE's bias). Build this model on the CPU "
            f"(its entity tables then start in the model, and storage='host' or 'mmap' still takes them over)."
        )


class ShardTables:
    """The shard tables of a model's entity embeddings, and their installation in the model."""

    def __init__(
        self,
        model: ERModel,
        embeddings: Sequence[Embedding],
        sharding: EntitySharding,
        topology: Topology,
        seed: int,
        storage: TableStorage | None = None,
    ):
        """Create (uninitialised) shard tables for the embeddings.

        :param model: the model whose ``entity_representations`` are the embeddings
        :param embeddings: the model's entity embeddings
        :param sharding: the entity sharding
        :param topology: the process topology (its local shards are held here)
        :param seed: the run's seed (initial values)
        :param storage: where the tables live (default: parameters on the model's device)
        """
        self.model = model
        self.embeddings = list(embeddings)
        if storage is None:
            storage = DeviceStorage()
        storage.attach(self.embeddings[0]._embeddings.weight.device)
        self.storage = storage
        suffix = self.label_suffix(topology)
        self.tables = [
            ShardedEmbedding(
                embedding,
                sharding,
                topology.local_shards,
                seed=seed,
                table_index=index,
                storage=storage,
                label_suffix=suffix,
            )
            for index, embedding in enumerate(self.embeddings)
        ]
        for table in self.tables:
            table.topology = topology
        self.topology = topology
        self.sharding = sharding
        self.is_installed = False
        self.hold_weights = False

    @staticmethod
    def label_suffix(topology: Topology) -> str:
        """Return what tells this process' tables apart from other processes' of the same shards (file names)."""
        # the replicas of a shard keep their own copies (e.g. files in a shared storage_path)
        return f".replica{topology.replica}-of{topology.replicas}" if topology.replicas > 1 else ""

    def __iter__(self) -> Iterator[ShardedEmbedding]:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self.tables)

    def __getitem__(self, index: int) -> ShardedEmbedding:
        return self.tables[index]

    def weights(self) -> list[torch.Tensor]:
        """Return the tables' weights (parameters of the model, or tensors of their storage tier)."""
        return [table.weight for table in self.tables]

    def make_optimizer(
        self, optimizer_cls: type[torch.optim.Optimizer], hyperparameters: dict, sparse_updates: bool
    ) -> BessOptimizer:
        """Build the user's optimizer for the replicated parameters, with row-sparse rules for the tables.

        :raises ValueError: for dense updates of tables outside the model
        """
        self.storage.check_updates(sparse_updates)
        return BessOptimizer(
            optimizer_cls,
            dense_params=self.replicated_parameters(),
            table_params=self.optimizer_parameters(),
            hyperparameters=hyperparameters,
            sparse_updates=sparse_updates,
            # constraints (e.g. unit norm) are applied to the updated rows within the update
            row_constraints={table.optimizer_parameter: table.constrain_values for table in self if table.constrainer},
            tables={table.optimizer_parameter: table for table in self},
        )

    def release_storage(self) -> None:
        """Give the tables' tensors and row state back to their tier (``storage="mmap"``: delete their files).

        For a loop that replaces its tables (it builds new ones); these tables are unusable afterwards.
        """
        for table in self.tables:
            table.storage.release_table(table)

    def optimizer_parameters(self) -> list[torch.nn.Parameter]:
        """Return what stands for each table in the optimizer (the parameter, or the handle of a stored table)."""
        return [table.optimizer_parameter for table in self.tables]

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
        self.storage.attach(self.embeddings[0]._embeddings.weight.device)
        for index, (embedding, table) in enumerate(zip(self.embeddings, self.tables)):
            table.to(embedding._embeddings.weight.device)
            representations[index] = table
        self.is_installed = True
        if self.hold_weights:
            return  # tables that stayed in the model after the last training kept their weights
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

    @contextlib.contextmanager
    def row_shards(
        self, optimizer: torch.optim.Optimizer | None, read: bool = True, write: bool = False
    ) -> Iterator[list[ShardedEmbedding]]:
        """While the block runs, the model holds the tables as row shards: these tables already are.

        (:class:`~pykeen_bess.tables.column_tables.ColumnShardTables` lends the model row shards
        made from its column parts; the arguments are its.)

        :yields: the tables
        """
        yield self.tables

    @property
    def keeps_files(self) -> bool:
        """Whether the tables live in files (checkpoints copy them into a directory next to the checkpoint)."""
        return self.storage.keeps_files

    def state_dict_tables(self) -> list[ShardedEmbedding]:
        """Return the tables whose entries the model's state dict may hold now (these tables)."""
        return self.tables

    @contextlib.contextmanager
    def checkpoint_files(self, directory: pathlib.Path | None) -> Iterator[None]:
        """While a checkpoint is written (read): copy table files into (read them from) ``directory``."""
        tables = self.state_dict_tables()
        for table in tables:
            table.snapshot_directory = directory
        try:
            yield
        finally:
            for table in tables:
                table.snapshot_directory = None

    @contextlib.contextmanager
    def weights_elsewhere(self) -> Iterator[None]:
        """While a checkpoint whose own files hold the tables' rows is written (read): leave the rows out of it."""
        tables = self.state_dict_tables()
        for table in tables:
            table.external_weights = True
        try:
            yield
        finally:
            for table in tables:
                table.external_weights = False

    def constrain_all(self) -> None:
        """Apply the tables' constraints to every real row (after a reset)."""
        for table in self.tables:
            constrain_all_rows(table)

    def constrain_entity_rows(self) -> None:
        """Apply the tables' constraints to every entity's row (after a dense update, as PyKEEN after every step)."""
        for table in self.tables:
            table.constrain_entity_rows()

    def uninstall(self) -> None:
        """End training: what happens to the tables depends on the back end."""
        raise NotImplementedError

    #: why the model cannot hold its own embeddings during training (:meth:`pykeen_embeddings`), or None
    pykeen_layout_obstacle: str | None = "the model keeps its shard tables"

    @contextlib.contextmanager
    def pykeen_embeddings(self) -> Iterator[None]:
        """While the block runs, the model holds its own embeddings with the tables' rows (PyKEEN's layout).

        :raises ValueError: where the back end cannot (:attr:`pykeen_layout_obstacle`)
        """
        if self.pykeen_layout_obstacle is not None:
            raise ValueError(
                f"The model cannot hold PyKEEN's embeddings during training: {self.pykeen_layout_obstacle}."
            )
        yield


class LocalShardTables(ShardTables):
    """All shards in one process: write the tables back into the model's embeddings."""

    pykeen_layout_obstacle = None

    @contextlib.contextmanager
    def pykeen_embeddings(self) -> Iterator[None]:  # noqa: D102
        if not (self.is_installed and self.hold_weights):  # the model holds its own embeddings' weights
            yield
            return
        representations = cast(torch.nn.ModuleList, self.model.entity_representations)
        for index, (embedding, table) in enumerate(zip(self.embeddings, self.tables)):
            table.copy_to(embedding)
            representations[index] = embedding
        try:
            yield
        finally:
            for index, (embedding, table) in enumerate(zip(self.embeddings, self.tables)):
                representations[index] = table
                weight = embedding._embeddings.weight
                weight.data = weight.data.new_empty(0, table.row_width)

    def uninstall(self) -> None:  # noqa: D102
        if not self.is_installed:
            return
        if self.topology.is_distributed:  # replicas of one shard: only the main process writes the model
            from ..distributed.export import guard_pipeline_results

            guard_pipeline_results()
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

    pykeen_layout_obstacle = "the tables are spread over the processes (no process holds a full table)"

    def uninstall(self) -> None:  # noqa: D102
        for table in self.tables:
            table.defer_constraints = False
        # PyKEEN's result.save_to_directory() must refuse this partial model before it writes anything
        from ..distributed.export import guard_pipeline_results

        guard_pipeline_results()


class StoredShardTables(ShardTables):
    """All shards in one process, in host memory or files: the tables stay in the model after training.

    Copying them into a plain embedding would need the full table on the model's device (or, for
    files, in memory), which is what the storage tier avoids. The model keeps the shard tables:
    every lookup (evaluation, ``predict_target``, scoring) reads the rows it needs to the model's
    device, and :class:`pykeen_bess.BessEvaluator` streams candidate slices.
    """

    pykeen_layout_obstacle = (
        "the tables live in host memory or files (a full table on the model's device is what the tier avoids)"
    )

    def uninstall(self) -> None:  # noqa: D102
        from ..distributed.export import guard_pipeline_results

        guard_pipeline_results()  # the pipeline's result saves the tables as plain embeddings
        for table in self.tables:
            table.defer_constraints = False
        setattr(self.model, "bess_sharding", dict(num_shards=self.sharding.n_shard, seed=self.sharding.seed))  # noqa: B010
        self.is_installed = False
