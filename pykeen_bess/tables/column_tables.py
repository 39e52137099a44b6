"""The entity tables of the encoding partition over processes: one column part of every row per rank.

:class:`ColumnShardTables` is the :class:`~pykeen_bess.tables.shard_tables.ShardTables` back end of a
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
with either partition; :class:`~pykeen_bess.training.checkpoints.stores.RowShardCheckpointStore`).

(With all column parts in one process the tables are whole and :class:`LocalShardTables` serves.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import cast

import torch
from pykeen.models import ERModel
from pykeen.nn.representation import Embedding

from ..distributed import Topology
from .encoding import ColumnSplit, check_encoding_model, column_embedding, columns_from_rows, rows_from_columns
from .representation import ShardedEmbedding
from ..data.sharding import EntitySharding
from ..storage import TableStorage
from .lent_rows import ColumnLayout, lend_row_shards
from .shard_tables import ShardTables

__all__ = [
    "ColumnShardTables",
]


class ColumnShardTables(ShardTables):
    """One column part of every row per process; row shards after training."""

    pykeen_layout_obstacle = "the encoding partition holds column parts of the rows"

    def __init__(
        self,
        model: ERModel,
        embeddings: Sequence[Embedding],
        sharding: EntitySharding,
        topology: Topology,
        seed: int,
        storage: TableStorage | None = None,
    ):
        """Create this process' column part of every table (see :class:`ShardTables`), in the storage tier."""
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
        row_topology: Topology = topology.row_topology()  # type: ignore[attr-defined]
        #: this process' column part, and the row shards of the token topology of the same processes
        self.layout = ColumnLayout(self.split, self.part, sharding.with_shards(row_topology.n_shard), row_topology)
        #: while :meth:`row_shards` runs: the row shards the model holds
        self.lent_rows: list[ShardedEmbedding] | None = None
        for table, embedding in zip(self.tables, self.embeddings):
            table.hold_column_part(
                self.part, embedding, table.row_width * self.split.dim // self.split.sizes[self.part]
            )

    @staticmethod
    def label_suffix(topology: Topology) -> str:
        """Name the column part and the replica (every process holds all rows: its files must not be another's)."""
        return f".column{topology.local_columns[0]}-of{topology.n_column}" + ShardTables.label_suffix(topology)

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
                current.storage.release_table(current)  # the tier's copy (files) of the row shard
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
                    table,
                    embedding,
                    self.layout.sharding,
                    self.layout.topology,
                    self.seed,
                    index,
                    self.split,
                    self.storage,
                    ShardTables.label_suffix(self.layout.topology),
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
        (:attr:`layout`), in the tables' storage tier, and so is the optimizer's state of them: an
        early stopper evaluates the model as it is after training, and PyKEEN's checkpoint
        dictionary of the process is the token partition's. Nested calls share the outer one's row
        shards. See :func:`~pykeen_bess.tables.lent_rows.lend_row_shards` for the arguments.

        :yields: the row shards ``[S, row_width]`` of the tables
        """
        if self.lent_rows is not None:
            yield self.lent_rows
            return
        with lend_row_shards(
            self.layout, self.model, self.embeddings, self.tables, self.seed, optimizer, read, write
        ) as rows:
            self.lent_rows = rows
            try:
                yield rows
            finally:
                self.lent_rows = None

    def state_dict_tables(self) -> list[ShardedEmbedding]:
        """Return the column parts, and the row shards lent to the model meanwhile (see :meth:`row_shards`)."""
        return [*self.tables, *(self.lent_rows or [])]
