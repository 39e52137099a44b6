"""The entity tables of the encoding partition over processes: one column part of every row per rank.

:class:`ColumnShardTables` is the :class:`~pykeen_bess.training.tables.ShardTables` back end of a
:class:`~pykeen_bess.distributed.ColumnTopology`: every rank holds all rows with the coordinates
of its column part (:func:`~pykeen_bess.tables.encoding.column_embedding`: initial values are the
part's coordinates of the whole table's, constraints and regularizers see whole rows through
column sums). After training the parts are redistributed to row shards
(:func:`~pykeen_bess.tables.encoding.rows_from_columns`, one all-to-all): the model then holds a
row-sharded table on every rank, like a model trained with ``partition="token"``, which
``BessEvaluator``, ``predict_top_k``, ``score_hrt`` and the export serve.

(With all column parts in one process the tables are whole and :class:`LocalShardTables` serves.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from pykeen.models import ERModel
from pykeen.nn.representation import Embedding

from ..distributed import Topology
from ..tables.encoding import ColumnSplit, check_encoding_model, column_embedding, columns_from_rows, rows_from_columns
from ..tables.representation import ShardedEmbedding
from ..tables.optim import BessOptimizer, RowwiseAdagrad
from ..data.sharding import EntitySharding
from ..storage import TableStorage
from .tables import ShardTables

__all__ = [
    "ColumnShardTables",
    "check_column_training",
]


def check_column_training(train_kwargs: dict) -> None:
    """Refuse, before training starts, what the encoding partition over processes does not support yet.

    Checkpoints (also ``checkpoint_on_failure``) and early stopping (which evaluates and saves while
    the tables are column parts).

    :raises ValueError: naming the setting and the alternative
    """
    stopper = train_kwargs.get("stopper")
    if (
        train_kwargs.get("checkpoint_name") is not None
        or train_kwargs.get("checkpoint_on_failure")
        or (stopper is not None and type(stopper).__name__ != "NopStopper")
    ):
        raise ValueError(
            "partition='encoding' over several processes does not support checkpoints or early stopping yet (the "
            "tables are column parts while training); train without them and evaluate afterwards, or use "
            "partition='token'."
        )


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
        for table, embedding in zip(self.tables, self.embeddings):
            table.hold_column_part(
                self.part, embedding, table.row_width * self.split.dim // self.split.sizes[self.part]
            )

    def make_optimizer(  # noqa: D102
        self, optimizer_cls: type[torch.optim.Optimizer], hyperparameters: dict, sparse_updates: bool
    ) -> BessOptimizer:
        if issubclass(optimizer_cls, RowwiseAdagrad) and not sparse_updates:
            raise ValueError(
                "RowwiseAdagrad keeps one accumulator per whole row, which partition='encoding' splits over "
                "processes: its row-sparse updates sum the parts' squares (sparse_updates=True), dense ones cannot."
            )
        return super().make_optimizer(optimizer_cls, hyperparameters, sparse_updates)

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
            rows_topology = self.topology.row_topology()  # type: ignore[attr-defined]
            sharding = self.sharding.with_shards(rows_topology.n_shard)
            for index, (embedding, table) in enumerate(zip(self.embeddings, self.tables)):
                representations[index] = rows_from_columns(
                    table, embedding, sharding, rows_topology, self.seed, index, self.split
                )
        else:  # nothing was trained: the model keeps its own tables
            for index, embedding in enumerate(self.embeddings):
                representations[index] = embedding
        self.is_installed = False
        self.hold_weights = False
