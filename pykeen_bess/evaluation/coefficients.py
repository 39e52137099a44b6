"""The adjusted metrics' coefficients, computed once per set of candidate counts and kept across evaluations.

PyKEEN's adjusted rank-based metrics (the adjusted mean rank, the z-scores, the adjusted index
metrics) are an affine map of a base metric whose coefficients depend only on every query's number
of candidates, not on the ranks: the expected value (and for z-scores the standard deviation) of
the base metric under random ranking. PyKEEN computes them for every side and rank type, nine times
per evaluation where three arrays of candidate counts (head, tail, both) occur, and again at every
evaluation of the same triples (an early stopper's validation set), although the filtered candidate
counts are the same each time. With WN18RR's 6,268 queries that is about 40% of PyKEEN's
``finalize`` (0.05 of 0.13 s on a 2-core CPU).

:class:`CoefficientCache` keeps each metric's coefficients by a digest of the candidate counts and
serves them while :meth:`CoefficientCache.applied` is active: the same function on the same input,
so every metric is identical to PyKEEN's. A cache belongs to one evaluator (its metric objects are
part of the key).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from pykeen.metrics.ranking import DerivedRankBasedMetric

__all__ = ["CoefficientCache"]


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
    def applied(self, metrics: Sequence[Any]) -> Iterator[None]:
        """Serve the coefficients of the derived metrics among ``metrics`` from the cache while the block runs."""
        patched = [metric for metric in metrics if isinstance(metric, DerivedRankBasedMetric)]
        for metric in patched:
            vars(metric)["get_coefficients"] = self._cached(metric, type(metric).get_coefficients.__get__(metric))
        try:
            yield
        finally:
            for metric in patched:
                del vars(metric)["get_coefficients"]  # the class' method again

    def _cached(self, metric: Any, compute: Any) -> Any:
        def get_coefficients(num_candidates: np.ndarray, weights: np.ndarray | None = None) -> Any:
            if weights is not None:  # weighted coefficients depend on the weights too: not kept
                return compute(num_candidates=num_candidates, weights=weights)
            counts = np.ascontiguousarray(num_candidates)
            digest = hashlib.blake2b(counts.tobytes(), digest_size=16).digest()
            key = (id(metric), counts.dtype.str, counts.shape, digest)
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
