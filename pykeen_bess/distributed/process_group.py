"""The topology of a ``torch.distributed`` process group: one shard per rank, optionally replicated.

The ranks of the group hold ``n`` shards, each in ``R`` replicas
(:class:`~pykeen_bess.distributed.groups.RankLayout`); ``R = 1`` is one shard per rank. The
topology uses three groups:

* the **shard group** of a rank: one rank per shard, all of the rank's replica index (shard order);
  a step's all-to-all and all-gather run here;
* the **replica group**: the ranks holding the rank's shard; the row-sparse gradients of the shard
  are summed here before every optimizer step (:meth:`DistributedTopology.replica_reduce_rows`);
* the **world** (the given group): losses, replicated gradients, configuration checks, barriers.

With ``R = 1`` the shard group is the world and no group is created.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .collectives import (
    all_gather_differentiable,
    all_reduce_identity_backward,
    all_to_all_differentiable,
    all_to_all_uneven_differentiable,
)
from .groups import RankLayout, describe_differences
from .topology import ReduceOp, Topology, check_leading

__all__ = [
    "ColumnTopology",
    "DistributedTopology",
]


class DistributedTopology(Topology):
    """The shards (and replicas) of the ranks of a ``torch.distributed`` process group.

    :attr:`bytes_sent` counts the payload the shard collectives of this process sent to other
    ranks (forward and backward); :attr:`replica_bytes_sent` the payload of the replicas'
    gradient sums.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        layout: RankLayout | None = None,
        shard_group: dist.ProcessGroup | None = None,
        replica_group: dist.ProcessGroup | None = None,
    ):
        """Use an initialised process group (default: the world).

        :param group: the process group of all ranks taking part (the world)
        :param layout: the shards and replicas of the ranks (default: one shard per rank)
        :param shard_group: this rank's shard group, if it exists already (e.g. from a device mesh);
            created (collectively) otherwise
        :param replica_group: this rank's replica group, likewise
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedTopology needs an initialised torch.distributed process group.")
        self.group = group
        world_size = dist.get_world_size(group)
        self.layout = layout if layout is not None else RankLayout.create(world_size)
        if self.layout.world_size != world_size:
            raise ValueError(f"The layout is for {self.layout.world_size} ranks, the group has {world_size}.")
        self._rank = dist.get_rank(group)
        self.n_shard = self.layout.num_shards
        self.local_shards = (self.layout.shard_of(self._rank),)
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(group) == "nccl"
            else torch.device("cpu")
        )
        if self.layout.replicas == 1:
            self.shard_group, self.replica_group = group, None
        elif shard_group is not None and replica_group is not None:
            self.shard_group, self.replica_group = shard_group, replica_group
        else:
            # every rank creates every group, in the same order (torch.distributed requires it)
            global_ranks = [self._global(r) for r in range(world_size)]
            self.shard_group = self._own_group([[global_ranks[r] for r in g] for g in self.layout.shard_groups()])
            self.replica_group = self._own_group([[global_ranks[r] for r in g] for g in self.layout.replica_groups()])
        #: bytes sent to other ranks by the shard collectives of this topology
        self.bytes_sent = 0
        #: bytes sent to other ranks by the replicas' gradient sums
        self.replica_bytes_sent = 0

    @staticmethod
    def check_same_settings(group: dist.ProcessGroup | None, settings: dict[str, Any]) -> None:
        """Check that every rank of ``group`` passes the same layout settings (collective, before any subgroup exists).

        :raises ValueError: naming every setting that differs and each rank's value
        """
        values: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(values, settings, group=group)
        message = describe_differences(values)
        if message:
            raise ValueError(f"The ranks of the process group run different configurations:\n{message}")

    def _own_group(self, groups: list[list[int]]) -> dist.ProcessGroup:
        own, _ = dist.new_subgroups_by_enumeration(groups)
        return own

    # -- layout ----------------------------------------------------------------------------------

    @property
    def is_distributed(self) -> bool:  # noqa: D102
        return self.layout.world_size > 1

    @property
    def rank(self) -> int:  # noqa: D102
        return self._rank

    @property
    def world_size(self) -> int:  # noqa: D102
        return self.layout.world_size

    @property
    def replicas(self) -> int:  # noqa: D102
        return self.layout.replicas

    @property
    def replica(self) -> int:  # noqa: D102
        return self.layout.replica_of(self._rank)

    @property
    def device(self) -> torch.device:  # noqa: D102
        return self._device

    def _global(self, rank: int) -> int:
        """Return the global rank of a rank of this topology's (world) group."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # -- shard axis ------------------------------------------------------------------------------

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_leading(x, 1, self.n_shard)
        return all_to_all_differentiable(self, x[0]).unsqueeze(0)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_leading(x, 1)
        return all_gather_differentiable(self, x[0]).unsqueeze(0)

    def gather_shards(self, x: torch.Tensor) -> torch.Tensor | None:  # noqa: D102
        check_leading(x, 1)
        if self.replica != 0:  # one replica of every shard takes part (replica 0, whose shard 0 is rank 0)
            return None
        local = x[0].detach().contiguous()
        shard = self.local_shards[0]
        pieces = [torch.empty_like(local) for _ in range(self.n_shard)] if shard == 0 else None
        destination = self._global(self.layout.rank_of(0, 0))
        dist.gather(local, gather_list=pieces, dst=destination, group=self.shard_group)
        return None if pieces is None else torch.stack(pieces)

    def all_to_all_primitive(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, ...] -> [n, ...]``: slice ``s`` goes to rank ``s`` of the shard group (see :meth:`all_to_all`).

        (:class:`ColumnTopology`: its shard group is all ranks, one column part each.)
        """
        x = x.contiguous()
        output = torch.empty_like(x)
        dist.all_to_all_single(output, x, group=self.shard_group)
        size = x.shape[0]
        self.bytes_sent += x.numel() * x.element_size() * (size - 1) // size
        return output

    def all_to_all_uneven(  # noqa: D102
        self, x: torch.Tensor, send_sizes: Sequence[int], receive_sizes: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        send = [int(size) for size in send_sizes]
        if len(send) != self.n_shard or x.shape[0] != sum(send):
            raise ValueError(f"Expected {self.n_shard} sizes summing to {x.shape[0]}, got {send}.")
        if receive_sizes is None:
            sizes = torch.tensor(send, dtype=torch.long, device=self._device)
            received = torch.empty_like(sizes)
            dist.all_to_all_single(received, sizes, group=self.shard_group)
            receive = received.tolist()
        else:
            receive = [int(size) for size in receive_sizes]
        return all_to_all_uneven_differentiable(self, x, send, receive), receive

    def all_to_all_uneven_primitive(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """``[sum(send), ...] -> [sum(receive), ...]`` (the primitive of :meth:`all_to_all_uneven`)."""
        staged = x.contiguous().to(self._device)
        output = staged.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(output, staged, receive, send, group=self.shard_group)
        own = self.local_shards[0]
        row = staged[0].numel() * staged.element_size() if staged.shape[0] else 0
        self.bytes_sent += (sum(send) - send[own]) * row
        return output.to(x.device)

    def all_gather_primitive(self, x: torch.Tensor) -> torch.Tensor:
        """``[...] -> [n, ...]`` (the primitive of :meth:`all_gather`)."""
        x = x.contiguous()
        output = [torch.empty_like(x) for _ in range(self.n_shard)]
        dist.all_gather(output, x, group=self.shard_group)
        self.bytes_sent += x.numel() * x.element_size() * (self.n_shard - 1)
        return torch.stack(output)

    def shard_all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:  # noqa: D102
        return self._all_reduce(x, op, self.shard_group)

    # -- replicas --------------------------------------------------------------------------------

    def replica_reduce_rows(self, rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum row-sparse values over the replicas of this process' shard (the union of their rows).

        Every replica sends its rows and values (padded to the largest number of rows) to the others
        with two all-gathers (no sparse all-reduce is needed, so NCCL works too); every replica then
        adds them up in replica order, so all replicas get bitwise identical results.

        :param rows: shape: ``[U]``, unique rows of this replica
        :param values: shape: ``[U, D]``
        :returns: the union of the rows, sorted, ``[U']``, and their summed values ``[U', D]``
        """
        if self.replicas == 1:
            return rows, values
        counts = [torch.zeros(1, dtype=torch.long, device=self._device) for _ in range(self.replicas)]
        dist.all_gather(counts, torch.tensor([rows.numel()], device=self._device), group=self.replica_group)
        sizes = [int(c) for c in counts]
        width = max(sizes)
        padded_rows = torch.full((width,), -1, dtype=torch.long, device=self._device)
        padded_rows[: rows.numel()] = rows.to(self._device)
        padded_values = values.new_zeros((width, *values.shape[1:])).to(self._device)
        padded_values[: rows.numel()] = values.to(self._device)
        gathered_rows = [torch.empty_like(padded_rows) for _ in range(self.replicas)]
        gathered_values = [torch.empty_like(padded_values) for _ in range(self.replicas)]
        dist.all_gather(gathered_rows, padded_rows, group=self.replica_group)
        dist.all_gather(gathered_values, padded_values, group=self.replica_group)
        self.replica_bytes_sent += (self.replicas - 1) * (
            padded_rows.numel() * padded_rows.element_size() + padded_values.numel() * padded_values.element_size()
        )
        all_rows = torch.cat([r[:size] for r, size in zip(gathered_rows, sizes)])
        union, position = torch.unique(all_rows, return_inverse=True)
        summed = values.new_zeros((union.numel(), *values.shape[1:])).to(self._device)
        # one replica at a time: its rows are unique, so no two additions meet in one row (deterministic
        # on every device, also where index_add_ uses atomics) and every replica adds in the same order
        for index, (part, size) in enumerate(zip(position.split(sizes), sizes)):
            summed.index_add_(0, part, gathered_values[index][:size])
        return union.to(rows.device), summed.to(values.device)

    def replica_all_gather(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if self.replicas == 1:
            return x.detach().unsqueeze(0)
        staged = x.detach().contiguous().to(self._device)
        pieces = [torch.empty_like(staged) for _ in range(self.replicas)]
        dist.all_gather(pieces, staged, group=self.replica_group)
        self.replica_bytes_sent += (self.replicas - 1) * staged.numel() * staged.element_size()
        return torch.stack(pieces).to(x.device)

    def replica_all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if self.replicas == 1:
            return x.detach().clone()
        y = self._all_reduce(x, "sum", self.replica_group)
        self.replica_bytes_sent += 2 * x.numel() * x.element_size() * (self.replicas - 1) // self.replicas
        return y

    # -- processes -------------------------------------------------------------------------------

    def _all_reduce(self, x: torch.Tensor, op: ReduceOp, group: Any) -> torch.Tensor:
        complex_ = x.is_complex()
        y = (torch.view_as_real(x) if complex_ else x).detach().to(self._device, copy=True)
        dist.all_reduce(y, op=reduce_op(op), group=group)
        y = y.to(x.device)
        return torch.view_as_complex(y) if complex_ else y

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:  # noqa: D102
        return self._all_reduce(x, op, self.group)

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
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        return values

    def barrier(self) -> None:  # noqa: D102
        dist.barrier(group=self.group)

    def __repr__(self) -> str:
        return (
            f"{self.__class__.__name__}(rank={self._rank}, n_shard={self.n_shard}, replicas={self.replicas}, "
            f"grouping={self.layout.grouping!r})"
        )


class ColumnTopology(DistributedTopology):
    """The encoding partition on a process group: every rank holds all rows and one column part of them.

    The row axis has one shard, held by every rank, so the shard collectives are local; what the
    ranks share is the column axis: :meth:`column_sum` all-reduces partial results (backward: the
    identity), and sums of table quantities (:meth:`shard_all_reduce`, e.g. gradient norms for
    clipping) run over the ranks of the column parts. :attr:`bytes_sent` counts the column sums as
    a ring all-reduce sends them, ``2 (c - 1) / c`` times the payload.

    With replicas the layout's shards are the column parts: the **shard group** of a rank holds one
    rank per column part (its column sums run there), the **replica group** the ranks of its column
    part (their row gradients are summed there, as for row shards).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        layout: RankLayout | None = None,
        shard_group: dist.ProcessGroup | None = None,
        replica_group: dist.ProcessGroup | None = None,
    ):
        """Use an initialised process group (default: the world); one column part per rank (without replicas).

        :param group: the process group of all ranks taking part (the world)
        :param layout: the column parts (as shards) and replicas of the ranks (default: one part per rank)
        :param shard_group: this rank's group of column parts, if it exists already; created otherwise
        :param replica_group: this rank's replica group, likewise
        """
        super().__init__(group, layout, shard_group, replica_group)
        self.n_column = self.layout.num_shards
        self.local_columns = self.local_shards  # the layout's shard of this rank is its column part
        self.n_shard = 1
        self.local_shards = (0,)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_leading(x, 1, 1)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_leading(x, 1)
        return x.unsqueeze(1)

    def gather_shards(self, x: torch.Tensor) -> torch.Tensor | None:  # noqa: D102
        check_leading(x, 1)
        return x.detach() if self._rank == 0 else None

    def shard_all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:  # noqa: D102
        return self._all_reduce(x, op, self.shard_group)  # the table's columns are spread over the parts

    def column_sum(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_leading(x, 1)
        return all_reduce_identity_backward(self, x[0])

    def column_all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        check_leading(x, 1, self.n_column)
        return all_to_all_differentiable(self, x[0]).unsqueeze(0)

    def row_topology(self) -> DistributedTopology:
        """Return the token topology of the same ranks and groups (column part ``k``'s ranks hold row shard ``k``)."""
        return DistributedTopology(self.group, self.layout, self.shard_group, self.replica_group)

    def column_all_reduce_primitive(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the column parts (the primitive of :meth:`column_sum`), counting a ring all-reduce's bytes."""
        y = self._all_reduce(x, "sum", self.shard_group)
        self.bytes_sent += 2 * (self.n_column - 1) * x.numel() * x.element_size() // self.n_column
        return y

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(rank={self._rank}, n_column={self.n_column}, replicas={self.replicas})"


def reduce_op(op: ReduceOp) -> Any:
    """Return the ``torch.distributed`` reduction of ``"sum"`` or ``"max"``."""
    if op == "sum":
        return dist.ReduceOp.SUM
    if op == "max":
        return dist.ReduceOp.MAX
    raise ValueError(f"Unknown reduction {op!r}; expected 'sum' or 'max'.")
