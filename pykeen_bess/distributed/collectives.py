"""Differentiable shard collectives of :class:`~pykeen_bess.distributed.process_group.DistributedTopology`.

* all-to-all: its backward is the all-to-all of the gradients (also with uneven splits, whose
  backward swaps the send and receive sizes);
* all-reduce sum over the column parts: its backward is the identity (every part's partial result
  enters the sum once, so its gradient is the sum's gradient);
* all-gather: its backward sends each rank's gradient for rank ``s``' slice to rank ``s``, which sums
  what arrives (an all-to-all, which gloo supports, unlike reduce-scatter).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = [
    "all_gather_differentiable",
    "all_reduce_identity_backward",
    "all_to_all_differentiable",
    "all_to_all_uneven_differentiable",
]


class ShardPrimitives(Protocol):
    """The non-differentiable collectives of a process group's shards (:class:`DistributedTopology`)."""

    def all_to_all_primitive(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, ...] -> [n, ...]``: slice ``s`` goes to rank ``s``."""

    def all_to_all_uneven_primitive(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """``[sum(send), ...] -> [sum(receive), ...]``."""

    def all_gather_primitive(self, x: torch.Tensor) -> torch.Tensor:
        """``[...] -> [n, ...]``."""


class ColumnPrimitives(Protocol):
    """The non-differentiable collective of a process group's column parts (:class:`ColumnTopology`)."""

    def column_all_reduce_primitive(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks."""


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, topology: ShardPrimitives, x: torch.Tensor) -> torch.Tensor:
        ctx.topology = topology
        return topology.all_to_all_primitive(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, ctx.topology.all_to_all_primitive(grad)


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, topology: ShardPrimitives, x: torch.Tensor, send: list[int], receive: list[int]
    ) -> torch.Tensor:
        ctx.topology, ctx.send, ctx.receive = topology, send, receive
        return topology.all_to_all_uneven_primitive(x, send, receive)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        return None, ctx.topology.all_to_all_uneven_primitive(grad, ctx.receive, ctx.send), None, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, topology: ColumnPrimitives, x: torch.Tensor) -> torch.Tensor:
        return topology.column_all_reduce_primitive(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, topology: ShardPrimitives, x: torch.Tensor) -> torch.Tensor:
        ctx.topology = topology
        return topology.all_gather_primitive(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        # grad[s] is this rank's gradient for rank s' slice: send it there, sum what arrives
        return None, ctx.topology.all_to_all_primitive(grad).sum(dim=0)


def all_to_all_differentiable(topology: ShardPrimitives, x: torch.Tensor) -> torch.Tensor:
    """``[n, ...] -> [n, ...]``: slice ``s`` goes to rank ``s``; differentiable."""
    return _AllToAll.apply(topology, x)


def all_gather_differentiable(topology: ShardPrimitives, x: torch.Tensor) -> torch.Tensor:
    """``[...] -> [n, ...]``: every rank's tensor; differentiable."""
    return _AllGather.apply(topology, x)


def all_to_all_uneven_differentiable(
    topology: ShardPrimitives, x: torch.Tensor, send: list[int], receive: list[int]
) -> torch.Tensor:
    """``[sum(send), ...] -> [sum(receive), ...]``: ``send[s]`` rows go to rank ``s``; differentiable."""
    return _AllToAllUneven.apply(topology, x, send, receive)


def all_reduce_identity_backward(topology: ColumnPrimitives, x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks; the backward passes the gradient through unchanged (column sums)."""
    return _AllReduceSum.apply(topology, x)
