"""The files of a distributed checkpoint: versions, the pointer written last, resharding.

A distributed checkpoint ``NAME`` lives in a directory all ranks share (as PyTorch-BigGraph's):

* ``NAME.v{version}.rank{s}-of-{n}``: shard ``s`` of ``n`` (with one replica per shard: rank ``s``),
  written by the shard's first replica (``checkpoint_retrieval="one_per_group"``): PyKEEN's
  checkpoint dictionary of that process (its shard of every entity table and of the optimizer
  state, the replicated parameters and their optimizer state, the epoch, losses, random states,
  stopper state);
* ``NAME.v{version}.rank{s}-of-{n}.replica{q}-of-{R}``: the same, written by every replica
  (``checkpoint_retrieval="all_replicas"``);
* ``NAME``: written last, by rank 0: a small pointer ``{"format", "version", "world_size" (the number of
  shards), "replicas", "retrieval", "epoch", "seed", "sharding", "random_seed", "stopper_dict"}`` ("sharding":
  the fingerprint of the entity sharding, checked before resharding). The last two are
  the fields PyKEEN itself reads from the file named ``checkpoint_name`` before the training loop
  loads it (``pipeline()`` takes the random seed from it, an early stopper its state), so a
  distributed checkpoint resumes through ``pipeline()`` like a single-file one.

Tables kept in files (``storage="mmap"``) are copied, flushed and synced, into a directory next to
each shard's file (``NAME.v{version}.rank{s}-of-{n}.tables-{pid}``), which the file names.

A new version is written next to the old one; only after every process has finished does rank 0
replace the pointer (atomically), and only then are the previous version's files removed, so a
crash while writing never loses the previous checkpoint. Files of older versions written with other
numbers of shards or replicas (before a resharded resume) are removed at the same time.
"""

from __future__ import annotations

import glob
import logging
import os
import pathlib
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...distributed import Topology
from ...storage.digests import verify_torch_file, write_with_digests
from ...storage.state_dict import verify_stored_tables

__all__ = [
    "POINTER_FORMAT",
    "latest_own_version",
    "load_verified",
    "peek_file",
    "pointer_file",
    "pointer_shards",
    "read_pointer",
    "remove_abandoned_temporaries",
    "remove_shard_files",
    "save_distributed_checkpoint",
    "shard_file",
    "stale_tables_directories",
    "tables_directory",
    "temporary_file",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

#: the ``format`` value of a distributed checkpoint's pointer file
POINTER_FORMAT = "pykeen-bess-distributed-checkpoint"


#: the infix of a file that is being written and is renamed into place once complete (``NAME.tmp-TAG``)
TEMPORARY_INFIX = ".tmp-"


def _host() -> str:
    """Return this machine's name as it may appear in a file name (``[A-Za-z0-9._-]``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def temporary_file(path: pathlib.Path) -> pathlib.Path:
    """Return the name a file ``path`` is written under before it is renamed into place: ``NAME.tmp-HOST-PID-NS``.

    The machine, the process and the time make it the writer's own (two processes writing one checkpoint never
    share it), and let a later writer tell an abandoned file from one being written
    (:func:`remove_abandoned_temporaries`).
    """
    return path.with_name(f"{path.name}{TEMPORARY_INFIX}{_host()}-{os.getpid()}-{time.time_ns()}")


def _process_start_ns(pid: int) -> int | None:
    """Return when process ``pid`` of this machine started (ns since the epoch; None where Linux does not say)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as file:
            started_ticks = int(file.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="utf-8") as file:
            boot = next(int(line.split()[1]) for line in file if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return (boot * 10**9) + started_ticks * 10**9 // os.sysconf("SC_CLK_TCK")


def _ended(pid: int, written_ns: int) -> bool:
    """Whether the process that wrote a temporary file at ``written_ns`` has ended.

    It has if no process ``pid`` runs on this machine, or if the process with that id started after the file
    was named (the id was reused, e.g. a restarted container's first process; one second of slack for the
    start time's resolution). A process of another user counts as running.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, OSError):
        return False
    started = _process_start_ns(pid)
    return started is not None and started > written_ns + 10**9


def remove_abandoned_temporaries(path: pathlib.Path) -> list[pathlib.Path]:
    """Remove the temporary files of checkpoint ``path`` whose writer ended before renaming them (killed mid-write).

    A write that fails in the process removes its temporary file itself; a process killed while writing
    (``SIGKILL``, out of memory, a lost machine) leaves ``NAME.tmp-TAG`` behind, up to a checkpoint's
    size, and the table copies next to it (``NAME.tables-TAG``, storage="mmap"). Removed are those of the
    pointer or single file ``NAME`` and of every shard file ``NAME.v{version}.rank{s}-of-{n}[.replica...]``
    written on this machine (:func:`temporary_file`) by a process that no longer runs (or whose id a later
    process took); files of other machines (a shared checkpoint directory) and of running processes stay.
    Machines are told apart by their host name: containers that share one (and their process ids) and a
    checkpoint directory need distinct checkpoint names.

    :returns: the temporary files removed
    """
    if not path.parent.is_dir():
        return []
    pattern = re.compile(
        rf"^{re.escape(path.name)}(?:\.v\d+\.rank\d+-of-\d+(?:\.replica\d+-of-\d+)?)?"
        rf"{re.escape(TEMPORARY_INFIX)}{re.escape(_host())}-(\d+)-(\d+)$"
    )
    removed = []
    for candidate in path.parent.iterdir():
        match = pattern.match(candidate.name)
        if match is None or not _ended(int(match.group(1)), int(match.group(2))) or not candidate.is_file():
            continue
        candidate.unlink(missing_ok=True)
        shutil.rmtree(tables_directory(candidate), ignore_errors=True)
        removed.append(candidate)
    if removed:
        logger.info("removed %d temporary checkpoint files of ended processes: %s", len(removed), removed)
    return removed


def tables_directory(file: pathlib.Path) -> pathlib.Path:
    """Return the directory for the copies of table files (``storage="mmap"``) of the checkpoint written to ``file``.

    A checkpoint is written to a temporary file ``NAME.tmp-TAG`` and then renamed to ``NAME``; its
    tables go to ``NAME.tables-TAG``, which is named for the checkpoint it belongs to and stays once the
    checkpoint is in place (the tag keeps it apart from the previous checkpoint's directory, which is
    removed only after the rename). For any other file ``NAME`` the directory is ``NAME.tables``.
    """
    name, infix, tag = file.name.rpartition(TEMPORARY_INFIX)
    if infix:
        return file.with_name(f"{name}.tables-{tag}")
    return file.with_name(f"{file.name}.tables")


def stale_tables_directories(file: pathlib.Path) -> list[pathlib.Path]:
    """Return the table directories written for checkpoint ``file`` (named as now, or as before they were renamed)."""
    pattern = glob.escape(file.name)
    return [*file.parent.glob(f"{pattern}.tables-*"), *file.parent.glob(f"{pattern}{TEMPORARY_INFIX}*.tables")]


def shard_file(
    path: pathlib.Path, version: int, shard: int, n_shard: int, replica: int | None = None, replicas: int = 1
) -> pathlib.Path:
    """Return the file of one shard (and, if every replica writes one, one replica) of a checkpoint version."""
    name = f"{path.name}.v{version}.rank{shard}-of-{n_shard}"
    if replica is not None:
        name += f".replica{replica}-of-{replicas}"
    return path.with_name(name)


def pointer_shards(pointer: Mapping[str, Any]) -> int:
    """Return the number of shards of the checkpoint a pointer describes."""
    return int(pointer["world_size"])


def pointer_file(path: pathlib.Path, pointer: Mapping[str, Any], shard: int, replica: int = 0) -> pathlib.Path:
    """Return the file of a shard in the checkpoint a pointer describes (a replica's, if every replica wrote one)."""
    if pointer.get("retrieval") == "all_replicas":
        return shard_file(path, int(pointer["version"]), shard, pointer_shards(pointer), replica, pointer["replicas"])
    return shard_file(path, int(pointer["version"]), shard, pointer_shards(pointer))


def _versions(path: pathlib.Path, shard: int, n_shard: int, replica: int | None = None, replicas: int = 1) -> list[int]:
    suffix = "" if replica is None else rf"\.replica{replica}-of-{replicas}"
    pattern = re.compile(rf"^{re.escape(path.name)}\.v(\d+)\.rank{shard}-of-{n_shard}{suffix}$")
    if not path.parent.is_dir():
        return []
    return sorted(int(m.group(1)) for p in path.parent.iterdir() if (m := pattern.match(p.name)))


def latest_own_version(
    path: pathlib.Path, shard: int, n_shard: int, replica: int | None = None, replicas: int = 1
) -> int | None:
    """Return the newest version written for a shard (and replica) of ``path`` (None if none)."""
    versions = _versions(path, shard, n_shard, replica, replicas)
    return versions[-1] if versions else None


def peek_file(path: pathlib.Path) -> Any:
    """Load a ``torch.save`` file memory-mapped where it can be (tensors are read only when used).

    :raises CorruptCheckpointError: if it cannot be loaded because it differs from what was written
    """
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError:  # not the zip format memory maps need (written with another serialization)
            return torch.load(path, map_location="cpu", weights_only=False)
    except Exception:
        verify_torch_file(path)  # a corrupted file: say so, naming it
        raise


def verify_checkpoint(path: pathlib.Path) -> None:
    """Check a checkpoint file (and the copies of tables in files it names) against the digests written with them.

    :raises CorruptCheckpointError: naming the file that differs from what was written
        (:mod:`~pykeen_bess.storage.digests`)
    """
    path = pathlib.Path(path)
    verify_torch_file(path)
    content = peek_file(path)
    if isinstance(content, dict) and isinstance(content.get("model_state_dict"), dict):
        verify_stored_tables(content["model_state_dict"], path.parent)


def load_verified(path: pathlib.Path) -> Any:
    """Return the content of a checkpoint file once :func:`verify_checkpoint` has checked it."""
    verify_checkpoint(path)
    return torch.load(path, weights_only=False)


def read_pointer(path: pathlib.Path) -> dict[str, Any] | None:
    """Return the pointer stored at ``path`` (checked against its digests), None if ``path`` is not a pointer."""
    if not path.is_file():
        return None
    content = peek_file(path)
    if isinstance(content, dict) and content.get("format") == POINTER_FORMAT:
        verify_torch_file(path)
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
    all_replicas: bool = False,
    version: int | None = None,
    before_pointer: Callable[[int], None] | None = None,
    sharding: str | None = None,
    after_pointer: Callable[[int], None] | None = None,
) -> pathlib.Path | None:
    """Write a new version of a distributed checkpoint (collective: every process calls it).

    :param path: the checkpoint's pointer path
    :param topology: the process topology (shard, replica, barrier, all-reduce)
    :param write_rank_file: writes this process' state to the given file
    :param epoch: the epoch the checkpoint holds (stored in the pointer for humans)
    :param seed: the seed of the entity sharding (needed to reshard)
    :param random_seed: the model's random seed (what ``pipeline()`` reads back when resuming)
    :param stopper_dict: the early stopper's summary (what PyKEEN's stopper reads back)
    :param all_replicas: every replica writes its own file (else the first replica of each shard)
    :param version: the version to write (default: one more than any version written so far); it must be
        newer than the one the pointer names
    :param before_pointer: called by the main process with the version once every process has written its
        file, before the pointer moves (e.g. files of the version that only one process writes)
    :param after_pointer: called by every process with the previous version once the pointer has moved
        (e.g. removing the previous version's files)
    :param sharding: the fingerprint of the entity sharding the files hold (checked before resharding)
    :returns: this process' file of the new version (None if it writes none)
    :raises ValueError: if ``version`` is not newer than the pointer's
    """
    shard, n_shard, replicas = topology.local_shards[0], topology.n_shard, topology.replicas
    replica = topology.replica if all_replicas else None
    writes = all_replicas or topology.replica == 0
    local = (latest_own_version(path, shard, n_shard, replica, replicas) or 0) if writes else 0
    pointer = read_pointer(path) if topology.is_main_process else None
    committed = int(pointer["version"]) if pointer is not None else 0
    latest, committed = topology.all_reduce(torch.tensor([max(local, committed), committed]), op="max").tolist()
    if version is None:
        version = latest + 1
    elif version <= committed:
        raise ValueError(f"Checkpoint {path} already holds version {committed}; cannot write version {version}.")
    target = shard_file(path, version, shard, n_shard, replica, replicas) if writes else None
    if target is not None:
        temporary = temporary_file(target)
        try:
            write_with_digests(temporary, lambda: write_rank_file(temporary))
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            shutil.rmtree(tables_directory(temporary), ignore_errors=True)
            raise
    topology.barrier()
    if topology.is_main_process:
        if before_pointer is not None:
            before_pointer(version)
        temporary_pointer = temporary_file(path)
        pointer = dict(
            format=POINTER_FORMAT,
            version=version,
            world_size=n_shard,
            replicas=replicas,
            processes=topology.world_size if topology.is_distributed else 1,
            retrieval="all_replicas" if all_replicas else "one_per_group",
            epoch=epoch,
            seed=seed,
            random_seed=random_seed,
            stopper_dict=dict(stopper_dict or {}),
            sharding=sharding,
        )
        write_with_digests(temporary_pointer, lambda: torch.save(pointer, temporary_pointer))
        os.replace(temporary_pointer, path)
    topology.barrier()
    if after_pointer is not None:
        after_pointer(committed)
    if writes:
        logger.info("shard %d wrote checkpoint version %d (epoch %d) to %s", shard, version, epoch, target)
    # no version older than the pointer's is read again: remove them, whichever numbers of shards and
    # replicas wrote them (a resharded run's past included); every process removes what it sees
    for old_file in _older_files(path, version):
        old_file.unlink(missing_ok=True)
        for tables in stale_tables_directories(old_file):
            shutil.rmtree(tables, ignore_errors=True)  # copies of tables in files (storage="mmap")
    remove_abandoned_temporaries(path)  # (of processes killed while writing)
    return target


def remove_shard_files(path: pathlib.Path) -> None:
    """Remove every shard file of the checkpoint ``path`` (any version and layout) and their tables' copies.

    After one process replaced a distributed checkpoint's pointer by its own file, no shard file is read
    again: they would stay beside it, as large as the tables, until ranks wrote the checkpoint again.
    """
    for old_file in _older_files(path, sys.maxsize):
        old_file.unlink(missing_ok=True)
        for tables in stale_tables_directories(old_file):
            shutil.rmtree(tables, ignore_errors=True)


def _older_files(path: pathlib.Path, version: int) -> list[pathlib.Path]:
    """Return the shard files of the checkpoint ``path`` of versions before ``version`` (any layout)."""
    if not path.parent.is_dir():
        return []
    pattern = re.compile(rf"^{re.escape(path.name)}\.v(\d+)\.rank\d+-of-\d+(?:\.replica\d+-of-\d+)?$")
    return [file for file in path.parent.iterdir() if (m := pattern.match(file.name)) and int(m.group(1)) < version]
