"""The encoding scheme: every process scores its coordinates of the whole batch; one sum of partial scores.

With the encoding (column) partition (:mod:`pykeen_bess.tables.encoding`) the plan has one shard and one
block of ``B`` slots: every process sees the whole batch, the ``K`` negatives of the block are
drawn uniformly from all entities, and there is no shardpair padding. Each process holds ``Lc``
of the ``c`` column parts of every row; for each of them it computes partial scores of the
positives and of the negatives from the part's coordinates (:class:`~pykeen_bess.tables.encoding.SeparableScoring`),
and one :meth:`~pykeen_bess.distributed.Topology.column_sum` of the ``[B, 1 + K]`` partial scores
gives every process the full scores (backward: the identity, so every part's coordinates get
their gradient where they live). No row moves.

Terms that every process computes in full would count ``c`` times in the sums over processes:
the relations' regularization (relations are replicated) and the model's own terms are weighted
with this process' share ``Lc / c`` (:attr:`EncodingScheme.replicated_share`); entity
regularizers see whole rows through column sums and are part of every process' loss, whose
reported value is likewise scaled by the share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pykeen.models import ERModel

from ..data.batch import BessBatch, BlockScores, RowGather, regularization_weights
from ..distributed import Topology
from ..tables.encoding import ColumnSplit, SeparableScoring, check_encoding_model, slice_columns
from ..tables.representation import ShardedEmbedding
from ..scoring import SharedCandidateScorer, Side
from .base import ExchangeScheme
from .copies import UNCACHED, DeviceCopies
from .lookup import slice_parts
from .regularization import Accumulator

__all__ = [
    "EncodingScheme",
]


class EncodingScheme(ExchangeScheme):
    """Partial scores of this process' column parts, summed over all parts (``exchange="encoding"``)."""

    synonyms = ("encoding",)
    partition = "encoding"

    def __init__(
        self,
        model: ERModel,
        tables: Sequence[ShardedEmbedding],
        scorer: SharedCandidateScorer,
        topology: Topology,
    ):
        """Bind the step to the column parts of the topology.

        :raises ValueError: for a topology with several row shards, or a model that is not column-separable
            (the loop checks the model with :func:`~pykeen_bess.tables.encoding.check_encoding_model` first)
        """
        if topology.n_shard != 1:
            raise ValueError(
                f"The encoding scheme needs one row shard (the encoding partition), not {topology.n_shard}."
            )
        super().__init__(model, tables, scorer, topology)
        #: the partial scorer and how summed partial scores become scores
        self.separable = SeparableScoring(model)
        #: the coordinates of every column part (relations are replicated: their shape is the whole row's; a model
        #: without relation representations, UM, by its entities')
        rows = model.relation_representations or model.entity_representations
        self.split = ColumnSplit(rows[0].shape[0], topology.n_column)
        #: the weight of terms every process computes in full (``Lc / c``)
        self.replicated_share = len(topology.local_columns) / topology.n_column
        #: per local part: its coordinates in the whole row and in the stored (local) rows
        self.parts: list[tuple[tuple[int, int], tuple[int, int]]] = []
        for part in topology.local_columns:
            start, stop = self.split.bounds(part)
            local = (start, stop) if topology.holds_all_columns else (0, stop - start)
            self.parts.append(((start, stop), local))
        self.relation_shapes = [tuple(r.shape) for r in model.relation_representations]

    @classmethod
    def applies(cls, model: ERModel) -> bool:
        """Return whether the model's interaction is column-separable (and its representations split alike)."""
        try:
            check_encoding_model(model)
        except ValueError:
            return False
        return True

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
        """Return the bytes one process sends per step with ``n`` column parts, for a batch of ``n**2 * b`` positives.

        The arguments are those of the token schemes for the same batch (``b`` slots per block of
        ``n**2`` blocks), so the costs compare. Every process sends its partial scores of the
        ``B = n**2 * b`` positives and their ``K`` shared negatives once, in a ring all-reduce:
        ``2 (n - 1) / n * B * (1 + K)`` values, independent of the entity width ``D``. Row norms for
        constraints and regularizers add ``2 (n - 1) / n`` values per constrained or regularized row;
        the backward pass sends nothing. The plan's one block shares its negatives whatever
        ``shared_negatives`` says.
        """
        return cls.batch_cost(n_shard, n_shard**2 * block_size, num_negs_per_pos, element_size)

    @staticmethod
    def batch_cost(n_column: int, batch_size: int, num_negs_per_pos: int, element_size: int = 4) -> int:
        """Return the bytes one process sends per step for a batch of ``B`` slots (the one block of the plan).

        ``2 (c - 1) * B * (1 + K) * element_size // c``: a ring all-reduce of the ``[B, 1 + K]`` partial
        scores, as :class:`~pykeen_bess.distributed.ColumnTopology` counts it.
        """
        return 2 * (n_column - 1) * batch_size * (1 + num_negs_per_pos) * element_size // n_column

    @classmethod
    def negative_cost(cls, n: int, b: int, k: int, entity_width: int, query_width: int, shared: bool = False) -> int:
        """Return the values sent for the negatives' partial scores (see :meth:`cost`)."""
        return 2 * (n - 1) * n * b * k

    # -- scoring ---------------------------------------------------------------------------------

    def scores(
        self,
        batch: BessBatch,
        gathered: RowGather,
        start: int = 0,
        stop: int | None = None,
        copies: DeviceCopies = UNCACHED,
    ) -> BlockScores:
        """Score the slots ``start:stop`` of the batch: partial scores of the local parts, one column sum.

        :param batch: the plan of the step (one shard: ``[1, 1, B]`` slots, ``[1, 1, 1, K]`` negatives)
        :param gathered: the rows gathered by :meth:`gather` (all columns this process holds)
        :param start: the first slot
        :param stop: the end slot (exclusive), defaults to the block size
        :param copies: how the step's masks and weights reach the device (the static step keeps them)
        :returns: the scores ``[1, 1, b']`` and ``[1, 1, b', K]``
        """
        stop = batch.block_size if stop is None else stop
        slots = slice(start, stop)
        gathered_slots = slice(start - gathered.first_slot, stop - gathered.first_slot)
        device = self.tables[0].compute_device
        local_valid = batch.valid[..., slots].reshape(-1)
        valid_index = None if bool(local_valid.all()) else copies.index(local_valid, device)
        regularization, replicated = Accumulator(), Accumulator()
        lookup = self.lookup
        normalized = [lookup.normalized_rows(table, leaf) for table, leaf in zip(self.tables, gathered.leaves)]
        m = gathered.negatives.shape[-1]
        relation_weights: torch.Tensor | None = None
        role_weights: list[list[torch.Tensor | None]] = [[None] * len(self.tables)] * 3
        if lookup.regularized:  # else no weights to compute
            weights = regularization_weights(batch, start, stop)
            # relations are replicated: every process weighs its share of their regularization
            relation_weights = weights.relation * self.replicated_share
            role_weights = [
                lookup.role_weights(head=weights.head),
                lookup.role_weights(tail=weights.tail),
                lookup.role_weights(
                    head=weights.negative_head.view(1, 1, 1).expand(1, 1, m),
                    tail=weights.negative_tail.view(1, 1, 1).expand(1, 1, m),
                ),
            ]
        relations = lookup.relations(batch.relations[..., slots], relation_weights, replicated, copies=copies)
        # the rows of the three roles in one lookup
        heads, tails, negatives = lookup.roles(
            normalized,
            [
                gathered.heads[..., gathered_slots],
                gathered.tails[..., gathered_slots],
                gathered.negatives.view(1, 1, m),
            ],
            regularization,
            role_weights,
            copies=copies,
        )
        head_parts, tail_parts, negative_parts = lookup.unpack(heads), lookup.unpack(tails), lookup.unpack(negatives)
        partial = []
        for (start_all, stop_all), (start_own, stop_own) in self.parts:
            own = [(start_own, stop_own)] * len(self.tables)
            h = self._columns(head_parts, [t.shape for t in self.tables], own)
            t = self._columns(tail_parts, [t.shape for t in self.tables], own)
            candidates = self._columns(negative_parts, [t.shape for t in self.tables], own)
            r_parts = relations if isinstance(relations, tuple) else (relations,)
            r_sliced = self._columns(list(r_parts), self.relation_shapes, [(start_all, stop_all)] * len(r_parts))
            r = r_sliced[0] if len(r_sliced) == 1 else tuple(r_sliced)
            positive = self.separable.positive(
                lookup.select(h, self.head_indices), r, lookup.select(t, self.tail_indices)
            )
            cache: dict[str, Any] = {}
            sides = []
            for side, side_slots in self._side_slots(batch.num_head_corrupted, start, stop):
                known = lookup.select(
                    t if side == "head" else h, self.tail_indices if side == "head" else self.head_indices, side_slots
                )
                query = self.separable.scorer.query(side, known, slice_parts(r, side_slots))
                chosen = lookup.select(candidates, self.head_indices if side == "head" else self.tail_indices)
                sides.append(self.negative_scores(side, query, self.separable.scorer.candidates(side, chosen), cache))
            negative = torch.cat(sides, dim=2) if len(sides) > 1 else sides[0]
            partial.append(torch.cat([positive.unsqueeze(-1), negative], dim=-1))
        # one sum over all column parts (an all-reduce across processes): [1, 1, b', 1 + K]
        scores = self.separable.finish(self.topology.column_sum(torch.stack(partial)))
        return BlockScores(
            positive=scores[..., 0],
            negative=scores[..., 1:].contiguous(),
            valid_index=valid_index,
            regularization=regularization.value + replicated.value,
            replicated_regularization=replicated.value,
            weights=None if batch.weights is None else batch.weights[..., slots],
        )

    def negative_scores(
        self, side: Side, query: torch.Tensor, negatives: torch.Tensor, cache: dict[str, Any]
    ) -> torch.Tensor:
        """Partial scores of one column part: query features ``[1, 1, b'', q]`` against candidates ``[1, 1, K, c]``.

        :returns: shape: ``[1, 1, b'', K]``, the part's partial scores (summed over parts by :meth:`scores`)
        """
        return self.separable.scorer.score(side, query, negatives)

    @staticmethod
    def _columns(
        parts: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]], bounds: Sequence[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """Slice every representation tensor to its bounds along the first axis of its shape."""
        return [slice_columns(x, shape, start, stop) for x, shape, (start, stop) in zip(parts, shapes, bounds)]
