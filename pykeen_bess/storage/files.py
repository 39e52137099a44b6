"""The file tier: the tables in ``.npy`` memory maps, their locks and their runs' marks (kernel side: :mod:`.disk`)."""

from __future__ import annotations

import dataclasses
import gc
import logging

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]
import numbers
import os
import pathlib
import shutil
import weakref
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from .digests import crc32_of_file
from .marks import checkpoints_of, decide, exists_message, mark, marker
from .disk import advise_random, advise_will_need, fsync, reserve_blocks
from .base import NUMPY_DTYPES, TableStorage, chunk_rows, format_bytes, open_source

__all__ = ["MmapStorage"]

logger = logging.getLogger(__name__)


class MmapStorage(TableStorage):
    """The tables in ``.npy`` memory maps, one file per table and state tensor, under ``storage_path``.

    Files are created (never silently overwritten: an existing file raises unless
    ``overwrite=True``; a training loop places such tensors beside the existing file until it
    knows whether it resumes a checkpoint, see :meth:`claim_existing`) and filled in chunks, so no
    step of the allocation holds a whole table in anonymous memory. :meth:`flush` writes the dirty
    pages to disk; checkpoints copy the files.
    """

    name = "mmap"
    keeps_files = True
    #: the checkpoint of the run whose files these are (set when training starts; None: none; a class
    #: default, which tiers pickled earlier also read)
    owner: str | None = None
    #: the other checkpoints the run wrote (failure checkpoints) or resumed: resuming any of them takes the
    #: files over (a class default, as :attr:`owner`)
    history: tuple[str, ...] = ()
    #: why the files were refused (the placed ones are removed: the tables map no
    #: file under ``storage_path`` any more, so no later training of this storage may start), or None (a class
    #: default, as :attr:`owner`)
    refused: str | None = None

    def __init__(self, storage_path: str | os.PathLike | None = None, overwrite: bool = False) -> None:
        """Keep the tables under ``storage_path``.

        :param storage_path: an existing, writable directory
        :param overwrite: replace files of an earlier run with the same names
        :raises ValueError: if no path is given, or ``overwrite`` is not True or False (a string such as ``"no"``
            would count as true and replace the files)
        :raises FileNotFoundError: if the path is not a directory
        :raises PermissionError: if it is not writable
        """
        super().__init__()
        if not isinstance(overwrite, bool | numbers.Integral) or overwrite not in (0, 1):
            raise ValueError(f"overwrite must be True or False, not {overwrite!r}.")
        if storage_path is None:
            raise ValueError(
                "storage='mmap' keeps the tables in files: pass storage_path='/a/directory' (command line: "
                "--storage-path), on a disk with room for the tables and their optimizer state."
            )
        path = pathlib.Path(storage_path)
        if not path.is_dir():
            raise FileNotFoundError(f"storage_path={str(path)!r} is not a directory; create it first.")
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"storage_path={str(path)!r} is not writable.")
        #: the directory, absolute: a later change of the working directory (a notebook, a tool) moves no file
        self.path = path.resolve()
        self.overwrite = bool(overwrite)
        #: place tensors whose file exists beside it, until :meth:`claim_existing` decides (a training loop
        #: knows only when training starts whether it resumes a checkpoint, whose files these are)
        self.defer_existing = False
        #: the existing file each deferred tensor replaces, by the id of its storage
        self.deferred: dict[int, pathlib.Path] = {}
        #: the file of every placed tensor, by the id of its storage
        self.files: dict[int, pathlib.Path] = {}
        self._arrays: dict[int, np.memmap] = {}
        #: the files placed for the training loop being built or trained (since :meth:`defer_existing_files`), by
        #: the id of their storage: a refusal or a failed build removes only these
        self.of_this_loop: set[int] = set()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the memory maps (a pickled model holds its tables' values as plain tensors)."""
        state = dict(self.__dict__)
        state["files"], state["_arrays"] = {}, {}
        return state

    def place(self, label: str, shape: Sequence[int], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:  # noqa: D102
        if dtype not in NUMPY_DTYPES:
            raise TypeError(f"storage='mmap' supports {sorted(map(str, NUMPY_DTYPES))} tables, not {dtype}.")
        file = target = self.path / f"{label}.npy"
        if target.exists():  # refused while another process maps it, or another model here maps what overwrite rewrites
            hold_for_this_process(target, self, in_place=self.overwrite)
        if file.exists() and not self.overwrite:
            if not self.defer_existing:
                _unmapped(str(target), None)  # (its lock, if nothing here maps it)
                raise FileExistsError(exists_message(file))
            file = file.with_name(f"{file.name}.new-{os.getpid()}")  # beside it; the existing file stays
        array = np.lib.format.open_memmap(file, mode="w+", dtype=NUMPY_DTYPES[dtype], shape=tuple(shape))
        try:
            reserve_blocks(file, target.name)
        except (OSError, MemoryError):
            del array
            file.unlink(missing_ok=True)
            _unmapped(str(target), None)  # (the lock taken on an existing file, if nothing here maps it)
            raise
        advise_random(array)
        if fill != 0:  # a new file reads as zeros
            step = chunk_rows(array)
            for start in range(0, array.shape[0], step):
                array[start : start + step] = fill
        if file == target:
            hold_for_this_process(target, self, in_place=True)  # (a file truncated in place keeps its lock)
            mark(target, self.owner, self.history)  # (optimizer state placed anew once training started)
        mapped_by(target, array, self)  # (the existing file's lock, for a file placed beside it)
        tensor = torch.from_numpy(array)
        self.files[_key(tensor)] = file
        self._arrays[_key(tensor)] = array
        self.of_this_loop.add(_key(tensor))
        if file != target:
            self.deferred[_key(tensor)] = target
        return tensor

    def defer_existing_files(self) -> None:  # noqa: D102
        self.defer_existing = True
        self.of_this_loop = set()  # (a storage handed to another loop keeps the earlier loop's files)

    def _entry_values(self, tensors: dict[str, torch.Tensor], directory: pathlib.Path | None) -> dict[str, Any]:
        """Name the files' copies in ``directory`` (in a checkpoint), else hold the tensors themselves.

        Outside a checkpoint a state dict holds values, as any module's does: a copy of it (an early stopper's
        best epoch, a user's snapshot, ``torch.save``) keeps today's values whatever the files hold later.
        The tensors are views of the memory maps: the state dict itself copies nothing.
        """
        if directory is None:
            return {"tensors": tensors}
        copies = {key: self.snapshot(value, directory) for key, value in tensors.items()}
        return {
            "files": {key: name for key, (name, _) in copies.items()},
            "directory": directory.name,
            # the CRC-32 of each copy's bytes, checked before a checkpoint is resumed (storage.digests)
            "digests": {key: digest for key, (_, digest) in copies.items()},
        }

    def claim_existing(
        self, resuming: bool, checkpoint: pathlib.Path | None = None, agree: Callable[[bool], bool] | None = None
    ) -> None:
        """Decide about the existing files the tensors were placed beside (see :attr:`defer_existing`).

        A run marks its files with the checkpoints it writes (``FILE.checkpoint`` beside each: the checkpoint
        it writes, then the failure checkpoints it wrote and the checkpoints it resumed), so that the same
        command run again after a crash before its first checkpoint takes them over (else they would be an
        earlier run's, refused), and so that resuming a checkpoint replaces only its own run's files.

        :param resuming: a checkpoint is being resumed: the files are replaced if they are its run's (the
            checkpoint's copies then fill the tables), else refused; not resuming, the placed files are
            removed and the files of the earlier run are refused as without deferring, unless all are marked
            as written by a run of ``checkpoint``
        :param checkpoint: the checkpoint this run writes or resumes (None: none)
        :param agree: returns whether its argument holds on every process (one collective, called on every
            process): the processes refuse together, so that none replaces its files (or trains, waiting for
            the others at a collective) while another refuses (None: this process decides alone)
        :raises FileExistsError: if there are such files and they are not the resumed checkpoint's run's (or
            no checkpoint is resumed), if another process refuses its files, or if the files were refused
            before (see :attr:`refused`)
        """
        if self.refused is not None:
            raise FileExistsError(self.refused)
        deferred, self.deferred = self.deferred, {}
        owner = None if checkpoint is None else str(pathlib.Path(checkpoint).resolve())
        marks = {key: checkpoints_of(target) for key, target in deferred.items()}
        refusal, resuming = decide(deferred, marks, owner, resuming, self.path)
        if agree is not None and not agree(refusal is None) and refusal is None:
            refusal = (
                f"Another process refused its table files (its error names them); this process' files under "
                f"{self.path} are left as they were."
            )
        if refusal is not None:
            self._refuse(deferred, refusal)
        self._claim(deferred)
        self.owner = owner
        earlier = [c for m in marks.values() for c in m if c] if resuming else []
        self.history = tuple(dict.fromkeys(c for c in earlier if c != owner))
        for file in self.files.values():  # this run's files now
            mark(file, owner, self.history)

    def checkpoint_written(self, checkpoint: pathlib.Path) -> None:  # noqa: D102
        path = str(pathlib.Path(checkpoint).resolve())
        if path != self.owner and path not in self.history:  # a failure checkpoint: resuming it takes the files
            self.history = (*self.history, path)
            for file in self.files.values():
                mark(file, self.owner, self.history)

    def _claim(self, deferred: dict[int, pathlib.Path]) -> None:
        """Replace the existing files by the placed ones (a checkpoint of their run is resumed)."""
        if not deferred:
            return
        for key, target in deferred.items():
            os.replace(self.files[key], target)  # the memory map stays valid: it maps the file, not its name
            self.files[key] = target
            hold_for_this_process(target, self, renew=True)  # the lock of the file now under the name
            mapped_by(target, self._arrays[key], self)
        logger.info("storage='mmap': resuming a checkpoint, its run's files under %s are replaced.", self.path)

    def _refuse(self, deferred: dict[int, pathlib.Path], message: str) -> NoReturn:
        """Remove every file this run placed (the existing ones stay as they are) and raise ``message``.

        Those beside existing files, and those placed under names no file had (an optimizer state the earlier
        run did not keep): left there, a later run would take them for the earlier run's.
        """
        self._remove_placed(deferred)
        self.refused = (
            f"{message} (This model's table files were refused by an earlier train() call and removed: build the "
            "model and the training loop again.)"
        )
        raise FileExistsError(message)

    def discard(self) -> None:  # noqa: D102
        # (only the failed loop's files: an earlier loop handed the same storage keeps training on its own)
        deferred, self.deferred = self.deferred, {}
        self._remove_placed(deferred)

    def _remove_placed(self, deferred: dict[int, pathlib.Path]) -> None:
        """Remove the files placed for this loop; ``deferred``: the existing files some were placed beside (kept)."""
        for key in [key for key in self.files if key in self.of_this_loop]:
            file = self.files.pop(key)
            self._arrays.pop(key, None)
            if key in deferred:
                _unmapped(str(deferred[key]), None)  # the earlier run's file: this process does not map it
            else:
                lock = _HELD.pop(str(file), None)
                if lock is not None:
                    os.close(lock.descriptor)
                marker(file).unlink(missing_ok=True)
            file.unlink(missing_ok=True)

    def release(self, tensor: torch.Tensor) -> None:  # noqa: D102
        file = self.files.pop(_key(tensor), None)
        self._arrays.pop(_key(tensor), None)
        self.deferred.pop(_key(tensor), None)
        if file is not None:
            lock = _HELD.pop(str(file), None)
            if lock is not None:  # (an open descriptor would keep the removed file's blocks)
                os.close(lock.descriptor)
            file.unlink(missing_ok=True)
            marker(file).unlink(missing_ok=True)

    def file_of(self, tensor: torch.Tensor) -> pathlib.Path:
        """Return the file a tensor of this tier is mapped from."""
        try:
            return self.files[_key(tensor)]
        except KeyError:
            raise ValueError("The tensor was not placed by this storage.") from None

    def check_capacity(self, num_bytes: int, device: torch.device) -> None:  # noqa: D102
        free = shutil.disk_usage(self.path).free
        if num_bytes > free:
            existing = sum(file.stat().st_size for file in self.path.glob("*.npy"))
            beside = (
                f" The {format_bytes(existing)} of .npy files already there stay until training decides whether it "
                f"resumes them (a resumed run places its files beside them, then replaces them): another "
                f"storage_path, or removing the files, frees that."
                if existing and not self.overwrite
                else ""
            )
            raise MemoryError(
                f"The shard tables and their optimizer state need {format_bytes(num_bytes)} of disk under "
                f"{self.path}, which has {format_bytes(free)} free. Use a larger disk, "
                f"optimizer='rowwise_adagrad' (one float of state per row), or spread the shards over more machines."
                f"{beside}"
            )

    def read_slice(self, tensor: torch.Tensor, rows: slice) -> torch.Tensor:
        """Read consecutive rows, asking the kernel to read the whole range ahead (else it reads page by page)."""
        array = self._arrays.get(_key(tensor))
        if array is not None and rows.stop > rows.start:
            advise_will_need(array, rows.start, rows.stop)
        return super().read_slice(tensor, rows)

    def snapshot(self, tensor: torch.Tensor, directory: pathlib.Path) -> tuple[str, int]:
        """Copy a tensor's file into ``directory`` (flushed first, the copy synced); return its name and CRC-32."""
        source = self.file_of(tensor)
        self._arrays[_key(tensor)].flush()
        target = pathlib.Path(directory) / source.name
        with ThreadPoolExecutor(1) as pool:  # the digest of the flushed file beside the kernel's copy of it
            digest = pool.submit(crc32_of_file, source)
            shutil.copyfile(source, target)
            fsync(target)
            return source.name, digest.result()

    def restore(self, tensor: torch.Tensor, file: pathlib.Path) -> None:
        """Overwrite a tensor of this tier from a ``.npy`` file, chunk by chunk (the memory map stays valid)."""
        source = open_source(file, tensor)
        target = self._arrays[_key(tensor)]
        if os.path.samefile(file, self.file_of(tensor)):
            return
        step = chunk_rows(target)
        for start in range(0, target.shape[0], step):
            target[start : start + step] = source[start : start + step]
        target.flush()

    def flush(self) -> None:  # noqa: D102
        for array in self._arrays.values():
            array.flush()
        for file in self.files.values():
            fsync(file)

    def describe(self) -> str:  # noqa: D102
        return f"mmap ({self.path})"


@dataclasses.dataclass(eq=False)
class _Lock:
    """The lock of a table file this process maps: its descriptor, and the arrays mapping the file."""

    descriptor: int
    #: the storage that placed each array of this process that maps the file (by the array's id)
    arrays: dict[int, weakref.ref[MmapStorage]] = dataclasses.field(default_factory=dict)

    def mapped_by_another(self, storage: MmapStorage) -> bool:
        """Whether an array another storage placed maps the file (a storage gone, its tables still used: another)."""
        return any(holder() is not storage for holder in self.arrays.values())


#: the table files the storages of this process map, and their locks (held while an array maps the file)
_HELD: dict[str, _Lock] = {}


def hold_for_this_process(
    file: pathlib.Path, storage: MmapStorage, renew: bool = False, in_place: bool = False
) -> None:
    """Hold an exclusive lock (``flock``) on a table file while this process maps it (:func:`mapped_by`).

    Another process placing the same table (a second run started with the same ``storage_path``, e.g. the
    same checkpointed command twice) is refused before it touches the files: resuming would otherwise move
    its new files over the names the running process maps and snapshots into its checkpoints. So is another
    storage of this process rewriting the file in place (``overwrite=True``) while the tables of the first one
    are alive (a second run in a notebook while the first run's model is kept): it would rewrite the first
    model's rows, or shrink the file under its memory maps (which kills the process). (Files a resumed run
    moves over the names are new files: the first model keeps mapping its own.) The lock goes when no array
    maps the file any more (the model and its storage were collected), and with the process (also when it is
    killed). Where the platform has no ``fcntl`` (Windows) nothing is locked.

    :param file: an existing table file
    :param storage: the storage placing it
    :param renew: lock the file now under the name (another file replaced the locked one)
    :param in_place: the storage writes this file itself (not a new file moved over the name later)
    :raises RuntimeError: if another process holds the lock, or, ``in_place``, another storage's tables of this
        process map the file
    """
    if fcntl is None:
        return
    enabled = gc.isenabled()
    gc.disable()  # no finalizer lets go of this file's lock meanwhile (it would close a descriptor replaced here)
    try:
        _hold(file, storage, renew, in_place)
    finally:
        if enabled:
            gc.enable()


def _hold(file: pathlib.Path, storage: MmapStorage, renew: bool, in_place: bool) -> None:
    """Take (or renew) the lock of :func:`hold_for_this_process`, the garbage collector disabled."""
    key = str(file)
    lock = _HELD.get(key)
    if in_place and lock is not None and lock.mapped_by_another(storage):
        gc.collect()  # an earlier run's loop and model in reference cycles, unreachable but not yet collected
        lock = _HELD.get(key)
    if in_place and lock is not None and lock.mapped_by_another(storage):
        raise RuntimeError(
            f"{file} is in use by another model's tables in this process (a second run with the same "
            f"storage_path while the first run's model is alive?): writing it would change that model's rows. "
            f"Give this run another storage_path, or drop the other model first (del result; gc.collect())."
        )
    if lock is not None and not renew:
        return
    descriptor = os.open(file, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise RuntimeError(
            f"{file} is in use by another process (a second run with the same storage_path?): one process at a "
            f"time may train a table in files. Wait for the other run, or give this one another storage_path."
        ) from None
    _HELD[key] = _Lock(descriptor)  # (renewed: the arrays of the replaced file do not map this one)
    if lock is not None:
        os.close(lock.descriptor)


def mapped_by(file: pathlib.Path, array: np.memmap, storage: MmapStorage) -> None:
    """Keep the lock of a table file while ``array`` maps it (the array's tensors and the storage hold it)."""
    lock = _HELD.get(str(file))
    if lock is None:  # nothing locked (no fcntl)
        return
    lock.arrays[id(array)] = weakref.ref(storage)
    weakref.finalize(array, _unmapped, str(file), id(array))


def _unmapped(key: str, array_id: int | None) -> None:
    """Let go of a table file's lock when the last array of this process mapping it is gone (None: none did)."""
    lock = _HELD.get(key)
    if lock is None or (array_id is not None and lock.arrays.pop(array_id, None) is None) or lock.arrays:
        return
    del _HELD[key]
    os.close(lock.descriptor)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
