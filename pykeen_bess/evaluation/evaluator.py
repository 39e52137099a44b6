"""The evaluator: PyKEEN's exact rank metrics from per-shard counts.

:class:`BessEvaluator` is a :class:`pykeen.evaluation.RankBasedEvaluator` whose ranks are never
computed from a ``[batch, num_entities]`` score matrix. The entities are split into shards (the
model's own :class:`~pykeen_bess.data.sharding.EntitySharding` when its entity representations are
:class:`~pykeen_bess.tables.representation.ShardedEmbedding` tables, else a random one); for each target
(head, tail) the evaluation triples are ranked batch by batch
(:func:`~pykeen_bess.evaluation.ranking.rank_triples`, one
:func:`~pykeen_bess.evaluation.ranking.rank_target` per target): every shard scores a batch of
``B`` queries against its local entities in blocks of at most ``slice_size`` with the fast
shared-candidate scorers (:mod:`pykeen_bess.scoring`) and *counts*, per query, the candidates
scoring above and below a narrow band around the true score
(:mod:`~pykeen_bess.evaluation.counting`), over the candidates that are neither filtered (known
triples, see :mod:`~pykeen_bess.evaluation.filtering`) nor the true entity itself: the excluded
pairs' own counts are subtracted, never masked. The counts of all shards are summed once per evaluation
(:meth:`~pykeen_bess.distributed.Topology.shard_all_reduce`, so under ``torch.distributed`` only
``[4, Q]`` integers per target cross processes), and the true entity's own contribution is added
explicitly, exactly as PyKEEN's :meth:`pykeen.evaluation.ranks.Ranks.from_scores` sees it after
:func:`pykeen.evaluation.evaluator.filter_scores_` restored its column
(:func:`~pykeen_bess.evaluation.counting.ranks_from_counts`):

* optimistic rank ``= larger + 1``,
* pessimistic rank ``= not_smaller + 1`` (the true score is not smaller than itself),
* realistic rank ``= (optimistic + pessimistic) / 2``,
* number of options ``= finite + 1`` (``+ 0`` if the true score is not finite).

Exact ties are therefore handled as PyKEEN handles them (optimistic / pessimistic / realistic),
independently of how entities are sharded or sliced. Near-ties, candidates whose score is within
rounding of the true score, are compared by PyKEEN's own scores (``tie_tolerance``): the matrix
products here sum in another order than PyKEEN's interaction, and a comparison within rounding
could otherwise differ from PyKEEN's (the metrics then differed from PyKEEN's on a GPU). Every
metric is identical to PyKEEN's wherever a pair's score in PyKEEN does not depend on the other
entities scored with it (element-wise interactions such as DistMult; checked on the CPU and an
H100). Near-ties are compared by PyKEEN's scores only when this process holds the whole model
(not for entity tables distributed over processes).

Deviation from PyKEEN, deliberately: a query whose *true* score is NaN gets the worst rank
(``finite + 1`` for all rank types, with the true entity counted as an option) instead of
PyKEEN's rank 1; NaN candidate scores are excluded from the options as in PyKEEN. Both are
reported with one :class:`RuntimeWarning` per evaluation.

Synchronisation: the host reads device values only once per evaluation (or per target): the id
tables are copied to the device once per scoring and device; the filter index is built on the
device and looked up for all queries of a target at once (the number of answers, the widest
batch of excluded pairs); then every batch and block runs on the device without host reads
(``tests/evaluation/test_host_sync.py`` counts the operators); finally the queries to rank again
(near-ties, non-finite scores) are found with one read, counted again in chunks (with a few
reads each), and all ranks are copied to the host in one copy. PyKEEN's metrics are then
computed on the host from the rank arrays, as PyKEEN's own evaluator does.

Memory: per step at most one ``[batch_size, slice_size]`` score block and its comparisons (see
:mod:`~pykeen_bess.evaluation.sizes` and :mod:`~pykeen_bess.evaluation.counting`), the candidate
features of one slice, the filter index (:data:`~pykeen_bess.evaluation.filtering.BYTES_PER_TRIPLE`
per known triple) and, per target, ``[4, Q]`` counts and the table of excluded pairs
(:class:`~pykeen_bess.evaluation.excluded.ExcludedPairs`).
"""

from __future__ import annotations

import numbers

import logging
import time
import warnings
import weakref
from collections import ChainMap
from collections.abc import Collection, Mapping
from typing import Any, cast

import torch
from pykeen.evaluation import RankBasedEvaluator
from pykeen.evaluation.rank_based_evaluator import RankBasedMetricResults
from pykeen.models import ERModel, Model
from pykeen.typing import LABEL_HEAD, LABEL_TAIL, Target
from tqdm.autonotebook import tqdm

from ..names import check_keyword_arguments
from ..runtime.allocator import AllocatorHint, resolve_allocator
from ..distributed import ProbeTopology, ProcessGroupHint, join_torchrun_group
from ..runtime.threads import ThreadPolicy, ThreadsHint, resolve_threads
from .checks import check_filter_triples, check_ids, check_model, check_restricted, check_targets, check_triples
from .sharded import holds_whole_model
from .counting import TIE_TOLERANCE
from .coefficients import CoefficientCache
from .excluded import ExcludedPairsCache
from .filtering import FilterIndex, FilterIndexCache
from .ranking import probe_step, rank_triples, ranks_by_pykeen_rows
from .candidates import ScoringLayouts
from .sharded import ShardedScoring
from .sizes import choose_block_sizes

__all__ = [
    "BessEvaluator",
]

logger = logging.getLogger(__name__)


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
        process_group: ProcessGroupHint = None,
        num_threads: ThreadsHint = "auto",
        host_allocator: AllocatorHint = None,
        tie_tolerance: float = TIE_TOLERANCE,
        **kwargs: Any,
    ):
        """Create the evaluator.

        :param num_shards: the number of entity shards; None: the model's (its ``ShardedEmbedding`` tables', else
            the one a :class:`~pykeen_bess.training.BessTrainingLoop` trained it with in one process), else 1
        :param batch_size: evaluation triples per batch (both targets are ranked per batch); None:
            chosen by the memory search (the ``batch_size`` of :meth:`evaluate` takes precedence)
        :param slice_size: candidates scored at once per shard; None: chosen by the memory search
        :param filtered: whether to exclude the known triples (the evaluation triples and
            ``additional_filter_triples``) from the candidates
        :param memory_budget: the largest peak of a probe step in bytes (CPU: resident memory's growth; default half
            the available memory, an eighth of it needs no probe; out-of-memory errors on a GPU)
        :param process_group: the process group of a model sharded over processes (default: the
            default group); unused in one process
        :param num_threads: intra-op CPU threads of the score blocks (:mod:`pykeen_bess.runtime.threads`):
            ``"auto"`` (default: measure 1 thread against all of the process's; torch's setting is restored
            afterwards), None or ``"keep"`` (torch's setting, left alone), or an integer
        :param host_allocator: how glibc's allocator serves the score blocks (:mod:`pykeen_bess.runtime.allocator`):
            None or ``"keep"`` (default: leave it alone) or ``"auto"`` (on the CPU: freed blocks stay in the heap
            for the next, a process-wide setting that stays; what the command line uses)
        :param tie_tolerance: the half width of the band around each true score, in units of
            ``eps * (|t| + ||q|| max ||c||)``, whose candidates are compared by PyKEEN's own scores
            (:mod:`~pykeen_bess.evaluation.counting`); 0: compare the products' scores only (faster,
            but a near-tie may then be ranked otherwise than PyKEEN ranks it)
        :param kwargs: :class:`~pykeen.evaluation.RankBasedEvaluator`'s (``metrics``, ``add_defaults``, ...)
        """
        check_keyword_arguments(type(self), RankBasedEvaluator, kwargs)
        if kwargs.get("mode") is not None:
            raise NotImplementedError("BessEvaluator supports transductive evaluation only (mode=None).")
        _check_flag("filtered", filtered)  # not "no", which would filter
        if process_group is None:
            join_torchrun_group()
        super().__init__(filtered=bool(filtered), batch_size=batch_size, slice_size=slice_size, **kwargs)
        for name, value in (("num_shards", num_shards), ("memory_budget (bytes)", memory_budget)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, but is {value!r}.")
        if isinstance(tie_tolerance, bool) or not isinstance(tie_tolerance, (int, float)) or not tie_tolerance >= 0:
            raise ValueError(f"tie_tolerance must be a non-negative number, but is {tie_tolerance!r}.")
        self.num_shards = num_shards
        self.tie_tolerance = float(tie_tolerance)
        self.memory_budget = memory_budget
        self.process_group = process_group
        self.num_threads = num_threads
        resolve_threads(num_threads, None)  # invalid values fail here
        self.host_allocator = host_allocator
        resolve_allocator(host_allocator, None)  # invalid values fail here
        #: the thread policy of the last evaluation (an adaptive one keeps learning across evaluations)
        self.thread_policy: ThreadPolicy | None = None
        self._thread_device: torch.device | None = None
        #: ``(batch_size, slice_size)`` of the last evaluation (given or found by the memory search)
        self.last_block_sizes: tuple[int, int] | None = None
        #: seconds of the last evaluation's stages: ``setup`` (PyKEEN's argument handling and the sharded
        #: scoring's set-up), ``filter_index`` (building it, or finding it built), ``block_sizes`` (the memory
        #: search, once per model), ``ranking`` (scoring and counting) and ``metrics`` (PyKEEN's)
        self.last_timings: dict[str, float] = {}
        #: per target, the number of queries of the last evaluation that were ranked again (near-ties, NaN)
        self.last_ranked_again: dict[str, int] = {}
        #: the caller's ``additional_filter_triples`` during :meth:`evaluate` (joined into the filter index)
        self._additional_filter_triples: list[torch.Tensor] = []
        #: the filter index of the last evaluation and what it was built from (digests of the known triples,
        #: sizes, device): a later evaluation with the same filter (early stopping's) builds nothing
        self._filter_index = FilterIndexCache()
        self._excluded_pairs = ExcludedPairsCache()
        #: the id layouts of the last evaluation (sharding, candidate columns, device tables), reused by the next
        self._layouts = ScoringLayouts()
        #: the adjusted metrics' coefficients by candidate counts (the same at every evaluation of the same triples)
        self._coefficients = CoefficientCache()
        self._entered: float | None = None  # when :meth:`evaluate` was called
        #: block sizes found by the memory search, reused by later evaluations of the same model (the
        #: entries die with the model: a new model can never find an old model's sizes)
        self._block_sizes: weakref.WeakKeyDictionary[Model, dict[tuple, tuple[int, int]]] = weakref.WeakKeyDictionary()

    def evaluate(
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
        self._entered = time.perf_counter()
        targets = check_targets(targets)
        model = check_model(model)
        num_relations = model.num_real_relations
        mapped_triples = check_triples(mapped_triples, model.num_entities, num_relations, "mapped_triples")
        given = additional_filter_triples is not None
        if additional_filter_triples is not None:
            # PyKEEN would deduplicate all known triples with ``unique(dim=0)`` on the host (seconds for a few
            # hundred thousand rows, a few milliseconds even for the evaluation triples alone); the filter index
            # deduplicates them itself, so PyKEEN gets none (and its warning about none given is dropped)
            self._additional_filter_triples = check_filter_triples(
                additional_filter_triples, model.num_entities, num_relations
            )
            additional_filter_triples = None
        if restrict_entities_to is not None:
            # PyKEEN's checks compare with Python sets: pass plain ints
            restrict_entities_to = check_ids(restrict_entities_to, model.num_entities, "restrict_entities_to").tolist()
        dropped = _DropRecords("The filtered setting was enabled") if given else None
        if dropped is not None:
            logging.getLogger("pykeen.utils").addFilter(dropped)
        try:
            result = super().evaluate(
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
                targets=cast(Collection[Target], targets),
            )
        finally:
            self._additional_filter_triples = []
            if dropped is not None:
                logging.getLogger("pykeen.utils").removeFilter(dropped)
        return cast(RankBasedMetricResults, result)

    def _evaluate_on_device(
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
        check_restricted(mapped_triples)
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
                    else check_ids(restrict_entities_to, model.num_entities, "restrict_entities_to"),
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
        """Rank all evaluation triples target by target, fill ``self.ranks`` / ``self.num_candidates`` and finalize."""
        scoring = ShardedScoring.for_model(
            model,
            num_shards=self.num_shards,
            process_group=self.process_group,
            restrict_entities_to=restrict_entities_to,
            layouts=self._layouts,
        )
        started = time.perf_counter()
        index = None
        if self.filtered:
            assert all_pos_triples is not None
            known = [all_pos_triples, *self._additional_filter_triples]
            index = self._filter_index.get(known, model.num_entities, model.num_real_relations, device)
        num_triples = mapped_triples.shape[0]
        indexed = time.perf_counter()
        batch_size, slice_size = _block_sizes_for(
            self, scoring, model, mapped_triples, index, targets, batch_size, slice_size, device
        )
        logger.info(
            "BESS evaluation: %d triples, %s, batch_size=%d, slice_size=%d",
            num_triples,
            scoring.sharding.describe(),
            batch_size,
            slice_size,
        )
        self.last_block_sizes = (batch_size, slice_size)
        sized = time.perf_counter()
        self.clear()
        tqdm_kwargs = dict(tqdm_kwargs)
        if not scoring.topology.is_main_process:
            tqdm_kwargs["disable"] = True
        progress = tqdm(
            **ChainMap(
                tqdm_kwargs,
                {
                    "desc": f"Evaluating on {device}",
                    "total": num_triples * len(targets),
                    "unit": "query",
                    "unit_scale": True,
                },
            )
        )
        topology = scoring.topology
        if self.thread_policy is None or self._thread_device != device:
            self.thread_policy, self._thread_device = resolve_threads(self.num_threads, device), device
        resolve_allocator(self.host_allocator, device).apply()
        # near-ties are compared by PyKEEN's own scores, which need the whole model in this process
        resolve_ties = self.tie_tolerance > 0 and topology.holds_all_shards and holds_whole_model(model)
        tolerance = self.tie_tolerance if resolve_ties else 0.0
        with progress, self.thread_policy.applied():
            ranked = rank_triples(
                scoring,
                mapped_triples,
                targets,
                batch_size,
                slice_size,
                index,
                tolerance=tolerance,
                resolve_ties=resolve_ties,
                threads=self.thread_policy,
                on_batch=progress.update,
                pairs_cache=self._excluded_pairs,
            )
        self.last_ranked_again = ranked.ranked_again
        ranked.gather_replicas(topology)
        nan_candidates, nan_true = ranked.append_to(self.ranks, self.num_candidates)
        self.num_entities = scoring.num_candidates
        if nan_candidates or nan_true:
            warnings.warn(
                f"The model produced NaN scores: {nan_candidates} candidate scores (excluded from the rankings, as "
                f"PyKEEN does) and {nan_true} true triples' scores (those queries get the worst rank).",
                RuntimeWarning,
                stacklevel=4,
            )
        ranked_at = time.perf_counter()
        result = self.finalize()
        finished = time.perf_counter()
        self.last_timings = {
            "setup": 0.0 if self._entered is None else started - self._entered,
            "filter_index": indexed - started,
            "block_sizes": sized - indexed,
            "ranking": ranked_at - sized,
            "metrics": finished - ranked_at,
        }
        logger.info("BESS evaluation timings (seconds): %s", self.last_timings)
        return result

    def finalize(self) -> RankBasedMetricResults:
        """Return PyKEEN's metrics of the ranks, their shared work done once (:mod:`.coefficients`)."""
        with self._coefficients.applied(self):
            return super().finalize()


class _DropRecords(logging.Filter):
    """Drop the log records whose message starts with a prefix."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def _block_sizes_for(
    evaluator: BessEvaluator,
    scoring: ShardedScoring,
    model: ERModel,
    mapped_triples: torch.Tensor,
    index: FilterIndex | None,
    targets: tuple[str, ...],
    batch_size: int | None,
    slice_size: int | None,
    device: torch.device,
) -> tuple[int, int]:
    """Return the given sizes, or search (once per model layout, cached by the evaluator) for the missing ones."""
    if (batch_size is not None and slice_size is not None) or ranks_by_pykeen_rows(scoring):
        # (ranked by PyKEEN's rows, the sizes only chunk the queries: a broadcast block's probe would be wasted)
        return choose_block_sizes(
            scoring, mapped_triples.shape[0], batch_size, slice_size, _no_probe, device, evaluator.memory_budget
        )
    key = (
        str(device),
        scoring.sharding.n_shard,
        scoring.num_candidates,
        mapped_triples.shape[0],
        batch_size,
        slice_size,
        evaluator.memory_budget,
    )
    cached = evaluator._block_sizes.setdefault(model, {}).get(key)
    if cached is not None:
        return cached
    probe_topology = ProbeTopology(scoring.topology)

    def probe(probe_batch_size: int, probe_slice_size: int) -> None:
        rows = torch.arange(probe_batch_size, device=mapped_triples.device) % mapped_triples.shape[0]
        probe_step(scoring, mapped_triples[rows], targets[0], probe_slice_size, probe_topology)

    sizes = choose_block_sizes(
        scoring, mapped_triples.shape[0], batch_size, slice_size, probe, device, memory_budget=evaluator.memory_budget
    )
    evaluator._block_sizes[model][key] = sizes
    return sizes


def _no_probe(batch_size: int, slice_size: int) -> None:
    """Stand in for a probe that is never run (both sizes given)."""


def _check_flag(name: str, value: Any) -> None:
    """Raise a ``ValueError`` unless ``value`` is True or False (or 1 or 0)."""
    if not isinstance(value, bool | numbers.Integral) or value not in (0, 1):
        raise ValueError(f"{name} must be True or False, not {value!r}.")
