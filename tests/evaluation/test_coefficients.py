"""The adjusted metrics' coefficients kept across evaluations: every metric identical to PyKEEN's."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pykeen.evaluation import RankBasedEvaluator
from pykeen.metrics.ranking import DerivedRankBasedMetric
from pykeen.typing import RANK_OPTIMISTIC, RANK_PESSIMISTIC, RANK_REALISTIC

from pykeen_bess.evaluation import BessEvaluator


def fill(evaluator: RankBasedEvaluator, seed: int, num_entities: int = 500, per_side: int = 300) -> None:
    """Give the evaluator random ranks and filtered candidate counts of both sides (as an evaluation leaves them)."""
    generator = np.random.default_rng(seed)
    for side in ("head", "tail"):
        candidates = generator.integers(num_entities - 40, num_entities + 1, per_side)
        optimistic = generator.integers(1, candidates + 1)
        pessimistic = np.minimum(optimistic + generator.integers(0, 3, per_side), candidates)
        ranks = {RANK_OPTIMISTIC: optimistic, RANK_PESSIMISTIC: pessimistic}
        ranks[RANK_REALISTIC] = (optimistic + pessimistic) / 2
        for rank_type, values in ranks.items():
            evaluator.ranks[side, rank_type].append(values.astype(float))
        evaluator.num_candidates[side].append(candidates)
    evaluator.num_entities = num_entities


def same(expected: dict, actual: dict) -> bool:
    assert expected.keys() == actual.keys()
    return all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(expected.values(), actual.values()))


def test_kept_coefficients_give_pykeen_metrics_exactly() -> None:
    """First and repeated evaluations equal PyKEEN's finalize bit for bit; a repeat computes no coefficient."""
    reference, evaluator = RankBasedEvaluator(), BessEvaluator()
    derived = sum(isinstance(metric, DerivedRankBasedMetric) for metric in evaluator.metrics)
    assert derived > 0
    fill(reference, seed=0)
    fill(evaluator, seed=0)
    expected = reference.finalize().to_flat_dict()
    assert same(expected, evaluator.finalize().to_flat_dict())
    cache = evaluator._coefficients
    # three arrays of candidate counts (head, tail, both), each computed once for all three rank types
    assert cache.computed == 3 * derived
    fill(evaluator, seed=0)  # the same candidate counts (another evaluation of the same triples)
    assert same(expected, evaluator.finalize().to_flat_dict())
    assert cache.computed == 3 * derived
    # the metric objects are PyKEEN's own again outside the evaluator's finalize
    assert all("get_coefficients" not in vars(metric) for metric in evaluator.metrics)


@pytest.mark.parametrize("seed", [1, 2])
def test_other_candidate_counts_compute_their_own_coefficients(seed: int) -> None:
    """Other candidate counts (another filter, other triples) are not served an earlier evaluation's coefficients."""
    evaluator = BessEvaluator()
    fill(evaluator, seed=0)
    evaluator.finalize()
    computed = evaluator._coefficients.computed
    reference = RankBasedEvaluator()
    fill(reference, seed=seed)
    fill(evaluator, seed=seed)
    assert same(reference.finalize().to_flat_dict(), evaluator.finalize().to_flat_dict())
    assert evaluator._coefficients.computed > computed


def test_a_base_metric_is_computed_once_per_rank_array(monkeypatch: pytest.MonkeyPatch) -> None:
    """The geometric mean rank, which three metrics use, is computed once for each of the nine rank arrays."""
    from pykeen.metrics.ranking import GeometricMeanRank, HitsAtK

    calls: dict[str, int] = {"gmr": 0, "hits": 0}
    for name, cls in (("gmr", GeometricMeanRank), ("hits", HitsAtK)):
        original = cls.__call__

        def counted(self, *args, __original=original, __name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls[__name] += 1
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", counted)
    reference, evaluator = RankBasedEvaluator(), BessEvaluator()
    fill(reference, seed=3)
    fill(evaluator, seed=3)
    expected = reference.finalize().to_flat_dict()
    pykeen_calls = dict(calls)
    assert pykeen_calls == {"gmr": 3 * 9, "hits": 3 * 4 * 9}  # GMR, z-GMR, AGMRI; hits, z-hits, adjusted hits
    metrics, bases = list(evaluator.metrics), [getattr(metric, "base", None) for metric in evaluator.metrics]
    assert same(expected, evaluator.finalize().to_flat_dict())
    # once per rank array; each k of the hits its own value
    assert {name: calls[name] - pykeen_calls[name] for name in calls} == {"gmr": 9, "hits": 4 * 9}
    # the evaluator's metrics and their bases are PyKEEN's objects again
    assert evaluator.metrics == metrics
    assert [getattr(metric, "base", None) for metric in evaluator.metrics] == bases
    assert all(type(base).__module__.startswith("pykeen.") for base in bases if base is not None)


def test_direct_stats_equal_scipy_and_pass_other_arguments_on() -> None:
    """The reductions without scipy's argument handling give scipy's values; other arguments go to scipy itself."""
    import warnings

    import pykeen.metrics.ranking
    import scipy.stats

    from pykeen_bess.evaluation.coefficients import DirectStats

    direct, generator = DirectStats(), np.random.default_rng(0)
    ranks = generator.integers(1, 1000, 777)
    for array in (ranks, ranks.astype(float), ranks / 2):
        for name in ("gmean", "hmean"):
            assert getattr(direct, name)(array) == getattr(scipy.stats, name)(array)
            weights = generator.random(array.shape)
            assert getattr(direct, name)(array, weights=weights) == getattr(scipy.stats, name)(array, weights=weights)
        mad = scipy.stats.median_abs_deviation(array, scale="normal")
        assert direct.median_abs_deviation(array, scale="normal") == mad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert math.isnan(direct.gmean(np.array([1.0, np.nan])))  # scipy's NaN policy
        assert math.isnan(direct.gmean(np.array([])))  # scipy's empty sample
        table = ranks.reshape(7, 111)
        assert np.array_equal(direct.gmean(table, axis=1), scipy.stats.gmean(table, axis=1))
    assert direct.rankdata is scipy.stats.rankdata  # every other name is scipy's own
    evaluator = BessEvaluator()
    fill(evaluator, seed=4)
    evaluator.finalize()
    assert pykeen.metrics.ranking.stats is scipy.stats  # PyKEEN's module sees scipy again after finalize


def test_direct_stats_skip_scipys_handling_only_for_plain_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finalize calls scipy's public ``gmean`` for no plain array of ranks; a non-finite array still goes there."""
    import scipy.stats

    from pykeen_bess.evaluation.coefficients import DirectStats

    public, calls = scipy.stats.gmean, []

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args)
        return public(*args, **kwargs)

    counted.__wrapped__ = public.__wrapped__  # type: ignore[attr-defined]
    monkeypatch.setattr(scipy.stats, "gmean", counted)
    reference, evaluator = RankBasedEvaluator(), BessEvaluator()
    fill(reference, seed=5)
    fill(evaluator, seed=5)
    expected = reference.finalize().to_flat_dict()
    pykeen_calls = len(calls)
    assert pykeen_calls > 0
    assert same(expected, evaluator.finalize().to_flat_dict())
    assert len(calls) == pykeen_calls
    DirectStats().gmean(np.array([1.0, np.inf]))
    assert len(calls) == pykeen_calls + 1
