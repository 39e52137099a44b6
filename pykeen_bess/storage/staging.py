"""A static step's rows of tables in host memory or files, staged in fixed device buffers around each step.

A CUDA graph replays kernels on fixed device memory; it cannot read rows from host memory or files.
A static step whose tables live in such a tier therefore reads and writes its rows through a
:class:`RowAccess`:

* :class:`TierRows` reads and writes each table's tier directly: the device tier, and every tier on
  the CPU (where the tier's memory is the compute device's);
* :class:`StagedRows` keeps, per staged tensor (every table's weight and the trainable tables' row
  state), a device buffer of the most rows a step looks up, and a row-to-slot map on the device.
  Around each step, outside the step function:

  1. :meth:`StagedRows.stage` takes the step's rows (computed on the device from the epoch's plan
     and read to the host: one synchronisation per step), finds the distinct rows, reads them from
     the tier into pinned host buffers and copies them to the device buffers, and maps every
     distinct row to its slot;
  2. inside the step (captured or not), :meth:`StagedRows.read` and :meth:`StagedRows.write` index
     the device buffers through the map: the step sees device memory of a fixed size only;
  3. :meth:`StagedRows.write_back` copies the written buffers' rows back (one synchronisation) and
     writes them to the tier.

  The next step is staged only after the write-back, so rows that consecutive steps share are read
  with their latest values. Staging and write-back are synchronous here; the device buffers hold
  ``N`` rows per tensor (``N``: the step's occurrences), not the tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .base import TableStorage

__all__ = ["RowAccess", "StagedRows", "TierRows"]

#: a tensor a step reads (a table's weight or row state tensor), with its tier and whether the step writes it
StagedTensor = tuple[TableStorage, torch.Tensor, bool]


class RowAccess:
    """How a static step reads and writes the rows of its tables' tensors (weights and row state)."""

    #: whether the step's rows are staged around each step (:meth:`stage` and :meth:`write_back`)
    staged = False

    def read(self, storage: TableStorage, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Return rows ``[U]`` of a tensor of a tier (a table's weight or row state tensor) on the compute device."""
        raise NotImplementedError

    def write(self, storage: TableStorage, tensor: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` ``[U, *]`` to rows ``[U]`` of a tensor of a tier (duplicate rows carry equal values)."""
        raise NotImplementedError

    def stage(self, step_rows: Callable[[], torch.Tensor]) -> None:
        """Before a step: make its rows readable inside the step (``step_rows()``: its local row ids ``[N]``)."""

    def write_back(self) -> None:
        """After a step: write what it wrote to the tables' tiers."""


class TierRows(RowAccess):
    """Each table's tier read and written directly (the device tier; every tier on the CPU)."""

    def read(self, storage: TableStorage, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return storage.read(tensor, rows)

    def write(  # noqa: D102
        self, storage: TableStorage, tensor: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
    ) -> None:
        storage.write(tensor, rows, values)


class StagedRows(RowAccess):
    """The step's rows of every staged tensor in device buffers of a fixed size, staged around each step."""

    staged = True

    def __init__(
        self,
        tensors: Callable[[], Sequence[StagedTensor]],
        num_rows: int,
        most: int,
        device: torch.device,
    ):
        """Prepare the buffers; nothing is staged yet.

        :param tensors: returns the staged tensors with their tiers, and whether the step writes each (asked
            at every :meth:`stage`: a checkpoint's load may replace a tier's tensors)
        :param num_rows: the rows of the tables (the row-to-slot map's size)
        :param most: the most rows a step looks up (occurrences, duplicates included)
        :param device: the compute device
        """
        self.tensors = tensors
        self.most = most
        self.device = device
        pin = device.type == "cuda"
        #: shape: ``[R]``, the slot of every distinct row of the staged step (others: stale)
        self.slot_of = torch.zeros(num_rows, dtype=torch.long, device=device)
        self._slots = torch.arange(most, dtype=torch.long, device=device)
        self._distinct_host = torch.empty(most, dtype=torch.long, pin_memory=pin)
        self._distinct = torch.empty(most, dtype=torch.long, device=device)
        self._device: list[torch.Tensor] = []  # per staged tensor: [most, *]
        self._host: list[torch.Tensor] = []  # per staged tensor: [most, *], pinned on CUDA
        self._position: dict[int, int] = {}  # id(tensor) -> its buffers
        self._staged: list[StagedTensor] = []
        self._count = 0
        self._pin = pin

    def stage(self, step_rows: Callable[[], torch.Tensor]) -> None:  # noqa: D102
        with torch.no_grad():
            distinct = torch.unique(step_rows().cpu())
        count = distinct.numel()
        if count > self.most:
            raise ValueError(f"A step looks up {count} distinct rows, more than the {self.most} staged.")
        self._count = count
        self._staged = list(self.tensors())
        self._bind([tensor for _, tensor, _ in self._staged])
        host_rows = self._distinct_host[:count]
        host_rows.copy_(distinct)
        device_rows = self._distinct[:count]
        device_rows.copy_(host_rows, non_blocking=True)
        self.slot_of.index_copy_(0, device_rows, self._slots[:count])
        for position, (storage, tensor, _) in enumerate(self._staged):
            staged = storage.read(tensor, distinct, out=self._host[position][:count])
            self._device[position][:count].copy_(staged, non_blocking=True)

    def read(self, storage: TableStorage, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self._device[self._position[id(tensor)]].index_select(0, self.slot_of.index_select(0, rows))

    def write(  # noqa: D102
        self, storage: TableStorage, tensor: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
    ) -> None:
        buffer = self._device[self._position[id(tensor)]]
        buffer.index_copy_(0, self.slot_of.index_select(0, rows), values.to(buffer.dtype))

    def write_back(self) -> None:  # noqa: D102
        count, distinct = self._count, self._distinct_host[: self._count]
        for position, (storage, tensor, written) in enumerate(self._staged):
            if written:
                host = self._host[position][:count]
                host.copy_(self._device[position][:count])  # waits for the step
                storage.write(tensor, distinct, host)

    def _bind(self, tensors: Sequence[torch.Tensor]) -> None:
        """Find (or make, at the first step) every staged tensor's buffers; their memory never changes after."""
        if not self._device:
            for tensor in tensors:
                shape = (self.most, *tensor.shape[1:])
                self._device.append(torch.empty(shape, dtype=tensor.dtype, device=self.device))
                self._host.append(torch.empty(shape, dtype=tensor.dtype, pin_memory=self._pin))
        elif len(tensors) != len(self._device) or any(
            tensor.shape[1:] != buffer.shape[1:] or tensor.dtype != buffer.dtype
            for tensor, buffer in zip(tensors, self._device)
        ):
            raise RuntimeError("The staged tensors of the tables changed their number, width or dtype.")
        self._position = {id(tensor): position for position, tensor in enumerate(tensors)}
