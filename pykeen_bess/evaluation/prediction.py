"""Top-k link prediction over sharded entity tables.

:func:`predict_top_k` answers a batch of ``(h, r, ?)`` or ``(?, r, t)`` queries with the ``k``
highest-scoring entities without a ``[Q, num_entities]`` score matrix: every shard scores its
local entities slice by slice (the block loop of
:meth:`~pykeen_bess.evaluation.sharded.ShardedScoring.score_blocks`, over the candidate slices the
evaluator scores too) and
keeps a running top-k; the shards' top-k lists are gathered
(:meth:`~pykeen_bess.distributed.Topology.all_gather`, ``[n, B, k]`` per batch) and merged. The
order is total and deterministic: by score
(descending), ties by entity id (ascending), so the result does not depend on the number of
shards, the slice size or the batch size.

Exact per block: the ``k``-th largest score ``v`` of the block is found with :func:`torch.topk`;
all scores above ``v`` are kept, and of the scores equal to ``v`` the ones with the smallest ids
(the shard's candidates are numbered by ascending global id, so these are the first ones in
column order). The merge sorts the small ``[B, 2k]`` (or ``[B, n k]``) candidate lists by
``(score desc, id asc)`` with stable sorts.

Filtered candidates (entities completing a query to one of ``filter_triples``) and NaN scores
are never returned; a query may therefore get fewer than ``k`` rows.

**PyKEEN's scores decide** (where this process holds the whole model): the blocks are matrix
products, whose scores differ from PyKEEN's in the last bits (the sums run in another order), so
two entities PyKEEN scores equally (e.g. equal embeddings) would otherwise be ordered by rounding,
differently for other slice sizes. After the block loop, every candidate whose block score lies
within twice the evaluator's tie band (:mod:`~pykeen_bess.evaluation.counting`, ``16 eps (|v| +
||q|| max ||c||)``) below the query's ``k``-th block score ``v`` is collected in a second pass over
the blocks: PyKEEN's ``k``-th score is at least ``v`` minus one band, so every entity of PyKEEN's
top-k is among them. They are scored by PyKEEN's own ``predict_t`` / ``predict_h`` (the shapes of
its evaluation, as the evaluator's near-ties) and sorted by ``(score desc, id asc)``; the returned
scores are PyKEEN's.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pandas as pd
import torch
from pykeen.models import ERModel, Model
from pykeen.triples import CoreTriplesFactory
from pykeen.typing import LABEL_HEAD, LABEL_RELATION, LABEL_TAIL

from ..distributed import ProbeTopology, Topology
from .checks import check_triples
from .counting import TIE_TOLERANCE, band_scale, pykeen_pair_scores, unique_pairs
from .filtering import FilterIndex, FilterSide
from .sharded import ShardedScoring, feature_norms, holds_whole_model
from .sizes import choose_block_sizes

__all__ = [
    "merge_top_k",
    "predict_top_k",
    "top_k_of_block",
]


def top_k_of_block(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Select the ``k`` best entries of each row by ``(score desc, id asc)``, NaN entries never.

    :param scores: shape: ``[B, W]``, NaN for excluded entries; the columns must be sorted by id
    :param ids: shape: ``[W]``, ascending entity ids of the columns
    :param k: the number of entries to keep
    :returns: scores ``[B, k']`` and ids ``[B, k']`` with ``k' = min(k, W)``, in column order
        (not sorted); rows with fewer valid entries are padded with NaN scores and id ``-1``
    """
    batch_size, width = scores.shape
    kept = min(k, width)
    valid = ~torch.isnan(scores)
    comparable = scores.masked_fill(~valid, float("-inf"))
    threshold = torch.topk(comparable, kept, dim=1, sorted=False).values.min(dim=1, keepdim=True).values
    greater = valid & (comparable > threshold)
    ties = valid & (comparable == threshold)
    # of the ties, keep the first ones (smallest ids) up to k in total
    room = kept - greater.sum(dim=1, keepdim=True)
    selected = greater | (ties & (torch.cumsum(ties, dim=1) <= room))
    slot = torch.cumsum(selected, dim=1) - 1
    rows, columns = selected.nonzero(as_tuple=True)
    slots = slot[rows, columns]
    out_scores = scores.new_full((batch_size, kept), float("nan"))
    out_ids = torch.full((batch_size, kept), -1, dtype=torch.long, device=scores.device)
    out_scores[rows, slots] = scores[rows, columns]
    out_ids[rows, slots] = ids.to(scores.device)[columns]
    return out_scores, out_ids


def merge_top_k(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort candidate lists by ``(valid first, score desc, id asc)`` and keep the first ``k``.

    :param scores: shape: ``[B, M]``; entries with id ``-1`` are padding
    :param ids: shape: ``[B, M]``
    :param k: the number of entries to keep
    :returns: scores and ids, shape ``[B, min(k, M)]``, sorted
    """
    valid = ids >= 0
    # three stable sorts, least significant key first
    order = torch.argsort(torch.where(valid, ids, torch.iinfo(torch.long).max), dim=1, stable=True)
    key = scores.gather(1, order).masked_fill(~valid.gather(1, order), float("-inf"))
    order = order.gather(1, torch.argsort(key, dim=1, descending=True, stable=True))
    order = order.gather(1, torch.argsort(valid.gather(1, order).long(), dim=1, descending=True, stable=True))
    order = order[:, :k]
    return scores.gather(1, order), ids.gather(1, order)


def predict_top_k(
    model: Model,
    queries: Any,
    k: int,
    target: str = LABEL_TAIL,
    filter_triples: None | torch.Tensor | Sequence[torch.Tensor] = None,
    triples_factory: CoreTriplesFactory | None = None,
    num_shards: int | None = None,
    batch_size: int | None = None,
    slice_size: int | None = None,
    memory_budget: int | None = None,
) -> pd.DataFrame:
    """Predict the ``k`` best entities for each query, shard by shard.

    :param model: a PyKEEN ``ERModel`` (plain, or with
        :class:`~pykeen_bess.tables.representation.ShardedEmbedding` tables)
    :param queries: shape: ``[Q, 2]``: ``(head, relation)`` ids for ``target="tail"``,
        ``(relation, tail)`` ids for ``target="head"``; or pairs of labels with ``triples_factory``
    :param k: the number of entities per query (at most the number of entities are returned)
    :param target: ``"tail"`` or ``"head"``
    :param filter_triples: shape: ``[T, 3]`` (or a list of such): known triples whose entities are
        excluded from the answers
    :param triples_factory: maps label queries to ids and adds label columns to the result
    :param num_shards: the number of shards (None: the model's sharding, or 1)
    :param batch_size: queries per batch (None: chosen automatically)
    :param slice_size: candidates scored at once per shard (None: chosen automatically)
    :param memory_budget: see :class:`~pykeen_bess.evaluation.BessEvaluator`
    :returns: one row per (query, predicted entity), sorted by query and rank, with columns
        ``query`` (the query's position), ``head_id``, ``relation_id``, ``tail_id`` (and
        ``head_label``, ``relation_label``, ``tail_label`` with a triples factory that has
        labels), ``score`` (as :meth:`pykeen.models.Model.predict` computes it, including the
        model's sigmoid) and ``rank`` (1-based position within the query)
    :raises ValueError: for invalid queries, ``k``, targets, or sizes and budgets other than positive integers
    :raises NotImplementedError: for relation prediction
    """
    if target == LABEL_RELATION:
        raise NotImplementedError("predict_top_k predicts entities only: target='relation' is not supported.")
    if target not in (LABEL_HEAD, LABEL_TAIL):
        raise ValueError(f"Invalid target={target!r}; expected 'head' or 'tail'.")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, but is {k!r}.")
    for name, value in (
        ("batch_size", batch_size),
        ("slice_size", slice_size),
        ("memory_budget (bytes)", memory_budget),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, but is {value!r}.")
    if not isinstance(model, ERModel):
        raise TypeError(f"predict_top_k needs a pykeen.models.ERModel, not {type(model).__name__}.")
    query_ids = _query_ids(queries, target, triples_factory)
    # check ids by completing the queries to triples with a placeholder entity
    placeholder = torch.zeros(query_ids.shape[0], 1, dtype=torch.long)
    pairs_as_triples = (
        torch.cat([query_ids, placeholder], dim=1)
        if target == LABEL_TAIL
        else torch.cat([placeholder, query_ids], dim=1)
    )
    check_triples(pairs_as_triples, model.num_entities, model.num_real_relations, "queries")
    index = None
    if filter_triples is not None:
        known = [filter_triples] if torch.is_tensor(filter_triples) else list(filter_triples)
        known = [
            check_triples(t, model.num_entities, model.num_real_relations, "filter_triples", allow_empty=True)
            for t in known
        ]
        index = FilterIndex.from_triples(known, model.num_entities, model.num_real_relations)

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            scoring = ShardedScoring.for_model(model, num_shards=num_shards, order_by_id=True)
            k = min(k, scoring.num_candidates)
            probe_topology = ProbeTopology(scoring.topology)

            def probe(probe_batch_size: int, probe_slice_size: int) -> None:
                rows = torch.arange(probe_batch_size) % query_ids.shape[0]
                _top_k_batch(scoring, index, query_ids[rows], target, k, probe_slice_size, probe_topology, max_blocks=1)

            device = model.device
            batch_size, slice_size = choose_block_sizes(
                scoring, query_ids.shape[0], batch_size, slice_size, probe, device, memory_budget=memory_budget
            )
            # PyKEEN's own scores order the candidates near the k-th score where its scoring works here
            exact = scoring.topology.holds_all_shards and holds_whole_model(model)
            results = [
                _top_k_batch(scoring, index, batch, target, k, slice_size, scoring.topology, pykeen_order=exact)
                for batch in query_ids.split(batch_size)
            ]
    finally:
        model.train(was_training)
    scores = torch.cat([r[0] for r in results]).cpu()
    ids = torch.cat([r[1] for r in results]).cpu()
    nan_count = sum(r[2] for r in results)
    if nan_count:
        warnings.warn(
            f"The model produced {nan_count} NaN scores; those entities were not ranked.", RuntimeWarning, stacklevel=2
        )
    return _to_frame(query_ids, scores, ids, target, triples_factory)


def _top_k_batch(
    scoring: ShardedScoring,
    index: FilterIndex | None,
    batch: torch.Tensor,
    target: str,
    k: int,
    slice_size: int,
    topology: Topology,
    max_blocks: int | None = None,
    pykeen_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Top-k of one batch of queries: local running top-k per shard, then an exact merge over shards.

    :param pykeen_order: order the candidates near the ``k``-th score by PyKEEN's own scores (see the module
        docstring; needs the whole model in this process)
    :returns: scores ``[B, k]``, ids ``[B, k]`` (``-1``: no entity) and the number of NaN scores
    """
    if target == LABEL_TAIL:
        known, relations = batch[:, 0], batch[:, 1]
    else:
        relations, known = batch[:, 0], batch[:, 1]
    batch_size = batch.shape[0]
    queries = scoring.queries(target, known, relations, topology=topology)
    if index is not None:
        pairs = index.filtered(cast(FilterSide, target), known, relations)
        query_index, entities = unique_pairs(*pairs, scoring.sharding.num_entities)
    else:
        query_index = entities = torch.empty(0, dtype=torch.long)
    dtype = queries.features.real.dtype if queries.features.is_complex() else queries.features.dtype
    device = queries.features.device
    best_scores = [torch.full((batch_size, 0), float("nan"), dtype=dtype, device=device) for _ in scoring.local_shards]
    best_ids = [torch.full((batch_size, 0), -1, dtype=torch.long, device=device) for _ in scoring.local_shards]
    nan_count = torch.zeros((), dtype=torch.long, device=device)  # read once per batch, not per block
    for block in scoring.score_blocks(queries, query_index, entities, slice_size, max_blocks):
        nan_count += torch.isnan(block.scores).sum() - block.num_masked.sum()
        block_scores, block_ids = top_k_of_block(block.scores, block.ids, k)
        position = block.position
        best_scores[position], best_ids[position] = merge_top_k(
            torch.cat([best_scores[position], block_scores], dim=1),
            torch.cat([best_ids[position], block_ids], dim=1),
            k,
        )
        del block  # release the block before the next one is allocated
    local_scores = [_pad(scores, k, float("nan")) for scores in best_scores]
    local_ids = [_pad(ids, k, -1) for ids in best_ids]
    # [L, B, k] -> every shard's lists [n, B, k] -> one merge
    gathered_scores = topology.all_gather(torch.stack(local_scores))[0]
    gathered_ids = topology.all_gather(torch.stack(local_ids))[0]
    nan_total = int(topology.shard_all_reduce(nan_count.view(1))[0])
    merged_scores, merged_ids = merge_top_k(
        gathered_scores.permute(1, 0, 2).reshape(batch_size, -1),
        gathered_ids.permute(1, 0, 2).reshape(batch_size, -1),
        k,
    )
    if pykeen_order and max_blocks is None:
        merged_scores, merged_ids = _in_pykeen_order(
            scoring, queries, query_index, entities, batch, target, k, slice_size, merged_scores
        )
    return merged_scores, merged_ids, nan_total


def _in_pykeen_order(
    scoring: ShardedScoring,
    queries: Any,
    query_index: torch.Tensor,
    entities: torch.Tensor,
    batch: torch.Tensor,
    target: str,
    k: int,
    slice_size: int,
    block_top_k: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the top-k by PyKEEN's scores: of every candidate within two bands of the ``k``-th block score.

    :param queries: the batch's queries (as :meth:`ShardedScoring.queries` returns them)
    :param query_index: shape: ``[m]``, the query of each excluded pair
    :param entities: shape: ``[m]``, the entity of each excluded pair
    :param batch: shape: ``[B, 2]``, the query ids
    :param block_top_k: shape: ``[B, k]``, the block scores of the block loop's top-k (NaN: fewer than ``k``)
    :returns: PyKEEN's scores ``[B, k]`` and ids ``[B, k]`` (``-1``: no entity), sorted by ``(score desc, id asc)``
    """
    batch_size = batch.shape[0]
    kth = block_top_k[:, -1]
    candidate_norm = torch.zeros((), dtype=kth.dtype, device=kth.device)
    for position in range(len(scoring.local_shards)):
        for _, _, candidates in scoring.candidate_blocks(queries.side, position, slice_size, kth.device):
            # a candidate with NaN features has NaN scores, ranked by no band: its norm must not make the band NaN
            norms = torch.nan_to_num(feature_norms(candidates), nan=0.0, posinf=float("inf"))
            candidate_norm = torch.maximum(candidate_norm, norms.amax().to(kth.dtype))
    base, slope = band_scale(kth, feature_norms(queries.features).to(kth.dtype), TIE_TOLERANCE)
    # fewer than k valid candidates: all of them
    lower = torch.where(torch.isnan(kth), float("-inf"), kth - 2 * torch.addcmul(base, slope, candidate_norm))
    rows, ids = [], []
    for block in scoring.score_blocks(queries, query_index, entities, slice_size):
        row, column = (block.scores >= lower.unsqueeze(1)).nonzero(as_tuple=True)  # (NaN: excluded or masked)
        rows.append(row)
        ids.append(block.ids[column])
        del block
    row, entity = torch.cat(rows), torch.cat(ids)
    order = torch.argsort(row, stable=True)
    row, entity = row[order], entity[order]
    placeholder = torch.zeros(batch_size, 1, dtype=torch.long, device=batch.device)
    triples = torch.cat([batch, placeholder], dim=1) if target == LABEL_TAIL else torch.cat([placeholder, batch], dim=1)
    scores = pykeen_pair_scores(scoring.model, target, triples.to(row.device), row, entity)
    valid = ~torch.isnan(scores)
    row, entity, scores = row[valid], entity[valid], scores[valid]
    # one padded [B, M] list per query, merged as the block loop's lists
    counts = torch.bincount(row, minlength=batch_size)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    slot = torch.arange(row.shape[0], device=row.device) - (torch.cumsum(counts, 0) - counts)[row]
    padded_scores = scores.new_full((batch_size, width), float("nan"))
    padded_ids = torch.full((batch_size, width), -1, dtype=torch.long, device=row.device)
    padded_scores[row, slot] = scores
    padded_ids[row, slot] = entity
    merged_scores, merged_ids = merge_top_k(padded_scores, padded_ids, k)
    return _pad(merged_scores, k, float("nan")), _pad(merged_ids, k, -1)


def _pad(x: torch.Tensor, k: int, value: float) -> torch.Tensor:
    """Pad ``[B, k']`` to ``[B, k]`` with ``value``."""
    if x.shape[1] == k:
        return x
    return torch.cat([x, x.new_full((x.shape[0], k - x.shape[1]), value)], dim=1)


def _query_ids(queries: Any, target: str, triples_factory: CoreTriplesFactory | None) -> torch.Tensor:
    """Return the queries as a ``[Q, 2]`` long tensor (mapping labels with the triples factory)."""
    if torch.is_tensor(queries):
        array = queries.detach().cpu().numpy()
    else:
        array = np.asarray(queries, dtype=object if _has_strings(queries) else None)
    if array.ndim == 1 and array.shape[0] == 2:
        array = array.reshape(1, 2)
    if array.ndim != 2 or array.shape[1] != 2:
        raise ValueError(f"queries must have shape [Q, 2], but have shape {list(array.shape)}.")
    if array.shape[0] == 0:
        raise ValueError("queries is empty: there is nothing to predict.")
    if array.dtype.kind in "iu":
        return torch.as_tensor(array.astype(np.int64))
    if array.dtype.kind != "O" and array.dtype.kind not in "US":
        raise ValueError(f"queries must hold integer ids or labels, but have dtype {array.dtype}.")
    if triples_factory is None or not hasattr(triples_factory, "entity_to_id"):
        raise ValueError("Label queries need a triples_factory with labels (a pykeen.triples.TriplesFactory).")
    labeled: Any = triples_factory
    entity_column, relation_column = (0, 1) if target == LABEL_TAIL else (1, 0)
    mapped = np.empty(array.shape, dtype=np.int64)
    for column, mapping, kind in (
        (entity_column, labeled.entity_to_id, "entity"),
        (relation_column, labeled.relation_to_id, "relation"),
    ):
        labels = pd.Series(array[:, column].astype(str))
        ids = labels.map(mapping)
        unknown = labels[ids.isna()].unique()
        if len(unknown):
            raise ValueError(f"Unknown {kind} labels in queries: {list(unknown[:5])}.")
        mapped[:, column] = ids.to_numpy(dtype=np.int64)
    return torch.as_tensor(mapped)


def _has_strings(queries: Any) -> bool:
    try:
        first = next(iter(queries))
        return any(isinstance(x, str) for x in first)
    except (StopIteration, TypeError):
        return False


def _to_frame(
    query_ids: torch.Tensor,
    scores: torch.Tensor,
    ids: torch.Tensor,
    target: str,
    triples_factory: CoreTriplesFactory | None,
) -> pd.DataFrame:
    """Assemble the result: one row per valid (query, entity), ordered by query and rank."""
    valid = ids >= 0
    query_index, rank_index = valid.nonzero(as_tuple=True)
    predicted = ids[query_index, rank_index].numpy()
    fixed = query_ids[query_index].numpy()
    if target == LABEL_TAIL:
        heads, relations, tails = fixed[:, 0], fixed[:, 1], predicted
    else:
        heads, relations, tails = predicted, fixed[:, 0], fixed[:, 1]
    columns: dict[str, Any] = {"query": query_index.numpy(), "head_id": heads}
    labeled: Any = triples_factory
    has_labels = labeled is not None and hasattr(labeled, "entity_id_to_label")
    if has_labels:
        entity_labels = _label_array(labeled.entity_id_to_label, labeled.num_entities)
        relation_labels = _label_array(labeled.relation_id_to_label, labeled.num_relations)
        columns["head_label"] = entity_labels[heads]
    columns["relation_id"] = relations
    if has_labels:
        columns["relation_label"] = relation_labels[relations]
    columns["tail_id"] = tails
    if has_labels:
        columns["tail_label"] = entity_labels[tails]
    columns["score"] = scores[query_index, rank_index].numpy()
    columns["rank"] = rank_index.numpy() + 1
    return pd.DataFrame(columns)


def _label_array(id_to_label: Any, size: int) -> np.ndarray:
    """Labels as an array indexed by id (``""`` for ids without a label)."""
    labels = np.full(size, "", dtype=object)
    items = np.asarray(list(id_to_label.items()), dtype=object)
    if len(items):
        labels[items[:, 0].astype(np.int64)] = items[:, 1]
    return labels
