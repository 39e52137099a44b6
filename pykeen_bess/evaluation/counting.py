"""Rank counting: per-query counts of one block of scores, and PyKEEN's ranks from the summed counts.

For a batch of ``B`` queries with true scores ``t`` every shard counts, per query and over its
candidates, the scores outside a narrow *band* ``[t - tau, t + tau]`` around the true score:

* ``above``: candidates scoring more than ``t + tau``,
* ``below``: candidates scoring less than ``t - tau``,

(:func:`count_block`), and subtracts the contributions of the excluded ``(query, candidate)``
pairs, the filtered candidates and the true entity itself (:func:`subtract_excluded`): a block is
never masked. Every shape is fixed by the batch, the slice and the number of excluded pairs per
batch, and nothing is read on the host: a block is a fixed sequence of device operations. Without
candidates inside the band, ``larger = above`` and ``not_smaller = candidates - below``.

Why a band: PyKEEN ranks with the scores of its own interaction (for DistMult an element-wise
product and a sum over the dimension) and takes the true score from the same row; the blocks here
are matrix products, which sum in another order, and the true score is a separate batched
product. Two scores within a few units of rounding can therefore compare otherwise than in
PyKEEN: this is why the metrics of a float32 DistMult differed from PyKEEN's on an H100 (and, less
often, on the CPU). Measured on an H100 (torch 2.11, TF32 off) with DistMult d=256 on WN18RR: 8 of
6,268 queries ranked differently with the separately computed true score and 14 with the true
score taken from the block's own product (so the summation order of the products is the cause,
not only the true score's kernel); an entity with the true entity's embedding ties exactly in
PyKEEN but not here (``tests/evaluation/test_ties.py``). The band's half width
``tau = tie_tolerance * eps * (|t| + ||q|| max ||c||)`` (``eps`` of the score dtype, ``q`` the
query features, ``c`` the slice's candidate features; :func:`band_scale` once per batch,
:func:`band_bounds` per block) bounds the difference of the two roundings: the largest difference
between a block's score and PyKEEN's seen on the H100 and the CPU was ``6 eps ||q|| max ||c||``.
A query with candidates inside the band (exact ties included) is counted again and its
candidates inside the band are compared by PyKEEN's own scores (:func:`pykeen_comparisons`); every
other comparison cannot differ from PyKEEN's. Queries with non-finite scores are counted again
element by element (:func:`count_exactly`).

:func:`ranks_from_counts` adds the true entity's own contribution, exactly as PyKEEN's
:meth:`pykeen.evaluation.ranks.Ranks.from_scores` sees it after
:func:`pykeen.evaluation.evaluator.filter_scores_` restored its column.

Memory: :func:`count_block` allocates per block two ``[B]`` counts and, on a GPU, one boolean
``[B, k]`` comparison at a time; on the CPU it works in row chunks of :data:`COUNT_CHUNK_ELEMENTS`
scores per intra-op thread through one cache-sized float buffer.
"""

from __future__ import annotations

import math

import torch
from pykeen.models import Model
from pykeen.typing import LABEL_TAIL

__all__ = [
    "COUNT_CHUNK_ELEMENTS",
    "TIE_TOLERANCE",
    "band_bounds",
    "band_scale",
    "count_block",
    "count_exactly",
    "finite_by_norms",
    "pykeen_comparisons",
    "PYKEEN_CALL_ELEMENTS",
    "pykeen_pair_scores",
    "pykeen_slice_size",
    "row_width",
    "ranks_from_counts",
    "subtract_excluded",
    "unique_pairs",
]

#: the number of scores compared at once on the CPU per intra-op thread (a chunk of a block's rows whose scores
#: and 0 / 1 flags, 1 MiB per thread, stay in a core's own cache): on a 2-core machine with 2 MiB of L2 per core,
#: ``[2000, 4096]`` blocks were counted 1.2-1.4x faster than in chunks of 2^19 scores (2 threads; 1.5x with 1
#: thread); chunks of 2^15 per thread were slower again (the parallel regions' fixed costs), and a later
#: machine of the same kind evaluated a generated FB15k-237-sized graph and WN18RR 3-4% faster with 2^17 than
#: with 2^16
COUNT_CHUNK_ELEMENTS = 2**17

#: the default half width of the band, in units of ``eps * (|t| + ||q|| max ||c||)`` (see the module docstring)
TIE_TOLERANCE = 16.0


def band_scale(
    true_scores: torch.Tensor, query_norms: torch.Tensor, tolerance: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the per-query parts of the band's half width ``tau = base + slope * max ||c||`` (once per batch).

    :param true_scores: shape: ``[B]``, the true scores ``t``
    :param query_norms: shape: ``[B]``, the norms of the query features
    :param tolerance: the half width in units of ``eps * (|t| + ||q|| max ||c||)``; 0: exact comparisons
    :returns: ``base = tolerance * eps * |t|`` and ``slope = tolerance * eps * ||q||``, each of shape ``[B]``
    """
    factor = tolerance * torch.finfo(true_scores.dtype).eps
    return true_scores.abs() * factor, query_norms * factor


def band_bounds(
    true_scores: torch.Tensor, base: torch.Tensor, slope: torch.Tensor, candidate_norm: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the band ``[t - tau, t + tau]`` of every query against one slice (see the module docstring).

    A non-finite true score gets an empty band (``t - tau`` is NaN or ``-inf < t``): its comparisons
    are exact, and its query is counted again element by element anyway.

    :param true_scores: shape: ``[B]``, the true scores ``t``
    :param base: shape: ``[B]``, from :func:`band_scale`
    :param slope: shape: ``[B]``, from :func:`band_scale`
    :param candidate_norm: shape: ``[]``, the largest norm of the slice's candidate features
    :returns: the lower and upper bounds, each of shape ``[B]``
    """
    tau = torch.addcmul(base, slope, candidate_norm)
    return true_scores - tau, true_scores + tau


def finite_by_norms(query_norms: torch.Tensor, candidate_norm: torch.Tensor) -> torch.Tensor:
    """Return which queries' scores against a slice are finite by their norms alone, ``[B]`` (bool).

    For a scorer whose scores are a finite-preserving function of the product of query and candidate
    features (:attr:`~pykeen_bess.scoring.SharedCandidateScorer.bounded_by_feature_norms`), every
    partial sum of a product is at most about ``||q|| ||c||`` (Cauchy-Schwarz, up to a relative
    rounding of ``d eps``): with finite features and ``||q|| max ||c||`` below a quarter of the
    dtype's largest value no score can be infinite or NaN. A NaN or infinite norm (non-finite
    features, or a norm that overflowed) is not below it: such rows are counted again exactly.

    :param query_norms: shape: ``[B]``, the norms of the query features
    :param candidate_norm: shape: ``[]``, the largest norm of the slice's candidate features
    """
    return query_norms * candidate_norm < torch.finfo(query_norms.dtype).max / 4


def count_block(
    scores: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    counts: torch.Tensor,
    chunked: bool | None = None,
    row_sums: bool = True,
) -> torch.Tensor | None:
    """Add one block's ``above`` and ``below`` counts to ``counts``; return the sum of every row.

    A row's sum is finite unless the block holds a non-finite score in it (or the finite scores
    overflow), which is how the caller finds the rows that need :func:`count_exactly`, unless it knows
    the scores to be finite (:func:`finite_by_norms`; ``row_sums=False``: no sums, one pass over the
    scores less); a NaN score is neither above nor below. On the CPU the rows are compared in chunks of
    :data:`COUNT_CHUNK_ELEMENTS` scores per intra-op thread into one float buffer (0 / 1, summed
    exactly: float32 below ``2^24`` columns, float64 beyond), which stays in the cores' caches;
    elsewhere each comparison is one ``[B, k]`` tensor of half-precision flags (2 bytes per score),
    summed the same way.

    :param scores: shape: ``[B, k]``
    :param lower: shape: ``[B]``, the lower ends of the bands
    :param upper: shape: ``[B]``, the upper ends of the bands
    :param counts: shape: ``[2, B]``, long: ``above`` and ``below``, updated in place
    :param chunked: compare in cache-sized chunks (default: on the CPU)
    :param row_sums: whether to sum the rows
    :returns: shape: ``[B]``, the row sums of the scores (None without ``row_sums``)
    """
    batch_size, width = scores.shape
    lower, upper = lower.unsqueeze(1), upper.unsqueeze(1)
    total_dtype = torch.float64 if scores.dtype == torch.float64 or width >= 2**24 else torch.float32
    if not (scores.device.type == "cpu" if chunked is None else chunked):
        # 0 / 1 flags in half precision, summed in float32 (exact below 2^24 columns): a GPU reads a half
        # tensor into a float32 sum without converting it first, where a boolean sum converts the whole
        # block to int64 (8 bytes per score written and read again)
        flags = torch.empty(scores.shape, dtype=torch.float16, device=scores.device)
        torch.gt(scores, upper, out=flags)
        counts[0] += torch.sum(flags, dim=1, dtype=total_dtype).long()
        torch.lt(scores, lower, out=flags)
        counts[1] += torch.sum(flags, dim=1, dtype=total_dtype).long()
        return scores.sum(dim=1) if row_sums else None
    chunk_rows = max(1, COUNT_CHUNK_ELEMENTS * torch.get_num_threads() // max(width, 1))
    buffer = torch.empty((min(chunk_rows, batch_size), width), dtype=total_dtype, device=scores.device)
    found = torch.empty((2, batch_size), dtype=total_dtype, device=scores.device)
    sums = torch.empty(batch_size, dtype=scores.dtype, device=scores.device) if row_sums else None
    for start in range(0, batch_size, chunk_rows):
        rows = slice(start, start + chunk_rows)
        chunk = scores[rows]
        flags = buffer[: chunk.shape[0]]
        torch.gt(chunk, upper[rows], out=flags)
        torch.sum(flags, dim=1, out=found[0, rows])
        torch.lt(chunk, lower[rows], out=flags)
        torch.sum(flags, dim=1, out=found[1, rows])
        if sums is not None:
            torch.sum(chunk, dim=1, out=sums[rows])
    counts += found.long()
    return sums


def subtract_excluded(
    scores: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    counts: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    columns: torch.Tensor,
    position: int,
    start: int,
    in_block: torch.Tensor | None = None,
) -> None:
    """Take the excluded pairs of one block out of its counts (instead of masking the block).

    The scores of all ``P`` excluded pairs of the batch are gathered from the block (pairs of other
    blocks read a clamped column and are weighted 0), compared with the same bounds as
    :func:`count_block` and subtracted, so that the counts equal those of a block whose excluded
    entries were removed. ``P`` is the same for every batch of an evaluation (padding pairs have
    position ``-1``): the shapes do not depend on the block.

    :param scores: shape: ``[B, k]``, the block
    :param lower: shape: ``[B]``
    :param upper: shape: ``[B]``
    :param counts: shape: ``[2, B]``, long, ``above`` and ``below``, updated in place
    :param rows: shape: ``[P]``, the row of each excluded pair in the batch
    :param positions: shape: ``[P]``, the local shard position of each pair's entity (``-1``: none)
    :param columns: shape: ``[P]``, the column of each pair's entity in its shard's candidates
    :param position: the block's shard position
    :param start: the block's first column
    :param in_block: shape: ``[B]``, long: where to add the number of each row's excluded pairs in this
        block, or None
    """
    width = scores.shape[1]
    inside = (positions == position) & (columns >= start) & (columns < start + width)
    values = scores[rows, (columns - start).clamp(0, max(width - 1, 0))]
    flags = [(values > upper[rows]) & inside, (values < lower[rows]) & inside]
    if in_block is not None:
        flags.append(inside)
    # one index_add_ over rows of [B, 2 or 3] (along the long axis of [2, B] it is about 4x slower)
    dropped = torch.zeros((scores.shape[0], len(flags)), dtype=counts.dtype, device=counts.device)
    dropped.index_add_(0, rows, torch.stack(flags, dim=1).to(counts.dtype))
    if in_block is None:
        counts.sub_(dropped.t())
    else:
        counts.sub_(dropped[:, :2].t())
        in_block.add_(dropped[:, 2])


def count_exactly(
    scores: torch.Tensor,
    true_scores: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    excluded: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """Count one block of the queries ranked again, element by element; return the entries inside the band.

    Outside the band ``larger`` and ``not_smaller`` are plain comparisons with the true score;
    ``finite`` and ``nan`` are counted as PyKEEN counts options. Entries inside the band are not
    compared here: the caller compares them by PyKEEN's scores (:func:`pykeen_comparisons`).

    :param scores: shape: ``[n, k]``
    :param true_scores: shape: ``[n]``
    :param lower: shape: ``[n]``, the band's lower ends (``= t`` for exact comparisons)
    :param upper: shape: ``[n]``, the band's upper ends
    :param excluded: shape: ``[n, k]``, bool, the excluded entries (filtered, the true entity)
    :param counts: shape: ``[4, n]``, long: ``larger``, ``not_smaller``, ``finite``, ``nan``; updated in place
    :returns: shape: ``[n, k]``, bool, the finite entries inside a band of positive width
    """
    kept = ~excluded
    true_scores = true_scores.unsqueeze(1)
    band = (scores >= lower.unsqueeze(1)) & (scores <= upper.unsqueeze(1)) & (upper > lower).unsqueeze(1) & kept
    compared = kept & ~band
    counts[0] += torch.sum((scores > true_scores) & compared, dim=1)
    counts[1] += torch.sum((scores >= true_scores) & compared, dim=1)
    counts[2] += torch.sum(torch.isfinite(scores) & kept, dim=1)
    counts[3] += torch.sum(torch.isnan(scores) & kept, dim=1)
    return band


def pykeen_comparisons(
    model: Model,
    target: str,
    triples: torch.Tensor,
    rows: torch.Tensor,
    entities: torch.Tensor,
    max_queries: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compare candidates with the true entity by PyKEEN's own scores: how many are larger / not smaller.

    The scores come from :meth:`pykeen.models.Model.predict_t` / :meth:`~pykeen.models.Model.predict_h`
    of up to ``max_queries`` queries at a time against one shared list of entities (their true
    entities, then the candidates), i.e. PyKEEN's own computation with the broadcast shapes of its
    evaluation (``[b, 1, d]`` queries against ``[1, m, d]`` entities, ``b, m >= 2``), which gives
    a pair the score of PyKEEN's full score row wherever a pair's score does not depend on the
    other entities scored with it (e.g. element-wise interactions; checked for DistMult on the CPU
    and on an H100).

    :param model: the model
    :param target: ``"head"`` or ``"tail"``
    :param triples: shape: ``[n, 3]``, the queries' triples
    :param rows: shape: ``[m]``, sorted, the query (row of ``triples``) of each candidate
    :param entities: shape: ``[m]``, the candidates' global ids
    :param max_queries: the number of queries per call of PyKEEN's scoring
    :returns: ``larger`` and ``not_smaller``, each of shape ``[n]`` (long)
    """
    larger = torch.zeros(triples.shape[0], dtype=torch.long, device=triples.device)
    not_smaller = torch.zeros_like(larger)
    column = 2 if target == LABEL_TAIL else 0
    starts = torch.arange(0, triples.shape[0] + max_queries, max_queries, device=rows.device)
    boundaries = torch.searchsorted(rows, starts).tolist()  # ranking again: sizes are read on the host
    for number, (first, last) in enumerate(zip(boundaries[:-1], boundaries[1:])):
        if first == last:
            continue
        begin = number * max_queries
        chunk = triples[begin : begin + max_queries]
        size = chunk.shape[0]
        # at least two queries and two entities: PyKEEN orders the broadcast products as in its evaluation
        queries = chunk if size > 1 else chunk.repeat(2, 1)
        ids = torch.cat([queries[:, column], entities[first:last]])
        if target == LABEL_TAIL:
            scores = model.predict_t(queries[:, :2], tails=ids)
        else:
            scores = model.predict_h(queries[:, 1:], heads=ids)
        local = rows[first:last] - begin
        true = scores[local, local]
        candidate = scores[local, torch.arange(last - first, device=local.device) + queries.shape[0]]
        larger.index_add_(0, local + begin, (candidate > true).long())
        not_smaller.index_add_(0, local + begin, (candidate >= true).long())
    return larger, not_smaller


#: the most elements of PyKEEN's scoring intermediates (``[b, m, d]``) per call of its ``predict_t`` / ``predict_h``
#: by :func:`pykeen_pair_scores` and the evaluator's full rows (128 MiB of float32)
PYKEEN_CALL_ELEMENTS = 2**25


def row_width(model: Model) -> int:
    """Return the numbers per entity row of a model's entity representations (``d`` of PyKEEN's ``[b, m, d]``)."""
    width = 0
    for representation in getattr(model, "entity_representations", ()):
        width += int(math.prod(getattr(representation, "shape", (1,)) or (1,)))
    return max(width, 1)


def pykeen_slice_size(num: int, size: int) -> int:
    """Return a slice size (at most ``size`` and at least 2, else the next larger) leaving no one of ``num`` alone.

    PyKEEN orders an interaction's broadcast products by the operands' shapes: a slice of one entity would
    be multiplied in another order than the others (other roundings).
    """
    size = max(2, min(size, num))
    for candidate in [*range(size, 1, -1), *range(size + 1, num + 1)]:  # (the smallest above, if none below)
        if num % candidate != 1 or num <= candidate:
            return candidate
    return num


def pykeen_pair_scores(
    model: Model, target: str, triples: torch.Tensor, rows: torch.Tensor, entities: torch.Tensor
) -> torch.Tensor:
    """Return PyKEEN's own scores of ``(query, entity)`` pairs, as its evaluation computes them.

    Queries are scored in chunks against the entities of their own pairs (PyKEEN's broadcast shapes
    ``[b, 1, d] x [1, m, d]``, ``b, m >= 2``, as :func:`pykeen_comparisons`), a chunk's queries and
    entities, sliced where needed, within :data:`PYKEEN_CALL_ELEMENTS` of PyKEEN's intermediates.

    :param model: the model
    :param target: ``"head"`` or ``"tail"``
    :param triples: shape: ``[n, 3]``, the queries as triples (the target column is ignored)
    :param rows: shape: ``[m]``, sorted, the query (row of ``triples``) of each pair
    :param entities: shape: ``[m]``, the pairs' entities (global ids)
    :returns: shape: ``[m]``, the scores (with the model's sigmoid, as ``predict_t`` / ``predict_h``)
    """
    result = torch.empty(rows.shape[0], dtype=torch.get_default_dtype(), device=rows.device)
    per_query = torch.bincount(rows, minlength=triples.shape[0]).tolist()  # (sizes are read on the host)
    width, budget = row_width(model), PYKEEN_CALL_ELEMENTS
    first = begin = 0
    while begin < len(per_query):
        end, count = begin + 1, per_query[begin]
        while end < len(per_query) and max(end + 1 - begin, 2) * (count + per_query[end]) * width <= budget:
            count += per_query[end]
            end += 1
        if count:
            chunk = triples[begin:end]
            queries = chunk if chunk.shape[0] > 1 else chunk.repeat(2, 1)
            ids = entities[first : first + count]
            ids = ids if count > 1 else ids.repeat(2)
            size = pykeen_slice_size(ids.shape[0], budget // (queries.shape[0] * width))
            slice_size = size if size < ids.shape[0] else None
            if target == LABEL_TAIL:
                scores = model.predict_t(queries[:, :2], tails=ids, slice_size=slice_size)
            else:
                scores = model.predict_h(queries[:, 1:], heads=ids, slice_size=slice_size)
            local = rows[first : first + count] - begin
            values = scores[local, torch.arange(count, device=local.device)]
            if result.dtype != values.dtype:
                result = result.to(values.dtype)
            result[first : first + count] = values
        first, begin = first + count, end
    return result


def ranks_from_counts(
    larger: torch.Tensor,
    not_smaller: torch.Tensor,
    finite: torch.Tensor,
    true_scores: torch.Tensor,
    is_candidate: torch.Tensor,
) -> torch.Tensor:
    """PyKEEN's ranks from the counts summed over all shards and the true entity's own contribution.

    * optimistic rank ``= larger + 1``,
    * pessimistic rank ``= not_smaller + 1`` (the true score is not smaller than itself),
    * realistic rank ``= (optimistic + pessimistic) / 2`` (float32, computed by the caller),
    * number of options ``= finite + 1`` (``+ 0`` if the true score is not finite).

    A query whose *true* score is NaN gets the worst rank (``finite + 1`` for all rank types, the
    true entity counted as an option) instead of PyKEEN's rank 1.

    :param larger: shape: ``[B]``, candidates scoring higher than the true entity (the true entity excluded)
    :param not_smaller: shape: ``[B]``, candidates scoring at least as high
    :param finite: shape: ``[B]``, candidates with a finite score
    :param true_scores: shape: ``[B]``
    :param is_candidate: shape: ``[B]``, whether the true entity is a candidate (``restrict_entities_to``)
    :returns: shape: ``[3, B]``, long: the optimistic and pessimistic ranks and the number of options
    """
    is_candidate = is_candidate.long()
    true_nan = torch.isnan(true_scores)
    not_smaller = not_smaller + is_candidate * (~true_nan).long()
    options = finite + is_candidate * torch.isfinite(true_scores).long()
    # a NaN true score ranks last, with the true entity counted as an option
    worst = finite + 1
    optimistic = torch.where(true_nan, worst, larger + 1)
    pessimistic = torch.where(true_nan, worst, not_smaller)
    options = torch.where(true_nan, finite + is_candidate, options)
    return torch.stack([optimistic, pessimistic, options])


def unique_pairs(
    query_index: torch.Tensor, entities: torch.Tensor, num_entities: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop duplicate ``(query, entity)`` pairs; shapes ``[m] -> [m']``, sorted by query (top-k prediction)."""
    keys = torch.unique(query_index.cpu() * num_entities + entities.cpu())
    return keys // num_entities, keys % num_entities
