"""Choosing the sizes of a BESS step: blocks from a batch size, and the automatic memory search.

``batch_size`` positives make ``n ** 2`` blocks of ``ceil(batch_size / n ** 2)`` slots; with
``batch_size=None`` the largest power of two that fits is searched, then the blocks are shrunk to
the same number of steps per epoch, so that the last step is not mostly padding. A step that does
not fit is split into sub-batches of the largest number of slots that does. Probes run one step's
forward and backward without communicating (:class:`~pykeen_bess.distributed.ProbeTopology`) and
all processes agree on each outcome (:func:`pykeen_bess.runtime.memory.search_largest`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from ...distributed import ProbeTopology, Topology
from ...runtime.memory import available_memory, fits_in_memory, search_largest
from ...data.partition import ShardPairPartition

__all__ = [
    "StepProbe",
    "StepSizes",
    "block_size_for",
    "resident_bytes",
]

#: runs one step's forward and backward over ``(partition, block_size, sub_block_size, label_smoothing, topology)``
#: without updating anything, then forgets its gradients (a training loop's ``probe_step``)
StepProbe = Callable[[ShardPairPartition, int, int, float, Topology], None]

logger = logging.getLogger(__name__)


def resident_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Return the bytes of a model's parameters on ``device`` with two optimizer state tensors each (at most)."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters() if p.device == device)


def block_size_for(batch_size: int, n_shard: int) -> int:
    """Return the slots per block of ``batch_size`` positives over ``n_shard ** 2`` blocks (rounded up, logged)."""
    n2 = n_shard**2
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


class StepSizes:
    """The memory search of a training loop: the largest batch, and the largest sub-batch, that fit."""

    def __init__(self, topology: Topology, memory_budget: int | None, probe: StepProbe):
        """Search sizes with ``probe`` over ``topology``'s shards.

        :param topology: the process topology (probes run on a :class:`ProbeTopology` of a process group's)
        :param memory_budget: bytes a CPU probe may use (None: half the available memory)
        :param probe: runs one step without updating anything
        """
        self.topology = topology
        self.memory_budget = memory_budget
        self.probe_step = probe

    def probe(
        self, partition: ShardPairPartition, block_size: int, sub_block_size: int, label_smoothing: float
    ) -> None:
        """Forward and backward of one step without updating anything or communicating."""
        topology = self.topology if not self.topology.is_distributed else ProbeTopology(self.topology)
        self.probe_step(partition, block_size, sub_block_size, label_smoothing, topology)

    def budget(self, device: torch.device) -> int | None:
        """Return the bytes a probe may use on ``device`` (None: only out-of-memory errors count, on a GPU)."""
        if self.memory_budget is not None:
            return self.memory_budget
        if device.type == "cuda":
            return None  # out-of-memory errors are raised, and caught
        available = available_memory(device)
        return None if available is None else available // 2

    def batch_size(self, partition: ShardPairPartition, label_smoothing: float, device: torch.device) -> int:
        """Find the largest batch size that fits, balanced over the steps of an epoch.

        :raises MemoryError: if not even one slot per block fits
        """
        budget = self.budget(device)
        n2 = self.topology.n_shard**2

        def fits(batch_size: int) -> bool:
            block = max(1, math.ceil(batch_size / n2))
            return fits_in_memory(lambda: self.probe(partition, block, block, label_smoothing), device, budget)[0]

        maximum = max(n2, partition.num_triples)
        batch_size, found = search_largest(
            fits, start=min(8192, maximum), maximum=maximum, topology=self.topology, description="batch_size"
        )
        if not found:
            raise MemoryError(f"Even batch_size=1 ({n2} slots) does not fit in memory with these parameters.")
        # the same number of steps with the smallest blocks: the last step of an epoch is then (nearly) full
        # instead of mostly padding (e.g. 8,544 triples in batches of 8,192 would be 48% padding)
        largest_pair = int(partition.pair_counts.max())
        steps = max(1, math.ceil(largest_pair / max(1, math.ceil(batch_size / n2))))
        balanced = math.ceil(largest_pair / steps) * n2
        logger.info(
            "Automatic memory optimization chose batch_size=%d (the largest batch that fits: %d, a power of two or "
            "the training triples; the same %d steps per epoch with the smallest blocks).",
            balanced,
            batch_size,
            steps,
        )
        return balanced

    def sub_block_size(
        self, partition: ShardPairPartition, block_size: int, label_smoothing: float, device: torch.device
    ) -> int:
        """Check that a step fits; otherwise find the largest sub-batch (slots per block) that does.

        :raises MemoryError: if not even sub-batches of one slot per block fit
        """
        budget = self.budget(device)

        def fits(sub_block: int) -> bool:
            return fits_in_memory(
                lambda: self.probe(partition, block_size, sub_block, label_smoothing), device, budget
            )[0]

        sub_block, found = search_largest(
            fits, start=block_size, maximum=block_size, topology=self.topology, description="slots per sub-batch"
        )
        if not found:
            raise MemoryError(
                "The model cannot be trained on this hardware with these parameters: even sub-batches of one slot "
                "per block do not fit. Reduce num_negs_per_pos, the embedding dimension or num_shards."
            )
        if sub_block < block_size:
            logger.info("Automatic memory optimization: sub-batches of %d slots per block.", sub_block)
        return sub_block
