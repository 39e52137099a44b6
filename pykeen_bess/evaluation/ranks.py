"""The ranks of one evaluation's queries: per target on the device, then of all targets on the host."""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from typing import cast

import numpy as np
import torch
from pykeen.typing import RANK_OPTIMISTIC, RANK_PESSIMISTIC, RANK_REALISTIC, RankType, Target

from ..distributed import Topology

__all__ = ["HostRanks", "TargetRanks"]


@dataclasses.dataclass(eq=False)
class TargetRanks:
    """The ranks of one target's queries (those of the batches ranked by this process)."""

    #: shape: ``[5, Q]``, long, on the device: optimistic rank, pessimistic rank, number of options,
    #: NaN candidate scores and whether the true score is NaN; zeros for the queries of other replicas
    values: torch.Tensor
    #: the number of queries ranked again (near-ties or non-finite scores)
    ranked_again: int


@dataclasses.dataclass(eq=False)
class HostRanks:
    """The ranks of all targets' queries on the host, batch by batch (see :func:`rank_triples`)."""

    #: per batch number and target: shape ``[5, b]``, long, the batch's columns of :attr:`TargetRanks.values`
    #: (the batches ranked by this process; after :meth:`gather_replicas` those of every replica)
    batches: dict[int, dict[str, np.ndarray]]
    #: per target, the number of queries this process ranked again (near-ties or non-finite scores)
    ranked_again: dict[str, int]

    def gather_replicas(self, topology: Topology) -> None:
        """Add the batches ranked by the other replicas: every process gets every replica's ranks."""
        if topology.replicas > 1:
            for other in topology.all_gather_object(self.batches):
                self.batches.update(other)

    def append_to(
        self,
        ranks: MutableMapping[tuple[Target, RankType], list[np.ndarray]],
        num_candidates: MutableMapping[Target, list[np.ndarray]],
    ) -> tuple[int, int]:
        """Append the ranks batch by batch, in order, as :class:`pykeen.evaluation.RankBasedEvaluator` collects them.

        :param ranks: per ``(target, rank type)``, the arrays of shape ``[b]`` to append to (the realistic
            rank is ``(optimistic + pessimistic) / 2`` in float32, as in PyKEEN's ``Ranks``)
        :param num_candidates: per target, the arrays of shape ``[b]`` of the numbers of options to append to
        :returns: the number of NaN candidate scores and the number of queries whose true score is NaN
        """
        nan_candidates = nan_true = 0
        for number in sorted(self.batches):
            for target, batch_values in self.batches[number].items():
                optimistic, pessimistic, options, nan, nan_true_batch = batch_values
                realistic = (optimistic + pessimistic).astype(np.float32) * np.float32(0.5)  # as PyKEEN's Ranks
                for rank_type, values in (
                    (RANK_OPTIMISTIC, optimistic),
                    (RANK_REALISTIC, realistic),
                    (RANK_PESSIMISTIC, pessimistic),
                ):
                    ranks[cast(Target, target), rank_type].append(values)
                num_candidates[cast(Target, target)].append(options)
                nan_candidates += int(nan.sum())
                nan_true += int(nan_true_batch.sum())
        return nan_candidates, nan_true
