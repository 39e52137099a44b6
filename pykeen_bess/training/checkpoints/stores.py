"""Checkpoint stores: how a BESS training loop writes and reads its checkpoints, chosen once per loop.

* :class:`FileCheckpointStore` (one process): PyKEEN's own single-file checkpoint, written to a
  temporary file of this process and renamed over the old one, so a crash while writing keeps the
  previous checkpoint. Resuming continues identically (same losses as an uninterrupted run).
* :class:`RankCheckpointStore` (a process group): versioned files per shard and a pointer written
  last (:mod:`~pykeen_bess.training.checkpoints.files`), in one of the two retrieval modes of replica groups:
  ``"one_per_group"`` (the first replica of each shard writes its file; resumable on any numbers of
  shards and replicas) or ``"all_replicas"`` (every process writes its own file; resuming checks that
  the replicas of each shard hold the same values). Resuming on the same number of shards loads each
  shard's file; on another number of shards the tables and their optimizer state are resharded.
* :class:`RowShardCheckpointStore` (the encoding partition over a process group): the same files,
  of the row shards the column parts make while they are written or read.

Both write PyKEEN's checkpoint dictionary through :meth:`pykeen.training.TrainingLoop._save_state`
and read it through :meth:`~pykeen.training.TrainingLoop._load_state`, so everything PyKEEN keeps
(epoch, losses, optimizer and scheduler state, random states, stopper, best-epoch model) is kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, cast

import torch
from pykeen.stoppers import Stopper
from pykeen.training.training_loop import CheckpointMismatchError, TrainingLoop
from pykeen.triples import CoreTriplesFactory

from ...data.sharding import EntitySharding, RandomSharding
from ...distributed import Topology
from ...storage.digests import write_with_digests
from ...tables.representation import ShardedEmbedding
from .mismatch import describe_mismatch, predated_checks, scheduler_difference
from .checkpointed import CheckpointedLoop, checksum, optimizer_text, scheduler_text
from ...tables.column_tables import ColumnShardTables
from .resharding import ShardFiles, reshard_rank_state, reshard_stored_tables
from .files import (
    POINTER_FORMAT,
    latest_own_version,
    peek_file,
    pointer_file,
    pointer_shards,
    read_pointer,
    remove_abandoned_temporaries,
    remove_shard_files,
    save_distributed_checkpoint,
    shard_file,
    stale_tables_directories,
    tables_directory,
    temporary_file,
    verify_checkpoint,
)

__all__ = [
    "CHECKPOINT_FORMATS",
    "CHECKPOINT_RETRIEVALS",
    "checkpoint_seed",
    "tables_directory",
    "CheckpointStore",
    "FileCheckpointStore",
    "RankCheckpointStore",
    "RowShardCheckpointStore",
]

logger = logging.getLogger(__name__)

#: the retrieval modes of distributed checkpoints (``checkpoint_retrieval=``)
CHECKPOINT_RETRIEVALS = ("one_per_group", "all_replicas")
#: the checkpoint layouts (``checkpoint_format=``): PyKEEN's files, or PyTorch-BigGraph's
CHECKPOINT_FORMATS = ("pykeen", "pbg")


def check_pointer_sharding(path: pathlib.Path, pointer: Mapping[str, Any], sharding: Any) -> None:
    """Check that resharding re-derives the sharding the checkpoint's files were written with.

    :raises ValueError: if the pointer records another sharding, or records none (written before it was
        recorded, when the sharding was always random) and this run's is not random
    """
    written = pointer.get("sharding")
    derived = sharding.with_shards(pointer_shards(pointer))
    if written == derived.fingerprint or written is None and isinstance(derived.strategy, RandomSharding):
        return
    raise ValueError(
        f"Checkpoint {path} was written with another sharding ({written or 'random; not recorded'}) than this run "
        f"derives for its {pointer_shards(pointer)} shards ({derived.fingerprint}): resume it with the sharding, "
        "seed and training triples it was written with."
    )


def check_pointer(path: pathlib.Path, pointer: Mapping[str, Any], seed: int, sharding: EntitySharding) -> ShardFiles:
    """Check that a distributed checkpoint can be resharded into this run's sharding; return its files.

    :raises ValueError: if it was written with another seed or sharding (:func:`check_pointer_sharding`)
    """
    if int(pointer.get("seed", seed)) != seed:
        raise ValueError(
            f"Checkpoint {path} was written with sharding seed {pointer['seed']}, this run uses {seed}: pass "
            f"seed={pointer['seed']} to resume it."
        )
    check_pointer_sharding(path, pointer, sharding)
    return ShardFiles.of_pointer(path, pointer)


def one_process_shards(store: CheckpointStore, path: pathlib.Path) -> int | None:
    """Return the number of logical shards of the one-process checkpoint at ``path`` if it resumes into this run.

    Its tables hold every shard, ``[k * ceil(N / k), D]``; PyKEEN's checksum (of the model, whose shard
    tables name their sharding, and of the optimizer) tells which ``k``, and that the rest of the
    configuration is this run's. None: not such a file (or another configuration: loading it says what differs).
    """
    content = peek_checkpoint(path)
    if content is None or not isinstance(content.get("model_state_dict"), dict) or "checksum" not in content:
        return None
    rows = _table_rows(store, content["model_state_dict"])
    if rows is None:
        return None
    loop, sharding = store.loop, store.sharding
    model, optimizer = str(loop.model), optimizer_text(loop.optimizer)
    scheduler = scheduler_text(loop.lr_scheduler)  # (and "": a checkpoint of an earlier version)
    for k in range(1, min(rows, sharding.num_entities) + 1):  # (more shards than entities: no sharding)
        if k * -(-sharding.num_entities // k) != rows:
            continue
        candidate = model.replace(loop.sharding.fingerprint, sharding.with_shards(k).fingerprint)
        if content["checksum"] in {checksum(candidate, optimizer, text) for text in (scheduler, "")}:
            return k
    return None


def _table_rows(store: CheckpointStore, model_state: Mapping[str, Any]) -> int | None:
    """Return the rows of the first entity table in a checkpoint's model state (None: it holds none)."""
    table_ids = {id(table.weight) for table in store.held_tables()}
    for name, param in store.loop.model.named_parameters():
        if id(param) in table_ids and torch.is_tensor(model_state.get(name)):
            return int(model_state[name].shape[0])
    for key, entry in model_state.items():
        if key.endswith(".stored_table") and isinstance(entry, dict):
            return int(entry["shape"][0])
    return None


def peek_checkpoint(path: pathlib.Path) -> dict[str, Any] | None:
    """Return the dictionary of the checkpoint file at ``path`` memory-mapped (tensors not read), None if none."""
    if not path.is_file():
        return None
    content = peek_file(path)
    return content if isinstance(content, dict) else None


def checkpoint_seed(path: pathlib.Path) -> int | None:
    """Return the seed a loop without an explicit ``seed`` derives for the checkpoint at ``path`` (None: no checkpoint).

    A distributed checkpoint's pointer records the loop's seed; a single file records the model's
    random seed (PyKEEN's ``random_seed`` entry), from which such a loop derived its seed.
    """
    content = peek_checkpoint(pathlib.Path(path))
    if content is None:
        return None
    if content.get("format") == POINTER_FORMAT:
        return int(content["seed"]) if content.get("seed") is not None else None
    if "checksum" not in content:  # not a checkpoint of a training loop
        return None
    seed = content.get("random_seed")
    return 0 if seed is None else int(seed)


class CheckpointStore(ABC):
    """Writes and reads a training loop's checkpoints."""

    def __init__(self, loop: CheckpointedLoop):
        """Serve ``loop`` (a :class:`~pykeen_bess.training.BessTrainingLoop`)."""
        self.loop = loop
        #: the files of the last checkpoint read if it was resharded (another layout of shards), else None
        self.resharded_from: ShardFiles | None = None

    @property
    def topology(self) -> Topology:
        """The topology whose shards the files are (the loop's)."""
        return self.loop.topology

    @property
    def sharding(self) -> EntitySharding:
        """The row sharding of the files (the loop's)."""
        return self.loop.sharding

    def held_tables(self) -> list[ShardedEmbedding]:
        """Return the tables the model holds while a checkpoint is read (the loop's tables)."""
        return self.loop.tables.tables

    def write_state(
        self,
        path: pathlib.Path,
        stopper: Stopper | None,
        best_epoch_model_file_path: pathlib.Path | None,
        triples_factory: CoreTriplesFactory | None,
    ) -> None:
        """Write PyKEEN's checkpoint dictionary of this process to ``path`` (no atomicity).

        Tables in files are copied into ``tables_directory`` (created here; see :func:`tables_directory`).
        """
        tables = self.loop.tables
        directory = tables_directory(path) if tables.keeps_files else None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)  # a leftover of an interrupted write
            directory.mkdir()
        with tables.checkpoint_files(directory):
            TrainingLoop._save_state(
                cast(TrainingLoop, self.loop),
                path=path,
                stopper=stopper,
                best_epoch_model_checkpoint_file_path=best_epoch_model_file_path,
                triples_factory=triples_factory,
            )

    def read_state(self, path: pathlib.Path, triples_factory: CoreTriplesFactory | None) -> Any:
        """Load PyKEEN's checkpoint dictionary of this process from ``path``.

        :raises CheckpointMismatchError: saying what differs (see :func:`describe_mismatch`)
        :raises CorruptCheckpointError: if the file, or a copy of a table in files, differs from what was written
        """
        verify_checkpoint(path)  # before anything is read into the loop
        try:
            with self.loop.tables.checkpoint_files(pathlib.Path(path).parent):
                pykeen_loop = cast(TrainingLoop, self.loop)
                return TrainingLoop._load_state(pykeen_loop, path=path, triples_factory=triples_factory)
        except CheckpointMismatchError as error:
            state = torch.load(path, weights_only=False)
            checks = predated_checks(self.loop, state)  # written before the checksum covered the sharding, ...
            if checks is not None:
                logger.warning("Checkpoint %s predates %s; resuming it as it is.", path, checks)
                return self.read_checksummed(state, triples_factory, tables=pathlib.Path(path).parent)
            raise CheckpointMismatchError(f"{error} {describe_mismatch(self.loop, state, triples_factory)}") from error

    def read_checksummed(self, state: dict[str, Any], triples_factory: Any, tables: pathlib.Path | None = None) -> Any:
        """Load a checkpoint dictionary built for this loop (resharded, or legacy) through PyKEEN's ``_load_state``.

        :param tables: the directory of the checkpoint's table files (default: none besides the dictionary)
        """
        difference = scheduler_difference(self.loop, state)  # (its checksum is replaced: the scheduler by its state)
        if difference is not None:
            raise CheckpointMismatchError(f"The checkpoint does not fit this run: {difference}.")
        state["checksum"] = self.loop.checksum  # the representation of the shard tables names the sharding
        with tempfile.TemporaryDirectory() as directory:
            file = pathlib.Path(directory, f"checkpoint-{os.getpid()}.pt")
            torch.save(state, file)
            with self.loop.tables.checkpoint_files(file.parent if tables is None else tables):
                pykeen_loop = cast(TrainingLoop, self.loop)
                return TrainingLoop._load_state(pykeen_loop, path=file, triples_factory=triples_factory)

    def load_resharded(self, files: ShardFiles, triples_factory: Any) -> Any:
        """Load a checkpoint whose files hold other shards (another number of them, or another layout).

        The rows of this process' shards (one rank's, or every logical shard of one process) are
        gathered from the checkpoint's files, one file at a time (:mod:`~pykeen_bess.training.checkpoints.resharding`).
        """
        loop = self.loop
        shards = list(self.topology.local_shards)
        self.resharded_from = files
        logger.warning(
            "Resharding checkpoint %s into shard(s) %s of %d.", files.describe(), shards, self.topology.n_shard
        )
        table_ids = {id(table.weight) for table in self.held_tables()}
        table_keys = [name for name, param in loop.model.named_parameters() if id(param) in table_ids]
        params = [param for group in loop.optimizer.param_groups for param in group["params"]]
        table_indices = [index for index, param in enumerate(params) if id(param) in table_ids]
        if not table_keys:  # tables outside the model: their rows go straight into the tier
            reshard_stored_tables(files, self.sharding, shards, self.held_tables())
        state = reshard_rank_state(
            files, self.sharding, shards, table_keys=table_keys, table_param_indices=table_indices
        )
        if not table_keys:
            model_state = state["model_state_dict"]
            for key in [key for key in model_state if key.endswith(".stored_table")]:
                del model_state[key]  # already loaded (the tables of the first file)
        return self.read_checksummed(state, triples_factory)

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

    def mark_written(self, path: pathlib.Path) -> None:
        """Mark the tables' files as of the run of a checkpoint it wrote (a failure checkpoint: resuming it takes them).

        Not for the early stopper's temporary copies of the best epoch, which PyKEEN writes with ``_save_state``.
        """
        self.loop.tables.storage.checkpoint_written(path)


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
        # a name of this process' own: two processes writing one checkpoint must not share a temporary file;
        # tables in files go to a directory named after it, kept only once the checkpoint file is in place
        temporary = temporary_file(path)
        try:
            write_with_digests(
                temporary, lambda: self.write_state(temporary, stopper, best_epoch_model_file_path, triples_factory)
            )
            os.replace(temporary, path)
        except BaseException:
            shutil.rmtree(tables_directory(temporary), ignore_errors=True)
            raise
        finally:
            temporary.unlink(missing_ok=True)
        if self.loop.tables.keeps_files:  # the previous versions' table files
            keep = tables_directory(temporary).name
            for old in stale_tables_directories(path):
                if old.name != keep:
                    shutil.rmtree(old, ignore_errors=True)
        remove_abandoned_temporaries(path)  # (of processes killed while writing)
        remove_shard_files(path)  # (of the distributed checkpoint this file replaced, if any)

    def load(self, path: pathlib.Path, triples_factory: CoreTriplesFactory | None = None) -> Any:  # noqa: D102
        path = pathlib.Path(path)
        pointer = read_pointer(path)
        if pointer is not None:  # a distributed checkpoint: every shard's rows from the ranks' files
            return self.load_resharded(
                check_pointer(path, pointer, self.loop.config.seed, self.sharding), triples_factory
            )
        try:
            return self.read_state(path, triples_factory)
        except CheckpointMismatchError:  # another number of logical shards, otherwise this configuration?
            shards = one_process_shards(self, path)
            if shards is None or shards == self.topology.n_shard:
                raise
            return self.load_resharded(ShardFiles(path, shards), triples_factory)


class RankCheckpointStore(CheckpointStore):
    """Versioned files per shard (or per replica) and a pointer written last."""

    def __init__(self, loop: CheckpointedLoop, all_replicas: bool = False):
        """Serve ``loop``; ``all_replicas``: every process writes its own file."""
        super().__init__(loop)
        self.all_replicas = all_replicas

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
            self.topology,
            write,
            epoch=self.loop._epoch,
            seed=self.loop.config.seed,
            random_seed=self.loop.model._random_seed,
            stopper_dict=stopper.get_summary_dict() if stopper is not None else None,
            all_replicas=self.all_replicas,
            sharding=self.sharding.fingerprint,
        )

    def rank_file(self, path: pathlib.Path) -> pathlib.Path | None:
        """Return this process' file of the checkpoint at ``path`` (same shards), None if it must be resharded."""
        topology = self.topology
        shard, n_shard = topology.local_shards[0], topology.n_shard
        pointer = read_pointer(path)
        if pointer is None:  # no pointer (yet): the newest file of this shard, or a plain PyKEEN file
            version = latest_own_version(path, shard, n_shard)
            if version is None:
                return path if path.is_file() else None
            return shard_file(path, version, shard, n_shard)
        if pointer_shards(pointer) != n_shard:
            return None
        same_replicas = int(pointer.get("replicas", 1)) == topology.replicas
        return pointer_file(path, pointer, shard, replica=topology.replica if same_replicas else 0)

    def load(self, path: pathlib.Path, triples_factory: CoreTriplesFactory | None = None) -> Any:  # noqa: D102
        path = pathlib.Path(path)
        pointer = read_pointer(path)
        file = self.rank_file(path)
        one_process = one_process_shards(self, path) if pointer is None and file == path else None
        if one_process is not None:  # one process' file with logical shards: this rank's rows of it
            result = self.load_resharded(ShardFiles(path, one_process), triples_factory)
        elif file is not None:
            result = self.read_state(file, triples_factory)
        elif pointer is None:
            raise FileNotFoundError(f"No checkpoint for shard {self.topology.local_shards[0]} at {path}.")
        else:
            result = self.load_resharded(
                check_pointer(path, pointer, self.loop.config.seed, self.sharding), triples_factory
            )
        if pointer is not None and pointer.get("retrieval") == "all_replicas":
            self.verify_replicas_agree(path)
        return result

    def verify_replicas_agree(self, path: pathlib.Path) -> None:
        """Check that the replicas of every shard hold the same tables and optimizer state (collective).

        :raises ValueError: naming the shard and the ranks whose values differ
        """
        topology = self.topology
        digest = hashlib.sha1()
        for table in self.held_tables():
            digest.update(table.weight.detach().cpu().contiguous().numpy().tobytes())
            state = dict(self.loop.optimizer.state.get(table.optimizer_parameter, {}), **table.row_state)
            for _, value in sorted(state.items()):
                if torch.is_tensor(value):
                    digest.update(value.detach().cpu().contiguous().numpy().tobytes())
        entries = topology.all_gather_object((topology.local_shards[0], digest.hexdigest()))
        by_shard: dict[int, dict[str, list[int]]] = {}
        for rank, (shard, value) in enumerate(entries):
            by_shard.setdefault(shard, {}).setdefault(value, []).append(rank)
        for shard, values in sorted(by_shard.items()):
            if len(values) > 1:
                groups = "; ".join(f"ranks {ranks}" for ranks in values.values())
                raise ValueError(
                    f"The replicas of shard {shard} in checkpoint {path} hold different values ({groups}): a replica's "
                    f"file was changed or written by another run."
                )


class RowShardCheckpointStore(RankCheckpointStore):
    """The encoding partition over processes: the token partition's files of the row shards its column parts make.

    While a checkpoint is written or read, the model and the optimizer hold the row shards of a
    token-partitioned run over the same processes (one all-to-all per table and per optimizer state
    tensor, :meth:`~pykeen_bess.tables.column_tables.ColumnShardTables.row_shards`), so the files
    are exactly the token partition's: they resume with either partition on any number of processes
    (resharded as there).
    """

    def __init__(self, loop: CheckpointedLoop, tables: ColumnShardTables, all_replicas: bool = False):
        """Serve ``loop``, whose ``tables`` are column parts; ``all_replicas``: every process writes its own file."""
        super().__init__(loop, all_replicas=all_replicas)
        self.column_tables = tables

    @property
    def topology(self) -> Topology:
        """The token topology of the same processes (rank ``r`` writes row shard ``r``)."""
        return self.column_tables.layout.topology

    @property
    def sharding(self) -> EntitySharding:
        """The row sharding of that topology."""
        return self.column_tables.layout.sharding

    def held_tables(self) -> list[ShardedEmbedding]:
        """Return the row shards the model holds while a checkpoint is read."""
        return self.column_tables.lent_rows or []

    def save(  # noqa: D102
        self,
        path: pathlib.Path,
        stopper: Stopper | None = None,
        best_epoch_model_file_path: pathlib.Path | None = None,
        triples_factory: CoreTriplesFactory | None = None,
    ) -> None:
        with self.column_tables.row_shards(self.loop.optimizer):
            super().save(path, stopper, best_epoch_model_file_path, triples_factory)

    def load(self, path: pathlib.Path, triples_factory: CoreTriplesFactory | None = None) -> Any:  # noqa: D102
        try:
            with self.column_tables.row_shards(self.loop.optimizer, read=False, write=True):
                return super().load(path, triples_factory)
        except CheckpointMismatchError as error:
            if read_pointer(pathlib.Path(path)) is not None:
                raise
            raise CheckpointMismatchError(
                f"{path} is a checkpoint of one process: with the encoding partition it resumes in one process "
                f"only (a checkpoint written under torchrun resumes in either). Resume it without torchrun. "
                f"({error})"
            ) from error
