"""A static step's rows of tables in host memory or files, staged in fixed device buffers around each step.

A CUDA graph replays kernels on fixed device memory; it cannot read rows from host memory or files.
A static step whose tables live in such a tier therefore reads and writes its rows through a
:class:`RowAccess`:

* :class:`TierRows` reads and writes each table's tier directly: the device tier, and every tier on
  the CPU (where the tier's memory is the compute device's);
* :class:`StagedRows` keeps, per staged tensor (every table's weight and the trainable tables' row
  state), a device buffer of the most rows a step looks up, and the slot of every occurrence the step
  looks up (``[N]``, on the device: nothing the size of the tables).

**The pipeline.** The rows every step looks up are known before the epoch (its order and negatives
are drawn in advance): they are computed on the device for a chunk of steps at a time and copied to
the host once per chunk (:data:`CHUNK_BYTES`), so no step waits for the device to learn the next
one's rows. A worker thread, in order, per step ``t``:

1. *reads* step ``t + 1``'s distinct rows (and their occurrences' slots) from the tiers into one of
   two sets of pinned host buffers, while step ``t`` runs on the device;
2. *writes* step ``t``'s written rows, copied back into one of two other sets of pinned host
   buffers, to the tiers, once that copy is done.

On the device's stream, around each step, outside the step function (:meth:`StagedRows.stage`,
:meth:`StagedRows.write_back`): the written rows of step ``t`` are copied to the host (without the
host waiting), the rows step ``t + 1`` shares with step ``t`` are taken from the device buffers
(step ``t``'s written values), step ``t + 1``'s rows are copied in from the host buffers and the
shared rows put back over them, and the occurrences' slots copied in. Inside the step (captured or
not), :meth:`StagedRows.read` and :meth:`StagedRows.write` index the device buffers by those
slots. The host never waits for the device within an epoch, except for a chunk's rows and for the
write-back of step ``t - 2`` before step ``t``'s reuses its host buffers; on a GPU the device runs
step ``t`` while the host and the worker prepare step ``t + 1``.

**Hazards.** The worker's read of step ``t + 1`` comes after its write of step ``t - 1``, so it
sees every row written before step ``t``; the rows it shares with step ``t`` (read before ``t``
wrote them) are forwarded on the device from ``t``'s written values. Host buffers are reused every
other step, after the device's copies from or into them are done (CUDA events, waited for on the
thread that reuses them). :meth:`StagedRows.flush` waits for the tiers' writes (at an epoch's end,
before per-step callbacks and checkpoints). The device buffers hold ``N`` rows per tensor (``N``:
the step's occurrences), the pinned host buffers four times that, not the tables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..runtime.threads import one_thread_here
from .base import TableStorage, format_bytes

__all__ = ["CHUNK_BYTES", "RowAccess", "StagedRows", "TierRows"]

#: the most bytes of step rows (``[steps, N]`` int64) computed on the device and copied to the host at once
CHUNK_BYTES = 16 * 2**20

#: a tensor a step reads (a table's weight or row state tensor), with its tier and whether the step writes it
StagedTensor = tuple[TableStorage, torch.Tensor, bool]
#: returns the looked-up rows of steps ``start`` to ``stop - 1`` of the loaded epoch, ``[stop - start, N]``
StepRowsOf = Callable[[int, int], torch.Tensor]


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

    def start_epoch(self) -> None:
        """Forget what was known of the last epoch's steps (a new epoch's plan is loaded)."""

    def stage(self, step: int, rows_of: StepRowsOf, num_steps: int) -> None:
        """Before a step: make its rows readable inside the step.

        :param step: the step's index in the loaded epoch
        :param rows_of: returns the looked-up rows ``[stop - start, N]`` of a range of the epoch's steps
        :param num_steps: the loaded epoch's steps
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


class _Read:
    """A step's rows as the worker read them: its distinct rows, occurrences' slots, what it shares with the last."""

    def __init__(
        self,
        step: int,
        rows: torch.Tensor,
        slots: torch.Tensor,
        shared: tuple[torch.Tensor, torch.Tensor],
        ready: Any = None,
    ):
        self.step = step
        #: shape: ``[U]``, the step's distinct local rows, sorted
        self.rows = rows
        #: shape: ``[N]``, the position in :attr:`rows` of every occurrence
        self.slots = slots
        #: shapes: ``[S]``, ``[S]``: the positions in :attr:`rows` of the rows the step before also used, and
        #: their positions among that step's rows (empty if the worker read after that step's writes)
        self.shared = shared
        #: the event after which the rows are in the incoming device buffers (depth 2 on a GPU; None: they are)
        self.ready = ready


class StagedRows(RowAccess):
    """The step's rows of every staged tensor in device buffers of a fixed size, staged around each step."""

    staged = True

    def __init__(
        self,
        tensors: Callable[[], Sequence[StagedTensor]],
        most: int,
        device: torch.device,
        budget: int | None = None,
    ):
        """Prepare the buffers; nothing is staged yet.

        :param tensors: returns the staged tensors with their tiers, and whether the step writes each (asked
            before every run of steps: a checkpoint's load may replace a tier's tensors)
        :param most: the most rows a step looks up (occurrences, duplicates included)
        :param device: the compute device
        :param budget: the bytes the device buffers may take (None: a quarter of the device's free memory on a
            GPU, no limit elsewhere); it decides the staging depth (:attr:`depth`)
        """
        self.tensors = tensors
        self.most = most
        self.device = device
        self.budget = budget
        self._cuda = device.type == "cuda"
        #: the device buffer sets: 2 where the budget holds them (the next step's rows are copied to the device
        #: while a step runs, on a side stream on a GPU), else 1 (copied in between the steps); set at the first step
        self.depth = 0
        self._incoming: list[torch.Tensor] = []  # depth 2, per staged tensor: [most, *], the next step's rows
        self._incoming_indices = torch.empty(0, dtype=torch.long)  # depth 2: [3, most], the next step's indices
        self._incoming_free: Any = None  # depth 2: the device has copied the incoming buffers (CUDA event)
        self._side: Any = None  # depth 2 on CUDA: the stream of the copies into the incoming buffers
        #: shape: ``[N]``, the slot (in the device buffers) of every occurrence the staged step looks up
        self.slots = torch.zeros(most, dtype=torch.long, device=device)
        self._occurrences = 0  # the step's occurrences (N: the same every step)
        self._device: list[torch.Tensor] = []  # per staged tensor: [most, *]
        # two sets of pinned host buffers per staged tensor, each used by every other step: the rows read from
        # the tiers (the next step's are read while a step runs) with the occurrences' slots and the shared
        # rows' positions, and the rows a step wrote
        self._read: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._written: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._indices = tuple(torch.empty(3, most, dtype=torch.long, pin_memory=self._cuda) for _ in range(2))
        # per set: the device's copies from the read set, and into the written set, are done (CUDA only)
        self._copied_in: list[Any] = [None, None]
        self._copied_out: list[Any] = [None, None]
        self._position: dict[int, int] = {}  # id(tensor) -> its buffers
        self._staged: list[StagedTensor] = []
        self._current: _Read | None = None  # the step staged on the device (its rows are in the device buffers)
        self._next: Future | None = None  # the next step's rows, being read into the other set
        self._last_rows = torch.empty(0, dtype=torch.long)  # the rows of the last step the worker read
        self._writes: dict[int, Future] = {}  # the writes to the tiers not yet seen done, by step
        self._ahead: tuple[int, torch.Tensor] = (0, torch.empty(0, 0, dtype=torch.long))  # a chunk of step rows
        self._worker: ThreadPoolExecutor | None = None

    def set_bytes(self) -> int:
        """Return the bytes of one set of device buffers: ``N`` rows of every staged tensor, and ``[3, N]`` indices."""
        row_bytes = sum(tensor[:1].numel() * tensor.element_size() for _, tensor, _ in self.tensors())
        return self.most * (row_bytes + 3 * self.slots.element_size())

    def buffer_bytes(self) -> tuple[int, int]:
        """Return the bytes of the device buffers (all sets, forwarding included) and of the pinned host buffers.

        The forwarded rows (those the next step shares with a step) take at most one more set while they are
        moved.
        """
        one = self.set_bytes()
        host = 4 * (one - 3 * self.most * self.slots.element_size()) + 2 * 3 * self.most * self.slots.element_size()
        return (max(1, self.depth) + 1) * one, host

    def describe(self) -> str:
        """Say what staging holds where (for the log's memory plan; the depth is chosen here if not yet).

        :raises MemoryError: if not even one set of buffers fits the budget (before any step)
        """
        self.depth = self.depth or self.choose_depth()
        device, host = self.buffer_bytes()
        ahead = (
            "the next step's rows copied in while a step runs"
            if self.depth == 2
            else "the next step's rows copied in after a step (the budget holds one set)"
        )
        return (
            f"every step's rows (at most {self.most:,}) staged on {self.device} in {format_bytes(device)} of "
            f"buffers ({max(1, self.depth)} set(s) of {format_bytes(self.set_bytes())}: {ahead}), through "
            f"{format_bytes(host)} of host buffers{' (pinned)' if self._cuda else ''}"
        )

    def choose_depth(self) -> int:
        """Return the buffer sets the budget holds (2 or 1), each with room for the forwarded rows.

        :raises MemoryError: if not even one set fits the budget
        """
        one = self.set_bytes()
        budget = self.budget
        if budget is None and self._cuda:
            budget = torch.cuda.mem_get_info(self.device)[0] // 4
        if budget is None or 3 * one <= budget:
            return 2
        if 2 * one <= budget:
            return 1
        raise MemoryError(
            f"Staging a step's rows takes {format_bytes(2 * one)} on {self.device} (a set of {self.most:,} rows of "
            f"every staged tensor, and the forwarded rows), more than the {format_bytes(budget)} the memory budget "
            f"leaves for it: lower the batch size or the number of negatives, or raise memory_budget."
        )

    def start_epoch(self) -> None:  # noqa: D102
        self._ahead = (0, torch.empty(0, 0, dtype=torch.long))

    def stage(self, step: int, rows_of: StepRowsOf, num_steps: int) -> None:  # noqa: D102
        # one torch thread for the worker: a second OpenMP team would make the step's parallel regions sleep and wake
        worker = self._worker or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="bess-staging", initializer=one_thread_here
        )
        self._worker = worker
        if self._next is None:  # the first step of a run of steps: read now (after the tiers' last writes)
            self._staged = list(self.tensors())
            self._bind([tensor for _, tensor, _ in self._staged])
            self._current = None
            self._last_rows = torch.empty(0, dtype=torch.long)
            self._next = worker.submit(self._read_rows, step, self._rows_of_step(step, rows_of, num_steps))
        read: _Read = self._next.result()
        if read.step != step:
            raise RuntimeError(f"Step {step} was staged, but the rows of step {read.step} were read.")
        count, occurrences = read.rows.numel(), read.slots.numel()
        if self._occurrences and occurrences != self._occurrences:
            raise RuntimeError(f"A step looks up {occurrences} rows, the steps before {self._occurrences}.")
        self._occurrences = occurrences
        turn = step % 2
        if self.depth == 2:  # copied to the incoming buffers by the worker (on the side stream: wait for it)
            if read.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(read.ready)
            sources, indices = self._incoming, self._incoming_indices
        else:
            sources, indices = self._read[turn], self._indices[turn].to(self.device, non_blocking=True)
        shared = read.shared[0].numel()
        at, source = indices[1, :shared], indices[2, :shared]
        # the rows shared with the step before: its written values, still in the device buffers
        forwarded = [
            buffer.index_select(0, source) if written and shared else None
            for buffer, (_, _, written) in zip(self._device, self._staged)
        ]
        for position, buffer in enumerate(self._device):
            buffer[:count].copy_(sources[position][:count], non_blocking=True)
            values = forwarded[position]
            if values is not None:
                buffer.index_copy_(0, at, values)
        self.slots[:occurrences].copy_(indices[0, :occurrences])
        if self.depth == 2:
            self._incoming_free = self._record()
        else:
            self._copied_in[turn] = self._record()
        self._current = read
        # the next step's rows are read on the worker while this step runs (after the last step's writes)
        self._next = None
        if step + 1 < num_steps:
            self._next = worker.submit(self._read_rows, step + 1, self._rows_of_step(step + 1, rows_of, num_steps))

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
        current = self._current
        if current is None:
            raise RuntimeError("No staged step to write back.")
        step, rows = current.step, current.rows
        turn, count = step % 2, rows.numel()
        # the host buffers reused here held step t - 2's rows: the worker wrote them before it read this step's
        self._result_of_writes(before=step - 1)  # (so this does not wait; it raises what the writes raised)
        for position, (_, _, written) in enumerate(self._staged):
            if written:  # (after the step, on the device's stream)
                self._written[turn][position][:count].copy_(self._device[position][:count], non_blocking=True)
        self._copied_out[turn] = self._record()
        assert self._worker is not None
        self._writes[step] = self._worker.submit(self._write_rows, rows, turn, self._copied_out[turn])
        self._result_of_writes(before=step, done_only=True)

    def flush(self) -> None:
        """Wait until every step's rows are written to the tiers, and forget a read of a next step.

        :raises Exception: what the worker raised reading or writing (the state is reset first)
        """
        futures = [self._next, *self._writes.values()]
        self._next, self._writes, self._current = None, {}, None
        for future in futures:
            if future is not None:
                future.result()

    def _result_of_writes(self, before: int, done_only: bool = False) -> None:
        """Wait for (``done_only``: look at the finished) writes of the steps before ``before``; raise their errors."""
        for step in sorted(self._writes):
            if step < before and (not done_only or self._writes[step].done()):
                self._writes.pop(step).result()  # raises what a write to the tiers raised

    def _rows_of_step(self, step: int, rows_of: StepRowsOf, num_steps: int) -> torch.Tensor:
        """Return a step's looked-up rows ``[N]`` on the host, computing a chunk of the epoch's steps when needed."""
        first, chunk = self._ahead
        if not first <= step < first + chunk.shape[0]:
            steps = max(1, min(num_steps - step, CHUNK_BYTES // max(1, 8 * self.most)))
            with torch.no_grad():
                chunk = rows_of(step, step + steps).cpu()
            self._ahead = first, chunk = step, chunk
        return chunk[step - first]

    def _read_rows(self, step: int, occurrences: torch.Tensor) -> _Read:
        """On the worker: a step's distinct rows, read from the tiers into the host buffers of its set."""
        rows, slots = torch.unique(occurrences, return_inverse=True)
        if slots.numel() > self.most:
            raise ValueError(f"A step looks up {slots.numel()} rows, more than the {self.most} staged.")
        turn = step % 2
        _wait(self._copied_in[turn])  # the device's copies of the step two before from these buffers are done
        shared = _shared_rows(rows, self._last_rows)  # (empty for a run's first step: read after every write)
        self._last_rows = rows
        indices = self._indices[turn]
        indices[0, : slots.numel()] = slots
        indices[1, : shared[0].numel()] = shared[0]
        indices[2, : shared[1].numel()] = shared[1]
        for position, (storage, tensor, _) in enumerate(self._staged):
            storage.read(tensor, rows, out=self._read[turn][position][: rows.numel()])
        ready = self._copy_in(turn, rows.numel()) if self.depth == 2 else None
        return _Read(step, rows, slots, shared, ready)

    def _copy_in(self, turn: int, count: int) -> Any:
        """On the worker (depth 2): copy a step's rows and indices to the incoming buffers; return when they are there.

        On a GPU the copies run on the side stream, after the device has copied the incoming buffers' last
        contents (:attr:`_incoming_free`), while the step before runs; the returned event marks them done.
        """
        stream = contextlib.nullcontext() if self._side is None else torch.cuda.stream(self._side)
        with stream:
            if self._side is not None and self._incoming_free is not None:
                self._side.wait_event(self._incoming_free)
            for position, buffer in enumerate(self._incoming):
                buffer[:count].copy_(self._read[turn][position][:count], non_blocking=True)
            # whole (a contiguous pinned tensor: a column slice would be copied through pageable memory)
            self._incoming_indices.copy_(self._indices[turn], non_blocking=True)
            ready = None
            if self._side is not None:
                ready = torch.cuda.Event()
                ready.record(self._side)
        self._copied_in[turn] = ready  # (the host buffers of ``turn`` are free once the copies are done)
        return ready

    def _write_rows(self, rows: torch.Tensor, turn: int, copied: Any) -> None:
        """On the worker: write the written rows of ``turn``'s host buffers to the tiers (once copied there)."""
        _wait(copied)
        for position, (storage, tensor, written) in enumerate(self._staged):
            if written:
                storage.write(tensor, rows, self._written[turn][position][: rows.numel()])

    def _record(self) -> Any:
        """Return an event recorded on the device's stream now (CUDA; None elsewhere, where copies are done at once)."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _bind(self, tensors: Sequence[torch.Tensor]) -> None:
        """Find (or make, at the first step) every staged tensor's buffers; their memory never changes after."""
        if not self._device:
            self.depth = self.depth or self.choose_depth()
            for tensor in tensors:
                shape = (self.most, *tensor.shape[1:])
                self._device.append(torch.empty(shape, dtype=tensor.dtype, device=self.device))
                if self.depth == 2:
                    self._incoming.append(torch.empty(shape, dtype=tensor.dtype, device=self.device))
                for buffers in (*self._read, *self._written):
                    buffers.append(torch.empty(shape, dtype=tensor.dtype, pin_memory=self._cuda))
            if self.depth == 2:
                self._incoming_indices = torch.empty(3, self.most, dtype=torch.long, device=self.device)
                self._side = torch.cuda.Stream(self.device) if self._cuda else None
        elif len(tensors) != len(self._device) or any(
            tensor.shape[1:] != buffer.shape[1:] or tensor.dtype != buffer.dtype
            for tensor, buffer in zip(tensors, self._device)
        ):
            raise RuntimeError("The staged tensors of the tables changed their number, width or dtype.")
        self._position = {id(tensor): position for position, tensor in enumerate(tensors)}


def _shared_rows(rows: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the positions in ``rows`` (sorted) of those also in ``last`` (sorted), and their positions in ``last``."""
    if last.numel() == 0 or rows.numel() == 0:
        empty = torch.empty(0, dtype=torch.long)
        return empty, empty
    at = torch.searchsorted(last, rows).clamp_(max=last.numel() - 1)
    shared = (last[at] == rows).nonzero().view(-1)
    return shared, at[shared]


def _wait(event: Any) -> None:
    """Wait (on this thread) until the device has passed a recorded event (None: nothing to wait for)."""
    if event is not None:
        event.synchronize()
