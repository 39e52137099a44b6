"""The parts of :class:`~pykeen_bess.training.BessTrainingLoop`: its setup, optimizer, sampler, scheme and steps.

:class:`LoopParts` builds what a run is made of from the loop's settings: the setup of a partition
(:meth:`~LoopParts.reassemble`, see :func:`~pykeen_bess.training.setup.assembly.assemble`), the optimizer
of its shard tables, the triples by shardpair, the sampler of balanced batches, the exchange scheme
and the step runner, and the memory probe the step sizes use; it keeps what the set-up functions
decide (the partition ``exchange="auto"`` chose, a resumed checkpoint's seed) and says what all ranks
must share (:meth:`~LoopParts.run_configuration`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, cast

import torch
from pykeen.regularizers import Regularizer
from pykeen.training.training_loop import _get_lr_scheduler_kwargs
from pykeen.triples import CoreTriplesFactory
from pykeen.triples.weights import loss_weighter_resolver

from ..distributed import Topology
from ..tables.optim import BessOptimizer
from ..tables.other_loops import guard_model_reset, resets_by_the_loop
from ..data.partition import ShardPairPartition
from ..data.sampling import BessSampler
from ..schemes import ExchangeScheme
from ..nn.loss import partition_weights
from ..runtime.threads import ThreadPolicy
from .epoch_steps import EpochBatches, make_static_step
from .setup.config import verify_same_configuration
from .setup.models import check_model_dtype
from .training_run import (
    TrainingRun,
    TrainingStart,
    log_plan,
    pykeen_callbacks,
    pykeen_layout_checkpoints,
    refuse_what_does_not_apply,
    register_step_callbacks,
    step_sizes,
)
from .setup.assembly import assemble, checkpoint_seed_to_adopt, choose_partition, make_sampler, make_scheme
from .hooks import PyKEENHooks
from .steps.runner import StepRunner, held_terms
from .steps.static_step import StaticStep

__all__ = ["LoopParts"]


class LoopParts(PyKEENHooks):
    """Builds the parts of a BESS run (a base class of :class:`~pykeen_bess.training.BessTrainingLoop`)."""

    #: the class and hyper-parameters of the user's optimizer
    optimizer_cls: type[torch.optim.Optimizer]
    optimizer_kwargs: dict[str, Any]
    #: whether the last checkpoint loaded was written by PyTorch-BigGraph (no optimizer state to continue)
    resumed_from_pbg: bool
    #: whether ``exchange="auto"`` has chosen the partition (at the first training with a batch size)
    _partition_chosen: bool
    #: the training triples by shardpair, with the triples tensor and version they were built from
    _partition: tuple[torch.Tensor, int, ShardPairPartition] | None
    #: the loss weights of the triples of the last partition a sampler was built for
    _loss_weights: tuple[ShardPairPartition, torch.Tensor | None] | None
    #: whether the static step trains: True: always, None: where it applies, False: never
    static_step: bool | None
    #: the static step of the current (or last) training; None where the eager step trained
    static: StaticStep | None
    #: how many intra-op threads the steps run with
    thread_policy: ThreadPolicy

    def reassemble(self, partition: str) -> None:
        """Build the setup for ``partition`` from :attr:`settings`, then the optimizer of its tables."""
        self.setup = assemble(self.settings, partition, self.optimizer, self, self.probe_step)
        self.fresh_optimizer()
        self.runner = None
        self._partition = None

    def fresh_optimizer(self) -> None:
        """Build the optimizer of the tables anew (no state), and the learning-rate scheduler for it."""
        self.optimizer = self.build_optimizer()
        if self.lr_scheduler is not None:
            self.lr_scheduler = self.rebuild_lr_scheduler()

    def use_steps(self, runner: StepRunner, static: StaticStep | None) -> None:
        """Train with ``runner`` and, where there is one, the static step (PyKEEN's hooks and checkpoints use them)."""
        self.runner = runner
        self.static = static

    def release_steps(self) -> None:
        """Let go of the steps of the last training (PyKEEN's ``clear_optimizer``: they hold the optimizer's state)."""
        self.runner = None
        self.static = None

    def finish_epoch(self, epoch: int, loss: float) -> None:
        """Record a completed epoch: its number and mean step loss."""
        self.losses_per_epochs.append(loss)
        self._epoch = epoch

    def resume_at(self, epoch: int, from_pbg: bool) -> None:
        """Train with ``runner`` and, where there is one, the static step (the hooks and checkpoints use them)."""
        self._epoch = epoch
        if from_pbg:
            self.losses_per_epochs = []
        self.resumed_from_pbg = from_pbg

    def reset_or_continue(self, continue_training: bool) -> None:
        """Fresh parameters and optimizer unless training continues, as PyKEEN does (over the shard tables).

        :raises ValueError: for ``continue_training`` of a loop that never trained
        """
        for table in self.tables:  # only this loop's fresh training re-initialises them from now on
            table.holds_training = True
        guard_model_reset(self.model, self.tables)  # and another loop is refused before it resets anything
        if continue_training:
            if not self._epoch and not self.optimizer.state and not self.resumed_from_pbg:  # (an optimizer without
                raise ValueError("Cannot continue_training without being trained once.")  # state counts epochs)
            return
        with resets_by_the_loop():
            self.model.reset_parameters_()
        check_model_dtype(self.model, {table.weight.dtype for table in self.tables}, after_reset=True)
        self.tables.constrain_all()  # the loop defers the tables' constraints; apply them once to all rows
        for parameter in self.tables.replicated_parameters():  # replicated: every process starts from rank 0's
            self.topology.broadcast_(parameter)
        self.tables.now_hold_weights()
        self.fresh_optimizer()

    def start_training(self, triples_factory: CoreTriplesFactory, start: TrainingStart) -> TrainingRun:
        """Build what the epochs of one ``train()`` call use, in PyKEEN's ``_train`` order (:mod:`.training_run`).

        :param triples_factory: the training triples
        :param start: the ``train()`` arguments that shape the run
        :returns: the run's callbacks, batches and steps (the static step, where it applies, in use)
        """
        partition = self.partition(triples_factory)
        refuse_what_does_not_apply(  # 6.
            start.slice_size, start.sampler, start.num_workers, start.drop_last, start.batch_size, partition
        )
        topology = self.topology
        callbacks = pykeen_callbacks(  # 5.
            self.result_tracker, topology, triples_factory, start.callbacks, start.callbacks_kwargs, start.stopper,
            start.last_best_epoch, start.best_epoch_model_file_path,
        )  # fmt: skip
        pykeen_layout_checkpoints(callbacks, self.tables)  # 11.
        if topology.is_distributed:  # every rank trains with the same settings
            verify_same_configuration(
                topology, self.run_configuration(triples_factory, static_step=self.static_step, **start.shared())
            )
        self.reset_or_continue(start.continue_training)
        block_size, sub_block_size = step_sizes(  # 4.
            self.sizes, topology, self.device, self.automatic_memory_optimization, partition, start.batch_size,
            start.sub_batch_size, start.label_smoothing, probing=start.only_size_probing or start.continue_training,
        )  # fmt: skip
        batches = self.epoch_batches(triples_factory, batch_size=block_size * topology.n_shard**2)
        runner = self.make_runner(block_size)
        loop_name = type(self).__name__ if self.overrides_process_batch else None
        static = make_static_step(
            self.static_step, loop_name, self.optimizer, self.tables, self.model, self.settings.memory_budget, runner,
            batches, block_size, sub_block_size, start.label_smoothing, start.clipping, start.only_size_probing,
        )  # fmt: skip
        self.use_steps(runner, static)
        register_step_callbacks(  # 3.
            callbacks, runner, self.tables, topology, start.clipping, static is None, self.config.sparse_updates,
            self.lr_scheduler,
        )  # fmt: skip
        callbacks.register_training_loop(self)
        if topology.is_main_process and not start.only_size_probing:
            log_plan(
                topology, self.config, self.tables, self.memory_plan, self.result_tracker, batches, runner,
                block_size, sub_block_size,
            )  # fmt: skip
        process_batch = self._process_batch if self.overrides_process_batch else None
        return TrainingRun(callbacks, batches, runner, static, sub_block_size, start.label_smoothing, process_batch)

    def probe_step(
        self,
        partition: ShardPairPartition,
        block_size: int,
        sub_block_size: int,
        label_smoothing: float,
        topology: Topology,
    ) -> None:
        """Run one step's forward and backward over ``topology`` without updating anything (a memory probe)."""
        runner = self.make_runner(block_size, topology)
        batch = next(iter(self.make_sampler(partition, block_size).epoch(1)))
        try:
            runner.forward_backward(batch, sub_block_size, label_smoothing)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.collect_regularization_term()

    def build_optimizer(self) -> BessOptimizer:
        """Build the user's optimizer for the replicated parameters, with row-sparse rules for the shard tables."""
        return self.tables.make_optimizer(self.optimizer_cls, self.optimizer_kwargs, self.config.sparse_updates)

    def rebuild_lr_scheduler(self) -> Any:
        """Build the learning-rate scheduler again, for the current optimizer (from its state, as PyKEEN's loops do).

        :raises ValueError: for a scheduler whose state does not keep its settings (``OneCycleLR``, ``CyclicLR``,
            ``LambdaLR``, ...; PyKEEN's own loops fail on them when they rebuild it), and for ``ReduceLROnPlateau``
            (PyKEEN steps schedulers without the metric it needs: its own loop fails after the first epoch)
        """
        assert self.lr_scheduler is not None
        cls = self.lr_scheduler.__class__
        if isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                "lr_scheduler=ReduceLROnPlateau steps by a metric, which PyKEEN's scheduler step after every epoch "
                "does not pass (PyKEEN's own loop fails after the first epoch). Use an epoch-based scheduler "
                "(StepLR, ExponentialLR, CosineAnnealingLR, ...), or early stopping (stopper='early')."
            )
        try:
            return cls(optimizer=self.optimizer, **_get_lr_scheduler_kwargs(self.lr_scheduler))
        except TypeError as error:
            raise ValueError(
                f"lr_scheduler={cls.__name__} cannot be made again for the loop's optimizer of the shard tables: its "
                f"state does not keep all its settings ({error}); PyKEEN's own loops rebuild schedulers the same "
                f"way. Use one whose state keeps them (StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, "
                f"LinearLR, ...)."
            ) from error

    def partition(self, triples_factory: CoreTriplesFactory) -> ShardPairPartition:
        """Return the training triples (with inverse triples if the model uses them) by shardpair, cached.

        The cache holds the triples tensor itself and its version counter, so neither another
        tensor (which could reuse a freed tensor's ``id``) nor an in-place change reuses a stale
        partition.
        """
        triples = triples_factory.mapped_triples
        if self._partition is None or self._partition[0] is not triples or self._partition[1] != triples._version:
            mapped = triples_factory._add_inverse_triples_if_necessary(triples)
            self._partition = (triples, triples._version, ShardPairPartition.from_triples(mapped, self.sharding))
        return self._partition[2]

    def epoch_batches(self, triples_factory: CoreTriplesFactory, batch_size: int) -> EpochBatches:
        """Return the balanced batches of the epochs (``batch_size`` positives per step, a multiple of ``n ** 2``)."""
        block_size = batch_size // self.topology.n_shard**2
        return EpochBatches(self.make_sampler(self.partition(triples_factory), block_size), first_epoch=self._epoch + 1)

    def make_sampler(self, partition: ShardPairPartition, block_size: int) -> BessSampler:
        """Return the sampler of balanced batches of ``block_size`` slots per block."""
        return make_sampler(self.settings, self.config, partition, block_size, self.loss_weights(partition))

    def loss_weights(self, partition: ShardPairPartition) -> torch.Tensor | None:
        """Return the loss weight of every triple of the partition (None without a loss weighter), once per partition.

        The memory search builds a sampler for every probe; the weights are computed for the first and
        kept with the partition they belong to.
        """
        if self.loss_weighter is None:
            return None
        cached = self._loss_weights
        if cached is not None and cached[0] is partition:
            return cached[1]
        weighter = loss_weighter_resolver.make_safe(cast(Any, self.loss_weighter), self.loss_weighter_kwargs)
        weights = partition_weights(weighter, self.loss, partition)
        self._loss_weights = (partition, weights)
        return weights

    def make_scheme(self, block_size: int, topology: Topology | None = None) -> ExchangeScheme:
        """Return the exchange scheme (``exchange="auto"``: the cheapest for this block size)."""
        return make_scheme(self.settings, self.setup, block_size, self.topology if topology is None else topology)

    def choose_partition(self, batch_size: int | None, train_kwargs: dict[str, Any]) -> None:
        """With ``exchange="auto"``: switch to the partition that sends the fewest bytes, once (see the function)."""
        if self._partition_chosen:
            return
        chosen = choose_partition(self.settings, self.setup, batch_size, train_kwargs)
        if chosen is None:
            return
        self._partition_chosen = True
        if chosen != self.config.partition:
            self.reassemble(chosen)

    def adopt_checkpoint_seed(self, train_kwargs: dict[str, Any]) -> None:
        """Resuming a checkpoint written with another derived seed: assemble again with it (see the function)."""
        seed = checkpoint_seed_to_adopt(self.settings, self.setup, train_kwargs)
        if seed is None:
            return
        self.tables.release_storage()
        self.settings = dataclasses.replace(self.settings, seed=seed)
        self.reassemble(self.config.partition)

    def run_configuration(self, triples_factory: CoreTriplesFactory, **train_kwargs: Any) -> dict[str, str]:
        """Return the settings every rank must share, as strings (compared at the start of training).

        :param triples_factory: the training triples (compared by a hash)
        :param train_kwargs: the ``train()`` settings to compare
        :returns: setting name -> its ``repr``
        """
        model, config, topology = self.model, self.config, self.topology
        tables = {id(table.weight) for table in self.tables}
        dense = {
            name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad and id(p) not in tables
        }
        triples = triples_factory.mapped_triples.contiguous().numpy()
        settings = dict(
            model=type(model).__name__,
            interaction=repr(model.interaction),
            loss=module_settings(model.loss),
            regularizers=[
                (name, module_settings(module))
                for name, module in model.named_modules()
                if isinstance(module, Regularizer)
            ],
            entity_initializers=[callable_name(getattr(e, "initializer", None)) for e in self.tables.embeddings],
            loss_weighter=_name(self.loss_weighter),
            num_entities=model.num_entities,
            num_relations=model.num_relations,
            entity_tables=[
                (e._embeddings.weight.shape[1], str(t.weight.dtype))
                for e, t in zip(self.tables.embeddings, self.tables)
            ],
            partition=config.partition,
            replicated_parameters=dense,
            optimizer=self.optimizer_cls.__name__,
            optimizer_kwargs=sorted((k, repr(v)) for k, v in self.optimizer_kwargs.items()),
            lr_scheduler=None
            if self.lr_scheduler is None
            else (type(self.lr_scheduler).__name__, sorted(_get_lr_scheduler_kwargs(self.lr_scheduler).items())),
            sharding=self.sharding.fingerprint,
            num_shards=topology.n_shard,
            replicas=topology.replicas,
            replica_grouping=getattr(getattr(topology, "layout", None), "grouping", "none"),
            exchange=config.scheme_name,
            corruption=config.corruption,
            negatives=config.sampler.__name__,
            num_negs_per_pos=config.num_negs_per_pos,
            seed=config.seed,
            sparse_updates=config.sparse_updates,
            triples=f"{triples.shape[0]} triples, sha1 {hashlib.sha1(triples.tobytes()).hexdigest()}",
            **train_kwargs,
        )
        return {key: repr(value) for key, value in settings.items()}

    def make_runner(self, block_size: int, topology: Topology | None = None) -> StepRunner:
        """Return the step runner of blocks of ``block_size`` slots."""
        return StepRunner(
            scheme=self.make_scheme(block_size, topology),
            loss=self.loss,
            tables=self.tables,
            sparse_updates=self.config.sparse_updates,
            collect_regularization_term=held_terms(self.model),
            post_forward_pass=self.model.post_forward_pass,
            weighted=self.loss_weighter is not None,
        )


def module_settings(module: torch.nn.Module) -> list[tuple[str, str]]:
    """Return a module's class and settings as every process sees them alike (compared between ranks).

    Its plain attributes (numbers, strings, flags: a loss's ``margin``, a regularizer's ``p``), its small
    buffers' values (a regularizer's ``weight``) and its children's settings; ``repr`` alone misses
    most of them (``MarginRankingLoss()`` whatever its margin).
    """
    items = [("class", type(module).__name__)]
    for name, value in sorted(vars(module).items()):
        if not name.startswith("_") and name != "training" and isinstance(value, bool | int | float | str):
            items.append((name, repr(value)))
    items += [(name, repr(b.tolist())) for name, b in module.named_buffers(recurse=False) if b.numel() <= 16]
    items += [(name, repr(module_settings(child))) for name, child in module.named_children()]
    return items


def callable_name(function: Any) -> str | None:
    """Return a function's (a ``functools.partial``'s, a callable object's) name and arguments, not its address."""
    if function is None or isinstance(function, str):
        return function
    if isinstance(function, functools.partial):
        return f"{callable_name(function.func)}(*{function.args!r}, **{sorted(function.keywords.items())!r})"
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{getattr(function, '__module__', None) or type(function).__module__}.{name}"


def _name(hint: Any) -> str | None:
    """Return a hint's name, the same in every process (a class's or an instance's class name, not its address)."""
    if hint is None or isinstance(hint, str):
        return hint
    return getattr(hint, "__name__", type(hint).__name__)
