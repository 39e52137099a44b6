"""Near-ties: BessEvaluator ranks a candidate within rounding of the true score as PyKEEN ranks it.

PyKEEN scores a query against all entities with its interaction (DistMult: an element-wise
product and a sum over the dimension) and takes the true score from the same row; BessEvaluator
scores blocks by matrix products, which sum in another order, and the true score by a batched
product. Two scores within a few units of rounding can therefore compare differently: the
metrics of a float32 DistMult of FB15k-237's size differed from PyKEEN's in a few of 4,000
queries on the CPU and on an H100 (max. relative difference 1e-5 to 2.5e-4), also when the true
score was taken from the block's own product. The evaluator compares the candidates within a band
around the true score by PyKEEN's own scores instead (:mod:`pykeen_bess.evaluation.counting`);
``tie_tolerance=0`` turns that off, which these tests use to show that each case is a real one.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.evaluation import RankBasedEvaluator
from pykeen.models import DistMult, ERModel

from pykeen_bess.evaluation import BessEvaluator, ShardedScoring


def metrics(evaluator, model: ERModel, data: Nations) -> Mapping[str, float]:
    kwargs = {"additional_filter_triples": [data.training.mapped_triples, data.validation.mapped_triples]}
    return evaluator.evaluate(model, data.testing.mapped_triples, use_tqdm=False, **kwargs).to_flat_dict()


@pytest.fixture(scope="module")
def nations() -> Nations:
    return Nations()


def twin_model(data: Nations) -> DistMult:
    """A float32 DistMult whose entities come in pairs with identical embeddings: exact ties for PyKEEN."""
    model = DistMult(triples_factory=data.training, embedding_dim=256, random_seed=0).eval()
    with torch.no_grad():
        weight = model.entity_representations[0]._embeddings.weight
        weight[1::2] = weight[0::2][: weight[1::2].shape[0]]
    return model


@pytest.mark.parametrize("num_shards", [1, 3])
def test_twins_tie_as_in_pykeen(nations: Nations, num_shards: int):
    """An entity with the true entity's embedding ties with it exactly in PyKEEN's scores, and here.

    Without the band the twin's block score and the separately computed true score differ by
    rounding, and the ties are ranked as strictly larger or smaller.
    """
    model = twin_model(nations)
    expected = metrics(RankBasedEvaluator(batch_size=256), model, nations)
    assert expected["both.optimistic.arithmetic_mean_rank"] < expected["both.pessimistic.arithmetic_mean_rank"]
    evaluator = BessEvaluator(num_shards=num_shards, batch_size=64, slice_size=5)
    assert metrics(evaluator, model, nations) == expected
    assert sum(evaluator.last_ranked_again.values()) > 0
    assert metrics(BessEvaluator(num_shards=num_shards, tie_tolerance=0), model, nations) != expected


def test_rounding_of_the_blocks_does_not_change_ranks(nations: Nations, monkeypatch):
    """Block scores one unit of rounding off PyKEEN's (another summation order) still give PyKEEN's metrics.

    A float32 model of small integers ties exactly in many places; every non-zero block score is
    moved up by one unit in the last place, as another summation order may round it (a sum of
    zeros is zero in every order).
    """
    model = DistMult(triples_factory=nations.training, embedding_dim=2, random_seed=0).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randint(-1, 2, parameter.shape, generator=generator).float())
    expected = metrics(RankBasedEvaluator(batch_size=256), model, nations)
    assert expected["both.optimistic.arithmetic_mean_rank"] < expected["both.pessimistic.arithmetic_mean_rank"] - 1
    scores = ShardedScoring.scores

    def rounded_up(self, queries, candidates, out=None):
        block = scores(self, queries, candidates, out=out)
        return torch.where(block == 0, block, torch.nextafter(block, torch.full_like(block, float("inf"))))

    monkeypatch.setattr(ShardedScoring, "scores", rounded_up)
    assert metrics(BessEvaluator(num_shards=2, slice_size=4), model, nations) == expected
    assert metrics(BessEvaluator(num_shards=2, slice_size=4, tie_tolerance=0), model, nations) != expected


@pytest.mark.parametrize(("num_shards", "slice_size"), [(1, None), (3, 5), (2, 4)])
def test_collected_near_ties_equal_near_ties_scored_again(nations: Nations, monkeypatch, num_shards, slice_size):
    """The CPU's block loop collects the near-ties' candidates; scoring their queries again finds the same."""
    from pykeen_bess.evaluation import ranking

    model = twin_model(nations)
    results = {}
    for collect in (True, False):
        monkeypatch.setattr(ranking, "COLLECT_BAND_ON_CPU", collect)
        evaluator = BessEvaluator(num_shards=num_shards, batch_size=64, slice_size=slice_size)
        results[collect] = metrics(evaluator, model, nations), dict(evaluator.last_ranked_again)
    assert results[True] == results[False]
    assert sum(results[True][1].values()) > 0
    assert results[True][0] == metrics(RankBasedEvaluator(batch_size=256), model, nations)


def test_block_loop_revisits_only_rows_with_band_candidates(nations: Nations, monkeypatch):
    """A row is searched for band candidates only if it has some that are not excluded (the true entity, filtered)."""
    from pykeen_bess.evaluation import ranking

    searched = []

    def recording(scores, lower, upper, others, *args):
        rows, ids = near_ties.band_candidates(scores, lower, upper, others, *args)
        searched.append(((others > 0).nonzero().view(-1), rows))
        return rows, ids

    from pykeen_bess.evaluation import near_ties

    monkeypatch.setattr(ranking, "band_candidates", recording)
    model = twin_model(nations)
    assert metrics(BessEvaluator(num_shards=2, slice_size=7), model, nations) == metrics(
        RankBasedEvaluator(batch_size=256), model, nations
    )
    assert sum(flagged.numel() for flagged, _ in searched) > 0
    for flagged, found in searched:  # every searched row holds a candidate (no NaN scores here)
        assert torch.equal(flagged, torch.unique(found))


@pytest.mark.parametrize("value", [-1.0, float("nan"), "16", True])
def test_bad_tie_tolerance(value):
    """The band's width must be a non-negative number."""
    with pytest.raises(ValueError, match="tie_tolerance"):
        BessEvaluator(tie_tolerance=value)
