"""Stage 7 of the pipeline: :class:`BessTrainingLoop`, BESS inside PyKEEN's training machinery.

The loop is a :class:`pykeen.training.SLCWATrainingLoop` (so ``pipeline()`` hands it the negative
sampler kwargs) that trains with the BESS stages of this package: the entity table as shard
tables (:mod:`~pykeen_bess.representation`), a shardpair partition of the triples
(:mod:`~pykeen_bess.partition`), balanced batches with shared negatives
(:mod:`~pykeen_bess.sampling`), an exchange scheme (:mod:`~pykeen_bess.schemes`) over a
collective back end (:mod:`~pykeen_bess.exchange`), fast shared-candidate scoring
(:mod:`~pykeen_bess.scoring`), PyKEEN's loss (:mod:`~pykeen_bess.loss`) and row-sparse updates
(:mod:`~pykeen_bess.optim`).

While :meth:`BessTrainingLoop.train` runs, the model's entity embeddings are replaced by
:class:`~pykeen_bess.representation.ShardedEmbedding` modules; in a single process they are
written back into the original embeddings when training ends (also on errors), so the trained
model is an ordinary PyKEEN model.
"""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
import os
import pathlib
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch
from class_resolver import HintOrType, OptionalKwargs
from pykeen.models import ERModel, Model
from pykeen.nn.representation import Embedding
from pykeen.regularizers import NoRegularizer, Regularizer
from pykeen.sampling import BasicNegativeSampler, NegativeSampler, negative_sampler_resolver
from pykeen.stoppers import Stopper
from pykeen.training import SLCWATrainingLoop
from pykeen.training.callbacks import (
    LearningRateSchedulerTrainingCallback,
    MultiTrainingCallback,
    StopperTrainingCallback,
    TrackerTrainingCallback,
    TrainingCallbackHint,
    TrainingCallbackKwargsHint,
)
from pykeen.training.training_loop import NonFiniteLossError, TrainingLoop, _get_lr_scheduler_kwargs
from pykeen.triples import CoreTriplesFactory
from pykeen.utils import get_batchnorm_modules
from tqdm.autonotebook import tqdm, trange

from .checkpoint import latest_own_version, rank_file, read_pointer, reshard_rank_state, save_distributed_checkpoint
from .exchange import DistributedExchange, Exchange, LocalExchange, ProbeExchange
from .loss import block_loss
from .memory import available_memory, fits_in_memory, search_largest
from .optim import BessOptimizer, optimizer_hyperparameters
from .partition import ShardPairPartition
from .representation import ShardedEmbedding
from .sampling import CORRUPTIONS, BessBatch, BessSampler, Corruption
from .schemes import SCHEMES, BessScheme, Scheme, choose_scheme, query_width
from .scoring import SharedCandidateScorer, get_scorer
from .sharding import EntitySharding

__all__ = [
    "BessTrainingLoop",
]

logger = logging.getLogger(__name__)

#: the default number of negatives per positive (rounded up to a multiple of the shard count)
DEFAULT_NUM_NEGS_PER_POS = 64

#: model names (``model_resolver`` keys, after registration) that BESS trains, named in error messages
SUPPORTED_MODEL_EXAMPLES = (
    "TransE",
    "DistMult",
    "ComplEx",
    "RotatE",
    "PairRE",
    "SimplE",
    "CP",
    "RESCAL",
    "InterHT",
    "TranS",
)


class BessTrainingLoop(SLCWATrainingLoop):
    """Train any PyKEEN ``ERModel`` with embedding tables with BESS.

    Use it through ``pipeline(training_loop="bess", training_loop_kwargs=dict(num_shards=4))``.
    One step is a balanced batch of ``num_shards ** 2`` blocks: the ``batch_size`` positives are
    split equally over the shardpairs (``block_size = ceil(batch_size / num_shards ** 2)``), and
    all positives of a block share ``num_negs_per_pos`` negatives drawn equally from every shard.
    See :mod:`pykeen_bess.sampling` for what an epoch is.
    """

    #: The knobs HPO tunes (they are ``train()`` keyword arguments, see :meth:`train`)
    hpo_default: ClassVar[Mapping[str, Mapping[str, Any]]] = dict(
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
        exchange: Scheme | Literal["auto"] = "embedding",
        corruption: Corruption = "ht",
        num_negs_per_pos: int | None = None,
        seed: int | None = None,
        sparse_updates: bool = True,
        process_group: Any = None,
        memory_budget: int | None = None,
        negative_sampler: HintOrType[NegativeSampler] = None,
        negative_sampler_kwargs: OptionalKwargs = None,
        **kwargs: Any,
    ) -> None:
        """Create the loop; every configuration error is raised here, before training starts.

        :param model: an ``ERModel`` whose entity representations are :class:`pykeen.nn.Embedding`
        :param triples_factory: the training triples
        :param num_shards: the number of entity shards ``n``; defaults to the world size inside a
            ``torch.distributed`` process group, else 1. In one process all ``n`` shards are held
            as logical shards.
        :param exchange: ``"embedding"`` (move tail and negative embeddings to the heads' shard),
            ``"score"`` (gather queries, move negative scores), or ``"auto"`` (the scheme that
            moves fewer bytes per step, see :func:`pykeen_bess.schemes.exchange_cost`)
        :param corruption: corrupt heads (``"h"``), tails (``"t"``) or both (``"ht"``: the first
            half of every block corrupts heads, the second half tails)
        :param num_negs_per_pos: negatives per positive, a multiple of ``num_shards``; also
            accepted from ``negative_sampler_kwargs`` (what ``pipeline()`` passes) and as a
            ``train()`` argument (what HPO tunes). Default: 64 rounded up to a multiple of
            ``num_shards``.
        :param seed: the seed of the sharding, the sampler and the per-shard initialisation;
            defaults to the model's random seed (``pipeline(random_seed=...)``), else 0
        :param sparse_updates: update the shard tables row-sparsely (see :mod:`pykeen_bess.optim`);
            set False to use any optimizer densely
        :param process_group: a ``torch.distributed`` process group to train in (default: the
            world group if one is initialised with more than one rank)
        :param memory_budget: bytes a memory probe may use on the CPU (default: half the memory
            available when the search starts); see :mod:`pykeen_bess.memory`
        :param negative_sampler: must be None or PyKEEN's basic sampler: BESS draws its own
            balanced, shared negatives
        :param negative_sampler_kwargs: only ``num_negs_per_pos`` is meaningful
        :param kwargs: passed to :class:`pykeen.training.TrainingLoop` (optimizer, lr scheduler,
            result tracker, ...)
        :raises ValueError: for an unsupported model or invalid parameters
        :raises NotImplementedError: for features BESS does not support (loss weighters, inductive
            mode)
        """
        if kwargs.get("loss_weighter") is not None:
            raise NotImplementedError("BessTrainingLoop does not support loss weighters.")
        if kwargs.get("mode") is not None:
            raise NotImplementedError("BessTrainingLoop supports transductive training only (mode=None).")
        num_negs_per_pos = _resolve_negative_sampler(negative_sampler, negative_sampler_kwargs, num_negs_per_pos)
        super().__init__(model=model, triples_factory=triples_factory, **kwargs)
        self.entity_embeddings = _check_model(model)

        self.exchange = _make_exchange(num_shards=num_shards, process_group=process_group)
        n_shard = self.exchange.n_shard
        if n_shard > model.num_entities:
            raise ValueError(f"num_shards={n_shard} is larger than the number of entities ({model.num_entities}).")
        if exchange not in (*SCHEMES, "auto"):
            raise ValueError(f"Unknown exchange={exchange!r}; expected one of {(*SCHEMES, 'auto')}.")
        if corruption not in CORRUPTIONS:
            raise ValueError(f"Unknown corruption={corruption!r}; expected one of {CORRUPTIONS}.")
        self.scheme_name = exchange
        self.corruption = corruption
        self.num_negs_per_pos = _check_num_negs(num_negs_per_pos, n_shard)
        if seed is None:
            seed = model._random_seed if model._random_seed is not None else 0
            if self.exchange.is_distributed:
                # every rank must shard and sample alike: without an explicit seed, rank 0's (e.g. the pipeline's
                # random seed, which hpo_pipeline draws per process) is used everywhere
                own = torch.tensor([int(seed) if self.exchange.is_main_process else 0], dtype=torch.long)
                seed = int(self.exchange.all_reduce(own)[0])
        self.seed = _check_integer("seed", seed, minimum=0)
        self.memory_budget = memory_budget

        self.sharding = EntitySharding.create(model.num_entities, n_shard, seed=self.seed)
        self.tables = [
            ShardedEmbedding(embedding, self.sharding, self.exchange.local_shards, seed=self.seed, table_index=index)
            for index, embedding in enumerate(self.entity_embeddings)
        ]
        self.scorer: SharedCandidateScorer = get_scorer(
            model.interaction,
            entity_representations=model.entity_representations,
            relation_representations=model.relation_representations,
        )
        self.sparse_updates = sparse_updates
        # the optimizer the base class built (or the pipeline passed) defines class and hyper-parameters
        self._optimizer_cls = type(self.optimizer)
        self._optimizer_kwargs = optimizer_hyperparameters(self.optimizer)
        self.optimizer = self._build_optimizer()
        if self.lr_scheduler is not None:
            self.lr_scheduler = self._rebuild_lr_scheduler()
        if self.exchange.is_distributed and not self.exchange.is_main_process:
            _silence(self.result_tracker)
        self._installed = False
        self._tables_hold_weights = False
        self._partition_cache: tuple[int, ShardPairPartition] | None = None
        logger.info("BESS: %s; exchange=%s, corruption=%s", self.sharding.describe(), exchange, corruption)

    # -- construction helpers ------------------------------------------------------------------

    def _dense_parameters(self) -> list[torch.nn.Parameter]:
        """Return the trainable parameters that are not entity tables (replicated on every worker)."""
        excluded = {id(embedding._embeddings.weight) for embedding in self.entity_embeddings}
        excluded.update(id(table.weight) for table in self.tables)
        return [p for p in self.model.parameters() if p.requires_grad and id(p) not in excluded]

    def _build_optimizer(self) -> BessOptimizer:
        return BessOptimizer(
            self._optimizer_cls,
            dense_params=self._dense_parameters(),
            table_params=[table.weight for table in self.tables],
            hyperparameters=self._optimizer_kwargs,
            sparse_updates=self.sparse_updates,
            # constraints (e.g. unit norm) are applied to the updated rows within the update
            row_constraints={table.weight: table.constrain_values for table in self.tables if table.constrainer},
        )

    def _rebuild_lr_scheduler(self) -> Any:
        assert self.lr_scheduler is not None
        return self.lr_scheduler.__class__(optimizer=self.optimizer, **_get_lr_scheduler_kwargs(self.lr_scheduler))

    # -- installing the shard tables -----------------------------------------------------------

    def _install(self, copy_weights: bool = True) -> None:
        """Swap the model's entity embeddings for the shard tables.

        :param copy_weights: copy the embeddings' weights into the shard tables; if False (training
            starts from a fresh initialisation or a checkpoint), the original weights are kept
            until the tables hold valid weights, so that an error before that loses nothing
        """
        for table in self.tables:
            table.defer_constraints = True
        if self._installed:  # under a process group the model stays sharded between train() calls
            return
        for index, (embedding, table) in enumerate(zip(self.entity_embeddings, self.tables)):
            table.to(embedding._embeddings.weight.device)
            self.model.entity_representations[index] = table
        self._installed = True
        self._tables_hold_weights = False
        if copy_weights:
            for embedding, table in zip(self.entity_embeddings, self.tables):
                table.copy_from(embedding)
            self._tables_now_hold_weights()

    def _tables_now_hold_weights(self) -> None:
        """Mark the shard tables as the weights' owner and release the full tables meanwhile."""
        if self._tables_hold_weights:
            return
        for embedding, table in zip(self.entity_embeddings, self.tables):
            weight = embedding._embeddings.weight
            weight.data = weight.data.new_empty(0, table.row_width)
        self._tables_hold_weights = True

    def _uninstall(self) -> None:
        """Write the shard tables back into the original embeddings (if they hold the weights).

        Under a process group no rank holds the full table: the model stays sharded (see
        :func:`pykeen_bess.distributed.save_to_directory` and :func:`~pykeen_bess.distributed.export_model`).
        """
        if not self._installed:
            return
        if self.exchange.is_distributed:
            for table in self.tables:
                table.defer_constraints = False
            return
        for index, (embedding, table) in enumerate(zip(self.entity_embeddings, self.tables)):
            table.defer_constraints = False
            if self._tables_hold_weights:
                table.copy_to(embedding)
            self.model.entity_representations[index] = embedding
        # BessEvaluator evaluates with the training's sharding by default
        self.model.bess_sharding = dict(num_shards=self.exchange.n_shard, seed=self.seed)
        self._installed = False
        self._tables_hold_weights = False

    # -- checkpoints ---------------------------------------------------------------------------

    def _save_state(
        self,
        path: Any,
        stopper: Stopper | None = None,
        best_epoch_model_checkpoint_file_path: pathlib.Path | None = None,
        triples_factory: CoreTriplesFactory | None = None,
    ) -> None:
        if not self.exchange.is_distributed:
            super()._save_state(
                path=path,
                stopper=stopper,
                best_epoch_model_checkpoint_file_path=best_epoch_model_checkpoint_file_path,
                triples_factory=triples_factory,
            )
            return
        best = None
        if best_epoch_model_checkpoint_file_path is not None:
            best = self._rank_checkpoint_file(pathlib.Path(best_epoch_model_checkpoint_file_path))

        def write(file: pathlib.Path) -> None:
            TrainingLoop._save_state(
                self,
                path=file,
                stopper=stopper,
                best_epoch_model_checkpoint_file_path=best,
                triples_factory=triples_factory,
            )

        save_distributed_checkpoint(
            pathlib.Path(path),
            self.exchange,
            write,
            epoch=self._epoch,
            seed=self.seed,
            random_seed=self.model._random_seed,
            stopper_dict=stopper.get_summary_dict() if stopper is not None else None,
        )

    def _rank_checkpoint_file(self, path: pathlib.Path) -> pathlib.Path | None:
        """Return this rank's file of the checkpoint at ``path`` (same world size), None if resharding."""
        rank, world_size = self.exchange.local_shards[0], self.exchange.n_shard
        pointer = read_pointer(path)
        if pointer is None:
            version = latest_own_version(path, rank, world_size)
            if version is None:
                return path if path.is_file() else None  # a plain PyKEEN checkpoint file
            return rank_file(path, version, rank, world_size)
        if pointer["world_size"] == world_size:
            return rank_file(path, pointer["version"], rank, world_size)
        return None

    def _load_state(self, path: str | pathlib.Path, triples_factory: CoreTriplesFactory | None = None) -> Any:
        if self.exchange.is_distributed:
            path = pathlib.Path(path)
            file = self._rank_checkpoint_file(path)
            if file is None:
                pointer = read_pointer(path)
                if pointer is None:
                    raise FileNotFoundError(f"No checkpoint for rank {self.exchange.local_shards[0]} at {path}.")
                if int(pointer.get("seed", self.seed)) != self.seed:
                    raise ValueError(
                        f"Checkpoint {path} was written with sharding seed {pointer['seed']}, this run uses "
                        f"{self.seed}: pass seed={pointer['seed']} to resume it."
                    )
                result = self._load_resharded(path, pointer, triples_factory)
            else:
                result = super()._load_state(path=file, triples_factory=triples_factory)
        else:
            if read_pointer(pathlib.Path(path)) is not None:
                raise ValueError(
                    f"{path} is a checkpoint of a torch.distributed run; resume it under torchrun (any number of "
                    f"ranks: it is resharded), or load its model with pykeen_bess.distributed.export_model first."
                )
            result = super()._load_state(path=path, triples_factory=triples_factory)
        self._tables_now_hold_weights()
        return result

    def _load_resharded(self, path: pathlib.Path, pointer: Mapping[str, Any], triples_factory: Any) -> Any:
        """Load a checkpoint written by another number of ranks, resharding the entity tables."""
        logger.warning(
            "Resharding checkpoint %s from %d to %d ranks.", path, pointer["world_size"], self.exchange.n_shard
        )
        table_ids = {id(table.weight) for table in self.tables}
        table_keys = [name for name, param in self.model.named_parameters() if id(param) in table_ids]
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        table_indices = [index for index, param in enumerate(params) if id(param) in table_ids]
        state = reshard_rank_state(
            path=path,
            version=int(pointer["version"]),
            old_world_size=int(pointer["world_size"]),
            seed=self.seed,
            sharding=self.sharding,
            rank=self.exchange.local_shards[0],
            table_keys=table_keys,
            table_param_indices=table_indices,
        )
        state["checksum"] = self.checksum  # the representation of the shard tables names the world size
        with tempfile.TemporaryDirectory() as directory:
            file = pathlib.Path(directory, "resharded.pt")
            torch.save(state, file)
            return super()._load_state(path=file, triples_factory=triples_factory)

    # -- training ------------------------------------------------------------------------------

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
            ``num_shards ** 2``, logged at INFO); None searches the largest batch that fits (see
            :mod:`pykeen_bess.memory`) when ``automatic_memory_optimization`` is on, else uses 256
        :param num_negs_per_pos: overrides the constructor's value (HPO tunes it here); rounded up to a
            multiple of ``num_shards`` (logged), so that any tuned value works with any shard count
        :param kwargs: the other arguments of :meth:`pykeen.training.TrainingLoop.train`
            (``sub_batch_size``, ``checkpoint_name``, ``stopper``, ``callbacks``, ...)
        :returns: the loss of every epoch
        """
        _check_integer("num_epochs", num_epochs, minimum=0)
        if batch_size is not None:
            _check_integer("batch_size", batch_size, minimum=1, hint="or None to search the largest that fits")
        if kwargs.get("sub_batch_size") is not None:
            _check_integer("sub_batch_size", kwargs["sub_batch_size"], minimum=1, hint="or None")
        if num_negs_per_pos is not None:
            self.num_negs_per_pos = _round_num_negs(num_negs_per_pos, self.exchange.n_shard)
        _check_triples_fit_model(triples_factory, self.model)
        # without continue_training the tables are re-initialised (or loaded from a checkpoint)
        self._install(copy_weights=bool(kwargs.get("continue_training")))
        try:
            return super().train(
                triples_factory=triples_factory, num_epochs=num_epochs, batch_size=batch_size, **kwargs
            )
        finally:
            self._uninstall()

    def configuration(self, **train_kwargs: Any) -> dict[str, str]:
        """Return the settings every rank must share, as strings (see :meth:`_verify_configuration`)."""
        model = self.model
        dense = {
            name: tuple(p.shape)
            for name, p in model.named_parameters()
            if p.requires_grad and not any(p is table.weight for table in self.tables)
        }
        config = dict(
            model=type(model).__name__,
            interaction=repr(model.interaction),
            loss=repr(model.loss),
            num_entities=model.num_entities,
            num_relations=model.num_relations,
            entity_tables=[(t.row_width, str(t.weight.dtype)) for t in self.tables],
            replicated_parameters=dense,
            optimizer=self._optimizer_cls.__name__,
            optimizer_kwargs=sorted((k, repr(v)) for k, v in self._optimizer_kwargs.items()),
            lr_scheduler=type(self.lr_scheduler).__name__ if self.lr_scheduler is not None else None,
            num_shards=self.exchange.n_shard,
            exchange=self.scheme_name,
            corruption=self.corruption,
            num_negs_per_pos=self.num_negs_per_pos,
            seed=self.seed,
            sparse_updates=self.sparse_updates,
            **train_kwargs,
        )
        return {key: repr(value) for key, value in config.items()}

    def _verify_configuration(self, triples_factory: CoreTriplesFactory, **train_kwargs: Any) -> None:
        """Check that all ranks run the same configuration on the same triples (collective).

        :raises ValueError: naming every setting that differs between ranks
        """
        if not self.exchange.is_distributed:
            return
        import torch.distributed as dist

        triples = triples_factory.mapped_triples.contiguous().numpy()
        config = self.configuration(
            triples=f"{triples.shape[0]} triples, sha1 {hashlib.sha1(triples.tobytes()).hexdigest()}", **train_kwargs
        )
        configs: list[Any] = [None] * self.exchange.n_shard
        dist.all_gather_object(configs, config, group=getattr(self.exchange, "group", None))
        differences = {
            key: [c.get(key) for c in configs]
            for key in sorted(set().union(*configs))
            if len({c.get(key) for c in configs}) > 1
        }
        if differences:
            lines = "\n".join(
                f"  {key}: " + ", ".join(f"rank {r}={v}" for r, v in enumerate(values))
                for key, values in differences.items()
            )
            hint = ""
            if differences.keys() & {"batch_size", "num_epochs", "num_negs_per_pos"}:
                hint = (
                    "\nUnder hpo_pipeline every rank must draw the same trials: give all ranks the same sampler seed, "
                    "e.g. hpo_pipeline(..., sampler='random', sampler_kwargs=dict(seed=0))."
                )
            raise ValueError(f"The ranks of the process group run different configurations:\n{lines}{hint}")

    def _broadcast_replicated(self) -> None:
        """Give every rank rank 0's replicated parameters (after a reset)."""
        if not self.exchange.is_distributed:
            return
        import torch.distributed as dist

        for param in self._dense_parameters():
            dist.broadcast(param.data, src=0, group=getattr(self.exchange, "group", None))

    def _partition(self, triples_factory: CoreTriplesFactory) -> ShardPairPartition:
        """Partition the training triples (with inverse triples if the model uses them), cached."""
        key = id(triples_factory.mapped_triples)
        if self._partition_cache is None or self._partition_cache[0] != key:
            mapped_triples = triples_factory._add_inverse_triples_if_necessary(triples_factory.mapped_triples)
            self._partition_cache = (key, ShardPairPartition.from_triples(mapped_triples, self.sharding))
        return self._partition_cache[1]

    def _block_size(self, batch_size: int) -> int:
        n2 = self.exchange.n_shard**2
        block_size = max(1, math.ceil(batch_size / n2))
        if block_size * n2 != batch_size:
            logger.info(
                "batch_size=%d rounded up to %d, a multiple of num_shards**2=%d (%d blocks of %d slots).",
                batch_size,
                block_size * n2,
                n2,
                n2,
                block_size,
            )
        return block_size

    def _make_scheme(self, block_size: int, exchange: Exchange | None = None) -> BessScheme:
        scheme = self.scheme_name
        if scheme == "auto":
            scheme = choose_scheme(
                n_shard=self.exchange.n_shard,
                block_size=block_size,
                num_negs_per_pos=self.num_negs_per_pos,
                entity_width=sum(table.row_width for table in self.tables),
                query_width=query_width(self.scorer, self.model, self.tables),  # type: ignore[arg-type]
            )
        return BessScheme(
            model=self.model,  # type: ignore[arg-type]
            tables=self.tables,
            scorer=self.scorer,
            exchange=self.exchange if exchange is None else exchange,
            scheme=scheme,  # type: ignore[arg-type]
        )

    def _sampler(self, partition: ShardPairPartition, block_size: int) -> BessSampler:
        return BessSampler(
            partition,
            block_size=block_size,
            num_negs_per_pos=self.num_negs_per_pos,
            corruption=self.corruption,
            seed=self.seed,
        )

    def _train(
        self,
        triples_factory: CoreTriplesFactory,
        num_epochs: int = 1,
        batch_size: int | None = None,
        slice_size: int | None = None,
        label_smoothing: float = 0.0,
        sampler: str | None = None,
        continue_training: bool = False,
        only_size_probing: bool = False,
        use_tqdm: bool = True,
        use_tqdm_batch: bool = True,
        tqdm_kwargs: Mapping[str, Any] | None = None,
        stopper: Stopper | None = None,
        sub_batch_size: int | None = None,
        num_workers: int | None = None,
        save_checkpoints: bool = False,
        checkpoint_path: None | str | pathlib.Path = None,
        checkpoint_frequency: int | None = None,
        checkpoint_on_failure_file_path: None | str | pathlib.Path = None,
        best_epoch_model_file_path: pathlib.Path | None = None,
        last_best_epoch: int | None = None,
        drop_last: bool | None = None,
        callbacks: TrainingCallbackHint = None,
        callbacks_kwargs: TrainingCallbackKwargsHint = None,
        gradient_clipping_max_norm: float | None = None,
        gradient_clipping_norm_type: float | None = None,
        gradient_clipping_max_abs_value: float | None = None,
        pin_memory: bool = True,
    ) -> list[float] | None:
        """Run the BESS epochs (called by :meth:`pykeen.training.TrainingLoop.train`)."""
        if slice_size is not None:
            raise ValueError("BessTrainingLoop does not support slice_size; use sub_batch_size.")
        if sampler is not None:
            raise ValueError(f"BessTrainingLoop draws its own balanced batches; sampler={sampler!r} is not supported.")
        if drop_last:
            logger.info("drop_last has no effect: BESS steps never have incomplete batches (they are padded).")
        if num_workers:
            logger.info("num_workers has no effect: BESS sampling is vectorised in the main process.")
        main = self.exchange.is_main_process
        partition = self._partition(triples_factory)

        callback = MultiTrainingCallback(callbacks=callbacks, callbacks_kwargs=callbacks_kwargs)
        if self.result_tracker is not None and main:
            callback.register_callback(TrackerTrainingCallback())
        if stopper is not None:
            callback.register_callback(
                StopperTrainingCallback(
                    stopper,
                    triples_factory=triples_factory,
                    last_best_epoch=last_best_epoch,
                    best_epoch_model_file_path=best_epoch_model_file_path,
                )
            )
        if self.lr_scheduler is not None:
            callback.register_callback(LearningRateSchedulerTrainingCallback())
        callback.register_training_loop(self)

        self._verify_configuration(
            triples_factory=triples_factory,
            num_epochs=num_epochs,
            batch_size=batch_size,
            sub_batch_size=sub_batch_size,
            label_smoothing=label_smoothing,
            continue_training=continue_training,
        )
        if not continue_training:
            self.model.reset_parameters_()
            for table in self.tables:  # the loop defers the tables' constraints; apply them once to all rows
                table.constrain_rows(table.real_rows())
            self._broadcast_replicated()
            self._tables_now_hold_weights()
            self.optimizer = self._build_optimizer()
            if self.lr_scheduler is not None:
                self.lr_scheduler = self._rebuild_lr_scheduler()
        elif not self.optimizer.state:
            raise ValueError("Cannot continue_training without being trained once.")

        if batch_size is None:
            if self.automatic_memory_optimization:
                batch_size = self._search_batch_size(partition, label_smoothing)
            else:
                batch_size = 256
                logger.info("No batch_size provided. Setting batch_size=%d.", batch_size)
        block_size = self._block_size(batch_size)
        if sub_batch_size is not None:
            sub_block_size = max(1, min(block_size, sub_batch_size // self.exchange.n_shard**2))
        elif self.automatic_memory_optimization and not only_size_probing and not continue_training:
            sub_block_size = self._search_sub_block_size(partition, block_size, label_smoothing)
        else:
            sub_block_size = block_size

        batch_sampler = self._sampler(partition, block_size)
        scheme = self._make_scheme(block_size)
        if main and not only_size_probing:
            logger.info(
                "BESS: %d steps per epoch of %d blocks x %d slots (sub-batches of %d), %d negatives per positive "
                "(%d per shard), exchange=%s, padding %.1f%%",
                len(batch_sampler),
                self.exchange.n_shard**2,
                block_size,
                sub_block_size,
                self.num_negs_per_pos,
                batch_sampler.negatives_per_shard,
                scheme.scheme,
                100 * batch_sampler.padding_fraction,
            )

        show_epochs = use_tqdm and main and not only_size_probing
        epoch_kwargs = dict(desc=f"Training epochs on {self.device}", unit="epoch", disable=not show_epochs)
        epoch_kwargs.update(tqdm_kwargs or {})
        epochs = trange(self._epoch + 1, 1 + num_epochs, initial=self._epoch, total=num_epochs, **epoch_kwargs)
        last_checkpoint = time.time()
        global_step = self._epoch * len(batch_sampler)
        for epoch in epochs:
            try:
                self.model.train()
                batches = tqdm(
                    batch_sampler.epoch(epoch),
                    total=len(batch_sampler),
                    desc=f"Training batches on {self.device}",
                    leave=False,
                    unit="batch",
                    disable=not (show_epochs and use_tqdm_batch),
                )
                epoch_loss = 0.0
                for batch in batches:
                    global_step += 1
                    epoch_loss += self._train_step(
                        scheme=scheme,
                        batch=batch,
                        sub_block_size=sub_block_size,
                        label_smoothing=label_smoothing,
                        callback=callback,
                        global_step=global_step,
                        num_steps=len(batch_sampler),
                        gradient_clipping_max_norm=gradient_clipping_max_norm,
                        gradient_clipping_norm_type=gradient_clipping_norm_type,
                        gradient_clipping_max_abs_value=gradient_clipping_max_abs_value,
                    )
                    if only_size_probing:
                        return None
                epoch_loss /= len(batch_sampler)
                self.losses_per_epochs.append(epoch_loss)
                epochs.set_postfix(
                    dict(
                        loss=epoch_loss,
                        prev_loss=self.losses_per_epochs[-2] if len(self.losses_per_epochs) > 1 else float("nan"),
                    )
                )
                self._epoch = epoch
            except (MemoryError, RuntimeError) as error:
                if only_size_probing or isinstance(error, NonFiniteLossError):
                    # a non-finite loss leaves no partial update behind and must not be checkpointed
                    raise
                logger.warning("The training loop failed during epoch %d: %s", epoch, error)
                if checkpoint_on_failure_file_path and not self.exchange.is_distributed:
                    self._save_state(
                        path=checkpoint_on_failure_file_path, stopper=stopper, triples_factory=triples_factory
                    )
                    logger.warning(
                        "Saved a failure checkpoint (the current parameters, epoch counter at the last finished "
                        "epoch) to %s",
                        checkpoint_on_failure_file_path,
                    )
                raise

            callback.post_epoch(epoch=epoch, epoch_loss=epoch_loss)

            if save_checkpoints and checkpoint_path is not None:
                minutes = (time.time() - last_checkpoint) // 60
                if minutes >= (checkpoint_frequency or 0) or self._should_stop or epoch == num_epochs:
                    best = best_epoch_model_file_path if last_best_epoch is not None else None
                    self._save_checkpoint(checkpoint_path, stopper, best, triples_factory)
                    last_checkpoint = time.time()

            if self._should_stop:
                if last_best_epoch is not None and best_epoch_model_file_path is not None:
                    self._load_state(path=best_epoch_model_file_path)
                    _remove(best_epoch_model_file_path)
                return self.losses_per_epochs

        callback.post_train(losses=self.losses_per_epochs)
        if stopper is not None and last_best_epoch is not None and best_epoch_model_file_path is not None:
            self._load_state(path=best_epoch_model_file_path)
            _remove(best_epoch_model_file_path)
        return self.losses_per_epochs

    def _save_checkpoint(
        self,
        path: str | pathlib.Path,
        stopper: Stopper | None,
        best_epoch_model_file_path: pathlib.Path | None,
        triples_factory: CoreTriplesFactory,
    ) -> None:
        """Write a checkpoint atomically: a crash while writing keeps the previous one intact."""
        path = pathlib.Path(path)
        if self.exchange.is_distributed:  # versioned rank files and a pointer (see pykeen_bess.checkpoint)
            self._save_state(path, stopper, best_epoch_model_file_path, triples_factory)
            return
        # a name of this process' own: two processes writing one checkpoint must not share a temporary file
        temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        try:
            self._save_state(
                path=temporary,
                stopper=stopper,
                best_epoch_model_checkpoint_file_path=best_epoch_model_file_path,
                triples_factory=triples_factory,
            )
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)

    # -- one step ------------------------------------------------------------------------------

    def _forward_backward(
        self, scheme: BessScheme, batch: BessBatch, sub_block_size: int, label_smoothing: float
    ) -> tuple[torch.Tensor, Any]:
        """Run forward and backward of all sub-batches of a step; return the local loss sum."""
        gathered = scheme.gather(batch)
        total = torch.zeros((), dtype=torch.float64)
        for start in range(0, batch.block_size, sub_block_size):
            scores = scheme.scores(batch, gathered, start, min(start + sub_block_size, batch.block_size))
            loss = block_loss(
                self.loss,
                scores,
                num_valid_step=batch.num_valid,
                label_smoothing=label_smoothing,
                num_entities=self.model.num_entities,
            )
            # what the scheme did not collect (e.g. weight regularizers) is replicated: add this
            # process' share of this sub-batch
            stop = min(start + sub_block_size, batch.block_size)
            share = (stop - start) / batch.block_size * self.exchange.n_local / self.exchange.n_shard
            # regularizer terms have shape [1]
            loss = (loss + self.model.collect_regularization_term() * share).sum()
            loss.backward()
            total += loss.detach().to(total)
            self.model.post_forward_pass()
        return total, gathered

    def _train_step(
        self,
        scheme: BessScheme,
        batch: BessBatch,
        sub_block_size: int,
        label_smoothing: float,
        callback: MultiTrainingCallback,
        global_step: int,
        num_steps: int,
        gradient_clipping_max_norm: float | None,
        gradient_clipping_norm_type: float | None,
        gradient_clipping_max_abs_value: float | None,
    ) -> float:
        callback.pre_batch()
        self.optimizer.zero_grad(set_to_none=True)
        local_loss, gathered = self._forward_backward(scheme, batch, sub_block_size, label_smoothing)
        step_loss = float(self.exchange.all_reduce(local_loss))
        if not math.isfinite(step_loss):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(
                f"The loss is non-finite ({step_loss}) in epoch {batch.epoch}, step {batch.step + 1}/{num_steps} "
                f"(global step {global_step}). The step was not applied, and no checkpoint was written for it. "
                f"Lower the learning rate, add gradient clipping or check the model's constraints."
            )
        scheme.set_row_gradients(gathered, dense=not self.sparse_updates)
        self._reduce_replicated_gradients()
        callback.on_batch(epoch=batch.epoch, batch=batch, batch_loss=step_loss)
        callback.pre_step()
        if gradient_clipping_max_norm is not None:
            self._clip_grad_norm(gradient_clipping_max_norm, gradient_clipping_norm_type or 2.0)
        if gradient_clipping_max_abs_value is not None:
            self._clip_grad_value(gradient_clipping_max_abs_value)
        self.optimizer.step()
        if not self.sparse_updates:  # the row-sparse rules apply the constraints themselves
            for table in self.tables:
                table.constrain_rows(gathered.real_rows)
        self.model.post_parameter_update()
        self.optimizer.zero_grad(set_to_none=True)
        callback.post_batch(epoch=batch.epoch, batch=batch)
        return step_loss

    def _reduce_replicated_gradients(self) -> None:
        """Sum the gradients of replicated parameters over the processes (no-op in one process)."""
        if not self.exchange.is_distributed:
            return
        for param in self._dense_parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            param.grad.copy_(self.exchange.all_reduce(param.grad))

    def _gradients(self) -> list[torch.Tensor]:
        """Return the local gradient values: dense gradients and the values of row-sparse ones."""
        grads = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grads.append(param.grad._values() if param.grad.is_sparse else param.grad)
        return grads

    def _clip_grad_norm(self, max_norm: float, norm_type: float) -> None:
        """Clip by the *global* gradient norm: every process' shard gradients, replicated ones once.

        Equals :func:`torch.nn.utils.clip_grad_norm_` over all parameters of the unsharded model.
        """
        replicated = [p.grad for p in self._dense_parameters() if p.grad is not None]
        sharded = [
            table.weight.grad._values() if table.weight.grad.is_sparse else table.weight.grad
            for table in self.tables
            if table.weight.grad is not None
        ]
        if math.isinf(norm_type):
            local = max((float(g.abs().max()) for g in sharded if g.numel()), default=0.0)
            total = max(
                float(self.exchange.all_reduce_max(torch.tensor(local, dtype=torch.float64))),
                max((float(g.abs().max()) for g in replicated if g.numel()), default=0.0),
            )
        else:
            local = sum(float(g.abs().pow(norm_type).sum()) for g in sharded)
            shared = sum(float(g.abs().pow(norm_type).sum()) for g in replicated)
            total = (float(self.exchange.all_reduce(torch.tensor(local, dtype=torch.float64))) + shared) ** (
                1.0 / norm_type
            )
        coefficient = max_norm / (total + 1e-6)
        if coefficient < 1.0:
            for grad in self._gradients():
                grad.mul_(coefficient)

    def _clip_grad_value(self, max_abs_value: float) -> None:
        for grad in self._gradients():
            grad.clamp_(-max_abs_value, max_abs_value)

    # -- memory search -------------------------------------------------------------------------

    def _probe(
        self, partition: ShardPairPartition, block_size: int, sub_block_size: int, label_smoothing: float
    ) -> None:
        """Forward and backward of one step without updating anything or communicating."""
        exchange = self.exchange if isinstance(self.exchange, LocalExchange) else ProbeExchange(self.exchange)
        scheme = self._make_scheme(block_size, exchange=exchange)
        batch = next(iter(self._sampler(partition, block_size).epoch(1)))
        try:
            self._forward_backward(scheme, batch, sub_block_size, label_smoothing)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.collect_regularization_term()

    def _budget(self) -> int | None:
        if self.memory_budget is not None:
            return self.memory_budget
        if self.device.type == "cuda":
            return None  # out-of-memory errors are raised, and caught
        available = available_memory(self.device)
        return None if available is None else available // 2

    def _search_batch_size(self, partition: ShardPairPartition, label_smoothing: float) -> int:
        """Find the largest batch size (a power of two, at most the number of triples) that fits."""
        budget = self._budget()
        n2 = self.exchange.n_shard**2

        def fits(batch_size: int) -> bool:
            block = max(1, math.ceil(batch_size / n2))
            return fits_in_memory(lambda: self._probe(partition, block, block, label_smoothing), self.device, budget)[0]

        maximum = max(n2, partition.num_triples)
        batch_size, found = search_largest(
            fits, start=min(8192, maximum), maximum=maximum, exchange=self.exchange, description="batch_size"
        )
        if not found:
            raise MemoryError(f"Even batch_size=1 ({n2} slots) does not fit in memory with these parameters.")
        # the same number of steps with the smallest blocks: the last step of an epoch is then (nearly) full
        # instead of mostly padding (e.g. 8,544 triples in batches of 8,192 would be 48% padding)
        largest_pair = int(partition.pair_counts.max())
        steps = max(1, math.ceil(largest_pair / max(1, math.ceil(batch_size / n2))))
        balanced = math.ceil(largest_pair / steps) * n2
        logger.info(
            "Automatic memory optimization chose batch_size=%d (the largest power of two that fits: %d; %d steps per "
            "epoch).",
            balanced,
            batch_size,
            steps,
        )
        return balanced

    def _search_sub_block_size(self, partition: ShardPairPartition, block_size: int, label_smoothing: float) -> int:
        """Check that a step fits; otherwise find the largest sub-batch (slots per block) that does."""
        budget = self._budget()

        def fits(sub_block: int) -> bool:
            return fits_in_memory(
                lambda: self._probe(partition, block_size, sub_block, label_smoothing), self.device, budget
            )[0]

        sub_block, found = search_largest(
            fits, start=block_size, maximum=block_size, exchange=self.exchange, description="slots per sub-batch"
        )
        if not found:
            raise MemoryError(
                "The model cannot be trained on this hardware with these parameters: even sub-batches of one slot "
                "per block do not fit. Reduce num_negs_per_pos, the embedding dimension or num_shards."
            )
        if sub_block < block_size:
            logger.info("Automatic memory optimization: sub-batches of %d slots per block.", sub_block)
        return sub_block

    def _slice_size_search(self, **kwargs: Any) -> int:
        raise MemoryError("BessTrainingLoop does not support slicing; use sub-batching.")

    def _create_training_data_loader(self, triples_factory: CoreTriplesFactory, **kwargs: Any) -> Any:
        raise NotImplementedError("BessTrainingLoop samples its own balanced batches (see pykeen_bess.sampling).")


def _silence(result_tracker: Any) -> None:
    """Stop a (multi) result tracker from logging: only rank 0 logs under a process group.

    The pipeline's in-memory :class:`~pykeen.trackers.PythonResultTracker` stays (the pipeline reads
    its configuration back); trackers that write files or talk to services are dropped.
    """
    from pykeen.trackers import PythonResultTracker

    trackers = getattr(result_tracker, "trackers", None)
    if isinstance(trackers, list):
        trackers[:] = [tracker for tracker in trackers if isinstance(tracker, PythonResultTracker)]


def _remove(path: pathlib.Path) -> None:
    if path.is_file():
        os.remove(path)


def _make_exchange(num_shards: int | None, process_group: Any) -> Exchange:
    """Choose the collective back end: a process group (explicit or initialised) or local shards."""
    import torch.distributed as dist

    from .distributed import join_torchrun_group

    if process_group is None:
        join_torchrun_group()
    in_group = process_group is not None or (
        dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    )
    if in_group:
        exchange = DistributedExchange(process_group)
        if num_shards is not None and num_shards != exchange.n_shard:
            raise ValueError(
                f"num_shards={num_shards} differs from the process group's world size {exchange.n_shard}; under "
                f"torch.distributed every rank holds exactly one shard (leave num_shards unset)."
            )
        return exchange
    if num_shards is None:
        num_shards = 1
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive integer, but is {num_shards!r}.")
    return LocalExchange(num_shards)


def _check_integer(name: str, value: Any, minimum: int, hint: str = "") -> int:
    """Return ``value`` as an ``int`` if it is an integer ``>= minimum``; else raise an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {expected}{' ' + hint if hint else ''}, but is {value!r}.")
    return int(value)


def _round_num_negs(num_negs_per_pos: Any, n_shard: int) -> int:
    """Round a tuned ``num_negs_per_pos`` (``train()``, HPO) up to a multiple of the number of shards."""
    value = _check_integer("num_negs_per_pos", num_negs_per_pos, minimum=1)
    rounded = n_shard * math.ceil(value / n_shard)
    if rounded != value:
        logger.info(
            "num_negs_per_pos=%d rounded up to %d, a multiple of num_shards=%d (every shard contributes equally).",
            value,
            rounded,
            n_shard,
        )
    return rounded


def _check_num_negs(num_negs_per_pos: int | None, n_shard: int) -> int:
    if num_negs_per_pos is None:
        return n_shard * math.ceil(DEFAULT_NUM_NEGS_PER_POS / n_shard)
    num_negs_per_pos = _check_integer("num_negs_per_pos", num_negs_per_pos, minimum=1)
    if num_negs_per_pos % n_shard:
        raise ValueError(
            f"num_negs_per_pos={num_negs_per_pos} is not usable with num_shards={n_shard}: BESS draws the same number "
            f"of negatives from every shard, so it must be a multiple of num_shards (e.g. "
            f"{n_shard * math.ceil(num_negs_per_pos / n_shard)})."
        )
    return num_negs_per_pos


def _check_triples_fit_model(triples_factory: CoreTriplesFactory, model: Model) -> None:
    """Check that the training triples use only entity and relation ids the model has.

    :raises ValueError: naming the offending ids (a factory changed after the model was created)
    """
    triples = triples_factory.mapped_triples
    if triples.ndim != 2 or triples.shape[1] != 3:
        raise ValueError(f"triples_factory.mapped_triples must have shape [n, 3], but has {list(triples.shape)}.")
    if triples.shape[0] == 0:
        raise ValueError("triples_factory holds no training triples.")
    problems = []
    for name, ids, upper in (
        ("entity", triples[:, [0, 2]], model.num_entities),
        ("relation", triples[:, 1], model.num_real_relations),
    ):
        bad = ids[(ids < 0) | (ids >= upper)]
        if bad.numel():
            problems.append(f"{name} ids outside [0, {upper}) such as {bad.unique()[:5].tolist()}")
    if problems:
        raise ValueError(
            f"The training triples contain {' and '.join(problems)}: they do not fit the model (was the triples "
            f"factory changed after the model was created?)."
        )


def _resolve_negative_sampler(
    negative_sampler: HintOrType[NegativeSampler], negative_sampler_kwargs: OptionalKwargs, num_negs_per_pos: int | None
) -> int | None:
    """Accept only what is meaningful for BESS from PyKEEN's negative sampler arguments."""
    if negative_sampler is not None and negative_sampler_resolver.lookup(negative_sampler) is not BasicNegativeSampler:
        raise ValueError(
            f"BessTrainingLoop draws its own balanced negatives shared within blocks; negative_sampler="
            f"{negative_sampler!r} is not supported. Pass negative_sampler_kwargs=dict(num_negs_per_pos=...) and the "
            f"corruption via training_loop_kwargs=dict(corruption='h'|'t'|'ht')."
        )
    kwargs = dict(negative_sampler_kwargs or {})
    from_sampler = kwargs.pop("num_negs_per_pos", None)
    if kwargs:
        raise ValueError(
            f"Unsupported negative_sampler_kwargs for BESS: {sorted(kwargs)}. Only num_negs_per_pos is used; choose "
            f"the corrupted side with training_loop_kwargs=dict(corruption=...). Filtering of false negatives is not "
            f"supported."
        )
    if from_sampler is not None and num_negs_per_pos is not None and from_sampler != num_negs_per_pos:
        raise ValueError(
            f"Conflicting num_negs_per_pos: {num_negs_per_pos} and {from_sampler} (negative_sampler_kwargs)."
        )
    return num_negs_per_pos if num_negs_per_pos is not None else from_sampler


def _check_model(model: Model) -> list[Embedding]:
    """Check that BESS can shard the model; return its entity embeddings."""
    supported = (
        f"ERModel subclasses whose entity representations are pykeen.nn.Embedding (models such as "
        f"{', '.join(SUPPORTED_MODEL_EXAMPLES)}), or an ERModel built from such embeddings and any interaction "
        f"(e.g. interaction='TripleRE' or 'LineaRE')"
    )
    if not isinstance(model, ERModel):
        raise ValueError(f"BESS cannot shard {type(model).__name__}: supported are {supported}.")
    embeddings = list(model.entity_representations)
    for representation in embeddings:
        if type(representation) is not Embedding:
            raise ValueError(
                f"BESS cannot shard {type(model).__name__}: its entity representation {type(representation).__name__} "
                f"is not a plain pykeen.nn.Embedding. Supported are {supported}."
            )
    entity_weights = {id(p) for representation in embeddings for p in representation.parameters()}
    for module in model.modules():
        if not isinstance(module, Regularizer) or isinstance(module, NoRegularizer) or not bool(module.weight):
            continue
        if any(id(p) in entity_weights for p in module.tracked_parameters):
            raise ValueError(
                f"BESS cannot train {type(model).__name__} with its {type(module).__name__}: it regularizes the whole "
                f"entity table every step, which is never in one place under BESS. Give it weight 0 (for TransH: "
                f"model_kwargs=dict(regularizer='normlimit', regularizer_kwargs=dict(weight=0.0)))."
            )
    for representation in embeddings:
        regularizer = representation.regularizer
        if regularizer is not None and regularizer.apply_only_once:
            raise ValueError(
                f"BESS does not support regularizers with apply_only_once=True on entity representations "
                f"({type(regularizer).__name__} of {type(model).__name__}): PyKEEN applies them to the first lookup of "
                f"a batch only, which has no counterpart in a step split over shards."
            )
    if get_batchnorm_modules(model):
        raise ValueError(
            f"BESS cannot train {type(model).__name__}: it has batch normalization layers, whose statistics would "
            f"depend on how a step is split into blocks."
        )
    return embeddings  # type: ignore[return-value]


def shard_tables_of(model: Model) -> Sequence[ShardedEmbedding]:
    """Return the shard tables installed in a model (empty if it is not sharded)."""
    if not isinstance(model, ERModel):
        return []
    return [r for r in model.entity_representations if isinstance(r, ShardedEmbedding)]
