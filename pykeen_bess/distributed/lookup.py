"""Collective token lookup: the rows of any entities from a table sharded over processes.

A model trained under a process group keeps its entity tables sharded: each rank holds the rows
of its shard (the *token* strategy). To score arbitrary triples (``model.score_hrt``,
``predict_target``, the entity representation itself), every rank of a shard group asks for the
rows of its own entity ids, which differ from rank to rank, and all ranks answer each other's
requests in the same collective. Two variants, one class each, give the same rows and gradients:

* :class:`RoutedTokenLookup` (``"routed"``, the default): the ids go to their owners and the rows
  come back, two all-to-alls with a different number of rows per pair of ranks
  (:meth:`~pykeen_bess.distributed.Topology.all_to_all_uneven`); only requested rows move.
* :class:`GatheredTokenLookup` (``"gathered"``): the static-shape form; the ids are
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
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from class_resolver import ClassResolver

from .factory import make_topology
from .topology import Topology

__all__ = [
    "GatheredTokenLookup",
    "RoutedTokenLookup",
    "ShardedTable",
    "TokenLookup",
    "lookup_entities",
    "table_topology",
    "token_lookup_resolver",
]


@runtime_checkable
class ShardedTable(Protocol):
    """What the collectives of this package need of an entity table sharded over processes.

    :class:`~pykeen_bess.tables.representation.ShardedEmbedding` is one; this package does not import it
    (the process layer depends on nothing else of pykeen-bess).
    """

    #: the number of entities
    max_id: int
    #: the width of one stored row
    row_width: int
    #: the entity sharding (``n_shard``, ``shard_size``, ``entity_shard`` ``[E]``, ``entity_local`` ``[E]``)
    sharding: Any
    #: shape: ``[num_entities]``, the flat local row of every global entity, -1 where it is not held here
    entity_rows: torch.Tensor
    #: the process topology of the shards; None: the default one
    topology: Topology | None
    #: the column part of every row the table holds, None for whole rows
    column_part: int | None
    #: the embedding the table replaced (whole rows; a PyKEEN ``Embedding``)
    base_embedding: Any
    #: shape: ``[L * shard_size, row_width]``, the local shards' rows
    weight: torch.Tensor

    @property
    def holds_all_shards(self) -> bool:
        """Whether this process holds every shard."""

    def owned_rows(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """Return flat local rows ``[U, row_width]`` on the compute device (differentiable for a parameter)."""

    def shard_tables(self) -> torch.Tensor:
        """Return the local shards as ``[L, shard_size, row_width]``."""

    def full_table(self) -> torch.Tensor:
        """Return the full ``[num_entities, row_width]`` table in global order (all shards local)."""

    def check_whole(self) -> None:
        """Raise :class:`pickle.PicklingError` if this process holds only some shards."""


def table_topology(table: ShardedTable) -> Topology:
    """Return the topology of a table's shards (the default one where the table has none)."""
    return table.topology if table.topology is not None else make_topology()


class TokenLookup(ABC):
    """Looks up the stored rows of global entity ids in a table whose shards are spread over processes."""

    #: the variant's short name
    name: ClassVar[str]

    def __call__(self, table: ShardedTable, entities: torch.Tensor) -> torch.Tensor:
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
    def lookup(self, table: ShardedTable, entities: torch.Tensor) -> torch.Tensor:
        """Return ``[M, row_width]`` rows for ``[M]`` global ids (CPU) on the compute device."""


class RoutedTokenLookup(TokenLookup):
    """Ids to their owners, rows back: two uneven all-to-alls; only the requested rows move."""

    name = "routed"

    def lookup(self, table: ShardedTable, entities: torch.Tensor) -> torch.Tensor:  # noqa: D102
        topology = table_topology(table)
        sharding = table.sharding
        owners = sharding.entity_shard[entities]
        order = torch.argsort(owners, stable=True)
        send_sizes = torch.bincount(owners, minlength=sharding.n_shard).tolist()
        # ids (local to their owner) to the owners; their requests of this rank's shard arrive here
        requested, received = topology.all_to_all_uneven(sharding.entity_local[entities[order]], send_sizes)
        values = table.owned_rows(requested.cpu())
        # the answers: as many rows back to each shard as it asked for, exactly what this rank asked for returns
        answered, _ = topology.all_to_all_uneven(values, received, receive_sizes=send_sizes)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return answered.index_select(0, inverse.to(answered.device))


class GatheredTokenLookup(TokenLookup):
    """The static-shape lookup: all-gather the ids, masked local lookup, reduce-scatter of the rows."""

    name = "gathered"

    def lookup(self, table: ShardedTable, entities: torch.Tensor) -> torch.Tensor:  # noqa: D102
        topology = table_topology(table)
        count = torch.tensor([entities.numel()], dtype=torch.long, device=topology.device)
        longest = int(topology.shard_all_reduce(count, "max")[0])
        padded = torch.full((longest,), -1, dtype=torch.long)
        padded[: entities.numel()] = entities
        ids = topology.all_gather(padded.to(topology.device).unsqueeze(0))[0].cpu()  # [n, longest]
        rows = torch.where(ids >= 0, table.entity_rows[ids.clamp_min(0)], -1)
        owned = rows >= 0  # ids of other shards (and padding) give zero rows
        values = table.owned_rows(rows.clamp_min(0).view(-1)).view(*ids.shape, table.row_width)
        values = values * owned.to(values.device).unsqueeze(-1).to(values.dtype)
        summed = topology.reduce_scatter(values.unsqueeze(0))[0]  # [longest, row_width]
        return summed[: entities.numel()]


#: the token lookup variants, by name (``"routed"``, ``"gathered"``) or class
token_lookup_resolver: ClassResolver[TokenLookup] = ClassResolver(
    [RoutedTokenLookup, GatheredTokenLookup],
    base=TokenLookup,  # type: ignore[type-abstract]
    suffix="TokenLookup",
)


def lookup_entities(table: ShardedTable, entities: torch.Tensor, variant: str = "routed") -> torch.Tensor:
    """Return the stored rows ``[*s, row_width]`` of global entity ids ``s`` from a sharded table.

    A process holding every shard reads them directly; under a process group this is a collective
    of the table's shard group (see the module docstring).

    :raises ValueError: for a column part of a table (the encoding partition while it trains)
    """
    if table.column_part is not None:
        raise ValueError(
            "This entity table holds one column part of every row (partition='encoding' while training): whole "
            "rows exist after training, when the parts are row shards."
        )
    if table.holds_all_shards:
        rows = table.entity_rows[entities.reshape(-1).to(table.entity_rows.device)]
        return table.owned_rows(rows).view(*entities.shape, table.row_width)
    return token_lookup_resolver.make(variant)(table, entities)
