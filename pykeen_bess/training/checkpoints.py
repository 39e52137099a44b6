"""Checkpoint stores: how a BESS training loop writes and reads its checkpoints, chosen once per loop.

* :class:`FileCheckpointStore` (one process): PyKEEN's own single-file checkpoint, written to a
  temporary file of this process and renamed over the old one, so a crash while writing keeps the
  previous checkpoint. Resuming continues identically (same losses as an uninterrupted run).
* :class:`RankCheckpointStore` (a process group): every rank writes its own file of a new version
  next to the old one; once all have, rank 0 replaces the pointer file, and only then are the old
  versions removed. Resuming on the same number of ranks loads each rank's file; on another number
  of ranks the tables and their optimizer state are resharded.

Files of a distributed checkpoint ``NAME`` (in a directory all ranks share, as PyTorch-BigGraph's):

* ``NAME.v{version}.rank{r}-of-{n}``: written by rank ``r``: PyKEEN's checkpoint dictionary for that
  rank (its shard of every entity table and of the optimizer state, the replicated parameters and
  their optimizer state, the epoch, losses, random states, stopper state);
* ``NAME``: written last, by rank 0: a small pointer ``{"format", "version", "world_size", "epoch",
  "seed", "random_seed", "stopper_dict"}``. The last two are the fields PyKEEN itself reads from
  the file named ``checkpoint_name`` before the training loop loads it (``pipeline()`` takes the
  random seed from it, an early stopper its state), so a distributed checkpoint resumes through
  ``pipeline()`` like a single-file one.

Both write PyKEEN's checkpoint dictionary through :meth:`pykeen.training.TrainingLoop._save_state`
and read it through :meth:`~pykeen.training.TrainingLoop._load_state`, so everything PyKEEN keeps
(epoch, losses, optimizer and scheduler state, random states, stopper, best-epoch model) is kept.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import torch
from pykeen.stoppers import Stopper
from pykeen.training.training_loop import TrainingLoop
from pykeen.triples import CoreTriplesFactory

from ..distributed import Topology
from ..sharding import EntitySharding

__all__ = [
    "POINTER_FORMAT",
    "CheckpointStore",
    "FileCheckpointStore",
    "RankCheckpointStore",
    "latest_own_version",
    "rank_file",
    "read_pointer",
    "reshard_rank_state",
    "save_distributed_checkpoint",
]

logger = logging.getLogger(__name__)

#: the ``format`` value of a distributed checkpoint's pointer file
POINTER_FORMAT = "pykeen-bess-distributed-checkpoint"


class CheckpointStore(ABC):
    """Writes and reads a training loop's checkpoints."""

    def __init__(self, loop: Any):
        """Serve ``loop`` (a :class:`~pykeen_bess.training.BessTrainingLoop`)."""
        self.loop = loop

    def write_state(
        self,
        path: pathlib.Path,
        stopper: Stopper | None,
        best_epoch_model_file_path: pathlib.Path | None,
        triples_factory: CoreTriplesFactory | None,
    ) -> None:
        """Write PyKEEN's checkpoint dictionary of this process to ``path`` (no atomicity)."""
        TrainingLoop._save_state(
            self.loop,
            path=path,
            stopper=stopper,
            best_epoch_model_checkpoint_file_path=best_epoch_model_file_path,
            triples_factory=triples_factory,
        )

    def read_state(self, path: pathlib.Path, triples_factory: CoreTriplesFactory | None) -> Any:
        """Load PyKEEN's checkpoint dictionary of this process from ``path``."""
        return TrainingLoop._load_state(self.loop, path=path, triples_factory=triples_factory)

    @abstractmethod
    def save(
        self,
        path: pathlib.Path,
        stopper: Stopper | None = None,
        best_epoch_model_file_path: pathlib.Path | None = None,
        triples_factory: CoreTriplesFactory | None = None,
    ) -> None:
        """Write a checkpoint at ``path`` (collective under a process group); a crash keeps the previous one."""

    @abstractmethod
    def load(self, path: pathlib.Path, triples_factory: CoreTriplesFactory | None = None) -> Any:
        """Load the checkpoint at ``path``; returns what PyKEEN's ``_load_state`` returns."""


class FileCheckpointStore(CheckpointStore):
    """PyKEEN's single checkpoint file, replaced atomically."""

    def save(  # noqa: D102
        self,
        path: pathlib.Path,
        stopper: Stopper | None = None,
        best_epoch_model_file_path: pathlib.Path | None = None,
        triples_factory: CoreTriplesFactory | None = None,
    ) -> None:
        path = pathlib.Path(path)
        # a name of this process' own: two processes writing one checkpoint must not share a temporary file
        temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        try:
            self.write_state(temporary, stopper, best_epoch_model_file_path, triples_factory)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)

    def load(self, path: pathlib.Path, triples_factory: CoreTriplesFactory | None = None) -> Any:  # noqa: D102
        if read_pointer(pathlib.Path(path)) is not None:
            raise ValueError(
                f"{path} is a checkpoint of a torch.distributed run; resume it under torchrun (any number of "
                f"ranks: it is resharded), or load its model with pykeen_bess.distributed.export_model first."
            )
        return self.read_state(pathlib.Path(path), triples_factory)


class RankCheckpointStore(CheckpointStore):
    """Versioned per-rank files and a pointer written last (one shard per rank)."""

    def save(  # noqa: D102
        self,
        path: pathlib.Path,
        stopper: Stopper | None = None,
        best_epoch_model_file_path: pathlib.Path | None = None,
        triples_factory: CoreTriplesFactory | None = None,
    ) -> None:
        best = None
        if best_epoch_model_file_path is not None:
            best = self.rank_file(pathlib.Path(best_epoch_model_file_path))

        def write(file: pathlib.Path) -> None:
            self.write_state(file, stopper, best, triples_factory)

        save_distributed_checkpoint(
            pathlib.Path(path),
            self.loop.topology,
            write,
            epoch=self.loop._epoch,
            seed=self.loop.config.seed,
            random_seed=self.loop.model._random_seed,
            stopper_dict=stopper.get_summary_dict() if stopper is not None else None,
        )

    def rank_file(self, path: pathlib.Path) -> pathlib.Path | None:
        """Return this rank's file of the checkpoint at ``path`` (same world size), None if it must be resharded."""
        topology = self.loop.topology
        rank, world_size = topology.rank, topology.n_shard
        pointer = read_pointer(path)
        if pointer is None:
            version = latest_own_version(path, rank, world_size)
            if version is None:
                return path if path.is_file() else None  # a plain PyKEEN checkpoint file
            return rank_file(path, version, rank, world_size)
        if pointer["world_size"] == world_size:
            return rank_file(path, pointer["version"], rank, world_size)
        return None

    def load(self, path: pathlib.Path, triples_factory: CoreTriplesFactory | None = None) -> Any:  # noqa: D102
        path = pathlib.Path(path)
        file = self.rank_file(path)
        if file is not None:
            return self.read_state(file, triples_factory)
        pointer = read_pointer(path)
        if pointer is None:
            raise FileNotFoundError(f"No checkpoint for rank {self.loop.topology.rank} at {path}.")
        seed = self.loop.config.seed
        if int(pointer.get("seed", seed)) != seed:
            raise ValueError(
                f"Checkpoint {path} was written with sharding seed {pointer['seed']}, this run uses {seed}: pass "
                f"seed={pointer['seed']} to resume it."
            )
        return self._load_resharded(path, pointer, triples_factory)

    def _load_resharded(self, path: pathlib.Path, pointer: Mapping[str, Any], triples_factory: Any) -> Any:
        """Load a checkpoint written by another number of ranks, resharding the entity tables."""
        loop = self.loop
        logger.warning(
            "Resharding checkpoint %s from %d to %d ranks.", path, pointer["world_size"], loop.topology.n_shard
        )
        table_ids = {id(weight) for weight in loop.tables.weights()}
        table_keys = [name for name, param in loop.model.named_parameters() if id(param) in table_ids]
        params = [param for group in loop.optimizer.param_groups for param in group["params"]]
        table_indices = [index for index, param in enumerate(params) if id(param) in table_ids]
        state = reshard_rank_state(
            path=path,
            version=int(pointer["version"]),
            old_world_size=int(pointer["world_size"]),
            seed=loop.config.seed,
            sharding=loop.sharding,
            rank=loop.topology.rank,
            table_keys=table_keys,
            table_param_indices=table_indices,
        )
        state["checksum"] = loop.checksum  # the representation of the shard tables names the world size
        with tempfile.TemporaryDirectory() as directory:
            file = pathlib.Path(directory, "resharded.pt")
            torch.save(state, file)
            return self.read_state(file, triples_factory)


# -- the files of a distributed checkpoint --------------------------------------------------------


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
    topology: Topology,
    write_rank_file: Callable[[pathlib.Path], None],
    epoch: int,
    seed: int,
    random_seed: int | None = None,
    stopper_dict: Mapping[str, Any] | None = None,
) -> pathlib.Path:
    """Write a new version of a distributed checkpoint (collective: every rank calls it).

    :param path: the checkpoint's pointer path
    :param topology: the process topology (rank, number of ranks, barrier, all-reduce)
    :param write_rank_file: writes this rank's state to the given file
    :param epoch: the epoch the checkpoint holds (stored in the pointer for humans)
    :param seed: the seed of the entity sharding (needed to reshard)
    :param random_seed: the model's random seed (what ``pipeline()`` reads back when resuming)
    :param stopper_dict: the early stopper's summary (what PyKEEN's stopper reads back)
    :returns: this rank's file of the new version
    """
    rank, world_size = topology.rank, topology.n_shard
    local = latest_own_version(path, rank, world_size) or 0
    pointer = read_pointer(path) if rank == 0 else None
    if pointer is not None:
        local = max(local, int(pointer["version"]))
    version = int(topology.all_reduce(torch.tensor([local], dtype=torch.long), op="max")[0]) + 1
    target = rank_file(path, version, rank, world_size)
    temporary = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    write_rank_file(temporary)
    os.replace(temporary, target)
    topology.barrier()
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
    topology.barrier()
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
