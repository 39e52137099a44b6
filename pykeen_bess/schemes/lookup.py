"""Looking up a step's rows: entity rows in their roles, relations, and their regularization terms.

:class:`RowLookup` reads the gathered rows of a step in the layout of a role (heads, tails,
negatives) and packs the parts of all entity tables side by side (``[*, D]``, the unit the exchange
moves); it weighs every looked-up row's regularizer term as PyKEEN's sLCWA loop does
(:func:`~pykeen_bess.data.batch.regularization_weights`), once per use of a table in the role.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from pykeen.models import ERModel
from pykeen.regularizers import LpRegularizer
from pykeen.utils import get_expected_norm

from ..tables.representation import ShardedEmbedding

__all__ = [
    "UNCACHED",
    "Accumulator",
    "CachedDeviceCopies",
    "DeviceCopies",
    "RowLookup",
    "regularize",
    "slice_parts",
    "split_parts",
]


class DeviceCopies:
    """How a step's host tensors (indices, masks, regularization weights) reach the compute device: copied at each use.

    The step passes its copies down to the lookups (:meth:`~pykeen_bess.schemes.ExchangeScheme.scores`).
    The eager step copies every time (this class); the static step keeps them
    (:class:`CachedDeviceCopies`), so that a captured step reads them from device memory.
    """

    def copy(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Return a CPU tensor on ``device``."""
        return tensor if tensor.device == device else self._keep(("copy", tensor), device, lambda: tensor.to(device))

    def index(self, selected: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Return the positions ``[k]`` of the True entries of a CPU mask on ``device``."""
        index = selected.nonzero().view(-1)
        return self._keep(("index", index), device, lambda: index.to(device))

    def weights(self, weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Return CPU weights (flat) on the device of ``like``, in its real dtype.

        Weights computed on that device already (a static step's typed negatives) are only cast.
        """
        dtype = like.dtype.to_real()
        flat = weights.reshape(-1)
        if flat.device == like.device:
            return flat.to(dtype)
        return self._keep(("weights", flat, dtype), like.device, lambda: flat.to(like.device, dtype))

    def _keep(self, key: tuple, device: torch.device, make: Any) -> torch.Tensor:
        """Return ``make()`` (a copy to ``device`` of the key's CPU tensor)."""
        return make()


class CachedDeviceCopies(DeviceCopies):
    """Device copies kept by content: a static step's plan is the same in every step of a kind.

    A step whose plan is the same in every step (all slots real) has the same regularization groups
    and masks every step: the first run copies each to the device once, later runs (and a CUDA graph
    captured from them) use those copies, so no host-to-device copy happens inside the step.
    """

    def __init__(self) -> None:
        """Keep no copies yet."""
        self._copies: dict[tuple, torch.Tensor] = {}

    def tensors(self) -> list[torch.Tensor]:
        """Return the copies kept (device memory a captured step reads)."""
        return list(self._copies.values())

    def _keep(self, key: tuple, device: torch.device, make: Any) -> torch.Tensor:
        kind, tensor, *rest = key
        content = (kind, str(device), *map(str, rest), str(tensor.dtype), tuple(tensor.shape), tensor.numpy().tobytes())
        if content not in self._copies:
            self._copies[content] = make()
        return self._copies[content]


#: the copies of a step that keeps none (the eager step's)
UNCACHED = DeviceCopies()


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
        """Whether every regularizer is PyKEEN's L2 norm of rows (:func:`_plain_l2`): its weights stay on the device.

        Other regularizers group their rows by weight (:func:`regularize`), which reads the weights on the host.
        """
        regularizers = [table.regularizer for table in self.tables]
        regularizers += [representation.regularizer for representation in self.model.relation_representations]
        return all(regularizer is None or _plain_l2_regularizer(regularizer) for regularizer in regularizers)

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
    ) -> torch.Tensor:
        """Look up entity rows for a role and pack all tables' parts into ``[*index.shape, D]``.

        :param normalized: per table, the normalized rows of the step (views of the leaves)
        :param index: shape: ``s``, positions in the rows
        :param regularization: accumulates the weighted regularization terms
        :param weights: per table, the regularization weight of each looked-up row, shape ``s`` (CPU)
        :param identity: the rows are the looked-up rows already, in order (``index`` is ``0, 1, ...``):
            nothing is selected
        :param copies: how the weights reach the device (the static step keeps them)
        :returns: shape: ``[*s, D]``
        """
        flat_index = index.reshape(-1)
        parts = []
        for table, rows, table_weights in zip(self.tables, normalized, weights):
            # the weights of the looked-up rows the regularizer runs on per group (None: not regularized here)
            group_weights = table_weights if table.regularizer is not None else None
            if group_weights is not None and _plain_l2(table.regularizer, rows):  # on the step's rows, each once
                # per row, the weights of its lookups (the dummy row of padding slots weighs 0)
                row_weights = copies.weights(group_weights, rows)
                if not identity:
                    row_weights = row_weights.new_zeros(rows.shape[0]).index_add_(0, flat_index, row_weights)
                rows, term = _l2_term(table.regularizer, rows, row_weights)  # the rows pass through the term
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
        packed = self.entities(normalized, flat_index, regularization, table_weights, identity=identity, copies=copies)
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
                x = torch.cat([representation._plain_forward(indices=part) for part in indices.split(1)])
            else:
                x = representation._plain_forward(indices=indices)
            if representation.normalizer is not None:
                x = representation.normalizer(x)
            rows = x.reshape(-1, *x.shape[indices.ndim :])
            if representation.regularizer is not None and weights is not None:
                if not _plain_l2(representation.regularizer, rows):
                    regularize(representation.regularizer, x, weights, regularization, copies)
                elif representation.max_id <= rows.shape[0]:  # fewer relations than lookups: per relation
                    table = representation._plain_forward(indices=None)
                    if representation.normalizer is not None:
                        table = representation.normalizer(table)
                    row_weights = copies.weights(weights, table)
                    row_weights = row_weights.new_zeros(table.shape[0]).index_add_(0, indices.reshape(-1), row_weights)
                    _, term = _l2_term(representation.regularizer, table, row_weights)
                    regularization.add(term)
                else:
                    row_weights = copies.weights(weights, rows)
                    _, term = _l2_term(representation.regularizer, rows, row_weights)
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
    if len(slots) == 1:
        return [slice_parts(x, slots[0])]
    sizes = [s.stop - s.start for s in slots]
    if isinstance(x, tuple):
        return list(zip(*(part.split(sizes, dim=2) for part in x)))
    return list(x.split(sizes, dim=2))


class Accumulator:
    """Sums weighted regularization terms."""

    def __init__(self) -> None:
        self.value: torch.Tensor | float = 0.0

    def add(self, term: torch.Tensor | float) -> None:
        """Add a weighted term."""
        self.value = self.value + term


def regularize(
    regularizer: Any, x: torch.Tensor, weights: torch.Tensor, accumulator: Accumulator, copies: DeviceCopies = UNCACHED
) -> None:
    """Add ``sum_rows weight(row) * g(row)`` for a regularizer that averages a per-row value ``g``.

    The rows are grouped by weight (a step has few distinct weights), and each group costs one
    regularizer call: ``mean_group(g) * |group| * weight``. Group selection uses indices computed on
    the CPU, so no device synchronisation happens.

    :param regularizer: a PyKEEN regularizer
    :param x: shape: ``[*weights.shape, *row_shape]``, the looked-up rows
    :param weights: shape: ``s``, CPU, the weight of each row (0: not regularized)
    :param accumulator: receives the weighted terms
    :param copies: how the groups' indices reach the device (the static step keeps them)
    """
    flat_weights = weights.reshape(-1)
    rows_all = x.reshape(-1, *x.shape[weights.ndim :])
    for value in torch.unique(flat_weights[flat_weights > 0]).tolist():
        selected = flat_weights == value
        if bool(selected.all()):
            rows = rows_all
        else:
            rows = rows_all.index_select(0, copies.index(selected, x.device))
        regularizer.update(rows)
        accumulator.add(regularizer.pop_regularization_term() * (rows.shape[0] * value))


def _plain_l2(regularizer: Any, rows: torch.Tensor) -> bool:
    """Whether the regularizer is PyKEEN's L2 norm of rows (ComplEx's and DistMult's default), for :func:`_l2_term`.

    :func:`regularize` runs the regularizer once per group of rows with the same weight, on the looked-up
    rows: every group costs dozens of small operations, and ``torch`` computes the norm of complex rows
    and its gradient tens of times slower on the CPU than that of their real view (the same value).
    Only where :meth:`~pykeen.regularizers.Regularizer.update` would add ``forward(rows)`` and
    :meth:`~pykeen.regularizers.Regularizer.pop_regularization_term` return ``weight`` times it,
    ``forward`` being :class:`~pykeen.regularizers.LpRegularizer`'s with ``p = 2`` over each row.

    :param rows: shape: ``[N, *row_shape]``
    """
    return (
        (rows.is_complex() or rows.is_floating_point())
        and rows.ndim == 2
        and _plain_l2_regularizer(regularizer)
        and regularizer.training
        and torch.is_grad_enabled()
    )


def _plain_l2_regularizer(regularizer: Any) -> bool:
    """Whether a regularizer is :class:`~pykeen.regularizers.LpRegularizer`'s L2 norm of each row, weighed per step."""
    return (
        type(regularizer).forward is LpRegularizer.forward
        and regularizer.dim == -1
        and float(regularizer.p) == 2.0
        and not regularizer.apply_only_once
        and not regularizer.tracked_parameters
    )


def _l2_term(regularizer: Any, rows: torch.Tensor, row_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the rows and their regularization term ``weight * sum_rows row_weight * g(row)`` (:func:`_plain_l2`).

    The rows are returned as they are, through the term's autograd node: where the caller goes on with them,
    their gradient and the term's are added in that node by one fused operation (instead of the autograd
    engine adding a separate gradient of the term to theirs).

    :param rows: shape: ``[N, d]``, real or complex
    :param row_weights: shape: ``[N]``, on the rows' device, in their real dtype
    :returns: the rows ``[N, d]`` (a view of ``rows``) and the term, shape: ``[1]``, as PyKEEN's terms
    """
    scale = 1.0 / get_expected_norm(p=regularizer.p, d=rows.shape[-1]) if regularizer.normalize else 1.0
    return _WeightedRowNorms.apply(rows, row_weights, regularizer.weight, scale)


class _WeightedRowNorms(torch.autograd.Function):
    """The rows ``[N, d]`` and ``weight * scale * sum_rows w_row * ||row||_2`` (complex rows on their real view).

    The gradient is ``torch``'s (0 for a zero row): ``torch.linalg.vector_norm``'s backward masks zero
    norms on the broadcast ``[N, 2 d]`` tensor, which costs a millisecond per step on the CPU; this
    masks the ``N`` norms. One autograd node for the whole term, which also passes the rows through:
    their gradient from later uses and the term's are summed by one ``addcmul``. The rows it returns are
    a view made by a custom function: they must not be modified in place. Differentiable once.
    """

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, w: torch.Tensor, weight: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.complex = rows.is_complex()
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not as zeros
        x = torch.view_as_real(rows).flatten(-2) if ctx.complex else rows
        norm = torch.linalg.vector_norm(x, ord=2, dim=-1)
        # d term / d row = weight * scale * w_row * row / ||row|| (0 for a zero row), up to the incoming gradient
        coefficient = (w * (weight * scale) / norm).masked_fill_(norm == 0, 0)
        ctx.save_for_backward(x, coefficient)
        return rows.view_as(rows), (weight * (torch.dot(norm, w) * scale)).reshape(1)

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_rows: torch.Tensor | None, grad: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None]:
        x, coefficient = ctx.saved_tensors
        if grad is None:  # the term does not reach the loss: the rows' own gradient passes through
            return grad_rows, None, None, None
        factor = (coefficient * grad).unsqueeze(-1)
        if grad_rows is None:
            rows = x * factor
        else:
            passed = torch.view_as_real(grad_rows.resolve_conj()).flatten(-2) if ctx.complex else grad_rows
            rows = torch.addcmul(passed, x, factor)
        return (torch.view_as_complex(rows.view(*x.shape[:-1], -1, 2)) if ctx.complex else rows), None, None, None
