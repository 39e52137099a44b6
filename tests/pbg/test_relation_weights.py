"""PyTorch-BigGraph's relation weights: read into the graph schema, written back, and trained with."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
import torch
from pykeen.datasets import Nations
from pykeen.models import DistMult
from pykeen.triples.weights import RelationLossWeighter
from typed_graphs import typed_graph

from pykeen_bess import pbg
from pykeen_bess.pbg import GraphSchema, TypedGraph
from pykeen_bess.pbg.config import load_config
from pykeen_bess.training import BessTrainingLoop

#: loss weights of the typed graph's relations (buys, likes, follows, tagged)
WEIGHTS = (2.0, 0.5, 1.0, 0.0)


def _config(graph: TypedGraph, directory: pathlib.Path, weights=WEIGHTS) -> dict:
    config = pbg.graph_config(graph, dict(dimension=4, operator="diagonal", comparator="dot"), checkpoint_path="c")
    config["entity_path"] = str(directory)
    config["edge_paths"] = [str(directory / name) for name in graph.splits]
    for relation, weight in zip(config["relations"], weights):
        relation["weight"] = weight
    return config


def weighted_graph(
    directory: pathlib.Path, num_partitions: int = 1, create_inverse_triples: bool = False
) -> TypedGraph:
    """The typed graph written as PyTorch-BigGraph files and read with a config that weighs its relations."""
    graph = typed_graph(num_partitions)
    pbg.write(graph, directory)
    return pbg.read(directory, config=_config(graph, directory), create_inverse_triples=create_inverse_triples)


def test_weights_are_read_written_and_kept(tmp_path: pathlib.Path) -> None:
    graph = weighted_graph(tmp_path / "a", num_partitions=2)
    assert graph.schema.relation_weights == WEIGHTS and graph.schema.weighted
    assert "weighted" in repr(graph.schema)
    assert graph.repartition(3, seed=1).schema.relation_weights == WEIGHTS
    pbg.write(graph, tmp_path / "b", config=dict(dimension=4, operator="diagonal", comparator="dot"))
    written = load_config(tmp_path / "b" / "config.json")
    assert [r["weight"] for r in written["relations"]] == list(WEIGHTS)
    assert pbg.read(tmp_path / "b").schema.relation_weights == WEIGHTS
    # unit weights are no weights
    plain = typed_graph()
    assert plain.schema.relation_weights == () and not plain.schema.weighted and plain.loss_weighter() is None
    assert [r["weight"] for r in _config(plain, tmp_path, weights=())["relations"]] == [1.0] * 4


def test_tsv_import_reads_the_weights(tmp_path: pathlib.Path) -> None:
    graph = typed_graph()
    path = tmp_path / "edges.tsv"
    labels = graph.training.label_triples(graph.training.mapped_triples)
    np.savetxt(path, labels, fmt="%s", delimiter="\t")
    imported = pbg.import_tsv(path, config=_config(graph, tmp_path))
    assert imported.schema.relation_weights == WEIGHTS


def test_dynamic_relations_share_one_weight(tmp_path: pathlib.Path) -> None:
    graph = TypedGraph.from_factories(Nations().training)
    assert graph.schema.dynamic_relations
    config = _config(graph, tmp_path, weights=(3.0,))
    assert len(config["relations"]) == 1
    pbg.write(graph, tmp_path)
    again = pbg.read(tmp_path, config=config)
    assert again.schema.relation_weights == (3.0,) * graph.schema.num_relations
    mixed = dataclasses.replace(graph.schema, relation_weights=(2.0,) + (1.0,) * (graph.schema.num_relations - 1))
    with pytest.raises(ValueError, match="dynamic relations share one loss weight"):
        pbg.graph_config(mixed, dict(dimension=4), checkpoint_path="c")


@pytest.mark.parametrize(
    ("weights", "message"),
    [((-1.0, 1.0, 1.0, 1.0), "finite, non-negative"), (("x", 1, 1, 1), "finite, non-negative"), ((0, 0, 0, 0), "0")],
)
def test_invalid_weights_are_refused(tmp_path: pathlib.Path, weights, message) -> None:
    graph = typed_graph()
    pbg.write(graph, tmp_path)
    with pytest.raises(ValueError, match=message):
        pbg.read(tmp_path, config=_config(graph, tmp_path, weights=weights))
    with pytest.raises(ValueError, match="relation weights"):
        dataclasses.replace(graph.schema, relation_weights=(1.0, 1.0))


def test_inverse_relations_weigh_what_their_relation_weighs(tmp_path: pathlib.Path) -> None:
    graph = weighted_graph(tmp_path, create_inverse_triples=True)
    factory = graph.training
    table = graph.schema.relation_weight_tensor(factory)
    assert table.shape == (2 * len(WEIGHTS),)
    forward = factory.relation_inverter.map(batch=torch.arange(4).view(-1, 1).repeat(1, 3))[:, 1]
    inverse = factory.relation_inverter.map(batch=torch.arange(4).view(-1, 1).repeat(1, 3), invert=True)[:, 1]
    assert table[forward].tolist() == list(WEIGHTS) and table[inverse].tolist() == list(WEIGHTS)
    weighter = graph.loss_weighter()
    assert isinstance(weighter, RelationLossWeighter) and torch.equal(weighter.weights, table.float())


def _train(factory, n_shard: int, **kwargs) -> tuple[list[float], torch.Tensor]:
    model = DistMult(triples_factory=factory, embedding_dim=8, loss="softplus", random_seed=1)
    loop = BessTrainingLoop(
        model=model,
        triples_factory=factory,
        num_shards=n_shard,
        num_negs_per_pos=2 * n_shard,
        seed=3,
        automatic_memory_optimization=False,
        **kwargs,
    )
    losses = loop.train(factory, num_epochs=2, batch_size=32, use_tqdm=False)
    return losses, model.entity_representations[0]().detach().clone()


@pytest.mark.parametrize("n_shard", [1, 2])
@pytest.mark.parametrize("create_inverse_triples", [False, True])
def test_the_loop_trains_with_the_graph_weights(tmp_path: pathlib.Path, n_shard: int, create_inverse_triples: bool):
    """A weighted graph trains as the same graph without weights given the weights as PyKEEN's weighter."""
    graph = weighted_graph(tmp_path, num_partitions=n_shard, create_inverse_triples=create_inverse_triples)
    unweighted_schema: GraphSchema = dataclasses.replace(graph.schema, relation_weights=())
    unweighted = TypedGraph.from_triples(
        unweighted_schema,
        {"training": graph.training.mapped_triples},
        entity_labels=graph.entity_labels(),
        create_inverse_triples=create_inverse_triples,
    )
    automatic = _train(graph.training, n_shard)
    explicit = _train(unweighted.training, n_shard, loss_weighter=graph.loss_weighter())
    plain = _train(unweighted.training, n_shard)
    torch.testing.assert_close(automatic[0], explicit[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(automatic[1], explicit[1], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(automatic[1], plain[1])
    # an explicit weighter wins over the graph's weights
    uniform = RelationLossWeighter(weights=torch.ones(graph.training.num_relations))
    torch.testing.assert_close(_train(graph.training, n_shard, loss_weighter=uniform)[1], plain[1])


def test_a_loss_without_weights_is_refused_when_the_loop_is_built(tmp_path: pathlib.Path) -> None:
    graph = weighted_graph(tmp_path)
    model = DistMult(triples_factory=graph.training, embedding_dim=8, loss="marginranking")
    with pytest.raises(ValueError, match="loss weights .* but the loss MarginRankingLoss does not support"):
        BessTrainingLoop(model=model, triples_factory=graph.training, automatic_memory_optimization=False)
