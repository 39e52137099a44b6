"""The BESS step: embedding-moving and score-moving, written once over :mod:`pykeen_bess.exchange`.

A step on the global plan of :class:`~pykeen_bess.sampling.BessBatch` (``n`` shards, blocks of
``b`` slots, ``m = K / n`` negatives per shard and block) runs on every process over its ``L``
local shards:

1. **gather** (:meth:`BessScheme.gather`): each local shard ``l`` looks up, once per step, the
   rows it owns: heads of its blocks ``(l, *)``, tails of blocks ``(*, l)`` and its negatives for
   all ``n ** 2`` blocks. The unique rows become leaf tensors, so the gradient of a step is
   row-sparse by construction.
2. **positives**: tails move to the heads' shard, ``all_to_all([L(j), n(i), b, D]) -> [L(i), n(j), b, D]``;
   positive scores are computed where the heads live.
3. **negatives**, ``embedding`` scheme: negative embeddings move to the heads' shard,
   ``all_to_all([L(k), n(i), n(j), m, D]) -> [L(i), n(k), n(j), m, D]``, and every query of block
   ``(i, j)`` is scored against its ``K = n * m`` shared negatives;
   ``score`` scheme: queries are gathered everywhere, ``all_gather([L(i), n(j), b, q]) -> [L(k), n(i), n(j), b, q]``,
   every shard scores them against its local negatives, ``[L(k), n(i), n(j), b, m]``, and the
   scores move back, ``all_to_all -> [L(i), n(k), n(j), b, m]``.

Both schemes produce the same ``[L, n, b, K]`` negative scores (candidate order: shard ``k``
major, then the ``m`` draws), hence the same loss and gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pykeen.models import ERModel

from .exchange import Exchange
from .optim import row_sparse_grad
from .representation import ShardedEmbedding
from .sampling import BessBatch
from .scoring import SharedCandidateScorer, Side

__all__ = [
    "Scheme",
    "SCHEMES",
    "RowGather",
    "BlockScores",
    "BessScheme",
    "RegularizationWeights",
    "regularization_weights",
]

#: the name of an exchange scheme
Scheme = Literal["embedding", "score"]
SCHEMES: tuple[str, ...] = ("embedding", "score")


@dataclasses.dataclass
class RowGather:
    """The entity rows a process needs for one step, as leaf tensors."""

    #: shape: ``[U]``, unique flat rows of the local shard tables, sorted; a leading ``-1`` marks a
    #: dummy row used by padding slots (its values are never scored into the loss and never updated)
    rows: torch.Tensor
    #: one leaf per shard table, shape: ``[U, row_width]``
    leaves: list[torch.Tensor]
    #: shape: ``[L(i), n(j), b]``, index into ``rows`` of the head of every slot of blocks ``(l, *)``
    heads: torch.Tensor
    #: shape: ``[L(j), n(i), b]``, index into ``rows`` of the tail of every slot of blocks ``(*, l)``
    tails: torch.Tensor
    #: shape: ``[L(k), n(i), n(j), m]``, index into ``rows`` of this shard's negatives of every block
    negatives: torch.Tensor

    @property
    def first_real(self) -> int:
        """The position of the first real row (1 if there is a dummy row, else 0)."""
        return int(self.rows.numel() > 0 and int(self.rows[0]) < 0)

    @property
    def real_rows(self) -> torch.Tensor:
        """shape: ``[U']``, the rows that hold entities (a view)."""
        return self.rows[self.first_real :]


@dataclasses.dataclass
class BlockScores:
    """The scores of (a slice of) one step, on the blocks whose heads are local."""

    #: shape: ``[L(i), n(j), b']``
    positive: torch.Tensor
    #: shape: ``[L(i), n(j), b', K]``
    negative: torch.Tensor
    #: shape: ``[L(i), n(j), b']``, False for padding slots
    valid: torch.Tensor
    #: the regularization term of this slice, already weighted (see :meth:`BessScheme.scores`)
    regularization: torch.Tensor | float


class BessScheme:
    """Computes the block scores of BESS steps for one process."""

    def __init__(
        self,
        model: ERModel,
        tables: Sequence[ShardedEmbedding],
        scorer: SharedCandidateScorer,
        exchange: Exchange,
        scheme: Scheme = "embedding",
    ):
        """Bind the step to a model whose entity representations are the given shard tables.

        :param model: the model (relation representations and interaction are used as they are)
        :param tables: the model's entity representations, as shard tables
        :param scorer: the shared-candidate scorer of the model's interaction
        :param exchange: the collective back end
        :param scheme: ``"embedding"`` or ``"score"``
        :raises ValueError: for an unknown scheme
        """
        if scheme not in SCHEMES:
            raise ValueError(f"Unknown exchange={scheme!r}; expected one of {SCHEMES}.")
        self.model = model
        self.tables = list(tables)
        self.scorer = scorer
        self.exchange = exchange
        self.scheme = scheme
        self.head_indices = list(model.interaction.head_indices)
        self.tail_indices = list(model.interaction.tail_indices)

    # -- gathering ---------------------------------------------------------------------------

    def gather(self, batch: BessBatch) -> RowGather:
        """Look up the rows this process owns and needs for the step, as leaves.

        :param batch: the global plan of the step
        :returns: the rows and index tensors into them
        """
        exchange = self.exchange
        size = self.tables[0].sharding.shard_size
        offset = (torch.arange(exchange.n_local) * size).view(-1, 1, 1)
        heads, tails, negatives = batch.heads, batch.tails, batch.negatives
        if not bool(batch.valid.all()):
            # padding slots use the dummy row -1; negatives of blocks without real positives too
            heads = torch.where(batch.valid, heads, -1)
            tails = torch.where(batch.valid, tails, -1)
            negatives = torch.where(batch.valid.any(dim=-1).unsqueeze(0).unsqueeze(-1), negatives, -1)
        # heads of blocks (l, *), tails of blocks (*, l), this shard's negatives of all blocks
        head_rows = _offset_rows(exchange.select_local(heads, 0), offset)
        tail_rows = _offset_rows(exchange.select_local(tails, 1).transpose(0, 1), offset)
        negative_rows = _offset_rows(exchange.select_local(negatives, 0), offset.unsqueeze(-1))
        wanted = torch.cat([head_rows.reshape(-1), tail_rows.reshape(-1), negative_rows.reshape(-1)])
        rows, inverse = torch.unique(wanted, return_inverse=True)
        device = self.tables[0].weight.device
        rows, inverse = rows.to(device), inverse.to(device)
        sizes = [head_rows.numel(), tail_rows.numel(), negative_rows.numel()]
        head_index, tail_index, negative_index = inverse.split(sizes)
        lookup = rows.clamp_min(0)
        leaves = [
            table.weight.detach().index_select(0, lookup).requires_grad_(table.weight.requires_grad)
            for table in self.tables
        ]
        return RowGather(
            rows=rows,
            leaves=leaves,
            heads=head_index.view(head_rows.shape),
            tails=tail_index.view(tail_rows.shape),
            negatives=negative_index.view(negative_rows.shape),
        )

    def set_row_gradients(self, gathered: RowGather, dense: bool = False) -> None:
        """Hand the accumulated leaf gradients to the shard tables.

        :param gathered: the rows of the step, whose leaves hold the accumulated gradients
        :param dense: build dense gradients (for optimizers without a row-sparse rule) instead of
            coalesced row-sparse ones
        """
        first, rows = gathered.first_real, gathered.real_rows
        for table, leaf in zip(self.tables, gathered.leaves):
            if leaf.grad is None:
                continue
            if dense:
                table.weight.grad = torch.zeros_like(table.weight).index_add_(0, rows, leaf.grad[first:])
            else:
                table.weight.grad = row_sparse_grad(table.weight, rows, leaf.grad[first:])

    # -- scoring -----------------------------------------------------------------------------

    def scores(self, batch: BessBatch, gathered: RowGather, start: int = 0, stop: int | None = None) -> BlockScores:
        """Score the slots ``start:stop`` of every local block against the block's negatives.

        The regularization term is PyKEEN's sLCWA term of the step as if every positive had its
        block's shared negatives as its own (see :func:`regularization_weights`), this process' share
        of the slots ``start:stop``: summing it over slices (sub-batches) and processes gives the
        term of the whole step regardless of how it is split.

        :param batch: the global plan of the step
        :param gathered: the rows gathered by :meth:`gather`
        :param start: the first slot (sub-batching slices the slot axis)
        :param stop: the end slot (exclusive), defaults to the block size
        :returns: the scores of the local blocks
        """
        exchange = self.exchange
        n = exchange.n_shard
        b = batch.block_size
        stop = b if stop is None else stop
        slots = slice(start, stop)
        valid = exchange.select_local(batch.valid[..., slots], 0).to(self.tables[0].weight.device)
        weights = regularization_weights(batch, start, stop)
        regularization = _Accumulator()
        normalized = [self._normalized_rows(table, leaf) for table, leaf in zip(self.tables, gathered.leaves)]

        # positives: heads stay, tails move to the heads' shard
        heads = self._entities(
            normalized,
            gathered.heads[..., slots],
            regularization,
            self._role_weights(head=exchange.select_local(weights.head, 0)),
        )
        tails_out = self._entities(
            normalized,
            gathered.tails[..., slots],
            regularization,
            self._role_weights(tail=exchange.select_local(weights.tail, 1).transpose(0, 1)),
        )
        tails = exchange.all_to_all(tails_out)
        relations = self._relations(
            exchange.select_local(batch.relations[..., slots], 0),
            exchange.select_local(weights.relation, 0),
            regularization,
        )
        head_parts, tail_parts = self._unpack(heads), self._unpack(tails)
        positive = self.scorer.score_triples(
            self._select(head_parts, self.head_indices), relations, self._select(tail_parts, self.tail_indices)
        )

        # negatives of every local block, shared by its slots.
        # They are gathered in the layout [n(i), n(j), L(k), m, D] and viewed as [L(k), n(i), n(j), m, D]:
        # after the (local) all-to-all the candidates of a block are then contiguous.
        m = gathered.negatives.shape[-1]
        negative_shape = (n, n, exchange.n_local, m)
        negatives_local = self._entities(
            normalized,
            gathered.negatives.permute(1, 2, 0, 3),
            regularization,
            self._role_weights(
                head=weights.negative_head.view(n, n, 1, 1).expand(negative_shape),
                tail=weights.negative_tail.view(n, n, 1, 1).expand(negative_shape),
            ),
        ).permute(2, 0, 1, 3, 4)
        negative_scores = []
        moved_negatives = None
        for side, side_slots in self._side_slots(batch.num_head_corrupted, start, stop):
            known_parts = tail_parts if side == "head" else head_parts
            known_indices = self.tail_indices if side == "head" else self.head_indices
            candidate_indices = self.head_indices if side == "head" else self.tail_indices
            query = self.scorer.query(
                side,
                self._select(known_parts, known_indices, side_slots),
                _slice_parts(relations, side_slots),
            )
            if self.scheme == "embedding":
                if moved_negatives is None:
                    # [L(k), n(i), n(j), m, D] -> [L(i), n(k), n(j), m, D] -> [L(i), n(j), K, D]
                    moved = exchange.all_to_all(negatives_local).transpose(1, 2)
                    moved_negatives = self._unpack(moved.reshape(moved.shape[0], n, -1, moved.shape[-1]))
                candidates = self.scorer.candidates(side, self._select(moved_negatives, candidate_indices))
                negative_scores.append(self.scorer.score(side, query, candidates))
            else:
                candidates = self.scorer.candidates(
                    side, self._select(self._unpack(negatives_local), candidate_indices)
                )
                # [L(k), n(i), n(j), b', m] -> [L(i), n(k), n(j), b', m] -> [L(i), n(j), b', K]
                scores = exchange.all_to_all(self.scorer.score(side, exchange.all_gather(query), candidates))
                scores = scores.permute(0, 2, 3, 1, 4)
                negative_scores.append(scores.reshape(*scores.shape[:3], -1))
        negative = torch.cat(negative_scores, dim=2) if len(negative_scores) > 1 else negative_scores[0]
        return BlockScores(positive=positive, negative=negative, valid=valid, regularization=regularization.value)

    # -- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _side_slots(num_head_corrupted: int, start: int, stop: int) -> list[tuple[Side, slice]]:
        """Split the slots ``start:stop`` into head- and tail-corrupted ranges (relative to start)."""
        result: list[tuple[Side, slice]] = []
        boundary = min(max(num_head_corrupted, start), stop)
        if boundary > start:
            result.append(("head", slice(0, boundary - start)))
        if stop > boundary:
            result.append(("tail", slice(boundary - start, stop - start)))
        return result

    @staticmethod
    def _normalized_rows(table: ShardedEmbedding, leaf: torch.Tensor) -> torch.Tensor:
        x = table.view_rows(leaf)
        if table.normalizer is not None:
            x = table.normalizer(x)
        return x

    def _role_weights(
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

    def _entities(
        self,
        normalized: Sequence[torch.Tensor],
        index: torch.Tensor,
        regularization: _Accumulator,
        weights: Sequence[torch.Tensor | None],
    ) -> torch.Tensor:
        """Look up entity rows for a role and pack all tables' parts into ``[*index.shape, D]``.

        :param normalized: per table, the normalized rows of the step (views of the leaves)
        :param index: shape: ``s``, positions in the rows
        :param regularization: accumulates the weighted regularization terms
        :param weights: per table, the regularization weight of each looked-up row, shape ``s`` (CPU)
        :returns: shape: ``[*s, D]``
        """
        flat_index = index.reshape(-1)
        parts = []
        for table, rows, table_weights in zip(self.tables, normalized, weights):
            # index_select (not advanced indexing): its backward is a fast index_add
            x = rows.index_select(0, flat_index).view(*index.shape, *rows.shape[1:])
            if table.regularizer is not None and table_weights is not None:
                _regularize(table.regularizer, x, table_weights, regularization)
            if table.dropout is not None:
                x = table.dropout(x)
            if x.is_complex():
                x = torch.view_as_real(x)
            parts.append(x.reshape(*index.shape, -1))
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def _relations(self, indices: torch.Tensor, weights: torch.Tensor, regularization: _Accumulator) -> Any:
        """Look up the relation representations of ``[L, n, b']`` relation ids (``weights``: same shape, CPU)."""
        indices = indices.to(self.tables[0].weight.device)
        parts = []
        for representation in self.model.relation_representations:
            x = representation._plain_forward(indices=indices)
            if representation.normalizer is not None:
                x = representation.normalizer(x)
            if representation.regularizer is not None:
                _regularize(representation.regularizer, x, weights, regularization)
            if representation.dropout is not None:
                x = representation.dropout(x)
            parts.append(x)
        return parts[0] if len(parts) == 1 else tuple(parts)

    def _unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
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
    def _select(parts: Sequence[torch.Tensor], indices: Sequence[int], slots: slice | None = None) -> Any:
        """Pick the representation parts of a slot (head or tail), optionally slicing the slot axis."""
        chosen = [parts[i] if slots is None else parts[i][:, :, slots] for i in indices]
        return chosen[0] if len(chosen) == 1 else tuple(chosen)


def _slice_parts(x: Any, slots: slice) -> Any:
    """Slice the slot axis of one representation tensor or a tuple of them."""
    if isinstance(x, tuple):
        return tuple(part[:, :, slots] for part in x)
    return x[:, :, slots]


def _offset_rows(local_ids: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Turn local ids of the local shards (leading axis) into flat rows, keeping -1 (dummy)."""
    rows = local_ids + offset
    return rows if bool(offset.max() == 0) else torch.where(local_ids >= 0, rows, -1)


class _Accumulator:
    """Sums weighted regularization terms."""

    def __init__(self) -> None:
        self.value: torch.Tensor | float = 0.0

    def add(self, term: torch.Tensor | float) -> None:
        self.value = self.value + term


@dataclasses.dataclass(eq=False)
class RegularizationWeights:
    """The weight of every row a step looks up in PyKEEN's sLCWA regularization term (CPU, float64).

    See :func:`regularization_weights`; ``n`` shards, ``b'`` slots of a slice.
    """

    #: shape: ``[n(i), n(j), b']``, each head of a real positive
    head: torch.Tensor
    #: shape: ``[n(i), n(j), b']``, each tail of a real positive
    tail: torch.Tensor
    #: shape: ``[n(i), n(j), b']``, each relation of a real positive
    relation: torch.Tensor
    #: shape: ``[n(i), n(j)]``, each shared negative of the block as a head candidate
    negative_head: torch.Tensor
    #: shape: ``[n(i), n(j)]``, each shared negative of the block as a tail candidate
    negative_tail: torch.Tensor


def regularization_weights(batch: BessBatch, start: int = 0, stop: int | None = None) -> RegularizationWeights:
    """Weigh the rows of slots ``start:stop`` as PyKEEN's sLCWA loop weighs them.

    PyKEEN's :class:`~pykeen.training.SLCWATrainingLoop` scores the ``V`` positives and their ``V x K``
    negative triples with two lookups per representation, and every lookup adds the regularizer's
    *mean* over its rows. For one step with every positive's negatives being its block's shared
    negatives (corrupting the slot's side, the other side and the relation kept), this is, for a
    regularizer that averages a per-row value ``g``:

    * heads: ``g(h) / V`` for every real positive, plus ``g(h) / V`` again if the slot corrupts
      tails (its negative triples repeat the head); tails likewise;
    * relations: ``2 g(r) / V`` (the negative triples repeat the relation);
    * negatives: each of the ``K`` shared negatives of block ``(i, j)`` with ``g(e) V_ij / (V K)``,
      ``V_ij`` the block's real positives corrupting that side.

    Tables used several times in a role (the interaction's head / tail indices) count once per use
    (see :meth:`BessScheme._role_weights`). The weights of slices add up to those of the step.

    :param batch: the step's plan
    :param start: the first slot of the slice
    :param stop: the end of the slice (default: the block size)
    :returns: the weights
    """
    stop = batch.block_size if stop is None else stop
    valid = batch.valid[..., start:stop].to(torch.float64)
    num_valid = max(batch.num_valid, 1)
    num_negatives = batch.negatives.shape[0] * batch.negatives.shape[-1]
    corrupts_head = (torch.arange(start, stop) < batch.num_head_corrupted).to(torch.float64)
    return RegularizationWeights(
        head=valid * (2.0 - corrupts_head) / num_valid,
        tail=valid * (1.0 + corrupts_head) / num_valid,
        relation=valid * (2.0 / num_valid),
        negative_head=(valid * corrupts_head).sum(dim=-1) / (num_valid * num_negatives),
        negative_tail=(valid * (1.0 - corrupts_head)).sum(dim=-1) / (num_valid * num_negatives),
    )


def _regularize(regularizer: Any, x: torch.Tensor, weights: torch.Tensor, accumulator: _Accumulator) -> None:
    """Add ``sum_rows weight(row) * g(row)`` for a regularizer that averages a per-row value ``g``.

    The rows are grouped by weight (a step has few distinct weights), and each group costs one
    regularizer call: ``mean_group(g) * |group| * weight``. Group selection uses indices computed on
    the CPU, so no device synchronisation happens.

    :param regularizer: a PyKEEN regularizer
    :param x: shape: ``[*weights.shape, *row_shape]``, the looked-up rows
    :param weights: shape: ``s``, CPU, the weight of each row (0: not regularized)
    :param accumulator: receives the weighted terms
    """
    flat_weights = weights.reshape(-1)
    rows_all = x.reshape(-1, *x.shape[weights.ndim :])
    for value in torch.unique(flat_weights[flat_weights > 0]).tolist():
        selected = flat_weights == value
        if bool(selected.all()):
            rows = rows_all
        else:
            rows = rows_all.index_select(0, selected.nonzero().view(-1).to(x.device))
        regularizer.update(rows)
        accumulator.add(regularizer.pop_regularization_term() * (rows.shape[0] * value))


# -- choosing the scheme ---------------------------------------------------------------------------


def exchange_cost(
    scheme: Scheme,
    n_shard: int,
    block_size: int,
    num_negs_per_pos: int,
    entity_width: int,
    query_width: int,
    element_size: int = 4,
) -> int:
    """Return the bytes one process sends to the others per step (forward pass).

    With ``n`` shards, ``b`` slots per block, ``K`` negatives per positive, ``D`` packed entity
    values per row and ``q`` query values, every process sends ``n - 1`` of the ``n`` chunks of each
    all-to-all and its own chunk to ``n - 1`` peers in an all-gather:

    * both schemes move the positive tails: ``(n - 1) * b * D``;
    * ``embedding`` moves the negatives: ``(n - 1) * K * D``;
    * ``score`` gathers the queries, ``(n - 1) * n * b * q``, and moves the scores back,
      ``(n - 1) * b * K``.

    The backward pass sends the same amounts back (gradients), so the ratio is the same.

    :returns: bytes sent per process and step
    """
    n, b, k = n_shard, block_size, num_negs_per_pos
    elements = (n - 1) * b * entity_width
    if scheme == "embedding":
        elements += (n - 1) * k * entity_width
    elif scheme == "score":
        elements += (n - 1) * n * b * query_width + (n - 1) * b * k
    else:
        raise ValueError(f"Unknown exchange={scheme!r}; expected one of {SCHEMES}.")
    return elements * element_size


def choose_scheme(n_shard: int, block_size: int, num_negs_per_pos: int, entity_width: int, query_width: int) -> Scheme:
    """Return the scheme that sends fewer bytes per step (:func:`exchange_cost`); ties: embedding."""
    costs = {
        scheme: exchange_cost(scheme, n_shard, block_size, num_negs_per_pos, entity_width, query_width)  # type: ignore[arg-type]
        for scheme in SCHEMES
    }
    return "score" if costs["score"] < costs["embedding"] else "embedding"


def query_width(scorer: SharedCandidateScorer, model: ERModel, tables: Sequence[ShardedEmbedding]) -> int:
    """Return the number of values of a query (the mean over both sides) for a model's scorer."""
    with torch.no_grad():
        entities = [table.view_rows(table.weight[:1]) for table in tables]
        first_relation = torch.zeros(1, dtype=torch.long, device=tables[0].weight.device)
        relations = [representation(indices=first_relation) for representation in model.relation_representations]
        relation = relations[0] if len(relations) == 1 else tuple(relations)
        widths = []
        for side, indices in (("head", model.interaction.tail_indices), ("tail", model.interaction.head_indices)):
            known = [entities[i] for i in indices]
            query = scorer.query(side, known[0] if len(known) == 1 else tuple(known), relation)  # type: ignore[arg-type]
            widths.append(query.shape[-1] * (2 if query.is_complex() else 1))
    return sum(widths) // len(widths)
