"""The device side of a static step's plan: the training triples on the device, sorted once per epoch.

A static step (:mod:`~pykeen_bess.training.steps.static_step`) reads each step's slots from a
:class:`DevicePlan`. The training triples stay on the device in partition order (grouped by
shardpair). Per epoch the host draws only the random part of the sort keys and every step's
negatives (:meth:`~pykeen_bess.data.sampling.BessSampler.draw_epoch`, the same generators as the
eager sampler), pinned on CUDA (:meth:`DevicePlan.host_plan`, safe on a background thread); they
are copied once, asynchronously, and the device sorts the triples into the epoch's order
(``argsort(pair + keys)``, the sampler's definition). Step ``s`` then takes slot ``t`` of block
``p`` from position ``pair_offset[p] + s * b + t`` of the order, through a device step counter, so
the batches are exactly the eager sampler's and no index crosses to the device per step.

**Step kinds.** Which slots of a step are padding depends only on the shardpairs' sizes and the
block size, not on the epoch: the first :attr:`~pykeen_bess.data.sampling.BessSampler.full_steps`
steps of every epoch hold no padding, and each later step has its own fixed pattern. A
:class:`StepKind` holds such a pattern (on the host, where the loss and the regularization weights
read it, and on the device); every step of a kind has the same shapes and the same real slots, so
a captured step serves all steps of its kind. The full steps are one kind; each padded step (at the
end of an epoch: one or two with the default balanced sharding) is a kind of its own. A padded slot
reads the first triple of its shardpair (as the eager sampler's padding does), is left out of the
loss, and its rows are not updated.

Memory on the device: the triples (three int64 per triple), the sort keys and the order (8 bytes
each per triple), the loss weights (with a loss weighter) and every step's negatives
(``[S, n(k), n(i), n(j), T * m]`` int64, or ``[S, n(k), 1, 1, T * m]`` when a step shares them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...data.batch import BessBatch, EpochDraws
from ...data.sampling import BessSampler, slot_offsets

__all__ = [
    "DevicePlan",
    "StepKind",
]

#: the partition's arrays a step reads its triples from
_TRIPLES = ("heads", "relations", "tails")


@dataclasses.dataclass(eq=False)
class StepKind:
    """Steps with the same padding: the full steps of every epoch (kind 0), or one padded step (its own kind)."""

    #: 0 for the full steps, ``1 + s - full_steps`` for padded step ``s``
    index: int
    #: shape: ``[n(i), n(j), b]``, False for padding slots (CPU: the loss and regularization weights read it)
    valid: torch.Tensor
    #: the real positives of every step of the kind
    num_valid: int
    #: shape: ``[n * n, b]``, ``valid`` on the device (None for the full steps)
    device_valid: torch.Tensor | None = None
    #: shape: ``[n * n, 1]``, the position in the epoch's order a padding slot reads (its shardpair's first
    #: triple; None for the full steps)
    fallback: torch.Tensor | None = None
    #: shape: ``[n * n, b]``, on the device: the position in the epoch's order of every slot of step 0 of the
    #: kind's layout (:func:`~pykeen_bess.data.sampling.slot_offsets`; None for the full steps: in order)
    slots: torch.Tensor | None = None

    @property
    def padded(self) -> bool:
        """Whether the kind's steps hold padding slots."""
        return self.device_valid is not None


class DevicePlan:
    """The steps of an epoch on the device, read through a device step counter."""

    def __init__(self, sampler: BessSampler, device: torch.device):
        """Put the sampler's triples on ``device``; nothing is drawn yet.

        :param sampler: the epochs' sampler (its partition, block size, corruption and negatives)
        :param device: the compute device
        """
        self.sampler = sampler
        self.device = device
        n, b = sampler.n_shard, sampler.block_size
        self.n, self.b = n, b
        #: the steps of every epoch
        self.num_steps = len(sampler)
        #: the leading steps of every epoch without padding
        self.full_steps = sampler.full_steps
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
        #: shape: ``[T]``, the loss weight of every triple (a loss weighter's; None: unweighted)
        self.weights = None if sampler.weights is None else sampler.weights.to(device)
        #: shape: ``[n * n, b]``, the position in the epoch's order of every slot of step 0
        self.pair_offsets = (partition.pair_offsets[:-1].view(-1, 1) + torch.arange(b).view(1, b)).to(device)
        #: typed negatives: shape ``[R', 2]``, the candidate type of every relation's head and tail (else None)
        candidates = getattr(sampler, "relation_candidates", None)
        self.relation_candidates = None if candidates is None else candidates.to(device)
        #: shape: ``[n, n, b]``, whether a slot corrupts its tail
        self.corrupts_tail = (torch.arange(b) >= sampler.num_head_corrupted).expand(n, n, b).long().to(device)
        #: the kinds of steps: the full steps, then every padded step
        self.kinds = self._kinds()
        #: shape: ``[1]``, the step of the loaded epoch the next step reads
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        #: the device buffers of the loaded epoch: ``keys``, ``order``, ``negatives``
        self.buffers: dict[str, torch.Tensor] = {}
        self._pinned: list[torch.Tensor] = []
        self._position = 0  # the steps of the loaded epoch handed out so far

    def _kinds(self) -> list[StepKind]:
        """Return the full steps' kind and one kind per padded step (the sampler's padding, step by step)."""
        n, b = self.n, self.b
        counts = self.sampler.partition.pair_counts.reshape(-1, 1)  # [n * n, 1]
        first = self.sampler.partition.pair_offsets[:-1].view(-1, 1).clamp_max(self.sampler.partition.num_triples - 1)
        full = torch.ones(n, n, b, dtype=torch.bool)
        kinds = [StepKind(index=0, valid=full, num_valid=n * n * b)]
        base = self.sampler.partition.pair_offsets[:-1].view(-1, 1)
        for step in range(self.full_steps, self.num_steps):
            offsets, valid = slot_offsets((counts - step * b).clamp(0, b), b, self.sampler.num_head_corrupted)
            kinds.append(
                StepKind(
                    index=len(kinds),
                    valid=valid.view(n, n, b),
                    num_valid=int(valid.sum()),
                    device_valid=valid.to(self.device),
                    fallback=first.to(self.device),
                    slots=(base + offsets).to(self.device),
                )
            )
        return kinds

    def kind_of(self, step: int) -> StepKind:
        """Return the kind of step ``step`` (0-based) of every epoch."""
        return self.kinds[0] if step < self.full_steps else self.kinds[1 + step - self.full_steps]

    def host_plan(self, draws: EpochDraws) -> dict[str, torch.Tensor]:
        """Return what :meth:`load` copies to the device: the epoch's sort keys and its steps' negatives.

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
            raise ValueError(f"The static step has {left} steps of its epoch left, not {steps} (load one first).")
        self._position += steps

    @property
    def position(self) -> int:
        """The steps of the loaded epoch handed out so far (the next step's index)."""
        return self._position

    def batch(self, kind: StepKind, at: int | None = None) -> BessBatch:
        """Return the current step's plan as a batch of device tensors (heads, relations, tails ``[n, n, b]``).

        :param kind: the step's kind (its padding slots read their shardpair's first triple)
        :param at: the plan of another step of the loaded epoch, by its index (its kind given), instead of the
            step at the device step counter
        """
        n, b = self.n, self.b
        step: Any = self.step_index if at is None else at
        negatives = self.buffers["negatives"]
        # slot t of block p is the triple at position pair_offset[p] + step * b + t of the epoch's order (a padded
        # kind's slots: their own layout, see slot_offsets)
        in_order = (self.pair_offsets if kind.slots is None else kind.slots) + step * b
        if kind.device_valid is not None and kind.fallback is not None:  # a padded kind
            in_order = torch.where(kind.device_valid, in_order, kind.fallback)
        positions = self.buffers["order"].index_select(0, in_order.view(-1))
        heads, relations, tails = (self.triples[name].index_select(0, positions).view(n, n, b) for name in _TRIPLES)
        candidate_types = None
        if self.relation_candidates is not None:  # typed negatives: the type of the corrupted side
            candidate_types = self.relation_candidates[relations, self.corrupts_tail]
        weights = None
        if self.weights is not None:
            weights = self.weights.index_select(0, positions).view(n, n, b)
            if kind.device_valid is not None:
                weights = torch.where(kind.device_valid.view(n, n, b), weights, torch.zeros_like(weights))
        return BessBatch(
            heads=heads,
            relations=relations,
            tails=tails,
            valid=kind.valid,
            positions=positions.view(n, n, b),
            negatives=negatives[at] if at is not None else negatives.index_select(0, step)[0],
            num_head_corrupted=self.sampler.num_head_corrupted,
            epoch=0,
            step=0,
            candidate_types=candidate_types,
            num_candidate_types=self.sampler.num_candidate_types,
            weights=weights,
            shared_negatives=self.sampler.shares_negatives,
        )

    def callback_batch(self, batch: BessBatch, kind: StepKind, epoch: int, step: int) -> BessBatch:
        """Return a step's plan as the eager step's batches are (for callbacks): copies, negatives of every block.

        :param batch: the plan the step read (:meth:`batch`; a captured step overwrites its tensors)
        :param kind: the step's kind
        :param epoch: the epoch (1-based)
        :param step: the step within the epoch (0-based)
        """
        n = self.n
        negatives = (
            batch.negatives.expand(n, n, n, batch.negatives.shape[-1]) if batch.shared_negatives else batch.negatives
        )
        positions = batch.positions
        if kind.device_valid is not None:  # padding slots: -1, as the eager sampler marks them
            positions = torch.where(kind.device_valid.view(positions.shape), positions, torch.full_like(positions, -1))
        return dataclasses.replace(
            batch,
            heads=batch.heads.clone(),
            relations=batch.relations.clone(),
            tails=batch.tails.clone(),
            positions=positions.clone(),
            negatives=negatives.clone(),
            candidate_types=None if batch.candidate_types is None else batch.candidate_types.clone(),
            weights=None if batch.weights is None else batch.weights.clone(),
            epoch=epoch,
            step=step,
        )

    def advance(self) -> None:
        """Move the device step counter to the next step."""
        self.step_index.add_(1)
