"""The entity table as shard tables: a PyKEEN representation stored shard by shard.

:class:`ShardedEmbedding` replaces a model's :class:`pykeen.nn.Embedding` while BESS trains it.
It keeps the embedding's normalizer, regularizer, dropout, constrainer and initializer, but stores
only the rows of the shards this process holds, as one table of shape
``[L * shard_size, row_width]`` (``L`` local shards; complex embeddings as real pairs). Row
``l * shard_size + local_id`` belongs to local shard ``l``. Padding rows are zero and never
trained.

Where the table lives is its storage tier (:mod:`pykeen_bess.storage`): on the model's device as a
parameter of the model (``"device"``, the default), or outside the model in host memory or files
(``"host"``, ``"mmap"``), where :attr:`ShardedEmbedding.weight` is a plain tensor of the tier that
neither ``model.parameters()`` nor ``model.to()`` sees; rows are read to the compute device when
used (:meth:`ShardedEmbedding.read_rows`), and the training loop's optimizer writes updated rows
back through the tier.

The module is a complete PyKEEN representation: :meth:`forward` accepts global entity ids, so the
model can be evaluated or queried while it is sharded. Under a process group each rank holds one
shard and a lookup is a collective token lookup over the table's :attr:`ShardedEmbedding.topology`
(:mod:`pykeen_bess.distributed.lookup`: ids to their owners, rows back, differentiably), which
also gathers the shards for export (:mod:`pykeen_bess.distributed.export`).
"""

from __future__ import annotations

import pathlib
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from pykeen.nn.init import PretrainedInitializer
from pykeen.nn.representation import Embedding, Representation
from torch import nn

from ..data.seeds import derive_seed
from ..data.sharding import EntitySharding
from ..distributed.launch import is_main_process
from ..storage import DeviceStorage, TableStorage
from ..storage.state_dict import add_stored_table, load_stored_table
from .other_loops import LOOP_RESETS, refuse_another_loop

__all__ = [
    "ColumnPart",
    "ShardedEmbedding",
    "constrain_all_rows",
    "draw_full_table",
    "entity_row_chunks",
    "reset_in_chunks",
]


#: the purpose key of the initial values' random stream (see :func:`~pykeen_bess.data.seeds.derive_seed`)
INITIALIZATION_STREAM = 1
#: tables in host memory or files larger than this (as a full table) are initialised chunk by chunk
FULL_DRAW_BYTES = 1 << 30
#: entities per chunk of a chunked initialisation
INITIALIZATION_CHUNK_ROWS = 1 << 20
#: bytes per chunk of the rows a constraint runs on in place in host memory (chunks that stay in the CPU's cache)
CONSTRAINT_CHUNK_BYTES = 1 << 21


class ColumnPart:
    """The column-part state of a shard table: which part of every row it holds (the encoding partition).

    A base class of :class:`ShardedEmbedding`; a table of whole rows keeps the defaults (None).
    """

    #: the column part of every row that the table holds (the encoding partition over processes); None: whole rows
    column_part: int | None = None
    #: the stored width of a whole row (this part's width and the others'), for a column part
    whole_width: int | None = None
    #: for a column part: the model's embedding of whole rows (its shape, normalizer, ...; not a submodule)
    whole_embedding: Embedding | None = None
    #: the process topology of the table (a column part's: its column sums)
    topology: Any

    def hold_column_part(self, part: int, whole_embedding: Embedding, whole_width: int) -> None:
        """Mark the table as column part ``part`` of every row of ``whole_embedding`` (the encoding partition).

        :param part: the column part
        :param whole_embedding: the model's embedding of whole rows
        :param whole_width: the stored width of a whole row (this part's :attr:`row_width` and the others')
        """
        self.column_part = int(part)
        self.whole_width = int(whole_width)
        object.__setattr__(self, "whole_embedding", whole_embedding)  # not a submodule: its parameters are not ours

    def row_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Return the mean of every row's entries ``[U, *] -> [U]`` over whole rows.

        A column part sums its entries, adds the other parts' sums (a collective of the column parts:
        every process must call it with the same rows) and divides by the whole row's width.
        """
        dims = tuple(range(1, x.dim()))
        if self.column_part is None:
            return x.mean(dim=dims)
        topology = self.topology
        return topology.column_sum(x.sum(dim=dims).unsqueeze(0)) / self.whole_width


class ShardedEmbedding(ColumnPart, Representation):
    """An entity embedding stored as the tables of the local shards."""

    #: shape: ``[num_entities]``, the flat local row of every global entity, -1 where it is not held here
    entity_rows: torch.Tensor
    #: shape: ``[L * shard_size, row_width]``, the table (a parameter of the model, or a tensor of its storage tier)
    weight: torch.Tensor
    #: the row-sparse gradient of a table outside the model (a default: tables pickled earlier lack it)
    stored_gradient: torch.Tensor | None = None
    #: whether the table holds a BESS training's values (set by the loop; only its own fresh training resets them)
    holds_training: bool = False

    def __init__(
        self,
        base: Embedding,
        sharding: EntitySharding,
        local_shards: Sequence[int],
        seed: int = 0,
        table_index: int = 0,
        storage: TableStorage | None = None,
        label_suffix: str = "",
    ):
        """Create the (uninitialised) shard tables for an embedding.

        :param base: the embedding to shard; its normalizer, regularizer, dropout, constrainer and
            initializer are shared, its weights are not copied (see :meth:`copy_from`)
        :param sharding: the entity sharding
        :param local_shards: the shards held by this process
        :param seed: the run's seed (the initial values depend on it and on ``table_index`` only)
        :param table_index: the position of the table among the model's entity representations
        :param storage: the storage tier of the table (default: a parameter on the embedding's device)
        :param label_suffix: appended to the table's name in its tier (e.g. the replica of a shard)
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
        if storage is None:
            storage = DeviceStorage()
            storage.attach(template.device)
        #: the storage tier of the table
        self.storage = storage
        #: whether the table is trained
        self.trainable = bool(template.requires_grad)
        first, last = self.local_shards[0], self.local_shards[-1]
        #: the table's name among the tensors of its tier (file names of ``storage="mmap"``)
        self.label = f"table{self.table_index}.shards{first}-{last}-of{sharding.n_shard}{label_suffix}"
        shape = (self.n_local * sharding.shard_size, self.row_width)
        #: the row rule's state of a table outside the model (see :class:`pykeen_bess.tables.optim.StoredTable`)
        self.row_state: dict[str, torch.Tensor] = {}
        #: the row-sparse gradient of a table outside the model (see :attr:`gradient`)
        self.stored_gradient: torch.Tensor | None = None
        #: shape: ``[U, W]``, the current values of the rows :attr:`gradient` touches, on the compute device,
        #: if the step already read them (None: the optimizer reads them)
        self.touched_values: torch.Tensor | None = None
        #: whether every row was constrained since the last reset (a chunked reset constrains as it writes)
        self.rows_constrained = False
        # a parameter of the model (device tier), or a plain tensor of the tier that the model does not see
        self.weight = storage.create_table(self.label, shape, template.dtype, template.device, self.trainable)
        #: what the optimizer's parameter group holds for a table outside the model (carries the step count)
        self.handle: nn.Parameter
        object.__setattr__(self, "handle", nn.Parameter(torch.zeros(0, dtype=template.dtype)))
        # flat local row of every global entity, -1 where the entity is not held here
        position = torch.full((sharding.n_shard,), -1, dtype=torch.long)
        position[list(self.local_shards)] = torch.arange(self.n_local)
        local_position = position[sharding.entity_shard]
        rows = torch.where(
            local_position >= 0,
            local_position * sharding.shard_size + sharding.entity_local,
            torch.full_like(local_position, -1),
        )
        storage.attach_index(self, "entity_rows", rows)  # where the table is: a buffer of a parameter's module
        storage.anchor_device(self, template.device)  # (a model whose tables are all outside it has a device)
        #: while a checkpoint is written: the directory its copies of a table's files go to; while one is
        #: read: the checkpoint's folder (set by the checkpoint store)
        self.snapshot_directory: pathlib.Path | None = None
        #: while a checkpoint whose own files hold the rows (PyTorch-BigGraph's layout) is written: omit them
        self.external_weights = False
        self.register_state_dict_post_hook(add_stored_table)
        self.register_load_state_dict_pre_hook(load_stored_table)
        # the embedding this table replaces (not a submodule: its parameters are not the model's)
        self.base_embedding: Embedding
        object.__setattr__(self, "base_embedding", base)
        #: the process topology of the shards (set by the training loop; not pickled); None: the default one
        self.topology: Any = None
        #: how rows held by other processes are looked up (``"routed"`` or ``"gathered"``, see
        #: :mod:`pykeen_bess.distributed.lookup`)
        self.token_lookup = "routed"

    # -- layout ------------------------------------------------------------------------------

    def owned_rows(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """Return flat local rows ``[U, row_width]`` on the compute device, differentiable for a parameter."""
        return self.storage.lookup_rows(self.weight, rows)

    def extra_repr(self) -> str:
        """Name the sharding: PyKEEN's checkpoint checksum hashes the ``repr`` (a checkpoint resumes into the same)."""
        return self.sharding.fingerprint

    @property
    def n_local(self) -> int:
        """The number of shards held by this process."""
        return len(self.local_shards)

    @property
    def holds_all_shards(self) -> bool:
        """Whether every entity is held by this process."""
        return self.n_local == self.sharding.n_shard

    @property
    def compute_device(self) -> torch.device:
        """The device rows are read to and scored on (the model's device)."""
        return self.storage.table_device(self)

    @property
    def gradient(self) -> torch.Tensor | None:
        """The table's gradient (row-sparse ``[R, W]`` while training; for a parameter, its ``grad``)."""
        return self.storage.gradient(self)

    @gradient.setter
    def gradient(self, value: torch.Tensor | None) -> None:
        self.storage.set_gradient(self, value)

    @property
    def optimizer_parameter(self) -> torch.nn.Parameter:
        """What stands for the table in the optimizer: the parameter, or the handle of a table outside the model."""
        return self.storage.optimizer_parameter(self)

    def read_rows(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """Read flat rows ``[U]`` (or a slice) to the compute device, detached (tier-counted): ``[U, row_width]``."""
        if isinstance(rows, slice):
            return self.storage.read_slice(self.weight, rows)
        return self.storage.read(self.weight, rows)

    def shard_tables(self) -> torch.Tensor:
        """Return the storage as ``[L, shard_size, row_width]`` (a view)."""
        return self.weight.view(self.n_local, self.sharding.shard_size, self.row_width)

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
        """Return the rows of global entity ids (default: all), also from shards held by other processes.

        Under a process group this is a collective of the shard group
        (:func:`~pykeen_bess.distributed.lookup.lookup_entities` with the variant :attr:`token_lookup`):
        every rank must call it, each with its own ids.
        """
        from ..distributed.lookup import lookup_entities

        if indices is None:
            indices = torch.arange(self.max_id)
        return self.view_rows(lookup_entities(self, indices, self.token_lookup))

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

        A table in host memory or files whose full table would exceed :data:`FULL_DRAW_BYTES` is
        drawn chunk by chunk instead (:meth:`reset_in_chunks`), so memory never holds it whole.
        """
        if self.holds_training and not LOOP_RESETS.get():
            refuse_another_loop(self, "re-initialise (and so lose)")
        with torch.no_grad():
            if isinstance(self.initializer, PretrainedInitializer):
                self.copy_from_tensor(self.initializer.tensor)
                return
            full_bytes = self.max_id * self.row_width * self.weight.element_size()
            if self.storage.draws_in_chunks(full_bytes, FULL_DRAW_BYTES):
                reset_in_chunks(self)
                return
            self.shard_tables().zero_()
            self.copy_from_tensor(draw_full_table(self, self.seed, self.table_index, self.weight.device))

    def post_parameter_update(self) -> None:
        """Apply the constrainer to all local rows (unless the training loop defers it)."""
        if self.defer_constraints or self.constrainer is None:
            return
        constrain_all_rows(self)

    def constrain_rows(self, rows: torch.Tensor) -> None:
        """Apply the constrainer to the given flat rows, in place."""
        if self.constrainer is None or rows.numel() == 0:
            return
        with torch.no_grad():
            self.weight.index_copy_(0, rows, self.constrain_values(self.weight.index_select(0, rows)))

    def constrain_entity_rows(self) -> None:
        """Apply the constrainer to every entity's row in place (after a dense update, as PyKEEN after every step).

        Chunk by chunk of consecutive entity rows (:func:`entity_row_chunks`; padding untouched): fixed shapes.
        """
        with torch.no_grad():
            for start, stop in entity_row_chunks(self) if self.constrainer is not None else ():
                self.weight[start:stop].copy_(self.constrain_values(self.weight[start:stop]))

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

    def check_whole(self) -> None:
        """Raise :class:`pickle.PicklingError` if this process holds only some shards (a partial table).

        A model saved with a partial table would silently lack entities.
        """
        if not self.holds_all_shards:
            raise pickle.PicklingError(
                f"This entity table holds {self.n_local} of {self.sharding.n_shard} shards (a torch.distributed run). "
                f"Save the full model with pykeen_bess.distributed.save_to_directory(result, directory) or "
                f"pykeen_bess.distributed.export_model(model, path), called on every rank (hpo_pipeline saves every "
                f"trial's model this way with save_model_directory: leave it out under torch.distributed)."
            )

    def __getstate__(self) -> dict:
        """Refuse to pickle a partial table (see :meth:`check_whole`)."""
        self.check_whole()
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


def draw_full_table(
    embedding: Embedding | ShardedEmbedding, seed: int, table_index: int, device: torch.device | None = None
) -> torch.Tensor:
    """Draw the initial values of a whole entity table, ``[num_entities, row_width]`` in global order.

    The embedding's initializer fills a ``[num_entities, *row_shape]`` tensor (the stored real
    layout) under a generator seeded by the run's seed and the table's index alone, so the values
    do not depend on how the table is split (rows or columns, processes).
    """
    if isinstance(embedding, ShardedEmbedding):
        row_shape, dtype = embedding.row_shape, embedding.weight.dtype
    else:
        row_shape, dtype = tuple(embedding._shape), embedding._embeddings.weight.dtype
        device = device or embedding._embeddings.weight.device
    device = torch.device("cpu") if device is None else device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(derive_seed(seed, INITIALIZATION_STREAM, table_index))
        full = embedding.initializer(torch.empty(embedding.max_id, *row_shape, dtype=dtype, device=device))
    return full.reshape(embedding.max_id, -1)


def reset_in_chunks(table: ShardedEmbedding, chunk_rows: int | None = None) -> None:
    """Initialise a table's local shards chunk by chunk of rows (tables too large to draw at once).

    Chunk ``c`` of shard ``s`` (its local rows ``c * chunk_rows`` to ``(c + 1) * chunk_rows``) is
    drawn by the initializer on a ``[chunk, *row_shape]`` tensor under a generator seeded by the
    table's seed and index, the number of shards, ``s`` and ``c``, and written in row order
    (sequential writes, which a table in files needs). So an entity's initial values do not
    depend on how many processes hold the shards, but, unlike the full draw of
    :meth:`ShardedEmbedding.reset_parameters`, they do depend on the number of shards;
    initializers whose scale depends on the table's shape (Xavier's) see the chunk's. The
    constrainer is applied to each chunk as it is written, so the pass over all rows that
    follows a reset is skipped (one pass over the table, not two). Padding rows are set to zero; a
    progress bar shows in a terminal (on the main process).
    """
    from tqdm.auto import tqdm

    chunk_rows = chunk_rows or INITIALIZATION_CHUNK_ROWS
    size = table.sharding.shard_size
    chunks = [(p, s, c) for p, s in enumerate(table.local_shards) for c in range(0, size, chunk_rows)]
    with torch.no_grad():
        quiet = None if is_main_process() else True  # None: a bar only where the output is a terminal
        bar = tqdm(chunks, desc=f"Initialising {table.label}", unit="chunk", leave=False, disable=quiet)
        for position, shard, start in bar:
            stop = min(start + chunk_rows, size)
            key = (table.seed, INITIALIZATION_STREAM, table.table_index, table.sharding.n_shard, shard)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(*key, start // chunk_rows))
                values = table.initializer(torch.empty(stop - start, *table.row_shape, dtype=table.weight.dtype))
            values = table.constrain_values(values.reshape(stop - start, table.row_width))
            padding = table.sharding.shard_entities[shard, start:stop] < 0
            if bool(padding.any()):
                values[padding] = 0
            table.weight[position * size + start : position * size + stop] = values
    table.rows_constrained = True


def entity_row_chunks(table: ShardedEmbedding) -> list[tuple[int, int]]:
    """Return the ``(start, stop)`` of a table's chunks of consecutive entity rows (kept while its rows' index is).

    A run of rows is a chunk, or on the CPU chunks of :data:`CONSTRAINT_CHUNK_BYTES` (not a column part's runs).
    """
    kept = vars(table).get("_kept_entity_chunks")
    if kept is not None and kept[0] is table.entity_rows:
        return kept[1]
    rows = table.real_rows().cpu().sort().values
    breaks = ((rows[1:] != rows[:-1] + 1).nonzero().view(-1) + 1).tolist()
    size = rows.numel() or 1
    if table.weight.device.type == "cpu" and table.column_part is None:
        size = max(1, CONSTRAINT_CHUNK_BYTES // (table.row_width * table.weight.element_size()))
    chunks = []
    for first, end in zip([0, *breaks], [*breaks, rows.numel()] if rows.numel() else []):
        start, stop = int(rows[first]), int(rows[end - 1]) + 1
        chunks += [(position, min(position + size, stop)) for position in range(start, stop, size)]
    vars(table)["_kept_entity_chunks"] = (table.entity_rows, chunks)
    return chunks


def constrain_all_rows(table: ShardedEmbedding, chunk_rows: int | None = None) -> None:
    """Apply a table's constrainer to every real row, chunk by chunk of consecutive rows (padding stays zero)."""
    if table.constrainer is None or table.rows_constrained:
        table.rows_constrained = False  # a chunked reset constrained every row as it wrote it
        return
    chunk_rows = chunk_rows or INITIALIZATION_CHUNK_ROWS
    real = (table.sharding.shard_entities.view(table.sharding.n_shard, -1)[list(table.local_shards)] >= 0).view(-1)
    with torch.no_grad():
        for start in range(0, table.weight.shape[0], chunk_rows):
            stop = min(start + chunk_rows, table.weight.shape[0])
            mask = real[start:stop].to(table.weight.device)
            values = table.weight[start:stop]
            constrained = table.constrain_values(values.to(table.compute_device)).to(values.device)
            values.copy_(torch.where(mask.unsqueeze(1), constrained, values))


#: the state-dict keys (after the module's prefix) of a table kept outside the model, and of a mark for
#: weights held by the checkpoint's own files
