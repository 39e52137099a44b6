"""The base of every storage tier: what a tier holds, the traffic it counts, and the host's memory."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from torch import nn

__all__ = [
    "NUMPY_DTYPES",
    "HeldTable",
    "StorageTraffic",
    "TableStorage",
    "available_host_memory",
    "check_host_memory",
    "chunk_rows",
    "format_bytes",
    "open_source",
]

#: numpy dtypes of the torch dtypes a memory-mapped table may have
NUMPY_DTYPES = {
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
    """What a tier reads and writes of a table it holds (a :class:`~.tables.representation.ShardedEmbedding`)."""

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
        self._compute_device = torch.device("cpu")

    @property
    def compute_device(self) -> torch.device:
        """The device the arithmetic on the tier's rows runs on: the model's (see :meth:`attach`)."""
        return self._compute_device

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled tier (earlier versions named the compute device's attribute ``compute_device``)."""
        if "compute_device" in state:
            state["_compute_device"] = state.pop("compute_device")
        self.__dict__.update(state)

    def attach(self, device: torch.device) -> None:
        """Serve a table set computing on ``device`` (the one place the compute device is set: the table set's).

        :class:`~pykeen_bess.tables.shard_tables.ShardTables` attaches its tier when it is created and when
        it is installed in the model (which may have moved to another device in between).
        """
        self._compute_device = torch.device(device)

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

    def discard(self) -> None:  # noqa: B027
        """Remove what the tier placed for a training loop that failed to build (tiers with files)."""

    @contextlib.contextmanager
    def discarded_on_failure(self) -> Iterator[None]:
        """Remove what the tier placed (:meth:`discard`) if the block raises, and raise again."""
        try:
            yield
        except BaseException:
            self.discard()
            raise

    def check_capacity(self, num_bytes: int, device: torch.device) -> None:  # noqa: B027
        """Raise :class:`MemoryError` with advice if the tier cannot hold ``num_bytes`` more bytes.

        :param num_bytes: the bytes the tables and their state need
        :param device: where the tables will compute (the model's device)
        """

    @property
    def storage_device(self) -> torch.device:
        """The device the tier's tensors live on."""
        return torch.device("cpu")

    # -- row traffic ---------------------------------------------------------------------------

    def read(self, tensor: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read rows of a tensor of this tier to the compute device.

        :param tensor: shape: ``[R, *]``, a tensor placed by this tier
        :param rows: shape: ``[U]``, row ids (any device)
        :param out: shape: ``[U, *]``, a buffer to read into where the tensor is on its device (a reused
            buffer spares the CPU's allocator fresh pages every step), or None
        :returns: shape: ``[U, *]``, on the compute device (a new tensor, or ``out``)
        """
        rows = rows.to(tensor.device)
        if out is not None and out.device == tensor.device and out.dtype == tensor.dtype:
            values = torch.index_select(tensor.detach(), 0, rows, out=out)
        else:
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

    def anchor_device(self, module: nn.Module, device: torch.device) -> None:
        """Give a table's module an empty buffer on ``device`` (not in its state dict).

        PyKEEN infers a model's device from its parameters and buffers (``train()`` moves the model there): a
        model whose only parameters are entity tables of this tier (UM, without a regularizer) had none.
        """
        module.register_buffer("device_anchor", torch.empty(0, device=device), persistent=False)

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
        """Why a CUDA graph cannot capture a static step on these tables, None if it can.

        Their rows cross from host memory or files to the GPU inside the step (synchronously: the step then
        runs uncaptured), which a CUDA graph cannot capture.
        """
        return f"its rows cross from storage={self.name!r} to the GPU"

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
        source = open_source(file, tensor)
        step = chunk_rows(source)
        with torch.no_grad():
            for start in range(0, source.shape[0], step):
                tensor[start : start + step].copy_(torch.from_numpy(np.ascontiguousarray(source[start : start + step])))

    def defer_existing_files(self) -> None:  # noqa: B027
        """Place tensors whose file exists beside it until :meth:`claim_existing` decides (tiers with files)."""

    def claim_existing(  # noqa: B027
        self, resuming: bool, checkpoint: pathlib.Path | None = None, agree: Callable[[bool], bool] | None = None
    ) -> None:
        """Decide about existing files the tensors were placed beside (tiers with files).

        :param resuming: a checkpoint is being resumed
        :param checkpoint: the checkpoint the run writes (None: none)
        :param agree: returns whether its argument holds on every process (a collective every process calls,
            or None: this process decides alone)
        """

    def checkpoint_written(self, checkpoint: pathlib.Path) -> None:  # noqa: B027
        """Note a checkpoint the run wrote (tiers with files: resuming it takes the run's files over)."""


def open_source(file: pathlib.Path, tensor: torch.Tensor) -> np.ndarray:
    """Memory-map a checkpoint's ``.npy`` copy of a tensor, checking its shape and dtype."""
    if not file.is_file():
        raise FileNotFoundError(f"The checkpoint's table file {file} is missing.")
    source = np.load(file, mmap_mode="r")
    if tuple(source.shape) != tuple(tensor.shape) or source.dtype != NUMPY_DTYPES.get(tensor.dtype):
        raise ValueError(f"{file} holds {source.dtype} {source.shape}, expected {tensor.dtype} {tuple(tensor.shape)}.")
    return source


def chunk_rows(array: Any, chunk_bytes: int = 64 << 20) -> int:
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


def check_host_memory(num_bytes: int, tier: str) -> None:
    """Raise :class:`MemoryError` with advice if host memory cannot hold ``num_bytes`` more bytes."""
    available = available_host_memory()
    if available is not None and num_bytes > available:
        raise MemoryError(
            f"The shard tables and their optimizer state need {format_bytes(num_bytes)} of host memory "
            f"(storage={tier!r}), {format_bytes(available)} are available. Keep them in files (storage='mmap', "
            f"storage_path=...), use optimizer='rowwise_adagrad' (one float of state per row), or use more shards "
            f"over more machines."
        )
