"""The entity tables of the encoding partition over processes: one column part of every row per rank.

:class:`ColumnShardTables` is the :class:`~pykeen_bess.training.tables.ShardTables` back end of a
:class:`~pykeen_bess.distributed.ColumnTopology`: every rank holds all rows with the coordinates
of its column part (:func:`~pykeen_bess.tables.encoding.column_embedding`: initial values are the
part's coordinates of the whole table's, constraints and regularizers see whole rows through
column sums). After training the parts are redistributed to row shards
(:func:`~pykeen_bess.tables.encoding.rows_from_columns`, one all-to-all): the model then holds a
row-sharded table on every rank, like a model trained with ``partition="token"``, which
``BessEvaluator``, ``predict_top_k``, ``score_hrt`` and the export serve.

While training, :meth:`ColumnShardTables.row_shards` lends the model (and the optimizer) the same
row shards for a while: an early stopper evaluates them, and checkpoints are written and read in
the token partition's layout of the same processes (so they resume on any number of processes,
with either partition; :class:`~pykeen_bess.training.checkpoints.RowShardCheckpointStore`).

(With all column parts in one process the tables are whole and :class:`LocalShardTables` serves.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from pykeen.models import ERModel
from pykeen.nn.representation import Embedding

from ..distributed import Topology
from ..tables.encoding import (
    ColumnSplit,
    check_encoding_model,
    column_embedding,
    columns_from_rows,
    columns_of_rows,
    rows_from_columns,
    rows_of_columns,
)
from ..tables.representation import ShardedEmbedding
from ..data.sharding import EntitySharding
from ..storage import TableStorage
from .tables import ShardTables

__all__ = [
    "ColumnShardTables",
]


class ColumnShardTables(ShardTables):
    """One column part of every row per process; row shards after training."""

    def __init__(
        self,
        model: ERModel,
        embeddings: Sequence[Embedding],
        sharding: EntitySharding,
        topology: Topology,
        seed: int,
        storage: TableStorage | None = None,
    ):
        """Create this process' column part of every table (see :class:`ShardTables`).

        :raises ValueError: for a storage tier outside the model (not supported with column parts)
        """
        if storage is not None and storage.column_parts_obstacle() is not None:
            raise ValueError(
                f"partition='encoding' over several processes keeps its column parts on the device; "
                f"storage={storage.name!r} is supported with partition='token'."
            )
        #: the coordinates of every column part
        self.split = ColumnSplit(check_encoding_model(model, partial_scores=False), topology.n_column)
        #: the column part of this process
        self.part = topology.local_columns[0]
        parts = [
            column_embedding(embedding, self.split, self.part, topology, seed, index)
            for index, embedding in enumerate(embeddings)
        ]
        super().__init__(model, parts, sharding, topology, seed, storage)
        self.embeddings = list(embeddings)  # the model's own (whole rows): installed, released, restored
        self.seed = seed
        #: the token topology of the same processes (rank ``r`` holds row shard ``r``)
        self.row_topology: Topology = topology.row_topology()  # type: ignore[attr-defined]
        #: the row sharding of :attr:`row_topology`
        self.row_sharding = sharding.with_shards(self.row_topology.n_shard)
        #: while :meth:`row_shards` runs: the row shards the model holds
        self.lent_rows: list[ShardedEmbedding] | None = None
        for table, embedding in zip(self.tables, self.embeddings):
            table.hold_column_part(
                self.part, embedding, table.row_width * self.split.dim // self.split.sizes[self.part]
            )

    def install(self, copy_weights: bool) -> None:
        """Swap in the column parts; continued training first fills them from the model's current tables.

        After a training the model holds row shards (see :meth:`uninstall`): one all-to-all moves every
        process' rows' coordinates to the parts (:func:`~pykeen_bess.tables.encoding.columns_from_rows`).
        A model with whole tables (never trained here) gives each process its part's coordinates.

        :raises ValueError: for a model whose entity representations are neither
        """
        if not copy_weights or self.is_installed:
            super().install(copy_weights)
            return
        for index, table in enumerate(self.tables):
            current = self.model.entity_representations[index]
            if isinstance(current, ShardedEmbedding) and not current.holds_all_shards:
                columns_from_rows(table, current, current.topology, self.split, self.part)
            elif current is self.embeddings[index] and current._embeddings.weight.shape[0] == current.max_id:
                start, stop = self.split.bounds(self.part)
                whole = current._embeddings.weight.detach()
                whole = torch.view_as_real(whole) if whole.is_complex() else whole
                part = whole.reshape(whole.shape[0], self.split.dim, -1)[:, start:stop]
                table.copy_from_tensor(part.reshape(whole.shape[0], -1))
            else:
                raise ValueError(
                    f"continue_training with partition='encoding' over several processes continues the row shards "
                    f"of this loop's last training; entity representation {index} is a {type(current).__name__}."
                )
        super().install(copy_weights=False)
        self.now_hold_weights()  # the column parts hold the weights again

    def now_hold_weights(self) -> None:  # noqa: D102
        if self.hold_weights:
            return
        for embedding in self.embeddings:  # release the model's whole tables (keep their width)
            weight = embedding._embeddings.weight
            weight.data = weight.data.new_empty(0, weight.shape[1])
        self.hold_weights = True

    def uninstall(self) -> None:
        """End training: the column parts become row shards of a token topology over the same processes."""
        for table in self.tables:
            table.defer_constraints = False
        if not self.is_installed:
            return
        representations = cast(torch.nn.ModuleList, self.model.entity_representations)
        if self.hold_weights:
            for index, (embedding, table) in enumerate(zip(self.embeddings, self.tables)):
                representations[index] = rows_from_columns(
                    table, embedding, self.row_sharding, self.row_topology, self.seed, index, self.split
                )
        else:  # nothing was trained: the model keeps its own tables
            for index, embedding in enumerate(self.embeddings):
                representations[index] = embedding
        self.is_installed = False
        self.hold_weights = False

    @contextlib.contextmanager
    def row_shards(
        self, optimizer: torch.optim.Optimizer | None, read: bool = True, write: bool = False
    ) -> Iterator[list[ShardedEmbedding]]:
        """While the block runs, the model and the optimizer hold the tables as this process' row shards.

        The row shards are those of a token-partitioned run over the same processes
        (:attr:`row_topology`, :attr:`row_sharding`), and so is the optimizer's state of them: an early
        stopper evaluates the model as it is after training, and PyKEEN's checkpoint dictionary of
        the process is the token partition's. Nested calls share the outer one's row shards.

        :param optimizer: the optimizer whose parameters (and state) the row shards stand in for
        :param read: fill the row shards (weights, optimizer state) from the column parts (one
            all-to-all per tensor); else they start uninitialised (the block loads them)
        :param write: after the block (if it raised nothing), fill the column parts (weights, optimizer
            state) from the row shards, as the block left them
        :yields: the row shards ``[S, row_width]`` of the tables
        """
        if self.lent_rows is not None:
            yield self.lent_rows
            return
        rows = [
            ShardedEmbedding(
                embedding, self.row_sharding, self.row_topology.local_shards, seed=self.seed, table_index=i
            )
            for i, embedding in enumerate(self.embeddings)
        ]
        states = {}
        for table, row in zip(self.tables, rows):
            row.topology = self.row_topology
            if read:
                with torch.no_grad():
                    row.weight.copy_(self._to_rows(table.weight.detach(), table, row))
            if optimizer is not None:
                states[id(table.weight)] = optimizer.state.pop(table.weight, None)
                if read and states[id(table.weight)] is not None:
                    optimizer.state[row.weight] = {
                        name: self._to_rows(value, table, row) for name, value in states[id(table.weight)].items()
                    }
        swaps = [(table.weight, row.weight) for table, row in zip(self.tables, rows)]
        _swap_parameters(optimizer, swaps)
        representations = cast(torch.nn.ModuleList, self.model.entity_representations)
        held = list(representations)  # the column parts while training
        for index, row in enumerate(rows):
            representations[index] = row
        self.lent_rows = rows
        written = False
        try:
            yield rows
            if write:
                self._write_back(optimizer, rows)
                written = True
        finally:
            self.lent_rows = None
            for index, representation in enumerate(held):
                representations[index] = representation
            _swap_parameters(optimizer, [(new, old) for old, new in swaps])
            if optimizer is not None:
                for table, row in zip(self.tables, rows):
                    state = optimizer.state.pop(row.weight, None)
                    if not written:
                        state = states[id(table.weight)]
                    if state is not None:
                        optimizer.state[table.weight] = state

    def _write_back(self, optimizer: torch.optim.Optimizer | None, rows: list[ShardedEmbedding]) -> None:
        """Fill the column parts' weights and optimizer state from the row shards (inside :meth:`row_shards`)."""
        for table, row in zip(self.tables, rows):
            with torch.no_grad():
                columns_from_rows(table, row, self.row_topology, self.split, self.part)
            if optimizer is not None and row.weight in optimizer.state:
                state = optimizer.state[row.weight]
                optimizer.state[row.weight] = {
                    name: self._to_columns(value, table, row) for name, value in state.items()
                }

    def _to_rows(self, value: Any, table: ShardedEmbedding, row: ShardedEmbedding) -> Any:
        """Return a tensor of the column part's layout in the row shard's.

        Of the table's shape ``[R, w]`` (weights, Adam's moments): the coordinates move (all-to-all);
        one value per row ``[R]`` (a row-wise accumulator, the same on every part): this shard's rows;
        anything else (a step count) as it is.
        """
        if not torch.is_tensor(value):
            return value
        ids = self.row_sharding.shard_entities
        if value.shape == table.weight.shape:
            inner = row.row_width // self.split.dim
            return rows_of_columns(value, table.entity_rows, ids, self.row_topology, self.split, inner).to(value)
        if value.ndim == 1 and value.shape[0] == table.weight.shape[0]:
            shard = ids[self.row_topology.local_shards[0]]
            return value[table.entity_rows[shard.clamp_min(0)]] * (shard >= 0).to(value)
        return value.clone()

    def _to_columns(self, value: Any, table: ShardedEmbedding, row: ShardedEmbedding) -> Any:
        """Return a tensor of the row shard's layout in the column part's: the inverse of :meth:`_to_rows`."""
        if not torch.is_tensor(value):
            return value
        ids = self.row_sharding.shard_entities
        if value.shape == row.weight.shape:
            result = value.new_zeros(table.weight.shape)
            inner = row.row_width // self.split.dim
            entities, values = columns_of_rows(value, ids, self.row_topology, self.split, self.part, inner)
        elif value.ndim == 1 and value.shape[0] == row.weight.shape[0]:
            result = value.new_zeros(table.weight.shape[0])
            copies = value.unsqueeze(0).expand(self.row_topology.n_shard, -1).unsqueeze(-1)  # [c, S, 1]
            received = self.row_topology.all_to_all(copies.unsqueeze(0).contiguous())[0, ..., 0]  # [c (shard), S]
            held = ids >= 0
            entities, values = ids[held], received[held.to(received.device)]
        else:
            return value
        result[table.entity_rows[entities].to(result.device)] = values.to(result)
        return result


def _swap_parameters(
    optimizer: torch.optim.Optimizer | None, swaps: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Replace parameters in the optimizer's groups: ``(old, new)`` pairs."""
    if optimizer is None:
        return
    replace = {id(old): new for old, new in swaps}
    for group in optimizer.param_groups:
        group["params"] = [replace.get(id(param), param) for param in group["params"]]
