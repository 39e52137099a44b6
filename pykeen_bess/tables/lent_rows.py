"""Row shards lent to the model while the encoding partition's column parts train over processes.

While a checkpoint is written or read, and while an early stopper evaluates, the model and the
optimizer of a run with :class:`~pykeen_bess.tables.column_tables.ColumnShardTables` hold the row
shards of a token-partitioned run over the same processes (:func:`lend_row_shards`), in the
tables' storage tier: the stopper sees the model as it is after training, and PyKEEN's checkpoint
dictionary of a process is the token partition's (so its files resume with either partition).

:class:`ColumnLayout` moves one tensor between the layouts: a per-row tensor of the column part's
shape ``[R, w]`` (weights, Adam's moments) by one all-to-all of coordinates, one value per whole
row ``[R]`` (a row-wise accumulator, the same on every part) by selecting (and, back, gathering)
rows; anything else (a step count) stays as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch

from ..data.sharding import EntitySharding
from ..distributed import Topology
from .encoding import ColumnSplit, columns_from_rows, columns_of_rows, rows_of_columns
from .representation import ShardedEmbedding
from .shard_tables import ShardTables


__all__ = ["ColumnLayout", "lend_row_shards"]


@dataclasses.dataclass(frozen=True)
class ColumnLayout:
    """A process' column part of every row, and its row shard of the same processes' token topology."""

    #: the coordinates of every column part
    split: ColumnSplit
    #: the column part of this process
    part: int
    #: the row sharding (one shard per process)
    sharding: EntitySharding
    #: the token topology of the same processes (the process of row shard ``k`` holds column part ``k``)
    topology: Topology

    def row_shape(self, value: torch.Tensor, table: ShardedEmbedding, row: ShardedEmbedding) -> tuple[int, ...]:
        """Return the shape of a per-row tensor of the column part ``table`` in the row shard ``row``."""
        if value.shape == table.weight.shape:
            return tuple(row.weight.shape)
        if value.ndim == 1 and value.shape[0] == table.weight.shape[0]:
            return (row.weight.shape[0],)
        return tuple(value.shape)

    def to_rows(self, value: Any, table: ShardedEmbedding, row: ShardedEmbedding) -> Any:
        """Return a tensor of the column part's layout in the row shard's (collective for per-row tensors)."""
        if not torch.is_tensor(value):
            return value
        ids = self.sharding.shard_entities  # [c, S]
        if value.shape == table.weight.shape:
            inner = row.row_width // self.split.dim
            return rows_of_columns(value, table.entity_rows, ids, self.topology, self.split, inner).to(value)
        if value.ndim == 1 and value.shape[0] == table.weight.shape[0]:
            shard = ids[self.topology.local_shards[0]]
            return value[table.entity_rows[shard.clamp_min(0)]] * (shard >= 0).to(value)
        return value.clone()

    def to_columns(self, value: Any, table: ShardedEmbedding, row: ShardedEmbedding) -> Any:
        """Return a tensor of the row shard's layout in the column part's: the inverse of :meth:`to_rows`."""
        if not torch.is_tensor(value):
            return value
        ids = self.sharding.shard_entities
        if value.shape == row.weight.shape:
            result = value.new_zeros(table.weight.shape)
            inner = row.row_width // self.split.dim
            entities, values = columns_of_rows(value, ids, self.topology, self.split, self.part, inner)
        elif value.ndim == 1 and value.shape[0] == row.weight.shape[0]:
            result = value.new_zeros(table.weight.shape[0])
            copies = value.unsqueeze(0).expand(self.topology.n_shard, -1).unsqueeze(-1)  # [c, S, 1]
            received = self.topology.all_to_all(copies.unsqueeze(0).contiguous())[0, ..., 0]  # [c (shard), S]
            held = ids >= 0
            entities, values = ids[held], received[held.to(received.device)]
        else:
            return value
        result[table.entity_rows[entities].to(result.device)] = values.to(result)
        return result


@contextlib.contextmanager
def lend_row_shards(
    layout: ColumnLayout,
    model: Any,
    embeddings: Sequence[Any],
    parts: Sequence[ShardedEmbedding],
    seed: int,
    optimizer: torch.optim.Optimizer | None,
    read: bool,
    write: bool,
) -> Iterator[list[ShardedEmbedding]]:
    """Lend the model and the optimizer this process' row shards of the column parts while the block runs.

    :param layout: this process' column part and the row shards of the same processes
    :param model: the model, whose entity representations are the column parts (installed)
    :param embeddings: the model's own embeddings (whole rows), which the row shards are made like
    :param parts: the column parts of the tables, in the model
    :param seed: the tables' seed
    :param optimizer: the optimizer whose parameters (and state) the row shards stand in for
    :param read: fill the row shards (weights, row state, optimizer state) from the column parts;
        else they start uninitialised (the block loads them)
    :param write: after the block (if it raised nothing), fill the column parts from the row shards
    :yields: the row shards ``[S, row_width]`` of the tables, in the tables' storage tier (given back after)
    """
    rows = []
    for index, (embedding, table) in enumerate(zip(embeddings, parts)):
        row = ShardedEmbedding(
            embedding,
            layout.sharding,
            layout.topology.local_shards,
            seed,
            index,
            storage=table.storage,
            label_suffix=ShardTables.label_suffix(layout.topology),  # the replicas' files apart
        )
        row.topology = layout.topology
        shapes = {name: (layout.row_shape(value, table, row), 0.0) for name, value in table.row_state.items()}
        if shapes:  # the row rule's state of a table outside the model, in the tier
            table.storage.reset_row_state(row, shapes)
        if read:
            with torch.no_grad():
                row.weight.copy_(layout.to_rows(table.weight.detach(), table, row))
                for name, value in table.row_state.items():
                    row.row_state[name].copy_(layout.to_rows(value, table, row))
        rows.append(row)
    swaps = [(table.optimizer_parameter, row.optimizer_parameter) for table, row in zip(parts, rows)]
    states = _lend_optimizer_state(optimizer, swaps, layout, parts, rows, read)
    representations = cast(torch.nn.ModuleList, model.entity_representations)
    held = list(representations)  # the column parts while training
    for index, row in enumerate(rows):
        representations[index] = row
    written = False
    try:
        yield rows
        if write:
            _write_back(layout, parts, optimizer, rows)
            written = True
    finally:
        for index, representation in enumerate(held):
            representations[index] = representation
        _swap_parameters(optimizer, [(new, old) for old, new in swaps])
        if optimizer is not None:
            for (old, new), state in zip(swaps, states):
                lent = optimizer.state.pop(new, None)
                state = lent if written else state
                if state is not None:
                    optimizer.state[old] = state
        for row in rows:
            row.storage.release_table(row)


def _lend_optimizer_state(
    optimizer: torch.optim.Optimizer | None,
    swaps: Sequence[tuple[torch.Tensor, torch.Tensor]],
    layout: ColumnLayout,
    parts: Sequence[ShardedEmbedding],
    rows: Sequence[ShardedEmbedding],
    read: bool,
) -> list[dict[str, Any] | None]:
    """Take the column parts' optimizer state out (returned), put the row shards' in (if ``read``), swap parameters."""
    if optimizer is None:
        return [None] * len(swaps)
    states = []
    for (old, new), table, row in zip(swaps, parts, rows):
        state = optimizer.state.pop(old, None)
        states.append(state)
        if read and state is not None:
            optimizer.state[new] = {name: layout.to_rows(value, table, row) for name, value in state.items()}
    _swap_parameters(optimizer, swaps)
    return states


def _write_back(
    layout: ColumnLayout,
    parts: Sequence[ShardedEmbedding],
    optimizer: torch.optim.Optimizer | None,
    rows: list[ShardedEmbedding],
) -> None:
    """Fill the column parts' weights, row state and optimizer state from the row shards."""
    for table, row in zip(parts, rows):
        with torch.no_grad():
            columns_from_rows(table, row, layout.topology, layout.split, layout.part)
            for name, value in row.row_state.items():
                table.row_state[name].copy_(layout.to_columns(value, table, row))
        parameter = row.optimizer_parameter
        if optimizer is not None and parameter in optimizer.state:
            state = optimizer.state[parameter]
            optimizer.state[parameter] = {name: layout.to_columns(value, table, row) for name, value in state.items()}


def _swap_parameters(
    optimizer: torch.optim.Optimizer | None, swaps: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Replace parameters in the optimizer's groups: ``(old, new)`` pairs."""
    if optimizer is None:
        return
    replace = {id(old): new for old, new in swaps}
    for group in optimizer.param_groups:
        group["params"] = [replace.get(id(param), param) for param in group["params"]]
