"""Rank counting: per-query counts of one block of scores, and PyKEEN's ranks from the summed counts.

For a batch of queries every shard counts, over its candidates that are neither filtered nor the
true entity, ``larger`` (scores strictly higher than the true entity's), ``not_smaller`` (at least as
high), ``finite`` (PyKEEN's number of options) and ``nan``; only these counts cross processes.
:func:`ranks_from_counts` adds the true entity's own contribution, exactly as PyKEEN's
:meth:`pykeen.evaluation.ranks.Ranks.from_scores` sees it after
:func:`pykeen.evaluation.evaluator.filter_scores_` restored its column.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, cast

import torch
from pykeen.typing import LABEL_TAIL, RANK_OPTIMISTIC, RANK_PESSIMISTIC, RANK_REALISTIC

if TYPE_CHECKING:
    from ..distributed import Topology
    from ..threads import ThreadPolicy
    from .filtering import FilterIndex, FilterSide
    from .sharded import ShardedScoring

__all__ = [
    "COUNT_CHUNK_ELEMENTS",
    "rank_batch",
    "RankCounts",
    "count_block",
    "ranks_from_counts",
    "subtraction_keeps_order",
    "unique_pairs",
]

#: the number of scores compared at once when counting (a cache-sized chunk of a block's rows)
COUNT_CHUNK_ELEMENTS = 2**19


@dataclasses.dataclass(eq=False)
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
    scores: torch.Tensor, true_scores: torch.Tensor, num_masked: torch.Tensor, counts: RankCounts, exact: bool
) -> None:
    """Add one block's counts; masked entries (filtered candidates, the true entity) are NaN already.

    The block is counted in chunks of :data:`COUNT_CHUNK_ELEMENTS` scores (rows of the block), which
    stay in the CPU's cache between the passes over them and need no block-sized temporaries.

    Without ``exact`` (the caller guarantees that every unmasked score and every true score is
    finite, and that :func:`subtraction_keeps_order` holds) one subtraction ranks every candidate:
    ``v = sign(score - true)`` is ``+1`` for a larger score, ``0`` for a tie, ``-1`` for a smaller
    one and NaN for a masked entry, so that with ``nansum`` over a row

    * ``larger = (sum(v) + sum(|v|)) / 2``,
    * ``smaller = (sum(|v|) - sum(v)) / 2`` and ``not_smaller = unmasked - smaller``,
    * ``finite = unmasked = width - num_masked``;

    sums of ``+-1`` are exact (float32 below ``2^24`` columns, float64 beyond), so the counts equal
    those of the comparisons, at about a quarter of their cost. With ``exact`` every score is
    compared (``>``, ``>=``) and finite and NaN scores are counted element by element.

    :param scores: shape: ``[B, k]``, masked entries NaN
    :param true_scores: shape: ``[B]``
    :param num_masked: shape: ``[B]``, the masked entries per query
    :param counts: the accumulators, updated in place
    :param exact: compare element by element (for blocks with non-finite scores)
    """
    batch_size, width = scores.shape
    true_scores = true_scores.unsqueeze(1)
    larger = torch.empty(batch_size, dtype=torch.long, device=scores.device)
    not_smaller = torch.empty_like(larger)
    chunk_rows = max(1, COUNT_CHUNK_ELEMENTS // max(width, 1))
    if exact:
        for start in range(0, batch_size, chunk_rows):
            rows = slice(start, start + chunk_rows)
            chunk, true_chunk = scores[rows], true_scores[rows]
            larger[rows] = torch.sum(chunk > true_chunk, dim=1)
            not_smaller[rows] = torch.sum(chunk >= true_chunk, dim=1)
        counts.larger += larger
        counts.not_smaller += not_smaller
        counts.finite += torch.isfinite(scores).sum(dim=1)
        counts.nan += torch.isnan(scores).sum(dim=1) - num_masked
        return
    unmasked = width - num_masked
    total_dtype = torch.float64 if scores.dtype == torch.float64 or width >= 2**24 else torch.float32
    buffer = torch.empty((min(chunk_rows, batch_size), width), dtype=scores.dtype, device=scores.device)
    for start in range(0, batch_size, chunk_rows):
        rows = slice(start, start + chunk_rows)
        chunk, true_chunk = scores[rows], true_scores[rows]
        signs = buffer[: chunk.shape[0]]
        torch.sub(chunk, true_chunk, out=signs)
        signs.sign_()
        balance = torch.nansum(signs, dim=1, dtype=total_dtype)  # larger - smaller
        signs.abs_()
        unequal = torch.nansum(signs, dim=1, dtype=total_dtype)  # larger + smaller
        larger[rows] = ((balance + unequal) * 0.5).long()
        not_smaller[rows] = unmasked[rows] - ((unequal - balance) * 0.5).long()
    counts.larger += larger
    counts.not_smaller += not_smaller
    counts.finite += unmasked


def subtraction_keeps_order(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``sign(a - b)`` equals the comparison of finite ``a`` and ``b`` on this device.

    True with IEEE subnormal arithmetic; False when subnormal results are flushed to zero (e.g.
    after ``torch.set_flush_denormal(True)``), where two distinct tiny scores would look tied.
    """
    smallest_normal = torch.finfo(dtype).tiny
    a = torch.tensor([1.5 * smallest_normal], dtype=dtype, device=device)
    b = torch.tensor([smallest_normal], dtype=dtype, device=device)
    return bool(((a - b) > 0).all()) and bool(((b - a) < 0).all())


def ranks_from_counts(
    counts: RankCounts, true_scores: torch.Tensor, is_candidate: torch.Tensor
) -> dict[str, torch.Tensor]:
    """PyKEEN's ranks from the counts summed over all shards and the true entity's own contribution.

    * optimistic rank ``= larger + 1``,
    * pessimistic rank ``= not_smaller + 1`` (the true score is not smaller than itself),
    * realistic rank ``= (optimistic + pessimistic) / 2``,
    * number of options ``= finite + 1`` (``+ 0`` if the true score is not finite).

    A query whose *true* score is NaN gets the worst rank (``finite + 1`` for all rank types, the
    true entity counted as an option) instead of PyKEEN's rank 1.

    :param counts: the counts of the batch, summed over shards
    :param true_scores: shape: ``[B]``
    :param is_candidate: shape: ``[B]``, whether the true entity is a candidate (``restrict_entities_to``)
    :returns: the three rank types and ``"options"``, each of shape ``[B]``
    """
    is_candidate = is_candidate.long()
    true_nan = torch.isnan(true_scores)
    larger = counts.larger
    not_smaller = counts.not_smaller + is_candidate * (~true_nan).long()
    options = counts.finite + is_candidate * torch.isfinite(true_scores).long()
    # a NaN true score ranks last, with the true entity counted as an option
    worst = counts.finite + 1
    optimistic = torch.where(true_nan, worst, larger + 1)
    pessimistic = torch.where(true_nan, worst, not_smaller)
    options = torch.where(true_nan, counts.finite + is_candidate, options)
    return {
        RANK_OPTIMISTIC: optimistic,
        RANK_REALISTIC: (optimistic + pessimistic).float() * 0.5,
        RANK_PESSIMISTIC: pessimistic,
        "options": options,
    }


def unique_pairs(
    query_index: torch.Tensor, entities: torch.Tensor, num_entities: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop duplicate ``(query, entity)`` pairs; shapes ``[m] -> [m']``, sorted by query."""
    keys = torch.unique(query_index.cpu() * num_entities + entities.cpu())
    return keys // num_entities, keys % num_entities


def rank_batch(
    scoring: ShardedScoring,
    index: FilterIndex | None,
    batch: torch.Tensor,
    target: str,
    slice_size: int,
    topology: Topology | None = None,
    max_blocks: int | None = None,
    threads: ThreadPolicy | None = None,
) -> dict[str, Any]:
    """Rank the true entities of one batch for one target (the counts of every shard, summed over the processes).

    :param scoring: the sharded scoring
    :param index: the filter index (None: unfiltered)
    :param batch: shape: ``[B, 3]``
    :param target: ``"head"`` or ``"tail"``
    :param slice_size: candidates per block
    :param topology: the topology (probes pass a :class:`~pykeen_bess.distributed.ProbeTopology`)
    :param max_blocks: score only this many blocks (probes)
    :param threads: the thread policy; each block (scoring and counting) is one of its units
    :returns: numpy arrays of shape ``[B]`` for the three rank types and ``"options"``, and the
        NaN counts ``"nan_candidates"`` and ``"nan_true"``
    """
    topology = scoring.topology if topology is None else topology
    heads, relations, tails = batch.unbind(dim=1)
    known, true = (heads, tails) if target == LABEL_TAIL else (tails, heads)
    queries = scoring.queries(target, known, relations, topology=topology)
    true_scores = scoring.true_scores(queries, true, topology=topology)
    # pairs excluded from the shards' counts: the true entity and the known answers
    query_index, entities = torch.arange(batch.shape[0], device=batch.device), true
    if index is not None:
        filtered_query, filtered_entity = index.filtered(cast("FilterSide", target), known, relations)
        query_index = torch.cat([query_index, filtered_query.to(batch.device)])
        entities = torch.cat([entities, filtered_entity.to(batch.device)])
    query_index, entities = unique_pairs(query_index, entities, scoring.sharding.num_entities)

    def count(exact: bool) -> tuple[RankCounts, torch.Tensor]:
        counts = RankCounts.zeros(batch.shape[0], device=true_scores.device)
        # the sign counting needs finite true scores (an infinite one minus an infinite score is NaN)
        nonfinite = ~torch.isfinite(true_scores).all()
        blocks = scoring.score_blocks(queries, query_index, entities, slice_size, max_blocks)
        num_blocks = sum(-(-count // slice_size) for count in scoring.candidate_counts)  # the slices of all shards
        for _ in range(num_blocks if max_blocks is None else min(num_blocks, max_blocks)):
            with contextlib.nullcontext() if threads is None else threads.unit():  # scoring and counting
                block = next(blocks)
                count_block(block.scores, true_scores, block.num_masked, counts, exact=exact)
                nonfinite |= block.nonfinite
                del block  # release the block before the next one is allocated
        return counts, nonfinite

    if subtraction_keeps_order(true_scores.device, true_scores.dtype):
        counts, nonfinite = count(exact=False)
        if bool(nonfinite):  # one read per batch; blocks with NaN or infinite scores need exact counts
            counts, _ = count(exact=True)
    else:  # subnormal differences flushed to zero: compare element by element
        counts, _ = count(exact=True)
    counts = RankCounts.from_stacked(topology.shard_all_reduce(counts.stack()))
    ranks = ranks_from_counts(counts, true_scores, scoring.is_candidate(true.to(true_scores.device)))
    result: dict[str, Any] = {key: value.cpu().numpy() for key, value in ranks.items()}
    result["nan_candidates"] = int(counts.nan.sum())
    result["nan_true"] = int(torch.isnan(true_scores).sum())
    return result
