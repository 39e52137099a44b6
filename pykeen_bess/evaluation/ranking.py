"""Ranking all evaluation triples: per target a block loop on the device, then the few queries ranked again.

:func:`rank_target` ranks the ``Q`` true entities of one target (head or tail) in three stages:

1. **Once per evaluation** (:meth:`~pykeen_bess.evaluation.excluded.ExcludedPairs.build`): the
   excluded ``(query, candidate)`` pairs of all queries, the known answers of the filter index
   and each query's true entity, are looked up at once on the device and laid out per batch in a
   ``[num_batches, P]`` table (``P``: the most pairs of a batch, padding pairs point nowhere).
   This is the only stage with data-dependent shapes before the end: it reads a few sizes on the
   host.
2. **Per batch and block** (:func:`rank_batch`, :func:`count_scored_block`): the batch's queries
   and true scores are computed, then every slice of every local shard is scored
   (``[B, q] x [k, c] -> [B, k]``), counted outside the narrow band around the true score
   (:func:`~pykeen_bess.evaluation.counting.count_block`) and corrected for the excluded pairs
   (:func:`~pykeen_bess.evaluation.counting.subtract_excluded`): all ``P`` pairs of the batch, or,
   where the block loop reads sizes anyway (collecting the band, below), only the block's own, one
   range of the batch's pairs in their block order. The counts stay on the device in
   ``[4, Q]`` tensors; the host issues the same operators for every block of the batch and never
   waits for the device.
3. **Once per evaluation**: the counts are summed over the shards (one collective), and the
   queries to count again are found with one host read each: those with candidates inside the
   band (near-ties, whose comparison may depend on the rounding of the product, see
   :mod:`~pykeen_bess.evaluation.counting`) and those with non-finite scores. On the CPU, and
   elsewhere with blocks of at least ``COLLECT_BAND_MIN_BLOCK`` scores, the block loop has
   collected the near-ties' candidates inside the band already (a few host reads per block: nothing
   on the CPU, little against a large block's device work), and they are compared by PyKEEN's scores
   without scoring any query again (:mod:`~pykeen_bess.evaluation.near_ties`). Otherwise they are
   scored again, in chunks of at most ``B``: near-tie queries as in the first pass (excluded pairs
   masked as NaN) while collecting the candidates inside the band, which are then compared by
   PyKEEN's own scores (:func:`~pykeen_bess.evaluation.counting.pykeen_comparisons`); queries with
   non-finite scores by PyKEEN's full score rows (whole model here), else element by element against
   a dense mask. This stage reads sizes on the host a few times per chunk.

A model without a fast scorer is ranked by PyKEEN's own score rows instead, where this process holds it
whole (:func:`~pykeen_bess.evaluation.near_ties.rank_by_pykeen_rows`). The ranks and NaN counts
(:class:`TargetRanks`, ``[5, Q]``) are returned on the device. :func:`rank_triples` ranks every target
(replicas split the batches) and copies the ranks of all targets to the host in one copy
(:class:`HostRanks`); there every process gets every replica's ranks, laid out as PyKEEN's
:class:`~pykeen.evaluation.RankBasedEvaluator` collects them.

Memory: the excluded-pair table (``3 * 8 * num_batches * P`` bytes), ``[4, Q]`` counts and ``[Q]``
true scores per target, one ``[B, k']`` score buffer for every block (:class:`BlockBuffer`) and the
block's comparisons; counting again scores at most ``B`` flagged queries with boolean ``[B, k]`` band
(and mask) tensors, and PyKEEN's scores stay within
:data:`~pykeen_bess.evaluation.counting.PYKEEN_CALL_ELEMENTS` of its intermediates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence

import numpy as np
import torch
from pykeen.typing import LABEL_TAIL

from ..distributed import Topology
from ..runtime.threads import ThreadPolicy
from ..scoring.base import SCORE_ROW_ALIGNMENT
from .counting import (
    band_bounds,
    band_scale,
    count_block,
    finite_by_norms,
    ranks_from_counts,
    subtract_excluded,
)
from .excluded import ExcludedPairs, ExcludedPairsCache, PairsByBlock
from .ranks import HostRanks, TargetRanks
from .near_ties import band_candidates, count_by_pykeen_rows, rank_again, rank_by_pykeen_rows, resolve_collected
from .filtering import FilterIndex
from .sharded import Queries, ShardedScoring, feature_norms, holds_whole_model

__all__ = [
    "BlockBuffer",
    "ExcludedPairs",
    "HostRanks",
    "TargetRanks",
    "count_scored_block",
    "probe_step",
    "rank_batch",
    "rank_target",
    "rank_triples",
    "ranks_by_pykeen_rows",
]


#: whether the CPU's block loop collects the near-ties' band candidates (tests turn it off to compare)
COLLECT_BAND_ON_CPU = True
#: on other devices the block loop collects them from blocks of at least this many scores: the host read
#: after such a block waits for milliseconds of device work, less than scoring a third of the queries again
#: (with a few thousand queries against 40,000 candidates that many have a candidate inside the band)
COLLECT_BAND_MIN_BLOCK = 2**24


class BlockBuffer:
    """The score blocks' memory of one target's ranking: one ``[B, k']`` tensor, written by every block.

    ``k'`` is the slice size rounded up to :data:`~pykeen_bess.scoring.base.SCORE_ROW_ALIGNMENT` (rows
    of an aligned stride; a shorter last slice writes a narrower view). Allocated on first use, in
    the dtype and on the device of the scores; a block is a view of it, so it is dead once the next
    block is scored (the block loop holds one block at a time). Reusing it spares the allocation per
    block and, on the CPU, the kernel clearing a fresh block's pages before the product writes them.
    """

    def __init__(self, batch_size: int, slice_size: int):
        """Hold blocks of up to ``batch_size`` queries against ``slice_size`` candidates."""
        self.shape = (batch_size, -(-slice_size // SCORE_ROW_ALIGNMENT) * SCORE_ROW_ALIGNMENT)
        self._tensor: torch.Tensor | None = None

    def of(self, like: torch.Tensor) -> torch.Tensor:
        """Return the buffer in the dtype and on the device of ``like`` (allocated on first use)."""
        tensor = self._tensor
        if tensor is None or tensor.dtype != like.dtype or tensor.device != like.device:
            tensor = self._tensor = torch.empty(self.shape, dtype=like.dtype, device=like.device)
        return tensor


def count_scored_block(
    scoring: ShardedScoring,
    queries: Queries,
    true_scores: torch.Tensor,
    band: tuple[torch.Tensor, torch.Tensor],
    candidates: torch.Tensor,
    position: int,
    start: int,
    pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    counts: torch.Tensor,
    band_pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ids: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    query_norms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Score one block and add its counts: the steady state of an evaluation, without host synchronisation.

    :param scoring: the scoring
    :param queries: ``B`` queries
    :param true_scores: shape: ``[B]``
    :param band: the batch's :func:`~pykeen_bess.evaluation.counting.band_scale`, two tensors of shape ``[B]``
    :param candidates: shape: ``[k, c]``, the slice's candidate features
    :param position: the slice's shard position
    :param start: the slice's first column
    :param pairs: the batch's excluded pairs: rows, positions, columns, each of shape ``[P]``
    :param counts: shape: ``[2, B]``, long: ``above`` and ``below``, updated in place
    :param band_pairs: where a host that reads for free (the CPU) collects the block's candidates inside
        the band that are not excluded, as ``(rows [m], candidate ids [m])`` (None: not collected; the
        near-ties are found after the loop and their queries scored again)
    :param ids: shape: ``[c]``, the slice's candidate ids (with ``band_pairs``)
    :param out: the evaluation's score buffer (:class:`BlockBuffer`), which the block may be written into
    :param query_norms: shape: ``[B]``, the norms of the query features: for a scorer whose scores are bounded
        by them (:attr:`~pykeen_bess.scoring.SharedCandidateScorer.bounded_by_feature_norms`) the rows
        that may hold a non-finite score are found from the norms (:func:`finite_by_norms`) instead of
        summing every row of the block
    :returns: shape: ``[B]``, bool: whether a row held (or, by its norms, may hold) a non-finite score
    """
    candidate_norm = feature_norms(candidates).amax()
    lower, upper = band_bounds(true_scores, *band, candidate_norm)
    scores = scoring.scores(queries, candidates, out=out)
    collect = band_pairs is not None and ids is not None
    before = counts.clone() if collect else None
    excluded = torch.zeros_like(counts[0]) if collect else None
    bounded = query_norms is not None and scoring.scorer.bounded_by_feature_norms
    sums = count_block(scores, lower, upper, counts, row_sums=not bounded)
    subtract_excluded(scores, lower, upper, counts, *pairs, position=position, start=start, in_block=excluded)
    if band_pairs is not None and before is not None and excluded is not None and ids is not None:
        # the entries neither above nor below that are not excluded: the band's candidates (and NaN scores)
        others = scores.shape[1] - (counts - before).sum(dim=0) - excluded
        band_pairs.append(band_candidates(scores, lower, upper, others, pairs, position, start, ids))
    if sums is None:
        assert query_norms is not None
        return ~finite_by_norms(query_norms, candidate_norm)
    return ~torch.isfinite(sums)


def rank_batch(
    scoring: ShardedScoring,
    target: str,
    known: torch.Tensor,
    relations: torch.Tensor,
    true: torch.Tensor,
    pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slice_size: int,
    tolerance: float,
    topology: Topology | None = None,
    threads: ThreadPolicy | None = None,
    max_blocks: int | None = None,
    band_pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    buffer: BlockBuffer | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Count one batch of ``B`` queries against every local candidate, on the device.

    :param scoring: the scoring
    :param target: ``"head"`` or ``"tail"``
    :param known: shape: ``[B]``, the known entities
    :param relations: shape: ``[B]``, the relations
    :param true: shape: ``[B]``, the true entities
    :param pairs: the batch's excluded pairs (a row of :class:`ExcludedPairs`' table, in its block order), each of
        shape ``[P]``
    :param slice_size: candidates per block
    :param tolerance: the band's half width
    :param topology: the topology (probes pass a :class:`~pykeen_bess.distributed.ProbeTopology`)
    :param threads: the thread policy; each block (scoring and counting) is one of its units
    :param max_blocks: score only this many blocks (memory probes)
    :param band_pairs: collects the candidates inside the band (see :func:`count_scored_block`), or None
    :param buffer: the evaluation's score buffer, reused by every block (None: a new tensor per block)
    :returns: ``above`` / ``below`` counts ``[2, B]``, whether a row held a non-finite score ``[B]``
        and the true scores ``[B]``
    """
    queries = scoring.queries(target, known, relations, topology=topology)
    true_scores = scoring.true_scores(queries, true, topology=topology)
    query_norms = feature_norms(queries.features)
    band = band_scale(true_scores, query_norms, tolerance)
    counts = torch.zeros((2, known.shape[0]), dtype=torch.long, device=true_scores.device)
    nonfinite = ~torch.isfinite(true_scores)
    out = None if buffer is None else buffer.of(true_scores)
    # where the host reads sizes anyway (collecting the band), each block gets only its own excluded pairs
    by_block = None if band_pairs is None else PairsByBlock(pairs, scoring.candidate_counts, slice_size)
    blocks = 0
    for position in range(len(scoring.local_shards)):
        for start, ids, candidates in scoring.candidate_blocks(queries.side, position, slice_size, known.device):
            if max_blocks is not None and blocks >= max_blocks:
                return counts, nonfinite, true_scores
            block_pairs = pairs if by_block is None else by_block.of_block(position, start)
            with contextlib.nullcontext() if threads is None else threads.unit():
                nonfinite |= count_scored_block(
                    scoring,
                    queries,
                    true_scores,
                    band,
                    candidates,
                    position,
                    start,
                    block_pairs,
                    counts,
                    band_pairs,
                    ids,
                    out,
                    query_norms,
                )
            del candidates
            blocks += 1
    return counts, nonfinite, true_scores


def probe_step(
    scoring: ShardedScoring, triples: torch.Tensor, target: str, slice_size: int, topology: Topology
) -> None:
    """Run the first block of one batch of ``triples`` (``[B, 3]``), as a memory probe."""
    heads, relations, tails = triples.unbind(dim=1)
    known, true = (heads, tails) if target == LABEL_TAIL else (tails, heads)
    rows = torch.zeros(1, dtype=torch.long, device=triples.device)
    pairs = (rows, rows - 1, rows)
    rank_batch(scoring, target, known, relations, true, pairs, slice_size, 0.0, topology=topology, max_blocks=1)


def rank_target(
    scoring: ShardedScoring,
    triples: torch.Tensor,
    target: str,
    batch_size: int,
    slice_size: int,
    index: FilterIndex | None,
    batches: Collection[int],
    tolerance: float,
    resolve_ties: bool,
    threads: ThreadPolicy | None = None,
    on_batch: Callable[[int], object] | None = None,
    collect_band: bool | None = None,
    pairs_cache: ExcludedPairsCache | None = None,
    by_pykeen_rows: bool = False,
) -> TargetRanks:
    """Rank the true entities of all evaluation triples for one target (see the module docstring).

    :param scoring: the scoring
    :param triples: shape: ``[Q, 3]``, the evaluation triples on the compute device
    :param target: ``"head"`` or ``"tail"``
    :param batch_size: queries per batch
    :param slice_size: candidates per block
    :param index: the filter index on the compute device (None: unfiltered)
    :param batches: the numbers of the batches this process ranks (all without replicas)
    :param tolerance: the band's half width (0: exact comparisons, no near-ties to resolve)
    :param resolve_ties: compare near-ties by PyKEEN's scores (needs the whole model in this process)
    :param threads: the thread policy of the blocks
    :param on_batch: called with the number of queries after each batch (progress), or None
    :param collect_band: collect the near-ties' band candidates in the block loop instead of scoring their
        queries again (default: on the CPU, and elsewhere for blocks of at least
        ``COLLECT_BAND_MIN_BLOCK`` scores; only when near-ties are resolved)
    :param pairs_cache: where the excluded pairs of an earlier evaluation are kept (None: built here)
    :param by_pykeen_rows: rank by PyKEEN's own score rows instead of the block loop (whole model here)
    :returns: the ranks
    """
    topology = scoring.topology
    num_queries = triples.shape[0]
    device = triples.device
    heads, relations, tails = triples.unbind(dim=1)
    known, true = (heads, tails) if target == LABEL_TAIL else (tails, heads)
    if pairs_cache is None:
        pairs = ExcludedPairs.build(scoring, index, target, known, relations, true, batch_size)
    else:
        pairs = pairs_cache.get(scoring, index, target, triples, batch_size)
    # above, below, excluded local candidates, rows with non-finite scores
    counts = torch.zeros((4, num_queries), dtype=torch.long, device=device)
    true_scores: torch.Tensor | None = None
    owned = torch.zeros(num_queries, dtype=torch.bool)
    for number in batches:
        owned[number * batch_size : (number + 1) * batch_size] = True
    owned_on_device = owned.to(device)
    if by_pykeen_rows:
        counts, true_scores = rank_by_pykeen_rows(
            scoring, triples, target, pairs, owned_on_device, batch_size, on_batch
        )
        larger, not_smaller, finite, nan = counts.unbind(0)
        ranks = ranks_from_counts(larger, not_smaller, finite, true_scores, scoring.is_candidate(true))
        values = torch.cat([ranks, nan.unsqueeze(0), torch.isnan(true_scores).long().unsqueeze(0)])
        return TargetRanks(values=values * owned_on_device.long(), ranked_again=0)
    # where reading sizes costs little (the CPU, large blocks), the first pass collects the band's candidates
    if collect_band is None:
        collect_band = (
            COLLECT_BAND_ON_CPU
            if device.type == "cpu"
            else min(batch_size, num_queries) * slice_size >= COLLECT_BAND_MIN_BLOCK
        )
    collected: list[tuple[torch.Tensor, torch.Tensor]] | None = (
        [] if collect_band and resolve_ties and tolerance > 0 else None
    )
    buffer = BlockBuffer(batch_size, slice_size)
    for number in sorted(batches):
        rows = slice(number * batch_size, min((number + 1) * batch_size, num_queries))
        batch_pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None if collected is None else []
        batch_counts, nonfinite, batch_true = rank_batch(
            scoring,
            target,
            known[rows],
            relations[rows],
            true[rows],
            (pairs.rows[number], pairs.positions[number], pairs.columns[number]),
            slice_size,
            tolerance,
            threads=threads,
            band_pairs=batch_pairs,
            buffer=buffer,
        )
        if collected is not None and batch_pairs:
            collected.extend((band_row + rows.start, band_ids) for band_row, band_ids in batch_pairs)
        if true_scores is None:
            true_scores = torch.zeros(num_queries, dtype=batch_true.dtype, device=device)
        counts[:2, rows] = batch_counts
        counts[3, rows] = nonfinite.long()
        true_scores[rows] = batch_true
        if on_batch is not None:
            on_batch(rows.stop - rows.start)
    if true_scores is None:  # a replica without a batch (fewer batches than replicas): nothing of its own
        true_scores = torch.zeros(num_queries, device=device)
    counts[2] = pairs.per_query
    counts = topology.shard_all_reduce(counts)  # the counts of all shards: one collective per evaluation
    finite = scoring.num_candidates - counts[2]
    larger, not_smaller = counts[0].clone(), finite - counts[1]
    nonfinite = owned_on_device & (counts[3] > 0)
    near = owned_on_device & ~nonfinite & (finite - counts[0] - counts[1] > 0)  # candidates inside the band
    nan = torch.zeros_like(larger)
    ranked_again = 0
    if collected is not None:  # the near-ties' candidates are known: compare them by PyKEEN's scores
        ranked_again += resolve_collected(
            scoring, triples, target, near, collected, counts, finite, larger, not_smaller
        )
    # the host reads of the ranking: which queries to rank again (near-ties need a band of positive width)
    for flagged, exact in ((nonfinite, True), (near, False)):
        if not exact and (tolerance == 0 or collected is not None):
            continue
        again = flagged.nonzero().view(-1)
        if again.numel() == 0:  # (split would yield one empty chunk, scored against every block)
            continue
        ranked_again += again.shape[0]
        if exact and resolve_ties:  # non-finite scores: PyKEEN's own rows decide (see near_ties)
            counted, true_scores[again] = count_by_pykeen_rows(scoring, triples[again], target, again, pairs)
        else:
            again_tolerance = tolerance if resolve_ties else 0.0
            counted = torch.cat(
                [
                    rank_again(scoring, triples[chunk], target, chunk, pairs, slice_size, again_tolerance, threads,
                               finite=None if exact else finite[chunk])
                    for chunk in again.split(batch_size)
                ],
                dim=1,
            )  # fmt: skip
        larger[again], not_smaller[again], finite[again], nan[again] = counted.unbind(0)
    ranks = ranks_from_counts(larger, not_smaller, finite, true_scores, scoring.is_candidate(true))
    values = torch.cat([ranks, nan.unsqueeze(0), torch.isnan(true_scores).long().unsqueeze(0)])
    return TargetRanks(values=values * owned_on_device.long(), ranked_again=ranked_again)


def ranks_by_pykeen_rows(scoring: ShardedScoring) -> bool:
    """Whether every query is ranked by PyKEEN's own score rows instead of the block loop.

    True for a model without a fast scorer, where this process holds the whole model: PyKEEN's own
    score rows rank faster than the interaction's broadcast blocks (and the block sizes only chunk the
    queries then, with nothing to probe).
    """
    return not scoring.scorer.fast and scoring.topology.holds_all_shards and holds_whole_model(scoring.model)


def rank_triples(
    scoring: ShardedScoring,
    triples: torch.Tensor,
    targets: Sequence[str],
    batch_size: int,
    slice_size: int,
    index: FilterIndex | None,
    tolerance: float,
    resolve_ties: bool,
    threads: ThreadPolicy | None = None,
    on_batch: Callable[[int], object] | None = None,
    pairs_cache: ExcludedPairsCache | None = None,
) -> HostRanks:
    """Rank the true entities of all evaluation triples for every target and copy the ranks to the host.

    Replicas split the batches: replica ``q`` of ``R`` ranks batches ``q, q + R, ...`` (the others'
    are added by :meth:`HostRanks.gather_replicas`). Every target is ranked by :func:`rank_target` (by PyKEEN's
    own score rows for a model without a fast scorer, where this process holds the whole model);
    the ranks of all targets are then copied to the host in one copy (``[targets, 5, Q]``).

    :param scoring: the scoring
    :param triples: shape: ``[Q, 3]``, the evaluation triples on the compute device
    :param targets: the targets to rank, ``"head"`` and / or ``"tail"``
    :param batch_size: queries per batch
    :param slice_size: candidates per block
    :param index: the filter index on the compute device (None: unfiltered)
    :param tolerance: the band's half width (see :func:`rank_target`)
    :param resolve_ties: compare near-ties by PyKEEN's scores (see :func:`rank_target`)
    :param threads: the thread policy of the blocks
    :param on_batch: called with the number of queries after each batch (progress), or None
    :param pairs_cache: where the excluded pairs of an earlier evaluation are kept (None: built here)
    :returns: the ranks of the batches ranked by this process, on the host
    """
    topology = scoring.topology
    # replicas split the batches: replica q ranks batches q, q + R, ...
    num_batches = -(-triples.shape[0] // batch_size)
    batches = [number for number in range(num_batches) if number % topology.replicas == topology.replica]
    by_pykeen_rows = ranks_by_pykeen_rows(scoring)
    per_target = [
        rank_target(
            scoring,
            triples,
            target,
            batch_size,
            slice_size,
            index,
            batches,
            tolerance=tolerance,
            resolve_ties=resolve_ties,
            threads=threads,
            on_batch=on_batch,
            pairs_cache=pairs_cache,
            by_pykeen_rows=by_pykeen_rows,
        )
        for target in targets
    ]
    # the one copy of the results to the host: [targets, 5, Q]
    values = torch.stack([ranks.values for ranks in per_target]).cpu().numpy()
    ranked: dict[int, dict[str, np.ndarray]] = {}
    for number in batches:
        rows = slice(number * batch_size, (number + 1) * batch_size)
        ranked[number] = {target: values[position, :, rows] for position, target in enumerate(targets)}
    ranked_again = {target: ranks.ranked_again for target, ranks in zip(targets, per_target)}
    return HostRanks(batches=ranked, ranked_again=ranked_again)
