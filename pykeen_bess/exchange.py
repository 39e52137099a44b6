"""Stage 4 of the pipeline: collective primitives over the shard axis.

BESS algorithms are written once against :class:`Exchange`. A process holds ``L`` of the
``n_shard`` shards ("local shards"); every tensor exchanged has a leading local-shard axis of
size ``L``:

* :meth:`Exchange.all_to_all`: ``[L, n, ...] -> [L, n, ...]``; input ``x[l, s]`` is the message
  from local shard ``l`` to shard ``s``, output ``y[l, s]`` the message shard ``s`` sent to local
  shard ``l``;
* :meth:`Exchange.all_gather`: ``[L, ...] -> [L, n, ...]``; ``y[l, s] = x`` of shard ``s``;
* :meth:`Exchange.all_reduce`: sums a tensor over processes (not shards) — used for counts,
  logging and replicated gradients.

Two back ends implement them: :class:`LocalExchange` (one process holding all ``n`` shards,
``L = n``: the collectives are transposes and broadcasts) and
:class:`DistributedExchange` (one shard per rank of a ``torch.distributed`` process group,
``L = 1``). Both are differentiable, so the backward pass of an exchanged embedding reaches the
shard that owns it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import torch

__all__ = [
    "Exchange",
    "LocalExchange",
    "DistributedExchange",
    "ProbeExchange",
]


class Exchange(ABC):
    """Collective primitives over the shard axis."""

    #: the total number of shards
    n_shard: int
    #: the shards held by this process, in the order of the leading local axis
    local_shards: tuple[int, ...]

    @property
    def n_local(self) -> int:
        """The number of shards held by this process (``L``)."""
        return len(self.local_shards)

    @property
    def is_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return False

    @property
    def is_main_process(self) -> bool:
        """Whether this process reports progress, logs and writes shared outputs."""
        return True

    def local_index(self) -> torch.Tensor:
        """Return the local shard ids as a long tensor of shape ``[L]``."""
        return torch.as_tensor(self.local_shards, dtype=torch.long)

    def select_local(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Select the local shards' entries of a global plan along ``dim``.

        :param x: shape: ``[..., n, ...]`` with the shard axis at ``dim``
        :returns: shape: ``[..., L, ...]``
        """
        if self.n_local == self.n_shard:
            return x
        return x.index_select(dim, self.local_index().to(x.device))

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
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over all processes (not differentiable, not in place).

        :param x: any shape
        :returns: the sum, same shape
        """

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Return the element-wise maximum over all processes."""
        return x.clone()

    def barrier(self) -> None:  # noqa: B027 - a single process has nothing to wait for
        """Wait for all processes."""


class LocalExchange(Exchange):
    """All ``n`` shards in one process: collectives are transposes and broadcasts."""

    def __init__(self, n_shard: int):
        """Create the exchange for ``n_shard`` logical shards."""
        if n_shard < 1:
            raise ValueError(f"n_shard must be positive, but is {n_shard}.")
        self.n_shard = int(n_shard)
        self.local_shards = tuple(range(self.n_shard))

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_leading(x, self.n_shard, self.n_shard)
        return x.transpose(0, 1)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_leading(x, self.n_shard)
        # every local shard sees all shards' tensors; expand keeps this a view and sums gradients
        return x.unsqueeze(0).expand(self.n_shard, *x.shape)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.clone()

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(n_shard={self.n_shard})"


class DistributedExchange(Exchange):
    """One shard per rank of a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).

    The collectives are differentiable: the backward of an all-to-all is the all-to-all of the
    gradients, the backward of an all-gather sums every rank's gradient for a rank's slice and
    returns it to that rank (an all-to-all, which gloo supports, unlike reduce-scatter).
    :attr:`bytes_sent` counts the payload this rank sent to other ranks (forward and backward).
    """

    def __init__(self, group: torch.distributed.ProcessGroup | None = None):
        """Create the exchange over an initialised process group (default: the world)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedExchange needs an initialised torch.distributed process group.")
        self.group = group
        self.n_shard = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local_shards = (self.rank,)
        #: where small bookkeeping tensors (losses, counts, flags) must be for the backend
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(group) == "nccl"
            else torch.device("cpu")
        )
        #: bytes sent to other ranks by the collectives of this exchange
        self.bytes_sent = 0

    @property
    def is_distributed(self) -> bool:  # noqa: D102
        return self.n_shard > 1

    @property
    def is_main_process(self) -> bool:  # noqa: D102
        return self.rank == 0

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_leading(x, 1, self.n_shard)
        return _AllToAll.apply(self, x[0]).unsqueeze(0)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        _check_leading(x, 1)
        return _AllGather.apply(self, x[0]).unsqueeze(0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        import torch.distributed as dist

        y = x.detach().to(self.device, copy=True)
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y.to(x.device)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        import torch.distributed as dist

        y = x.detach().to(self.device, copy=True)
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=self.group)
        return y.to(x.device)

    def barrier(self) -> None:  # noqa: D102
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, ...] -> [n, ...]``: slice ``s`` goes to rank ``s``."""
        import torch.distributed as dist

        x = x.contiguous()
        output = torch.empty_like(x)
        dist.all_to_all_single(output, x, group=self.group)
        self.bytes_sent += x.numel() * x.element_size() * (self.n_shard - 1) // self.n_shard
        return output

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[...] -> [n, ...]``."""
        import torch.distributed as dist

        x = x.contiguous()
        output = [torch.empty_like(x) for _ in range(self.n_shard)]
        dist.all_gather(output, x, group=self.group)
        self.bytes_sent += x.numel() * x.element_size() * (self.n_shard - 1)
        return torch.stack(output)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(rank={self.rank}, n_shard={self.n_shard})"


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: its backward is the all-to-all of the gradients."""

    @staticmethod
    def forward(ctx, exchange: DistributedExchange, x: torch.Tensor) -> torch.Tensor:
        ctx.exchange = exchange
        return exchange._all_to_all(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, ctx.exchange._all_to_all(grad)


class _AllGather(torch.autograd.Function):
    """Differentiable all-gather: its backward returns to each rank the sum of the gradients of its slice."""

    @staticmethod
    def forward(ctx, exchange: DistributedExchange, x: torch.Tensor) -> torch.Tensor:
        ctx.exchange = exchange
        return exchange._all_gather(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        # grad[s] is this rank's gradient for rank s' slice: send it there, sum what arrives
        return None, ctx.exchange._all_to_all(grad).sum(dim=0)


def _check_leading(x: torch.Tensor, *sizes: int) -> None:
    if tuple(x.shape[: len(sizes)]) != tuple(sizes):
        raise ValueError(f"Expected leading dimensions {list(sizes)}, got shape {list(x.shape)}.")


class ProbeExchange(Exchange):
    """The shapes of another exchange without communication, for memory probes.

    A probe must not enter a collective: a rank that runs out of memory would leave the others
    waiting. This exchange returns tensors of the shapes (and sizes) the real collectives would
    return, filled with local data.
    """

    def __init__(self, exchange: Exchange):
        """Mirror ``exchange``'s layout."""
        self.n_shard = exchange.n_shard
        self.local_shards = exchange.local_shards

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.clone()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.unsqueeze(1).expand(x.shape[0], self.n_shard, *x.shape[1:]).clone()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.clone()
