"""Scoring over entity shards: queries, candidate slices, and the block loop of evaluation and top-k.

:class:`ShardedScoring` turns ``(known entity, relation)`` queries into the scorer's queries
(handling inverse relations exactly as :meth:`pykeen.models.Model.predict_h` does), iterates over
the candidate entities of each local shard in slices (:meth:`ShardedScoring.candidate_blocks`)
and scores blocks of queries against slices (``[B, q] x [k, c] -> [B, k]``). The evaluator
(:mod:`~pykeen_bess.evaluation.ranking`) consumes the raw blocks and corrects its counts for the
excluded pairs; top-k prediction consumes :meth:`ShardedScoring.score_blocks`, which masks the
excluded ``(query, candidate)`` pairs as NaN.

The query representations are obtained by :meth:`ShardedScoring.gather_entities`
(:func:`~pykeen_bess.evaluation.rows.gather_entities`): the shard that owns an entity contributes
its row, the others zeros, and the topology sums them. In one process all shards are local and
the sum is a copy; under a process group each rank holds one shard of the tables and the same
code is correct.

Synchronisation: the id tables the scoring needs on the compute device (which local shard and
column holds each entity, the candidates' global ids:
:class:`~pykeen_bess.evaluation.candidates.DeviceTables`) are copied there once per device
(:meth:`ShardedScoring.device_tables`); afterwards gathering query rows, reading a candidate slice
and scoring a block are device operations with shapes fixed by the batch and the slice, without
host reads (tables in host memory or files excepted, see :mod:`~pykeen_bess.evaluation.rows`).
:meth:`ShardedScoring.score_blocks` (top-k) still prepares its masks on the host, once per shard
and batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from pykeen.models import ERModel, Model
from pykeen.typing import LABEL_TAIL

from ..distributed import ProcessGroupHint, Topology, make_topology
from ..tables.representation import ShardedEmbedding
from ..scoring import SharedCandidateScorer, Side, get_scorer
from ..data.sharding import EntitySharding
from .candidates import DeviceTables, ScoringLayouts
from .rows import EntityRows, ForwardRows, ShardTableRows, gather_entities, module_device

__all__ = [
    "DeviceTables",
    "Queries",
    "ScoreBlock",
    "ShardedScoring",
    "feature_norms",
    "holds_whole_model",
    "rows_and_topology",
]


@dataclasses.dataclass(eq=False)
class Queries:
    """A batch of queries in the scorer's terms."""

    #: the side the scorer predicts ("tail" also for head prediction through inverse relations)
    side: Side
    #: shape: ``[B, q]``, query features
    features: torch.Tensor


@dataclasses.dataclass(eq=False)
class ScoreBlock:
    """The scores of a batch of queries against one slice of one local shard's candidates."""

    #: the position of the shard in :attr:`ShardedScoring.local_shards`
    position: int
    #: the column of the slice's first candidate (see :class:`ShardedScoring`)
    start: int
    #: shape: ``[k]``, the global ids of the candidates (on the scores' device)
    ids: torch.Tensor
    #: shape: ``[B, k]``, the scores, NaN at the masked ``(query, candidate)`` pairs
    scores: torch.Tensor
    #: shape: ``[B]``, the number of masked entries per query (on the scores' device)
    num_masked: torch.Tensor
    #: 0-dimensional, True if a score was not finite before masking (on the scores' device; not read here)
    nonfinite: torch.Tensor


def feature_norms(features: torch.Tensor) -> torch.Tensor:
    """Return the Euclidean norm of each feature row, ``[*, f] -> [*]`` (complex features by modulus)."""
    return torch.linalg.vector_norm(features, dim=-1)


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
    column order breaks ties by entity id); see :class:`~pykeen_bess.evaluation.candidates.CandidateColumns`.
    """

    def __init__(
        self,
        model: ERModel,
        rows: EntityRows,
        topology: Topology,
        restrict_entities_to: torch.Tensor | None = None,
        order_by_id: bool = False,
        layouts: ScoringLayouts | None = None,
    ):
        """Prepare the scoring.

        :param model: the model (its relation representations and interaction are used directly)
        :param rows: the entity rows of the local shards
        :param topology: the process topology (its local shards must be those of ``rows``)
        :param restrict_entities_to: shape: ``[E']``, sorted unique global ids of the only candidates
        :param order_by_id: number the candidates of each shard by ascending global id
        :param layouts: where the id layouts of an earlier scoring are kept (None: built here)
        """
        if tuple(topology.local_shards) != tuple(rows.local_shards) or topology.n_shard != rows.sharding.n_shard:
            raise ValueError(
                f"The topology ({topology.n_shard} shards, local {topology.local_shards}) does not match the entity "
                f"rows ({rows.sharding.n_shard} shards, local {rows.local_shards})."
            )
        self.model = model
        self.rows = rows
        self.topology = topology
        self.sharding = rows.sharding
        self.scorer: SharedCandidateScorer = get_scorer(
            model.interaction,
            entity_representations=model.entity_representations,
            relation_representations=model.relation_representations,
        )
        self.head_indices = list(model.interaction.head_indices)
        self.tail_indices = list(model.interaction.tail_indices)
        #: the columns of the local shards' candidates, on the host (its fields are also attributes here)
        self.layouts = ScoringLayouts() if layouts is None else layouts
        self.columns = self.layouts.columns(self.sharding, rows.local_shards, restrict_entities_to, order_by_id)
        # per local shard: the local id of each column (None: the columns are the local ids 0..count-1)
        self.candidate_local = self.columns.candidate_local
        # per local shard: the column of each local id, -1 for non-candidates (None: the columns are the local ids)
        self.column_of_local = self.columns.column_of_local
        self.candidate_counts = self.columns.candidate_counts  # per local shard: the number of candidates
        #: shape: ``[num_entities]``, whether each entity is a candidate (None: all are)
        self.candidate_mask = self.columns.candidate_mask
        self.num_candidates = self.columns.num_candidates  # total over all shards
        self._device_tables: dict[torch.device, DeviceTables] = {}

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def for_model(
        cls,
        model: Model,
        num_shards: int | None = None,
        process_group: ProcessGroupHint = None,
        restrict_entities_to: torch.Tensor | None = None,
        order_by_id: bool = False,
        layouts: ScoringLayouts | None = None,
    ) -> ShardedScoring:
        """Choose the entity rows and the topology for a model.

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
        :param layouts: where the id layouts of an earlier scoring are kept (None: built here)
        :returns: the scoring
        :raises ValueError: for models this evaluator cannot handle
        """
        rows, topology = rows_and_topology(model, num_shards, process_group, layouts)
        restrict, order = restrict_entities_to, order_by_id
        return cls(model, rows, topology, restrict_entities_to=restrict, order_by_id=order, layouts=layouts)  # type: ignore[arg-type]

    # -- properties --------------------------------------------------------------------------

    @property
    def local_shards(self) -> tuple[int, ...]:
        """The shards processed here."""
        return self.rows.local_shards

    @property
    def max_columns(self) -> int:
        """The largest number of candidates of a local shard."""
        return max(self.candidate_counts)

    @property
    def num_local_candidates(self) -> int:
        """The number of candidates of the local shards."""
        return sum(self.candidate_counts)

    def is_candidate(self, entities: torch.Tensor) -> torch.Tensor:
        """Return whether global entity ids are candidates, shape ``[B]`` bool (on the ids' device)."""
        return self.device_tables(entities.device).is_candidate[entities]

    def device_tables(self, device: torch.device | str) -> DeviceTables:
        """Return the id tables on ``device``, built and copied there once (the only host-to-device copies)."""
        device = torch.device(device)
        tables = self._device_tables.get(device)
        if tables is None:
            tables = self.layouts.tables(self.sharding, self.local_shards, self.columns, device)
            self._device_tables[device] = tables
        return tables

    # -- queries -----------------------------------------------------------------------------

    def gather_entities(self, entities: torch.Tensor, topology: Topology | None = None) -> list[torch.Tensor]:
        """Return the representations of arbitrary entities, contributed by the shards that own them.

        See :func:`~pykeen_bess.evaluation.rows.gather_entities`: the shapes do not depend on the
        ids, the host never waits for the device, and the topology sums over processes.

        :param entities: shape: ``[B]``, global ids (on the compute device)
        :param topology: the topology to sum with (default: :attr:`topology`; probes pass a
            :class:`~pykeen_bess.distributed.ProbeTopology`)
        :returns: one tensor of shape ``[B, *shape]`` per entity representation
        """
        topology = self.topology if topology is None else topology
        return gather_entities(self.rows, self.device_tables(entities.device), entities, topology)

    def queries(
        self, target: str, known: torch.Tensor, relations: torch.Tensor, topology: Topology | None = None
    ) -> Queries:
        """Build the scorer queries for predicting ``target``.

        :param target: ``"tail"`` for ``(h, r, ?)``, ``"head"`` for ``(?, r, t)``
        :param known: shape: ``[B]``, the known entity (head for tail prediction, tail for head prediction)
        :param relations: shape: ``[B]``, the original relation ids
        :param topology: see :meth:`gather_entities`
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
        entity_parts = self.gather_entities(known, topology)
        known_indices = self.head_indices if side == "tail" else self.tail_indices
        e = _unpack([entity_parts[i] for i in known_indices])
        relation_parts = []
        for representation in model.relation_representations:
            device = module_device(representation)
            relation_parts.append(representation(indices=relations.to(device) if device is not None else relations))
        features = self.scorer.query(side, e, _unpack(relation_parts))
        return Queries(side=side, features=features)

    def _candidate_parts(self, side: Side, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        indices = self.tail_indices if side == "tail" else self.head_indices
        return self.scorer.candidates(side, _unpack([parts[i] for i in indices]))

    def true_scores(self, queries: Queries, entities: torch.Tensor, topology: Topology | None = None) -> torch.Tensor:
        """Score each query against one entity of its own (the true entity).

        :param queries: ``B`` queries
        :param entities: shape: ``[B]``, the global id of each query's entity
        :param topology: see :meth:`gather_entities`
        :returns: shape: ``[B]``
        """
        candidates = self._candidate_parts(queries.side, self.gather_entities(entities, topology))
        scores = self.scorer.score(queries.side, queries.features.unsqueeze(-2), candidates.unsqueeze(-2))
        return self._finish(scores.view(-1))

    # -- candidates --------------------------------------------------------------------------

    def candidate_blocks(
        self, side: Side, position: int, slice_size: int, device: torch.device | str | None = None
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Iterate over the candidates of one local shard in slices.

        :param side: the scorer side
        :param position: the position of the shard in :attr:`local_shards`
        :param slice_size: the number of candidates per slice
        :param device: where the candidate ids are wanted (default: the scoring device)
        :yields: ``(first column, global ids [k], candidate features [k, c])``
        """
        tables = self.device_tables(self.device if device is None else device)
        column_local = tables.column_local[position]
        column_ids = tables.column_ids[position]
        for start in range(0, self.candidate_counts[position], slice_size):
            stop = min(start + slice_size, self.candidate_counts[position])
            local: slice | torch.Tensor = slice(start, stop) if column_local is None else column_local[start:stop]
            yield start, column_ids[start:stop], self._candidate_parts(side, self.rows.rows(position, local))

    @property
    def device(self) -> torch.device:
        """The device of the scores (the device of the entity rows)."""
        template = self.rows.rows(0, slice(0, 0))[0]
        return template.device

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

    def score_blocks(
        self,
        queries: Queries,
        query_index: torch.Tensor,
        entities: torch.Tensor,
        slice_size: int,
        max_blocks: int | None = None,
    ) -> Iterator[ScoreBlock]:
        """Score a batch of queries against every local candidate, slice by slice, masking excluded pairs.

        Only one block exists at a time if the consumer drops it before asking for the next.

        :param queries: ``B`` queries
        :param query_index: shape: ``[m]``, the query of each excluded pair (filtered, true entity)
        :param entities: shape: ``[m]``, the global id of each excluded pair's entity
        :param slice_size: candidates per block
        :param max_blocks: stop after this many blocks (memory probes)
        :yields: the blocks
        """
        blocks = 0
        for position in range(len(self.local_shards)):
            masked_query, masked_column = self.local_pairs(position, query_index, entities)
            # per slice, the masked pairs are one run of the column-sorted pairs
            boundaries = torch.arange(0, self.candidate_counts[position] + slice_size, slice_size)
            runs = torch.searchsorted(masked_column, boundaries).tolist()
            blocks_of_shard = self.candidate_blocks(queries.side, position, slice_size, queries.features.device)
            for index, (start, ids, candidates) in enumerate(blocks_of_shard):
                scores = self.scores(queries, candidates)
                del candidates
                nonfinite = ~torch.isfinite(scores.sum())
                lo, hi = runs[index], runs[index + 1]
                rows = masked_query[lo:hi].to(scores.device)
                if hi > lo:
                    scores[rows, (masked_column[lo:hi] - start).to(scores.device)] = float("nan")
                num_masked = torch.bincount(rows, minlength=scores.shape[0])
                block = ScoreBlock(position, start, ids, scores, num_masked, nonfinite)
                del scores  # only the consumer holds the block: it is freed before the next one is scored
                yield block
                del block
                blocks += 1
                if max_blocks is not None and blocks >= max_blocks:
                    return

    def scores(self, queries: Queries, candidates: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Score all queries against a slice of candidates: ``[B, q] x [k, c] -> [B, k]``.

        :param out: a ``[B', k']`` buffer (``B' >= B``, ``k' >= k``) the scorer may write the scores into
            (:meth:`~pykeen_bess.scoring.SharedCandidateScorer.score_into`), or None
        """
        if out is None:
            return self._finish(self.scorer.score(queries.side, queries.features, candidates))
        return self._finish(self.scorer.score_into(queries.side, queries.features, candidates, out))

    def _finish(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(scores) if self.model.predict_with_sigmoid else scores


def holds_whole_model(model: Model) -> bool:
    """Whether PyKEEN's own scoring of the model works in this process (no entity table is spread over processes)."""
    return not any(
        isinstance(r, ShardedEmbedding) and not r.holds_all_shards for r in getattr(model, "entity_representations", ())
    )


def rows_and_topology(
    model: Model, num_shards: int | None, process_group: ProcessGroupHint, layouts: ScoringLayouts | None = None
) -> tuple[EntityRows, Topology]:
    """Choose the entity rows and the topology of a model (see :meth:`ShardedScoring.for_model`).

    ``layouts`` keeps the entity sharding of a model without sharded tables for the next call.

    :raises TypeError: for a model that is not an ``ERModel``
    :raises ValueError: for an invalid number of shards
    """
    if not isinstance(model, ERModel):
        raise TypeError(
            "BESS evaluation needs a pykeen.models.ERModel (interaction + representations), not "
            f"{type(model).__name__}."
        )
    if num_shards is not None and (isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1):
        raise ValueError(f"num_shards must be a positive integer or None, but is {num_shards!r}.")
    representations = list(model.entity_representations)
    tables = [r for r in representations if isinstance(r, ShardedEmbedding)]
    if any(table.column_part is not None for table in tables):
        raise ValueError(
            "The model's entity tables are column parts (partition='encoding' while training); evaluate it after "
            "training, when they are row shards."
        )
    if tables and len(tables) == len(representations) and num_shards in (None, tables[0].sharding.n_shard):
        rows: EntityRows = ShardTableRows(tables)
        if tables[0].holds_all_shards:
            return rows, make_topology(rows.sharding.n_shard, in_process=True)
        if process_group is None and tables[0].topology is not None:
            return rows, tables[0].topology  # the topology the tables were trained in
        return rows, make_topology(process_group=process_group)
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
    if layouts is None:
        sharding = EntitySharding.create(model.num_entities, n, seed=seed)
    else:
        sharding = layouts.sharding(model.num_entities, n, seed)
    topology = make_topology(n, in_process=True)  # every process scores all shards of a model it holds whole
    rows = ForwardRows(representations, sharding, topology.local_shards)
    return rows, topology
