"""The entity table as shard tables: a PyKEEN representation stored shard by shard.

:class:`ShardedEmbedding` replaces a model's :class:`pykeen.nn.Embedding` while BESS trains it.
It keeps the embedding's normalizer, regularizer, dropout, constrainer and initializer, but stores
only the rows of the shards this process holds, as one parameter of shape
``[L * shard_size, row_width]`` (``L`` local shards; complex embeddings as real pairs). Row
``l * shard_size + local_id`` belongs to local shard ``l``. Padding rows are zero and never
trained.

When all shards are local (one process), the module is a complete PyKEEN representation:
:meth:`forward` accepts global entity ids, so the model can be evaluated or queried while it is
sharded. Under a process group each rank holds one shard and global lookups raise; the table's
:attr:`ShardedEmbedding.topology` gathers the shards for export (:mod:`pykeen_bess.distributed.export`).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from pykeen.nn.init import PretrainedInitializer
from pykeen.nn.representation import Embedding, Representation
from torch import nn

from .seeds import derive_seed
from .sharding import EntitySharding

__all__ = [
    "ShardedEmbedding",
]


#: the purpose key of the initial values' random stream (see :func:`~pykeen_bess.seeds.derive_seed`)
INITIALIZATION_STREAM = 1


class ShardedEmbedding(Representation):
    """An entity embedding stored as the tables of the local shards."""

    #: shape: ``[num_entities]``, the flat local row of every global entity, -1 where it is not held here
    entity_rows: torch.Tensor

    def __init__(
        self,
        base: Embedding,
        sharding: EntitySharding,
        local_shards: Sequence[int],
        seed: int = 0,
        table_index: int = 0,
    ):
        """Create the (uninitialised) shard tables for an embedding.

        :param base: the embedding to shard; its normalizer, regularizer, dropout, constrainer and
            initializer are shared, its weights are not copied (see :meth:`copy_from`)
        :param sharding: the entity sharding
        :param local_shards: the shards held by this process
        :param seed: the run's seed (the initial values depend on it and on ``table_index`` only)
        :param table_index: the position of the table among the model's entity representations
        :raises ValueError: if the embedding does not match the sharding
        """
        if base.max_id != sharding.num_entities:
            raise ValueError(f"Embedding has {base.max_id} rows but the sharding {sharding.num_entities} entities.")
        super().__init__(max_id=base.max_id, shape=base.shape, unique=False)
        self.normalizer = base.normalizer
        self.regularizer = base.regularizer
        self.dropout = base.dropout
        self.constrainer = base.constrainer
        self.initializer = base.initializer
        self.is_complex = base.is_complex
        #: the shape of one stored row, e.g. ``(d, 2)`` for a complex vector
        self.row_shape = tuple(base._shape)
        self.sharding = sharding
        self.local_shards = tuple(int(s) for s in local_shards)
        self.seed = int(seed)
        self.table_index = int(table_index)
        #: whether :meth:`post_parameter_update` is a no-op (the training loop constrains the
        #: updated rows itself instead of the whole table)
        self.defer_constraints = False
        template = base._embeddings.weight
        self.row_width = template.shape[1]
        self.weight = nn.Parameter(
            torch.zeros(
                self.n_local * sharding.shard_size, self.row_width, dtype=template.dtype, device=template.device
            ),
            requires_grad=template.requires_grad,
        )
        # flat local row of every global entity, -1 where the entity is not held here
        position = torch.full((sharding.n_shard,), -1, dtype=torch.long)
        position[list(self.local_shards)] = torch.arange(self.n_local)
        local_position = position[sharding.entity_shard]
        rows = torch.where(
            local_position >= 0,
            local_position * sharding.shard_size + sharding.entity_local,
            torch.full_like(local_position, -1),
        )
        self.register_buffer("entity_rows", rows, persistent=False)
        # the embedding this table replaces (not a submodule: its parameters are not the model's)
        object.__setattr__(self, "base_embedding", base)
        #: the process topology of the shards (set by the training loop; not pickled); None: the default one
        self.topology: Any = None

    # -- layout ------------------------------------------------------------------------------

    @property
    def n_local(self) -> int:
        """The number of shards held by this process."""
        return len(self.local_shards)

    @property
    def holds_all_shards(self) -> bool:
        """Whether every entity is held by this process."""
        return self.n_local == self.sharding.n_shard

    def shard_tables(self) -> torch.Tensor:
        """Return the storage as ``[L, shard_size, row_width]`` (a view)."""
        return self.weight.view(self.n_local, self.sharding.shard_size, self.row_width)

    def rows_of(self, entities: torch.Tensor) -> torch.Tensor:
        """Map global entity ids to flat local rows.

        :param entities: shape: ``s``, global ids
        :returns: shape: ``s``, rows of :attr:`weight`
        :raises ValueError: if some entity is held by another process
        """
        rows = self.entity_rows[entities.to(self.entity_rows.device)]
        if not self.holds_all_shards and bool((rows < 0).any()):
            raise ValueError(
                "Entities held by other ranks were looked up. A distributed sharded model can only be queried "
                "for local entities; use pykeen_bess.BessEvaluator or export the full model first."
            )
        return rows

    def real_rows(self) -> torch.Tensor:
        """Return the flat rows that hold an entity (no padding), shape ``[n_real]``."""
        return self.entity_rows[self.entity_rows >= 0]

    # -- PyKEEN representation interface -------------------------------------------------------

    def view_rows(self, x: torch.Tensor) -> torch.Tensor:
        """View stored rows ``[*, row_width]`` in the representation's shape (complex if needed)."""
        x = x.view(*x.shape[:-1], *self.row_shape)
        if self.is_complex:
            x = torch.view_as_complex(x)
        return x

    def _plain_forward(self, indices: torch.Tensor | None = None) -> torch.Tensor:
        if indices is None:
            if not self.holds_all_shards:
                raise ValueError("Only a process holding all shards can return the full entity table.")
            indices = torch.arange(self.max_id, device=self.weight.device)
        rows = self.rows_of(indices)
        return self.view_rows(self.weight[rows])

    def reset_parameters(self) -> None:
        """Initialise the local shards exactly as PyKEEN initialises the full table, from this table's seed.

        The initializer is called on a full ``[num_entities, *row_shape]`` table, as
        :meth:`pykeen.nn.representation.Embedding.reset_parameters` calls it (the stored real
        layout; shape-dependent initializers such as Xavier's see the full table's fans), under a
        generator seeded by :attr:`seed` and :attr:`table_index` alone; each process keeps the rows
        of its shards. So every
        entity starts from the same values whatever the number of shards or processes, and the
        distribution is PyKEEN's. The full table exists only during this call. A
        :class:`~pykeen.nn.init.PretrainedInitializer` is sharded instead of re-drawn.
        """
        with torch.no_grad():
            self.shard_tables().zero_()
            if isinstance(self.initializer, PretrainedInitializer):
                self.copy_from_tensor(self.initializer.tensor)
                return
            with torch.random.fork_rng(devices=[self.weight.device] if self.weight.is_cuda else []):
                torch.manual_seed(derive_seed(self.seed, INITIALIZATION_STREAM, self.table_index))
                full = torch.empty(self.max_id, *self.row_shape, dtype=self.weight.dtype, device=self.weight.device)
                full = self.initializer(full)
            self.copy_from_tensor(full.reshape(self.max_id, self.row_width))

    def post_parameter_update(self) -> None:
        """Apply the constrainer to all local rows (unless the training loop defers it)."""
        if self.defer_constraints or self.constrainer is None:
            return
        self.constrain_rows(self.real_rows())

    def constrain_rows(self, rows: torch.Tensor) -> None:
        """Apply the constrainer to the given flat rows, in place."""
        if self.constrainer is None or rows.numel() == 0:
            return
        with torch.no_grad():
            self.weight.index_copy_(0, rows, self.constrain_values(self.weight.index_select(0, rows)))

    def constrain_values(self, values: torch.Tensor) -> torch.Tensor:
        """Apply the constrainer to stored rows ``[U, row_width]``; returns the constrained rows."""
        if self.constrainer is None:
            return values
        x = self.constrainer(self.view_rows(values))
        if x.is_complex():
            x = torch.view_as_real(x)
        return x.reshape(values.shape).to(values.dtype)

    def iter_extra_repr(self) -> Iterable[str]:  # noqa: D102
        yield from super().iter_extra_repr()
        yield f"n_shard={self.sharding.n_shard}"
        yield f"local_shards={list(self.local_shards)}"

    def __getstate__(self) -> dict:
        """Refuse to pickle a partial table (a model saved that way would silently lack entities)."""
        if not self.holds_all_shards:
            raise pickle.PicklingError(
                f"This entity table holds {self.n_local} of {self.sharding.n_shard} shards (a torch.distributed run). "
                f"Save the full model with pykeen_bess.distributed.save_to_directory(result, directory) or "
                f"pykeen_bess.distributed.export_model(model, path), called on every rank."
            )
        state = super().__getstate__()
        state = dict(state)
        state["topology"] = None  # a process group cannot be pickled; a full table needs none
        return state

    # -- conversion from / to a plain embedding ------------------------------------------------

    def copy_from_tensor(self, table: torch.Tensor) -> None:
        """Fill the local shards from a full ``[num_entities, ...]`` table in global order."""
        table = (
            table.reshape(self.max_id, -1)
            if not table.is_complex()
            else torch.view_as_real(table).reshape(self.max_id, -1)
        )
        if table.shape[1] != self.row_width:
            raise ValueError(f"Expected rows of width {self.row_width}, got {table.shape[1]}.")
        with torch.no_grad():
            held = (self.entity_rows >= 0).nonzero().view(-1)
            self.weight.zero_()
            self.weight[self.entity_rows[held]] = table[held.to(table.device)].to(self.weight)

    def copy_from(self, embedding: Embedding) -> None:
        """Fill the local shards from a plain embedding's weights."""
        self.copy_from_tensor(embedding._embeddings.weight.detach())

    def full_table(self) -> torch.Tensor:
        """Return the full ``[num_entities, row_width]`` table in global order (all shards local)."""
        if not self.holds_all_shards:
            raise ValueError("Only a process holding all shards can assemble the full table.")
        return self.weight.detach()[self.entity_rows]

    def copy_to(self, embedding: Embedding) -> None:
        """Write the shard tables back into a plain embedding (all shards local)."""
        with torch.no_grad():
            embedding._embeddings.weight.data = self.full_table().to(embedding._embeddings.weight.device).clone()
