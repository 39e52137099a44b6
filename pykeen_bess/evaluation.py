"""Sharded filtered evaluation: PyKEEN's exact rank metrics from per-shard counts.

:class:`BessEvaluator` is a :class:`pykeen.evaluation.RankBasedEvaluator` whose ranks are never
computed from a ``[batch, num_entities]`` score matrix. The entities are split into shards (the
model's own :class:`~pykeen_bess.sharding.EntitySharding` when its entity representations are
:class:`~pykeen_bess.representation.ShardedEmbedding` tables, else a random one); for a batch of
``B`` queries every shard scores its local entities in blocks of at most ``slice_size`` with the
fast shared-candidate scorers (:mod:`pykeen_bess.scoring`) and *counts*, per query,

* ``larger``: candidates scoring strictly higher than the true entity,
* ``not_smaller``: candidates scoring at least as high,
* ``finite``: candidates with a finite score (PyKEEN's number of options),

over the candidates that are neither filtered (known triples, see :mod:`pykeen_bess.filtering`)
nor the true entity itself. Filtered candidates are masked by index (``index_put`` of NaN, which
no comparison counts) from ``(query, entity)`` pairs, never by a dense mask. The counts of all
shards are summed (:meth:`~pykeen_bess.exchange.Exchange.all_reduce`, so under
``torch.distributed`` only ``[4, B]`` integers per batch cross processes), and the true entity's
own contribution is added explicitly, exactly as PyKEEN's :meth:`pykeen.evaluation.ranks.Ranks.from_scores`
sees it after :func:`pykeen.evaluation.evaluator.filter_scores_` restored its column:

* optimistic rank ``= larger + 1``,
* pessimistic rank ``= not_smaller + 1`` (the true score is not smaller than itself),
* realistic rank ``= (optimistic + pessimistic) / 2``,
* number of options ``= finite + 1`` (``+ 0`` if the true score is not finite).

Exact ties are therefore handled as PyKEEN handles them (optimistic / pessimistic / realistic),
independently of how entities are sharded or sliced. Because the true score is computed once,
explicitly, and never compared with "its own column", rounding differences between the
batched matrix product of a block and the true triple's score cannot make the true entity
count against itself.

Deviation from PyKEEN, deliberately: a query whose *true* score is NaN gets the worst rank
(``finite + 1`` for all rank types, with the true entity counted as an option) instead of
PyKEEN's rank 1; NaN candidate scores are excluded from the options as in PyKEEN. Both are
reported with one :class:`RuntimeWarning` per evaluation.

The query representations are obtained by :meth:`ShardedScoring.gather_entities`: the shard that
owns an entity contributes its row, the others zeros, and an all-reduce sums them. In one process
(:class:`~pykeen_bess.exchange.LocalExchange`) all shards are local and the all-reduce is a copy;
under a process group each rank holds one shard of the tables and the same code is correct.

Memory: per step at most one ``[batch_size, slice_size]`` score block, cache-sized temporaries of
the counting (:data:`COUNT_CHUNK_ELEMENTS` scores) and the candidate features of one slice exist.
Without explicit sizes the block is bounded to :data:`CPU_BLOCK_BYTES` on the CPU
(:data:`CUDA_BLOCK_BYTES` on a GPU) and checked by an out-of-memory-catching probe agreed by all
processes (:func:`pykeen_bess.memory.search_largest`).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from abc import ABC, abstractmethod
from collections import ChainMap
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from pykeen.evaluation import RankBasedEvaluator
from pykeen.evaluation.rank_based_evaluator import RankBasedMetricResults
from pykeen.models import ERModel, Model
from pykeen.typing import (
    LABEL_HEAD,
    LABEL_RELATION,
    LABEL_TAIL,
    RANK_OPTIMISTIC,
    RANK_PESSIMISTIC,
    RANK_REALISTIC,
)
from tqdm.autonotebook import tqdm

from .exchange import DistributedExchange, Exchange, LocalExchange, ProbeExchange
from .filtering import FilterIndex
from .memory import available_memory, fits_in_memory, search_largest
from .representation import ShardedEmbedding
from .scoring import SharedCandidateScorer, Side, get_scorer
from .sharding import EntitySharding

__all__ = [
    "CPU_BLOCK_BYTES",
    "CUDA_BLOCK_BYTES",
    "DEFAULT_SLICE_SIZE",
    "BessEvaluator",
    "EntityRows",
    "ForwardRows",
    "Queries",
    "RankCounts",
    "ShardTableRows",
    "ShardedScoring",
    "check_triples",
    "choose_block_sizes",
    "count_block",
]

logger = logging.getLogger(__name__)

#: the default bound of one ``[batch, slice]`` score block on the CPU, in bytes
CPU_BLOCK_BYTES = 32 * 2**20
#: the default (starting) size of one score block on a GPU, in bytes; the search may double it
CUDA_BLOCK_BYTES = 256 * 2**20
#: the default number of candidates scored at once per shard
DEFAULT_SLICE_SIZE = 4096
#: the number of scores compared at once when counting (a cache-sized chunk of a block's rows)
COUNT_CHUNK_ELEMENTS = 2**19
#: score blocks of all queries against all candidates of a shard up to this size are used without a probe
TRIVIAL_BLOCK_BYTES = 4 * 2**20

ENTITY_TARGETS = (LABEL_HEAD, LABEL_TAIL)


# -- entity rows ---------------------------------------------------------------------------------


class EntityRows(ABC):
    """The (normalized) entity representations of the local shards, addressed by local id."""

    #: the entity sharding
    sharding: EntitySharding
    #: the shards held here, in the order of the ``position`` argument
    local_shards: tuple[int, ...]

    @abstractmethod
    def rows(self, position: int, local: slice | torch.Tensor) -> list[torch.Tensor]:
        """Return the representations of entities of one local shard.

        :param position: the position of the shard in :attr:`local_shards`
        :param local: the local ids, a ``slice`` or a long tensor of shape ``[k]`` (real entities only)
        :returns: one tensor of shape ``[k, *shape]`` per entity representation of the model, as
            the representation's ``forward`` would return it in evaluation mode
        """


class ShardTableRows(EntityRows):
    """Rows read directly from a model's :class:`ShardedEmbedding` tables (no full-table copy).

    A slice of local ids is a view of the table; the representation's normalizer is applied as
    :meth:`pykeen.nn.representation.Representation.forward` would.
    """

    def __init__(self, tables: Sequence[ShardedEmbedding]):
        """Wrap the shard tables (all with the same sharding and local shards)."""
        self.tables = list(tables)
        first = self.tables[0]
        for table in self.tables[1:]:
            if table.sharding is not first.sharding or table.local_shards != first.local_shards:
                raise ValueError("All entity shard tables of a model must share the sharding and the local shards.")
        self.sharding = first.sharding
        self.local_shards = first.local_shards

    def rows(self, position: int, local: slice | torch.Tensor) -> list[torch.Tensor]:  # noqa: D102
        offset = position * self.sharding.shard_size
        result = []
        for table in self.tables:
            weight = table.weight.detach()
            if isinstance(local, slice):
                stored = weight[offset + local.start : offset + local.stop]
            else:
                stored = weight.index_select(0, local.to(weight.device) + offset)
            x = table.view_rows(stored)
            if table.normalizer is not None:
                x = table.normalizer(x)
            result.append(x)
        return result


class ForwardRows(EntityRows):
    """Rows of any PyKEEN representation, via its ``forward`` on the global ids of a virtual sharding."""

    def __init__(
        self, representations: Sequence[torch.nn.Module], sharding: EntitySharding, local_shards: Sequence[int]
    ):
        """Wrap the model's entity representations.

        :param representations: the model's entity representations (all entities addressable)
        :param sharding: the (virtual) sharding that splits the entities into shards
        :param local_shards: the shards processed here
        """
        self.representations = list(representations)
        self.sharding = sharding
        self.local_shards = tuple(int(s) for s in local_shards)

    def rows(self, position: int, local: slice | torch.Tensor) -> list[torch.Tensor]:  # noqa: D102
        shard = self.local_shards[position]
        ids = self.sharding.shard_entities[shard, local]
        result = []
        for representation in self.representations:
            device = _module_device(representation)
            result.append(representation(indices=ids.to(device) if device is not None else ids))
        return result


def _module_device(module: torch.nn.Module) -> torch.device | None:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return None


# -- scoring over shards -------------------------------------------------------------------------


@dataclasses.dataclass
class Queries:
    """A batch of queries in the scorer's terms."""

    #: the side the scorer predicts ("tail" also for head prediction through inverse relations)
    side: Side
    #: shape: ``[B, q]``, query features
    features: torch.Tensor


def _unpack(parts: Sequence[torch.Tensor]) -> Any:
    """One tensor, or a tuple for several representations (as ``ERModel._get_representations``)."""
    return parts[0] if len(parts) == 1 else tuple(parts)


class ShardedScoring:
    """A model's link-prediction scores split over entity shards.

    It turns ``(known entity, relation)`` queries into scorer queries (handling inverse relations
    exactly as :meth:`pykeen.models.Model.predict_h` does), iterates over the candidate entities
    of each local shard in slices, and scores blocks of queries against slices
    (``[B, q] x [k, c] -> [B, k]``, with the model's sigmoid if ``predict_with_sigmoid``).

    Candidates of a shard are numbered by *columns* ``0..C_p - 1`` (``p``: position of the shard in
    :attr:`local_shards`): all real local ids in order, or only those of ``restrict_entities_to``,
    or the local ids sorted by global id (``order_by_id``, used by top-k prediction so that
    column order breaks ties by entity id).
    """

    def __init__(
        self,
        model: ERModel,
        rows: EntityRows,
        exchange: Exchange,
        restrict_entities_to: torch.Tensor | None = None,
        order_by_id: bool = False,
    ):
        """Prepare the scoring.

        :param model: the model (its relation representations and interaction are used directly)
        :param rows: the entity rows of the local shards
        :param exchange: the collective back end (its local shards must be those of ``rows``)
        :param restrict_entities_to: shape: ``[E']``, sorted unique global ids of the only candidates
        :param order_by_id: number the candidates of each shard by ascending global id
        """
        if tuple(exchange.local_shards) != tuple(rows.local_shards) or exchange.n_shard != rows.sharding.n_shard:
            raise ValueError(
                f"The exchange ({exchange.n_shard} shards, local {exchange.local_shards}) does not match the entity "
                f"rows ({rows.sharding.n_shard} shards, local {rows.local_shards})."
            )
        self.model = model
        self.rows = rows
        self.exchange = exchange
        self.sharding = rows.sharding
        self.scorer: SharedCandidateScorer = get_scorer(
            model.interaction,
            entity_representations=model.entity_representations,
            relation_representations=model.relation_representations,
        )
        self.head_indices = list(model.interaction.head_indices)
        self.tail_indices = list(model.interaction.tail_indices)
        # candidates of each local shard: None (= columns are local ids 0..count-1) or local ids
        self.candidate_local: list[torch.Tensor | None] = []
        # column of each local id, -1 for non-candidates (None when columns are local ids)
        self.column_of_local: list[torch.Tensor | None] = []
        allowed = None
        if restrict_entities_to is not None:
            allowed = torch.zeros(self.sharding.num_entities, dtype=torch.bool)
            allowed[restrict_entities_to.cpu()] = True
        for shard in rows.local_shards:
            count = int(self.sharding.shard_counts[shard])
            entities = self.sharding.shard_entities[shard, :count]
            local = torch.arange(count)
            if allowed is not None:
                local = local[allowed[entities]]
            if order_by_id:
                local = local[torch.argsort(entities[local])]
            if allowed is None and not order_by_id:
                self.candidate_local.append(None)
                self.column_of_local.append(None)
                continue
            column = torch.full((self.sharding.shard_size,), -1, dtype=torch.long)
            column[local] = torch.arange(local.shape[0])
            self.candidate_local.append(local)
            self.column_of_local.append(column)
        self.candidate_counts = [
            int(self.sharding.shard_counts[shard]) if local is None else int(local.shape[0])
            for shard, local in zip(rows.local_shards, self.candidate_local)
        ]
        #: shape: ``[num_entities]``, whether each entity is a candidate (None: all are)
        self.candidate_mask = allowed
        # total over all shards
        self.num_candidates = self.sharding.num_entities if allowed is None else int(allowed.sum())

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def for_model(
        cls,
        model: Model,
        num_shards: int | None = None,
        process_group: Any = None,
        restrict_entities_to: torch.Tensor | None = None,
        order_by_id: bool = False,
    ) -> ShardedScoring:
        """Choose the entity rows and the exchange for a model.

        If the model's entity representations are :class:`ShardedEmbedding` tables and
        ``num_shards`` is None or their number of shards, their rows are read directly (a process
        holding only some shards evaluates them under ``torch.distributed``, the group's ranks
        holding the other shards). Otherwise the entities are sharded by
        ``EntitySharding.create(num_entities, num_shards, seed)`` and read through the
        representations' ``forward``; ``num_shards=None`` means the sharding a
        :class:`~pykeen_bess.training.BessTrainingLoop` trained the model with (its
        ``bess_sharding`` attribute), else 1.

        :param model: the model
        :param num_shards: the number of shards (None: the model's own, or 1)
        :param process_group: the process group of a distributed sharded model (None: the default one)
        :param restrict_entities_to: sorted unique global ids of the only candidates
        :param order_by_id: see :class:`ShardedScoring`
        :returns: the scoring
        :raises ValueError: for models this evaluator cannot handle
        """
        if not isinstance(model, ERModel):
            raise TypeError(
                "BESS evaluation needs a pykeen.models.ERModel (interaction + representations), not "
                f"{type(model).__name__}."
            )
        if num_shards is not None and (
            isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1
        ):
            raise ValueError(f"num_shards must be a positive integer or None, but is {num_shards!r}.")
        representations = list(model.entity_representations)
        tables = [r for r in representations if isinstance(r, ShardedEmbedding)]
        if tables and len(tables) == len(representations) and num_shards in (None, tables[0].sharding.n_shard):
            rows: EntityRows = ShardTableRows(tables)
            if tables[0].holds_all_shards:
                exchange: Exchange = LocalExchange(rows.sharding.n_shard)
            else:
                exchange = DistributedExchange(process_group)
            return cls(model, rows, exchange, restrict_entities_to=restrict_entities_to, order_by_id=order_by_id)
        if any(isinstance(r, ShardedEmbedding) and not r.holds_all_shards for r in representations):
            raise ValueError(
                "The model's entity tables are distributed over processes; evaluate it with its own sharding "
                "(num_shards=None)."
            )
        # a model trained by BessTrainingLoop in one process remembers its sharding
        trained = getattr(model, "bess_sharding", None) or {}
        n = trained.get("num_shards", 1) if num_shards is None else num_shards
        seed = trained.get("seed", 0) if n == trained.get("num_shards") else 0
        if n > model.num_entities:
            raise ValueError(f"num_shards={n} is larger than the number of entities ({model.num_entities}).")
        sharding = EntitySharding.create(model.num_entities, n, seed=seed)
        exchange = LocalExchange(n)
        rows = ForwardRows(representations, sharding, exchange.local_shards)
        return cls(model, rows, exchange, restrict_entities_to=restrict_entities_to, order_by_id=order_by_id)

    # -- properties --------------------------------------------------------------------------

    @property
    def local_shards(self) -> tuple[int, ...]:
        """The shards processed here."""
        return self.rows.local_shards

    @property
    def max_columns(self) -> int:
        """The largest number of candidates of a local shard."""
        return max(self.candidate_counts)

    def is_candidate(self, entities: torch.Tensor) -> torch.Tensor:
        """Return whether global entity ids are candidates, shape ``[B]`` bool (on the ids' device)."""
        if self.candidate_mask is None:
            return torch.ones_like(entities, dtype=torch.bool)
        return self.candidate_mask.to(entities.device)[entities]

    # -- queries -----------------------------------------------------------------------------

    def gather_entities(self, entities: torch.Tensor, exchange: Exchange | None = None) -> list[torch.Tensor]:
        """Return the representations of arbitrary entities, contributed by the shards that own them.

        Each local shard writes the rows of the entities it owns into zero tensors, and the
        exchange sums over processes: every process obtains all rows while holding only its shards.

        :param entities: shape: ``[B]``, global ids
        :param exchange: the exchange to sum with (default: :attr:`exchange`; probes pass a
            :class:`~pykeen_bess.exchange.ProbeExchange`)
        :returns: one tensor of shape ``[B, *shape]`` per entity representation
        """
        exchange = self.exchange if exchange is None else exchange
        entities = entities.cpu()
        shard, local = self.sharding.to_local(entities)
        templates = self.rows.rows(0, slice(0, 0))
        result = [t.new_zeros((entities.shape[0], *t.shape[1:])) for t in templates]
        for position, shard_id in enumerate(self.local_shards):
            owned = (shard == shard_id).nonzero().view(-1)
            if owned.numel() == 0:
                continue
            for out, values in zip(result, self.rows.rows(position, local[owned])):
                out[owned.to(out.device)] = values
        return [_all_reduce(exchange, x) for x in result]

    def queries(
        self, target: str, known: torch.Tensor, relations: torch.Tensor, exchange: Exchange | None = None
    ) -> Queries:
        """Build the scorer queries for predicting ``target``.

        :param target: ``"tail"`` for ``(h, r, ?)``, ``"head"`` for ``(?, r, t)``
        :param known: shape: ``[B]``, the known entity (head for tail prediction, tail for head prediction)
        :param relations: shape: ``[B]``, the original relation ids
        :param exchange: see :meth:`gather_entities`
        :returns: the queries
        """
        model = self.model
        relations = relations.view(-1, 1)
        if target == LABEL_TAIL:
            side: Side = "tail"
            if model.use_inverse_triples:
                relations = model.relation_inverter.map(relations, index=0, invert=False)
        elif model.use_inverse_triples:
            # as Model.predict_h -> score_h_inverse: f(?, r, t) = f(t, r_inv, ?)
            side = "tail"
            relations = model.relation_inverter.map(relations, index=0, invert=True)
        else:
            side = "head"
        relations = relations.view(-1)
        entity_parts = self.gather_entities(known, exchange)
        known_indices = self.head_indices if side == "tail" else self.tail_indices
        e = _unpack([entity_parts[i] for i in known_indices])
        relation_parts = []
        for representation in model.relation_representations:
            device = _module_device(representation)
            relation_parts.append(representation(indices=relations.to(device) if device is not None else relations))
        features = self.scorer.query(side, e, _unpack(relation_parts))
        return Queries(side=side, features=features)

    def _candidate_parts(self, side: Side, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        indices = self.tail_indices if side == "tail" else self.head_indices
        return self.scorer.candidates(side, _unpack([parts[i] for i in indices]))

    def true_scores(self, queries: Queries, entities: torch.Tensor, exchange: Exchange | None = None) -> torch.Tensor:
        """Score each query against one entity of its own (the true entity).

        :param queries: ``B`` queries
        :param entities: shape: ``[B]``, the global id of each query's entity
        :param exchange: see :meth:`gather_entities`
        :returns: shape: ``[B]``
        """
        candidates = self._candidate_parts(queries.side, self.gather_entities(entities, exchange))
        scores = self.scorer.score(queries.side, queries.features.unsqueeze(-2), candidates.unsqueeze(-2))
        return self._finish(scores.view(-1))

    # -- candidates --------------------------------------------------------------------------

    def candidate_blocks(
        self, side: Side, position: int, slice_size: int
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Iterate over the candidates of one local shard in slices.

        :param side: the scorer side
        :param position: the position of the shard in :attr:`local_shards`
        :param slice_size: the number of candidates per slice
        :yields: ``(first column, global ids [k], candidate features [k, c])``
        """
        shard = self.local_shards[position]
        candidate_local = self.candidate_local[position]
        for start in range(0, self.candidate_counts[position], slice_size):
            stop = min(start + slice_size, self.candidate_counts[position])
            local: slice | torch.Tensor = slice(start, stop) if candidate_local is None else candidate_local[start:stop]
            ids = self.sharding.shard_entities[shard, local]
            yield start, ids, self._candidate_parts(side, self.rows.rows(position, local))

    def local_pairs(
        self, position: int, query_index: torch.Tensor, entities: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Map ``(query, entity)`` pairs to the ``(query, column)`` pairs of one local shard.

        :param position: the position of the shard in :attr:`local_shards`
        :param query_index: shape: ``[m]``
        :param entities: shape: ``[m]``, global ids
        :returns: the pairs whose entity is a candidate of the shard, sorted by column: two long
            tensors of shape ``[m']`` on the CPU
        """
        query_index, entities = query_index.cpu(), entities.cpu()
        shard, local = self.sharding.to_local(entities)
        keep = shard == self.local_shards[position]
        query_index, local = query_index[keep], local[keep]
        column_of_local = self.column_of_local[position]
        if column_of_local is None:
            column = local
        else:
            column = column_of_local[local]
            keep = column >= 0
            query_index, column = query_index[keep], column[keep]
        order = torch.argsort(column, stable=True)
        return query_index[order], column[order]

    def scores(self, queries: Queries, candidates: torch.Tensor) -> torch.Tensor:
        """Score all queries against a slice of candidates: ``[B, q] x [k, c] -> [B, k]``."""
        return self._finish(self.scorer.score(queries.side, queries.features, candidates))

    def _finish(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(scores) if self.model.predict_with_sigmoid else scores


def _all_reduce(exchange: Exchange, x: torch.Tensor) -> torch.Tensor:
    """Sum over processes; complex tensors travel as their real view."""
    if x.is_complex():
        return torch.view_as_complex(exchange.all_reduce(torch.view_as_real(x)).contiguous())
    return exchange.all_reduce(x)


# -- counting ------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankCounts:
    """Per-query counts of one batch, summed over shards (the true entity excluded)."""

    #: shape: ``[B]``, candidates scoring higher than the true entity
    larger: torch.Tensor
    #: shape: ``[B]``, candidates scoring at least as high as the true entity
    not_smaller: torch.Tensor
    #: shape: ``[B]``, candidates with a finite score
    finite: torch.Tensor
    #: shape: ``[B]``, candidates with a NaN score (before filtering)
    nan: torch.Tensor

    def stack(self) -> torch.Tensor:
        """Return the counts as one ``[4, B]`` tensor."""
        return torch.stack([self.larger, self.not_smaller, self.finite, self.nan])

    @classmethod
    def zeros(cls, batch_size: int, device: torch.device) -> RankCounts:
        """Return zero counts for ``batch_size`` queries."""
        return cls(*torch.zeros(4, batch_size, dtype=torch.long, device=device))

    @classmethod
    def from_stacked(cls, x: torch.Tensor) -> RankCounts:
        """Invert :meth:`stack`."""
        return cls(*x)


def count_block(
    scores: torch.Tensor,
    true_scores: torch.Tensor,
    masked_query: torch.Tensor,
    masked_column: torch.Tensor,
    counts: RankCounts,
) -> None:
    """Add one block's counts, excluding masked entries (filtered candidates and the true entity).

    Masked entries are overwritten with NaN, which no comparison counts. The comparisons run over
    chunks of :data:`COUNT_CHUNK_ELEMENTS` scores (rows of the block), which stay in the CPU's
    cache between the two comparisons and need no block-sized temporaries; the per-chunk sums are
    int32 (a block has fewer than ``2^31`` columns). The number of finite scores is derived from
    the number of masked entries when the block's sum is finite (then every score is); only
    blocks with NaN or infinite scores are counted element by element.

    :param scores: shape: ``[B, k]``, overwritten (masked entries become NaN)
    :param true_scores: shape: ``[B]``
    :param masked_query: shape: ``[m]``, the query of each masked entry (pairs unique)
    :param masked_column: shape: ``[m]``, the column of each masked entry within the block
    :param counts: the accumulators, updated in place
    """
    batch_size, width = scores.shape
    all_finite = bool(torch.isfinite(scores.sum()))
    num_masked = torch.bincount(masked_query, minlength=batch_size).to(scores.device)
    if masked_query.numel():
        scores[masked_query.to(scores.device), masked_column.to(scores.device)] = float("nan")
    true_scores = true_scores.unsqueeze(1)
    larger = torch.empty(batch_size, dtype=torch.int32, device=scores.device)
    not_smaller = torch.empty_like(larger)
    chunk_rows = max(1, COUNT_CHUNK_ELEMENTS // max(width, 1))
    for start in range(0, batch_size, chunk_rows):
        rows = slice(start, start + chunk_rows)
        chunk, true_chunk = scores[rows], true_scores[rows]
        torch.sum(chunk > true_chunk, dim=1, dtype=torch.int32, out=larger[rows])
        torch.sum(chunk >= true_chunk, dim=1, dtype=torch.int32, out=not_smaller[rows])
    counts.larger += larger
    counts.not_smaller += not_smaller
    if all_finite:
        counts.finite += width - num_masked
        return
    counts.finite += torch.isfinite(scores).sum(dim=1, dtype=torch.int32)
    counts.nan += torch.isnan(scores).sum(dim=1, dtype=torch.int32) - num_masked


def unique_pairs(
    query_index: torch.Tensor, entities: torch.Tensor, num_entities: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop duplicate ``(query, entity)`` pairs; shapes ``[m] -> [m']``, sorted by query."""
    keys = torch.unique(query_index.cpu() * num_entities + entities.cpu())
    return keys // num_entities, keys % num_entities


# -- block sizes ---------------------------------------------------------------------------------


def choose_block_sizes(
    scoring: ShardedScoring,
    num_queries: int,
    batch_size: int | None,
    slice_size: int | None,
    probe: Callable[[int, int], None],
    device: torch.device,
    memory_budget: int | None = None,
) -> tuple[int, int]:
    """Choose the number of queries per batch and of candidates per slice.

    Given sizes are kept. If all queries against all candidates of a shard make a block of at
    most :data:`TRIVIAL_BLOCK_BYTES`, that is used without probing. Otherwise missing sizes start
    from a score block of :data:`CPU_BLOCK_BYTES` (CPU; the search does not grow beyond it, larger
    blocks are not faster there) or :data:`CUDA_BLOCK_BYTES` (GPU; the batch may grow up to
    ``num_queries``), with slices of :data:`DEFAULT_SLICE_SIZE` candidates, and are halved until
    ``probe(batch_size, slice_size)`` fits, the decision agreed by all processes.

    :param scoring: the scoring (for the candidate counts, the dtype and the exchange)
    :param num_queries: the number of evaluation triples (queries per target)
    :param batch_size: the batch size, or None to choose
    :param slice_size: the slice size, or None to choose
    :param probe: runs one step of ``(batch_size, slice_size)`` without communicating
    :param device: the evaluation device
    :param memory_budget: the largest peak of a probe in bytes (CPU default: half the available
        memory; GPU default: only out-of-memory errors count)
    :returns: ``(batch_size, slice_size)``
    :raises MemoryError: if not even a single query against a single candidate fits
    """
    for name, value in (("batch_size", batch_size), ("slice_size", slice_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, but is {value!r}.")
    max_columns = max(1, scoring.max_columns)
    num_queries = max(1, num_queries)
    if batch_size is not None and slice_size is not None:
        return batch_size, slice_size
    itemsize = _score_itemsize(scoring)
    if num_queries * max_columns * itemsize <= TRIVIAL_BLOCK_BYTES:
        # everything in one block per shard, far below the default block: nothing to search
        return batch_size or num_queries, slice_size or max_columns
    block_bytes = CUDA_BLOCK_BYTES if device.type == "cuda" else CPU_BLOCK_BYTES
    block_elements = max(1, block_bytes // itemsize)
    budget = memory_budget
    if budget is None and device.type != "cuda":
        available = available_memory(device)
        budget = None if available is None else available // 2
    exchange = scoring.exchange

    def fits(batch: int, slice_: int) -> bool:
        return fits_in_memory(lambda: probe(batch, slice_), device, budget)[0]

    if batch_size is None:
        slice_start = min(max_columns, DEFAULT_SLICE_SIZE) if slice_size is None else min(slice_size, max_columns)
        batch_start = max(1, min(num_queries, block_elements // slice_start))
        maximum = num_queries if device.type == "cuda" else batch_start
        batch_size, found = search_largest(
            lambda b: fits(b, slice_start),
            start=batch_start,
            maximum=maximum,
            exchange=exchange,
            description="batch_size",
        )
        if found or slice_size is not None:
            if not found:
                raise MemoryError(f"Not even one query against slice_size={slice_size} candidates fits in memory.")
            return batch_size, slice_size if slice_size is not None else slice_start
        slice_size = slice_start
    # a given (small) batch gets the rest of the block as slice, within a sane bound
    slice_start = min(max_columns, max(1, block_elements // batch_size), DEFAULT_SLICE_SIZE * 16)
    maximum = max_columns if device.type == "cuda" else slice_start
    slice_size, found = search_largest(
        lambda s: fits(batch_size, s), start=slice_start, maximum=maximum, exchange=exchange, description="slice_size"
    )
    if not found:
        raise MemoryError(f"Not even batch_size={batch_size} queries against one candidate fit in memory.")
    return batch_size, slice_size


def _score_itemsize(scoring: ShardedScoring) -> int:
    """Return the bytes of one score (the real dtype of the entity representations)."""
    template = scoring.rows.rows(0, slice(0, 0))[0]
    dtype = template.real.dtype if template.is_complex() else template.dtype
    return torch.empty(0, dtype=dtype).element_size() if dtype.is_floating_point else 4


# -- input checks ----------------------------------------------------------------------------------


def check_triples(
    triples: Any, num_entities: int, num_relations: int, name: str, allow_empty: bool = False
) -> torch.Tensor:
    """Check ``[n, 3]`` id triples against a model's sizes.

    :param triples: the triples
    :param num_entities: the number of entities of the model
    :param num_relations: the number of (real, non-inverse) relations of the model
    :param name: the argument's name, for messages
    :param allow_empty: whether zero triples are acceptable
    :returns: the triples as a long tensor
    :raises ValueError: for a wrong shape or dtype, no triples, or ids outside the model
    """
    if not torch.is_tensor(triples):
        triples = torch.as_tensor(np.asarray(triples))
    if triples.ndim != 2 or triples.shape[1] != 3:
        raise ValueError(
            f"{name} must have shape [n, 3] (head, relation, tail ids), but has shape {list(triples.shape)}."
        )
    if triples.dtype.is_floating_point or triples.dtype.is_complex or triples.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer ids, but has dtype {triples.dtype}.")
    if triples.shape[0] == 0:
        if allow_empty:
            return triples.long()
        raise ValueError(f"{name} is empty: there is nothing to evaluate.")
    triples = triples.long()
    entities = triples[:, [0, 2]]
    relations = triples[:, 1]
    problems = []
    if int(entities.min()) < 0 or int(entities.max()) >= num_entities:
        bad = entities[(entities < 0) | (entities >= num_entities)].unique()[:5].tolist()
        problems.append(f"entity ids outside [0, {num_entities}) such as {bad}")
    if int(relations.min()) < 0 or int(relations.max()) >= num_relations:
        bad = relations[(relations < 0) | (relations >= num_relations)].unique()[:5].tolist()
        problems.append(f"relation ids outside [0, {num_relations}) such as {bad}")
    if problems:
        raise ValueError(
            f"{name} contains {' and '.join(problems)}: the triples do not belong to this model (were they mapped "
            f"with another triples factory?)."
        )
    return triples


def _check_targets(targets: Collection[str]) -> tuple[str, ...]:
    targets = tuple(targets)
    if LABEL_RELATION in targets:
        raise NotImplementedError(
            "BessEvaluator ranks entities only: relation prediction (target 'relation') is not supported. Use "
            "targets=('head', 'tail') or a subset."
        )
    unknown = [t for t in targets if t not in ENTITY_TARGETS]
    if unknown:
        raise ValueError(f"Unknown evaluation targets {unknown}; expected a subset of {ENTITY_TARGETS}.")
    if not targets:
        raise ValueError("No evaluation targets given; expected a subset of ('head', 'tail').")
    return targets


# -- the evaluator -------------------------------------------------------------------------------


class BessEvaluator(RankBasedEvaluator):
    """PyKEEN's rank-based evaluation computed shard by shard from counts (see the module docstring).

    The results are :class:`pykeen.evaluation.RankBasedMetricResults` with every metric, side and
    rank type of :class:`pykeen.evaluation.RankBasedEvaluator`, and the same values.
    """

    def __init__(
        self,
        num_shards: int | None = None,
        batch_size: int | None = None,
        slice_size: int | None = None,
        filtered: bool = True,
        memory_budget: int | None = None,
        process_group: Any = None,
        **kwargs: Any,
    ):
        """Create the evaluator.

        :param num_shards: the number of entity shards; None: the model's sharding if its entity
            representations are :class:`~pykeen_bess.representation.ShardedEmbedding` tables, else 1
        :param batch_size: evaluation triples per batch (both targets are ranked per batch); None:
            chosen by the memory search (the ``batch_size`` of :meth:`evaluate` takes precedence)
        :param slice_size: candidates scored at once per shard; None: chosen by the memory search
        :param filtered: whether to exclude the known triples (the evaluation triples and
            ``additional_filter_triples``) from the candidates
        :param memory_budget: the largest peak memory of a probe step in bytes (default: half of
            the available memory on the CPU; out-of-memory errors on a GPU)
        :param process_group: the process group of a model sharded over processes (default: the
            default group); unused in one process
        :param kwargs: passed to :class:`pykeen.evaluation.RankBasedEvaluator` (``metrics``,
            ``metrics_kwargs``, ``add_defaults``, ``clear_on_finalize``, ``mode``)
        """
        if kwargs.get("mode") is not None:
            raise NotImplementedError("BessEvaluator supports transductive evaluation only (mode=None).")
        if process_group is None:
            from .distributed import join_torchrun_group

            join_torchrun_group()
        super().__init__(filtered=filtered, batch_size=batch_size, slice_size=slice_size, **kwargs)
        if num_shards is not None and (
            isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1
        ):
            raise ValueError(f"num_shards must be a positive integer or None, but is {num_shards!r}.")
        self.num_shards = num_shards
        self.memory_budget = memory_budget
        self.process_group = process_group
        #: block sizes found by the memory search, reused by later evaluations of the same model
        self._block_sizes: dict[tuple, tuple[int, int]] = {}

    def evaluate(  # type: ignore[override]
        self,
        model: Model,
        mapped_triples: torch.Tensor,
        batch_size: int | None = None,
        slice_size: int | None = None,
        device: torch.device | None = None,
        use_tqdm: bool = True,
        tqdm_kwargs: Mapping[str, Any] | None = None,
        restrict_entities_to: Collection[int] | None = None,
        restrict_relations_to: Collection[int] | None = None,
        do_time_consuming_checks: bool = True,
        additional_filter_triples: None | torch.Tensor | list[torch.Tensor] = None,
        pre_filtered_triples: bool = True,
        targets: Collection[str] = (LABEL_HEAD, LABEL_TAIL),
    ) -> RankBasedMetricResults:
        """Evaluate a model on triples; the arguments are those of :meth:`pykeen.evaluation.Evaluator.evaluate`.

        The input is checked first (ids inside the model, non-empty, entity targets only); then
        PyKEEN's own argument handling (restriction checks, :func:`~pykeen.utils.prepare_filter_triples`,
        progress bar options) runs and calls this evaluator's sharded evaluation.

        :returns: the rank-based metric results
        :raises ValueError: for triples that do not belong to the model, empty inputs or invalid sizes
        :raises NotImplementedError: for relation prediction or inductive models
        """
        targets = _check_targets(targets)
        if not isinstance(model, ERModel):
            raise TypeError(f"BessEvaluator needs a pykeen.models.ERModel, not {type(model).__name__}.")
        num_relations = model.num_real_relations
        mapped_triples = check_triples(mapped_triples, model.num_entities, num_relations, "mapped_triples")
        if additional_filter_triples is not None:
            extra = (
                [additional_filter_triples]
                if torch.is_tensor(additional_filter_triples)
                else list(additional_filter_triples)
            )
            additional_filter_triples = [
                check_triples(t, model.num_entities, num_relations, "additional_filter_triples", allow_empty=True)
                for t in extra
            ]
        if restrict_entities_to is not None:
            # PyKEEN's checks compare with Python sets: pass plain ints
            restrict_entities_to = _check_ids(restrict_entities_to, model.num_entities, "restrict_entities_to").tolist()
        return super().evaluate(
            model=model,
            mapped_triples=mapped_triples,
            batch_size=batch_size,
            slice_size=slice_size,
            device=device,
            use_tqdm=use_tqdm,
            tqdm_kwargs=tqdm_kwargs,
            restrict_entities_to=restrict_entities_to,
            restrict_relations_to=restrict_relations_to,
            do_time_consuming_checks=do_time_consuming_checks,
            additional_filter_triples=additional_filter_triples,
            pre_filtered_triples=pre_filtered_triples,
            targets=targets,
        )

    def _evaluate_on_device(  # type: ignore[override]
        self,
        model: Model,
        mapped_triples: torch.Tensor,
        batch_size: int | None,
        slice_size: int | None,
        device: torch.device,
        all_pos_triples: torch.Tensor | None,
        targets: Collection[str],
        tqdm_kwargs: Mapping[str, Any],
        restrict_entities_to: Collection[int] | None = None,
        **kwargs: Any,
    ) -> RankBasedMetricResults:
        """Evaluate on one device (called by PyKEEN's :meth:`~pykeen.evaluation.Evaluator.evaluate`)."""
        assert isinstance(model, ERModel)
        was_training = model.training
        model.eval()
        model.to(device)
        try:
            with torch.inference_mode():
                return self._evaluate_sharded(
                    model=model,
                    mapped_triples=mapped_triples.to(device),
                    batch_size=batch_size if batch_size is not None else self.batch_size,
                    slice_size=slice_size if slice_size is not None else self.slice_size,
                    device=device,
                    all_pos_triples=all_pos_triples,
                    targets=tuple(targets),
                    tqdm_kwargs=tqdm_kwargs,
                    restrict_entities_to=None
                    if restrict_entities_to is None
                    else _check_ids(restrict_entities_to, model.num_entities, "restrict_entities_to"),
                )
        finally:
            model.train(was_training)

    def _evaluate_sharded(
        self,
        model: ERModel,
        mapped_triples: torch.Tensor,
        batch_size: int | None,
        slice_size: int | None,
        device: torch.device,
        all_pos_triples: torch.Tensor | None,
        targets: tuple[str, ...],
        tqdm_kwargs: Mapping[str, Any],
        restrict_entities_to: torch.Tensor | None,
    ) -> RankBasedMetricResults:
        """Rank all evaluation triples batch by batch, fill ``self.ranks`` / ``self.num_candidates`` and finalize."""
        scoring = ShardedScoring.for_model(
            model,
            num_shards=self.num_shards,
            process_group=self.process_group,
            restrict_entities_to=restrict_entities_to,
        )
        index = None
        if self.filtered:
            assert all_pos_triples is not None
            index = FilterIndex.from_triples(all_pos_triples, model.num_entities, model.num_real_relations).to(device)
        num_triples = mapped_triples.shape[0]
        batch_size, slice_size = self._block_sizes_for(
            scoring, model, mapped_triples, index, targets, batch_size, slice_size, device
        )
        logger.info(
            "BESS evaluation: %d triples, %s, batch_size=%d, slice_size=%d",
            num_triples,
            scoring.sharding.describe(),
            batch_size,
            slice_size,
        )
        self.clear()
        nan_candidates = nan_true = 0
        tqdm_kwargs = dict(tqdm_kwargs)
        if not scoring.exchange.is_main_process:
            tqdm_kwargs["disable"] = True
        progress = tqdm(
            **ChainMap(
                tqdm_kwargs,
                {"desc": f"Evaluating on {device}", "total": num_triples, "unit": "triple", "unit_scale": True},
            )
        )
        with progress:
            for batch in mapped_triples.split(batch_size):
                for target in targets:
                    ranks = self._rank_batch(scoring, index, batch, target, slice_size)
                    for rank_type in (RANK_OPTIMISTIC, RANK_REALISTIC, RANK_PESSIMISTIC):
                        self.ranks[target, rank_type].append(ranks[rank_type])
                    self.num_candidates[target].append(ranks["options"])
                    nan_candidates += ranks["nan_candidates"]
                    nan_true += ranks["nan_true"]
                progress.update(batch.shape[0])
        self.num_entities = scoring.num_candidates
        if nan_candidates or nan_true:
            warnings.warn(
                f"The model produced NaN scores: {nan_candidates} candidate scores (excluded from the rankings, as "
                f"PyKEEN does) and {nan_true} true triples' scores (those queries get the worst rank).",
                RuntimeWarning,
                stacklevel=4,
            )
        return self.finalize()

    def _rank_batch(
        self,
        scoring: ShardedScoring,
        index: FilterIndex | None,
        batch: torch.Tensor,
        target: str,
        slice_size: int,
        exchange: Exchange | None = None,
        max_blocks: int | None = None,
    ) -> dict[str, Any]:
        """Rank the true entities of one batch for one target.

        :param scoring: the sharded scoring
        :param index: the filter index (None: unfiltered)
        :param batch: shape: ``[B, 3]``
        :param target: ``"head"`` or ``"tail"``
        :param slice_size: candidates per block
        :param exchange: the exchange (probes pass a :class:`ProbeExchange`)
        :param max_blocks: score only this many blocks (probes)
        :returns: numpy arrays of shape ``[B]`` for the three rank types and ``"options"``, and the
            NaN counts ``"nan_candidates"`` and ``"nan_true"``
        """
        exchange = scoring.exchange if exchange is None else exchange
        heads, relations, tails = batch.unbind(dim=1)
        known, true = (heads, tails) if target == LABEL_TAIL else (tails, heads)
        batch_size = batch.shape[0]
        queries = scoring.queries(target, known, relations, exchange=exchange)
        true_scores = scoring.true_scores(queries, true, exchange=exchange)
        # pairs excluded from the shards' counts: the true entity and the known answers
        query_index, entities = torch.arange(batch_size, device=batch.device), true
        if index is not None:
            filtered_query, filtered_entity = index.filtered(target, known, relations)
            query_index = torch.cat([query_index, filtered_query.to(batch.device)])
            entities = torch.cat([entities, filtered_entity.to(batch.device)])
        query_index, entities = unique_pairs(query_index, entities, scoring.sharding.num_entities)

        counts = RankCounts.zeros(batch_size, device=true_scores.device)
        blocks_left = max_blocks
        for position in range(len(scoring.local_shards)):
            masked_query, masked_column = scoring.local_pairs(position, query_index, entities)
            for start, _ids, candidates in scoring.candidate_blocks(queries.side, position, slice_size):
                scores = scoring.scores(queries, candidates)
                lo, hi = torch.searchsorted(masked_column, torch.tensor([start, start + scores.shape[1]])).tolist()
                count_block(scores, true_scores, masked_query[lo:hi], masked_column[lo:hi] - start, counts)
                # release the block before the next one is allocated
                del scores, candidates
                if blocks_left is not None:
                    blocks_left -= 1
                    if blocks_left <= 0:
                        break
            if blocks_left is not None and blocks_left <= 0:
                break
        counts = RankCounts.from_stacked(exchange.all_reduce(counts.stack()))

        # the true entity's own contribution, as PyKEEN sees its restored column
        is_candidate = scoring.is_candidate(true.to(true_scores.device)).long()
        true_nan = torch.isnan(true_scores)
        larger = counts.larger
        not_smaller = counts.not_smaller + is_candidate * (~true_nan).long()
        options = counts.finite + is_candidate * torch.isfinite(true_scores).long()
        # a NaN true score ranks last, with the true entity counted as an option
        worst = counts.finite + 1
        optimistic = torch.where(true_nan, worst, larger + 1)
        pessimistic = torch.where(true_nan, worst, not_smaller)
        options = torch.where(true_nan, counts.finite + is_candidate, options)
        realistic = (optimistic + pessimistic).float() * 0.5
        return {
            RANK_OPTIMISTIC: optimistic.cpu().numpy(),
            RANK_REALISTIC: realistic.cpu().numpy(),
            RANK_PESSIMISTIC: pessimistic.cpu().numpy(),
            "options": options.cpu().numpy(),
            "nan_candidates": int(counts.nan.sum()),
            "nan_true": int(true_nan.sum()),
        }

    def _block_sizes_for(
        self,
        scoring: ShardedScoring,
        model: ERModel,
        mapped_triples: torch.Tensor,
        index: FilterIndex | None,
        targets: tuple[str, ...],
        batch_size: int | None,
        slice_size: int | None,
        device: torch.device,
    ) -> tuple[int, int]:
        """Return the given sizes, or search (once per model layout) for the missing ones."""
        if batch_size is not None and slice_size is not None:
            return choose_block_sizes(scoring, mapped_triples.shape[0], batch_size, slice_size, _no_probe, device)
        key = (
            id(model),
            str(device),
            scoring.sharding.n_shard,
            scoring.num_candidates,
            mapped_triples.shape[0],
            batch_size,
            slice_size,
            self.memory_budget,
        )
        cached = self._block_sizes.get(key)
        if cached is not None:
            return cached
        probe_exchange = ProbeExchange(scoring.exchange)

        def probe(probe_batch_size: int, probe_slice_size: int) -> None:
            rows = torch.arange(probe_batch_size, device=mapped_triples.device) % mapped_triples.shape[0]
            self._rank_batch(
                scoring,
                index,
                mapped_triples[rows],
                targets[0],
                probe_slice_size,
                exchange=probe_exchange,
                max_blocks=1,
            )

        sizes = choose_block_sizes(
            scoring, mapped_triples.shape[0], batch_size, slice_size, probe, device, memory_budget=self.memory_budget
        )
        self._block_sizes[key] = sizes
        return sizes


def _no_probe(batch_size: int, slice_size: int) -> None:
    """Stand in for a probe that is never run (both sizes given)."""


def _check_ids(ids: Iterable[int] | torch.Tensor, upper: int, name: str) -> torch.Tensor:
    """Return sorted unique ids, checked to lie in ``[0, upper)`` and to be non-empty."""
    ids = torch.as_tensor(ids if torch.is_tensor(ids) else list(ids), dtype=torch.long).view(-1).cpu().unique()
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty: there would be no candidates to rank.")
    if int(ids.min()) < 0 or int(ids.max()) >= upper:
        raise ValueError(f"{name} contains ids outside [0, {upper}).")
    return ids
