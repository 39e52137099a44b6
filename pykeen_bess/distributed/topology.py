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

* **over the processes** (not differentiable): :meth:`~Topology.all_reduce` (sum or maximum,
  complex tensors as their real view), :meth:`~Topology.all_reduce_coalesced` (many tensors in one
  call per dtype), :meth:`~Topology.broadcast_`, :meth:`~Topology.broadcast_object`,
  :meth:`~Topology.all_gather_object` and :meth:`~Topology.barrier`. Ranks passed to them
  (``source``) are relative to the topology's group, never global ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from .collectives import all_gather_differentiable, all_to_all_differentiable

__all__ = [
    "DistributedTopology",
    "LocalTopology",
    "ProbeTopology",
    "ReduceOp",
    "Topology",
    "make_topology",
]

#: the reductions of :meth:`Topology.all_reduce`
ReduceOp = Literal["sum", "max"]


class Topology(ABC):
    """The shards of this process and the collectives between processes."""

    #: the total number of shards
    n_shard: int
    #: the shards held by this process, in the order of the leading local axis
    local_shards: tuple[int, ...]

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

    def local_index(self) -> torch.Tensor:
        """Return the local shard ids as a long tensor of shape ``[L]``."""
        return torch.as_tensor(self.local_shards, dtype=torch.long)

    def select_local(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Select the local shards' entries of a global plan along ``dim``.

        :param x: shape: ``[..., n, ...]`` with the shard axis at ``dim``
        :returns: shape: ``[..., L, ...]``
        """
        if self.holds_all_shards:
            return x
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

    @abstractmethod
    def gather_shards(self, x: torch.Tensor) -> torch.Tensor | None:
        """Collect every shard's tensor on the main process (not differentiable).

        :param x: shape: ``[L, ...]``, the same trailing shape on every process
        :returns: shape: ``[n, ...]`` in shard order on the main process, None on the others
        """

    # -- over the processes ----------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce a tensor over the processes (not differentiable, not in place).

        :param x: any shape and dtype, complex included
        :param op: ``"sum"`` or ``"max"``
        :returns: the reduction, same shape, dtype and device as ``x``
        """
        return x.detach().clone()

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
    """All ``n`` shards in one process: the shard collectives are transposes and broadcasts."""

    def __init__(self, n_shard: int):
        """Hold ``n_shard`` logical shards."""
        if isinstance(n_shard, bool) or not isinstance(n_shard, int) or n_shard < 1:
            raise ValueError(f"num_shards must be a positive integer, but is {n_shard!r}.")
        self.n_shard = int(n_shard)
        self.local_shards = tuple(range(self.n_shard))

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_leading(x, self.n_shard, self.n_shard)
        return x.transpose(0, 1)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_leading(x, self.n_shard)
        # every local shard sees all shards' tensors; expand keeps this a view and sums gradients
        return x.unsqueeze(0).expand(self.n_shard, *x.shape)

    def gather_shards(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_leading(x, self.n_shard)
        return x.detach()

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(n_shard={self.n_shard})"


class DistributedTopology(Topology):
    """One shard per rank of a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).

    :attr:`bytes_sent` counts the payload the shard collectives of this process sent to other
    ranks (forward and backward).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        """Use an initialised process group (default: the world)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedTopology needs an initialised torch.distributed process group.")
        self.group = group
        self.n_shard = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        self.local_shards = (self._rank,)
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(group) == "nccl"
            else torch.device("cpu")
        )
        #: bytes sent to other ranks by the shard collectives of this topology
        self.bytes_sent = 0

    @property
    def is_distributed(self) -> bool:  # noqa: D102
        return self.n_shard > 1

    @property
    def rank(self) -> int:  # noqa: D102
        return self._rank

    @property
    def world_size(self) -> int:  # noqa: D102
        return self.n_shard

    @property
    def device(self) -> torch.device:  # noqa: D102
        return self._device

    def _global(self, rank: int) -> int:
        """Return the global rank of a rank of this topology's group."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # -- shard axis ------------------------------------------------------------------------------

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_leading(x, 1, self.n_shard)
        return all_to_all_differentiable(self, x[0]).unsqueeze(0)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_leading(x, 1)
        return all_gather_differentiable(self, x[0]).unsqueeze(0)

    def gather_shards(self, x: torch.Tensor) -> torch.Tensor | None:  # noqa: D102
        _check_leading(x, 1)
        local = x[0].detach().contiguous()
        pieces = [torch.empty_like(local) for _ in range(self.n_shard)] if self._rank == 0 else None
        dist.gather(local, gather_list=pieces, dst=self._global(0), group=self.group)
        return None if pieces is None else torch.stack(pieces)

    def all_to_all_primitive(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, ...] -> [n, ...]``: slice ``s`` goes to rank ``s`` (the primitive of :meth:`all_to_all`)."""
        x = x.contiguous()
        output = torch.empty_like(x)
        dist.all_to_all_single(output, x, group=self.group)
        self.bytes_sent += x.numel() * x.element_size() * (self.n_shard - 1) // self.n_shard
        return output

    def all_gather_primitive(self, x: torch.Tensor) -> torch.Tensor:
        """``[...] -> [n, ...]`` (the primitive of :meth:`all_gather`)."""
        x = x.contiguous()
        output = [torch.empty_like(x) for _ in range(self.n_shard)]
        dist.all_gather(output, x, group=self.group)
        self.bytes_sent += x.numel() * x.element_size() * (self.n_shard - 1)
        return torch.stack(output)

    # -- processes -------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:  # noqa: D102
        complex_ = x.is_complex()
        y = (torch.view_as_real(x) if complex_ else x).detach().to(self._device, copy=True)
        dist.all_reduce(y, op=_reduce_op(op), group=self.group)
        y = y.to(x.device)
        return torch.view_as_complex(y) if complex_ else y

    def all_reduce_coalesced(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:  # noqa: D102
        buckets: dict[torch.dtype, list[int]] = defaultdict(list)
        views = [torch.view_as_real(t) if t.is_complex() else t for t in tensors]
        for index, view in enumerate(views):
            buckets[view.dtype].append(index)
        result: list[torch.Tensor | None] = [None] * len(tensors)
        for indices in buckets.values():
            flat = torch.cat([views[i].detach().reshape(-1).to(self._device) for i in indices])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for i in indices:
                size = views[i].numel()
                value = flat[offset : offset + size].view(views[i].shape).to(tensors[i].device)
                result[i] = torch.view_as_complex(value) if tensors[i].is_complex() else value
                offset += size
        return result  # type: ignore[return-value]

    def broadcast_(self, x: torch.Tensor, source: int = 0) -> torch.Tensor:  # noqa: D102
        if x.device == self._device:
            dist.broadcast(x.data, src=self._global(source), group=self.group)
            return x
        staged = x.detach().to(self._device)
        dist.broadcast(staged, src=self._global(source), group=self.group)
        x.data.copy_(staged)
        return x

    def broadcast_object(self, value: Any, source: int = 0) -> Any:  # noqa: D102
        values = [value if self._rank == source else None]
        dist.broadcast_object_list(values, src=self._global(source), group=self.group)
        return values[0]

    def all_gather_object(self, value: Any) -> list[Any]:  # noqa: D102
        values: list[Any] = [None] * self.n_shard
        dist.all_gather_object(values, value, group=self.group)
        return values

    def barrier(self) -> None:  # noqa: D102
        dist.barrier(group=self.group)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(rank={self._rank}, n_shard={self.n_shard})"


class ProbeTopology(Topology):
    """The layout of another topology without communication, for memory probes.

    A probe must not enter a collective: a rank that runs out of memory would leave the others
    waiting. The shard collectives return tensors of the shapes (and sizes) the real ones would
    return, filled with local data; the process collectives act as in one process.
    """

    def __init__(self, topology: Topology):
        """Mirror ``topology``'s layout."""
        self.n_shard = topology.n_shard
        self.local_shards = topology.local_shards

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.clone()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.unsqueeze(1).expand(x.shape[0], self.n_shard, *x.shape[1:]).clone()

    def gather_shards(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.detach()


def make_topology(num_shards: int | None = None, process_group: Any = None, *, in_process: bool = False) -> Topology:
    """Choose the topology: a process group (given, initialised, or ``torchrun``'s) or logical shards.

    :param num_shards: the number of shards; under a process group it must be None or the group's
        size (one shard per rank); else None means 1
    :param process_group: a ``torch.distributed`` process group (default: the initialised world,
        joining ``torchrun``'s first if this process was started by it)
    :param in_process: hold all shards in this process even inside a process group (e.g. to
        evaluate a model that is not sharded over the processes)
    :returns: the topology
    :raises ValueError: for an invalid ``num_shards``
    """
    from .launch import join_torchrun_group

    if in_process:
        return LocalTopology(1 if num_shards is None else num_shards)
    if process_group is None:
        join_torchrun_group()
    in_group = process_group is not None or (
        dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    )
    if in_group:
        topology = DistributedTopology(process_group)
        if num_shards is not None and num_shards != topology.n_shard:
            raise ValueError(
                f"num_shards={num_shards} differs from the process group's size {topology.n_shard}; under "
                f"torch.distributed every rank holds exactly one shard (leave num_shards unset)."
            )
        return topology
    return LocalTopology(1 if num_shards is None else num_shards)


def _reduce_op(op: ReduceOp) -> Any:
    if op == "sum":
        return dist.ReduceOp.SUM
    if op == "max":
        return dist.ReduceOp.MAX
    raise ValueError(f"Unknown reduction {op!r}; expected 'sum' or 'max'.")


def _check_leading(x: torch.Tensor, *sizes: int) -> None:
    if tuple(x.shape[: len(sizes)]) != tuple(sizes):
        raise ValueError(f"Expected leading dimensions {list(sizes)}, got shape {list(x.shape)}.")
