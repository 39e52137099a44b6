"""The data of one BESS step, shared by the stages: the plan, the gathered rows, the scores.

* :class:`BessBatch`: the global plan of a step (drawn by :mod:`~pykeen_bess.data.sampling`, identical
  in every process);
* :class:`RowGather`: the entity rows a process needs for the step, as autograd leaves (built by
  an exchange scheme, :mod:`~pykeen_bess.schemes`);
* :class:`BlockScores`: the scores of the local blocks (from the scheme, for :mod:`~pykeen_bess.nn.loss`);
* :class:`RegularizationWeights`: how PyKEEN's sLCWA loop weighs each looked-up row in the
  regularization term (:func:`regularization_weights`);
* :class:`EpochPlan`: the plans of consecutive steps stacked along a step axis, and
  :class:`EpochDraws`: the random draws of an epoch's first steps (a static step's plan).

``n`` is the number of shards, ``L`` the shards held by this process, ``b`` the slots of a block
(``b'`` of a sub-batch), ``m = K / n`` the negatives each shard contributes to a block, ``K`` the
negatives per positive. All plan tensors live on the CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "BessBatch",
    "EpochDraws",
    "EpochPlan",
    "BlockScores",
    "RegularizationWeights",
    "RowGather",
    "regularization_weights",
]


@dataclasses.dataclass(eq=False)
class BessBatch:
    """The global plan of one BESS step (identical on every process, on the CPU)."""

    #: shape: ``[n(i), n(j), b]``, local head id (on shard ``i``) of slot ``s`` of block ``(i, j)``
    heads: torch.Tensor
    #: shape: ``[n(i), n(j), b]``, relation ids
    relations: torch.Tensor
    #: shape: ``[n(i), n(j), b]``, local tail id (on shard ``j``)
    tails: torch.Tensor
    #: shape: ``[n(i), n(j), b]``, False for padding slots
    valid: torch.Tensor
    #: shape: ``[n(i), n(j), b]``, position of the triple in the partition's arrays (-1 for padding)
    positions: torch.Tensor
    #: shape: ``[n(k), n(i), n(j), T * m]``, local ids on shard ``k`` of the negatives of block ``(i, j)``:
    #: ``m`` per candidate type (``T = 1`` without types)
    negatives: torch.Tensor
    #: the first ``num_head_corrupted`` slots of every block corrupt heads, the others tails
    num_head_corrupted: int
    #: the epoch this batch belongs to (1-based)
    epoch: int
    #: the step within the epoch (0-based)
    step: int
    #: shape: ``[n(i), n(j), b]``, which of the ``T`` candidate types slot ``s`` is scored against (the
    #: type of its corrupted side, typed negatives); None: all slots share the block's ``m`` negatives
    candidate_types: torch.Tensor | None = None
    #: the number ``T`` of candidate types the negatives are drawn for (1 without types)
    num_candidate_types: int = 1
    #: shape: ``[n(i), n(j), b]``, the loss weight of every slot's positive (a PyKEEN loss weighter;
    #: 0 for padding); None: unweighted
    weights: torch.Tensor | None = None
    #: whether all blocks of the step share one set of negatives (``negatives[:, i, j]`` equal for all
    #: ``(i, j)``, :class:`~pykeen_bess.data.sampling.StepSharedBessSampler`): the schemes then gather, move
    #: and score the ``K`` rows once for the whole step
    shared_negatives: bool = False

    @property
    def n_shard(self) -> int:
        """The number of shards."""
        return self.heads.shape[0]

    @property
    def block_size(self) -> int:
        """The number of slots per block."""
        return self.heads.shape[2]

    @property
    def num_negs_per_pos(self) -> int:
        """The number of negatives per positive, ``K = n * m`` (of its candidate type)."""
        return self.negatives.shape[0] * self.negatives.shape[-1] // self.num_candidate_types

    @property
    def num_valid(self) -> int:
        """The number of real (non-padding) positives in the batch."""
        return int(self.valid.sum())

    def __len__(self) -> int:
        """Return the number of real positives (as PyKEEN's batch-size bookkeeping expects)."""
        return self.num_valid


@dataclasses.dataclass(eq=False)
class RowGather:
    """The entity rows a process needs for one step, as leaf tensors."""

    #: shape: ``[U]``, unique flat rows of the local shard tables, sorted (on the tables' device);
    #: a leading ``-1`` marks a dummy row used by padding slots (never scored into the loss, never
    #: updated)
    rows: torch.Tensor
    #: one leaf per shard table, shape: ``[U, row_width]``
    leaves: list[torch.Tensor]
    #: shape: ``[L(i), n(j), b]``, index into ``rows`` of the head of every gathered slot of blocks ``(l, *)``
    heads: torch.Tensor
    #: shape: ``[L(j), n(i), b]``, index into ``rows`` of the tail of every gathered slot of blocks ``(*, l)``
    tails: torch.Tensor
    #: shape: ``[L(k), n(i), n(j), m]``, index into ``rows`` of this shard's negatives of every block;
    #: ``[L(k), 1, 1, m]`` when all blocks share them (:attr:`BessBatch.shared_negatives`)
    negatives: torch.Tensor
    #: the position of the first real row (1 if there is a dummy row, else 0), known on the host
    first_real: int
    #: the first slot of the blocks the rows were gathered for (``heads`` / ``tails`` start there)
    first_slot: int = 0
    #: every looked-up row is its own row, in the order the scores look them up (heads, tails, then the
    #: negatives as ``[n(i), n(j), L(k), m]``): the lookup selects nothing (a static step's rows)
    in_role_order: bool = False
    #: where the L2 terms of rows that are the leaves (or parameters viewed whole) leave their gradients for
    #: the step to add (:class:`~pykeen_bess.schemes.regularization.RowTermGradient`; a static step's list);
    #: None: autograd adds them
    term_gradients: list[Any] | None = None

    @property
    def real_rows(self) -> torch.Tensor:
        """shape: ``[U']``, the rows that hold entities (a view)."""
        return self.rows[self.first_real :]


@dataclasses.dataclass(eq=False)
class BlockScores:
    """The scores of (a slice of) one step, on the blocks whose heads are local."""

    #: shape: ``[L(i), n(j), b']``
    positive: torch.Tensor
    #: shape: ``[L(i), n(j), b', K]``
    negative: torch.Tensor
    #: shape: ``[V']``, positions of the real slots in the flattened ``[L(i) * n(j) * b']`` slots
    #: (on the scores' device); None if every slot is real
    valid_index: torch.Tensor | None
    #: the weighted regularization term of this slice (see :func:`regularization_weights`)
    regularization: torch.Tensor | float
    #: the part of :attr:`regularization` every process computes for its share of replicated
    #: parameters while the rest is whole on every process (the encoding scheme; 0 otherwise)
    replicated_regularization: torch.Tensor | float = 0.0
    #: shape: ``[L(i), n(j), b']``, the loss weights of the slots (CPU, from :attr:`BessBatch.weights`);
    #: None: unweighted
    weights: torch.Tensor | None = None

    @property
    def num_valid(self) -> int:
        """The number of real slots ``V'`` (known on the host)."""
        return self.positive.numel() if self.valid_index is None else self.valid_index.numel()


@dataclasses.dataclass(eq=False)
class RegularizationWeights:
    """The weight of every row a step looks up in PyKEEN's sLCWA regularization term (CPU, float64).

    See :func:`regularization_weights`; ``b'`` slots of a slice.
    """

    #: shape: ``[n(i), n(j), b']``, each head of a real positive
    head: torch.Tensor
    #: shape: ``[n(i), n(j), b']``, each tail of a real positive
    tail: torch.Tensor
    #: shape: ``[n(i), n(j), b']``, each relation of a real positive
    relation: torch.Tensor
    #: shape: ``[n(i), n(j), T]``, each shared negative of the block (of candidate type ``t``) as a head candidate
    negative_head: torch.Tensor
    #: shape: ``[n(i), n(j), T]``, each shared negative of the block (of candidate type ``t``) as a tail candidate
    negative_tail: torch.Tensor


def regularization_weights(
    batch: BessBatch,
    start: int = 0,
    stop: int | None = None,
    to_device: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> RegularizationWeights:
    """Weigh the rows of slots ``start:stop`` as PyKEEN's sLCWA loop weighs them.

    PyKEEN's :class:`~pykeen.training.SLCWATrainingLoop` scores the ``V`` positives and their ``V x K``
    negative triples with two lookups per representation, and every lookup adds the regularizer's
    *mean* over its rows. For one step with every positive's negatives being its block's shared
    negatives (corrupting the slot's side, the other side and the relation kept), this is, for a
    regularizer that averages a per-row value ``g``:

    * heads: ``g(h) / V`` for every real positive, plus ``g(h) / V`` again if the slot corrupts
      tails (its negative triples repeat the head); tails likewise;
    * relations: ``2 g(r) / V`` (the negative triples repeat the relation);
    * negatives: each of the ``K`` shared negatives of block ``(i, j)`` with ``g(e) V_ij / (V K)``,
      ``V_ij`` the block's real positives corrupting that side (with typed negatives: those whose
      corrupted side has the negative's candidate type).

    Tables used several times in a role (the interaction's head / tail indices) count once per use.
    The weights of slices add up to those of the step.

    :param batch: the step's plan
    :param start: the first slot of the slice
    :param stop: the end of the slice (default: the block size)
    :param to_device: moves the plan's host masks to the device of its candidate types (typed negatives
        whose types a static step computes on the device; default: ``Tensor.to``)
    :returns: the weights (on the candidate types' device with typed negatives, else on the CPU)
    """
    stop = batch.block_size if stop is None else stop
    valid = batch.valid[..., start:stop].to(torch.float64)
    num_valid = max(batch.num_valid, 1)
    num_negatives = batch.num_negs_per_pos
    corrupts_head = (torch.arange(start, stop) < batch.num_head_corrupted).to(torch.float64)
    if batch.candidate_types is None:
        of_type = valid.unsqueeze(-1)  # [n, n, b', 1]
    else:  # [n, n, b', T]: the slot's real positive, in its candidate type's column
        types = batch.candidate_types[..., start:stop]
        if types.device != valid.device:
            move = to_device or (lambda tensor: tensor.to(types.device))
            valid, corrupts_head = move(valid), move(corrupts_head)
        # one-hot by comparison (one_hot checks the values' range on the host)
        of_type = types.unsqueeze(-1) == torch.arange(batch.num_candidate_types, device=types.device)
        of_type = of_type.to(torch.float64) * valid.unsqueeze(-1)
    return RegularizationWeights(
        head=valid * (2.0 - corrupts_head) / num_valid,
        tail=valid * (1.0 + corrupts_head) / num_valid,
        relation=valid * (2.0 / num_valid),
        negative_head=(of_type * corrupts_head.unsqueeze(-1)).sum(dim=-2) / (num_valid * num_negatives),
        negative_tail=(of_type * (1.0 - corrupts_head).unsqueeze(-1)).sum(dim=-2) / (num_valid * num_negatives),
    )


@dataclasses.dataclass(eq=False)
class EpochPlan:
    """The plans of consecutive steps of an epoch, stacked along a leading step axis ``S`` (on the CPU).

    Step ``s`` of the plan is :class:`~pykeen_bess.data.batch.BessBatch` ``first_step + s``; the fields are
    those of a batch with the step axis in front (:meth:`batch`).
    """

    #: shape: ``[S, n(i), n(j), b]``, local head ids
    heads: torch.Tensor
    #: shape: ``[S, n(i), n(j), b]``, relation ids
    relations: torch.Tensor
    #: shape: ``[S, n(i), n(j), b]``, local tail ids
    tails: torch.Tensor
    #: shape: ``[S, n(i), n(j), b]``, False for padding slots
    valid: torch.Tensor
    #: shape: ``[S, n(i), n(j), b]``, positions in the partition (-1 for padding)
    positions: torch.Tensor
    #: shape: ``[S, n(k), n(i), n(j), T * m]``, local ids of the negatives on shard ``k``
    negatives: torch.Tensor
    #: the first ``num_head_corrupted`` slots of every block corrupt heads
    num_head_corrupted: int
    #: the epoch (1-based)
    epoch: int
    #: the step of the epoch the plan starts at (0-based)
    first_step: int
    #: shape: ``[S, n(i), n(j), b]``, candidate types of the slots (typed negatives), or None
    candidate_types: torch.Tensor | None = None
    #: the number ``T`` of candidate types
    num_candidate_types: int = 1
    #: shape: ``[S, n(i), n(j), b]``, loss weights of the positives, or None
    weights: torch.Tensor | None = None
    #: whether all blocks of a step share one set of negatives
    shared_negatives: bool = False

    def __len__(self) -> int:
        """Return the number of steps ``S``."""
        return self.heads.shape[0]

    def batch(self, step: int) -> BessBatch:
        """Return step ``first_step + step`` as a batch (views of the stacked tensors)."""
        return BessBatch(
            heads=self.heads[step],
            relations=self.relations[step],
            tails=self.tails[step],
            valid=self.valid[step],
            positions=self.positions[step],
            negatives=self.negatives[step],
            num_head_corrupted=self.num_head_corrupted,
            epoch=self.epoch,
            step=self.first_step + step,
            candidate_types=None if self.candidate_types is None else self.candidate_types[step],
            num_candidate_types=self.num_candidate_types,
            weights=None if self.weights is None else self.weights[step],
            shared_negatives=self.shared_negatives,
        )

    def batches(self, start: int = 0) -> Iterator[BessBatch]:
        """Iterate over the steps from ``start`` on as batches."""
        for step in range(start, len(self)):
            yield self.batch(step)


@dataclasses.dataclass(eq=False)
class EpochDraws:
    """The random draws of an epoch's first steps (:meth:`BessSampler.draw_epoch`), on the CPU."""

    #: the epoch (1-based)
    epoch: int
    #: shape: ``[T]``, float64 in ``[0, 1)``: the epoch's order is ``argsort(pair + keys)``
    keys: torch.Tensor
    #: shape: ``[S', n(k), n(i), n(j), T * m]``, the negatives of the first ``S'`` steps (None for none)
    negatives: torch.Tensor | None
    #: the negatives' generator, after those steps (the later steps continue with it)
    generator: torch.Generator
