"""The encoding lookup: whole rows assembled from column parts (the encoding strategy), for any interaction.

With the encoding (column) partition every process holds all entities with ``d / c`` of their
coordinates. Interactions that are not column-separable (RESCAL, TransR, ...) need whole rows.
:class:`EncodingLookupScheme` assembles them as an encoding lookup does: every part
looks up the requested rows in its columns and one all-to-all sends each requester the column
slices of its rows, which it concatenates (the ids need no all-gather: every process draws the
same plan, so it knows every part's requests). The ``B`` slots of the step's one block are split
over the ``c`` parts (part ``r`` scores slots ``r * ceil(B / c)`` onwards, as replicas split a
block; with replicas, the parts split their replica's share); each part requests the heads and
tails of its slots and the block's ``K`` negatives, scores them with the model's own scorer, and
after all sub-batches sends the whole rows' gradients back the same way, where the owners add them
into their columns (one all-to-all per table each way and step). Relations are replicated; their
gradients are summed over the processes as usual.

The static step (:mod:`~pykeen_bess.training.steps.static_step`) does the same with fixed shapes
(:meth:`EncodingLookupScheme.scored_rows`): every part looks up the rows of all the replica's slots and
the negatives in its columns, one row per occurrence (no ``unique``); every part's request is the
heads and tails of its share of the slots (padded to the largest share) and the negatives; one
differentiable all-to-all per table assembles the whole rows, and the backward pass sends their
gradients back to the occurrences they came from.

With all parts in one process the rows are whole already: the scheme is the one-shard token
scheme (``embedding``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from pykeen.models import ERModel

from ..data.batch import BessBatch, RowGather
from ..distributed import Topology
from ..tables.optim import row_sparse_grad
from ..tables.representation import ShardedEmbedding
from ..scoring import SharedCandidateScorer
from .base import gather_rows
from .embedding import EmbeddingMovingScheme
from .lookup import RowLookup

__all__ = [
    "EncodingLookupScheme",
]


class WholeRows:
    """What scoring reads of an entity table, for whole rows assembled from column parts."""

    def __init__(self, table: ShardedEmbedding):
        """Describe the whole rows of a column part's table (its ``whole_embedding``)."""
        embedding: Any = table.whole_embedding  # set by ColumnShardTables
        self.normalizer = embedding.normalizer
        self.regularizer = embedding.regularizer
        self.dropout = None
        self.is_complex = embedding.is_complex
        self.shape = tuple(embedding.shape)
        self.row_shape = tuple(embedding._shape)
        self.row_width = embedding._embeddings.weight.shape[1]
        self.compute_device = table.compute_device

    def view_rows(self, x: torch.Tensor) -> torch.Tensor:
        """View rows ``[*, row_width]`` in the representation's shape (complex if needed)."""
        return ShardedEmbedding.view_rows(self, x)  # type: ignore[arg-type]


class EncodingLookupScheme(EmbeddingMovingScheme):
    """Whole rows from the column parts (``exchange="encoding_lookup"``); any interaction."""

    synonyms: ClassVar[tuple[str, ...]] = ("encoding_lookup",)
    partition: ClassVar[str] = "encoding"

    def __init__(
        self,
        model: ERModel,
        tables: Sequence[ShardedEmbedding],
        scorer: SharedCandidateScorer,
        topology: Topology,
    ):
        """Bind the step to the column parts of the topology.

        :raises ValueError: for a topology with several row shards
        """
        if topology.n_shard != 1:
            raise ValueError(f"The encoding lookup needs one row shard (encoding partition), not {topology.n_shard}.")
        super().__init__(model, tables, scorer, topology)
        #: the column parts' tables (this process' columns of all rows)
        self.column_tables = list(tables)
        if not topology.holds_all_columns:  # scoring sees whole rows
            self.tables = [WholeRows(table) for table in tables]  # type: ignore[misc]
            self.lookup = RowLookup(model, self.tables)
        #: the requests of the current step: per part, positions into the gathered rows
        self._requests: list[torch.Tensor] = []
        #: a static step's requests (fixed per number of slots and negatives), and every part's slot count
        self._static: dict[tuple, tuple[torch.Tensor, list[int]]] = {}
        self._column_leaves: list[torch.Tensor] = []

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
        """Return the bytes one process sends per step (at most) with ``n`` column parts, batches of ``n**2 * b``.

        Every part requests at most ``M = 2 B / n + K`` rows (heads and tails of its ``B / n`` slots,
        the ``K`` shared negatives); it sends the ``n - 1`` others its ``D / n`` columns of theirs:
        ``(n - 1) * M * D / n`` values forward, the same backward (gradients). Duplicate rows make
        the measured bytes smaller; uneven parts are padded to the largest. The plan's one block
        shares its negatives whatever ``shared_negatives`` says.
        """
        if n_shard == 1:
            return 0
        batch = n_shard**2 * block_size
        rows = 2 * -(-batch // n_shard) + num_negs_per_pos
        return 2 * (n_shard - 1) * rows * -(-entity_width // n_shard) * element_size

    @classmethod
    def negative_cost(cls, n: int, b: int, k: int, entity_width: int, query_width: int, shared: bool = False) -> int:
        """Return the values sent for the negatives' rows (see :meth:`cost`)."""
        return (n - 1) * k * -(-entity_width // n)

    # -- slots, rows and gradients ---------------------------------------------------------------

    def looked_up_slots(self, block_size: int) -> tuple[int, int]:
        """Return the slots of the replica: a static step looks up every part's rows in this process' columns."""
        return self.topology.replica_slots(block_size)

    def scored_rows(self, looked_up: RowGather) -> RowGather:
        """Assemble the whole rows of this part's slots and the negatives from every part's columns (fixed shapes).

        Every part requests ``M = 2 * share + m`` rows: the heads and tails of its share of the replica's
        ``S`` slots (the last part's share padded by repeating row 0, which nothing scores) and the ``m``
        negatives. One all-to-all per table sends every part its requested rows' slices of this process'
        columns (differentiable: the backward sends the whole rows' gradients back to the columns' owners).

        :param looked_up: the rows of all the replica's slots and the negatives in this process' columns,
            ``[2 S + m, W_own]`` per table, heads, tails and negatives in role order
        :returns: the whole rows ``[M, W]`` per table, with this part's heads, tails and negatives indexing them
        """
        topology = self.topology
        if topology.holds_all_columns:
            return looked_up
        n, part = topology.n_column, topology.local_columns[0]
        slots = looked_up.heads.shape[-1]  # S: the replica's slots
        share = -(-slots // n)
        requests, count = self._static_requests(looked_up, slots, share)
        leaves = []
        for leaf, table in zip(looked_up.leaves, self.column_tables):
            widths = [width * table.row_width // table.shape[0] for width in _part_widths(table)]
            message = leaf.index_select(0, requests.view(-1)).view(n, requests.shape[1], leaf.shape[-1])
            message = torch.nn.functional.pad(message, (0, max(widths) - leaf.shape[-1]))
            received = topology.column_all_to_all(message.unsqueeze(0))[0]  # [c, M, W_max]: part p's columns
            leaves.append(torch.cat([received[p, :, :width] for p, width in enumerate(widths)], dim=-1))
        start, _ = _part_slots(slots, part, n)
        own = torch.arange(count[part], device=requests.device).view(1, 1, -1)
        negatives = looked_up.negatives.numel()
        return RowGather(
            rows=looked_up.rows,
            leaves=leaves,
            heads=own,
            tails=own + share,
            negatives=(2 * share + torch.arange(negatives, device=requests.device)).view(looked_up.negatives.shape),
            first_real=0,
            first_slot=looked_up.first_slot + start,
        )

    def _static_requests(self, looked_up: RowGather, slots: int, share: int) -> tuple[torch.Tensor, list[int]]:
        """Return every part's requests ``[c, 2 * share + m]`` (positions into the looked-up rows) and slot counts."""
        n = self.topology.n_column
        key = (slots, looked_up.negatives.numel(), looked_up.rows.device)
        if key not in self._static:
            negatives = looked_up.negatives.numel()
            requests, counts = [], []
            for part in range(n):
                start, stop = _part_slots(slots, part, n)
                own = torch.arange(start, stop)
                pad = torch.zeros(share - own.numel(), dtype=torch.long)
                negative = 2 * slots + torch.arange(negatives)
                requests.append(torch.cat([own, pad, own + slots, pad, negative]))
                counts.append(stop - start)
            self._static[key] = (torch.stack(requests).to(looked_up.rows.device), counts)
        return self._static[key]

    def slot_range(self, block_size: int) -> tuple[int, int]:
        """Return the slots this process scores: its column part's share of its replica's slots (all in one process)."""
        if self.topology.holds_all_columns:
            return super().slot_range(block_size)
        return self._part_range(block_size, self.topology.local_columns[0])

    def _part_range(self, block_size: int, part: int) -> tuple[int, int]:
        """Return the slots of column part ``part`` of this replica: consecutive shares of the replica's slots."""
        first, last = self.topology.replica_slots(block_size)
        start, stop = _part_slots(last - first, part, self.topology.n_column)
        return first + start, first + stop

    def gather(self, batch: BessBatch, start: int = 0, stop: int | None = None) -> RowGather:
        """Look up the rows of all parts' slots in this process' columns, and assemble whole rows of its own.

        :returns: the gathered rows whose ``leaves`` are the whole rows of this part's requests (leaf
            tensors), and ``heads``, ``tails``, ``negatives`` indexing them
        """
        if self.topology.holds_all_columns:
            return super().gather(batch, start, stop)
        topology = self.topology
        n, part = topology.n_column, topology.local_columns[0]
        # every part's rows, in this process' columns (the owners' side of the lookup)
        columns = gather_rows(self.column_tables, topology, batch, 0, batch.block_size)
        self._column_leaves = [leaf.detach() for leaf in columns.leaves]
        self._requests = []
        for other in range(n):
            first, last = self._part_range(batch.block_size, other)
            wanted = [columns.heads[..., first:last], columns.tails[..., first:last], columns.negatives]
            self._requests.append(torch.unique(torch.cat([w.reshape(-1) for w in wanted])))
        own = self._requests[part]
        whole = [self._assemble(leaf, table) for leaf, table in zip(self._column_leaves, self.column_tables)]
        position = torch.full((columns.rows.numel(),), -1, dtype=torch.long, device=own.device)
        position[own] = torch.arange(own.numel(), device=own.device)
        first, last = self._part_range(batch.block_size, part)
        gathered = RowGather(
            rows=columns.rows,
            leaves=[rows.requires_grad_(table.trainable) for rows, table in zip(whole, self.column_tables)],
            heads=position[columns.heads[..., first:last]],
            tails=position[columns.tails[..., first:last]],
            negatives=position[columns.negatives],
            first_real=columns.first_real,
            first_slot=first,
        )
        gathered.column_leaves = columns.leaves  # type: ignore[attr-defined]
        return gathered

    def _assemble(self, leaf: torch.Tensor, table: ShardedEmbedding) -> torch.Tensor:
        """Send every part its requested rows' slices of this process' columns; concatenate the slices of its own."""
        widths = [width * table.row_width // table.shape[0] for width in _part_widths(table)]
        message = self._padded([leaf.index_select(0, request) for request in self._requests], max(widths))
        received = self.topology.column_all_to_all(message.unsqueeze(0))[0]  # [c, M, W_max]: part p's columns
        count = self._requests[self.topology.local_columns[0]].numel()
        return torch.cat([received[p, :count, :width] for p, width in enumerate(widths)], dim=-1)

    def _padded(self, parts: Sequence[torch.Tensor], width: int) -> torch.Tensor:
        """Stack ``[M_p, W]`` tensors, zero-padded, as ``[c, M, width]`` (``M``: the largest request of any part)."""
        rows = max(request.numel() for request in self._requests)
        result = parts[0].new_zeros((len(parts), rows, width))
        for index, part in enumerate(parts):
            result[index, : part.shape[0], : part.shape[1]] = part
        return result

    def set_row_gradients(self, gathered: RowGather, dense: bool = False) -> None:
        """Send the whole rows' gradients back to the columns' owners, who add them up; hand them to the tables."""
        if self.topology.holds_all_columns:
            super().set_row_gradients(gathered, dense)
            return
        part = self.topology.local_columns[0]
        first = gathered.first_real
        for table, whole, columns in zip(self.column_tables, gathered.leaves, gathered.column_leaves):  # type: ignore[attr-defined]
            grad = whole.grad if whole.grad is not None else torch.zeros_like(whole)
            widths = [width * table.row_width // table.shape[0] for width in _part_widths(table)]
            slices = grad.split(widths, dim=-1)  # this part's rows, every part's columns
            message = self._padded(list(slices), max(widths)).to(grad.dtype)
            received = self.topology.column_all_to_all(message.unsqueeze(0))[0]  # [c, M, W_max]: my columns
            total = torch.zeros_like(columns)
            for other, request in enumerate(self._requests):
                total.index_add_(0, request, received[other, : request.numel(), : widths[part]])
            rows = gathered.rows[first:]
            if dense:
                table.weight.grad = torch.zeros_like(table.weight).index_add_(0, rows, total[first:])
            else:
                table.gradient = row_sparse_grad(table.weight, rows, total[first:])
                table.touched_values = columns.detach()[first:]


def _part_slots(block_size: int, part: int, n_part: int) -> tuple[int, int]:
    """Return the slots ``[start, stop)`` of a column part: consecutive shares of the block (the last shorter)."""
    share = -(-block_size // n_part)
    start = min(part * share, block_size)
    return start, min(start + share, block_size)


def _part_widths(table: ShardedEmbedding) -> list[int]:
    """Return the coordinates of every column part of a table (the split of its whole rows)."""
    from ..tables.encoding import ColumnSplit

    whole: Any = table.whole_embedding  # set by ColumnShardTables
    return ColumnSplit(int(whole.shape[0]), table.topology.n_column).sizes
