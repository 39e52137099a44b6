"""Near-ties: the queries with candidates inside the band, whose comparisons PyKEEN's own scores decide.

After the block loop of :mod:`~pykeen_bess.evaluation.ranking`, a query with candidates inside the
band around its true score (see :mod:`~pykeen_bess.evaluation.counting`) needs those candidates
compared by PyKEEN's scores, and a query with non-finite scores an element-by-element count:

* on the CPU, where reading sizes costs nothing, and on other devices with large blocks, the block
  loop collects each block's candidates inside the band as it goes (:func:`band_candidates`), and
  :func:`resolve_collected` compares them, without scoring any query again;
* otherwise (and for non-finite scores) :func:`rank_again` scores the flagged queries again, in
  chunks, collecting the band's candidates (or counting exactly).

Queries with non-finite scores, where this process holds the whole model, are counted by PyKEEN's own
full score rows instead (:func:`count_by_pykeen_rows`), and so are all queries of a model without a fast
scorer (:func:`rank_by_pykeen_rows`: its block scores would be its interaction's broadcast, slower than
PyKEEN's own calls, whose near-ties PyKEEN's scores would decide again): whether a score overflows, becomes infinite or
NaN depends on how it is computed (a distance's norm expansion turns PyKEEN's ``-inf`` into
``inf - inf = NaN``), so only PyKEEN's scores give PyKEEN's ranks there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from pykeen.typing import LABEL_TAIL

from ..runtime.threads import ThreadPolicy
from .counting import (
    PYKEEN_CALL_ELEMENTS,
    band_bounds,
    band_scale,
    count_block,
    count_exactly,
    pykeen_comparisons,
    pykeen_slice_size,
    row_width,
)
from .excluded import ExcludedPairs
from .sharded import ShardedScoring, feature_norms

__all__ = [
    "band_candidates",
    "comparison_queries",
    "count_by_pykeen_rows",
    "rank_again",
    "rank_by_pykeen_rows",
    "resolve_collected",
]


def comparison_queries(device: torch.device) -> int:
    """Return the queries per call of PyKEEN's scoring when near-ties are compared (scores ``[b, b + m]``).

    32 on the CPU, where the scores of every query against every entity of its call (``b x (b + m)``,
    with ``m`` about ``b`` candidates) are arithmetic of their own, against a call's fixed cost of about
    0.15 ms (about 900 near-tie queries of a generated FB15k-237-sized graph: 64 per call 16-17 ms, 32 per
    call 13-16 ms, 8 per call 26-33 ms); 1024 elsewhere, where a call's fixed cost (a few dozen kernel
    launches) dominates (a thousand near-tie queries are one or two calls).
    """
    return 32 if device.type == "cpu" else 1024


def band_candidates(
    scores: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    others: torch.Tensor,
    pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    position: int,
    start: int,
    ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return a block's candidates inside the band that are not excluded: ``(rows [m], candidate ids [m])``.

    Only the rows with entries in the band other than their excluded pairs (``others > 0``: the
    band's candidates, and NaN scores, which are neither above nor below) are compared again, in a
    copy in which the block's excluded pairs are NaN (never inside the band). Reads sizes on the host (a
    few times per block): for the CPU, where that costs nothing, and for blocks large enough that it
    costs little.

    :param scores: shape: ``[B, k]``
    :param lower: shape: ``[B]``
    :param upper: shape: ``[B]``
    :param others: shape: ``[B]``, the block's entries per row that are neither above nor below nor
        excluded
    :param pairs: the excluded pairs: rows, positions, columns (those of other blocks are ignored)
    :param position: the slice's shard position
    :param start: the slice's first column
    :param ids: shape: ``[k]``, the slice's candidate ids
    """
    width = scores.shape[1]
    rows = (others > 0).nonzero().view(-1)
    block = scores.index_select(0, rows)  # (a gather of whole rows; indexing with ``scores[rows]`` took 2x as long)
    excluded_rows, positions, columns = pairs
    if excluded_rows.numel():  # the excluded entries of the gathered rows become NaN: neither inside nor outside
        row_in_block = torch.full((scores.shape[0],), -1, dtype=torch.long, device=scores.device)
        row_in_block[rows] = torch.arange(rows.shape[0], device=scores.device)
        excluded_rows = row_in_block[excluded_rows]
        here = (excluded_rows >= 0) & (positions == position) & (columns >= start) & (columns < start + width)
        block[excluded_rows[here], columns[here] - start] = float("nan")
    inside = torch.ge(block, lower.index_select(0, rows).unsqueeze(1))
    inside.logical_and_(torch.le(block, upper.index_select(0, rows).unsqueeze(1)))
    row, column = inside.nonzero(as_tuple=True)
    return rows[row], ids[column]


def resolve_collected(
    scoring: ShardedScoring,
    triples: torch.Tensor,
    target: str,
    near: torch.Tensor,
    collected: list[tuple[torch.Tensor, torch.Tensor]],
    counts: torch.Tensor,
    finite: torch.Tensor,
    larger: torch.Tensor,
    not_smaller: torch.Tensor,
) -> int:
    """Rank the near-tie queries from the band candidates the first pass collected (no query scored again).

    A near-tie query's ``above`` and ``below`` are final; its candidates inside the band (``m`` of
    them) are compared by PyKEEN's scores: ``larger = above + larger_m``, ``not_smaller = finite -
    below - m + not_smaller_m``, what :func:`rank_again` computes after scoring the query again.

    :param near: shape: ``[Q]``, bool: the queries with candidates inside the band (and finite scores)
    :param collected: the ``(query indices [m], candidate ids [m])`` of every block
    :param counts: shape: ``[4, Q]``: ``above``, ``below``, ...
    :param finite: shape: ``[Q]``, the finite candidates of every query
    :param larger: shape: ``[Q]``, updated in place for the near-tie queries
    :param not_smaller: shape: ``[Q]``, updated in place for the near-tie queries
    :returns: the number of near-tie queries
    """
    queries = near.nonzero().view(-1)
    if not collected or queries.numel() == 0:
        return 0
    rows, ids = torch.cat([row for row, _ in collected]), torch.cat([ids for _, ids in collected])
    keep = near[rows]
    rows, ids = rows[keep], ids[keep]
    order = torch.argsort(rows, stable=True)
    rows, ids = rows[order], ids[order]
    band = torch.bincount(rows, minlength=near.shape[0])[queries]
    compared_larger, compared_not_smaller = pykeen_comparisons(
        scoring.model,
        target,
        triples[queries],
        torch.searchsorted(queries, rows),
        ids,
        max_queries=comparison_queries(triples.device),
    )
    larger[queries] = counts[0, queries] + compared_larger
    not_smaller[queries] = finite[queries] - counts[1, queries] - band + compared_not_smaller
    return int(queries.numel())


def rank_again(
    scoring: ShardedScoring,
    triples: torch.Tensor,
    target: str,
    queries_index: torch.Tensor,
    pairs: ExcludedPairs,
    slice_size: int,
    tolerance: float,
    threads: ThreadPolicy | None,
    finite: torch.Tensor | None,
) -> torch.Tensor:
    """Count some queries again, their near-ties (candidates inside the band) by PyKEEN's scores.

    With ``finite`` (queries whose scores were all finite: only near-ties to resolve) the blocks
    are counted as in the first pass, with the excluded pairs masked as NaN, and the candidates
    inside the band are collected; otherwise (queries with non-finite scores) every block is
    counted element by element (:func:`~pykeen_bess.evaluation.counting.count_exactly`).

    :param triples: shape: ``[n, 3]``, the queries' triples
    :param queries_index: shape: ``[n]``, their global query indices
    :param tolerance: the band's half width (0: no near-ties to resolve)
    :param finite: shape: ``[n]``, the number of candidates of each query (all scores finite), or None
    :returns: shape: ``[4, n]``, long: ``larger``, ``not_smaller``, ``finite``, ``nan``, summed over the shards
    """
    heads, relations, tails = triples.unbind(dim=1)
    known, true = (heads, tails) if target == LABEL_TAIL else (tails, heads)
    queries = scoring.queries(target, known, relations)
    true_scores = scoring.true_scores(queries, true)
    band_parts = band_scale(true_scores, feature_norms(queries.features), tolerance)
    row, position, column = pairs.of_queries(queries_index, pairs.per_query.shape[0])
    num_queries = triples.shape[0]
    # larger (or above), not_smaller (or below), finite, nan; the fast path counts the band in the third row
    counts = torch.zeros((4, num_queries), dtype=torch.long, device=true_scores.device)
    band_rows, band_ids = [], []
    for index in range(len(scoring.local_shards)):
        for start, ids, candidates in scoring.candidate_blocks(queries.side, index, slice_size, triples.device):
            with contextlib.nullcontext() if threads is None else threads.unit():
                lower, upper = band_bounds(true_scores, *band_parts, feature_norms(candidates).amax())
                scores = scoring.scores(queries, candidates)
                inside = (position == index) & (column >= start) & (column < start + scores.shape[1])
                if finite is not None:
                    scores[row[inside], column[inside] - start] = float("nan")
                    count_block(scores, lower, upper, counts[:2])
                    band = (scores >= lower.unsqueeze(1)) & (scores <= upper.unsqueeze(1))
                else:
                    excluded = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
                    excluded[row[inside], column[inside] - start] = True
                    band = count_exactly(scores, true_scores, lower, upper, excluded, counts)
                if tolerance > 0:
                    band_row, band_column = band.nonzero(as_tuple=True)
                    band_rows.append(band_row)
                    band_ids.append(ids[band_column])
                del scores, band
    if finite is not None:
        band_count = torch.zeros_like(counts[2])
        for band_row in band_rows:
            band_count.index_add_(0, band_row, torch.ones_like(band_row))
        counts[2] = band_count
    counts = scoring.topology.shard_all_reduce(counts)
    if finite is not None:  # above, below and the band's size -> larger, not_smaller outside the band
        counts[1] = finite - counts[1] - counts[2]
        counts[2] = finite
        counts[3] = 0
    if band_rows:
        rows = torch.cat(band_rows)
        order = torch.argsort(rows, stable=True)
        larger, not_smaller = pykeen_comparisons(
            scoring.model, target, triples, rows[order], torch.cat(band_ids)[order], comparison_queries(triples.device)
        )
        counts[0] += larger
        counts[1] += not_smaller
    return counts


def count_by_pykeen_rows(
    scoring: ShardedScoring,
    triples: torch.Tensor,
    target: str,
    queries_index: torch.Tensor,
    pairs: ExcludedPairs,
    max_queries: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Count some queries by PyKEEN's own full score rows, element by element (whole model in this process).

    The rows come from :meth:`pykeen.models.Model.predict_t` / :meth:`~pykeen.models.Model.predict_h` of all
    entities (PyKEEN's evaluation shapes, at least two queries per call), restricted to the candidates; the
    excluded pairs (filtered, the true entity) are left out, and the true score is taken from the same row.

    :param triples: shape: ``[n, 3]``, the queries' triples
    :param queries_index: shape: ``[n]``, their global query indices
    :param max_queries: the most queries per PyKEEN call (default: as many as :data:`PYKEEN_CALL_ELEMENTS` allows)
    :returns: ``larger``, ``not_smaller``, ``finite``, ``nan`` of shape ``[4, n]`` (long) and the true scores ``[n]``
    """
    tables = scoring.device_tables(triples.device)
    candidate_ids = torch.cat(list(tables.column_ids))
    offsets = torch.tensor([0, *scoring.candidate_counts], device=triples.device).cumsum(0)[:-1]
    row, position, column = pairs.of_queries(queries_index, pairs.per_query.shape[0])
    num_entities, width = scoring.model.num_entities, row_width(scoring.model)
    # within PYKEEN_CALL_ELEMENTS of PyKEEN's [b, E, d] intermediates: fewer queries, then slices of the entities
    chunk_size = max(2, min(PYKEEN_CALL_ELEMENTS // max(num_entities * width, 1), max_queries or num_entities))
    entity_slice = pykeen_slice_size(num_entities, PYKEEN_CALL_ELEMENTS // (chunk_size * width))
    slice_size = entity_slice if entity_slice < num_entities else None
    counts = torch.zeros((4, triples.shape[0]), dtype=torch.long, device=triples.device)
    true_scores = torch.zeros(triples.shape[0], device=triples.device)
    column_of_true = 2 if target == LABEL_TAIL else 0
    for begin in range(0, triples.shape[0], chunk_size):
        chunk = triples[begin : begin + chunk_size]
        size = chunk.shape[0]
        queries = chunk if size > 1 else chunk.repeat(2, 1)  # (PyKEEN's evaluation shapes)
        if target == LABEL_TAIL:
            rows = scoring.model.predict_t(queries[:, :2], slice_size=slice_size)[:size]
        else:
            rows = scoring.model.predict_h(queries[:, 1:], slice_size=slice_size)[:size]
        true = rows[torch.arange(size, device=rows.device), chunk[:, column_of_true]]
        scores = rows[:, candidate_ids.to(rows.device)]
        kept = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
        here = (row >= begin) & (row < begin + size)
        kept[row[here] - begin, (offsets[position[here]] + column[here]).to(scores.device)] = False
        true_column = true.unsqueeze(1)
        for index, flags in enumerate(
            (scores > true_column, scores >= true_column, torch.isfinite(scores), torch.isnan(scores))
        ):
            counts[index, begin : begin + size] = (flags & kept).sum(dim=1).to(counts.device)
        if true_scores.dtype != true.dtype:
            true_scores = true_scores.to(true.dtype)
        true_scores[begin : begin + size] = true.to(true_scores.device)
    return counts, true_scores


#: the most queries per PyKEEN call of :func:`rank_by_pykeen_rows` (PyKEEN's evaluation batch on the CPU)
PYKEEN_ROW_QUERIES = 32


def rank_by_pykeen_rows(
    scoring: ShardedScoring,
    triples: torch.Tensor,
    target: str,
    pairs: ExcludedPairs,
    owned: torch.Tensor,
    batch_size: int,
    on_batch: Callable[[int], object] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank every query this process owns by PyKEEN's own full score rows (:func:`count_by_pykeen_rows`).

    For models without a fast scorer, in a process holding the whole model: PyKEEN's scores decide every
    comparison, as its evaluator's do, with no near-ties left to resolve. A call scores at most
    :data:`PYKEEN_ROW_QUERIES` queries on every device (PyKEEN's own evaluation batch on the CPU): such an
    interaction's intermediates may be far wider than its representations (ConvKB's ``[b, E, filters, d]``), and
    the evaluator's ``memory_budget`` does not see them.

    :param triples: shape: ``[Q, 3]``, the evaluation triples
    :param owned: shape: ``[Q]``, bool: the queries this process ranks
    :param batch_size: queries per chunk (progress is reported per chunk)
    :param on_batch: called with the number of queries after each chunk (progress), or None
    :returns: shape: ``[4, Q]`` long ``larger``, ``not_smaller``, ``finite``, ``nan`` (zero for the queries not
        owned), and the true scores ``[Q]``
    """
    counts = torch.zeros((4, triples.shape[0]), dtype=torch.long, device=triples.device)
    true_scores: torch.Tensor | None = None
    for chunk in owned.nonzero().view(-1).split(max(batch_size, 1)):
        counted, true = count_by_pykeen_rows(
            scoring, triples[chunk], target, chunk, pairs, max_queries=PYKEEN_ROW_QUERIES
        )
        counts[:, chunk] = counted
        if true_scores is None:
            true_scores = torch.zeros(triples.shape[0], dtype=true.dtype, device=triples.device)
        true_scores[chunk] = true.to(true_scores)
        if on_batch is not None:
            on_batch(chunk.shape[0])
    return counts, torch.zeros(triples.shape[0], device=triples.device) if true_scores is None else true_scores
