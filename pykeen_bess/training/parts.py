"""The parts of :class:`~pykeen_bess.training.BessTrainingLoop`: its setup, optimizer, sampler, scheme and steps.

:class:`LoopParts` builds what a run is made of from the loop's settings: the setup of a partition
(:meth:`~LoopParts.reassemble`, see :func:`~pykeen_bess.training.setup.assembly.assemble`), the optimizer
of its shard tables, the triples by shardpair, the sampler of balanced batches, the exchange scheme
and the step runner, and the memory probe the step sizes use.
"""

from __future__ import annotations

from typing import Any

import torch
from pykeen.training.training_loop import _get_lr_scheduler_kwargs
from pykeen.triples import CoreTriplesFactory

from ..distributed import Topology
from ..tables.optim import BessOptimizer
from ..data.partition import ShardPairPartition
from ..data.sampling import BessSampler
from ..schemes import ExchangeScheme
from .setup.assembly import assemble, make_sampler, make_scheme
from .hooks import PyKEENHooks
from .steps.runner import StepRunner, held_terms

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

    def reassemble(self, partition: str) -> None:
        """Build the setup for ``partition`` from :attr:`settings`, then the optimizer of its tables."""
        self.setup = assemble(self, self.settings, partition)
        self.optimizer = self.build_optimizer()
        if self.lr_scheduler is not None:
            self.lr_scheduler = self.rebuild_lr_scheduler()
        self.runner = None
        self._partition = None

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
        """Build the learning-rate scheduler again, for the current optimizer."""
        assert self.lr_scheduler is not None
        return self.lr_scheduler.__class__(optimizer=self.optimizer, **_get_lr_scheduler_kwargs(self.lr_scheduler))

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

    def make_sampler(self, partition: ShardPairPartition, block_size: int) -> BessSampler:
        """Return the sampler of balanced batches of ``block_size`` slots per block."""
        return make_sampler(self, partition, block_size)

    def make_scheme(self, block_size: int, topology: Topology | None = None) -> ExchangeScheme:
        """Return the exchange scheme (``exchange="auto"``: the cheapest for this block size)."""
        return make_scheme(self, block_size, self.topology if topology is None else topology)

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
