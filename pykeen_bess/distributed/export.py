"""Saving a model whose entity tables are sharded over processes.

After distributed training every rank holds only its shard of the entity tables. The collective
functions :func:`export_model` and :func:`save_to_directory` gather the tables on the main
process of the writing topology (:func:`writer_topology`: the one passed, the training loop's, or the
tables'), which alone writes an ordinary PyKEEN model (``predict_target``, stock evaluation,
``torch.load``); every rank of a whole model's group enters as well, and only its main process writes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import torch

from .launch import world_size
from .lookup import ShardedTable, table_topology
from .topology import LocalTopology, Topology

logger = logging.getLogger(__name__)

__all__ = [
    "check_whole_model",
    "export_model",
    "gathered_model",
    "guard_pipeline_results",
    "plain_stored_tables",
    "save_to_directory",
    "writer_topology",
]


def writer_topology(model: Any, training_loop: Any = None, topology: Topology | None = None) -> Topology:
    """Return the processes that write a model's outputs together; its main process writes.

    :param model: the (sharded) model
    :param training_loop: the loop that trained it (a BESS loop brings its topology)
    :param topology: the topology to use (wins over the others)
    :returns: ``topology``, else the training loop's, else the topology of the model's first sharded entity
        table, else this process alone (a whole model outside a process group)
    :raises ValueError: for a model that is whole in this process, without a topology, inside a process group of
        several ranks: every rank would write the same files
    """
    if topology is not None:
        return topology
    loop_topology = getattr(training_loop, "topology", None)
    if isinstance(loop_topology, Topology):
        return loop_topology
    for representation in model.entity_representations:
        if isinstance(representation, ShardedTable) and representation.topology is not None:
            return representation.topology
    if world_size() > 1:
        raise ValueError(
            f"This model is whole in each of the {world_size()} processes and nothing says which one writes: pass "
            f"the training loop (training_loop=...) or topology=... (e.g. pykeen_bess.distributed.make_topology(), "
            f"called on every rank), or call this on one rank with topology=LocalTopology(1)."
        )
    return LocalTopology(1)


def _gather_table(table: ShardedTable, topology: Topology) -> torch.Tensor | None:
    """Gather a sharded table on the main process as ``[num_entities, row_width]`` (None elsewhere)."""
    stacked = topology.gather_shards(table.shard_tables().detach())
    if stacked is None:
        return None
    sharding = table.sharding
    stacked = stacked.reshape(sharding.n_shard * sharding.shard_size, -1)
    rows = sharding.entity_shard * sharding.shard_size + sharding.entity_local
    return stacked[rows.to(stacked.device)].clone()


@contextlib.contextmanager
def gathered_model(model: Any, topology: Topology | None = None) -> Iterator[Any]:
    """Temporarily give the main process the full model (collective: every process must enter).

    Inside the block the main process' model has ordinary :class:`pykeen.nn.Embedding` entity
    representations holding all entities; the other processes get None. Afterwards the model is
    sharded again. Tables sharded over processes are gathered on the main process of their topology; a
    model that is whole in every process is yielded as it is on the main process of ``topology``.

    :param model: a model trained by :class:`~pykeen_bess.training.BessTrainingLoop`
    :param topology: the processes that write a whole model (default: :func:`writer_topology` of the model)
    :yields: the full model on the main process, None on the others
    """
    tables = [(i, r) for i, r in enumerate(model.entity_representations) if isinstance(r, ShardedTable)]
    if not tables or all(table.holds_all_shards for _, table in tables):
        if not writer_topology(model, topology=topology).is_main_process:
            yield None
            return
        with plain_stored_tables(model):
            yield model
        return
    shards = table_topology(tables[0][1])
    full = [(index, table, _gather_table(table, shards)) for index, table in tables]
    if not shards.is_main_process:
        yield None
        return
    try:
        for index, table, weights in full:
            base: Any = table.base_embedding
            assert weights is not None  # the main process holds the gathered table
            base._embeddings.weight.data = weights.to(table.weight.device)
            model.entity_representations[index] = base
        yield model
    finally:
        for index, table, _ in full:
            base = table.base_embedding
            base._embeddings.weight.data = base._embeddings.weight.data.new_empty(0, table.row_width)
            model.entity_representations[index] = table


@contextlib.contextmanager
def plain_stored_tables(model: Any) -> Iterator[Any]:
    """While the block runs, whole tables kept outside the model (host memory, files) are plain embeddings.

    The rows are read into each table's own :class:`pykeen.nn.Embedding` (in memory, as pickling the table
    would), so that saving writes an ordinary PyKEEN model: PyKEEN's state dict keys, the weights alone (not
    the table's tier with its optimizer state and sharding). Tables on the device (parameters) and tables
    spread over processes are left as they are. See :func:`~pykeen_bess.tables.unshard.unshard_model` for
    the lasting change.

    :yields: the model
    """
    representations = model.entity_representations
    stored = [
        (index, table)
        for index, table in enumerate(representations)
        if isinstance(table, ShardedTable)
        and table.holds_all_shards
        and table.column_part is None
        and not isinstance(table.weight, torch.nn.Parameter)
    ]
    if not stored:
        yield model
        return
    # the model's guard of those tables against PyKEEN's resets (a class of this plugin): not saved with it
    guard = vars(model).pop("reset_parameters_", None)
    try:
        for index, table in stored:
            base = table.base_embedding
            base._embeddings.weight.data = table.full_table().to(base._embeddings.weight.device).clone()
            representations[index] = base
        yield model
    finally:
        for index, table in stored:
            base = table.base_embedding
            base._embeddings.weight.data = base._embeddings.weight.data.new_empty(0, table.row_width)
            representations[index] = table
        if guard is not None:
            model.reset_parameters_ = guard


def export_model(model: Any, path: str | os.PathLike, topology: Topology | None = None) -> None:
    """Write the full model to one file on the main process (collective), loadable with ``torch.load``.

    :param model: the (sharded) model
    :param path: the file the main process writes
    :param topology: the processes that write (default: :func:`writer_topology` of the model)
    """
    writers = writer_topology(model, topology=topology)
    with gathered_model(model, writers) as full:
        if full is not None:
            torch.save(full, pathlib.Path(path))
    writers.barrier()


def check_whole_model(model: Any) -> None:
    """Raise :class:`pickle.PicklingError` if ``model`` holds partial entity tables (some shards of a process group)."""
    for module in model.modules():
        if isinstance(module, ShardedTable):
            module.check_whole()


def guard_pipeline_results() -> None:
    """Make ``PipelineResult.save_model`` and ``save_to_directory`` safe after training on ranks or stored tables.

    * **A partial model is refused before anything is written.** Pickling a partial table fails
      (:meth:`~pykeen_bess.tables.representation.ShardedEmbedding.check_whole`), but only once
      :func:`torch.save` has opened the file: a good model at that path would be replaced by a truncated
      file (and ``save_to_directory`` would first replace the directory's results).
    * **A whole model is written by the main process only** where its BESS training loop ran over a
      process group (replicas of one shard: every process holds the same model): every rank wrote the
      same files at once, each with its own timings in ``results.json``, so the files could interleave
      two writers' bytes. The other processes write nothing (logged); per-rank copies are made with
      ``torch.save`` directly.

    * **Whole tables kept outside the model (host memory, files) are written as plain embeddings**
      (:func:`plain_stored_tables`): the file is an ordinary PyKEEN model, not the table's tier with its
      optimizer state and the sharding's triples.

    The training loop installs this guard (once, idempotently) when it trains over a process group or with
    tables outside the model; a whole model outside a process group (e.g. inside :func:`save_to_directory`
    of this module, on the main process) saves as before. Saving a partial model with ``torch.save``
    directly still fails only while writing; ``torch.save`` of a model with stored tables pickles them.
    """
    from pykeen.pipeline.api import PipelineResult

    if getattr(PipelineResult.save_model, "_bess_guarded", False):
        return
    save_model, save_directory = PipelineResult.save_model, PipelineResult.save_to_directory

    @functools.wraps(save_model)
    def guarded_save_model(self: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        check_whole_model(self.model)
        if _another_process_writes(self, path):
            return
        with plain_stored_tables(self.model):
            save_model(self, path, *args, **kwargs)

    @functools.wraps(save_directory)
    def guarded_save_to_directory(self: Any, directory: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("save_replicates", True):
            check_whole_model(self.model)
        if _another_process_writes(self, directory):
            return
        with plain_stored_tables(self.model):
            save_directory(self, directory, *args, **kwargs)

    guarded_save_model._bess_guarded = True  # type: ignore[attr-defined]
    PipelineResult.save_model = guarded_save_model  # type: ignore[method-assign]
    PipelineResult.save_to_directory = guarded_save_to_directory  # type: ignore[method-assign]


def _another_process_writes(result: Any, target: Any) -> bool:
    """Whether a pipeline result's BESS training ran over a process group whose main process is another (logged)."""
    topology = getattr(result.training_loop, "topology", None)
    if not isinstance(topology, Topology) or not topology.is_distributed or topology.is_main_process:
        return False
    logger.info(
        "Rank %d does not write %s: the model is the same in every process of its process group, whose main process "
        "writes it.",
        topology.rank,
        target,
    )
    return True


def save_to_directory(result: Any, directory: str | os.PathLike, **kwargs: Any) -> None:
    """Call ``PipelineResult.save_to_directory`` on the main process with the full model (collective).

    :param result: the pipeline's result (on every process; its training loop's topology says who writes)
    :param directory: the output directory the main process writes
    :param kwargs: passed to :meth:`pykeen.pipeline.PipelineResult.save_to_directory`
    """
    writers = writer_topology(result.model, result.training_loop)
    with gathered_model(result.model, writers) as full:
        if full is not None:
            result.save_to_directory(directory, **kwargs)
    writers.barrier()
