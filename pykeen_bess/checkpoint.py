"""Checkpoints of BESS training under a process group.

In one process :class:`~pykeen_bess.training.BessTrainingLoop` writes PyKEEN's own single-file
checkpoint (``train(checkpoint_name=...)``). Under ``torch.distributed`` every rank holds one
shard, so a checkpoint ``NAME`` is a set of files in the checkpoint directory (which must be
shared by all ranks, as PyTorch-BigGraph's is):

* ``NAME.v{version}.rank{r}-of-{n}``: written by rank ``r``: PyKEEN's checkpoint dictionary for
  that rank (its shard of every entity table and of the optimizer state, the replicated
  parameters and their optimizer state, the epoch, losses, random states, stopper state);
* ``NAME``: written last, by rank 0: a small pointer ``{"format", "version", "world_size", "epoch",
  "seed", "random_seed", "stopper_dict"}``. The last two are the fields PyKEEN itself reads from
  the file named ``checkpoint_name`` before the training loop loads it (``pipeline()`` takes the
  random seed from it, an early stopper its state), so a distributed checkpoint resumes through
  ``pipeline()`` like a single-file one.

A new version is written next to the old one; only after every rank has finished does rank 0
replace the pointer (atomically), and only then are the previous version's files removed. A crash
while writing therefore never loses the previous checkpoint.

Resuming on the same world size loads each rank's file. Resuming on another world size
*reshards*: every rank reads the old ranks' files one at a time and keeps the rows (and their
optimizer state) of the entities its new shard holds.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .exchange import Exchange
from .sharding import EntitySharding

__all__ = [
    "POINTER_FORMAT",
    "rank_file",
    "save_distributed_checkpoint",
    "read_pointer",
    "latest_own_version",
    "reshard_rank_state",
]

logger = logging.getLogger(__name__)

#: the ``format`` value of a distributed checkpoint's pointer file
POINTER_FORMAT = "pykeen-bess-distributed-checkpoint"


def rank_file(path: pathlib.Path, version: int, rank: int, world_size: int) -> pathlib.Path:
    """Return the file of one rank of one checkpoint version."""
    return path.with_name(f"{path.name}.v{version}.rank{rank}-of-{world_size}")


def _versions(path: pathlib.Path, rank: int, world_size: int) -> list[int]:
    pattern = re.compile(rf"^{re.escape(path.name)}\.v(\d+)\.rank{rank}-of-{world_size}$")
    if not path.parent.is_dir():
        return []
    return sorted(int(m.group(1)) for p in path.parent.iterdir() if (m := pattern.match(p.name)))


def latest_own_version(path: pathlib.Path, rank: int, world_size: int) -> int | None:
    """Return the newest version this rank has written for ``path`` (None if none)."""
    versions = _versions(path, rank, world_size)
    return versions[-1] if versions else None


def read_pointer(path: pathlib.Path) -> dict[str, Any] | None:
    """Return the pointer stored at ``path``, or None if ``path`` is not a pointer file."""
    if not path.is_file():
        return None
    content = torch.load(path, weights_only=False)
    if isinstance(content, dict) and content.get("format") == POINTER_FORMAT:
        return content
    return None


def save_distributed_checkpoint(
    path: pathlib.Path,
    exchange: Exchange,
    write_rank_file: Callable[[pathlib.Path], None],
    epoch: int,
    seed: int,
    random_seed: int | None = None,
    stopper_dict: Mapping[str, Any] | None = None,
) -> pathlib.Path:
    """Write a new version of a distributed checkpoint (collective: every rank calls it).

    :param path: the checkpoint's pointer path
    :param exchange: the distributed exchange (rank, world size, barrier, all-reduce)
    :param write_rank_file: writes this rank's state to the given file
    :param epoch: the epoch the checkpoint holds (stored in the pointer for humans)
    :param seed: the seed of the entity sharding (needed to reshard)
    :param random_seed: the model's random seed (what ``pipeline()`` reads back when resuming)
    :param stopper_dict: the early stopper's summary (what PyKEEN's stopper reads back)
    :returns: this rank's file of the new version
    """
    rank, world_size = exchange.local_shards[0], exchange.n_shard
    local = latest_own_version(path, rank, world_size) or 0
    pointer = read_pointer(path) if rank == 0 else None
    if pointer is not None:
        local = max(local, int(pointer["version"]))
    version = int(exchange.all_reduce_max(torch.tensor([local], dtype=torch.long))) + 1
    target = rank_file(path, version, rank, world_size)
    temporary = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    write_rank_file(temporary)
    os.replace(temporary, target)
    exchange.barrier()
    if rank == 0:
        temporary_pointer = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        pointer = dict(
            format=POINTER_FORMAT,
            version=version,
            world_size=world_size,
            epoch=epoch,
            seed=seed,
            random_seed=random_seed,
            stopper_dict=dict(stopper_dict or {}),
        )
        torch.save(pointer, temporary_pointer)
        os.replace(temporary_pointer, path)
    exchange.barrier()
    for old in _versions(path, rank, world_size):
        if old < version:
            rank_file(path, old, rank, world_size).unlink(missing_ok=True)
    logger.info("rank %d wrote checkpoint version %d (epoch %d) to %s", rank, version, epoch, target)
    return target


def reshard_rank_state(
    path: pathlib.Path,
    version: int,
    old_world_size: int,
    seed: int,
    sharding: EntitySharding,
    rank: int,
    table_keys: list[str],
    table_param_indices: list[int],
) -> dict[str, Any]:
    """Build this rank's checkpoint dictionary for a new world size from the old ranks' files.

    The replicated state is taken from the old rank 0; every entity table (``table_keys`` in the
    model's state dict) and its row-wise optimizer state (parameters ``table_param_indices`` of the
    optimizer's state dict) are rebuilt for this rank's shard of the new sharding, reading one old
    file at a time.

    :param path: the pointer path
    :param version: the version to read
    :param old_world_size: the world size that wrote it
    :param seed: the seed of the (old and new) sharding
    :param sharding: the new sharding
    :param rank: this rank (its shard of the new sharding)
    :param table_keys: the state-dict keys of the entity tables
    :param table_param_indices: the optimizer parameter indices of the entity tables
    :returns: a PyKEEN checkpoint dictionary for this rank
    :raises FileNotFoundError: if an old rank's file is missing
    """
    old_sharding = EntitySharding.create(sharding.num_entities, old_world_size, seed=seed)
    new_global = sharding.shard_entities[rank]  # [S_new], -1 for padding
    state: dict[str, Any] | None = None
    for old_rank in range(old_world_size):
        file = rank_file(path, version, old_rank, old_world_size)
        if not file.is_file():
            raise FileNotFoundError(
                f"Cannot reshard checkpoint {path} from {old_world_size} to {sharding.n_shard} ranks: {file} is "
                f"missing (all ranks' files must be in the same, shared directory)."
            )
        old = torch.load(file, weights_only=False)
        old_global = old_sharding.shard_entities[old_rank]  # [S_old]
        # rows of the new shard held by this old shard: new local row -> old local row
        position = torch.full((sharding.num_entities,), -1, dtype=torch.long)
        position[old_global[old_global >= 0]] = torch.nonzero(old_global >= 0).view(-1)
        real = new_global >= 0
        source = torch.full_like(new_global, -1)
        source[real] = position[new_global[real]]
        take = source >= 0
        if state is None:
            # the replicated state of old rank 0, with empty tables of the new shard size
            state = dict(old)
            state["model_state_dict"] = dict(old["model_state_dict"])
            state["optimizer_state_dict"] = dict(old["optimizer_state_dict"])
            state["optimizer_state_dict"]["state"] = {
                index: dict(value) for index, value in old["optimizer_state_dict"]["state"].items()
            }
            for key in table_keys:
                width = old["model_state_dict"][key].shape[1]
                state["model_state_dict"][key] = old["model_state_dict"][key].new_zeros(sharding.shard_size, width)
            optimizer_state = state["optimizer_state_dict"]["state"]
            for index in table_param_indices:
                for name, value in list(optimizer_state.get(index, {}).items()):
                    if torch.is_tensor(value) and value.ndim == 2:
                        optimizer_state[index][name] = value.new_zeros(sharding.shard_size, value.shape[1])
        for key in table_keys:
            state["model_state_dict"][key][take] = old["model_state_dict"][key][source[take]]
        for index in table_param_indices:
            for name, value in old["optimizer_state_dict"]["state"].get(index, {}).items():
                if torch.is_tensor(value) and value.ndim == 2:
                    state["optimizer_state_dict"]["state"][index][name][take] = value[source[take]]
        del old
    assert state is not None
    return state
