"""Tests for :func:`pykeen_bess.evaluation.prediction.predict_top_k` against a brute-force full sort."""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import pytest
import torch
from pykeen.datasets import UMLS, Nations
from pykeen.models import ComplEx, DistMult, ERModel, TransE

from pykeen_bess.evaluation.prediction import predict_top_k
from pykeen_bess.tables.representation import ShardedEmbedding
from pykeen_bess.data.sharding import EntitySharding

K = 7


@functools.cache
def umls() -> UMLS:
    """The UMLS dataset (cached)."""
    return UMLS()


@functools.cache
def model_for(model_name: str) -> ERModel:
    """A randomly initialised float64 model on UMLS (cached)."""
    model_cls = {"DistMult": DistMult, "ComplEx": ComplEx, "TransE": TransE}[model_name]
    return model_cls(triples_factory=umls().training, random_seed=0).double()


def query_pairs(target: str, count: int = 40) -> torch.Tensor:
    """``(h, r)`` pairs for tail prediction, ``(r, t)`` pairs for head prediction, from test triples."""
    triples = umls().testing.mapped_triples[:count]
    return triples[:, :2] if target == "tail" else triples[:, 1:]


def brute_force(
    model: ERModel, pairs: torch.Tensor, target: str, k: int, known: torch.Tensor | None
) -> list[list[int]]:
    """The top-k entity ids of each query from PyKEEN's full score matrix, sorted by (score desc, id asc)."""
    with torch.inference_mode():
        scores = (model.predict_t(pairs) if target == "tail" else model.predict_h(pairs)).numpy().copy()
    if known is not None:
        known_set = {tuple(t) for t in known.tolist()}
        for i, (a, b) in enumerate(pairs.tolist()):
            for e in range(scores.shape[1]):
                if ((a, b, e) if target == "tail" else (e, a, b)) in known_set:
                    scores[i, e] = np.nan
    expected = []
    ids = np.arange(scores.shape[1])
    for row in scores:
        keep = ~np.isnan(row)
        order = np.lexsort((ids[keep], -row[keep]))
        expected.append(ids[keep][order][:k].tolist())
    return expected


def predicted_ids(frame: pd.DataFrame, target: str, num_queries: int) -> list[list[int]]:
    """The predicted ids of each query, in rank order."""
    column = f"{target}_id"
    assert (frame.groupby("query")["rank"].apply(lambda r: list(r) == list(range(1, len(r) + 1)))).all()
    return [frame.loc[frame["query"] == i, column].tolist() for i in range(num_queries)]


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("target", ["head", "tail"])
@pytest.mark.parametrize("model_name", ["DistMult", "ComplEx"])
def test_equals_brute_force(model_name: str, target: str, filtered: bool, num_shards: int):
    """The same entities in the same order as a full sort, with and without filtering."""
    model = model_for(model_name)
    pairs = query_pairs(target)
    known = umls().training.mapped_triples if filtered else None
    expected = brute_force(model, pairs, target, K, known)
    frame = predict_top_k(
        model, pairs, k=K, target=target, filter_triples=known, num_shards=num_shards, batch_size=16, slice_size=10
    )
    assert predicted_ids(frame, target, len(pairs)) == expected
    # the query columns and the scores
    fixed = ["head_id", "relation_id"] if target == "tail" else ["relation_id", "tail_id"]
    np.testing.assert_array_equal(frame[fixed].to_numpy(), pairs.numpy()[frame["query"].to_numpy()])
    with torch.inference_mode():
        triples = torch.as_tensor(frame[["head_id", "relation_id", "tail_id"]].to_numpy().copy())
        np.testing.assert_allclose(frame["score"].to_numpy(), model.predict_hrt(triples).view(-1).numpy(), rtol=1e-9)


def test_ties_are_ordered_by_entity_id():
    """With massive exact ties the order is by entity id, whatever the sharding, slicing and batching."""
    data = Nations()
    model = DistMult(triples_factory=data.training, embedding_dim=2, random_seed=0).double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randint(-1, 2, parameter.shape, generator=generator).double())
    pairs = data.testing.mapped_triples[:30, :2]
    expected = brute_force(model, pairs, "tail", 9, None)
    with torch.inference_mode():
        scores = model.predict_t(pairs)
    assert (scores.unsqueeze(2) == scores.unsqueeze(1)).sum() > 3 * scores.numel()  # many ties
    for num_shards, slice_size, batch_size in [(1, None, None), (3, 2, 7), (5, 1, 4), (4, 3, 30)]:
        frame = predict_top_k(model, pairs, k=9, num_shards=num_shards, slice_size=slice_size, batch_size=batch_size)
        assert predicted_ids(frame, "tail", len(pairs)) == expected


def test_labels_and_large_k():
    """Label queries through a triples factory; label columns; k larger than the number of entities."""
    data = umls()
    factory = data.training
    model = model_for("DistMult")
    ids = query_pairs("head", 3)
    labels = [(factory.relation_id_to_label[int(r)], factory.entity_id_to_label[int(t)]) for r, t in ids.tolist()]
    frame = predict_top_k(model, labels, k=1000, target="head", triples_factory=factory)
    assert len(frame) == 3 * factory.num_entities
    by_id = predict_top_k(model, ids, k=1000, target="head")
    pd.testing.assert_frame_equal(frame[by_id.columns], by_id)
    assert (frame["head_label"] == frame["head_id"].map(factory.entity_id_to_label)).all()
    assert (frame["relation_label"] == frame["relation_id"].map(factory.relation_id_to_label)).all()
    assert (frame["tail_label"] == frame["tail_id"].map(factory.entity_id_to_label)).all()
    with pytest.raises(ValueError, match="Unknown entity labels"):
        predict_top_k(model, [(labels[0][0], "no such entity")], k=3, target="head", triples_factory=factory)


def test_sharded_embedding_model():
    """A model holding ShardedEmbedding tables predicts what the plain model predicts."""
    data = umls()
    plain = model_for("TransE")
    sharded = TransE(triples_factory=data.training, random_seed=0).double()
    sharded.load_state_dict(plain.state_dict())
    embedding = sharded.entity_representations[0]
    table = ShardedEmbedding(embedding, EntitySharding.create(data.num_entities, 3, seed=1), local_shards=range(3))
    table.copy_from(embedding)
    sharded.entity_representations[0] = table
    pairs = query_pairs("tail")
    expected = predict_top_k(plain, pairs, k=K)
    actual = predict_top_k(sharded, pairs, k=K, slice_size=11)
    pd.testing.assert_frame_equal(actual, expected)


def test_nan_scores_are_skipped():
    """NaN scores are never predicted, and reported."""
    data = umls()
    model = DistMult(triples_factory=data.training, random_seed=0).double()
    with torch.no_grad():
        model.entity_representations[0]._embeddings.weight[:5] = float("nan")
    pairs = query_pairs("tail", 10)
    with pytest.warns(RuntimeWarning, match="NaN scores"):
        frame = predict_top_k(model, pairs, k=200)
    assert not frame["tail_id"].isin(range(5)).any()
    assert len(frame) == 10 * (data.num_entities - 5) - (pairs[:, 0] < 5).sum().item() * (data.num_entities - 5)


def test_a_nan_candidate_leaves_the_top_k_of_the_others():
    """One NaN entity row made the band around the k-th score NaN: every query's top 5 came back empty."""
    data = Nations()
    model = DistMult(triples_factory=data.training, embedding_dim=8, random_seed=0)
    with torch.no_grad():
        model.entity_representations[0]._embeddings.weight[3] = float("nan")
    pairs = torch.tensor([[0, 0], [5, 2], [7, 9]])
    with pytest.warns(RuntimeWarning, match="NaN scores"):
        frame = predict_top_k(model, pairs, k=5)
    assert len(frame) == 15 and not frame["tail_id"].isin([3]).any()
    with torch.no_grad():
        scores = model.score_t(pairs).numpy()
    for query, (_, group) in enumerate(frame.groupby("query")):
        expected = [e for e in np.argsort(-np.nan_to_num(scores[query], nan=-np.inf), kind="stable") if e != 3][:5]
        assert group["tail_id"].tolist() == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target": "relation"}, NotImplementedError, "not supported"),
        ({"target": "middle"}, ValueError, "Invalid target"),
        ({"k": 0}, ValueError, "k must be a positive integer"),
        ({"memory_budget": -1}, ValueError, r"memory_budget \(bytes\) must be a positive integer"),
        ({"batch_size": 0}, ValueError, "batch_size must be a positive integer"),
        ({"slice_size": 2.5}, ValueError, "slice_size must be a positive integer"),
        ({"queries": torch.tensor([[0, 999]])}, ValueError, "relation ids outside"),
        ({"queries": torch.tensor([[999, 0]])}, ValueError, "entity ids outside"),
        ({"queries": torch.empty(0, 2, dtype=torch.long)}, ValueError, "empty"),
        ({"queries": torch.tensor([[0, 1, 2]])}, ValueError, r"shape \[Q, 2\]"),
        ({"queries": [("a", "b")]}, ValueError, "need a triples_factory"),
        ({"filter_triples": torch.tensor([[0, 0, 999]])}, ValueError, "filter_triples"),
    ],
)
def test_bad_input(kwargs, error, match):
    """Clear errors for invalid queries, k and targets."""
    arguments = {"model": model_for("DistMult"), "queries": query_pairs("tail", 2), "k": 3}
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        predict_top_k(**arguments)


def test_pykeen_scores_order_float32_ties():
    """Entities PyKEEN scores equally (equal rows) come by id, with PyKEEN's scores, whatever the slicing.

    In float32 the matrix products score such entities differently in the last bits, differently for every
    slice size; PyKEEN's own scores decide near the k-th score.
    """
    data = Nations()
    model = DistMult(triples_factory=data.training, random_seed=0)
    weight = model.entity_representations[0]._embeddings.weight
    with torch.no_grad():
        weight[12] = weight[1]
        weight[13] = weight[1]
    pairs = torch.cartesian_prod(torch.arange(data.num_entities), torch.arange(data.num_relations))
    expected = brute_force(model, pairs, "tail", 5, None)
    with torch.inference_mode():
        full = model.predict_t(pairs).numpy()
    for num_shards, slice_size in [(1, None), (1, 4), (1, 5), (3, 2)]:
        frame = predict_top_k(model, pairs, k=5, num_shards=num_shards, slice_size=slice_size)
        assert predicted_ids(frame, "tail", len(pairs)) == expected
        np.testing.assert_array_equal(
            frame["score"].to_numpy(), full[frame["query"].to_numpy(), frame["tail_id"].to_numpy()]
        )
    with torch.no_grad():
        weight.fill_(0.5)  # one score for every entity
    for slice_size in (None, 4, 5):
        frame = predict_top_k(model, pairs[:2], k=5, slice_size=slice_size)
        assert predicted_ids(frame, "tail", 2) == [[0, 1, 2, 3, 4]] * 2


def test_pykeen_scores_in_bounded_calls(monkeypatch: pytest.MonkeyPatch):
    """With a tiny bound on PyKEEN's intermediates the pairs are scored in many chunks and slices: the same result."""
    from pykeen_bess.evaluation import counting
    from pykeen_bess.evaluation.counting import pykeen_slice_size

    data = Nations()
    model = DistMult(triples_factory=data.training, embedding_dim=8, random_seed=0)
    with torch.no_grad():
        model.entity_representations[0]._embeddings.weight[5:] = model.entity_representations[0]._embeddings.weight[4]
    pairs = torch.cartesian_prod(torch.arange(data.num_entities), torch.arange(4))
    expected = predict_top_k(model, pairs, k=9)
    monkeypatch.setattr(counting, "PYKEEN_CALL_ELEMENTS", 8 * 5)  # two queries against about three entities
    actual = predict_top_k(model, pairs, k=9)
    pd.testing.assert_frame_equal(actual, expected)
    assert [pykeen_slice_size(n, s) for n, s in [(7, 3), (7, 6), (10, 3), (5, 1), (7, 2), (1, 4)]] == [4, 5, 2, 3, 4, 2]
