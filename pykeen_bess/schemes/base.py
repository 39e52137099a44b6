"""The part of a BESS step every exchange scheme shares: gathering rows, positives, regularization.

A step on the global plan :class:`~pykeen_bess.data.batch.BessBatch` (``n`` shards, blocks of ``b``
slots, ``m = K / n`` negatives per shard and block) runs on every process over its ``L`` local
shards:

1. **gather** (:meth:`ExchangeScheme.gather`): each local shard ``l`` looks up, once per step, the
   rows it owns: heads of its blocks ``(l, *)``, tails of blocks ``(*, l)`` and its negatives for
   all ``n ** 2`` blocks. The unique rows become leaf tensors, so the gradient of a step is
   row-sparse by construction (:meth:`ExchangeScheme.set_row_gradients` hands it to the tables).
2. **positives**: tails move to the heads' shard, ``all_to_all([L(j), n(i), b, D]) -> [L(i), n(j), b, D]``;
   positive scores are computed where the heads live.
3. **negatives**: the scheme's own part (:meth:`ExchangeScheme.negative_scores`): every scheme
   returns the same ``[L(i), n(j), b', K]`` scores, candidate order shard ``k`` major, then the
   ``m`` draws, hence the same loss and gradients.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from pykeen.models import ERModel

from ..data.batch import BessBatch, BlockScores, RowGather, regularization_weights
from ..distributed import Topology
from ..tables.optim import row_sparse_grad
from ..tables.representation import ShardedEmbedding
from ..scoring import SharedCandidateScorer, Side
from .copies import UNCACHED, DeviceCopies
from .lookup import RowLookup, split_parts
from .regularization import Accumulator

__all__ = [
    "ExchangeScheme",
    "gather_rows",
]


class ExchangeScheme(ABC):
    """Computes the block scores of BESS steps for one process; subclasses move the negatives."""

    #: other names the scheme is known by (``exchange="embedding"``)
    synonyms: ClassVar[tuple[str, ...]] = ()
    #: the entity-table partition the scheme works on (``"token"``: rows, ``"encoding"``: columns)
    partition: ClassVar[str] = "token"
    #: the weight of a step's terms that every process computes in full, e.g. the encoding
    #: scheme's scores (1: every process computes its own part of the step)
    replicated_share: float = 1.0

    def __init__(
        self,
        model: ERModel,
        tables: Sequence[ShardedEmbedding],
        scorer: SharedCandidateScorer,
        topology: Topology,
    ):
        """Bind the step to a model whose entity representations are the given shard tables.

        :param model: the model (relation representations and interaction are used as they are)
        :param tables: the model's entity representations, as shard tables
        :param scorer: the shared-candidate scorer of the model's interaction
        :param topology: the process topology
        """
        self.model = model
        self.tables = list(tables)
        self.scorer = scorer
        self.topology = topology
        self.head_indices = list(model.interaction.head_indices)
        self.tail_indices = list(model.interaction.tail_indices)
        self.lookup = RowLookup(model, self.tables)
        #: how the rows of a step are weighed in the regularization term
        self.row_weights = RowWeights(self.lookup, topology)
        #: a process holding several shards sums the gradients of rows every shard uses (the shared negatives,
        #: the relations) per shard, then over its shards, as processes holding one shard each do (so ``n``
        #: logical shards and ``n`` ranks agree bitwise for two shards, to rounding beyond); on the CPU only,
        #: where sums are deterministic (a GPU's atomic adds are not)
        self.sums_per_shard = topology.n_local > 1 and self.tables[0].compute_device.type == "cpu"

    @classmethod
    def applies(cls, model: ERModel) -> bool:
        """Return whether the scheme can train the model (all token schemes can)."""
        return True

    def slot_range(self, block_size: int) -> tuple[int, int]:
        """Return the slots ``[start, stop)`` of every block this process scores (its replica's share)."""
        return self.topology.replica_slots(block_size)

    # -- the static step's rows ------------------------------------------------------------------

    def looked_up_slots(self, block_size: int) -> tuple[int, int]:
        """Return the slots ``[start, stop)`` of every block whose rows a static step looks up in this process' tables.

        Default: the slots it scores (:meth:`slot_range`).
        """
        return self.slot_range(block_size)

    def scored_rows(self, looked_up: RowGather) -> RowGather:
        """Return the rows a static step scores, from the rows it looked up in this process' tables (default: those).

        :param looked_up: one row per occurrence (``in_role_order``) of the slots :meth:`looked_up_slots`
            and of the negatives; its leaves are what the step differentiates and updates
        """
        return looked_up

    @classmethod
    def get_name(cls) -> str:
        """Return the scheme's short name (its first synonym, e.g. ``"embedding"``)."""
        return cls.synonyms[0] if cls.synonyms else cls.__name__

    # -- the cost model --------------------------------------------------------------------------

    @classmethod
    def cost(
        cls,
        n_shard: int,
        block_size: int,
        num_negs_per_pos: int,
        entity_width: int,
        query_width: int,
        element_size: int = 4,
        shared_negatives: bool = False,
    ) -> int:
        """Return the bytes one process sends to the others per step (forward pass).

        With ``n`` shards, ``b`` slots per block, ``K`` negatives per positive, ``D`` packed entity
        values per row and ``q`` query values, every process sends ``n - 1`` of the ``n`` chunks of
        each all-to-all and its own chunk to ``n - 1`` peers in an all-gather. Every scheme moves
        the positive tails, ``(n - 1) * b * D``, plus what :meth:`negative_cost` says. The backward
        pass sends the same amounts back (gradients).

        :param shared_negatives: whether all blocks of a step share one set of negatives
            (:attr:`~pykeen_bess.data.batch.BessBatch.shared_negatives`)
        :returns: bytes sent per process and step
        """
        n, b = n_shard, block_size
        elements = (n - 1) * b * entity_width
        elements += cls.negative_cost(n, b, num_negs_per_pos, entity_width, query_width, shared_negatives)
        return elements * element_size

    @classmethod
    @abstractmethod
    def negative_cost(cls, n: int, b: int, k: int, entity_width: int, query_width: int, shared: bool = False) -> int:
        """Return the values one process sends per step to score the negatives (forward pass).

        :param shared: whether all blocks share one set of negatives
        """

    # -- gathering -------------------------------------------------------------------------------

    def gather(self, batch: BessBatch, start: int = 0, stop: int | None = None) -> RowGather:
        """Look up the rows this process owns and needs for the slots ``start:stop`` of a step, as leaves.

        :param batch: the global plan of the step
        :param start: the first slot this process trains (replicas split the slot axis)
        :param stop: the end of its slots (default: the block size)
        :returns: the rows and index tensors into them
        """
        return gather_rows(self.tables, self.topology, batch, start, stop)

    def set_row_gradients(self, gathered: RowGather, dense: bool = False) -> None:
        """Hand the accumulated leaf gradients to the shard tables.

        :param gathered: the rows of the step, whose leaves hold the accumulated gradients
        :param dense: build dense gradients (for optimizers without a row-sparse rule) instead of
            coalesced row-sparse ones
        """
        first, rows = gathered.first_real, gathered.real_rows
        for table, leaf in zip(self.tables, gathered.leaves):
            if leaf.grad is None:
                continue
            if dense:  # tables that are parameters only (checked by the loop)
                table.weight.grad = torch.zeros_like(table.weight).index_add_(0, rows, leaf.grad[first:])
            else:
                table.gradient = row_sparse_grad(table.weight, rows, leaf.grad[first:])
                # the rows' current values, already on the compute device: the optimizer need not read them again
                table.touched_values = leaf.detach()[first:]

    # -- scoring ---------------------------------------------------------------------------------

    def scores(
        self,
        batch: BessBatch,
        gathered: RowGather,
        start: int = 0,
        stop: int | None = None,
        copies: DeviceCopies = UNCACHED,
    ) -> BlockScores:
        """Score the slots ``start:stop`` of every local block against the block's negatives.

        The regularization term is PyKEEN's sLCWA term of the step as if every positive had its
        block's shared negatives as its own (see :func:`~pykeen_bess.data.batch.regularization_weights`),
        this process' share of the slots ``start:stop``: summing it over slices (sub-batches) and
        processes gives the term of the whole step regardless of how it is split.

        :param batch: the global plan of the step
        :param gathered: the rows gathered by :meth:`gather`
        :param start: the first slot (sub-batching slices the slot axis)
        :param stop: the end slot (exclusive), defaults to the block size
        :param copies: how the step's masks and weights reach the device (the static step keeps them)
        :returns: the scores of the local blocks
        """
        topology = self.topology
        n = topology.n_shard
        stop = batch.block_size if stop is None else stop
        slots = slice(start, stop)
        gathered_slots = slice(start - gathered.first_slot, stop - gathered.first_slot)
        device = self.tables[0].compute_device
        local_valid = topology.select_local(batch.valid[..., slots], 0).reshape(-1)  # on the CPU
        valid_index = None if bool(local_valid.all()) else copies.index(local_valid, device)
        regularization = Accumulator(gathered.term_gradients)
        normalized = [self.lookup.normalized_rows(table, leaf) for table, leaf in zip(self.tables, gathered.leaves)]
        role_weights, relation_weights = self.row_weights.of(batch, gathered, start, stop, copies)

        # the rows of the three roles in one lookup: heads and tails of the positives, and the
        # negatives of every local block, shared by its slots. These are gathered in the layout
        # [n(i), n(j), L(k), m, D] and viewed as [L(k), n(i), n(j), m, D]: after the (local)
        # all-to-all the candidates of a block are then contiguous. Negatives shared by all blocks
        # are [L(k), 1, 1, m, D].
        heads, tails_out, negatives_local = self.lookup.roles(
            normalized,
            [
                gathered.heads[..., gathered_slots],
                gathered.tails[..., gathered_slots],
                gathered.negatives.permute(1, 2, 0, 3),
            ],
            regularization,
            role_weights,
            identity=gathered.in_role_order,
            copies=copies,
            leaves=gathered.leaves,
        )
        negatives_local = negatives_local.permute(2, 0, 1, 3, 4)

        # positives: heads stay, tails move to the heads' shard
        tails = topology.all_to_all(tails_out)
        relations = self.lookup.relations(
            topology.select_local(batch.relations[..., slots], 0),
            relation_weights,
            regularization,
            self.sums_per_shard,
            copies,
        )
        head_parts, tail_parts = self.lookup.unpack(heads), self.lookup.unpack(tails)

        # per side: the queries of its slots, and (for inner products) their positives' scores from the same
        # queries; shapes [L(i), n(j), b''(, q)]
        positive_scores: list[torch.Tensor | None] = []
        queries = []
        sides = self._side_slots(batch.num_head_corrupted, start, stop)
        # each role split once at the sides' boundary (the backward pass joins two gradients instead of
        # zero-filling the whole role once per side)
        ranges = [side_slots for _, side_slots in sides]
        side_relations = split_parts(relations, ranges)
        side_heads = split_parts(self.lookup.select(head_parts, self.head_indices), ranges)
        side_tails = split_parts(self.lookup.select(tail_parts, self.tail_indices), ranges)
        by_side = zip(sides, side_relations, side_heads, side_tails)
        for (side, _), side_relation, side_head, side_tail in by_side:
            known, own = (side_tail, side_head) if side == "head" else (side_head, side_tail)
            query = self.scorer.query(side, known, side_relation)
            positive_scores.append(self.scorer.aligned_scores(side, query, own))
            queries.append(query)
        # the negatives' scores [L(i), n(j), b', K]: both sides' queries in one product where the candidates are
        # the same for both (the scorer's features and the entity parts of both roles)
        cache: dict[str, Any] = {}
        if len(sides) > 1 and self.scorer.side_free_candidates and self.head_indices == self.tail_indices:
            negative = self.negative_scores(sides[-1][0], torch.cat(queries, dim=2), negatives_local, cache)
        else:
            negative_scores = [
                self.negative_scores(side, query, negatives_local, cache) for (side, _), query in zip(sides, queries)
            ]
            negative = torch.cat(negative_scores, dim=2) if len(negative_scores) > 1 else negative_scores[0]
        side_positives = [score for score in positive_scores if score is not None]
        if len(side_positives) == len(sides):
            positive = torch.cat(side_positives, dim=2) if len(side_positives) > 1 else side_positives[0]
        else:
            positive = self.scorer.score_triples(
                self.lookup.select(head_parts, self.head_indices),
                relations,
                self.lookup.select(tail_parts, self.tail_indices),
            )
        if batch.candidate_types is not None:  # typed negatives: each slot against its corrupted side's type
            negative = select_candidate_type(
                negative, topology.select_local(batch.candidate_types[..., slots], 0), n, batch.num_candidate_types
            )
        return BlockScores(
            positive=positive,
            negative=negative,
            valid_index=valid_index,
            regularization=regularization.value,
            weights=None if batch.weights is None else topology.select_local(batch.weights[..., slots], 0),
        )

    @abstractmethod
    def negative_scores(
        self, side: Side, query: torch.Tensor, negatives: torch.Tensor, cache: dict[str, Any]
    ) -> torch.Tensor:
        """Score the queries of one side against their blocks' negatives.

        :param side: the corrupted side
        :param query: shape: ``[L(i), n(j), b'', q]``, the scorer's queries of the side's slots
        :param negatives: shape: ``[L(k), n(i), n(j), m, D]``, this process' negatives of every block,
            packed (all tables' values of a row side by side); ``[L(k), 1, 1, m, D]`` when all blocks
            share them (:attr:`~pykeen_bess.data.batch.BessBatch.shared_negatives`)
        :param cache: shared by the sides of one slice (e.g. negatives moved once for both sides)
        :returns: shape: ``[L(i), n(j), b'', K]``
        """

    # -- helpers ---------------------------------------------------------------------------------

    def candidate_parts(self, side: Side, packed: torch.Tensor) -> torch.Tensor:
        """Return the scorer's candidate features of packed rows ``[*, D]`` for the corrupted side."""
        indices = self.head_indices if side == "head" else self.tail_indices
        return self.scorer.candidates(side, self.lookup.select(self.lookup.unpack(packed), indices))

    @staticmethod
    def _side_slots(num_head_corrupted: int, start: int, stop: int) -> list[tuple[Side, slice]]:
        """Split the slots ``start:stop`` into head- and tail-corrupted ranges (relative to start)."""
        result: list[tuple[Side, slice]] = []
        boundary = min(max(num_head_corrupted, start), stop)
        if boundary > start:
            result.append(("head", slice(0, boundary - start)))
        if stop > boundary:
            result.append(("tail", slice(boundary - start, stop - start)))
        return result


def gather_rows(
    tables: Sequence[ShardedEmbedding], topology: Topology, batch: BessBatch, start: int = 0, stop: int | None = None
) -> RowGather:
    """Look up the rows of ``tables`` that a process of ``topology`` owns and needs for the slots ``start:stop``.

    What :meth:`ExchangeScheme.gather` does with the scheme's tables; the encoding lookup reads its column
    parts with it. Each occurrence's row is deduplicated: ``leaves`` hold every distinct row once (``[N, W]``
    per table, the dummy row ``-1`` of padding first where there is one), ``heads``, ``tails`` and
    ``negatives`` index them.
    """
    stop = batch.block_size if stop is None else stop
    size = tables[0].sharding.shard_size
    offset = (torch.arange(topology.n_local) * size).view(-1, 1, 1)
    valid = batch.valid[..., start:stop]
    heads, tails, negatives = batch.heads[..., start:stop], batch.tails[..., start:stop], batch.negatives
    if batch.shared_negatives:  # one set for all blocks: [n(k), 1, 1, m]
        negatives = negatives[:, :1, :1]
    if not bool(valid.all()):  # the plan is on the CPU: no device synchronisation
        # padding slots use the dummy row -1; negatives of blocks without real positives here too
        heads = torch.where(valid, heads, -1)
        tails = torch.where(valid, tails, -1)
        used = valid.any(dim=-1) if not batch.shared_negatives else valid.any().view(1, 1)
        negatives = torch.where(used.unsqueeze(0).unsqueeze(-1), negatives, -1)
    # heads of blocks (l, *), tails of blocks (*, l), this shard's negatives of all blocks
    head_rows = _offset_rows(topology.select_local(heads, 0), offset)
    tail_rows = _offset_rows(topology.select_local(tails, 1).transpose(0, 1), offset)
    negative_rows = _offset_rows(topology.select_local(negatives, 0), offset.unsqueeze(-1))
    wanted = torch.cat([head_rows.reshape(-1), tail_rows.reshape(-1), negative_rows.reshape(-1)])
    rows, inverse = torch.unique(wanted, return_inverse=True)
    first_real = int(rows.numel() > 0 and int(rows[0]) < 0)  # on the CPU
    lookup = rows.clamp_min(0)
    # each table's storage tier reads the rows to the compute device
    leaves = [table.read_rows(lookup).requires_grad_(table.trainable) for table in tables]
    device = tables[0].compute_device
    rows, inverse = rows.to(device), inverse.to(device)
    sizes = [head_rows.numel(), tail_rows.numel(), negative_rows.numel()]
    head_index, tail_index, negative_index = inverse.split(sizes)
    return RowGather(
        rows=rows,
        leaves=leaves,
        heads=head_index.view(head_rows.shape),
        tails=tail_index.view(tail_rows.shape),
        negatives=negative_index.view(negative_rows.shape),
        first_real=first_real,
        first_slot=start,
    )


def select_candidate_type(scores: torch.Tensor, candidate_types: torch.Tensor, n: int, types: int) -> torch.Tensor:
    """Keep every slot's scores against the negatives of its candidate type.

    :param scores: shape: ``[L(i), n(j), b', n(k) * T * m]``, every slot against all ``T`` types' negatives
        (shard ``k`` major, then the type, then the ``m`` draws)
    :param candidate_types: shape: ``[L(i), n(j), b']``, each slot's type (CPU)
    :param n: the number of shards
    :param types: ``T``
    :returns: shape: ``[L(i), n(j), b', K]``, ``K = n * m``, shard ``k`` major
    """
    *slots, _ = scores.shape
    scores = scores.view(*slots, n, types, -1)
    index = candidate_types.to(scores.device).view(*slots, 1, 1, 1).expand(*slots, n, 1, scores.shape[-1])
    return scores.gather(-2, index).reshape(*slots, -1)


class RowWeights:
    """The regularization weights of a step's local rows, as PyKEEN's sLCWA loop weighs them.

    Steps without padding (most steps) weigh their rows as every other step of their shape does: their
    weights are computed once and kept.
    """

    def __init__(self, lookup: RowLookup, topology: Topology):
        """Weigh the rows of ``lookup``'s tables for a process of ``topology``."""
        self.lookup = lookup
        self.topology = topology
        self._full_steps: dict[tuple, Any] = {}  # by the plan's shapes and slots

    def of(
        self, batch: BessBatch, gathered: RowGather, start: int, stop: int, copies: DeviceCopies = UNCACHED
    ) -> tuple[list[list[torch.Tensor | None]], torch.Tensor | None]:
        """Return the regularization weights of the local rows of slots ``start:stop`` (None: nothing is regularized).

        :returns: per role (heads, tails, negatives) and table, the weight of each looked-up row (CPU), and the
            relations' weights ``[L(i), n(j), b']``; each negative row shared by all blocks weighs what
            it weighs in all blocks together
        """
        lookup = self.lookup
        if not lookup.regularized:  # no weights to compute
            return [[None] * len(lookup.tables)] * 3, None
        key: tuple | None = None
        if batch.candidate_types is None and bool(batch.valid.all()):
            key = (batch.valid.shape, start, stop, batch.num_head_corrupted, batch.negatives.shape)
            key += (gathered.negatives.shape, batch.num_candidate_types, batch.shared_negatives)
            if key in self._full_steps:
                return self._full_steps[key]
        topology = self.topology
        candidates = batch.candidate_types
        to_device = None if candidates is None else functools.partial(copies.copy, device=candidates.device)
        weights = regularization_weights(batch, start, stop, to_device)
        types = batch.num_candidate_types
        blocks = gathered.negatives.shape[1]  # n, or 1 when the step's blocks share the negatives
        negative_head, negative_tail = weights.negative_head, weights.negative_tail
        if blocks < topology.n_shard:
            negative_head = negative_head.sum(dim=(0, 1), keepdim=True)
            negative_tail = negative_tail.sum(dim=(0, 1), keepdim=True)
        negative_shape = (blocks, blocks, topology.n_local, types, gathered.negatives.shape[-1] // types)
        role_weights = [
            lookup.role_weights(head=topology.select_local(weights.head, 0)),
            lookup.role_weights(tail=topology.select_local(weights.tail, 1).transpose(0, 1)),
            lookup.role_weights(
                head=_per_row(negative_head, negative_shape), tail=_per_row(negative_tail, negative_shape)
            ),
        ]
        result = role_weights, topology.select_local(weights.relation, 0)
        if key is not None:
            self._full_steps[key] = result
        return result


def _per_row(block_weights: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Spread the weights ``[B, B, T]`` of a block's negatives to its rows: ``[B, B, L(k), T * m]``."""
    blocks, _, local, types, m = shape
    return block_weights.view(blocks, blocks, 1, types, 1).expand(shape).reshape(blocks, blocks, local, types * m)


def _offset_rows(local_ids: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Turn local ids of the local shards (leading axis) into flat rows, keeping -1 (dummy); CPU tensors."""
    rows = local_ids + offset
    return rows if bool(offset.max() == 0) else torch.where(local_ids >= 0, rows, -1)
