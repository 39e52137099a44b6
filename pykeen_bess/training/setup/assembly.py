"""Assembling a BESS training loop for a partition, and ``exchange="auto"`` across partitions.

:func:`assemble` builds everything of a :class:`~pykeen_bess.training.BessTrainingLoop` that
depends on how the entity tables are partitioned: the process topology, the validated settings,
the row sharding, the tables and their optimizer, the checkpoint store and the step sizes. The
loop's constructor calls it once; :func:`choose_partition` may ask for it again at the start of
training, when the batch size is known: with ``exchange="auto"`` and no explicit partition, the
registered scheme of either partition that sends the fewest bytes per step
(:func:`~pykeen_bess.schemes.choose_scheme`) is chosen, and the reason is logged.

The functions take the parts they use (the loop's settings, the current setup, the model), not the
loop; the loop (:class:`~pykeen_bess.training.parts.LoopParts`) keeps what they decide.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable
from typing import Any

import torch
from pykeen.constants import PYKEEN_CHECKPOINTS
from pykeen.triples.weights import RelationLossWeighter

from ...distributed import Topology
from ...tables.encoding import ColumnSplit, check_encoding_model
from ...nn.loss import weight_convention
from ...schemes import AUTO, ExchangeScheme, choose_scheme, query_width, scheme_resolver
from ...scoring import get_scorer
from ...data.partition import ShardPairPartition
from ...data.sampling import BessSampler, TypedBessSampler
from ...data.sharding import EntitySharding, resolve_sharding
from ..checkpoints.stores import (
    checkpoint_seed,
)
from ..checkpoints.checkpointed import CheckpointedLoop
from ..checkpoints.pbg import PbgCheckpointStore
from .config import BessConfig
from .arguments import LoopSettings
from .settings import TrainingSetup
from .sizes import StepSizes
from .partitions import partition_resolver
from ...tables.creation import create_tables

__all__ = [
    "assemble",
    "checkpoint_path",
    "checkpoint_seed_to_adopt",
    "choose_encoding_scheme",
    "choose_partition",
    "graph_loss_weighter",
    "make_sampler",
    "make_scheme",
]

logger = logging.getLogger(__name__)


def graph_loss_weighter(loss_weighter: Any, loss: Any, settings: LoopSettings) -> Any:
    """Return the loop's loss weighter: the user's, else a typed graph's relation weights (PyTorch-BigGraph's).

    :param loss_weighter: the user's (PyKEEN's ``loss_weighter`` hint), or None
    :param loss: the model's loss
    :raises ValueError: if the graph's relations have weights that the loss cannot apply
    """
    if loss_weighter is not None or settings.schema is None or not settings.schema.weighted:
        return loss_weighter
    try:
        weight_convention(loss)
    except ValueError as error:
        reason = str(error)
        raise ValueError(
            f"The graph's relations have loss weights (PyTorch-BigGraph's 'weight'), which the loop applies, "
            f"but {reason[:1].lower()}{reason[1:]} Or set the weights to 1 in the graph's config."
        ) from error
    weights = settings.schema.relation_weight_tensor(settings.factory).to(torch.get_default_dtype())
    logger.info("BESS: the graph's relation weights weigh the loss (PyKEEN's RelationLossWeighter).")
    return RelationLossWeighter(weights=weights)


def assemble(
    settings: LoopSettings,
    partition: str,
    optimizer: torch.optim.Optimizer,
    checkpointed: CheckpointedLoop,
    probe_step: Callable[..., None],
) -> TrainingSetup:
    """Build the setup of a loop for ``partition``: topology, configuration, sharding, tables, store and sizes.

    The loop then builds the optimizer of the new tables (:meth:`~pykeen_bess.training.BessTrainingLoop.reassemble`).

    :param settings: the loop's arguments
    :param partition: ``"token"`` or ``"encoding"``
    :param optimizer: the loop's optimizer (the memory plan counts its state per row)
    :param checkpointed: what the checkpoint store reads and writes of the loop
    :param probe_step: runs one step as a memory probe (see :class:`~pykeen_bess.training.setup.sizes.StepSizes`)
    :raises ValueError: for settings that do not fit the partition or the processes
    """
    model = settings.model
    table_partition = partition_resolver.make(partition)
    part = table_partition.build(settings)
    topology = part.topology
    n_shard = topology.n_shard
    seed = settings.seed
    if seed is None:
        seed = model._random_seed if model._random_seed is not None else 0
        # every rank must shard and sample alike: without an explicit seed, rank 0's (e.g. the pipeline's
        # random seed, which hpo_pipeline draws per process) is used everywhere
        seed = topology.broadcast_object(seed)
    config = BessConfig.create(
        n_shard,
        part.exchange,
        settings.corruption,
        settings.num_negs_per_pos,
        seed,
        settings.sparse_updates,
        settings.memory_budget,
        partition,
        settings.negatives,
    )
    if issubclass(config.sampler, TypedBessSampler):
        if settings.schema is None:
            raise ValueError(
                f"negatives={settings.negatives!r} needs entity types: train on a typed graph's factories "
                "(pykeen_bess.pbg.read, pbg.import_tsv with a config, or pbg.TypedGraph.from_factories)."
            )
        table_partition.check_sampler(config.sampler, settings.negatives)
    strategy = resolve_sharding(settings.sharding, settings.schema, settings.factory)
    sharding = EntitySharding.create(model.num_entities, n_shard, seed=config.seed, strategy=strategy)
    tables, memory_plan = create_tables(
        model,
        settings.embeddings,
        sharding,
        topology,
        config.seed,
        optimizer,
        settings.storage,
        part.tables_kind,
    )
    scorer = get_scorer(
        model.interaction,
        entity_representations=model.entity_representations,
        relation_representations=model.relation_representations,
    )
    checkpoints = table_partition.checkpoint_store(checkpointed, settings, topology, sharding, tables)
    logger.info(
        "BESS: %s%s; exchange=%s, corruption=%s",
        part.description,
        sharding.describe(),
        config.scheme_name,
        settings.corruption,
    )
    return TrainingSetup(
        table_partition=table_partition,
        topology=topology,
        config=config,
        sharding=sharding,
        tables=tables,
        memory_plan=memory_plan,
        scorer=scorer,
        checkpoints=checkpoints,
        sizes=StepSizes(topology, config.memory_budget, probe_step),
    )


def choose_partition(
    settings: LoopSettings, setup: TrainingSetup, batch_size: int | None, train_kwargs: dict
) -> str | None:
    """With ``exchange="auto"`` and no partition given: the partition whose scheme sends the fewest bytes.

    Compares every registered scheme's bytes per step for this batch size (token schemes on ``n``
    row shards, the encoding schemes on ``n`` column parts of the same batch); the encoding
    partition is a candidate only where it applies (a model whose rows split into ``n`` column parts,
    no replicas, no typed negatives, PyKEEN's checkpoints, a fresh training). The loop chooses once, at
    the first training with a known batch size; the choice and the costs are logged.

    :returns: the chosen partition; None where nothing is to be chosen (a partition or scheme was given,
        or the batch size is not known yet)
    """
    if settings.partition is not None or settings.exchange != AUTO or batch_size is None:
        return None
    n = setup.topology.n_shard
    block_size = -(-batch_size // n**2)
    widths = dict(
        entity_width=sum(embedding._embeddings.weight.shape[1] for embedding in settings.embeddings),
        query_width=query_width(setup.scorer, settings.model, setup.tables.tables),
    )
    num_negs = candidates_per_block(settings, setup.config)
    model = settings.model
    shared = setup.config.sampler.shares_negatives
    costs = {
        cls.get_name(): cls.cost(n, block_size, num_negs, **widths, shared_negatives=shared)
        for cls in scheme_resolver
        if cls.applies(model)
    }
    reason = _encoding_unavailable(settings, setup, train_kwargs)
    candidates = ("token",) if reason else ("token", "encoding")
    chosen = choose_scheme(
        n, block_size, num_negs, partitions=candidates, model=model, shared_negatives=shared, **widths
    )
    logger.info(
        "exchange='auto': bytes sent per process and step with %d parts and batches of %d: %s%s; chose %r.",
        n,
        batch_size,
        ", ".join(f"{name} {value}" for name, value in costs.items()),
        f" (encoding not applicable: {reason})" if reason else "",
        chosen.get_name(),
    )
    return chosen.partition


def choose_encoding_scheme(setup: TrainingSetup, model: Any, block_size: int) -> type[ExchangeScheme]:
    """Return the encoding partition's scheme that sends the fewest bytes for blocks of ``block_size`` (logged).

    Partial scores (``encoding``) where the interaction is separable, else whole rows (``encoding_lookup``).
    """
    n = setup.topology.n_column
    scheme = choose_scheme(
        n,
        max(block_size // n**2, 1),
        setup.config.num_negs_per_pos,
        sum(embedding._embeddings.weight.shape[1] for embedding in setup.tables.embeddings),
        0,  # neither encoding scheme moves queries
        partitions=("encoding",),
        model=model,
    )
    logger.info("exchange='auto' chose %s (the encoding partition).", scheme.get_name())
    return scheme


def _encoding_unavailable(settings: LoopSettings, setup: TrainingSetup, train_kwargs: dict) -> str:
    """Return why the encoding partition cannot replace the token partition here ("" if it can)."""
    try:
        ColumnSplit(check_encoding_model(settings.model, partial_scores=False), setup.topology.n_shard)
    except ValueError as error:
        return str(error).split(";")[0]
    if setup.topology.replicas > 1:
        return "replicas"
    if issubclass(setup.config.sampler, TypedBessSampler):
        return "typed negatives"
    if settings.checkpoint_format != "pykeen":
        return f"checkpoint_format={settings.checkpoint_format!r}"
    if train_kwargs.get("continue_training"):
        return "continued training"
    return ""


def make_sampler(
    settings: LoopSettings, config: BessConfig, partition: ShardPairPartition, block_size: int, weights: Any = None
) -> BessSampler:
    """Return the sampler of balanced batches of ``block_size`` slots per block.

    Typed negatives get the graph's schema; a loss weighter (PyKEEN's ``loss_weighter``) the weight
    of every triple (``weights``, shape ``[T]``, see :func:`~pykeen_bess.nn.loss.partition_weights`).
    """
    kwargs: dict[str, Any] = {}
    schema = settings.schema
    if issubclass(config.sampler, TypedBessSampler) and schema is not None:
        kwargs = dict(
            relation_sides=schema.relation_sides(settings.factory),
            entity_types=schema.entity_type,
            type_names=schema.entity_types,
        )
    if weights is not None:  # (a user's sampler class without loss weights still works unweighted)
        kwargs["weights"] = weights
    return config.sampler(
        partition,
        block_size=block_size,
        num_negs_per_pos=config.num_negs_per_pos,
        corruption=config.corruption,
        seed=config.seed,
        **kwargs,
    )


def candidates_per_block(settings: LoopSettings, config: BessConfig) -> int:
    """Return the negatives a block's slots are scored against: ``K``, or ``T * K`` with typed negatives.

    Typed negatives draw ``K`` of each of the ``T`` candidate types for every block, and the schemes
    move and score all of them (each slot keeps its type's), so the exchange costs count ``T * K``.
    """
    num_negs = config.num_negs_per_pos
    schema = settings.schema
    if issubclass(config.sampler, TypedBessSampler) and schema is not None:
        sides = schema.relation_sides(settings.factory)
        return num_negs * len(TypedBessSampler.candidate_types(sides, config.corruption))
    return num_negs


def make_scheme(settings: LoopSettings, setup: TrainingSetup, block_size: int, topology: Topology) -> ExchangeScheme:
    """Return the exchange scheme for blocks of ``block_size`` slots (``exchange="auto"``: the cheapest)."""
    config, tables, model = setup.config, setup.tables, settings.model
    scheme = config.scheme
    if scheme is None and config.partition == "encoding":
        scheme = choose_encoding_scheme(setup, model, block_size)
    if scheme is None:
        scheme = choose_scheme(
            n_shard=setup.topology.n_shard,
            block_size=block_size,
            num_negs_per_pos=candidates_per_block(settings, config),
            entity_width=sum(table.row_width for table in tables),
            query_width=query_width(setup.scorer, model, tables.tables),
            partitions=(config.partition,),
            shared_negatives=config.sampler.shares_negatives,
        )
        logger.info("exchange='auto' chose %s for blocks of %d slots.", scheme.get_name(), block_size)
    return scheme(model=model, tables=tables.tables, scorer=setup.scorer, topology=topology)


def checkpoint_path(train_kwargs: dict[str, Any]) -> pathlib.Path | None:
    """Return the checkpoint file ``train()`` resumes if it exists (default: PyKEEN's directory); None: no name."""
    name = train_kwargs.get("checkpoint_name")
    if not name:
        return None
    directory = train_kwargs.get("checkpoint_directory")
    return pathlib.Path(PYKEEN_CHECKPOINTS if directory is None else directory) / name


def checkpoint_seed_to_adopt(settings: LoopSettings, setup: TrainingSetup, train_kwargs: dict[str, Any]) -> int | None:
    """Resuming a checkpoint: the checkpoint's seed, where the loop derived its own and it differs (else None).

    A loop without an explicit ``seed`` derives it from the model's random seed; PyKEEN restores
    everything from a checkpoint, whatever the new model's seed. So the seed the checkpoint
    records (see :func:`~pykeen_bess.training.checkpoints.stores.checkpoint_seed`) wins: the loop is
    assembled again with it (new tables, whose values the checkpoint then replaces), and resuming
    continues as the uninterrupted run would. An explicit ``seed`` is kept (a checkpoint of another
    seed then does not match, and the error says so). Under a process group rank 0 decides (collective).
    """
    path = checkpoint_path(train_kwargs)
    if path is None or settings.seed is not None or isinstance(setup.checkpoints, PbgCheckpointStore):
        return None
    seed = checkpoint_seed(path)
    if setup.topology.is_distributed:  # every rank assembles alike (rank 0 decides)
        seed = setup.topology.broadcast_object(seed)
    if seed is None or seed == setup.config.seed:
        return None
    logger.info(
        "Resuming checkpoint %s, written with seed %d: the loop shards and samples with it (this model's random "
        "seed derives %d).",
        path,
        seed,
        setup.config.seed,
    )
    return int(seed)
