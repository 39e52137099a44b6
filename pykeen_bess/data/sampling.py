"""Stage 3 of the pipeline: balanced batches and shared negatives.

Every training step is a batch of ``n_shard ** 2`` *blocks* of ``block_size`` slots each; block
``(i, j)`` holds triples of shardpair ``(i, j)``: heads on shard ``i``, tails on shard ``j``.

**Epoch.** An epoch presents every training triple exactly once: each shardpair is shuffled
(seeded per epoch) and cut into consecutive chunks of ``block_size``; step ``s`` takes chunk
``s`` of every shardpair. The epoch has ``ceil(max_pair_count / block_size)`` steps. A shardpair
that runs out of triples (a small or empty one) fills its remaining slots with *padding*,
marked ``valid = False`` and excluded from the loss, so small shardpairs are neither
over-sampled nor able to crash a step. With a random entity sharding, hub entities make some
shardpairs several percent larger than ``T / n**2`` (8% padding on WN18RR with 4 shards); the
default balanced sharding (:mod:`pykeen_bess.data.balancing`) evens them to within 0.3%. The
fraction is reported by :attr:`BessSampler.padding_fraction`.

**Negatives.** The sampler draws ``num_negs_per_pos / n_shard`` entities uniformly with
replacement from the *real* (never padding) rows of every shard ``k``, and positives share these
``num_negs_per_pos`` negatives. :class:`StepSharedBessSampler` (``negatives="step"``, the default)
draws one such set per step and gives it to every block; :class:`BessSampler`
(``negatives="block"``, BESS's original scheme) draws one set per block, ``n_shard ** 2`` per step.
With one shard the two are the same. With corruption ``"ht"`` the first ``block_size // 2`` slots
of every block corrupt their head and the rest their tail (a block the epoch's last steps fill only
partly puts about half of its triples in each part, :func:`slot_offsets`); with ``"h"`` or ``"t"``
all slots corrupt that side.

*Which to use.* One set per step is the default because it trains as well as one shard does:
a step touches ``num_negs_per_pos`` negative rows whatever ``n_shard`` is. Per-block sets touch up
to ``n_shard ** 2`` times as many rows, each carrying the gradient of fewer positives, and
row-sparse Adam moves every row it touches by about its learning rate whatever the gradient's size:
at four shards that cost 0.01-0.03 filtered MRR against one shard (``benchmarks/parity.py``).
One set per step also gathers, moves and scores the negatives once per step instead of once per
block, so it is faster. Per-block sets draw more distinct negatives per step; with Adagrad (whose
accumulated denominators do not move rarely-seen rows that way) they train as well as one shard,
and they reproduce BESS's published scheme.

**Typed negatives** (:class:`TypedBessSampler`, ``negatives="typed"``, graphs with entity types,
:mod:`pykeen_bess.pbg`): a slot's negatives have the type of its corrupted side (a relation's head or
tail type). For every block and every candidate type ``t`` each shard contributes ``m`` entities of
type ``t`` (the shards hold an equal share of every type, :class:`~pykeen_bess.data.sharding.TypedSharding`),
and the block's slots of that type share them: a block draws ``T * m`` per shard and every slot is
scored against the ``K = n * m`` of its type.

All randomness comes from a generator seeded by ``(seed, epoch)``: every worker that builds the
sampler from the same seed draws the same global plan, and resuming at an epoch boundary
continues identically.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch

from .batch import BessBatch, EpochDraws, EpochPlan
from .slots import head_slots, slot_offsets
from .partition import ShardPairPartition
from .seeds import derive_seed

__all__ = [
    "DEFAULT_NEGATIVES",
    "NEGATIVES",
    "Corruption",
    "BessBatch",
    "BessSampler",
    "EpochDraws",
    "EpochPlan",
    "StepSharedBessSampler",
    "StepSharedTypedBessSampler",
    "TypedBessSampler",
    "resolve_negatives",
    "slot_offsets",
]

#: which side(s) of a positive triple the negatives replace
Corruption = Literal["h", "t", "ht"]
CORRUPTIONS: tuple[str, ...] = ("h", "t", "ht")


class BessSampler:
    """Draws the balanced batches of an epoch from a shardpair partition."""

    #: whether all blocks of a step share one set of negatives (:attr:`BessBatch.shared_negatives`)
    shares_negatives: bool = False

    def __init__(
        self,
        partition: ShardPairPartition,
        block_size: int,
        num_negs_per_pos: int,
        corruption: Corruption = "ht",
        seed: int = 0,
        *,
        weights: torch.Tensor | None = None,
    ):
        """Create the sampler.

        :param partition: the triples grouped by shardpair
        :param block_size: the number of slots per block, ``>= 1``; a step has
            ``n_shard ** 2 * block_size`` slots
        :param num_negs_per_pos: the number of negatives per positive, a positive multiple of
            ``n_shard`` (the same number is drawn from every shard)
        :param corruption: ``"h"``, ``"t"`` or ``"ht"``
        :param seed: the seed; the plan of epoch ``e`` depends only on ``(seed, e)``
        :param weights: shape: ``[T]``, the loss weight of every triple in partition order (a PyKEEN
            loss weighter's, see :func:`pykeen_bess.nn.loss.partition_weights`); None: unweighted
        :raises ValueError: on invalid parameters
        """
        n = partition.n_shard
        if block_size < 1:
            raise ValueError(f"block_size must be positive, but is {block_size}.")
        if corruption not in CORRUPTIONS:
            raise ValueError(f"Unknown corruption={corruption!r}; expected one of {CORRUPTIONS}.")
        if num_negs_per_pos < 1 or num_negs_per_pos % n:
            raise ValueError(
                f"num_negs_per_pos={num_negs_per_pos} is not usable with {n} shards: BESS draws the same number "
                f"of negatives from every shard, so it must be a positive multiple of num_shards={n}."
            )
        if partition.num_triples == 0:
            raise ValueError("Cannot sample batches from an empty set of triples.")
        if weights is not None and weights.shape != (partition.num_triples,):
            raise ValueError(f"weights has shape {tuple(weights.shape)}; expected ({partition.num_triples},).")
        self.partition = partition
        self.weights = weights
        self.block_size = int(block_size)
        self.num_negs_per_pos = int(num_negs_per_pos)
        self.corruption = corruption
        self.seed = int(seed)
        self.num_head_corrupted = head_slots(self.block_size, corruption)
        self._counts = partition.pair_counts.view(-1)
        self._shard_counts = partition.sharding.shard_counts
        empty = (self._shard_counts == 0).nonzero().view(-1).tolist()
        if empty and not isinstance(self, TypedBessSampler):  # (typed negatives check every type of every shard)
            raise ValueError(
                f"Shard(s) {empty} of {self.n_shard} hold no entity (a sharding that leaves a shard empty, e.g. "
                f"PyTorch-BigGraph partitions of a typed graph), but every shard gives num_negs_per_pos / num_shards "
                f"of each step's negatives. Use fewer shards."
            )

    @property
    def n_shard(self) -> int:
        """The number of shards."""
        return self.partition.n_shard

    @property
    def num_candidate_types(self) -> int:
        """The number ``T`` of candidate types the negatives are drawn for (1 without types)."""
        return 1

    @property
    def negatives_per_shard(self) -> int:
        """The number of negatives drawn from each shard per block, ``m``."""
        return self.num_negs_per_pos // self.n_shard

    @property
    def batch_size(self) -> int:
        """The number of slots per step (positives plus padding)."""
        return self.n_shard**2 * self.block_size

    def __len__(self) -> int:
        """Return the number of steps per epoch."""
        return max(1, math.ceil(int(self._counts.max()) / self.block_size))

    @property
    def padding_fraction(self) -> float:
        """The fraction of padding slots over an epoch."""
        return 1.0 - self.partition.num_triples / (len(self) * self.batch_size)

    def _generator(self, epoch: int, stream: int) -> torch.Generator:
        # distinct, reproducible streams per (seed, epoch, purpose)
        return torch.Generator().manual_seed(derive_seed(self.seed, epoch, stream))

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """Return a random order of all triples that keeps them grouped by shardpair.

        :returns: shape: ``[T]``, positions into the partition arrays; shardpair ``p`` occupies
            ``pair_offsets[p]:pair_offsets[p+1]`` in a uniformly random order
        """
        return torch.argsort(self.pair_keys() + self.epoch_keys(epoch))

    def pair_keys(self) -> torch.Tensor:
        """Return the shardpair of every triple in partition order, float64 ``[T]`` (the sort keys' integer part)."""
        return torch.repeat_interleave(torch.arange(self._counts.numel()), self._counts).to(torch.float64)

    def epoch_keys(self, epoch: int) -> torch.Tensor:
        """Return the random part of the sort keys, float64 ``[T]`` in ``[0, 1)`` (order: ``argsort(pair + keys)``)."""
        return torch.rand(self.partition.num_triples, generator=self._generator(epoch, 0), dtype=torch.float64)

    def draw_epoch(self, epoch: int, steps: int) -> EpochDraws:
        """Draw what the epoch's first ``steps`` steps are made of, without ordering the triples on the host.

        A static step (:mod:`pykeen_bess.training.steps.static_step`) sorts the keys on its device and takes every
        step's triples from there; :meth:`remaining_steps` then draws the rest of the epoch as :meth:`epoch`
        would. Together they give the batches of :meth:`epoch`.

        :param epoch: the epoch (1-based)
        :param steps: the leading steps whose negatives are drawn
        """
        generator = self._generator(epoch, 1)
        negatives = self.draw_negatives(generator, steps) if steps else None
        return EpochDraws(epoch=epoch, keys=self.epoch_keys(epoch), negatives=negatives, generator=generator)

    def remaining_steps(
        self, draws: EpochDraws, order: Callable[[torch.Tensor], torch.Tensor], start: int
    ) -> EpochPlan:
        """Draw the steps ``start..`` of an epoch whose first ``start`` steps' negatives ``draws`` holds.

        :param draws: from :meth:`draw_epoch` with ``steps=start``
        :param order: maps positions in the epoch's order (a CPU tensor) to positions in the partition
            (the sorted keys, wherever they were sorted)
        :param start: the first step
        """
        return self._steps(draws.epoch, order, draws.generator, start, len(self))

    @property
    def full_steps(self) -> int:
        """The number of leading steps of every epoch without padding, ``min_p floor(count_p / b)``.

        Shardpair ``p`` fills its blocks up to step ``floor(count_p / b) - 1``, so the steps without
        any padding slot are exactly the first ``full_steps`` of an epoch; the rest (if any) hold
        padding. A static step (:mod:`pykeen_bess.training.steps.static_step`) runs the full steps.
        """
        return min(int((self._counts // self.block_size).min()), len(self))

    def epoch(self, epoch: int, steps_per_chunk: int = 32) -> Iterator[BessBatch]:
        """Iterate over the batches of an epoch.

        The steps are drawn ``steps_per_chunk`` at a time (:meth:`epoch_plan` draws them all at once;
        both give the same batches).

        :param epoch: the epoch (1-based, as PyKEEN counts)
        :param steps_per_chunk: steps drawn together (memory: a chunk's plan)
        :yields: the batches, ``len(self)`` of them
        """
        order = self._epoch_order(epoch)
        negative_generator = self._generator(epoch, 1)
        for start in range(0, len(self), steps_per_chunk):
            plan = self._steps(epoch, order, negative_generator, start, min(start + steps_per_chunk, len(self)))
            yield from plan.batches()

    def epoch_plan(self, epoch: int) -> EpochPlan:
        """Draw the plans of all steps of an epoch at once, as stacked tensors (the batches of :meth:`epoch`).

        :param epoch: the epoch (1-based)
        :returns: the epoch's plan, ``len(self)`` steps
        """
        return self._steps(epoch, self._epoch_order(epoch), self._generator(epoch, 1), 0, len(self))

    def _steps(
        self,
        epoch: int,
        order: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
        negative_generator: torch.Generator,
        start: int,
        stop: int,
    ) -> EpochPlan:
        """Draw steps ``start:stop`` of an epoch; the generator must have drawn the negatives of the steps before.

        :param order: shape: ``[T]``, the epoch's order of the triples (:meth:`_epoch_order`), or a function
            that looks positions in it up
        :param negative_generator: the epoch's generator of negatives
        """
        n, b = self.n_shard, self.block_size
        num_steps = stop - start
        offsets = self.partition.pair_offsets[:-1].view(1, n * n, 1)
        counts = self._counts.view(1, n * n, 1)
        first = torch.arange(start, stop).view(num_steps, 1, 1) * b  # each step's first position in its shardpair
        slots, valid = slot_offsets((counts - first).clamp(0, b), b, self.num_head_corrupted)  # [S, n * n, b]
        within = first + slots
        # padding slots point at the shardpair's first triple (or triple 0 for an empty one)
        position_in_order = offsets + torch.where(valid, within, torch.zeros_like(within))
        position_in_order = position_in_order.clamp_max(max(self.partition.num_triples - 1, 0))
        flat = position_in_order.view(-1)
        positions = order(flat) if callable(order) else order.index_select(0, flat)
        shape = (num_steps, n, n, b)
        relations = self.partition.relations.index_select(0, positions).view(shape)
        valid = valid.view(-1)
        weights = None
        if self.weights is not None:
            weights = torch.where(valid, self.weights.index_select(0, positions), 0.0).view(shape)
        # one draw per step, in step order: the generator's stream is that of the step-by-step sampler
        negatives = self.draw_negatives(negative_generator, num_steps)
        return EpochPlan(
            heads=self.partition.heads.index_select(0, positions).view(shape),
            relations=relations,
            tails=self.partition.tails.index_select(0, positions).view(shape),
            valid=valid.view(shape),
            positions=torch.where(valid, positions, torch.full_like(positions, -1)).view(shape),
            negatives=negatives,
            num_head_corrupted=self.num_head_corrupted,
            epoch=epoch,
            first_step=start,
            weights=weights,
            shared_negatives=self.shares_negatives,
            **self._candidate_types(relations),
        )

    def draw_negatives(self, generator: torch.Generator, steps: int) -> torch.Tensor:
        """Draw the negatives of ``steps`` consecutive steps, one step after the other.

        :returns: shape: ``[steps, n(k), n(i), n(j), T * m]`` (``steps`` may be 0: an epoch whose steps
            were all drawn before)
        """
        if steps == 0:
            n = self.n_shard
            return torch.empty((0, n, n, n, self.num_candidate_types * self.negatives_per_shard), dtype=torch.long)
        return torch.stack([self._negatives(generator) for _ in range(steps)])

    def _candidate_types(self, relations: torch.Tensor) -> dict:
        """Which negatives each slot is scored against (none to choose: all slots share the block's)."""
        return {}

    def _negatives(self, generator: torch.Generator) -> torch.Tensor:
        """Draw ``m`` negatives per (owner shard, block) uniformly from each shard's real rows.

        :returns: shape: ``[n(k), n(i), n(j), m]``, local ids on shard ``k``
        """
        return self._draw(generator, self.n_shard)

    def _draw(self, generator: torch.Generator, blocks: int) -> torch.Tensor:
        """Draw ``m`` real rows of every shard for ``blocks x blocks`` blocks: ``[n(k), blocks, blocks, m]``."""
        n, m = self.n_shard, self.negatives_per_shard
        uniform = torch.rand(n, blocks, blocks, m, generator=generator, dtype=torch.float64)
        limits = self._shard_counts.view(n, 1, 1, 1)
        return (uniform * limits.to(torch.float64)).long().clamp_max_(limits - 1)


class TypedBessSampler(BessSampler):
    """Typed negatives: every slot's negatives have its corrupted side's entity type.

    Needs a sharding whose shards hold every type's rows grouped type by type
    (:class:`~pykeen_bess.data.sharding.TypedSharding`): shard ``k``'s rows of type ``t`` are the local ids
    ``offset[k, t] .. offset[k, t] + count[k, t] - 1``.
    """

    def __init__(
        self,
        partition: ShardPairPartition,
        block_size: int,
        num_negs_per_pos: int,
        corruption: Corruption = "ht",
        seed: int = 0,
        *,
        relation_sides: torch.Tensor,
        entity_types: torch.Tensor,
        type_names: Sequence[str] = (),
        weights: torch.Tensor | None = None,
    ):
        """Create the sampler.

        :param partition: the triples grouped by shardpair
        :param block_size: the slots per block
        :param num_negs_per_pos: the negatives per positive, a multiple of the number of shards
        :param corruption: ``"h"``, ``"t"`` or ``"ht"``
        :param seed: the seed
        :param relation_sides: shape: ``[R', 2]``, the head and tail type of every relation id the
            partition holds (inverse relations included)
        :param entity_types: shape: ``[N]``, the type of every entity
        :param type_names: the type names, for error messages
        :param weights: the loss weights of the triples (see :class:`BessSampler`)
        :raises ValueError: if a shard holds no entity of a type some relation corrupts, or the shards'
            rows are not grouped by type
        """
        super().__init__(partition, block_size, num_negs_per_pos, corruption, seed, weights=weights)
        sharding = partition.sharding
        n = sharding.n_shard
        #: the entity types some slot is scored against, in type order (their position is the candidate type)
        self.types = self.candidate_types(relation_sides, corruption)
        position = torch.full((int(entity_types.max()) + 1,), -1, dtype=torch.long)
        position[self.types] = torch.arange(len(self.types))
        #: shape: ``[R', 2]``, the candidate type (position in :attr:`types`) of each relation's head and tail
        self.relation_candidates = torch.where(relation_sides >= 0, position[relation_sides.clamp_min(0)], -1)
        real = sharding.padding_mask()
        row_types = torch.where(real, entity_types[sharding.shard_entities.clamp_min(0)], -1)
        counts = torch.stack([(row_types == t).sum(dim=1) for t in self.types], dim=1)  # [n, T]
        offsets = torch.stack([(row_types < t).logical_and(real).sum(dim=1) for t in self.types], dim=1)
        grouped = bool((row_types[:, 1:] >= row_types[:, :-1]).logical_or(~real[:, 1:]).all())
        if not grouped:
            raise ValueError("Typed negatives need shards whose rows are grouped by entity type (TypedSharding).")
        empty = (counts == 0).nonzero()
        if empty.numel():
            shard, t = empty[0].tolist()
            name = type_names[self.types[t]] if type_names else str(self.types[t])
            total = int((entity_types == self.types[t]).sum())
            raise ValueError(
                f"Typed negatives: entity type {name!r} has {total} entities, fewer than num_shards={n}, so shard "
                f"{shard} holds none to draw negatives from. Use at most {total} shards, or negatives='block'."
            )
        self._type_counts = counts
        self._type_offsets = offsets

    @staticmethod
    def candidate_types(relation_sides: torch.Tensor, corruption: Corruption) -> list[int]:
        """Return the entity types some slot is scored against (the corrupted sides' types), in type order.

        :param relation_sides: shape: ``[R', 2]``, the head and tail type of every relation id (-1: none)
        :param corruption: ``"h"``, ``"t"`` or ``"ht"``
        :returns: the types; every block draws negatives of each (``T`` of them)
        """
        sides = {"h": [0], "t": [1], "ht": [0, 1]}[corruption]
        return sorted(set(relation_sides[:, sides].reshape(-1).tolist()) - {-1})

    @property
    def num_candidate_types(self) -> int:
        """The number of candidate types ``T``."""
        return len(self.types)

    def _candidate_types(self, relations: torch.Tensor) -> dict:
        b = relations.shape[-1]  # [..., n, n, b]
        corrupts_tail = (torch.arange(b) >= self.num_head_corrupted).long().expand_as(relations)
        return dict(
            candidate_types=self.relation_candidates[relations, corrupts_tail],
            num_candidate_types=self.num_candidate_types,
        )

    def _negatives(self, generator: torch.Generator) -> torch.Tensor:
        """Draw ``m`` negatives per (owner shard, block, type) uniformly from each shard's rows of the type.

        :returns: shape: ``[n(k), n(i), n(j), T * m]``, local ids on shard ``k``, type major
        """
        return self._draw_types(generator, self.n_shard)

    def _draw_types(self, generator: torch.Generator, blocks: int) -> torch.Tensor:
        """Draw ``m`` rows of every type and shard for ``blocks x blocks`` blocks: ``[n(k), blocks, blocks, T * m]``."""
        n, m, types = self.n_shard, self.negatives_per_shard, self.num_candidate_types
        uniform = torch.rand(n, blocks, blocks, types, m, generator=generator, dtype=torch.float64)
        counts = self._type_counts.view(n, 1, 1, types, 1)
        local = (uniform * counts.to(torch.float64)).long().minimum(counts - 1)
        return (local + self._type_offsets.view(n, 1, 1, types, 1)).view(n, blocks, blocks, types * m)


class StepSharedBessSampler(BessSampler):
    """Uniform negatives shared by all blocks of a step (``negatives="step"``).

    Every shard contributes the same ``m = num_negs_per_pos / n_shard`` entities to every block of
    a step, so all ``n_shard ** 2`` blocks score against one set of ``num_negs_per_pos`` negatives,
    as the single block of one shard does. A step then touches ``num_negs_per_pos`` negative rows
    instead of ``n_shard ** 2`` times as many (each drawn for fewer positives); with one shard it is
    :class:`BessSampler` itself. The batches say so (:attr:`BessBatch.shared_negatives`), and the
    exchange schemes then gather, move and score the ``K`` rows once per step instead of once per
    block (the embedding scheme: ``[L(i) * n(j) * b', q] x [K, c]``, the matrix shape of one shard).
    """

    shares_negatives = True

    def _negatives(self, generator: torch.Generator) -> torch.Tensor:
        """Draw ``m`` negatives per owner shard, the same for every block.

        :returns: shape: ``[n(k), n(i), n(j), m]``, local ids on shard ``k``, equal over ``(i, j)``
        """
        n = self.n_shard
        return self._draw(generator, 1).expand(n, n, n, -1).contiguous()


class StepSharedTypedBessSampler(TypedBessSampler):
    """Typed negatives shared by all blocks of a step (``negatives="typed_step"``).

    :class:`TypedBessSampler`'s draws, but, as in :class:`StepSharedBessSampler`, every shard
    contributes the same ``m`` entities of every candidate type to every block of a step: all
    ``n_shard ** 2`` blocks score against one set of ``T * num_negs_per_pos`` negatives, which the
    exchange schemes gather, move and score once per step. With one shard it is
    :class:`TypedBessSampler` itself.
    """

    shares_negatives = True

    def _negatives(self, generator: torch.Generator) -> torch.Tensor:
        """Draw ``m`` negatives per owner shard and type, the same for every block.

        :returns: shape: ``[n(k), n(i), n(j), T * m]``, local ids on shard ``k``, type major, equal over ``(i, j)``
        """
        n = self.n_shard
        return self._draw_types(generator, 1).expand(n, n, n, -1).contiguous()


#: the negative samplers by name (``negatives=``)
NEGATIVES: dict[str, type[BessSampler]] = {
    "step": StepSharedBessSampler,
    "block": BessSampler,
    "uniform": BessSampler,  # the earlier name of "block"
    "typed_step": StepSharedTypedBessSampler,
    "typed": TypedBessSampler,
}

#: the negatives a loop draws unless told otherwise (see :data:`NEGATIVES`)
DEFAULT_NEGATIVES = "step"


def resolve_negatives(negatives: str | type[BessSampler]) -> type[BessSampler]:
    """Return the sampler class of ``negatives`` (a name in :data:`NEGATIVES` or a ``BessSampler`` subclass).

    :raises ValueError: for an unknown name
    """
    if isinstance(negatives, type) and issubclass(negatives, BessSampler):
        return negatives
    if negatives not in NEGATIVES:
        raise ValueError(f"Unknown negatives={negatives!r}; expected one of {sorted(NEGATIVES)}.")
    return NEGATIVES[negatives]
