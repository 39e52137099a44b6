"""The ``(query, candidate)`` pairs excluded from the counts of one target, laid out per batch.

When ranking one target (:func:`~pykeen_bess.evaluation.ranking.rank_target`) the candidates
that are filtered (the known answers of the :class:`~pykeen_bess.evaluation.filtering.FilterIndex`)
or the true entity itself are not masked in the score blocks: their own counts are subtracted
(:func:`~pykeen_bess.evaluation.counting.subtract_excluded`). :meth:`ExcludedPairs.build` looks
up these pairs for all queries of the target at once on the device and lays them out per batch
in a ``[num_batches, P]`` table (``P``: the most pairs of a batch, padding pairs point nowhere),
so that every batch reads its pairs without host synchronisation; building the table reads a
few sizes on the host. :meth:`ExcludedPairs.of_queries` returns the pairs of the few queries
that are ranked again, whose blocks mask them as NaN.

Memory: ``3 * 8 * num_batches * P`` bytes for the table, ``3 * 8 * M`` bytes for the ``M`` pairs
sorted by query and ``8 * Q`` bytes for the number of pairs per query.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

import torch

from ..storage.digests import sha256_of_array
from .candidates import DeviceTables
from .filtering import FilterIndex, FilterSide
from .sharded import ShardedScoring

__all__ = [
    "ExcludedPairs",
    "ExcludedPairsCache",
    "PairsByBlock",
]


@dataclasses.dataclass(eq=False)
class ExcludedPairs:
    """The ``(query, candidate)`` pairs excluded from the counts of one target (filtered, true entity).

    Pairs whose entity is no candidate of a local shard (another process' shard, or outside
    ``restrict_entities_to``) are kept with position ``-1``: they never match a block.
    """

    #: shape: ``[num_batches, P]``, the row of each pair's query in its batch (0 for padding); each row of the
    #: table holds its padding first, then its pairs by shard position and column (:meth:`block_key`)
    rows: torch.Tensor
    #: shape: ``[num_batches, P]``, the local shard position of each pair's entity (``-1``: none, padding)
    positions: torch.Tensor
    #: shape: ``[num_batches, P]``, the column of each pair's entity among its shard's candidates
    columns: torch.Tensor
    #: shape: ``[M]``, the (global) query of every pair, sorted
    query: torch.Tensor
    #: shape: ``[M]``, the local shard position of every pair's entity (``-1``: none)
    position: torch.Tensor
    #: shape: ``[M]``, the column of every pair's entity
    column: torch.Tensor
    #: shape: ``[Q]``, long, the number of excluded pairs of each query that are local candidates
    per_query: torch.Tensor

    @classmethod
    def build(
        cls,
        scoring: ShardedScoring,
        index: FilterIndex | None,
        target: str,
        known: torch.Tensor,
        relations: torch.Tensor,
        true: torch.Tensor,
        batch_size: int,
    ) -> ExcludedPairs:
        """Look up the excluded pairs of all ``Q`` queries at once and lay them out per batch.

        :param scoring: the scoring (for the id tables of the local shards)
        :param index: the filter index (None: only the true entities are excluded)
        :param target: ``"head"`` or ``"tail"``
        :param known: shape: ``[Q]``, the known entity of each query (on the compute device)
        :param relations: shape: ``[Q]``, the relation of each query
        :param true: shape: ``[Q]``, the true entity of each query
        :param batch_size: the queries per batch
        :returns: the pairs
        """
        num_queries = known.shape[0]
        device = known.device
        query = torch.arange(num_queries, device=device)
        entity = true
        if index is not None:
            filtered_query, filtered_entity = index.filtered(cast(FilterSide, target), known, relations)
            other = filtered_entity != true[filtered_query]  # the true entity is excluded once, below
            query = torch.cat([query, filtered_query[other]])
            entity = torch.cat([entity, filtered_entity[other]])
        order = torch.argsort(query, stable=True)
        query, entity = query[order], entity[order]
        tables = scoring.device_tables(device)
        column = tables.entity_column[entity]
        position = torch.where(column >= 0, tables.entity_position[entity], -1)
        per_query = torch.zeros(num_queries, dtype=torch.long, device=device)
        per_query.index_add_(0, query, (position >= 0).long())
        # one row of P pairs per batch, in block order: padding and the pairs of no local candidate first, then
        # by shard position and column (the pairs of one block are contiguous, see block_key)
        num_batches = -(-num_queries // batch_size)
        batch = query // batch_size
        key = torch.where(position >= 0, position * (max(scoring.candidate_counts) + 1) + column, -1)
        layout = torch.argsort(key, stable=True)
        layout = layout[torch.argsort(batch[layout], stable=True)]
        per_batch = torch.bincount(batch, minlength=num_batches)
        width = max(1, int(per_batch.max()))
        # right-aligned: a batch's padding (position -1) comes before its pairs
        slot = torch.arange(query.shape[0], device=device) - torch.cumsum(per_batch, 0)[batch[layout]] + width
        rows = torch.zeros((num_batches, width), dtype=torch.long, device=device)
        positions = torch.full((num_batches, width), -1, dtype=torch.long, device=device)
        columns = torch.zeros((num_batches, width), dtype=torch.long, device=device)
        rows[batch[layout], slot] = query[layout] % batch_size
        positions[batch[layout], slot] = position[layout]
        columns[batch[layout], slot] = column[layout].clamp_min(0)
        return cls(rows, positions, columns, query, position, column, per_query)

    @staticmethod
    def block_key(positions: torch.Tensor, columns: torch.Tensor, num_columns: int) -> torch.Tensor:
        """Return the sort key of a batch's pairs, ``[P]``: ascending in every row of the table (see :meth:`build`).

        The pairs of the block of shard position ``p`` and columns ``start:stop`` are those with keys in
        ``[p * (C + 1) + start, p * (C + 1) + stop)`` (``C``: the most candidates of a local shard); padding
        and pairs of no local candidate have key ``-1``.

        :param positions: shape: ``[P]``, a batch's pair positions (a row of :attr:`positions`)
        :param columns: shape: ``[P]``, the pairs' columns
        :param num_columns: ``C``, the most candidates of a local shard
        """
        return torch.where(positions >= 0, positions * (num_columns + 1) + columns, -1)

    def of_queries(self, queries: torch.Tensor, num_queries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return the local pairs of some queries: ``(row in queries, position, column)``, each of shape ``[m]``.

        :param queries: shape: ``[n]``, global query indices
        :param num_queries: ``Q``
        """
        member = torch.full((num_queries,), -1, dtype=torch.long, device=queries.device)
        member[queries] = torch.arange(queries.shape[0], device=queries.device)
        row = member[self.query]
        keep = (row >= 0) & (self.position >= 0)
        return row[keep], self.position[keep], self.column[keep]


class PairsByBlock:
    """One batch's excluded pairs (a row of :class:`ExcludedPairs`' table), cut into the pairs of each block.

    In the table's block order the pairs of a block are one range of the batch's pairs: the ranges of
    all blocks are found by one ``searchsorted`` and one host read per batch (for a block loop that
    reads sizes anyway).
    """

    def __init__(
        self, pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], candidate_counts: Sequence[int], slice_size: int
    ):
        """Cut ``pairs`` (rows, positions, columns, each ``[P]``) into the blocks of ``slice_size`` columns.

        :param pairs: a batch's excluded pairs, in block order
        :param candidate_counts: the number of candidates of each local shard (by position)
        :param slice_size: the columns of a block (the last block of a shard may have fewer)
        """
        self.pairs = pairs
        num_columns = max(candidate_counts)
        key = ExcludedPairs.block_key(pairs[1], pairs[2], num_columns)
        blocks = [(p, start) for p, count in enumerate(candidate_counts) for start in range(0, count, slice_size)]
        bounds = [
            p * (num_columns + 1) + column
            for p, start in blocks
            for column in (start, min(start + slice_size, candidate_counts[p]))
        ]
        ends = torch.searchsorted(key, torch.tensor(bounds, dtype=key.dtype, device=key.device)).tolist()
        #: per block (shard position, first column): the range of its pairs
        self.ranges = {block: (ends[2 * i], ends[2 * i + 1]) for i, block in enumerate(blocks)}

    def of_block(self, position: int, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return the pairs of the block of shard position ``position`` starting at column ``start`` (views)."""
        low, high = self.ranges[position, start]
        rows, positions, columns = self.pairs
        return rows[low:high], positions[low:high], columns[low:high]


class ExcludedPairsCache:
    """The excluded pairs of the last evaluation's targets, built again only when what they depend on changes.

    Early stopping ranks the same validation triples every few epochs: the second evaluation finds
    every target's pairs here and builds nothing. The pairs depend on the filter index (the same
    object: :class:`~pykeen_bess.evaluation.filtering.FilterIndexCache` keeps it), the evaluation
    triples and the batch size, and on where each entity is a candidate (the local shards' columns);
    the key holds SHA-256 digests of the triples and of those id tables, so other triples (even of the same
    CRC-32, which the key held before) or a tensor changed in place build new pairs. The id tables' digests
    are computed once per tables object (an evaluator's evaluations share theirs,
    :class:`~pykeen_bess.evaluation.candidates.ScoringLayouts`, and nothing writes into them): on a GPU a
    digest is a copy to the host.
    """

    def __init__(self) -> None:
        """Start empty."""
        self._index: FilterIndex | None = None
        self._key: tuple | None = None
        self._pairs: dict[str, ExcludedPairs] = {}
        #: the last digested id tables, with the digests of their entity columns and positions
        self._tables_digest: tuple[DeviceTables, tuple[bytes, bytes]] | None = None

    def _table_digests(self, tables: DeviceTables) -> tuple[bytes, bytes]:
        """Return the SHA-256s of the tables' entity columns and positions (once per tables object)."""
        if self._tables_digest is None or self._tables_digest[0] is not tables:
            digests = (sha256_of_array(tables.entity_column), sha256_of_array(tables.entity_position))
            self._tables_digest = tables, digests
        return self._tables_digest[1]

    def get(
        self,
        scoring: ShardedScoring,
        index: FilterIndex | None,
        target: str,
        triples: torch.Tensor,
        batch_size: int,
    ) -> ExcludedPairs:
        """Return the pairs of ``target`` for the evaluation triples ``[Q, 3]`` (see :meth:`ExcludedPairs.build`)."""
        tables = self._table_digests(scoring.device_tables(triples.device))
        key = (str(triples.device), tuple(triples.shape), sha256_of_array(triples), batch_size, *tables)
        if key != self._key or index is not self._index:
            self._index, self._key, self._pairs = index, key, {}
        pairs = self._pairs.get(target)
        if pairs is None:
            heads, relations, tails = triples.unbind(dim=1)
            known, true = (heads, tails) if target == "tail" else (tails, heads)
            pairs = ExcludedPairs.build(scoring, index, target, known, relations, true, batch_size)
            self._pairs[target] = pairs
        return pairs
