"""The process topology: which shards a process holds, and every collective between processes.

Everything else in this package is written once against :class:`Topology` and runs unchanged on
``n`` logical shards in one process (:class:`LocalTopology`), on one shard per rank of a
``torch.distributed`` process group (:class:`DistributedTopology`), or without communicating at
all (:class:`ProbeTopology`, for memory probes). This module and :mod:`pykeen_bess.distributed.launch`
are the only code that calls ``torch.distributed``.

A process holds ``L`` of the ``n_shard`` shards ("local shards"). Two kinds of collectives:

* **along the shard axis**, differentiable (the backward of an exchanged embedding reaches the
  shard that owns it); every tensor has a leading local-shard axis of size ``L``:

  - :meth:`Topology.all_to_all`: ``[L, n, ...] -> [L, n, ...]``; input ``x[l, s]`` is the message
    from local shard ``l`` to shard ``s``, output ``y[l, s]`` the message shard ``s`` sent to
    local shard ``l``;
  - :meth:`Topology.all_gather`: ``[L, ...] -> [L, n, ...]``; ``y[l, s] = x`` of shard ``s``;
  - :meth:`Topology.gather_shards`: ``[L, ...] -> [n, ...]`` on the main process (export);
  - :meth:`Topology.all_to_all_uneven`: ``[sum_s c_s, ...] -> [sum_s c'_s, ...]`` with a different
    number of rows for every shard (one local shard only; the collective token lookup,
    :mod:`pykeen_bess.distributed.lookup`);

* **along the column axis** (the encoding partition, :mod:`pykeen_bess.tables.encoding`): a process holds
  ``Lc`` of the ``n_column`` column parts of every row; :meth:`Topology.column_sum` sums partial
  results ``[Lc, ...] -> [...]`` over all parts, differentiably (its backward is the identity on
  every part). Token (row) topologies have one column part.

* **over the processes** (not differentiable): :meth:`~Topology.all_reduce` (sum or maximum,
  complex tensors as their real view), :meth:`~Topology.all_reduce_coalesced` (many tensors in one
  call per dtype), :meth:`~Topology.broadcast_`, :meth:`~Topology.broadcast_object`,
  :meth:`~Topology.all_gather_object` and :meth:`~Topology.barrier`. Ranks passed to them
  (``source``) are relative to the topology's group, never global ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal

import torch


__all__ = [
    "LocalTopology",
    "ProbeTopology",
    "ReduceOp",
    "Topology",
    "check_leading",
]

#: the reductions of :meth:`Topology.all_reduce`
ReduceOp = Literal["sum", "max"]


class Topology(ABC):
    """The shards of this process and the collectives between processes."""

    #: the total number of shards
    n_shard: int
    #: the shards held by this process, in the order of the leading local axis
    local_shards: tuple[int, ...]
    #: the number of column parts of every row (the encoding partition; 1: whole rows)
    n_column: int = 1
    #: the column parts held by this process
    local_columns: tuple[int, ...] = (0,)

    # -- layout ----------------------------------------------------------------------------------

    @property
    def n_local(self) -> int:
        """The number of shards held by this process (``L``)."""
        return len(self.local_shards)

    @property
    def holds_all_shards(self) -> bool:
        """Whether this process holds every shard (no other process holds entity rows)."""
        return self.n_local == self.n_shard

    @property
    def is_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return False

    @property
    def rank(self) -> int:
        """Return this process' rank in the topology's group (0 in one process)."""
        return 0

    @property
    def world_size(self) -> int:
        """The number of processes (1 in one process)."""
        return 1

    @property
    def is_main_process(self) -> bool:
        """Whether this process shows progress, logs and writes shared outputs."""
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where small bookkeeping tensors (losses, counts, flags) must be for the collectives."""
        return torch.device("cpu")

    @property
    def replicas(self) -> int:
        """The number of processes holding each shard (1: no replicas)."""
        return 1

    @property
    def replica(self) -> int:
        """Which replica of its shards this process is (0 without replicas)."""
        return 0

    def replica_slots(self, block_size: int) -> tuple[int, int]:
        """Return the slots ``[start, stop)`` of every block this replica trains.

        The replicas of a shard split every block's slot axis into consecutive parts (the last may be
        shorter or empty), so that they train different positives of the same global plan and a step
        of all replicas is one step of the plan.
        """
        part = -(-block_size // self.replicas)
        start = min(self.replica * part, block_size)
        return start, min(start + part, block_size)

    def local_index(self) -> torch.Tensor:
        """Return the local shard ids as a long tensor of shape ``[L]``."""
        return torch.as_tensor(self.local_shards, dtype=torch.long)

    def select_local(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Select the local shards' entries of a global plan along ``dim``.

        Consecutive local shards (one per rank, or all of them) are a view (no index moves to ``x``'s device).

        :param x: shape: ``[..., n, ...]`` with the shard axis at ``dim``
        :returns: shape: ``[..., L, ...]``
        """
        if self.holds_all_shards:
            return x
        first = self.local_shards[0]
        if self.local_shards == tuple(range(first, first + self.n_local)):
            return x.narrow(dim, first, self.n_local)
        return x.index_select(dim, self.local_index().to(x.device))

    # -- along the shard axis (differentiable) ---------------------------------------------------

    @abstractmethod
    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Exchange messages between all pairs of shards.

        :param x: shape: ``[L, n, ...]``, ``x[l, s]`` goes from local shard ``l`` to shard ``s``
        :returns: shape: ``[L, n, ...]``, ``y[l, s]`` came from shard ``s`` to local shard ``l``
        """

    @abstractmethod
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Give every shard the tensors of all shards.

        :param x: shape: ``[L, ...]``
        :returns: shape: ``[L, n, ...]``, ``y[l, s] = x`` of shard ``s``
        """

    def all_gather_once(self, x: torch.Tensor) -> torch.Tensor:
        """Give the process the tensors of all shards once, not once per local shard (differentiable).

        :param x: shape: ``[L, ...]``
        :returns: shape: ``[n, ...]``, ``y[s] = x`` of shard ``s`` (what :meth:`all_gather` gives every local shard)
        """
        return self.all_gather(x)[0]

    @abstractmethod
    def gather_shards(self, x: torch.Tensor) -> torch.Tensor | None:
        """Collect every shard's tensor on the main process (not differentiable).

        :param x: shape: ``[L, ...]``, the same trailing shape on every process
        :returns: shape: ``[n, ...]`` in shard order on the main process, None on the others
        """

    def all_to_all_uneven(
        self, x: torch.Tensor, send_sizes: Sequence[int], receive_sizes: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Send ``send_sizes[s]`` consecutive rows of ``x`` to shard ``s`` (differentiable; one local shard).

        :param x: shape: ``[sum(send_sizes), ...]``, the rows for shard 0, then shard 1, ...
        :param send_sizes: the number of rows for each of the ``n`` shards
        :param receive_sizes: the number of rows each shard sends here, if known (else exchanged first)
        :returns: shape: ``[sum(receive_sizes), ...]``, the rows every shard sent here, in shard order,
            and ``receive_sizes``
        :raises NotImplementedError: for a process holding several shards (it needs no messages)
        """
        if self.n_local == 1 and self.n_shard == 1:
            return x, [int(send_sizes[0])]
        raise NotImplementedError(f"{type(self).__name__} holds {self.n_local} shards: look the rows up locally.")

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum every shard's message for each local shard (differentiable; the backward is an all-gather).

        Implemented as an all-to-all followed by a sum in shard order: on gloo
        ``reduce_scatter_tensor`` is a full all-reduce, the all-to-all sends ``n`` times less.

        :param x: shape: ``[L, n, ...]``, ``x[l, s]`` is local shard ``l``'s part for shard ``s``
        :returns: shape: ``[L, ...]``, ``y[l] = sum_s x_s[l]`` over the shards ``s``
        """
        return self.all_to_all(x).sum(dim=1)

    # -- along the column axis (differentiable) --------------------------------------------------

    @property
    def holds_all_columns(self) -> bool:
        """Whether this process holds every column part of its rows."""
        return len(self.local_columns) == self.n_column

    def column_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results over all column parts (differentiable; the backward is the identity).

        :param x: shape: ``[Lc, ...]``, the results of the local column parts
        :returns: shape: ``[...]``, the sum over all ``n_column`` parts (on every process)
        """
        check_leading(x, len(self.local_columns))
        return x.sum(dim=0)

    def column_all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Exchange messages between all pairs of column parts (differentiable).

        :param x: shape: ``[Lc, c, ...]``, ``x[l, p]`` goes from local part ``l`` to part ``p``
        :returns: shape: ``[Lc, c, ...]``, ``y[l, p]`` came from part ``p`` to local part ``l``
        """
        check_leading(x, len(self.local_columns), self.n_column)
        if not self.holds_all_columns:
            raise NotImplementedError(f"{type(self).__name__} cannot exchange column parts between processes.")
        return x.transpose(0, 1)

    # -- over the processes ----------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce a tensor over the processes (not differentiable, not in place).

        :param x: any shape and dtype, complex included
        :param op: ``"sum"`` or ``"max"``
        :returns: the reduction, same shape, dtype and device as ``x``
        """
        return x.detach().clone()

    def shard_all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce over the processes of this replica, one per shard (all processes without replicas).

        :param x: any shape and dtype, complex included
        :param op: ``"sum"`` or ``"max"``
        :returns: the reduction, same shape, dtype and device as ``x``
        """
        return self.all_reduce(x, op)

    def replica_reduce_rows(self, rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum row-sparse values over the replicas of this process' shard (the identity without replicas).

        :param rows: shape: ``[U]``, unique rows
        :param values: shape: ``[U, D]``
        :returns: the union of all replicas' rows, sorted, and their summed values
        """
        return rows, values

    def replica_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a dense tensor over the replicas of this process' shard (a copy without replicas)."""
        return x.detach().clone()

    def replica_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Give every replica of this process' shard the tensors of all of them (not differentiable; fixed shapes).

        :param x: the same shape and dtype on every replica
        :returns: shape: ``[R, *x.shape]``, in replica order (``[1, *x.shape]`` without replicas)
        """
        return x.detach().unsqueeze(0)

    def all_reduce_coalesced(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Sum many tensors over the processes with one collective per dtype (not in place).

        :param tensors: any shapes and dtypes
        :returns: the sums, in the order of ``tensors``
        """
        return [x.detach().clone() for x in tensors]

    def broadcast_(self, x: torch.Tensor, source: int = 0) -> torch.Tensor:
        """Overwrite ``x`` in place with the tensor of process ``source`` (a rank in this topology's group)."""
        return x

    def broadcast_object(self, value: Any, source: int = 0) -> Any:
        """Return process ``source``'s picklable value on every process."""
        return value

    def all_gather_object(self, value: Any) -> list[Any]:
        """Return every process' picklable value, in rank order."""
        return [value]

    def barrier(self) -> None:  # noqa: B027 - a single process has nothing to wait for
        """Wait for all processes."""

    def agree(self, ok: bool) -> bool:
        """Return whether ``ok`` holds on every process (one collective)."""
        failures = self.all_reduce(torch.tensor([0 if ok else 1], dtype=torch.long, device=self.device))
        return int(failures[0]) == 0


class LocalTopology(Topology):
    """All ``n`` shards (and all column parts) in one process: the shard collectives are transposes and broadcasts."""

    def __init__(self, n_shard: int, n_column: int = 1):
        """Hold ``n_shard`` logical shards of rows split in ``n_column`` logical column parts."""
        for name, value in (("num_shards", n_shard), ("the number of column parts", n_column)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, but is {value!r}.")
        self.n_shard = int(n_shard)
        self.local_shards = tuple(range(self.n_shard))
        self.n_column = int(n_column)
        self.local_columns = tuple(range(self.n_column))

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_leading(x, self.n_shard, self.n_shard)
        return x.transpose(0, 1)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_leading(x, self.n_shard)
        # every local shard sees all shards' tensors; expand keeps this a view and sums gradients
        return x.unsqueeze(0).expand(self.n_shard, *x.shape)

    def all_gather_once(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_leading(x, self.n_shard)
        return x

    def gather_shards(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_leading(x, self.n_shard)
        return x.detach()

    def __repr__(self) -> str:
        columns = f", n_column={self.n_column}" if self.n_column > 1 else ""
        return f"{self.__class__.__name__}(n_shard={self.n_shard}{columns})"


class ProbeTopology(Topology):
    """The layout of another topology without communication, for memory probes.

    A probe must not enter a collective: a rank that runs out of memory would leave the others
    waiting. The shard collectives return tensors of the shapes (and sizes) the real ones would
    return, filled with local data; the process collectives act as in one process.
    """

    def __init__(self, topology: Topology):
        """Mirror ``topology``'s layout (shards and replicas)."""
        self.n_shard = topology.n_shard
        self.local_shards = topology.local_shards
        self.n_column = topology.n_column
        self.local_columns = topology.local_columns
        self._replicas = topology.replicas
        self._replica = topology.replica

    @property
    def replicas(self) -> int:  # noqa: D102
        return self._replicas

    @property
    def replica(self) -> int:  # noqa: D102
        return self._replica

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.clone()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.unsqueeze(1).expand(x.shape[0], self.n_shard, *x.shape[1:]).clone()

    def gather_shards(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.detach()

    def column_all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.clone()


def check_leading(x: torch.Tensor, *sizes: int) -> None:
    """Raise an error unless ``x`` has the given leading dimensions."""
    if tuple(x.shape[: len(sizes)]) != tuple(sizes):
        raise ValueError(f"Expected leading dimensions {list(sizes)}, got shape {list(x.shape)}.")
