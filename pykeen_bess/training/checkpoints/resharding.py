"""Resharding a checkpoint: the rows of one set of shards rebuilt for another, whoever wrote them.

One process with ``n`` logical shards and ``n`` ranks hold the same tables, so their checkpoints
hold the same rows, only in different files: a distributed checkpoint holds one file per shard
(``NAME.v{N}.rank{s}-of-{n}``, with its pointer ``NAME``), a one-process checkpoint one file whose
tables hold every shard one after another (``[n * S, D]``). :class:`ShardFiles` reads either as
``(global entity ids of the rows, PyKEEN's checkpoint dictionary)`` pairs, one file at a time, and
:func:`reshard_rank_state` / :func:`reshard_stored_tables` build the tables of any shards of any other
sharding from them (the same strategy and seed with another number of shards; padding rows become
zero). So a checkpoint moves between one process and ranks, and between numbers of shards, in
both directions.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...data.sharding import EntitySharding
from .files import load_verified, pointer_file, pointer_shards

__all__ = ["ShardFiles", "reshard_rank_state", "reshard_stored_tables"]


@dataclasses.dataclass(frozen=True)
class ShardFiles:
    """The files holding a checkpoint's shards: a distributed checkpoint's, or one process' single file."""

    #: the checkpoint's path (a distributed checkpoint's pointer, or the one process' file)
    path: pathlib.Path
    #: the number of shards the files hold
    n_shard: int
    #: the pointer of a distributed checkpoint (None: one file holding every shard)
    pointer: Mapping[str, Any] | None = None

    @classmethod
    def of_pointer(cls, path: pathlib.Path, pointer: Mapping[str, Any]) -> ShardFiles:
        """Return the rank files a distributed checkpoint's pointer names (the first replica's of each shard)."""
        return cls(pathlib.Path(path), pointer_shards(pointer), pointer)

    def describe(self) -> str:
        """Say what wrote the files (for messages)."""
        kind = "ranks" if self.pointer is not None else "logical shards in one process"
        return f"{self.path} ({self.n_shard} {kind})"

    def shards(self, sharding: EntitySharding) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """Yield each file's rows as global entity ids (``[R]``, -1 for padding) and its checkpoint dictionary.

        :param sharding: the sharding of the files (the same strategy and seed, :attr:`n_shard` shards)
        :raises FileNotFoundError: if a rank file is missing
        :raises CorruptCheckpointError: if a file differs from what was written
        """
        if self.pointer is None:
            rows = torch.cat([sharding.shard_entities[shard] for shard in range(self.n_shard)])
            yield rows, self._checked(load_verified(self.path))
            return
        for shard in range(self.n_shard):
            file = pointer_file(self.path, self.pointer, shard, replica=0)
            if not file.is_file():
                raise FileNotFoundError(
                    f"Cannot reshard checkpoint {self.path}: {file} is missing (all ranks' files must be in the same, "
                    f"shared directory)."
                )
            yield sharding.shard_entities[shard], self._checked(load_verified(file))

    def _checked(self, state: dict[str, Any]) -> dict[str, Any]:
        """Refuse a file whose rows are in PyTorch-BigGraph's files (``checkpoint_format="pbg"``)."""
        if any(key.endswith(".external_weight") for key in state.get("model_state_dict", {})):
            raise ValueError(
                f"Checkpoint {self.path} keeps its rows in PyTorch-BigGraph's files: resume it with "
                f"checkpoint_format='pbg' and num_shards={self.n_shard}."
            )
        return state


def _sources(old_global: torch.Tensor, new_global: torch.Tensor, num_entities: int) -> torch.Tensor:
    """For each new row (``[R_new]``), the old row holding its entity (``-1``: not in this file, or padding)."""
    position = torch.full((num_entities,), -1, dtype=torch.long)
    position[old_global[old_global >= 0]] = torch.nonzero(old_global >= 0).view(-1)
    source = torch.full_like(new_global, -1)
    real = new_global >= 0
    source[real] = position[new_global[real]]
    return source


def reshard_rank_state(
    files: ShardFiles,
    sharding: EntitySharding,
    shards: Sequence[int],
    table_keys: list[str],
    table_param_indices: list[int],
) -> dict[str, Any]:
    """Build the checkpoint dictionary of some shards of another sharding from a checkpoint's files.

    The replicated state is taken from the first file; every entity table (``table_keys`` in the
    model's state dict) and its row-wise optimizer state (the tensors with one entry or row per
    table row, e.g. Adam's moments ``[R, D]`` or row-wise Adagrad's sums ``[R]``, of parameters
    ``table_param_indices`` of the optimizer's state dict) are rebuilt for ``shards`` of ``sharding``,
    one after another (``[len(shards) * S, D]``: a rank's one shard, or one process' every shard),
    reading one file at a time.

    :param files: the checkpoint's files
    :param sharding: the new sharding (the files' is the same strategy and seed with their number of shards)
    :param shards: the shards of the new sharding to build, in the order the tables hold them
    :param table_keys: the state-dict keys of the entity tables
    :param table_param_indices: the optimizer parameter indices of the entity tables
    :returns: a PyKEEN checkpoint dictionary for the shards
    """
    old_sharding = sharding.with_shards(files.n_shard)
    new_global = torch.cat([sharding.shard_entities[shard] for shard in shards])  # [R_new], -1 for padding
    state: dict[str, Any] | None = None
    for old_global, old in files.shards(old_sharding):
        source = _sources(old_global, new_global, sharding.num_entities)
        take = source >= 0
        if state is None:
            # the replicated state of the first file, with empty tables of the new size
            state = dict(old)
            state["model_state_dict"] = dict(old["model_state_dict"])
            state["optimizer_state_dict"] = dict(old["optimizer_state_dict"])
            state["optimizer_state_dict"]["state"] = {
                index: dict(value) for index, value in old["optimizer_state_dict"]["state"].items()
            }
            for key in table_keys:
                width = old["model_state_dict"][key].shape[1]
                state["model_state_dict"][key] = old["model_state_dict"][key].new_zeros(len(new_global), width)
            optimizer_state = state["optimizer_state_dict"]["state"]
            for index in table_param_indices:
                for name, value in list(optimizer_state.get(index, {}).items()):
                    if _is_row_state(value, len(old_global)):
                        optimizer_state[index][name] = value.new_zeros(len(new_global), *value.shape[1:])
        for key in table_keys:
            state["model_state_dict"][key][take] = old["model_state_dict"][key][source[take]]
        for index in table_param_indices:
            for name, value in old["optimizer_state_dict"]["state"].get(index, {}).items():
                if _is_row_state(value, len(old_global)):
                    state["optimizer_state_dict"]["state"][index][name][take] = value[source[take]]
        del old
    assert state is not None
    return state


def reshard_stored_tables(
    files: ShardFiles, sharding: EntitySharding, shards: Sequence[int], tables: Sequence[Any]
) -> None:
    """Fill one process' tables kept in host memory or files (and their row state) from a checkpoint's files.

    Reads the files one at a time (a ``"host"`` table from the file itself, a ``"mmap"`` table from its
    copies next to the file, memory-mapped) and writes the rows of ``shards`` into the live tables of
    the tier; padding rows become zero.

    :param files: the checkpoint's files
    :param sharding: the new sharding (the files' is the same strategy and seed with their number of shards)
    :param shards: the shards of the new sharding the process' tables hold, in their order
    :param tables: the process' :class:`~pykeen_bess.tables.representation.ShardedEmbedding` tables, in the
        order of the model's entity representations
    :raises FileNotFoundError: if a file or table copy is missing
    :raises ValueError: if the checkpoint's tables were kept in another storage tier
    """
    old_sharding = sharding.with_shards(files.n_shard)
    new_global = torch.cat([sharding.shard_entities[shard] for shard in shards])
    with torch.no_grad():
        for table in tables:
            table.weight[new_global < 0] = 0
        for old_global, old in files.shards(old_sharding):
            source = _sources(old_global, new_global, sharding.num_entities)
            take = (source >= 0).nonzero().view(-1)
            for index, table in enumerate(tables):
                entry = old["model_state_dict"].get(f"entity_representations.{index}.stored_table")
                if entry is None or entry["tier"] != table.storage.name:
                    written = "device" if entry is None else entry["tier"]
                    raise ValueError(
                        f"Checkpoint {files.path} keeps the entity tables with storage={written!r}; resume it with "
                        f"the same storage (this run uses storage={table.storage.name!r})."
                    )
                targets = {"weight": table.weight, **{f"state.{k}": v for k, v in table.row_state.items()}}
                for key, target in targets.items():
                    if "tensors" in entry:
                        values = entry["tensors"][key][source[take]]
                    else:
                        copy = files.path.parent / entry["directory"] / entry["files"][key]
                        if not copy.is_file():
                            raise FileNotFoundError(f"Cannot reshard checkpoint {files.path}: {copy} is missing.")
                        values = torch.from_numpy(np.load(copy, mmap_mode="r")[source[take].numpy()])
                    target[take] = values.to(target.dtype)
            del old
    for table in tables:
        table.storage.flush()


def _is_row_state(value: Any, rows: int) -> bool:
    """Whether an optimizer state value holds one entry (or row) per row of a file's table (``rows`` rows)."""
    return torch.is_tensor(value) and value.ndim >= 1 and value.shape[0] == rows
