"""Collective token lookup: the rows of any entities from a table sharded over processes.

A model trained under a process group keeps its entity tables sharded: each rank holds the rows
of its shard (seed 001's *token* strategy). To score arbitrary triples (``model.score_hrt``,
``predict_target``, the entity representation itself), every rank of a shard group asks for the
rows of its own entity ids, which differ from rank to rank, and all ranks answer each other's
requests in the same collective. Two variants, one class each, give the same rows and gradients:

* :class:`RoutedTokenLookup` (``"routed"``, the default): the ids go to their owners and the rows
  come back, two all-to-alls with a different number of rows per pair of ranks
  (:meth:`~pykeen_bess.distributed.Topology.all_to_all_uneven`); only requested rows move.
* :class:`GatheredTokenLookup` (``"gathered"``): seed 001's static-shape form; the ids are
  all-gathered (padded to the longest request), every rank looks up the rows it owns with the
  others masked to zero, and a reduce-scatter sums each rank's rows
  (:meth:`~pykeen_bess.distributed.Topology.reduce_scatter`); every rank sends ``n - 1`` times
  the longest request's rows, most of them zeros, but all shapes are known before the call.

Both are differentiable: the gradient of a looked-up row reaches the owner's table (tables that
are parameters of the model; rows of a storage tier outside the model are read detached). Every
rank of the shard group must call the lookup together (like any collective); a rank that does not
makes the others fail after the collective timeout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
from class_resolver import ClassResolver

if TYPE_CHECKING:
    from ..representation import ShardedEmbedding

__all__ = [
    "GatheredTokenLookup",
    "RoutedTokenLookup",
    "TokenLookup",
    "lookup_entities",
    "token_lookup_resolver",
]


class TokenLookup(ABC):
    """Looks up the stored rows of global entity ids in a table whose shards are spread over processes."""

    #: the variant's short name
    name: ClassVar[str]

    def __call__(self, table: ShardedEmbedding, entities: torch.Tensor) -> torch.Tensor:
        """Return the stored rows of the entities (collective over the table's shard group).

        :param table: a shard table holding one shard of a process group
        :param entities: shape: ``s``, global entity ids (any, different on every rank)
        :returns: shape: ``[*s, row_width]``, on the table's compute device
        :raises ValueError: for ids outside ``[0, num_entities)``
        """
        flat = entities.reshape(-1).to(torch.long).cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= table.max_id):
            raise ValueError(f"Entity ids must lie in [0, {table.max_id}), got {flat.min()}..{flat.max()}.")
        rows = self.lookup(table, flat)
        return rows.view(*entities.shape, table.row_width)

    @abstractmethod
    def lookup(self, table: ShardedEmbedding, entities: torch.Tensor) -> torch.Tensor:
        """Return ``[M, row_width]`` rows for ``[M]`` global ids (CPU) on the compute device."""


def _owned_rows(table: ShardedEmbedding, rows: torch.Tensor) -> torch.Tensor:
    """Read flat local rows ``[U]`` of the table, differentiably for a parameter (on the compute device)."""
    return table.storage.lookup_rows(table.weight, rows)


class RoutedTokenLookup(TokenLookup):
    """Ids to their owners, rows back: two uneven all-to-alls; only the requested rows move."""

    name = "routed"

    def lookup(self, table: ShardedEmbedding, entities: torch.Tensor) -> torch.Tensor:  # noqa: D102
        topology = table.topology
        sharding = table.sharding
        owners = sharding.entity_shard[entities]
        order = torch.argsort(owners, stable=True)
        send_sizes = torch.bincount(owners, minlength=sharding.n_shard).tolist()
        # ids (local to their owner) to the owners; their requests of this rank's shard arrive here
        requested, received = topology.all_to_all_uneven(sharding.entity_local[entities[order]], send_sizes)
        values = _owned_rows(table, requested.cpu())
        # the answers: as many rows back to each shard as it asked for, exactly what this rank asked for returns
        answered, _ = topology.all_to_all_uneven(values, received, receive_sizes=send_sizes)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return answered.index_select(0, inverse.to(answered.device))


class GatheredTokenLookup(TokenLookup):
    """Seed 001's static-shape lookup: all-gather the ids, masked local lookup, reduce-scatter of the rows."""

    name = "gathered"

    def lookup(self, table: ShardedEmbedding, entities: torch.Tensor) -> torch.Tensor:  # noqa: D102
        topology = table.topology
        count = torch.tensor([entities.numel()], dtype=torch.long, device=topology.device)
        longest = int(topology.shard_all_reduce(count, "max")[0])
        padded = torch.full((longest,), -1, dtype=torch.long)
        padded[: entities.numel()] = entities
        ids = topology.all_gather(padded.to(topology.device).unsqueeze(0))[0].cpu()  # [n, longest]
        rows = torch.where(ids >= 0, table.entity_rows[ids.clamp_min(0)], -1)
        owned = rows >= 0  # ids of other shards (and padding) give zero rows
        values = _owned_rows(table, rows.clamp_min(0).view(-1)).view(*ids.shape, table.row_width)
        values = values * owned.to(values.device).unsqueeze(-1).to(values.dtype)
        summed = topology.reduce_scatter(values.unsqueeze(0))[0]  # [longest, row_width]
        return summed[: entities.numel()]


#: the token lookup variants, by name (``"routed"``, ``"gathered"``) or class
token_lookup_resolver: ClassResolver[TokenLookup] = ClassResolver(
    [RoutedTokenLookup, GatheredTokenLookup],
    base=TokenLookup,  # type: ignore[type-abstract]
    suffix="TokenLookup",
)


def lookup_entities(table: ShardedEmbedding, entities: torch.Tensor, variant: str = "routed") -> torch.Tensor:
    """Return the stored rows ``[*s, row_width]`` of global entity ids ``s`` from a sharded table.

    A process holding every shard reads them directly; under a process group this is a collective
    of the table's shard group (see the module docstring).

    :raises ValueError: for a column part of a table (the encoding partition while it trains)
    """
    if getattr(table, "column_part", None) is not None:
        raise ValueError(
            "This entity table holds one column part of every row (partition='encoding' while training): whole "
            "rows exist after training, when the parts are row shards."
        )
    if table.holds_all_shards:
        rows = table.entity_rows[entities.reshape(-1).to(table.entity_rows.device)]
        return _owned_rows(table, rows).view(*entities.shape, table.row_width)
    return token_lookup_resolver.make(variant)(table, entities)
