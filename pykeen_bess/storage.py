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
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from class_resolver import ClassResolver
from torch import nn

from .mapped_files import advise_random, advise_will_need, fsync

__all__ = [
    "DeviceStorage",
    "HeldTable",
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


class HeldTable(Protocol):
    """What a tier reads and writes of a table it holds (a :class:`~pykeen_bess.representation.ShardedEmbedding`)."""

    #: the tier's name of the table's tensors
    label: str
    #: shape: ``[R, W]``, the table
    weight: torch.Tensor
    #: what stands for a table outside the model in the optimizer (it carries the step count)
    handle: nn.Parameter
    #: the row-sparse gradient of a table outside the model (a parameter's is its ``grad``)
    stored_gradient: torch.Tensor | None
    #: the row rule's state tensors of a table outside the model, by name
    row_state: dict[str, torch.Tensor]


class TableStorage(ABC):
    """Where one process keeps its shard tables and their per-row optimizer state.

    The base class keeps the tables *outside the model*: plain tensors of the tier that neither
    ``model.parameters()`` nor ``model.to()`` sees, with the row rule's state beside them and a
    row-sparse gradient set by the step. :class:`DeviceStorage` overrides the methods under "how a
    table is held" to make the tables parameters of the model instead. Callers ask the tier what
    they need (:meth:`create_table`, :meth:`gradient`, :meth:`row_state`, ...), so a new tier is
    one new class.
    """

    #: the tier's name (``storage="host"``)
    name: ClassVar[str]
    #: whether the tables live in files (checkpoints copy them, see :meth:`MmapStorage.snapshot`)
    keeps_files: ClassVar[bool] = False
    #: whether training copies the shard tables back into the model's full embedding afterwards (else
    #: the model keeps the shard tables: a full table on the model's device is what the tier avoids)
    copies_back_after_training: ClassVar[bool] = False

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

    # -- how a table is held -------------------------------------------------------------------

    def create_table(
        self, label: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, trainable: bool
    ) -> torch.Tensor:
        """Allocate a table (zeros): a tensor of this tier, not a parameter of the model.

        :param label: the table's name among the tier's tensors
        :param shape: ``[R, W]``
        :param dtype: its dtype
        :param device: the model's device (where a parameter would live)
        :param trainable: whether the table is trained
        """
        return self.place(label, shape, dtype)

    def attach_index(self, module: nn.Module, name: str, index: torch.Tensor) -> None:
        """Keep an index tensor of a table beside the table (a plain attribute: ``model.to`` leaves both)."""
        setattr(module, name, index)

    def table_device(self, table: HeldTable) -> torch.device:
        """Return the device a table's rows are read to and scored on."""
        return self.compute_device

    def optimizer_parameter(self, table: HeldTable) -> nn.Parameter:
        """Return what stands for a table in the optimizer's parameter groups: its handle."""
        return table.handle

    def gradient(self, table: HeldTable) -> torch.Tensor | None:
        """Return the table's row-sparse gradient ``[R, W]`` (None before a step)."""
        return table.stored_gradient

    def set_gradient(self, table: HeldTable, value: torch.Tensor | None) -> None:
        """Set the table's row-sparse gradient."""
        table.stored_gradient = value

    def clear_gradient(self, table: HeldTable) -> None:
        """Forget the table's gradient (``optimizer.zero_grad`` clears parameters' gradients only)."""
        table.stored_gradient = None

    def lookup_rows(self, weight: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
        """Rows of a table as scoring sees them: ``[U, W]`` on the compute device.

        Here copies read through the tier (counted); the device tier: differentiable rows of the parameter.
        """
        if isinstance(rows, slice):
            return self.read_slice(weight, rows)
        return self.read(weight, rows)

    def draws_in_chunks(self, num_bytes: int, limit: int) -> bool:
        """Whether a table whose full table has ``num_bytes`` is initialised chunk by chunk (above ``limit``)."""
        return num_bytes > limit

    def row_state(self, table: HeldTable, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """Return the dictionary that holds a table's row-rule state: the table's own, in this tier."""
        return table.row_state

    def reset_row_state(self, table: HeldTable, shapes: Mapping[str, tuple[Sequence[int], float]]) -> None:
        """Place fresh row-rule state for a table (releasing the old): ``{name: (shape, fill)}``."""
        for tensor in table.row_state.values():
            self.release(tensor)
        table.row_state.clear()
        for name, (shape, fill) in shapes.items():
            table.row_state[name] = self.place(f"{table.label}.{name}", shape, table.weight.dtype, fill)

    def release_table(self, table: HeldTable) -> None:
        """Give a table's tensors and row state back to the tier (files: delete them)."""
        for tensor in table.row_state.values():
            self.release(tensor)
        table.row_state.clear()
        self.release(table.weight)

    def check_updates(self, sparse_updates: bool) -> None:
        """Raise :class:`ValueError` if the tier cannot hold tables updated this way."""
        if not sparse_updates:
            raise ValueError(
                f"storage={self.name!r} needs row-sparse updates (sparse_updates=True): a dense update "
                f"would touch every row of the tables every step."
            )

    def check_meta_model(self) -> None:  # noqa: B027
        """Raise :class:`ValueError` if the tier cannot train a model built on the meta device."""

    def captured_step_obstacle(self) -> str | None:
        """Why a captured (static) step cannot hold these tables, None if it can."""
        return f"it keeps the tables on the device (storage={self.name!r})"

    def column_parts_obstacle(self) -> str | None:
        """Why tables of this tier cannot be split into column parts over processes, None if they can."""
        return f"storage={self.name!r}"

    def state_entry(self, table: HeldTable, directory: pathlib.Path | None, omit_weight: bool) -> dict[str, Any] | None:
        """Return what a state dict holds of a table outside the model: its tensors (and row state).

        :param table: the table
        :param directory: while a checkpoint is written, the directory its file copies go to
        :param omit_weight: leave the rows out (a checkpoint whose own files hold them)
        :returns: the entry (None: the table is a parameter, already in the state dict)
        """
        tensors = {"weight": table.weight, **{f"state.{name}": value for name, value in table.row_state.items()}}
        if omit_weight:
            del tensors["weight"]
        return {
            "tier": self.name,
            "label": table.label,
            "shape": tuple(table.weight.shape),
            **self._entry_values(tensors, directory),
        }

    def _entry_values(self, tensors: dict[str, torch.Tensor], directory: pathlib.Path | None) -> dict[str, Any]:
        return {"tensors": tensors}

    def restore(self, tensor: torch.Tensor, file: pathlib.Path) -> None:
        """Overwrite a tensor of this tier from a ``.npy`` file (a checkpoint's copy), chunk by chunk."""
        source = _open_source(file, tensor)
        step = _chunk_rows(source)
        with torch.no_grad():
            for start in range(0, source.shape[0], step):
                tensor[start : start + step].copy_(torch.from_numpy(np.ascontiguousarray(source[start : start + step])))

    def defer_existing_files(self) -> None:  # noqa: B027
        """Place tensors whose file exists beside it until :meth:`claim_existing` decides (tiers with files)."""

    def claim_existing(self, resuming: bool) -> None:  # noqa: B027
        """Decide about existing files the tensors were placed beside (tiers with files)."""


class DeviceStorage(TableStorage):
    """The tables as parameters of the model on its device (the default)."""

    name = "device"
    copies_back_after_training = True

    @property
    def storage_device(self) -> torch.device:  # noqa: D102
        return self.compute_device

    def create_table(  # noqa: D102
        self, label: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, trainable: bool
    ) -> torch.Tensor:
        return nn.Parameter(torch.zeros(tuple(shape), dtype=dtype, device=device), requires_grad=trainable)

    def attach_index(self, module: nn.Module, name: str, index: torch.Tensor) -> None:
        """Keep an index tensor as a buffer of the module: ``model.to`` moves it with the table."""
        module.register_buffer(name, index, persistent=False)

    def table_device(self, table: HeldTable) -> torch.device:  # noqa: D102
        return table.weight.device

    def optimizer_parameter(self, table: HeldTable) -> nn.Parameter:
        """Return the table itself (a parameter)."""
        return table.weight  # type: ignore[return-value]

    def gradient(self, table: HeldTable) -> torch.Tensor | None:  # noqa: D102
        return table.weight.grad

    def set_gradient(self, table: HeldTable, value: torch.Tensor | None) -> None:  # noqa: D102
        table.weight.grad = value

    def clear_gradient(self, table: HeldTable) -> None:
        """Nothing: the optimizer's ``zero_grad`` clears a parameter's gradient."""

    def lookup_rows(self, weight: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:  # noqa: D102
        if isinstance(rows, slice):
            return weight[rows]
        return weight.index_select(0, rows.to(weight.device))

    def draws_in_chunks(self, num_bytes: int, limit: int) -> bool:
        """Never: the full table fits where the tables live."""
        return False

    def row_state(self, table: HeldTable, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """Return the optimizer's state of the parameter (created at its first step)."""
        return optimizer_state

    def reset_row_state(self, table: HeldTable, shapes: Mapping[str, tuple[Sequence[int], float]]) -> None:
        """Nothing: a parameter's state is created at its first step."""

    def release_table(self, table: HeldTable) -> None:
        """Nothing: the tables are parameters of the model."""

    def check_updates(self, sparse_updates: bool) -> None:
        """Any updates: dense ones too."""

    def check_meta_model(self) -> None:  # noqa: D102
        raise ValueError(
            "The model was built on the meta device (its entity tables have no memory): train it with "
            "storage='host' or storage='mmap', whose tiers allocate the shard tables."
        )

    def captured_step_obstacle(self) -> str | None:  # noqa: D102
        return None

    def column_parts_obstacle(self) -> str | None:  # noqa: D102
        return None

    def state_entry(self, table: HeldTable, directory: pathlib.Path | None, omit_weight: bool) -> dict[str, Any] | None:
        """None: the table is a parameter of the model, in the state dict already."""
        return None

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
    keeps_files = True

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

    def defer_existing_files(self) -> None:  # noqa: D102
        self.defer_existing = True

    def _entry_values(self, tensors: dict[str, torch.Tensor], directory: pathlib.Path | None) -> dict[str, Any]:
        """Name the files' copies in ``directory`` (in a checkpoint), else the live files by path."""
        files = {
            key: (self.snapshot(value, directory) if directory is not None else str(self.file_of(value)))
            for key, value in tensors.items()
        }
        return {"files": files, "directory": directory.name if directory is not None else None}

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
        source = _open_source(file, tensor)
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


def _open_source(file: pathlib.Path, tensor: torch.Tensor) -> np.ndarray:
    """Memory-map a checkpoint's ``.npy`` copy of a tensor, checking its shape and dtype."""
    if not file.is_file():
        raise FileNotFoundError(f"The checkpoint's table file {file} is missing.")
    source = np.load(file, mmap_mode="r")
    if tuple(source.shape) != tuple(tensor.shape) or source.dtype != _NUMPY_DTYPES.get(tensor.dtype):
        raise ValueError(f"{file} holds {source.dtype} {source.shape}, expected {tensor.dtype} {tuple(tensor.shape)}.")
    return source


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
