"""Checkpoints in PyTorch-BigGraph's layout for BESS runs (``checkpoint_format="pbg"``).

:class:`PbgCheckpointStore` writes a BESS run's checkpoints as PyTorch-BigGraph checkpoint
directories (shard ``k`` is partition ``k`` of every entity type) with the versioned protocol of
:mod:`~pykeen_bess.training.checkpoints.files`, and resumes them exactly;
:func:`prepare_pbg_checkpoint` adopts a checkpoint PyTorch-BigGraph wrote in the directory.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any, cast

import torch
from pykeen.models import ERModel
from pykeen.stoppers import Stopper
from pykeen.triples import CoreTriplesFactory

from .files import POINTER_FORMAT, pointer_shards, read_pointer, save_distributed_checkpoint, temporary_file
from .stores import RankCheckpointStore
from .checkpointed import CheckpointedLoop
from ...distributed import Topology
from ...data.sharding import EntitySharding

__all__ = [
    "PbgCheckpointStore",
    "prepare_pbg_checkpoint",
]

logger = logging.getLogger(__name__)


class PbgCheckpointStore(RankCheckpointStore):
    """PyTorch-BigGraph's checkpoint layout (``checkpoint_format="pbg"``), in the checkpoint file's directory.

    Shard ``k`` is partition ``k`` of every entity type (the graph's partitions are the shards). A
    version ``N`` is the number of completed epochs; writing it is the atomic protocol of
    :func:`~pykeen_bess.training.checkpoints.files.save_distributed_checkpoint`:

    1. every process writing its shard writes ``embeddings_{type}_{k}.v{N}.h5`` for each of its shards
       (row-wise Adagrad's state as PyTorch-BigGraph's optimizer blob) and its own resume state
       ``NAME.v{N}.rank{k}-of-{n}`` (PyKEEN's checkpoint dictionary without the rows, which are in the
       embeddings files: epoch, losses, optimizer and scheduler state, random states, stopper);
    2. once all are written, the main process writes ``model.v{N}.h5``, ``config.json`` /
       ``config.py``, the graph's entity files under ``entities/`` and then ``checkpoint_version.txt``;
    3. then the pointer ``NAME`` moves to ``N``, and only then are version ``N - 1``'s files removed.

    So PyTorch-BigGraph (``torchbiggraph_train`` resuming, ``torchbiggraph_export_to_tsv``) reads the
    directory as its own, and BESS resumes it exactly. A directory holding only PyTorch-BigGraph's
    files (a checkpoint PyTorch-BigGraph wrote) is adopted: the rows, the relations and row-wise
    Adagrad's state are read, training continues after its completed epochs (:meth:`adopt`).
    """

    def __init__(
        self,
        loop: CheckpointedLoop,
        schema: Any,
        factory: Any,
        topology: Topology,
        sharding: EntitySharding,
        all_replicas: bool = False,
    ):
        """Serve ``loop`` for a graph of schema ``schema`` (its training factory ``factory`` names the entities).

        ``topology`` and ``sharding`` are the loop's (of the setup being built) whose shards are the graph's partitions.

        :raises ValueError: if the shards are not the graph's partitions, or PyTorch-BigGraph cannot express the model
        """
        from ...pbg.conversion import conversion_for_model

        super().__init__(loop, all_replicas)
        #: the model (the loop refuses any but an ``ERModel`` before it builds a store)
        self.model = cast(ERModel, loop.model)
        self.schema = schema
        self.factory = factory
        self.conversion = conversion_for_model(self.model)
        n = topology.n_shard
        wrong = [
            f"{name}: {len(sizes)}"
            for name, sizes in zip(schema.entity_types, schema.partition_sizes)
            if len(sizes) != n
        ]
        if wrong:
            raise ValueError(
                f"checkpoint_format='pbg' writes shard k as partition k of every entity type, so every type needs "
                f"num_shards={n} partitions; the graph has {', '.join(wrong)}. Repartition it "
                f"(graph.repartition({n}), or pbg.TypedGraph.from_factories(..., num_partitions={n}))."
            )
        #: per shard: ``(type, first local row, rows)`` of each of its partitions, checked against the sharding
        self.layout: list[list[tuple[int, int, int]]] = []
        for shard in range(n):
            start, parts = 0, []
            for t in range(schema.num_types):
                ids = schema.partition_range(t, shard)
                held = sharding.shard_entities[shard, start : start + len(ids)]
                if not torch.equal(held, torch.arange(ids.start, ids.stop)):
                    raise ValueError(
                        f"checkpoint_format='pbg' writes shard k as partition k of every entity type, its entities in "
                        f"id order; the sharding holds them in another order ({n} shard(s) of a graph whose types "
                        f"have one partition are dealt randomly). Train a typed graph with num_shards > 1 partitions "
                        f"(pykeen_bess.pbg.TypedGraph.from_factories(training, ..., num_partitions=n)), or write a "
                        f"PyTorch-BigGraph checkpoint after training (pykeen_bess.pbg.write_checkpoint)."
                    )
                parts.append((t, start, len(ids)))
                start += len(ids)
            self.layout.append(parts)

    # -- writing -------------------------------------------------------------------------------

    def save(  # noqa: D102
        self,
        path: pathlib.Path,
        stopper: Stopper | None = None,
        best_epoch_model_file_path: pathlib.Path | None = None,
        triples_factory: CoreTriplesFactory | None = None,
    ) -> None:
        from ...pbg import files

        loop, topology = self.loop, self.loop.topology
        directory = pathlib.Path(path).parent
        version = int(loop._epoch)
        best = self.rank_file(pathlib.Path(best_epoch_model_file_path)) if best_epoch_model_file_path else None

        def write(file: pathlib.Path) -> None:
            with loop.tables.weights_elsewhere():
                self.write_state(file, stopper, best, triples_factory)
            if topology.replica == 0:
                self.write_partitions(directory, version)

        def remove(previous: int) -> None:
            if topology.is_main_process and 0 < previous != version:
                files.remove_version(directory, previous)

        save_distributed_checkpoint(
            pathlib.Path(path),
            topology,
            write,
            epoch=loop._epoch,
            seed=loop.config.seed,
            random_seed=loop.model._random_seed,
            stopper_dict=stopper.get_summary_dict() if stopper is not None else None,
            all_replicas=self.all_replicas,
            version=version,
            before_pointer=lambda v: self.write_model(directory, v),
            after_pointer=remove,
            sharding=loop.sharding.fingerprint,
        )

    def _row_sums(self) -> tuple[torch.Tensor, float] | None:
        """Row-wise Adagrad's per-row sums of the entity table ``[L * S]`` and its lr (None for other optimizers)."""
        from ...tables.optim import RowwiseAdagrad

        if self.loop.optimizer_cls is not RowwiseAdagrad:
            return None
        table = self.loop.tables[0]
        state = dict(self.loop.optimizer.state.get(table.optimizer_parameter, {}), **table.row_state)
        sums = state.get("sum")
        if sums is None:
            sums = torch.zeros(table.weight.shape[0])
        return sums, float(self.loop.optimizer_kwargs.get("lr", 1e-2))

    def write_partitions(self, directory: pathlib.Path, version: int) -> None:
        """Write this process' shards as PyTorch-BigGraph partitions of every type."""
        from ...pbg import files
        from ...pbg.checkpoint import rowwise_blob
        from ...pbg.conversion import entity_rows

        table = self.loop.tables[0]
        size = table.sharding.shard_size
        sums = self._row_sums()
        with torch.no_grad():
            for local, shard in enumerate(table.local_shards):
                for t, start, count in self.layout[shard]:
                    first = local * size + start
                    rows = entity_rows(table.view_rows(table.read_rows(slice(first, first + count))))
                    state = None if sums is None else rowwise_blob(sums[0][first : first + count].cpu(), sums[1])
                    path = files.embeddings_file(directory, self.schema.entity_types[t], shard, version)
                    files.write_embeddings(path, rows, state)

    def write_model(self, directory: pathlib.Path, version: int) -> None:
        """Write the relations, the config and the entity files, then commit ``version`` (main process)."""
        from ...pbg import files
        from ...pbg.checkpoint import ENTITY_DIRECTORY, checkpoint_settings, relation_parameters
        from ...pbg.config import write_config
        from ...pbg.graph import EDGE_PATH_KEY, TypedGraph
        from ...pbg.inputs import graph_config, write_entities

        files.write_model(
            files.model_file(directory, version), relation_parameters(self.model, self.schema, self.conversion)
        )
        entity_path = directory / ENTITY_DIRECTORY
        if not (entity_path / "dynamic_rel_names.json").is_file():
            entity_path.mkdir(exist_ok=True)
            write_entities(TypedGraph(schema=self.schema, training=self.factory), entity_path)
        sums = self._row_sums()
        settings = checkpoint_settings(self.model, self.conversion, sums[1] if sums is not None else None)
        settings["num_epochs"] = version
        edge_path = (self.factory.metadata or {}).get(EDGE_PATH_KEY)
        config = graph_config(
            self.schema,
            settings,
            checkpoint_path=directory,
            entity_path=entity_path,
            edge_paths=[edge_path] if edge_path else [],
        )
        write_config(config, directory)
        files.write_version(directory, version)

    # -- reading -------------------------------------------------------------------------------

    def load(self, path: pathlib.Path, triples_factory: CoreTriplesFactory | None = None) -> Any:  # noqa: D102
        path = pathlib.Path(path)
        pointer = read_pointer(path)
        if pointer is None:
            raise ValueError(f"{path} is not the pointer of a checkpoint with checkpoint_format='pbg'.")
        n = self.loop.topology.n_shard
        if pointer_shards(pointer) != n:
            raise ValueError(
                f"Checkpoint {path} holds {pointer_shards(pointer)} partitions (shards); with checkpoint_format='pbg' "
                f"shard k is partition k, so resume it with num_shards={pointer_shards(pointer)}."
            )
        if pointer.get("pbg_only"):
            return self.adopt(path.parent, int(pointer["version"]), int(pointer["epoch"]))
        written = pointer.get("processes")  # (pointers of earlier versions do not say)
        if written is not None and (int(written) > 1) != self.loop.topology.is_distributed:
            raise ValueError(
                f"Checkpoint {path} with checkpoint_format='pbg' was written by "
                f"{'one process' if int(written) == 1 else f'{written} processes'}, and this run has "
                f"{f'{self.loop.topology.world_size} processes' if self.loop.topology.is_distributed else 'one'}: its "
                "optimizer state is kept per process, so it resumes only on the layout of processes that wrote it "
                "(checkpoint_format='pykeen' checkpoints move between one process and ranks)."
            )
        self.read_partitions(path.parent, int(pointer["version"]))
        return super().load(path, triples_factory)

    def read_partitions(
        self, directory: pathlib.Path, version: int, settings: Any = None, parameters: Any = None
    ) -> list[tuple[int, torch.Tensor]]:
        """Read this process' partitions into its tables; return their row-wise Adagrad sums (if stored).

        With ``settings`` (a checkpoint PyTorch-BigGraph wrote) the rows are converted as PyTorch-BigGraph
        scores them (global embeddings, ``max_norm``).
        """
        from ...pbg import files
        from ...pbg.restore import partition_rows
        from ...pbg.conversion import rows_to_weight

        table = self.loop.tables[0]
        size = table.sharding.shard_size
        sums = []
        with torch.no_grad():
            for local, shard in enumerate(table.local_shards):
                for t, start, count in self.layout[shard]:
                    path = files.embeddings_file(directory, self.schema.entity_types[t], shard, version)
                    rows, state = files.read_embeddings(path)
                    if settings is not None:
                        rows = partition_rows(rows, self.schema, t, shard, parameters, settings, str(path))
                    elif tuple(rows.shape) != (count, table.row_width):
                        raise ValueError(
                            f"{path} has rows of shape {tuple(rows.shape)}, not ({count}, {table.row_width})."
                        )
                    first = local * size + start
                    weight = rows_to_weight(rows, table.is_complex).to(table.weight.dtype)
                    table.storage.write(
                        table.weight, torch.arange(first, first + count), weight.to(table.compute_device)
                    )
                    if state is not None:
                        sums.append((first, state["state"][0]["sum"]))
        return sums

    def adopt(self, directory: pathlib.Path, version: int, epoch: int) -> tuple[None, None]:
        """Continue from a checkpoint PyTorch-BigGraph wrote: its rows, relations and row-wise Adagrad sums.

        The other optimizer state starts fresh (PyTorch-BigGraph keeps none for BESS's optimizers).
        """
        from ...pbg import files
        from ...pbg.restore import checkpoint_conversion, relations_from_parameters, set_relations
        from ...pbg.config import load_config

        loop = self.loop
        source = str(directory)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"{directory} has no config.json: cannot tell how its checkpoint scores.")
        settings = load_config(directory / "config.json")
        conversion = checkpoint_conversion(settings, source)
        if type(conversion) is not type(self.conversion):
            raise ValueError(f"{source} holds {conversion.describe()}, but the model is {self.conversion.describe()}.")
        parameters = files.read_model(files.model_file(directory, version))
        sums = self.read_partitions(directory, version, settings, parameters)
        relation = relations_from_parameters(parameters, self.schema, settings, conversion, self.factory, source)
        set_relations(self.model, relation)
        row_sums = self._row_sums()
        if row_sums is not None and sums:
            table = loop.tables[0]
            state = table.storage.row_state(table, loop.optimizer.state[table.optimizer_parameter])
            total = torch.zeros(table.weight.shape[0], dtype=table.weight.dtype, device=table.weight.device)
            for first, values in sums:
                total[first : first + values.numel()] = values.to(total)
            if "sum" in state:
                state["sum"].copy_(total)
            else:
                state["sum"] = total
        logger.info(
            "Continuing from PyTorch-BigGraph's checkpoint %s version %d (%d completed epochs, %s%s).",
            directory,
            version,
            epoch,
            conversion.describe(),
            "; row-wise Adagrad state read" if row_sums is not None and sums else "; fresh optimizer state",
        )
        loop.resume_at(epoch, from_pbg=True)
        return None, None


def prepare_pbg_checkpoint(loop: CheckpointedLoop, train_kwargs: Mapping[str, Any]) -> None:
    """Prepare a training with ``checkpoint_format="pbg"``: refuse what it cannot hold, adopt PBG's own checkpoint.

    If the checkpoint's directory holds a checkpoint PyTorch-BigGraph wrote (``checkpoint_version.txt``) but
    no pointer of this package, or one of an older version (PyTorch-BigGraph continued the training there),
    a pointer to it is written, so that the training resumes from it (:meth:`PbgCheckpointStore.adopt`): its
    version is the number of completed iterations, ``epochs x edge paths x edge chunks`` of its config.

    :raises ValueError: for ``checkpoint_on_failure`` (a failure checkpoint would share the directory) or a
        PyTorch-BigGraph checkpoint that stopped inside an epoch
    """
    from pykeen.constants import PYKEEN_CHECKPOINTS

    from ...pbg import files
    from ...pbg.config import load_config

    if train_kwargs.get("checkpoint_on_failure"):
        raise ValueError(
            "checkpoint_format='pbg' keeps one checkpoint per directory; checkpoint_on_failure is not supported "
            "with it."
        )
    name = train_kwargs.get("checkpoint_name")
    if not name:
        return
    path = pathlib.Path(train_kwargs.get("checkpoint_directory") or PYKEEN_CHECKPOINTS) / name
    topology = loop.topology
    version = files.read_version(path.parent) if path.parent.is_dir() else 0
    pointer = read_pointer(path)
    if version == 0 or (pointer is not None and int(pointer["version"]) >= version):
        return
    if path.is_file() and pointer is None:
        raise ValueError(f"{path} is not the pointer of a checkpoint with checkpoint_format='pbg'.")
    config = path.parent / "config.json"
    iterations = 1
    if config.is_file():
        settings = load_config(config)
        iterations = max(1, len(settings["edge_paths"])) * int(settings.get("num_edge_chunks") or 1)
    if version % iterations:
        raise ValueError(
            f"PyTorch-BigGraph's checkpoint {path.parent} is at iteration {version}, inside an epoch of {iterations} "
            f"iterations (edge paths x edge chunks); BESS resumes at epoch boundaries."
        )
    if topology.is_main_process:
        pointer = dict(
            format=POINTER_FORMAT,
            version=version,
            world_size=topology.n_shard,
            replicas=topology.replicas,
            retrieval="one_per_group",
            epoch=version // iterations,
            seed=loop.config.seed,
            random_seed=loop.model._random_seed,
            stopper_dict={},
            pbg_only=True,
        )
        temporary = temporary_file(path)
        torch.save(pointer, temporary)
        os.replace(temporary, path)
        logger.info(
            "Found PyTorch-BigGraph's checkpoint %s (version %d); training continues from it.", path.parent, version
        )
    topology.barrier()
