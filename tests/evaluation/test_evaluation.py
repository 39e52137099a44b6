"""Tests for :class:`pykeen_bess.evaluation.BessEvaluator`: every metric equals PyKEEN's ``RankBasedEvaluator``.

The reference is PyKEEN's own evaluator on the same (float64, randomly initialised) model, with the
same filter triples. Sharded results are compared for 1, 2, 3 and 5 shards (5 does not divide any
of the entity counts), with one block per shard and with small batches and slices that split
every shard into many blocks.
"""

from __future__ import annotations

import pathlib
import functools
import math
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from pykeen.datasets import UMLS, Dataset, Kinships, Nations
from pykeen.evaluation import RankBasedEvaluator
from pykeen.evaluation.ranks import Ranks
from pykeen.models import ComplEx, DistMult, ERModel, RotatE, TransE
from pykeen.pipeline import pipeline
from pykeen.triples.triples_factory import restrict_triples

from pykeen_bess.evaluation import (
    BessEvaluator,
    ShardedScoring,
    ShardTableRows,
    choose_block_sizes,
)
from pykeen_bess.scoring import get_scorer
from pykeen_bess.tables.representation import ShardedEmbedding
from pykeen_bess.data.sharding import EntitySharding

DATASETS = {"nations": Nations, "kinships": Kinships, "umls": UMLS}
MODELS = {"DistMult": DistMult, "TransE": TransE, "ComplEx": ComplEx, "RotatE": RotatE}
#: (batch_size, slice_size) per shard count: None lets the evaluator choose (one block per shard here)
BLOCKS = {1: (None, None), 2: (128, 16), 3: (None, None), 5: (97, 7)}
PYKEEN_BATCH_SIZE = 512
RTOL = 1e-6


@functools.cache
def dataset(name: str, create_inverse_triples: bool = False) -> Dataset:
    """A shipped dataset (cached)."""
    return DATASETS[name](create_inverse_triples=create_inverse_triples)


def filter_triples(data: Dataset) -> list[torch.Tensor]:
    """The training and validation triples, as PyKEEN's pipeline filters test evaluation."""
    return [data.training.mapped_triples, data.validation.mapped_triples]


def make_model(model_name: str, data: Dataset, seed: int = 0) -> ERModel:
    """A randomly initialised float64 model."""
    return MODELS[model_name](triples_factory=data.training, random_seed=seed).double()


def pykeen_metrics(model: ERModel, triples: torch.Tensor, **kwargs) -> Mapping[str, float]:
    """PyKEEN's RankBasedEvaluator as the reference."""
    return (
        RankBasedEvaluator()
        .evaluate(model, triples, batch_size=PYKEEN_BATCH_SIZE, use_tqdm=False, **kwargs)
        .to_flat_dict()
    )


@functools.cache
def reference(dataset_name: str, model_name: str) -> tuple[ERModel, Mapping[str, float]]:
    """A model and PyKEEN's metrics on the filtered test set (cached per dataset and model)."""
    data = dataset(dataset_name)
    model = make_model(model_name, data)
    return model, pykeen_metrics(model, data.testing.mapped_triples, additional_filter_triples=filter_triples(data))


def assert_same_metrics(expected: Mapping[str, float], actual: Mapping[str, float]) -> None:
    """All keys present on both sides, all values equal up to float tolerance."""
    assert set(actual) == set(expected)
    assert len(expected) >= 75  # every metric for head, tail and both, three rank types
    different = {
        key: (expected[key], actual[key])
        for key in expected
        if not (
            math.isclose(expected[key], actual[key], rel_tol=RTOL, abs_tol=1e-12)
            or (math.isnan(expected[key]) and math.isnan(actual[key]))
        )
    }
    assert not different, different


@pytest.mark.parametrize("num_shards", sorted(BLOCKS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("dataset_name", sorted(DATASETS))
def test_equals_pykeen(dataset_name: str, model_name: str, num_shards: int):
    """All 225 metric values equal PyKEEN's for every model, dataset and shard count."""
    model, expected = reference(dataset_name, model_name)
    data = dataset(dataset_name)
    batch_size, slice_size = BLOCKS[num_shards]
    evaluator = BessEvaluator(num_shards=num_shards, batch_size=batch_size, slice_size=slice_size)
    result = evaluator.evaluate(
        model, data.testing.mapped_triples, additional_filter_triples=filter_triples(data), use_tqdm=False
    )
    assert_same_metrics(expected, result.to_flat_dict())
    assert result.get_metric("mrr") == result.to_flat_dict()["both.realistic.inverse_harmonic_mean_rank"]


def integer_model(model_cls: type[ERModel], data: Dataset, values: int = 2) -> ERModel:
    """A model whose representations are small integers, so that many scores tie exactly."""
    model = model_cls(triples_factory=data.training, embedding_dim=2, random_seed=0).double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randint(-values + 1, values, parameter.shape, generator=generator).double())
    return model


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("model_cls", [DistMult, TransE])
def test_forced_ties(model_cls: type[ERModel], num_shards: int):
    """Exact ties (optimistic != pessimistic) are counted as PyKEEN counts them."""
    data = dataset("kinships")
    model = integer_model(model_cls, data)
    kwargs = {"additional_filter_triples": filter_triples(data)}
    expected = pykeen_metrics(model, data.testing.mapped_triples, **kwargs)
    assert expected["both.optimistic.arithmetic_mean_rank"] < expected["both.pessimistic.arithmetic_mean_rank"] - 1
    evaluator = BessEvaluator(num_shards=num_shards, batch_size=300, slice_size=13)
    actual = evaluator.evaluate(model, data.testing.mapped_triples, use_tqdm=False, **kwargs).to_flat_dict()
    assert_same_metrics(expected, actual)


@pytest.mark.parametrize("model_cls", [DistMult, RotatE])
def test_inverse_triples(model_cls: type[ERModel]):
    """Head prediction through inverse relations, as PyKEEN's predict_h does."""
    data = dataset("nations", create_inverse_triples=True)
    model = make_model(model_cls.__name__, data)
    assert model.use_inverse_triples
    kwargs = {"additional_filter_triples": filter_triples(data)}
    expected = pykeen_metrics(model, data.testing.mapped_triples, **kwargs)
    actual = BessEvaluator(num_shards=3).evaluate(model, data.testing.mapped_triples, use_tqdm=False, **kwargs)
    assert_same_metrics(expected, actual.to_flat_dict())


@pytest.mark.parametrize("pre_filtered", [True, False])
def test_restrict_entities(pre_filtered: bool):
    """restrict_entities_to: only those entities are candidates, as in PyKEEN."""
    data = dataset("umls")
    model, _ = reference("umls", "ComplEx")
    entities = torch.arange(0, data.num_entities, 2).tolist()
    triples = data.testing.mapped_triples
    if pre_filtered:
        triples = restrict_triples(triples, entities=entities)
    kwargs = {
        "additional_filter_triples": filter_triples(data),
        "restrict_entities_to": entities,
        "pre_filtered_triples": pre_filtered,
    }
    expected = pykeen_metrics(model, triples, **kwargs)
    for num_shards in (1, 4):
        evaluator = BessEvaluator(num_shards=num_shards, batch_size=64, slice_size=9)
        actual = evaluator.evaluate(model, triples, use_tqdm=False, **kwargs).to_flat_dict()
        assert_same_metrics(expected, actual)


@pytest.mark.parametrize("targets", [("head",), ("tail",)])
def test_single_target(targets: tuple[str, ...]):
    """One target: the same keys (that side and "both") and values as PyKEEN."""
    data = dataset("nations")
    model, _ = reference("nations", "TransE")
    kwargs = {"additional_filter_triples": filter_triples(data), "targets": targets}
    expected = pykeen_metrics(model, data.testing.mapped_triples, **kwargs)
    actual = BessEvaluator(num_shards=2).evaluate(model, data.testing.mapped_triples, use_tqdm=False, **kwargs)
    assert_same_metrics(expected, actual.to_flat_dict())


def test_sigmoid():
    """predict_with_sigmoid is applied to candidate and true scores alike."""
    data = dataset("kinships")
    model = make_model("DistMult", data, seed=1)
    model.predict_with_sigmoid = True
    kwargs = {"additional_filter_triples": filter_triples(data)}
    expected = pykeen_metrics(model, data.testing.mapped_triples, **kwargs)
    actual = BessEvaluator(num_shards=2).evaluate(model, data.testing.mapped_triples, use_tqdm=False, **kwargs)
    assert_same_metrics(expected, actual.to_flat_dict())


@pytest.mark.parametrize("model_name", ["DistMult", "ComplEx"])
def test_sharded_embedding_model(model_name: str):
    """A model holding ShardedEmbedding tables is evaluated from its own tables, equal to the plain model."""
    data = dataset("umls")
    model, expected = reference("umls", model_name)
    sharded = make_model(model_name, data)
    sharded.load_state_dict(model.state_dict())
    embedding = sharded.entity_representations[0]
    sharding = EntitySharding.create(data.num_entities, 4, seed=3)
    table = ShardedEmbedding(embedding, sharding, local_shards=range(4))
    table.copy_from(embedding)
    sharded.entity_representations[0] = table.to(torch.float64)
    scoring = ShardedScoring.for_model(sharded)
    assert isinstance(scoring.rows, ShardTableRows) and scoring.sharding is sharding
    result = BessEvaluator(batch_size=200, slice_size=8).evaluate(
        sharded, data.testing.mapped_triples, additional_filter_triples=filter_triples(data), use_tqdm=False
    )
    assert_same_metrics(expected, result.to_flat_dict())


def test_unfiltered_ranks():
    """filtered=False: the ranks PyKEEN's Ranks.from_scores computes from the full score matrix."""
    data = dataset("nations")
    model, _ = reference("nations", "RotatE")
    triples = data.testing.mapped_triples
    evaluator = BessEvaluator(filtered=False, num_shards=3, clear_on_finalize=False)
    evaluator.evaluate(model, triples, use_tqdm=False)
    with torch.inference_mode():
        for target, column in (("head", 0), ("tail", 2)):
            scores = model.predict(triples, target=target)
            true_scores = scores[torch.arange(len(triples)), triples[:, column]].unsqueeze(1)
            expected = Ranks.from_scores(true_score=true_scores, all_scores=scores)
            for rank_type, values in expected.items():
                np.testing.assert_array_equal(np.concatenate(evaluator.ranks[target, rank_type]), values.numpy())
            np.testing.assert_array_equal(
                np.concatenate(evaluator.num_candidates[target]), expected.number_of_options.numpy()
            )


def huge_candidates(model_name: str, overflowing: float | None, huge: float) -> tuple[ERModel, torch.Tensor, dict]:
    """A float32 Kinships model whose entities 0 and 1 are candidates with huge rows; the test triples without them."""
    data = dataset("kinships")
    model = make_model(model_name, data, seed=3).float()  # float32 scores overflow
    triples = data.testing.mapped_triples
    triples = triples[~torch.isin(triples[:, [0, 2]], torch.tensor([0, 1])).any(dim=1)]  # true scores stay finite
    weight = model.entity_representations[0]._embeddings.weight
    with torch.no_grad():
        if model_name == "DistMult":
            model.relation_representations[0]._embeddings.weight.mul_(4.0)  # query entries up to about 0.56
        if overflowing is not None:
            weight[0] = overflowing
        weight[1] = huge
    return model, triples, {"additional_filter_triples": filter_triples(data), "use_tqdm": False}


def test_finite_scores_beyond_the_norms_bound():
    """A candidate whose norm puts ``||q|| ||c||`` over the bound of finite scores: counted again, ranked as PyKEEN.

    Scorers bounded by their feature norms do not sum every block's rows to find non-finite scores
    (``finite_by_norms``); the rows their norms cannot clear are counted again exactly.
    """
    model, triples, kwargs = huge_candidates("DistMult", None, 1e37)
    with torch.inference_mode():
        assert torch.isfinite(model.predict(triples, target="tail")).all()
    reference_evaluator = RankBasedEvaluator(clear_on_finalize=False)
    reference_evaluator.evaluate(model, triples, batch_size=PYKEEN_BATCH_SIZE, **kwargs)
    evaluator = BessEvaluator(num_shards=2, clear_on_finalize=False)
    evaluator.evaluate(model, triples, **kwargs)
    assert sum(evaluator.last_ranked_again.values()) > triples.shape[0]  # most queries, on both sides
    for target in ("head", "tail"):
        for rank_type in ("optimistic", "realistic", "pessimistic"):
            np.testing.assert_array_equal(
                np.concatenate(evaluator.ranks[target, rank_type]),
                np.concatenate(reference_evaluator.ranks[target, rank_type]),
            )


@pytest.mark.parametrize("model_name", ["DistMult", "TransE"])
def test_overflowing_scores_found_by_norms_as_by_row_sums(model_name: str, monkeypatch):
    """Scores that overflow: the queries flagged by the norms or by every block's row sums are ranked as PyKEEN.

    Both count the flagged queries by PyKEEN's own rows. (Flagged by row sums only, a query whose block
    scores stay finite where PyKEEN's overflow keeps the block's count of options: the norms flag it.)
    """
    model, triples, kwargs = huge_candidates(model_name, 3e38, 1e37)
    with torch.inference_mode():
        assert (~torch.isfinite(model.predict(triples, target="tail")[:, 0])).any()
    reference = RankBasedEvaluator(clear_on_finalize=False)
    reference.evaluate(model, triples, **kwargs)
    scorer_class = type(get_scorer(model.interaction))
    for bounded in (True, False):
        monkeypatch.setattr(scorer_class, "bounded_by_feature_norms", bounded)
        evaluator = BessEvaluator(num_shards=2, clear_on_finalize=False)
        evaluator.evaluate(model, triples, **kwargs)
        for target in ("head", "tail"):
            for rank_type in ("optimistic", "realistic", "pessimistic"):
                np.testing.assert_array_equal(
                    np.concatenate(evaluator.ranks[target, rank_type]),
                    np.concatenate(reference.ranks[target, rank_type]),
                )
            if bounded or model_name != "DistMult":
                np.testing.assert_array_equal(
                    np.concatenate(evaluator.num_candidates[target]), np.concatenate(reference.num_candidates[target])
                )


@pytest.mark.parametrize("model_name", ["NTN", "SE", "ConvKB"])
@pytest.mark.parametrize("num_shards", [1, 3])
def test_models_without_a_fast_scorer_are_ranked_by_pykeens_rows(model_name, num_shards, monkeypatch) -> None:
    """Interactions without a fast scorer are ranked by PyKEEN's own score rows, as PyKEEN ranks them.

    Their broadcast blocks recomputed the queries' work for every candidate chunk (NTN: the relation's
    matrices), and most of their queries had candidates inside the near-tie band, compared again by
    PyKEEN's scores: several times PyKEEN's time. No block is scored now, and no query is ranked again.
    """
    from pykeen.models import model_resolver

    from pykeen_bess.scoring.fallback import BroadcastScorer

    data = dataset("nations")
    model = model_resolver.make(model_name, triples_factory=data.training, embedding_dim=8, random_seed=0)
    triples = data.testing.mapped_triples
    kwargs = dict(use_tqdm=False, additional_filter_triples=[data.training.mapped_triples])
    expected = RankBasedEvaluator().evaluate(model, triples, batch_size=PYKEEN_BATCH_SIZE, **kwargs).to_flat_dict()

    def no_blocks(*args, **kwargs):
        raise AssertionError("a broadcast block was scored")

    monkeypatch.setattr(BroadcastScorer, "score", no_blocks)
    evaluator = BessEvaluator(num_shards=num_shards)
    assert evaluator.evaluate(model, triples, **kwargs).to_flat_dict() == expected
    assert evaluator.last_ranked_again == {"head": 0, "tail": 0}


def test_models_ranked_by_pykeens_rows_probe_no_block(monkeypatch) -> None:
    """With a memory budget, the block-size search of a model ranked by PyKEEN's rows probes nothing.

    The sizes only chunk the queries there; the probe was a broadcast block of the interaction
    (seconds, and a peak far above the ranking's, for ConvKB).
    """
    from pykeen.models import model_resolver
    from pykeen.triples import CoreTriplesFactory

    from pykeen_bess.scoring.fallback import BroadcastScorer

    generator = torch.Generator().manual_seed(0)
    num_entities, num_triples = 3000, 2000
    triples = torch.stack(
        [
            torch.randint(num_entities, (num_triples,), generator=generator),
            torch.randint(5, (num_triples,), generator=generator),
            torch.randint(num_entities, (num_triples,), generator=generator),
        ],
        dim=1,
    )
    factory = CoreTriplesFactory.create(mapped_triples=triples, num_entities=num_entities, num_relations=5)
    model = model_resolver.make("SE", triples_factory=factory, embedding_dim=4, random_seed=0)
    test = triples[:400]  # 400 x 3000 float32 scores: beyond the block used without a search
    kwargs = dict(use_tqdm=False, additional_filter_triples=[triples], targets=["tail"])
    expected = RankBasedEvaluator().evaluate(model, test, batch_size=PYKEEN_BATCH_SIZE, **kwargs).to_flat_dict()

    def no_blocks(*args, **kwargs):
        raise AssertionError("a broadcast block was scored")

    monkeypatch.setattr(BroadcastScorer, "score", no_blocks)
    evaluator = BessEvaluator(memory_budget=2**20)
    assert evaluator.evaluate(model, test, **kwargs).to_flat_dict() == expected


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    ("model_name", "value"), [("RotatE", 3e38), ("TransE", 1e20), ("TransE", float("-inf")), ("DistMult", 3e38)]
)
@pytest.mark.parametrize("num_shards", [1, 3])
def test_non_finite_scores_are_counted_by_pykeens_rows(model_name: str, value: float, num_shards: int) -> None:
    """A row that makes scores overflow or infinite: the queries with non-finite scores are ranked as PyKEEN ranks.

    A distance's norm expansion turns PyKEEN's -inf into inf - inf = NaN (RotatE at 3e38, TransE's L2 at 1e20):
    PyKEEN's own full score rows count those queries.
    """
    data = dataset("nations")
    cls = {"RotatE": RotatE, "TransE": TransE, "DistMult": DistMult}[model_name]
    model = cls(triples_factory=data.training, random_seed=0, **({"scoring_fct_norm": 2} if cls is TransE else {}))
    with torch.no_grad():
        model.entity_representations[0]._embeddings.weight[3, 0] = value
    triples = data.testing.mapped_triples
    kwargs = dict(use_tqdm=False, additional_filter_triples=[data.training.mapped_triples])
    expected = RankBasedEvaluator().evaluate(model, triples, **kwargs).to_flat_dict()
    evaluator = BessEvaluator(num_shards=num_shards)
    actual = evaluator.evaluate(model, triples, **kwargs).to_flat_dict()
    assert sum(evaluator.last_ranked_again.values()) > 0
    assert {
        k: v for k, v in actual.items() if not (v == expected[k] or (math.isnan(v) and math.isnan(expected[k])))
    } == {}


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_nan_scores():
    """NaN candidates are excluded as in PyKEEN; a NaN true score ranks last; both are reported.

    (PyKEEN's reference has queries with zero options here, hence its division warnings.)
    """
    data = dataset("kinships")
    model = make_model("DistMult", data, seed=2)
    triples = data.testing.mapped_triples
    broken = int(triples[0, 2])
    with torch.no_grad():
        model.entity_representations[0]._embeddings.weight[broken] = float("nan")
    kwargs = {"additional_filter_triples": filter_triples(data), "use_tqdm": False}
    reference_evaluator = RankBasedEvaluator(clear_on_finalize=False)
    reference_evaluator.evaluate(model, triples, batch_size=PYKEEN_BATCH_SIZE, **kwargs)
    evaluator = BessEvaluator(num_shards=3, clear_on_finalize=False)
    with pytest.warns(RuntimeWarning, match=r"NaN scores: \d+ candidate scores .* \d+ true triples"):
        evaluator.evaluate(model, triples, **kwargs)
    with torch.inference_mode():
        true_is_nan = torch.isnan(model.score_hrt(triples).view(-1)).numpy()
    assert true_is_nan.any() and not true_is_nan.all()
    for target in ("head", "tail"):
        options = np.concatenate(evaluator.num_candidates[target])
        expected_options = np.concatenate(reference_evaluator.num_candidates[target])
        np.testing.assert_array_equal(options[~true_is_nan], expected_options[~true_is_nan])
        # PyKEEN does not count the NaN true entity as an option; here it is the last one
        np.testing.assert_array_equal(options[true_is_nan], expected_options[true_is_nan] + 1)
        for rank_type in ("optimistic", "realistic", "pessimistic"):
            ranks = np.concatenate(evaluator.ranks[target, rank_type])
            expected_ranks = np.concatenate(reference_evaluator.ranks[target, rank_type])
            np.testing.assert_array_equal(ranks[~true_is_nan], expected_ranks[~true_is_nan])
            np.testing.assert_array_equal(ranks[true_is_nan], options[true_is_nan])
        # PyKEEN would rank these first
        assert (np.concatenate(reference_evaluator.ranks[target, "optimistic"])[true_is_nan] == 1).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mapped_triples": torch.tensor([[0, 0, 14]])}, ValueError, r"entity ids outside \[0, 14\)"),
        ({"mapped_triples": torch.tensor([[0, 55, 1]])}, ValueError, r"relation ids outside \[0, 55\)"),
        ({"mapped_triples": torch.tensor([[-1, 0, 1]])}, ValueError, "entity ids outside"),
        ({"mapped_triples": torch.tensor([[0, 0, 1], [0, -2, 1]])}, ValueError, r"relation ids outside .* \[-2\]"),
        ({"mapped_triples": torch.tensor([[0, 0, 1], [0, -2, 1]])}, ValueError, r"^(?!.*entity ids)"),
        ({"mapped_triples": torch.tensor([[0, 0, 1], [3, 0, -7]])}, ValueError, r"entity ids outside .* \[-7\]"),
        ({"mapped_triples": torch.tensor([[0, 0, 1], [0, 60, 1]]).t().contiguous().t()}, ValueError, "relation ids"),
        ({"mapped_triples": torch.empty(0, 3, dtype=torch.long)}, ValueError, "empty"),
        ({"mapped_triples": torch.tensor([[0, 1]])}, ValueError, r"shape \[n, 3\]"),
        ({"mapped_triples": torch.tensor([[0.0, 1.0, 2.0]])}, ValueError, "integer"),
        ({"targets": ("relation",)}, NotImplementedError, "relation prediction .* not supported"),
        (
            {"restrict_entities_to": [0, 1, 2], "restrict_relations_to": [0], "pre_filtered_triples": False},
            ValueError,
            "No evaluation triples remain after restrict_entities_to",
        ),
        ({"targets": ("head", "middle")}, ValueError, "Unknown evaluation targets"),
        ({"targets": ()}, ValueError, "No evaluation targets"),
        ({"targets": ("head", "head")}, ValueError, "repeat a side"),  # PyKEEN counts it twice, BESS counted once
        ({"additional_filter_triples": [torch.tensor([[0, 0, 99]])]}, ValueError, "additional_filter_triples"),
        ({"restrict_entities_to": []}, ValueError, "restrict_entities_to is empty"),
        ({"restrict_entities_to": [0, 20]}, ValueError, r"restrict_entities_to contains ids outside \[0, 14\)"),
        ({"batch_size": 0}, ValueError, "batch_size must be a positive integer"),
    ],
)
def test_bad_input(kwargs, error, match):
    """Clear errors for triples that do not belong to the model, empty inputs and relation targets."""
    data = dataset("nations")
    model, _ = reference("nations", "DistMult")
    arguments = {"model": model, "mapped_triples": data.testing.mapped_triples, "use_tqdm": False}
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        BessEvaluator().evaluate(**arguments)


@pytest.mark.parametrize("memory_budget", ["2", 0, -1, True])
def test_bad_memory_budget(memory_budget) -> None:
    with pytest.raises(ValueError, match=r"memory_budget \(bytes\) must be a positive integer or None"):
        BessEvaluator(memory_budget=memory_budget)


@pytest.mark.parametrize("filtered", ["no", "False", 2, None])
def test_filtered_must_be_a_boolean(filtered) -> None:
    """filtered="no" filtered (a non-empty string is true)."""
    with pytest.raises(ValueError, match="filtered must be True or False"):
        BessEvaluator(filtered=filtered)


def test_given_block_sizes_beyond_the_queries_and_candidates_are_capped() -> None:
    """A batch of a million queries against slices of a million candidates: the queries and candidates there are."""
    data = dataset("nations")
    model, _ = reference("nations", "DistMult")
    evaluator = BessEvaluator(batch_size=10**6, slice_size=10**6)
    result = evaluator.evaluate(model, data.testing.mapped_triples, use_tqdm=False)
    assert evaluator.last_block_sizes == (data.testing.num_triples, data.num_entities)
    expected = BessEvaluator().evaluate(model, data.testing.mapped_triples, use_tqdm=False)
    assert result.to_flat_dict() == expected.to_flat_dict()


@pytest.mark.parametrize(("num_shards", "match"), [(0, "positive integer"), (15, "larger than the number of entities")])
def test_bad_num_shards(num_shards: int, match: str):
    """The number of shards must be between 1 and the number of entities."""
    data = dataset("nations")
    model, _ = reference("nations", "DistMult")
    with pytest.raises(ValueError, match=match):
        BessEvaluator(num_shards=num_shards).evaluate(model, data.testing.mapped_triples, use_tqdm=False)


def test_relation_target_message():
    """Relation prediction is refused with an explanation, not PyKEEN's bare link."""
    model, _ = reference("nations", "DistMult")
    with pytest.raises(NotImplementedError, match="ranks entities only"):
        BessEvaluator().evaluate(model, dataset("nations").testing.mapped_triples, targets=("head", "relation"))


def test_memory_search_halves_until_the_probe_fits(monkeypatch):
    """Missing sizes: the largest power-of-two fraction of the default block that the probe accepts."""
    from pykeen_bess import memory
    from pykeen_bess.evaluation import sizes as evaluation

    monkeypatch.setattr(evaluation, "TRIVIAL_BLOCK_BYTES", 0)
    monkeypatch.setattr(evaluation, "CPU_BLOCK_BYTES", 135 * 8 * 64)
    monkeypatch.setattr(memory.gc, "collect", lambda generation=2: 0)  # speed: nothing is allocated by this probe
    data = dataset("umls")
    model, _ = reference("umls", "DistMult")
    scoring = ShardedScoring.for_model(model, num_shards=1)
    tried = []

    def probe(batch_size: int, slice_size: int) -> None:
        tried.append((batch_size, slice_size))
        if batch_size * slice_size > 1000:
            raise MemoryError("probe too large")

    num_queries, cpu = 10_000, torch.device("cpu")
    # a budget of CPU_PROBE_MARGIN default blocks or more: the default block, no probe
    budget = evaluation.CPU_BLOCK_BYTES * evaluation.CPU_PROBE_MARGIN
    batch_size, slice_size = choose_block_sizes(scoring, num_queries, None, None, probe, cpu, memory_budget=budget)
    assert tried == [] and slice_size == data.num_entities
    assert batch_size * slice_size * 8 == evaluation.CPU_BLOCK_BYTES  # the reference model scores in float64
    # a budget below CPU_PROBE_MARGIN default blocks: the block is probed
    choose_block_sizes(scoring, num_queries, None, None, probe, cpu, memory_budget=budget - 1)
    assert tried == [(batch_size, slice_size)]
    # with every block probed (the margin never holds)
    tried.clear()
    monkeypatch.setattr(evaluation, "CPU_PROBE_MARGIN", 2**62)
    batch_size, slice_size = choose_block_sizes(scoring, num_queries, None, None, probe, cpu)
    assert slice_size == data.num_entities
    assert batch_size * slice_size <= 1000 < 2 * batch_size * slice_size
    assert tried[0][0] > batch_size and all(s == slice_size for _, s in tried)
    # a given batch size: the slice is searched
    tried.clear()
    batch_size, slice_size = choose_block_sizes(scoring, num_queries, 50, None, probe, cpu)
    assert batch_size == 50 and slice_size * 50 <= 1000 < slice_size * 100
    # nothing fits
    with pytest.raises(MemoryError):
        choose_block_sizes(scoring, num_queries, 1, None, lambda b, s: probe(b, s * 2000), cpu)


def test_automatic_sizes_equal_pykeen(monkeypatch):
    """With the probe and several default-sized blocks (block bound lowered), the metrics are unchanged."""
    from pykeen_bess.evaluation import sizes as evaluation

    monkeypatch.setattr(evaluation, "TRIVIAL_BLOCK_BYTES", 0)
    monkeypatch.setattr(evaluation, "CPU_BLOCK_BYTES", 64 * 8 * 32)
    monkeypatch.setattr(evaluation, "DEFAULT_SLICE_SIZE", 32)
    data = dataset("umls")
    model, expected = reference("umls", "TransE")
    evaluator = BessEvaluator(num_shards=2)
    result = evaluator.evaluate(
        model, data.testing.mapped_triples, additional_filter_triples=filter_triples(data), use_tqdm=False
    )
    assert_same_metrics(expected, result.to_flat_dict())
    assert [sizes for cached in evaluator._block_sizes.values() for sizes in cached.values()] == [(64, 32)]


def test_pipeline_with_early_stopping():
    """The evaluator class works in pipeline() and in early-stopping validation."""
    result = pipeline(
        dataset="nations",
        model="DistMult",
        evaluator=BessEvaluator,
        training_kwargs={"num_epochs": 2, "use_tqdm": False},
        stopper="early",
        stopper_kwargs={"frequency": 1, "patience": 1},
        random_seed=0,
    )
    assert len(result.stopper.results) >= 1
    assert 0 < result.metric_results.get_metric("mrr") <= 1
    assert len(result.metric_results.to_flat_dict()) >= 75


def test_mid_training_evaluation_reads_shard_tables(monkeypatch):
    """Under BESS training the stopper evaluates the model's ShardedEmbedding tables directly."""
    from pykeen_bess.training import BessTrainingLoop

    seen = []
    original = ShardedScoring.__init__

    def spy(self, model, rows, *args, **kwargs):
        seen.append(type(rows).__name__)
        original(self, model, rows, *args, **kwargs)

    monkeypatch.setattr(ShardedScoring, "__init__", spy)
    result = pipeline(
        dataset="nations",
        model="DistMult",
        training_loop=BessTrainingLoop,
        training_loop_kwargs={"num_shards": 2},
        evaluator=BessEvaluator,
        training_kwargs={"num_epochs": 2, "use_tqdm": False},
        stopper="early",
        stopper_kwargs={"frequency": 1, "patience": 1},
        random_seed=0,
    )
    assert seen[0] == "ShardTableRows"
    assert 0 < result.metric_results.get_metric("mrr") <= 1


def test_early_stopping_builds_the_filter_and_the_excluded_pairs_once(monkeypatch):
    """pipeline(evaluator="bess", stopper="early"): checks after the first build nothing; the final test builds."""
    from pykeen_bess.evaluation.excluded import ExcludedPairs
    from pykeen_bess.evaluation.filtering import FilterIndex

    calls = {"index": 0, "pairs": 0}
    from_triples, build = FilterIndex.from_triples, ExcludedPairs.build

    def counted_index(*args, **kwargs):
        calls["index"] += 1
        return from_triples(*args, **kwargs)

    def counted_pairs(*args, **kwargs):
        calls["pairs"] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(FilterIndex, "from_triples", counted_index)
    monkeypatch.setattr(ExcludedPairs, "build", counted_pairs)
    result = pipeline(
        dataset="nations",
        model="DistMult",
        training_loop="bess",
        evaluator="bess",
        training_kwargs={"num_epochs": 4, "use_tqdm": False},
        evaluator_kwargs={"num_shards": 2},
        stopper="early",
        stopper_kwargs={"frequency": 1, "patience": 10},
        random_seed=0,
    )
    assert len(result.stopper.results) == 4
    # the 4 validation checks: one index, two targets' pairs; the final test evaluation: one more of each
    assert calls == {"index": 2, "pairs": 4}


def test_a_repeated_evaluation_reuses_the_id_layouts(monkeypatch):
    """The entity sharding, candidate columns and device id tables are built once for repeated evaluations."""
    from pykeen_bess.evaluation.candidates import CandidateColumns, DeviceTables

    calls = {"sharding": 0, "columns": 0, "tables": 0}
    originals = {
        "sharding": EntitySharding.create,
        "columns": CandidateColumns.create,
        "tables": DeviceTables.build,
    }
    for name, (cls, attribute) in {
        "sharding": (EntitySharding, "create"),
        "columns": (CandidateColumns, "create"),
        "tables": (DeviceTables, "build"),
    }.items():

        def counted(*args, __name=name, **kwargs):
            calls[__name] += 1
            return originals[__name](*args, **kwargs)

        monkeypatch.setattr(cls, attribute, counted)
    model, expected = reference("nations", "DistMult")
    data = dataset("nations")
    evaluator = BessEvaluator(num_shards=3, batch_size=64)

    def evaluate(**kwargs) -> Mapping[str, float]:
        result = evaluator.evaluate(
            model, data.testing.mapped_triples, additional_filter_triples=filter_triples(data), use_tqdm=False, **kwargs
        )
        return result.to_flat_dict()

    from pykeen_bess.evaluation import excluded

    digests = []
    digest = excluded.sha256_of_array
    monkeypatch.setattr(excluded, "sha256_of_array", lambda array: digests.append(array.shape) or digest(array))
    for _ in range(3):
        assert_same_metrics(expected, evaluate())
    assert calls == {"sharding": 1, "columns": 1, "tables": 1}
    # the excluded pairs' key: the triples digested per target, the kept id tables once (two arrays)
    assert len(digests) == 3 * 2 + 2
    # restricted candidates (here: all entities): their own columns and tables each time, the sharding kept
    everyone = list(range(data.training.num_entities))
    for _ in range(2):
        assert_same_metrics(expected, evaluate(restrict_entities_to=everyone))
    assert calls == {"sharding": 1, "columns": 3, "tables": 3}
    assert_same_metrics(expected, evaluate())  # the unrestricted columns kept, their tables built again
    assert calls == {"sharding": 1, "columns": 3, "tables": 4}
    evaluator.num_shards = 2  # another sharding: everything anew
    assert_same_metrics(expected, evaluate())
    assert calls == {"sharding": 2, "columns": 4, "tables": 5}


def test_hpo_pipeline():
    """The evaluator class works in hpo_pipeline()."""
    from pykeen.hpo import hpo_pipeline

    result = hpo_pipeline(
        dataset="nations",
        model="DistMult",
        evaluator=BessEvaluator,
        evaluator_kwargs={"num_shards": 2},
        n_trials=1,
        training_kwargs={"num_epochs": 1, "use_tqdm": False},
    )
    assert len(result.study.trials) == 1 and 0 < result.study.best_value <= 1


@pytest.mark.slow
def test_distributed_shards_equal_pykeen(tmp_path):
    """Under torch.distributed (2 gloo ranks, one shard each) only counts cross ranks; metrics equal PyKEEN's."""
    import rank_zygote
    from pykeen_bess.evaluation import predict_top_k

    worker = pathlib.Path(__file__).with_name("evaluation_worker.py")
    results = rank_zygote.launch(2, [str(worker), str(tmp_path)], timeout=240)
    assert results.ok, results.report()
    outcomes = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    data = dataset("nations")
    model = make_model("ComplEx", data)
    expected = pykeen_metrics(model, data.testing.mapped_triples, additional_filter_triples=filter_triples(data))
    expected_top = predict_top_k(
        model, data.testing.mapped_triples[:20, :2], k=4, filter_triples=data.training.mapped_triples
    )
    for outcome in outcomes:
        assert_same_metrics(expected, outcome["metrics"])
        assert outcome["tail_ids"] == expected_top["tail_id"].tolist()


def test_evaluation_reads_the_host_a_few_times_per_batch_not_per_block():
    """Whether a block held non-finite scores is read once per batch, not once per block."""
    from host_reads import HostReads

    data = dataset("nations")
    model, expected = reference("nations", "DistMult")
    evaluator = BessEvaluator(num_shards=2, batch_size=100, slice_size=2)  # 4 blocks per shard
    triples = data.testing.mapped_triples
    with HostReads(list(model.parameters())) as reads:
        result = evaluator.evaluate(model, triples, additional_filter_triples=filter_triples(data), use_tqdm=False)
    assert_same_metrics(expected, result.to_flat_dict())
    batches = -(-triples.shape[0] // 100)
    # per batch and target: the non-finite flag, and the NaN counts of candidates and true scores
    assert len(reads.reads) <= 3 * 2 * batches, "\n".join(sorted(set(reads.reads)))


def test_block_size_cache_dies_with_the_model():
    """The evaluator's cache of searched block sizes is keyed by the model object, not by its ``id``."""
    import gc

    data = dataset("nations")
    model = make_model("DistMult", data)
    evaluator = BessEvaluator(num_shards=1)
    evaluator.evaluate(model, data.testing.mapped_triples, use_tqdm=False)
    assert len(evaluator._block_sizes) == 1
    del model
    gc.collect()
    assert len(evaluator._block_sizes) == 0  # a new model that reuses the id cannot find these sizes


def test_an_inductive_model_is_refused() -> None:
    """An inductive model's entities depend on PyKEEN's evaluation mode, which BessEvaluator does not take."""
    from pykeen.models import InductiveNodePiece

    data = Nations(create_inverse_triples=True)
    model = InductiveNodePiece(
        triples_factory=data.training, inference_factory=data.training, num_tokens=3, random_seed=0
    )
    with pytest.raises(NotImplementedError, match="transductive models only; InductiveNodePiece is inductive"):
        BessEvaluator().evaluate(model, data.testing.mapped_triples, use_tqdm=False)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_non_finite_scores_counted_by_pykeens_rows_in_bounded_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a tiny bound on PyKEEN's intermediates the full rows come in slices of its entities: the same metrics."""
    from pykeen_bess.evaluation import near_ties

    data = dataset("nations")
    model = TransE(triples_factory=data.training, random_seed=0, scoring_fct_norm=2)
    with torch.no_grad():
        model.entity_representations[0]._embeddings.weight[3, 0] = 1e20
    triples = data.testing.mapped_triples
    kwargs = dict(use_tqdm=False, additional_filter_triples=[data.training.mapped_triples])
    expected = RankBasedEvaluator().evaluate(model, triples, **kwargs).to_flat_dict()
    monkeypatch.setattr(near_ties, "PYKEEN_CALL_ELEMENTS", 2 * 3 * 50)  # two queries against three entities
    actual = BessEvaluator().evaluate(model, triples, **kwargs).to_flat_dict()
    assert {
        k: v for k, v in actual.items() if not (v == expected[k] or (math.isnan(v) and math.isnan(expected[k])))
    } == {}
