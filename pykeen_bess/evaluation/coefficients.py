"""PyKEEN's metrics with their shared work done once: coefficients across evaluations, base values within one.

PyKEEN's adjusted rank-based metrics (the adjusted mean rank, the z-scores, the adjusted index
metrics) are an affine map of a base metric whose coefficients depend only on every query's number
of candidates, not on the ranks: the expected value (and for z-scores the standard deviation) of
the base metric under random ranking. PyKEEN computes them for every side and rank type, nine times
per evaluation where three arrays of candidate counts (head, tail, both) occur, and again at every
evaluation of the same triples (an early stopper's validation set), although the filtered candidate
counts are the same each time. With WN18RR's 6,268 queries that is about 40% of PyKEEN's
``finalize`` (0.05 of 0.13 s on a 2-core CPU).

The base metric itself is computed again by every metric derived from it: the geometric mean rank
by ``geometric_mean_rank``, ``z_geometric_mean_rank`` and ``adjusted_geometric_mean_rank_index``,
the hits at ``k`` by three metrics each, the arithmetic mean rank by four, for each of the nine rank
arrays (scipy's ``gmean`` and ``hmean`` cost a tenth of a millisecond each on a few thousand ranks).

Most of such a call is scipy's argument handling (``_axis_nan_policy``: signatures, broadcasting, NaN
checks), not the reduction: for PyKEEN's plain arguments (one non-empty, finite 1-D array of ranks)
:class:`DirectStats` calls the reductions PyKEEN uses (``gmean``, ``hmean``,
``median_abs_deviation``) without it, which computes the same values (the handling's result for
such an array is the array itself), and scipy's public functions for anything else. Measured on a
2-core CPU: a repeated ``finalize`` of 4,000 queries 5 ms instead of 11.

:class:`CoefficientCache` keeps each metric's coefficients by a digest of the candidate counts and,
while :meth:`CoefficientCache.applied` is active, serves them, and each base metric's value on one
rank array, from what was computed before: the same function on the same input, so every metric is
identical to PyKEEN's. A cache belongs to one evaluator (its metric objects are part of the key).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pykeen.metrics.ranking
import pykeen.metrics.utils
import scipy.stats
from pykeen.metrics.ranking import DerivedRankBasedMetric, RankBasedMetric

__all__ = ["CoefficientCache", "DirectStats", "SharedValues"]

#: the modules of PyKEEN's metrics that call ``scipy.stats`` (as ``stats``)
_METRIC_MODULES = (pykeen.metrics.ranking, pykeen.metrics.utils)


class DirectStats:
    """``scipy.stats`` whose ``gmean``, ``hmean`` and ``median_abs_deviation`` skip scipy's handling for plain arrays.

    A plain array is a non-empty, finite 1-D numpy array of integers or floats (weights, where given, the
    same); every other argument, and every other name, goes to ``scipy.stats`` itself.
    """

    _direct = ("gmean", "hmean", "median_abs_deviation")

    def __getattr__(self, name: str) -> Any:
        public = getattr(scipy.stats, name)
        direct = getattr(public, "__wrapped__", None) if name in self._direct else None
        if direct is None:
            return public

        def reduction(a: Any, *args: Any, **kwargs: Any) -> Any:
            weights = kwargs.get("weights")
            if not args and _plain(a) and (weights is None or (_plain(weights) and weights.shape == a.shape)):
                return direct(a, **kwargs)
            return public(a, *args, **kwargs)

        return reduction


def _plain(array: Any) -> bool:
    """Whether ``array`` is a non-empty, finite 1-D numpy array of integers or floats (no subclass)."""
    return (
        type(array) is np.ndarray
        and array.ndim == 1
        and array.size > 0
        and array.dtype.kind in "iuf"
        and (array.dtype.kind != "f" or bool(np.isfinite(array).all()))
    )


class SharedValues:
    """The values of base metrics within one ``finalize``, by metric and rank array (and digests of count arrays).

    A base metric's value is kept by its class and attributes (e.g. ``HitsAtK`` with ``k=10``: two
    instances alike compute the same function) and by the identity of the arrays it was given; the
    arrays are held, so that an identity is never reused while the value is kept. Derived metrics (each
    called once per array) and weighted calls are not kept (PyKEEN's rank-based evaluator passes no
    weights).
    """

    def __init__(self) -> None:
        """Start empty (one per ``finalize``)."""
        self._values: dict[tuple, tuple[np.ndarray, np.ndarray | None, Any]] = {}
        self._digests: dict[int, tuple[np.ndarray, tuple]] = {}

    def value(
        self, metric: RankBasedMetric, ranks: np.ndarray, num_candidates: np.ndarray | None, weights: np.ndarray | None
    ) -> Any:
        """Return ``metric(ranks, num_candidates, weights)``, computed once per metric and arrays."""
        if weights is not None or isinstance(metric, DerivedRankBasedMetric):
            return type(metric).__call__(metric, ranks=ranks, num_candidates=num_candidates, weights=weights)
        attributes = tuple(sorted((name, repr(value)) for name, value in vars(metric).items()))
        key = (type(metric), attributes, id(ranks), id(num_candidates))
        found = self._values.get(key)
        if found is None:
            value = type(metric).__call__(metric, ranks=ranks, num_candidates=num_candidates, weights=None)
            found = self._values[key] = (ranks, num_candidates, value)
        return found[2]

    def digest(self, counts: np.ndarray) -> tuple:
        """Return a key of the values of ``counts`` (dtype, shape, a 16-byte digest), computed once per array."""
        found = self._digests.get(id(counts))
        if found is None:
            contiguous = np.ascontiguousarray(counts)
            digest = hashlib.blake2b(contiguous.tobytes(), digest_size=16).digest()
            key = (contiguous.dtype.str, contiguous.shape, digest)
            found = self._digests[id(counts)] = (counts, key)
        return found[1]


class _Shared:
    """A metric whose calls go through :class:`SharedValues` (PyKEEN reads ``key`` and calls it)."""

    def __init__(self, metric: RankBasedMetric, shared: SharedValues):
        self.metric, self.shared = metric, shared

    def __getattr__(self, name: str) -> Any:
        return getattr(self.metric, name)

    @property
    def key(self) -> str:
        """The wrapped metric's key."""
        return self.metric.key

    def __call__(
        self, ranks: np.ndarray, num_candidates: np.ndarray | None = None, weights: np.ndarray | None = None
    ) -> Any:
        return self.shared.value(self.metric, ranks, num_candidates, weights)


class CoefficientCache:
    """The adjusted metrics' coefficients by metric and candidate counts (the most recent ``capacity`` arrays)."""

    def __init__(self, capacity: int = 16):
        """Keep the coefficients of at most ``capacity`` distinct arrays of candidate counts per metric.

        :param capacity: the arrays kept per metric (an evaluation has three: head, tail, both)
        """
        self.capacity = capacity
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        #: how many coefficients were computed (not served from the cache)
        self.computed = 0

    @contextlib.contextmanager
    def applied(self, evaluator: Any) -> Iterator[None]:
        """Serve coefficients from the cache and base values once per rank array while the block runs.

        The evaluator's ``metrics`` are replaced while the block runs (PyKEEN's ``finalize`` reads them) by
        ones with the same keys and values that share the base values; its metric objects serve the kept
        coefficients and their base metrics' shared values; PyKEEN's metric modules see :class:`DirectStats`
        as ``stats``.

        :param evaluator: the evaluator (a ``RankBasedEvaluator``) whose ``finalize`` runs in the block
        """
        shared = SharedValues()
        metrics = evaluator.metrics
        derived = [metric for metric in metrics if isinstance(metric, DerivedRankBasedMetric)]
        for metric in derived:
            vars(metric)["get_coefficients"] = self._cached(
                metric, type(metric).get_coefficients.__get__(metric), shared
            )
            vars(metric)["base"] = _Shared(metric.base, shared)
        evaluator.metrics = [_Shared(metric, shared) for metric in metrics]
        modules = [module for module in _METRIC_MODULES if getattr(module, "stats", None) is scipy.stats]
        for module in modules:
            module.stats = DirectStats()  # type: ignore[attr-defined]
        try:
            yield
        finally:
            for module in modules:
                module.stats = scipy.stats  # type: ignore[attr-defined]
            evaluator.metrics = metrics
            for metric in derived:  # the class' method and the metric's own base again
                del vars(metric)["get_coefficients"]
                vars(metric)["base"] = vars(metric)["base"].metric

    def _cached(self, metric: Any, compute: Any, shared: SharedValues) -> Any:
        def get_coefficients(num_candidates: np.ndarray, weights: np.ndarray | None = None) -> Any:
            if weights is not None:  # weighted coefficients depend on the weights too: not kept
                return compute(num_candidates=num_candidates, weights=weights)
            key = (id(metric), *shared.digest(num_candidates))
            found = self._entries.get(key)
            if found is None:
                found = compute(num_candidates=num_candidates, weights=None)
                self.computed += 1
                self._entries[key] = found
                while len(self._entries) > self.capacity * 32:  # about 32 derived metrics per evaluator
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
            return found

        return get_coefficients
