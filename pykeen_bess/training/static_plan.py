"""The device side of a static step's plan: the training triples on the device, sorted once per epoch.

A static step (:mod:`~pykeen_bess.training.static_step`) reads each step's slots from a
:class:`DevicePlan`. The training triples stay on the device in partition order (grouped by
shardpair). Per epoch the host draws only the random part of the sort keys and the full steps'
negatives (:meth:`~pykeen_bess.data.sampling.BessSampler.draw_epoch`, the same generators as the eager
sampler), pinned on CUDA (:meth:`DevicePlan.host_plan`, safe on a background thread); they are
copied once, asynchronously, and the device sorts the triples into the epoch's order
(``argsort(pair + keys)``, the sampler's definition). Step ``s`` then takes slot ``t`` of block
``p`` from position ``pair_offset[p] + s * b + t`` of the order, through a device step counter, so
the batches are exactly the eager sampler's and no index crosses to the device per step.

Memory on the device: the triples (three int64 per triple), the sort keys and the order (8 bytes
each per triple) and the full steps' negatives (``[S, n(k), n(i), n(j), T * m]`` int64, or
``[S, n(k), 1, 1, T * m]`` when a step shares them).
"""

from __future__ import annotations

import torch

from ..data.batch import BessBatch, EpochDraws
from ..data.sampling import BessSampler

__all__ = [
    "DevicePlan",
]

#: the partition's arrays a step reads its triples from
_TRIPLES = ("heads", "relations", "tails")


class DevicePlan:
    """The full steps of an epoch on the device, read through a device step counter."""

    def __init__(self, sampler: BessSampler, device: torch.device):
        """Put the sampler's triples on ``device``; nothing is drawn yet.

        :param sampler: the epochs' sampler (its partition, block size, corruption and negatives)
        :param device: the compute device
        """
        self.sampler = sampler
        self.device = device
        n, b = sampler.n_shard, sampler.block_size
        self.n, self.b = n, b
        #: the full steps of every epoch (those without padding)
        self.num_steps = sampler.full_steps
        blocks = 1 if sampler.shares_negatives else n
        #: the shape of one step's negatives, ``[n(k), n(i), n(j), T * m]`` (``n(i) = n(j) = 1`` when shared)
        self.negative_shape = (n, blocks, blocks, sampler.num_candidate_types * sampler.negatives_per_shard)
        partition = sampler.partition
        #: the training triples in partition order, and the integer part of their sort keys (float64)
        self.triples = {
            "heads": partition.heads.to(device),
            "relations": partition.relations.to(device),
            "tails": partition.tails.to(device),
            "pair": sampler.pair_keys().to(device),
        }
        #: shape: ``[n * n, b]``, the position in the epoch's order of every slot of step 0
        self.pair_offsets = (partition.pair_offsets[:-1].view(-1, 1) + torch.arange(b).view(1, b)).to(device)
        #: typed negatives: shape ``[R', 2]``, the candidate type of every relation's head and tail (else None)
        candidates = getattr(sampler, "relation_candidates", None)
        self.relation_candidates = None if candidates is None else candidates.to(device)
        #: shape: ``[n, n, b]``, whether a slot corrupts its tail
        self.corrupts_tail = (torch.arange(b) >= sampler.num_head_corrupted).expand(n, n, b).long().to(device)
        #: the all-real validity mask of a full step (on the host: the schemes read it there)
        self.valid = torch.ones(n, n, b, dtype=torch.bool)
        #: shape: ``[1]``, the step of the loaded epoch the next step reads
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        #: the device buffers of the loaded epoch: ``keys``, ``order``, ``negatives``
        self.buffers: dict[str, torch.Tensor] = {}
        self._pinned: list[torch.Tensor] = []
        self._position = 0  # the steps of the loaded epoch handed out so far

    def host_plan(self, draws: EpochDraws) -> dict[str, torch.Tensor]:
        """Return what :meth:`load` copies to the device: the epoch's sort keys and its full steps' negatives.

        Contiguous, and pinned on CUDA; safe to call on another thread (the loop draws and pins the next
        epoch's while one trains).

        :param draws: the epoch's draws (:meth:`~pykeen_bess.data.sampling.BessSampler.draw_epoch` with
            ``steps=num_steps``)
        """
        fields = {"keys": draws.keys}
        if draws.negatives is not None:
            fields["negatives"] = draws.negatives[:, :, : self.negative_shape[1], : self.negative_shape[2]]
        pin = self.device.type == "cuda"
        return {name: value.contiguous().pin_memory() if pin else value.contiguous() for name, value in fields.items()}

    def load(self, fields: dict[str, torch.Tensor]) -> None:
        """Start an epoch: copy its keys and negatives to the device (asynchronously on CUDA), sort the triples there.

        :param fields: from :meth:`host_plan`
        """
        # the previous epoch's copies finished before its loss was read; these stay alive until the next
        self._pinned = list(fields.values())
        for name, values in fields.items():
            if name not in self.buffers:
                self.buffers[name] = torch.empty(values.shape, dtype=values.dtype, device=self.device)
            self.buffers[name].copy_(values, non_blocking=values.is_pinned())
        # the epoch's order, argsort(pair + keys) as the sampler defines it (a captured step reads this buffer)
        if "order" not in self.buffers:
            self.buffers["order"] = torch.empty(self.buffers["keys"].shape, dtype=torch.long, device=self.device)
        self.buffers["order"].copy_(torch.argsort(self.triples["pair"] + self.buffers["keys"]))
        self.step_index.zero_()
        self._position = 0

    def take(self, steps: int) -> None:
        """Reserve ``steps`` further steps of the loaded epoch.

        :raises ValueError: for more steps than the loaded epoch has left (the device would read past its buffers)
        """
        if not self.buffers or self._position + steps > self.num_steps:
            left = self.num_steps - self._position if self.buffers else 0
            raise ValueError(f"The static step has {left} full steps of its epoch left, not {steps} (load one first).")
        self._position += steps

    def batch(self) -> BessBatch:
        """Return the current step's plan as a batch of device tensors (heads, relations, tails ``[n, n, b]``)."""
        n, b = self.n, self.b
        # slot t of block p is the triple at position pair_offset[p] + step * b + t of the epoch's order
        positions = self.buffers["order"].index_select(0, (self.pair_offsets + self.step_index * b).view(-1))
        heads, relations, tails = (self.triples[name].index_select(0, positions).view(n, n, b) for name in _TRIPLES)
        candidate_types = None
        if self.relation_candidates is not None:  # typed negatives: the type of the corrupted side
            candidate_types = self.relation_candidates[relations, self.corrupts_tail]
        return BessBatch(
            heads=heads,
            relations=relations,
            tails=tails,
            valid=self.valid,
            positions=self.valid,  # not read by the scores
            negatives=self.buffers["negatives"].index_select(0, self.step_index)[0],
            num_head_corrupted=self.sampler.num_head_corrupted,
            epoch=0,
            step=0,
            candidate_types=candidate_types,
            num_candidate_types=self.sampler.num_candidate_types,
            shared_negatives=self.sampler.shares_negatives,
        )

    def advance(self) -> None:
        """Move the device step counter to the next step."""
        self.step_index.add_(1)

    def order_lookup(self, position_in_order: torch.Tensor) -> torch.Tensor:
        """Return the partition positions at positions of the loaded epoch's order (a host read, for eager steps)."""
        flat = position_in_order.reshape(-1).to(self.device)
        return self.buffers["order"].index_select(0, flat).cpu().view(position_in_order.shape)
