"""Looking up a step's rows: entity rows in their roles, relations, and their regularization terms.

:class:`RowLookup` reads the gathered rows of a step in the layout of a role (heads, tails,
negatives) and packs the parts of all entity tables side by side (``[*, D]``, the unit the exchange
moves); it weighs every looked-up row's regularizer term as PyKEEN's sLCWA loop does
(:func:`~pykeen_bess.data.batch.regularization_weights`), once per use of a table in the role
(the terms themselves: :mod:`~pykeen_bess.schemes.regularization`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pykeen.models import ERModel
from pykeen.nn.representation import Embedding

from ..tables.representation import ShardedEmbedding
from .copies import UNCACHED, DeviceCopies
from .regularization import Accumulator, l2_term, is_plain_l2, is_plain_l2_regularizer, regularize

__all__ = ["RowLookup", "plain_rows", "slice_parts", "split_parts"]


class RowLookup:
    """Reads a step's rows for the roles of a model's interaction."""

    def __init__(self, model: ERModel, tables: Sequence[ShardedEmbedding]):
        """Look up the model's entity tables (as shard tables) and relation representations."""
        self.model = model
        self.tables = list(tables)
        self.head_indices = list(model.interaction.head_indices)
        self.tail_indices = list(model.interaction.tail_indices)

    @property
    def regularized(self) -> bool:
        """Whether an entity table or a relation representation has a regularizer (else no weights are needed)."""
        return any(table.regularizer is not None for table in self.tables) or any(
            representation.regularizer is not None for representation in self.model.relation_representations
        )

    @property
    def weighs_on_the_device(self) -> bool:
        """Whether every regularizer is PyKEEN's L2 norm of rows (:func:`is_plain_l2`): its weights stay on the device.

        Other regularizers group their rows by weight (:func:`regularize`), which reads the weights on the host.
        """
        regularizers = [table.regularizer for table in self.tables]
        regularizers += [representation.regularizer for representation in self.model.relation_representations]
        return all(regularizer is None or is_plain_l2_regularizer(regularizer) for regularizer in regularizers)

    @staticmethod
    def normalized_rows(table: ShardedEmbedding, leaf: torch.Tensor) -> torch.Tensor:
        """Return the stored rows of a leaf in the representation's shape, normalized as PyKEEN's forward would."""
        x = table.view_rows(leaf)
        if table.normalizer is not None:
            x = table.normalizer(x)
        return x

    def role_weights(
        self, head: torch.Tensor | None = None, tail: torch.Tensor | None = None
    ) -> list[torch.Tensor | None]:
        """Per table, the regularization weight of each row looked up in the head and / or tail role.

        PyKEEN looks up a table once for every time it appears in the interaction's head (tail)
        indices, so a role's weights count once per appearance.

        :param head: shape: ``s``, weights of the rows as heads (CPU)
        :param tail: shape: ``s``, weights of the rows as tails (CPU)
        :returns: one weight tensor of shape ``s`` per table (None: not regularized in this lookup)
        """
        result: list[torch.Tensor | None] = []
        for index in range(len(self.tables)):
            total = None
            for weights, indices in ((head, self.head_indices), (tail, self.tail_indices)):
                count = indices.count(index)
                if weights is not None and count:
                    total = weights * count if total is None else total + weights * count
            result.append(total)
        return result

    def entities(
        self,
        normalized: Sequence[torch.Tensor],
        index: torch.Tensor,
        regularization: Accumulator,
        weights: Sequence[torch.Tensor | None],
        identity: bool = False,
        copies: DeviceCopies = UNCACHED,
        leaves: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Look up entity rows for a role and pack all tables' parts into ``[*index.shape, D]``.

        :param normalized: per table, the normalized rows of the step (views of the leaves)
        :param index: shape: ``s``, positions in the rows
        :param regularization: accumulates the weighted regularization terms
        :param weights: per table, the regularization weight of each looked-up row, shape ``s`` (CPU)
        :param identity: the rows are the looked-up rows already, in order (``index`` is ``0, 1, ...``):
            nothing is selected
        :param copies: how the weights reach the device (the static step keeps them)
        :param leaves: per table, the leaf the normalized rows view (where they are the leaf itself, an L2 term's
            gradient may be left to the step, see :class:`Accumulator`)
        :returns: shape: ``[*s, D]``
        """
        flat_index = index.reshape(-1)
        parts = []
        for number, (table, rows, table_weights) in enumerate(zip(self.tables, normalized, weights)):
            # the weights of the looked-up rows the regularizer runs on per group (None: not regularized here)
            group_weights = table_weights if table.regularizer is not None else None
            if group_weights is not None and is_plain_l2(table.regularizer, rows):  # on the step's rows, each once
                # per row, the weights of its lookups (the dummy row of padding slots weighs 0)
                row_weights = copies.weights(group_weights, rows)
                if not identity:
                    row_weights = row_weights.new_zeros(rows.shape[0]).index_add_(0, flat_index, row_weights)
                leaf = None if leaves is None else leaves[number]
                if not regularization.add_l2(table.regularizer, rows, row_weights, leaf):
                    rows, term = l2_term(table.regularizer, rows, row_weights)  # the rows pass through the term
                    regularization.add(term)
                group_weights = None
            # index_select (not advanced indexing): its backward is a fast index_add; complex rows
            # are selected as their real view ([*, d, 2]), whose index_add is about 3x faster
            complex_rows = rows.is_complex()
            source = torch.view_as_real(rows) if complex_rows else rows
            x = (source if identity else source.index_select(0, flat_index)).view(*index.shape, *source.shape[1:])
            needs_rows = group_weights is not None or table.dropout is not None
            if complex_rows and needs_rows:
                x = torch.view_as_complex(x)
            if group_weights is not None:
                regularize(table.regularizer, x, group_weights, regularization, copies)
            if table.dropout is not None:
                x = table.dropout(x)
            if x.is_complex():
                x = torch.view_as_real(x)
            parts.append(x.reshape(*index.shape, -1))
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def roles(
        self,
        normalized: Sequence[torch.Tensor],
        indices: Sequence[torch.Tensor],
        regularization: Accumulator,
        weights: Sequence[Sequence[torch.Tensor | None]],
        identity: bool = False,
        copies: DeviceCopies = UNCACHED,
        leaves: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Look up the rows of several roles at once, as :meth:`entities` does for each.

        One ``index_select`` per table serves all roles, so the backward pass zero-fills and
        accumulates each leaf's gradient once instead of once per role.

        :param normalized: per table, the normalized rows of the step (views of the leaves)
        :param indices: per role, shape ``s_i``, positions in the rows
        :param regularization: accumulates the weighted regularization terms
        :param weights: per role, per table, the regularization weight of each row (shape ``s_i``,
            CPU; None: not regularized in this role)
        :param identity: the rows are the roles' rows, in role order (nothing is selected)
        :param copies: how the weights reach the device (the static step keeps them)
        :param leaves: see :meth:`entities`
        :returns: per role, shape ``[*s_i, D]``
        """
        sizes = [index.numel() for index in indices]
        flat_index = torch.cat([index.reshape(-1) for index in indices])
        table_weights: list[torch.Tensor | None] = []
        for table in range(len(self.tables)):
            role_weights = [role[table] for role in weights]
            if all(w is None for w in role_weights):
                table_weights.append(None)
                continue
            dtype = next(w for w in role_weights if w is not None).dtype
            parts = [
                torch.zeros(size, dtype=dtype) if w is None else w.reshape(-1) for w, size in zip(role_weights, sizes)
            ]
            table_weights.append(torch.cat(parts))
        packed = self.entities(
            normalized, flat_index, regularization, table_weights, identity=identity, copies=copies, leaves=leaves
        )
        return [part.view(*index.shape, -1) for part, index in zip(packed.split(sizes), indices)]

    def relations(
        self,
        indices: torch.Tensor,
        weights: torch.Tensor | None,
        regularization: Accumulator,
        per_shard: bool = False,
        copies: DeviceCopies = UNCACHED,
    ) -> Any:
        """Look up the relation representations of ``[L, n, b']`` relation ids.

        :param indices: shape: ``[L, n, b']``, relation ids
        :param weights: shape: ``[L, n, b']`` (CPU), the rows' regularization weights; None: not regularized
        :param regularization: accumulates the weighted regularization terms
        :param per_shard: one lookup per local shard: the relations' gradient is summed per shard, then over
            the shards, as processes holding one shard each sum theirs (then all-reduced), not in one pass
        :param copies: how the weights reach the device (the static step keeps them)
        :returns: the representations (a tuple for several)
        """
        indices = indices.to(self.tables[0].compute_device)
        parts = []
        for representation in self.model.relation_representations:
            if per_shard and indices.shape[0] > 1:
                x = torch.cat([plain_rows(representation, part) for part in indices.split(1)])
            else:
                x = plain_rows(representation, indices)
            if representation.normalizer is not None:  # on [rows, *shape], as PyKEEN's [batch, *shape] (dim=1)
                x = representation.normalizer(x.reshape(-1, *x.shape[indices.ndim :])).view(x.shape)
            rows = x.reshape(-1, *x.shape[indices.ndim :])
            if representation.regularizer is not None and weights is not None:
                if not is_plain_l2(representation.regularizer, rows):
                    regularize(representation.regularizer, x, weights, regularization, copies)
                elif representation.max_id <= rows.shape[0]:  # fewer relations than lookups: per relation
                    table = representation._plain_forward(indices=None)
                    if representation.normalizer is not None:
                        table = representation.normalizer(table)
                    row_weights = copies.weights(weights, table)
                    row_weights = row_weights.new_zeros(table.shape[0]).index_add_(0, indices.reshape(-1), row_weights)
                    weight = getattr(getattr(representation, "_embeddings", None), "weight", None)
                    if not regularization.add_l2(representation.regularizer, table, row_weights, weight):
                        _, term = l2_term(representation.regularizer, table, row_weights)
                        regularization.add(term)
                else:
                    row_weights = copies.weights(weights, rows)
                    _, term = l2_term(representation.regularizer, rows, row_weights)
                    regularization.add(term)
            if representation.dropout is not None:
                x = representation.dropout(x)
            parts.append(x)
        return parts[0] if len(parts) == 1 else tuple(parts)

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Split ``[*, D]`` into one tensor per table, in the representation's shape."""
        parts = []
        offset = 0
        for table in self.tables:
            x = packed[..., offset : offset + table.row_width]
            offset += table.row_width
            parts.append(
                table.view_rows(x.contiguous()) if table.is_complex else x.reshape(*x.shape[:-1], *table.shape)
            )
        return parts

    @staticmethod
    def select(parts: Sequence[torch.Tensor], indices: Sequence[int], slots: slice | None = None) -> Any:
        """Pick the representation parts of a slot (head or tail), optionally slicing the slot axis."""
        chosen = [parts[i] if slots is None else parts[i][:, :, slots] for i in indices]
        return chosen[0] if len(chosen) == 1 else tuple(chosen)


def plain_rows(representation: Any, indices: torch.Tensor) -> torch.Tensor:
    """Return ``representation._plain_forward(indices=indices)`` (an embedding's module called directly).

    For PyKEEN's :class:`~pykeen.nn.representation.Embedding` with the indices on its weight's device: the
    same operators (the module's lookup, a view, the complex view), without PyKEEN's device resolution of
    every call (``indices.to(self.device)`` walks the module's parameters): a few dozen microseconds a
    lookup, several lookups a step.
    """
    if type(representation)._plain_forward is Embedding._plain_forward:
        module = representation._embeddings
        if indices.device == module.weight.device:
            x = module(indices).view(*indices.shape, *representation._shape)
            return torch.view_as_complex(x) if representation.is_complex else x
    return representation._plain_forward(indices=indices)


def slice_parts(x: Any, slots: slice) -> Any:
    """Slice the slot axis of one representation tensor or a tuple of them."""
    if isinstance(x, tuple):
        return tuple(part[:, :, slots] for part in x)
    return x[:, :, slots]


def split_parts(x: Any, slots: Sequence[slice]) -> list[Any]:
    """Split the slot axis of one representation tensor (or a tuple of them) into consecutive ranges.

    One ``split`` instead of a slice per range: the backward pass joins the ranges' gradients
    instead of zero-filling the whole tensor once per range.

    :param x: shape: ``[L, n, b', ...]`` (or a tuple of such)
    :param slots: consecutive ranges that cover ``0:b'``
    :returns: per range, ``x[:, :, range]``
    """
    if isinstance(x, tuple) and not x:  # no representation of this kind (UM's relations): none per range
        return [() for _ in slots]
    if len(slots) == 1:
        return [slice_parts(x, slots[0])]
    sizes = [s.stop - s.start for s in slots]
    if isinstance(x, tuple):
        return list(zip(*(part.split(sizes, dim=2) for part in x)))
    return list(x.split(sizes, dim=2))
