"""Stage 7 of the pipeline: :class:`BessTrainingLoop`, BESS inside PyKEEN's training machinery.

The loop is a :class:`pykeen.training.SLCWATrainingLoop` (so ``pipeline()`` hands it the negative
sampler kwargs) assembled from the parts of this subpackage: the validated settings
(:mod:`~pykeen_bess.training.setup.config`), the shard tables (:mod:`~pykeen_bess.tables.shard_tables`), the
step (:mod:`~pykeen_bess.training.steps.runner`), the step sizes (:mod:`~pykeen_bess.training.setup.sizes`) and
the checkpoint store (:mod:`~pykeen_bess.training.checkpoints.stores`), over one process topology
(:mod:`pykeen_bess.distributed`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, ClassVar, cast

import torch
from class_resolver import HintOrType, OptionalKwargs
from pykeen.models import ERModel, Model
from pykeen.sampling import NegativeSampler
from pykeen.training import SLCWATrainingLoop
from pykeen.triples import CoreTriplesFactory

from ..distributed import ProcessGroupHint
from ..runtime.allocator import AllocatorHint, resolve_allocator
from ..tables.optim import optimizer_hyperparameters
from ..data.partition import ShardPairPartition
from ..pbg.schema import schema_of
from ..data.sampling import CORRUPTIONS, DEFAULT_NEGATIVES, NEGATIVES, BessSampler, Corruption
from ..schemes import ExchangeScheme, canonical_exchange
from ..data.sharding import SHARDINGS, ShardingStrategy
from ..distributed.groups import GROUPINGS
from ..names import canonical_choice, check_keyword_arguments
from ..storage import TableStorage, make_storage
from ..runtime.threads import ThreadsHint, resolve_threads
from .checkpoints.pbg import PbgCheckpointStore, prepare_pbg_checkpoint
from .checkpoints.stores import CHECKPOINT_FORMATS, CHECKPOINT_RETRIEVALS
from .checkpoints.stopper_weights import pykeen_layout_stopper_file, stopper_file_layout
from .setup.config import PARTITIONS, check_train_arguments, resolve_negative_sampler, resolve_partition, round_num_negs
from .setup.models import check_model, check_model_dtype, check_triples_fit_model
from .epochs import run_epochs
from .hooks import asks_evaluation_loss
from .parts import LoopParts
from .steps.static_step import StaticStep, check_static_step
from .steps.runner import StepRunner
from .setup.arguments import LoopSettings
from .setup.assembly import checkpoint_path, graph_loss_weighter
from ..tables.shard_tables import materialize
from ..tables.unshard import unshard_model

__all__ = [
    "BessTrainingLoop",
]

logger = logging.getLogger(__name__)


class BessTrainingLoop(LoopParts):
    """Train any PyKEEN ``ERModel`` with embedding tables with BESS.

    Use it through ``pipeline(training_loop="bess", training_loop_kwargs=dict(num_shards=4))``.
    One step is a balanced batch of ``num_shards ** 2`` blocks: the ``batch_size`` positives are
    split equally over the shardpairs (``block_size = ceil(batch_size / num_shards ** 2)``), and
    all positives of a step share ``num_negs_per_pos`` negatives drawn equally from every shard
    (``negatives="block"``: every block draws its own).
    See :mod:`pykeen_bess.data.sampling` for what an epoch is.

    Of PyKEEN's per-batch hooks, a subclass may override :meth:`_process_batch` (one sub-batch's
    loss); overriding ``_train_epoch`` or ``_forward_pass``, which the training steps never call, is refused.
    PyKEEN's ``evaluation-loss`` callback works in one process: :meth:`_train_epoch` computes the loss
    of the given triples as PyKEEN's ``SLCWATrainingLoop`` does, with this loop's number of negatives.
    """

    #: The knobs HPO tunes (they are ``train()`` keyword arguments, see :meth:`train`)
    hpo_default = dict(
        num_epochs=dict(type=int, low=100, high=1000, q=100),
        batch_size=dict(type=int, low=8, high=13, scale="power_two"),  # 256 ... 8192
        num_negs_per_pos=dict(type=int, low=4, high=8, scale="power_two"),  # 16 ... 256
    )

    supports_slicing: ClassVar[bool] = False

    def __init__(
        self,
        model: Model,
        triples_factory: CoreTriplesFactory,
        *,
        num_shards: int | None = None,
        exchange: str | type[ExchangeScheme] | None = None,
        partition: str | None = None,
        corruption: Corruption = "ht",
        num_negs_per_pos: int | None = None,
        seed: int | None = None,
        sparse_updates: bool = True,
        process_group: ProcessGroupHint = None,
        replicas: int | None = None,
        replica_grouping: str | None = None,
        checkpoint_retrieval: str = "one_per_group",
        memory_budget: int | None = None,
        storage: HintOrType[TableStorage] = None,
        storage_path: str | os.PathLike | None = None,
        storage_kwargs: OptionalKwargs = None,
        negative_sampler: HintOrType[NegativeSampler] = None,
        negative_sampler_kwargs: OptionalKwargs = None,
        num_threads: ThreadsHint = "auto",
        host_allocator: AllocatorHint = None,
        negatives: str | type[BessSampler] = DEFAULT_NEGATIVES,
        checkpoint_format: str = "pykeen",
        sharding: str | ShardingStrategy | None = None,
        static_step: bool | None = None,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        """Create the loop; configuration errors are raised here (or, those of ``train()``'s arguments, as it starts).

        :param model: an ``ERModel`` whose entity representations are :class:`pykeen.nn.Embedding`
        :param triples_factory: the training triples
        :param num_shards: the number of entity shards ``n``; defaults to the world size (divided by
            ``replicas``) inside a ``torch.distributed`` process group, else 1. In one process all ``n`` shards are held
            as logical shards.
        :param exchange: the exchange scheme (:mod:`pykeen_bess.schemes`): ``"embedding"`` (default of
            the token partition: move tail and negative embeddings to the heads' shard), ``"score"``
            (gather queries, move negative scores), ``"encoding"`` (the encoding partition's default for
            column-separable interactions: sum partial scores of column parts), ``"encoding_lookup"`` (its
            default for the others: assemble whole rows from the column parts), a scheme class, or
            ``"auto"`` (the partition's scheme that moves the fewest bytes per step)
        :param partition: how the entity tables are split over the ``num_shards`` parts (the
            host-embedding strategies): ``"token"`` (rows: BESS's shards; default) or ``"encoding"`` (columns: every
            part holds ``d / num_shards`` coordinates of all entities, every process sees the whole
            batch; see :mod:`pykeen_bess.tables.encoding`). Default: what ``exchange`` implies
        :param corruption: corrupt heads (``"h"``), tails (``"t"``) or both (``"ht"``: the first
            half of every block corrupts heads, the second half tails; a block of an odd size ``b`` has
            ``b // 2`` head slots, none for one slot: small odd blocks are warned about)
        :param num_negs_per_pos: negatives per positive, a multiple of ``num_shards``; also
            accepted from ``negative_sampler_kwargs`` (what ``pipeline()`` passes) and as a
            ``train()`` argument (what HPO tunes). Default: 64 rounded up to a multiple of
            ``num_shards``.
        :param seed: the seed of the sharding, the sampler and the initial tables; defaults to the
            model's random seed (``pipeline(random_seed=...)``; under a process group rank 0's), else 0; without
            it, a checkpoint being resumed brings its own (see :meth:`~.LoopParts.adopt_checkpoint_seed`)
        :param sparse_updates: update the shard tables row-sparsely (see :mod:`pykeen_bess.tables.optim`);
            set False to use any optimizer densely
        :param process_group: a ``torch.distributed`` process group to train in (default: the
            world group if one is initialised with more than one rank; under ``torchrun`` it is
            joined first), or a device mesh with the dimensions ``("replica", "shard")``
        :param replicas: the processes holding each shard (``num_shards * replicas`` = the world size; default 1)
        :param replica_grouping: how the replicas are laid out over the ranks: ``"orthogonal"``
            (default with replicas: the shards of one replica are consecutive ranks), ``"consecutive"``
            (the replicas of one shard are consecutive ranks), ``"all"`` (one shard, every rank a
            replica) or ``"none"`` (no replicas); see :mod:`pykeen_bess.distributed.groups`
        :param checkpoint_retrieval: ``"one_per_group"`` (one file per shard, written by its first
            replica; resumable on any numbers of shards and replicas) or ``"all_replicas"`` (every
            process writes its own file; resuming checks that the replicas agree)
        :param memory_budget: bytes the compute device may use: the peak of a memory probe (default: half the
            available memory on the CPU; on a GPU, out-of-memory errors decide; on the CPU the peak is the growth
            of the process' resident memory, so a probe served from memory the process already holds counts
            0 bytes), and, with tables in host memory or
            files staged on a GPU, the staging buffers with the replicated parameters and their optimizer state
            (default: a quarter of the GPU's free memory for the buffers); see the storage how-to
        :param storage: where the process keeps its shard tables and optimizer state (:mod:`pykeen_bess.storage`):
            ``"device"`` (default), ``"host"`` (host memory; each step moves its rows to the device and back),
            ``"mmap"`` (``.npy`` memory maps under ``storage_path``) or a :class:`~pykeen_bess.storage.TableStorage`
        :param storage_path: the directory of ``storage="mmap"``'s files
        :param storage_kwargs: further arguments of the storage class (e.g. ``overwrite=True``). Without
            ``overwrite``, files of an earlier run under ``storage_path`` are refused when training starts,
            unless ``train()`` resumes a checkpoint (``checkpoint_name`` of an existing checkpoint): then they
            are its run's, and are replaced
        :param negative_sampler: None or PyKEEN's basic sampler (BESS draws its own negatives)
        :param negative_sampler_kwargs: only ``num_negs_per_pos`` is meaningful (``filterer=None``, PyKEEN's
            "no filtering", is accepted)
        :param num_threads: intra-op CPU threads while training (:mod:`pykeen_bess.runtime.threads`): ``"auto"``
            (default: measure 1 thread against all of the process's, so a busy neighbour on a shared CPU is
            noticed; torch's setting is restored afterwards), None or ``"keep"`` (torch's setting, left alone),
            or an integer
        :param host_allocator: None or ``"keep"`` (default: leave the C library's allocator alone) or ``"auto"``
            (on the CPU: glibc keeps freed blocks for the next step, a process-wide setting that stays;
            :mod:`pykeen_bess.runtime.allocator`; what the command line uses)
        :param negatives: ``"step"`` (default: ``num_negs_per_pos`` entities drawn equally from every
            shard, one set shared by all blocks of a step, gathered, moved and scored once), ``"block"``
            (BESS's original scheme: one such set per block, ``num_shards ** 2`` sets per step; also
            accepted as ``"uniform"``), ``"typed_step"`` and ``"typed"`` (a relation's negatives have its
            corrupted side's type, one set per step or per block; a typed graph, :mod:`pykeen_bess.pbg`),
            or a ``BessSampler`` subclass. With one shard per-step and per-block draws are the same; see
            :mod:`pykeen_bess.data.sampling` for when to use which
        :param checkpoint_format: ``"pykeen"`` (default: PyKEEN's checkpoint file, or versioned files per
            shard under a process group) or ``"pbg"`` (PyTorch-BigGraph's checkpoint layout in the
            checkpoint file's directory: shard ``k`` is partition ``k`` of every entity type; see
            :class:`~pykeen_bess.training.checkpoints.pbg.PbgCheckpointStore`)
        :param sharding: ``"balanced"`` (default: every shardpair holds about ``T / n ** 2`` triples, see
            :mod:`pykeen_bess.data.balancing`), ``"random"`` or a :class:`~pykeen_bess.data.sharding.ShardingStrategy`
            (typed graphs: by type); a checkpoint resumes only with the sharding it was written with
        :param static_step: None (default: every step runs as the static step, one function of fixed shapes,
            captured as a CUDA graph on a GPU, wherever the configuration allows; else the eager step, the reason
            logged), True (the static step, or an error says why not) or False (the eager step); see
            :mod:`pykeen_bess.training.steps.static_step`. Process groups, replicas, the encoding partition,
            sub-batches, clipping, loss weights, dropout, per-step callbacks, tables in host memory or files
            (their rows staged into device buffers around every step on a GPU) and dense updates (any optimizer;
            captured on a GPU for the optimizers with a capturable form, Adam, AdamW, RMSprop, ..., uncaptured for
            the others, as are typed negatives with a regularizer other than L2, and host or file tables with
            replicas or the encoding partition) run on the static step; the eager step runs for a subclass that
            overrides ``_process_batch`` (the GPU how-to says why)
        :param device: where a model built on the meta device is materialised (every parameter but its entity
            tables, which ``storage`` holds) and computes, e.g. ``"cuda"`` for tables in host memory or files
            bigger than the GPU; None: the CPU. A model built on a real device computes there (giving another
            device is an error)
        :param kwargs: passed to :class:`pykeen.training.TrainingLoop` (optimizer, lr scheduler,
            result tracker, loss weighter (every positive's weight is passed to the loss as
            ``pos_weights``, see :mod:`pykeen_bess.nn.loss`; default: a typed graph's relation weights), ...)
        :raises ValueError: for invalid parameters
        :raises UnsupportedModelError: for a model BESS cannot shard (e.g. one with batch normalization, such
            as ConvE); both a ``ValueError`` and a ``NotImplementedError``
        :raises NotImplementedError: for features BESS does not support (inductive mode)
        """
        if kwargs.get("mode") is not None:
            raise NotImplementedError("BessTrainingLoop supports transductive training only (mode=None).")
        check_keyword_arguments(type(self), SLCWATrainingLoop, kwargs)
        self.refuse_uncalled_hooks()
        # the named options as PyKEEN matches names ("Token", "HT", "one-per-group"): canonical from here on
        partition = canonical_choice(partition, PARTITIONS)
        corruption = canonical_choice(corruption, CORRUPTIONS)
        replica_grouping = canonical_choice(replica_grouping, GROUPINGS)
        checkpoint_retrieval = canonical_choice(checkpoint_retrieval, CHECKPOINT_RETRIEVALS)
        negatives = canonical_choice(negatives, NEGATIVES)
        checkpoint_format = canonical_choice(checkpoint_format, CHECKPOINT_FORMATS)
        sharding = canonical_choice(sharding, SHARDINGS)
        # a model an earlier loop trained with tables in host memory or files: its embeddings again
        unshard_model(model)
        num_negs_per_pos = resolve_negative_sampler(
            negative_sampler, negative_sampler_kwargs, num_negs_per_pos, corruption
        )
        #: the negatives per positive the user gave the loop (None: its default); train() warns when it replaces them
        self.chosen_num_negs_per_pos = num_negs_per_pos
        super().__init__(model=model, triples_factory=triples_factory, **kwargs)
        table_storage = make_storage(storage, storage_path, storage_kwargs)
        table_storage.defer_existing_files()  # files of an earlier run: kept until train() knows if it resumes
        with (
            table_storage.discarded_on_failure()
        ):  # a loop failing to build leaves no files (a corrected run finds them)
            if any(parameter.is_meta for parameter in model.parameters()):  # built without its full tables
                materialize(model, table_storage, torch.device(device or "cpu"))
            elif device is not None and not _same_device(torch.device(device), model.device):
                raise ValueError(
                    f"device={device!r} is for a model built on the meta device, not one on {model.device}."
                )
            # the optimizer the base class built (or the pipeline passed) defines class and hyper-parameters
            self.optimizer_cls = type(self.optimizer)
            self.optimizer_kwargs = optimizer_hyperparameters(self.optimizer, scheduled=self.lr_scheduler is not None)
            exchange = canonical_exchange(exchange)  # (any spelling the scheme resolver accepts: "Auto", "Encoding")
            #: the settings the partition-dependent parts are built from (again if exchange="auto" changes it)
            self.settings = LoopSettings(
                model=cast(ERModel, model),
                embeddings=check_model(model),
                storage=table_storage,
                num_shards=num_shards,
                process_group=process_group,
                replicas=replicas,
                replica_grouping=replica_grouping,
                exchange=exchange,
                partition=partition,
                corruption=corruption,
                num_negs_per_pos=num_negs_per_pos,
                seed=seed,
                sparse_updates=sparse_updates,
                memory_budget=memory_budget,
                checkpoint_retrieval=checkpoint_retrieval,
                schema=schema_of(triples_factory),
                factory=triples_factory,
                negatives=negatives,
                checkpoint_format=checkpoint_format,
                sharding=sharding,
            )
            self._partition_chosen = False
            #: whether the last checkpoint loaded was written by PyTorch-BigGraph (no optimizer state to continue)
            self.resumed_from_pbg = False
            #: how many intra-op threads the steps use
            self.thread_policy = resolve_threads(num_threads, self.device)
            #: how the C library's allocator serves the steps' CPU tensors
            self.host_allocator = resolve_allocator(host_allocator, self.device)
            self.static_step = check_static_step(static_step)  # None: wherever the configuration allows
            if self.static_step and self.overrides_process_batch:  # (train() would refuse it, see epoch_steps)
                raise ValueError(
                    f"static_step=True: {type(self).__name__} overrides _process_batch, which only the eager step "
                    f"calls; pass static_step=False or None."
                )
            #: the step runner of the current (or last) training
            self.runner: StepRunner | None = None
            #: the static step of the current (or last) training; None where the eager step trained
            self.static: StaticStep | None = None
            self._partition: tuple[torch.Tensor, int, ShardPairPartition] | None = None
            #: the loss weights of the triples of the last partition a sampler was built for
            self._loss_weights: tuple[ShardPairPartition, torch.Tensor | None] | None = None
            self.loss_weighter = graph_loss_weighter(self.loss_weighter, self.loss, self.settings)
            self.reassemble(resolve_partition(partition, exchange)[0])

    # -- PyKEEN's training-loop interface ------------------------------------------------------

    def train(  # type: ignore[override]
        self,
        triples_factory: CoreTriplesFactory,
        num_epochs: int = 1,
        batch_size: int | None = None,
        *,
        num_negs_per_pos: int | None = None,
        **kwargs: Any,
    ) -> list[float] | None:
        """Train the model; see :meth:`pykeen.training.TrainingLoop.train` for all arguments.

        :param triples_factory: the training triples
        :param num_epochs: the number of epochs
        :param batch_size: positives per step, a positive integer (rounded up to a multiple of
            ``num_shards ** 2``, logged at INFO; a batch beyond every shardpair's triples trains as the one
            step that holds them); None searches the largest batch that fits (see
            :mod:`pykeen_bess.runtime.memory`) when ``automatic_memory_optimization`` is on, else uses 256
        :param num_negs_per_pos: overrides the constructor's value (HPO tunes it here); rounded up to a
            multiple of ``num_shards`` (logged), so that any tuned value works with any shard count
        :param kwargs: the other arguments of :meth:`pykeen.training.TrainingLoop.train`
            (``sub_batch_size``, ``checkpoint_name``, ``stopper``, ``callbacks``, ...)
        :returns: the loss of every epoch
        """
        check_train_arguments(num_epochs, batch_size, kwargs, has_optimizer=self.optimizer is not None)
        if num_negs_per_pos is not None:
            rounded = round_num_negs(num_negs_per_pos, self.topology.n_shard, self.chosen_num_negs_per_pos)
            config = dataclasses.replace(self.config, num_negs_per_pos=rounded)
            self.setup = dataclasses.replace(self.setup, config=config)
            self.settings = dataclasses.replace(self.settings, num_negs_per_pos=rounded)  # (a setup assembled again)
        check_triples_fit_model(triples_factory, self.model)
        check_model_dtype(self.model, {table.weight.dtype for table in self.tables})
        if asks_evaluation_loss(kwargs.get("callbacks")):
            self.check_evaluation_loss()  # before training starts
        self.adopt_checkpoint_seed(kwargs)
        path = checkpoint_path(kwargs)
        self.tables.storage.claim_existing(
            resuming=path is not None and path.is_file(), checkpoint=path, agree=self.topology.agree
        )
        if isinstance(self.checkpoints, PbgCheckpointStore):
            self.resumed_from_pbg = False
            prepare_pbg_checkpoint(self, kwargs)
        self.choose_partition(batch_size, kwargs)
        # without continue_training the tables are re-initialised (or loaded from a checkpoint)
        self.host_allocator.apply()
        installed = self.tables.installed(copy_weights=bool(kwargs.get("continue_training")))
        own_layout = not self.topology.is_distributed  # the stopper's file in the tables' layout meanwhile (12.)
        if own_layout:
            stopper_file_layout(kwargs.get("stopper"), self.tables.tables)
        try:
            with installed, self.thread_policy.applied():
                losses = super().train(triples_factory, num_epochs=num_epochs, batch_size=batch_size, **kwargs)
            if self.optimizer is None:  # clear_optimizer (pipeline()'s default): its steps held the optimizer's state
                self.release_steps()
            return losses
        finally:
            if own_layout:
                pykeen_layout_stopper_file(kwargs.get("stopper"), self.tables.tables, self.model.entity_representations)

    def _train(self, triples_factory: CoreTriplesFactory, **kwargs: Any) -> list[float] | None:  # type: ignore[override]
        """Run the BESS epochs (called by PyKEEN's ``TrainingLoop.train``); see :func:`.epochs.run_epochs`."""
        return run_epochs(self, triples_factory, **kwargs)


def _same_device(requested: torch.device, actual: torch.device) -> bool:
    """Whether ``actual`` is the ``requested`` device (``"cuda"`` names every CUDA device)."""
    return requested.type == actual.type and requested.index in (None, actual.index)
