"""Storage tiers of the shard tables: where a process keeps its entity tables and their optimizer state.

A BESS step touches a few thousand rows of tables that may hold hundreds of millions, so the
tables need not live where the arithmetic happens. A :class:`TableStorage` (one per process,
chosen with ``training_loop_kwargs=dict(storage=...)``) holds every shard table of the process
and, for the row-sparse optimizer rules, its per-row state:

============ ================================================================================
``storage``  where the tables and their row state live
============ ================================================================================
``"device"`` :class:`DeviceStorage` (default): on the model's device, the tables as parameters
             of the model (as before storage tiers existed)
``"host"``   :class:`HostStorage`: in host memory, not parameters of the model (``model.to``
             does not move them); each step gathers its unique rows to the compute device and
             writes the updated rows and state back. On CUDA the rows pass through pinned,
             double-buffered staging buffers.
``"mmap"``   :class:`MmapStorage`: in ``.npy`` memory maps under ``storage_path``, one file per
             table and state tensor; the operating system pages rows in and out, so tables
             may exceed the machine's memory (resident memory is the page cache, not the
             process' anonymous memory)
============ ================================================================================

Every tier counts the bytes it moves (:class:`StorageTraffic`): reading a step's unique rows of a
table and of each row-state tensor, and writing them back, so a step with ``U`` unique rows of
width ``W`` and ``s`` row-state tensors of the same width moves ``U * W * (1 + s) * 4`` bytes each
way (float32). The arithmetic is the same code in every tier (:mod:`pykeen_bess.optim`), so the
tiers train bitwise alike.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from class_resolver import ClassResolver

from .mapped_files import advise_random, advise_will_need, fsync

__all__ = [
    "DeviceStorage",
    "HostStorage",
    "MmapStorage",
    "StorageTraffic",
    "TableStorage",
    "fsync",
    "make_storage",
    "storage_resolver",
]

logger = logging.getLogger(__name__)

#: numpy dtypes of the torch dtypes a memory-mapped table may have
_NUMPY_DTYPES = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
}


@dataclasses.dataclass
class StorageTraffic:
    """Bytes a storage tier moved: rows read for steps (and evaluation) and rows written back."""

    #: bytes read from the tier (table and row-state rows)
    bytes_read: int = 0
    #: bytes written to the tier
    bytes_written: int = 0

    def reset(self) -> None:
        """Set both counters to zero."""
        self.bytes_read = self.bytes_written = 0


class TableStorage(ABC):
    """Where one process keeps its shard tables and their per-row optimizer state."""

    #: the tier's name (``storage="host"``)
    name: ClassVar[str]
    #: whether the tables are parameters of the model (``model.parameters()``, moved by ``model.to``)
    is_parameter: ClassVar[bool] = False

    def __init__(self) -> None:
        """Create the tier (nothing is allocated until :meth:`place`)."""
        self.traffic = StorageTraffic()
        #: the device the arithmetic runs on (set by the training loop: the model's device)
        self.compute_device = torch.device("cpu")

    # -- allocation ----------------------------------------------------------------------------

    @abstractmethod
    def place(self, label: str, shape: Sequence[int], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
        """Allocate a tensor of ``shape`` filled with ``fill`` in this tier.

        :param label: a name unique among this process' tensors (a file name for :class:`MmapStorage`)
        :param shape: its shape (rows first)
        :param dtype: its dtype
        :param fill: the initial value of every entry
        :returns: the tensor (on the tier's device; for files a view of the memory map)
        """

    def release(self, tensor: torch.Tensor) -> None:  # noqa: B027
        """Forget a tensor placed earlier (e.g. the optimizer state of a replaced optimizer)."""

    def check_capacity(self, num_bytes: int) -> None:  # noqa: B027
        """Raise :class:`MemoryError` with advice if the tier cannot hold ``num_bytes`` more bytes."""

    @property
    def storage_device(self) -> torch.device:
        """The device the tier's tensors live on."""
        return torch.device("cpu")

    # -- row traffic ---------------------------------------------------------------------------

    def read(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Read rows of a tensor of this tier to the compute device.

        :param tensor: shape: ``[R, *]``, a tensor placed by this tier
        :param rows: shape: ``[U]``, row ids (any device)
        :returns: shape: ``[U, *]``, on the compute device (a new tensor)
        """
        rows = rows.to(tensor.device)
        values = self._gather(tensor.detach(), rows)
        self.traffic.bytes_read += values.numel() * values.element_size()
        return values

    def read_slice(self, tensor: torch.Tensor, rows: slice) -> torch.Tensor:
        """Read a contiguous range of rows to the compute device (a view where it is already there).

        :returns: shape: ``[stop - start, *]``
        """
        values = tensor.detach()[rows].to(self.compute_device)
        self.traffic.bytes_read += values.numel() * values.element_size()
        return values

    def write(self, tensor: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows of a tensor of this tier (the inverse of :meth:`read`).

        :param tensor: shape: ``[R, *]``
        :param rows: shape: ``[U]``, unique row ids
        :param values: shape: ``[U, *]``, on any device
        """
        self.traffic.bytes_written += values.numel() * values.element_size()
        tensor.index_copy_(0, rows.to(tensor.device), values.to(tensor.device, tensor.dtype))

    def _gather(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return tensor.index_select(0, rows).to(self.compute_device)

    def flush(self) -> None:  # noqa: B027
        """Make every write durable where the tier has a durable medium (files)."""

    def describe(self) -> str:
        """Describe the tier for logs."""
        return self.name


class DeviceStorage(TableStorage):
    """The tables as parameters of the model on its device (the default)."""

    name = "device"
    is_parameter = True

    @property
    def storage_device(self) -> torch.device:  # noqa: D102
        return self.compute_device

    def _gather(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return tensor.index_select(0, rows)  # on the device the arithmetic runs on

    def place(self, label: str, shape: Sequence[int], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:  # noqa: D102
        return torch.full(tuple(shape), fill, dtype=dtype, device=self.compute_device)

    def check_capacity(self, num_bytes: int) -> None:  # noqa: D102
        if self.compute_device.type != "cuda":
            _check_host_memory(num_bytes, self.name)
            return
        free, _ = torch.cuda.mem_get_info(self.compute_device)
        if num_bytes > free:
            raise MemoryError(
                f"The shard tables and their optimizer state need {format_bytes(num_bytes)} on "
                f"{self.compute_device}, which has {format_bytes(free)} free. Keep them in host memory "
                f"(storage='host') or in files (storage='mmap'), use optimizer='rowwise_adagrad' (one float of state "
                f"per row), or use more shards."
            )


class HostStorage(TableStorage):
    """The tables in host memory; each step's rows move to the compute device and back.

    With a CUDA compute device, reads go through two pinned staging buffers used in turn: a
    buffer is refilled only after the device copy from it has completed (a CUDA event), and
    write-backs complete before :meth:`write` returns, so the next step's reads never see rows
    older than the last update.
    """

    name = "host"

    def __init__(self) -> None:
        """Create the tier."""
        super().__init__()
        self._staging: list[torch.Tensor | None] = [None, None]
        self._events: list[Any] = [None, None]
        self._turn = 0

    def place(self, label: str, shape: Sequence[int], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:  # noqa: D102
        return torch.full(tuple(shape), fill, dtype=dtype)

    def check_capacity(self, num_bytes: int) -> None:  # noqa: D102
        _check_host_memory(num_bytes, self.name)

    def _gather(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if self.compute_device.type != "cuda":
            return tensor.index_select(0, rows)
        # pinned, double-buffered staging (pinning needs CUDA: never on a CPU-only build)
        turn = self._turn
        self._turn = 1 - turn
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # the previous copy out of this buffer has finished
        num_bytes = rows.numel() * tensor[0].numel() * tensor.element_size()
        buffer = self._staging[turn]
        if buffer is None or buffer.numel() < num_bytes:
            buffer = torch.empty(max(num_bytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
            self._staging[turn] = buffer
        staged = buffer[:num_bytes].view(tensor.dtype).view(rows.numel(), *tensor.shape[1:])
        torch.index_select(tensor, 0, rows, out=staged)
        result = staged.to(self.compute_device, non_blocking=True)
        recorded = torch.cuda.Event()
        recorded.record()
        self._events[turn] = recorded
        return result


class MmapStorage(TableStorage):
    """The tables in ``.npy`` memory maps, one file per table and state tensor, under ``storage_path``.

    Files are created (never silently overwritten: an existing file raises unless
    ``overwrite=True``; a training loop places such tensors beside the existing file until it
    knows whether it resumes a checkpoint, see :meth:`claim_existing`) and filled in chunks, so no
    step of the allocation holds a whole table in anonymous memory. :meth:`flush` writes the dirty
    pages to disk; checkpoints copy the files.
    """

    name = "mmap"

    def __init__(self, storage_path: str | os.PathLike | None = None, overwrite: bool = False) -> None:
        """Keep the tables under ``storage_path``.

        :param storage_path: an existing, writable directory
        :param overwrite: replace files of an earlier run with the same names
        :raises ValueError: if no path is given
        :raises FileNotFoundError: if the path is not a directory
        :raises PermissionError: if it is not writable
        """
        super().__init__()
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
        self.path = path
        self.overwrite = bool(overwrite)
        #: place tensors whose file exists beside it, until :meth:`claim_existing` decides (a training loop
        #: knows only when training starts whether it resumes a checkpoint, whose files these are)
        self.defer_existing = False
        #: the existing file each deferred tensor replaces, by the id of its storage
        self.deferred: dict[int, pathlib.Path] = {}
        #: the file of every placed tensor, by the id of its storage
        self.files: dict[int, pathlib.Path] = {}
        self._arrays: dict[int, np.memmap] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the memory maps (a pickled model holds its tables' values as plain tensors)."""
        state = dict(self.__dict__)
        state["files"], state["_arrays"] = {}, {}
        return state

    def place(self, label: str, shape: Sequence[int], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:  # noqa: D102
        if dtype not in _NUMPY_DTYPES:
            raise TypeError(f"storage='mmap' supports {sorted(map(str, _NUMPY_DTYPES))} tables, not {dtype}.")
        file = target = self.path / f"{label}.npy"
        if file.exists() and not self.overwrite:
            if not self.defer_existing:
                raise FileExistsError(_exists_message(file))
            file = file.with_name(f"{file.name}.new-{os.getpid()}")  # beside it; the existing file stays
        array = np.lib.format.open_memmap(file, mode="w+", dtype=_NUMPY_DTYPES[dtype], shape=tuple(shape))
        advise_random(array)
        if fill != 0:  # a new file reads as zeros
            step = _chunk_rows(array)
            for start in range(0, array.shape[0], step):
                array[start : start + step] = fill
        tensor = torch.from_numpy(array)
        self.files[_key(tensor)] = file
        self._arrays[_key(tensor)] = array
        if file != target:
            self.deferred[_key(tensor)] = target
        return tensor

    def claim_existing(self, resuming: bool) -> None:
        """Decide about the existing files the tensors were placed beside (see :attr:`defer_existing`).

        :param resuming: a checkpoint is being resumed: the files are its run's, and are replaced (the
            checkpoint's copies then fill the tables); else the placed files are removed and the files
            of the earlier run are refused as without deferring
        :raises FileExistsError: if there are such files and no checkpoint is resumed
        """
        deferred, self.deferred = self.deferred, {}
        if not deferred:
            return
        if resuming:
            for key, target in deferred.items():
                os.replace(self.files[key], target)  # the memory map stays valid: it maps the file, not its name
                self.files[key] = target
            logger.info("storage='mmap': resuming a checkpoint, its run's files under %s are replaced.", self.path)
            return
        for key in deferred:
            self.files[key].unlink(missing_ok=True)
        raise FileExistsError(
            f"{_exists_message(min(deferred.values()))} No checkpoint is being resumed (train(checkpoint_name=...) "
            f"with an existing checkpoint would resume it and reuse the files)."
        )

    def release(self, tensor: torch.Tensor) -> None:  # noqa: D102
        file = self.files.pop(_key(tensor), None)
        self._arrays.pop(_key(tensor), None)
        self.deferred.pop(_key(tensor), None)
        if file is not None:
            file.unlink(missing_ok=True)

    def file_of(self, tensor: torch.Tensor) -> pathlib.Path:
        """Return the file a tensor of this tier is mapped from."""
        try:
            return self.files[_key(tensor)]
        except KeyError:
            raise ValueError("The tensor was not placed by this storage.") from None

    def check_capacity(self, num_bytes: int) -> None:  # noqa: D102
        free = shutil.disk_usage(self.path).free
        if num_bytes > free:
            raise MemoryError(
                f"The shard tables and their optimizer state need {format_bytes(num_bytes)} of disk under "
                f"{self.path}, which has {format_bytes(free)} free. Use a larger disk, "
                f"optimizer='rowwise_adagrad' (one float of state per row), or spread the shards over more machines."
            )

    def read_slice(self, tensor: torch.Tensor, rows: slice) -> torch.Tensor:
        """Read consecutive rows, asking the kernel to read the whole range ahead (else it reads page by page)."""
        array = self._arrays.get(_key(tensor))
        if array is not None and rows.stop > rows.start:
            advise_will_need(array, rows.start, rows.stop)
        return super().read_slice(tensor, rows)

    def snapshot(self, tensor: torch.Tensor, directory: pathlib.Path) -> str:
        """Copy a tensor's file into ``directory`` (flushed and synced first, the copy synced); return its name."""
        source = self.file_of(tensor)
        self._arrays[_key(tensor)].flush()
        target = pathlib.Path(directory) / source.name
        shutil.copyfile(source, target)
        fsync(target)
        return source.name

    def restore(self, tensor: torch.Tensor, file: pathlib.Path) -> None:
        """Overwrite a tensor of this tier from a ``.npy`` file, chunk by chunk (the memory map stays valid)."""
        if not file.is_file():
            raise FileNotFoundError(f"The checkpoint's table file {file} is missing.")
        source = np.load(file, mmap_mode="r")
        if tuple(source.shape) != tuple(tensor.shape) or source.dtype != _NUMPY_DTYPES[tensor.dtype]:
            raise ValueError(
                f"{file} holds {source.dtype} {source.shape}, expected {tensor.dtype} {tuple(tensor.shape)}."
            )
        target = self._arrays[_key(tensor)]
        if os.path.samefile(file, self.file_of(tensor)):
            return
        step = _chunk_rows(target)
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


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _chunk_rows(array: Any, chunk_bytes: int = 64 << 20) -> int:
    """Rows per chunk of about ``chunk_bytes`` for chunked copies and fills."""
    row_bytes = max(int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize, 1)
    return max(chunk_bytes // row_bytes, 1)


def format_bytes(num_bytes: float) -> str:
    """Return a byte count in the largest binary unit it fills at least once (``"1.50 GiB"``, ``"12.00 KiB"``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{int(num_bytes)} B"


def available_host_memory() -> int | None:
    """Return the bytes of host memory available to new allocations (``MemAvailable``), None if unknown."""
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_host_memory(num_bytes: int, tier: str) -> None:
    available = available_host_memory()
    if available is not None and num_bytes > available:
        raise MemoryError(
            f"The shard tables and their optimizer state need {format_bytes(num_bytes)} of host memory "
            f"(storage={tier!r}), {format_bytes(available)} are available. Keep them in files (storage='mmap', "
            f"storage_path=...), use optimizer='rowwise_adagrad' (one float of state per row), or use more shards "
            f"over more machines."
        )


#: resolves ``storage=`` names (``"device"``, ``"host"``, ``"mmap"``) and classes
storage_resolver: ClassResolver[TableStorage] = ClassResolver(
    [DeviceStorage, HostStorage, MmapStorage],
    base=TableStorage,  # type: ignore[type-abstract]
    suffix="Storage",
)


def _exists_message(file: pathlib.Path) -> str:
    return (
        f"{file} exists (from an earlier run?). Remove it, use another storage_path, or pass "
        f"storage_kwargs=dict(overwrite=True)."
    )


def make_storage(
    storage: Any = None, storage_path: str | os.PathLike | None = None, storage_kwargs: Mapping[str, Any] | None = None
) -> TableStorage:
    """Resolve ``storage=`` (a name, a class, an instance or None for the device) with its arguments.

    :raises ValueError: for an unknown name, or a ``storage_path`` given to a tier without files
    """
    if isinstance(storage, TableStorage):
        return storage
    kwargs = dict(storage_kwargs or {})
    try:
        cls = storage_resolver.lookup(storage if storage is not None else "device")
    except (KeyError, ValueError, TypeError):
        raise ValueError(
            f"Unknown storage={storage!r}; expected one of {sorted(storage_resolver.lookup_dict)} "
            f"(or a TableStorage class)."
        ) from None
    if storage_path is not None:
        if cls is not MmapStorage:
            raise ValueError(f"storage_path is the directory of storage='mmap'; storage={cls.name!r} keeps no files.")
        kwargs["storage_path"] = storage_path
    return cls(**kwargs)
