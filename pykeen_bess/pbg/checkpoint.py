"""PyTorch-BigGraph checkpoints of PyKEEN models: :func:`write_checkpoint`.

A written checkpoint directory holds what ``torchbiggraph_train`` (resume, or ``init_path``),
``torchbiggraph_export_to_tsv`` and PyTorch-BigGraph's ``CheckpointManager`` read: one
``embeddings_{type}_{part}.v{N}.h5`` per partition (rows in the graph's id order; row-wise Adagrad
state as PyTorch-BigGraph's optimizer blob with the run's learning rate), ``model.v{N}.h5`` (the
relations as the operator's parameters, :mod:`~pykeen_bess.pbg.conversion`), ``config.json`` and
``config.py`` (exact score settings: the operator and comparator, ``global_emb``, ``bias`` off),
the graph's entity files under ``entities/`` (the config's ``entity_path``; the exporter needs the
names) and ``checkpoint_version.txt``, written last. The version ``N`` is the number of completed
epochs: PyTorch-BigGraph resumes at iteration ``N`` with one edge path and one edge chunk.

Reading checkpoints back is :mod:`~pykeen_bess.pbg.restore`.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from pykeen.models import ERModel
from pykeen.nn.representation import Embedding
from pykeen.training import TrainingLoop

from . import files
from .config import write_config
from .conversion import DYNAMIC_NAMES, Conversion, conversion_for_model, entity_rows
from .graph import TypedGraph, as_typed_graph
from .inputs import graph_config, write_entities
from .schema import GraphSchema

if TYPE_CHECKING:
    from ..distributed.topology import Topology

__all__ = [
    "ENTITY_DIRECTORY",
    "checkpoint_settings",
    "commit",
    "relation_parameters",
    "rowwise_adagrad_state",
    "rowwise_blob",
    "write_checkpoint",
]

logger = logging.getLogger(__name__)

#: the folder of a checkpoint directory that holds the graph's entity files (the config's entity path)
ENTITY_DIRECTORY = "entities"
#: rows looked up at once while writing a partition
WRITE_CHUNK = 1 << 20


def _relation_ids(model: ERModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the forward and the inverse relation ids of a model trained with inverse triples."""
    real = torch.arange(model.num_real_relations)
    batch = torch.stack([torch.zeros_like(real), real, torch.zeros_like(real)], dim=1)
    inverter = model.relation_inverter
    return inverter.map(batch=batch)[:, 1], inverter.map(batch=batch, invert=True)[:, 1]


def relation_parameters(model: ERModel, schema: GraphSchema, conversion: Conversion) -> dict[str, torch.Tensor]:
    """Return the relations of a model as PyTorch-BigGraph's model parameters (dataset path -> values).

    Without dynamic relations every relation ``i`` has its ``rhs`` operator
    (``relations/{i}/operator/rhs/...``); with dynamic relations ``relations/0/operator/{lhs,rhs}/...``
    hold all relations. A model with inverse triples puts its forward relations into ``lhs`` and its
    inverse relations into ``rhs``.

    :raises ValueError: for inverse triples without dynamic relations (one operator per relation)
    """
    with torch.no_grad():
        relation = model.relation_representations[0](indices=None).detach().cpu()
    if model.use_inverse_triples:
        if not schema.dynamic_relations:
            raise ValueError(
                "A model trained with inverse triples predicts heads with separate inverse relations; PyTorch-BigGraph "
                "holds those only with dynamic relations (one head and one tail type for all relations)."
            )
        forward, inverse = _relation_ids(model)
        lhs, rhs = conversion.lhs(relation[forward]), conversion.lhs(relation[inverse])
    else:
        lhs, rhs = conversion.lhs(relation), conversion.rhs(relation)
    if schema.dynamic_relations:
        return {
            f"relations/0/operator/{side}/{DYNAMIC_NAMES[name]}": value
            for side, parameters in (("lhs", lhs), ("rhs", rhs))
            for name, value in parameters.items()
        }
    return {
        f"relations/{index}/operator/rhs/{name}": value[index]
        for index in range(schema.num_relations)
        for name, value in rhs.items()
    }


class RowwiseTrainedLoop(Protocol):
    """What a checkpoint reads of a BESS loop that trained with :class:`~pykeen_bess.tables.optim.RowwiseAdagrad`."""

    #: the optimizer (None after PyKEEN's ``clear_optimizer``)
    optimizer: torch.optim.Optimizer | None
    #: its hyper-parameters (``lr``)
    optimizer_kwargs: Mapping[str, Any]
    #: the shard tables (``optimizer_parameter``, ``row_state``, ``entity_rows``)
    tables: Sequence[Any]
    #: the process topology (a :class:`~pykeen_bess.distributed.Topology`)
    topology: Any


def rowwise_adagrad_state(training_loop: TrainingLoop | None) -> tuple[Any, float] | None:
    """Return a function ``ids -> per-row sums`` of a BESS loop's row-wise Adagrad entity state, and its lr.

    None if the loop did not train with :class:`~pykeen_bess.tables.optim.RowwiseAdagrad`. Under a process
    group the sums of the ids held elsewhere are summed in over the shard group (a collective).
    """
    from ..tables.optim import RowwiseAdagrad

    if training_loop is None or getattr(training_loop, "optimizer_cls", None) is not RowwiseAdagrad:
        return None
    if training_loop.optimizer is None:
        logger.warning(
            "The training loop's optimizer state was released after training (PyKEEN's clear_optimizer=True, the "
            "pipeline's default): the checkpoint holds no row-wise Adagrad state. Run pipeline(..., "
            "clear_optimizer=False) to keep it."
        )
        return None
    loop = cast(RowwiseTrainedLoop, training_loop)  # only a BESS loop has optimizer_cls RowwiseAdagrad
    assert loop.optimizer is not None
    table = loop.tables[0]
    state = dict(loop.optimizer.state.get(table.optimizer_parameter, {}), **table.row_state)
    if "sum" not in state:
        return None
    sums = state["sum"]
    topology = loop.topology

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        rows = table.entity_rows[ids]
        held = rows >= 0
        values = torch.zeros(ids.numel(), dtype=torch.float32)
        values[held] = sums[rows[held].to(sums.device)].detach().cpu().float()
        if topology.is_distributed:
            values = topology.shard_all_reduce(values.to(topology.device)).cpu()
        return values

    return lookup, float(loop.optimizer_kwargs.get("lr", 1e-2))


def checkpoint_settings(model: ERModel, conversion: Conversion, lr: float | None) -> dict[str, Any]:
    """Return the config settings of a checkpoint that make PyTorch-BigGraph score as the model does."""
    representation = model.entity_representations[0]
    dimension = (
        getattr(representation, "row_width", None) or cast(Embedding, representation)._embeddings.weight.shape[1]
    )
    settings: dict[str, Any] = dict(
        dimension=int(dimension), operator=conversion.operator, comparator=conversion.comparator, bias=False
    )
    if lr is not None:
        settings["lr"] = lr
    return settings


def write_checkpoint(
    model: ERModel,
    graph: TypedGraph | Any,
    directory: str | os.PathLike,
    *,
    version: int | None = None,
    training_loop: TrainingLoop | None = None,
    config: Mapping[str, Any] | None = None,
    topology: Topology | None = None,
) -> pathlib.Path:
    """Write a PyKEEN model as a PyTorch-BigGraph 1.0 checkpoint.

    Under a process group (a model trained on ranks stays sharded) every rank must call it; the main
    process of the writing topology writes, the rows of each partition are looked up collectively.

    :param model: DistMult, TransE with ``scoring_fct_norm=2``, ComplEx, RotatE or RESCAL (any
        ``ERModel`` with their interactions and one entity and one relation representation)
    :param graph: the typed graph (or the training triples factory) whose partitions lay out the files
    :param directory: the checkpoint directory (created)
    :param version: the checkpoint version (default: the epochs ``training_loop`` completed, else 0, a
        checkpoint PyTorch-BigGraph starts from, as from an ``init_path``)
    :param training_loop: the BESS loop that trained the model: its completed epochs and, with
        ``optimizer="rowwise_adagrad"``, its per-row state (PyTorch-BigGraph's optimizer blob)
    :param config: more PyTorch-BigGraph config keys (e.g. ``num_epochs``, ``loss_fn``)
    :param topology: the processes that write together, whose main process writes the files (default: the
        training loop's, else the model's sharded entity table's, else this process alone:
        :func:`~pykeen_bess.distributed.export.writer_topology`)
    :returns: the directory
    :raises ValueError: for a model PyTorch-BigGraph cannot express, a graph that does not fit the model, a
        directory holding a newer checkpoint, or a whole model under a process group without a topology
    """
    from ..distributed.export import writer_topology

    typed = as_typed_graph(graph)
    schema = typed.schema
    if model.num_entities != schema.num_entities or model.num_real_relations != schema.num_relations:
        raise ValueError(
            f"The model has {model.num_entities} entities and {model.num_real_relations} relations, the graph "
            f"{schema.num_entities} and {schema.num_relations}."
        )
    conversion = conversion_for_model(model)
    if len(model.entity_representations) != 1 or len(model.relation_representations) != 1:
        raise ValueError("PyTorch-BigGraph checkpoints hold models with one entity and one relation representation.")
    directory = pathlib.Path(directory).resolve()  # the config's paths work from any working directory
    if version is None:
        version = int(getattr(training_loop, "_epoch", 0) or 0)
    main = writer_topology(model, training_loop, topology).is_main_process
    existing = files.read_version(directory) if directory.is_dir() else 0  # every rank: a shared directory
    if existing > version:
        raise ValueError(f"{directory} holds checkpoint version {existing}, newer than version {version}.")
    if main:
        directory.mkdir(parents=True, exist_ok=True)
    optimizer = rowwise_adagrad_state(training_loop)
    parameters = relation_parameters(model, schema, conversion)
    representation = model.entity_representations[0]
    was_training = model.training
    model.eval()
    try:
        for t, name in enumerate(schema.entity_types):
            for p in range(len(schema.partition_sizes[t])):
                ids = torch.arange(schema.partition_range(t, p).start, schema.partition_range(t, p).stop)
                with torch.no_grad():
                    rows = (
                        torch.cat(
                            [entity_rows(representation(indices=chunk)).cpu() for chunk in ids.split(WRITE_CHUNK)]
                        )
                        if ids.numel()
                        else entity_rows(representation(indices=ids)).cpu()  # [0, D]: an empty partition
                    )
                state = None
                if optimizer is not None:
                    lookup, lr = optimizer
                    state = rowwise_blob(lookup(ids), lr)
                if main:
                    files.write_embeddings(files.embeddings_file(directory, name, p, version), rows, state)
    finally:
        model.train(was_training)
    if not main:
        return directory
    files.write_model(files.model_file(directory, version), parameters)
    entity_path = directory / ENTITY_DIRECTORY
    entity_path.mkdir(exist_ok=True)
    write_entities(typed, entity_path)
    settings = checkpoint_settings(model, conversion, optimizer[1] if optimizer is not None else None)
    settings["num_epochs"] = max(version, 1)
    settings.update(config or {})
    write_config(graph_config(typed, settings, checkpoint_path=directory, entity_path=entity_path), directory)
    commit(directory, version)
    logger.info("Wrote PyTorch-BigGraph checkpoint version %d (%s) to %s.", version, conversion.describe(), directory)
    return directory


def rowwise_blob(sums: torch.Tensor, lr: float) -> dict[str, Any]:
    """PyTorch-BigGraph's ``RowAdagrad`` state of one partition (its lr overrides the config's on load)."""
    return {
        "state": {0: {"step": 0, "sum": sums.to(torch.float32).contiguous()}},
        "param_groups": [{"lr": float(lr), "lr_decay": 0, "weight_decay": 0, "params": [0]}],
    }


def commit(directory: pathlib.Path, version: int) -> None:
    """Point ``checkpoint_version.txt`` at ``version`` (written last), then remove the previous version's files.

    As PyTorch-BigGraph: a version 0 is never removed (it is an initial checkpoint).
    """
    previous = files.read_version(directory)
    files.write_version(directory, version)
    if previous != version and previous > 0:
        files.remove_version(directory, previous)
