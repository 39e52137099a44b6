"""The typed graph's schema and the type-stratified sharding."""

from __future__ import annotations

import pytest
import torch
from typed_graphs import TYPES, typed_graph
from pykeen.datasets import Nations

from pykeen_bess.pbg import GraphSchema, TypedGraph, schema_of
from pykeen_bess.data.sharding import EntitySharding, RandomSharding, TypedSharding


def test_ids_are_laid_out_type_by_type_partition_by_partition() -> None:
    graph = typed_graph(num_partitions=3)
    schema = graph.schema
    assert schema.num_entities == sum(size for _, size in TYPES) == graph.training.num_entities
    assert [sum(sizes) for sizes in schema.partition_sizes] == [size for _, size in TYPES]
    # PyTorch-BigGraph's importer: partition boundaries ceil(p * N / P)
    assert schema.partition_sizes[0] == (10, 10, 10) and schema.partition_sizes[2] == (3, 2, 2)
    expected = 0
    for t in range(schema.num_types):
        for p in range(3):
            ids = schema.partition_range(t, p)
            assert ids.start == expected
            assert bool((schema.entity_type[ids.start : ids.stop] == t).all())
            assert bool((schema.entity_partition[ids.start : ids.stop] == p).all())
            assert schema.entity_offset[ids.start : ids.stop].tolist() == list(range(len(ids)))
            expected = ids.stop
    # every factory of the graph carries the schema; the triples respect the relations' types
    for factory in graph.splits.values():
        assert schema_of(factory) is schema
        schema.check_triples(factory.mapped_triples)


def test_repartitioning_keeps_the_labeled_triples() -> None:
    graph = typed_graph()
    again = graph.repartition(3, seed=4)
    for name, factory in graph.splits.items():
        a = sorted(map(tuple, factory.label_triples(factory.mapped_triples).tolist()))
        b = sorted(map(tuple, again.splits[name].label_triples(again.splits[name].mapped_triples).tolist()))
        assert a == b
    assert again.schema.num_partitions == 3
    # partitions hold random entities (seeded)
    assert again.entity_labels() != graph.entity_labels()
    assert graph.repartition(3, seed=4).entity_labels() == again.entity_labels()


def test_relation_types_are_checked_on_every_triple() -> None:
    graph = typed_graph()
    triples = graph.training.mapped_triples.clone()
    buys = graph.schema.relation_names.index("buys")
    row = int((triples[:, 1] == buys).nonzero()[0])
    triples[row, 2] = 0  # a user as the tail of "buys" (user -> item)
    with pytest.raises(ValueError, match="violate their relation's entity types.*buys.*buys: user -> item"):
        TypedGraph.from_triples(graph.schema, {"training": triples}, entity_labels=graph.entity_labels())


def test_schema_rejects_inconsistent_definitions() -> None:
    with pytest.raises(ValueError, match="same number of partitions"):
        GraphSchema(("a", "b"), ((1, 2), (1, 1, 1)), ("r",), (0,), (1,))
    with pytest.raises(ValueError, match="unique"):
        GraphSchema(("a", "a"), ((1,), (1,)), ("r",), (0,), (1,))
    with pytest.raises(ValueError, match="outside the schema"):
        GraphSchema(("a",), ((3,),), ("r",), (0,), (1,))
    with pytest.raises(ValueError, match="same head type"):
        GraphSchema(("a", "b"), ((1,), (1,)), ("r", "s"), (0, 1), (1, 1), dynamic_relations=True)


def test_a_changed_factory_no_longer_fits_its_schema() -> None:
    graph = typed_graph()
    factory = graph.training
    factory.num_entities += 1
    with pytest.raises(ValueError, match="no longer fits"):
        schema_of(factory)


def test_inverse_relations_swap_their_types() -> None:
    graph = typed_graph(create_inverse_triples=True)
    schema = graph.schema
    sides = schema.relation_sides(graph.training)
    assert sides.shape == (2 * schema.num_relations, 2)
    for relation in range(schema.num_relations):
        assert sides[2 * relation].tolist() == [schema.relation_lhs[relation], schema.relation_rhs[relation]]
        assert sides[2 * relation + 1].tolist() == [schema.relation_rhs[relation], schema.relation_lhs[relation]]


def test_untyped_factories_get_one_type_and_dynamic_relations() -> None:
    dataset = Nations()
    graph = TypedGraph.from_factories(dataset.training, dataset.validation, dataset.testing)
    assert graph.schema.entity_types == ("entity",) and graph.schema.dynamic_relations
    assert graph.training.entity_to_id == dataset.training.entity_to_id  # one partition: the ids stay
    assert torch.equal(graph.testing.mapped_triples, dataset.testing.mapped_triples)
    partitioned = TypedGraph.from_factories(dataset.training, dataset.validation, dataset.testing, num_partitions=3)
    assert partitioned.schema.partition_sizes == ((5, 5, 4),)


# -- the sharding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n_shard", [1, 2, 3, 4, 7])
def test_typed_sharding_gives_every_shard_an_equal_share_of_every_type(n_shard: int) -> None:
    graph = typed_graph()
    schema = graph.schema
    sharding = EntitySharding.create(schema.num_entities, n_shard, seed=3, strategy=schema.sharding_strategy())
    real = sharding.padding_mask()
    row_types = torch.where(real, schema.entity_type[sharding.shard_entities.clamp_min(0)], -1)
    for t, (_, size) in enumerate(TYPES):
        counts = (row_types == t).sum(dim=1)
        assert int(counts.sum()) == size
        assert int(counts.max() - counts.min()) <= 1  # stratified
    totals = sharding.shard_counts
    assert int(totals.max() - totals.min()) <= 1  # and balanced over all types
    # real rows first, grouped type by type
    for shard in range(n_shard):
        types = row_types[shard, : int(totals[shard])]
        assert bool((types[1:] >= types[:-1]).all())
        assert bool((row_types[shard, int(totals[shard]) :] == -1).all())
    # seeded, and rebuilt alike for another number of shards (resharding a checkpoint)
    again = EntitySharding.create(schema.num_entities, n_shard, seed=3, strategy=schema.sharding_strategy())
    assert torch.equal(again.shard_entities, sharding.shard_entities)
    assert torch.equal(sharding.with_shards(2).shard_entities, again.with_shards(2).shard_entities)


def test_with_as_many_shards_as_partitions_shard_k_is_partition_k() -> None:
    graph = typed_graph(num_partitions=3)
    schema = graph.schema
    sharding = EntitySharding.create(schema.num_entities, 3, seed=0, strategy=schema.sharding_strategy())
    for shard in range(3):
        expected = torch.cat(
            [torch.arange(r.start, r.stop) for r in (schema.partition_range(t, shard) for t in range(3))]
        )
        assert torch.equal(sharding.shard_entities[shard, : int(sharding.shard_counts[shard])], expected)
    assert "stratified by 3 entity types" in sharding.describe()


def test_random_sharding_is_unchanged() -> None:
    """The default strategy deals a seeded permutation exactly as before strategies existed."""
    sharding = EntitySharding.create(100, 7, seed=3)
    permutation = torch.randperm(100, generator=torch.Generator().manual_seed(3))
    expected = torch.full((15 * 7,), -1, dtype=torch.long)
    expected[:100] = permutation
    assert torch.equal(sharding.shard_entities, expected.view(15, 7).t())
    assert isinstance(sharding.strategy, RandomSharding)


def test_typed_sharding_refuses_types_of_another_graph() -> None:
    with pytest.raises(ValueError, match="describe 3 entities"):
        EntitySharding.create(4, 2, strategy=TypedSharding(torch.tensor([0, 0, 1])))


def test_type_names_with_colons_keep_their_entity_names(tmp_path) -> None:
    """Names repeated across types are labelled ``type:name``; a type's own ``:`` stays in the type, not the name."""
    import json

    from pbg_tools import import_one_relation

    from pykeen_bess import pbg

    lines = "n1\tlikes\tn1\nn2\tlikes\tn1\n"
    graph, config = import_one_relation(tmp_path / "likes.tsv", lines, "ns:user", "likes", "item", num_partitions=1)
    assert graph.training.entity_to_id == {"ns:user:n1": 0, "ns:user:n2": 1, "item:n1": 2}
    pbg.write(graph, tmp_path / "data")
    assert json.loads((tmp_path / "data" / "entity_names_ns:user_0.json").read_text()) == ["n1", "n2"]
    assert json.loads((tmp_path / "data" / "entity_names_item_0.json").read_text()) == ["n1"]
    again = pbg.read(
        tmp_path / "data",
        config=dict(
            config,
            entity_path=str(tmp_path / "data"),
            edge_paths=[str(tmp_path / "data" / "training")],
            checkpoint_path=str(tmp_path / "checkpoints"),
        ),
    )
    assert again.training.entity_to_id == graph.training.entity_to_id
    with pytest.raises(ValueError, match="not of an entity of type 'item'"):
        graph.schema.name_of(1, "ns:user:n1")
