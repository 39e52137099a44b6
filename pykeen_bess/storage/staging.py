"""A static step's rows of tables in host memory or files, staged in fixed device buffers around each step.

A CUDA graph replays kernels on fixed device memory; it cannot read rows from host memory or files.
A static step whose tables live in such a tier therefore reads and writes its rows through a
:class:`RowAccess`:

* :class:`TierRows` reads and writes each table's tier directly: the device tier, and every tier on
  the CPU (where the tier's memory is the compute device's);
* :class:`StagedRows` keeps, per staged tensor (every table's weight and the trainable tables' row
  state), a device buffer of the most rows a step looks up, and the slot of every occurrence the step
  looks up (``[N]``, on the device: nothing the size of the tables).
  Around each step, outside the step function:

  1. :meth:`StagedRows.stage` copies the step's distinct rows, read from the tiers into pinned host
     buffers, to the device buffers, and its occurrences' slots among them; then it computes the
     next step's rows (on the device, from the epoch's plan: one synchronisation per step) and has a
     worker thread read them from the tiers into the other set of host buffers while this step runs;
  2. inside the step (captured or not), :meth:`StagedRows.read` and :meth:`StagedRows.write` index
     the device buffers by the occurrences' slots (the step computes its occurrences in the same order):
     the step sees device memory of a fixed size only;
  3. :meth:`StagedRows.write_back` copies the written rows back to host buffers (waiting for the step)
     and has the worker write them to the tiers.

  **Hazards.** The worker runs in order: the writes of step ``t`` before the read of step ``t + 2``,
  so a step reads every row the steps before the last wrote. Rows that step ``t + 1`` shares with
  step ``t`` were read before ``t`` wrote them: they are forwarded from ``t``'s written values before
  they go to the device. :meth:`StagedRows.flush` waits for the tiers' writes (at an epoch's end,
  and before per-step callbacks). The device buffers hold ``N`` rows per tensor (``N``: the step's
  occurrences), the host buffers four times that, not the tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .base import TableStorage, format_bytes

__all__ = ["RowAccess", "StagedRows", "TierRows"]

#: a tensor a step reads (a table's weight or row state tensor), with its tier and whether the step writes it
StagedTensor = tuple[TableStorage, torch.Tensor, bool]
#: a step's distinct rows ``[U]`` (sorted) and the slot among them of every occurrence ``[N]``
Staged = tuple[torch.Tensor, torch.Tensor]


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

    def stage(self, step_rows: Callable[[], torch.Tensor], next_rows: Callable[[], torch.Tensor] | None = None) -> None:
        """Before a step: make its rows readable inside the step.

        :param step_rows: returns the step's local row ids ``[N]`` (on the compute device)
        :param next_rows: returns the next step's (the one staged next, if it follows at once), or None
        """

    def write_back(self) -> None:
        """After a step: have what it wrote written to the tables' tiers (:meth:`flush` waits for it)."""

    def flush(self) -> None:
        """Wait until the tables' tiers hold every step's writes (before anything else reads them)."""

    def describe(self) -> str:
        """Say how the step reaches its rows (for the log)."""
        return "every step's rows read from and written to the tables' tiers directly"


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
        most: int,
        device: torch.device,
    ):
        """Prepare the buffers; nothing is staged yet.

        :param tensors: returns the staged tensors with their tiers, and whether the step writes each (asked
            before every step: a checkpoint's load may replace a tier's tensors)
        :param most: the most rows a step looks up (occurrences, duplicates included)
        :param device: the compute device
        """
        self.tensors = tensors
        self.most = most
        self.device = device
        self._pin = device.type == "cuda"
        #: shape: ``[N]``, the slot (in the device buffers) of every occurrence the staged step looks up
        self.slots = torch.zeros(most, dtype=torch.long, device=device)
        self._slots_host = torch.empty(most, dtype=torch.long, pin_memory=self._pin)
        self._occurrences = 0  # the step's occurrences (N: the same every step)
        self._device: list[torch.Tensor] = []  # per staged tensor: [most, *]
        # two sets of host buffers (pinned on CUDA) per staged tensor, used by every other step: the rows
        # read from the tier (the next step's are read while a step runs), and the rows a step wrote
        self._read: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._written: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._position: dict[int, int] = {}  # id(tensor) -> its buffers
        self._staged: list[StagedTensor] = []
        self._turn = 0  # the set of host buffers of the current step
        self._rows = torch.empty(0, dtype=torch.long)  # the current step's distinct rows (sorted)
        self._next: Future | None = None  # the next step's rows, being read into the other set
        self._previous: tuple[torch.Tensor, int] | None = None  # the last step's rows and its written set
        self._writes: list[Future] = []  # the writes to the tiers not yet seen done
        self._worker: ThreadPoolExecutor | None = None

    def buffer_bytes(self) -> tuple[int, int]:
        """Return the bytes of the device buffers (with the occurrences' slots) and of the pinned host buffers."""
        row_bytes = sum(tensor[:1].numel() * tensor.element_size() for _, tensor, _ in self.tensors())
        device = self.most * (row_bytes + self.slots.element_size())
        return device, 4 * self.most * row_bytes

    def describe(self) -> str:
        """Say what staging holds where (for the log's memory plan)."""
        device, host = self.buffer_bytes()
        return (
            f"every step's rows (at most {self.most:,}) staged on {self.device} in {format_bytes(device)} of "
            f"buffers, through {format_bytes(host)} of host buffers{' (pinned)' if self._pin else ''} (two steps, "
            f"read and written)"
        )

    def stage(  # noqa: D102
        self, step_rows: Callable[[], torch.Tensor], next_rows: Callable[[], torch.Tensor] | None = None
    ) -> None:
        worker = self._worker or ThreadPoolExecutor(max_workers=1, thread_name_prefix="bess-staging")
        self._worker = worker
        turn = self._turn
        if self._next is None:  # the first step of a run of steps: read now (after the tiers' last writes)
            self._staged = list(self.tensors())
            self._bind([tensor for _, tensor, _ in self._staged])
            self._next = worker.submit(self._read_rows, self._distinct_rows(step_rows), turn, self._staged)
        rows, slots = self._next.result()
        count, occurrences = rows.numel(), slots.numel()
        if self._occurrences and occurrences != self._occurrences:
            raise RuntimeError(f"A step looks up {occurrences} rows, the steps before {self._occurrences}.")
        self._occurrences = occurrences
        self._forward(rows, turn)
        host_slots = self._slots_host[:occurrences]
        host_slots.copy_(slots)
        self.slots[:occurrences].copy_(host_slots, non_blocking=True)
        for position, buffer in enumerate(self._device):
            buffer[:count].copy_(self._read[turn][position][:count], non_blocking=True)
        self._rows = rows
        # the next step's rows are read on the worker while this step runs (after this step's writes
        # are queued there: rows both steps use are forwarded from this step's written values instead)
        self._next = None
        if next_rows is not None:
            self._next = worker.submit(self._read_rows, self._distinct_rows(next_rows), 1 - turn, self._staged)

    def read(self, storage: TableStorage, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Return the staged values of the step's occurrences ``rows`` ``[N]`` (the rows staged, in their order)."""
        return self._device[self._position[id(tensor)]].index_select(0, self._slots_of(rows))

    def write(self, storage: TableStorage, tensor: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` ``[N, *]`` of the step's occurrences ``rows`` ``[N]`` to the staged buffer."""
        buffer = self._device[self._position[id(tensor)]]
        buffer.index_copy_(0, self._slots_of(rows), values.to(buffer.dtype))

    def _slots_of(self, rows: torch.Tensor) -> torch.Tensor:
        """Return the slots of the step's occurrences (``rows``: the staged step's occurrences, in their order)."""
        if rows.numel() != self._occurrences:
            raise RuntimeError(
                f"Staged rows are read and written by the step's occurrences ({self._occurrences}), not {rows.numel()}."
            )
        return self.slots[: self._occurrences]

    def write_back(self) -> None:  # noqa: D102
        turn, rows = self._turn, self._rows
        count = rows.numel()
        for position, (_, _, written) in enumerate(self._staged):
            if written:  # (waits for the step)
                self._written[turn][position][:count].copy_(self._device[position][:count])
        assert self._worker is not None
        done = [write for write in self._writes if write.done()]
        self._writes = [write for write in self._writes if not write.done()]
        for write in done:
            write.result()  # raises what a write to the tiers raised
        self._writes.append(self._worker.submit(self._write_rows, rows, turn, self._staged))
        self._previous = (rows, turn)
        self._turn = 1 - turn

    def flush(self) -> None:
        """Wait until every step's rows are written to the tiers, and forget a read of a next step.

        :raises Exception: what the worker raised reading or writing (the state is reset first)
        """
        futures = [self._next, *self._writes]
        self._next, self._writes, self._previous = None, [], None
        for future in futures:
            if future is not None:
                future.result()

    def _distinct_rows(self, step_rows: Callable[[], torch.Tensor]) -> Staged:
        """Return a step's distinct rows (sorted) and every occurrence's slot among them."""
        with torch.no_grad():
            rows, slots = torch.unique(step_rows().cpu(), return_inverse=True)
        if slots.numel() > self.most:
            raise ValueError(f"A step looks up {slots.numel()} rows, more than the {self.most} staged.")
        return rows, slots

    def _read_rows(self, step: Staged, turn: int, staged: Sequence[StagedTensor]) -> Staged:
        """On the worker: read the rows of every staged tensor from its tier into the host buffers of ``turn``."""
        rows = step[0]
        for position, (storage, tensor, _) in enumerate(staged):
            storage.read(tensor, rows, out=self._read[turn][position][: rows.numel()])
        return step

    def _write_rows(self, rows: torch.Tensor, turn: int, staged: Sequence[StagedTensor]) -> None:
        """On the worker: write the written rows of ``turn``'s host buffers to the tiers."""
        for position, (storage, tensor, written) in enumerate(staged):
            if written:
                storage.write(tensor, rows, self._written[turn][position][: rows.numel()])

    def _forward(self, rows: torch.Tensor, turn: int) -> None:
        """Replace the read values of rows the last step also used by what it wrote (read before its write)."""
        if self._previous is None:
            return
        previous, written_turn = self._previous
        if previous.numel() == 0 or rows.numel() == 0:
            return
        at = torch.searchsorted(previous, rows).clamp_(max=previous.numel() - 1)
        shared = (previous[at] == rows).nonzero().view(-1)
        if shared.numel() == 0:
            return
        source = at[shared]
        for position, (_, _, written) in enumerate(self._staged):
            if written:
                self._read[turn][position][shared] = self._written[written_turn][position][source]

    def _bind(self, tensors: Sequence[torch.Tensor]) -> None:
        """Find (or make, at the first step) every staged tensor's buffers; their memory never changes after."""
        if not self._device:
            for tensor in tensors:
                shape = (self.most, *tensor.shape[1:])
                self._device.append(torch.empty(shape, dtype=tensor.dtype, device=self.device))
                for buffers in (*self._read, *self._written):
                    buffers.append(torch.empty(shape, dtype=tensor.dtype, pin_memory=self._pin))
        elif len(tensors) != len(self._device) or any(
            tensor.shape[1:] != buffer.shape[1:] or tensor.dtype != buffer.dtype
            for tensor, buffer in zip(tensors, self._device)
        ):
            raise RuntimeError("The staged tensors of the tables changed their number, width or dtype.")
        self._position = {id(tensor): position for position, tensor in enumerate(tensors)}
