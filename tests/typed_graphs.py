"""Small generated typed graphs (PyTorch-BigGraph's data model) for the tests."""

from __future__ import annotations

import torch

from pykeen_bess.pbg import GraphSchema, TypedGraph

#: entity types and their sizes
TYPES = (("user", 30), ("item", 20), ("tag", 7))
#: relations: name, head type, tail type
RELATIONS = (("buys", 0, 1), ("likes", 0, 1), ("follows", 0, 0), ("tagged", 1, 2))


def typed_graph(
    num_partitions: int = 1,
    seed: int = 0,
    num_triples: int = 400,
    repeated_names: bool = False,
    create_inverse_triples: bool = False,
) -> TypedGraph:
    """A typed graph of three entity types and four relations, with training, validation and testing triples.

    :param num_partitions: every type's partitions
    :param seed: the seed of the triples and the partitions
    :param num_triples: triples drawn (before removing duplicates), spread over the relations
    :param repeated_names: give the item and tag types the same names (labels become ``type:name``)
    :param create_inverse_triples: PyKEEN's inverse triples
    """
    generator = torch.Generator().manual_seed(seed)
    schema = GraphSchema(
        entity_types=tuple(name for name, _ in TYPES),
        partition_sizes=tuple((size,) for _, size in TYPES),
        relation_names=tuple(name for name, _, _ in RELATIONS),
        relation_lhs=tuple(lhs for _, lhs, _ in RELATIONS),
        relation_rhs=tuple(rhs for _, _, rhs in RELATIONS),
        qualified_labels=repeated_names,
    )
    offsets = schema.type_offsets
    parts = []
    for relation, (_, lhs, rhs) in enumerate(RELATIONS):
        count = num_triples // len(RELATIONS)
        heads = torch.randint(TYPES[lhs][1], (count,), generator=generator) + offsets[lhs]
        tails = torch.randint(TYPES[rhs][1], (count,), generator=generator) + offsets[rhs]
        parts.append(torch.stack([heads, torch.full_like(heads, relation), tails], dim=1))
    triples = torch.cat(parts).unique(dim=0)
    triples = triples[torch.randperm(triples.shape[0], generator=generator)]
    names = [
        f"{'x' if repeated_names and t else name[0]}{i}" for t, (name, size) in enumerate(TYPES) for i in range(size)
    ]
    labels = [schema.label(int(t), n) for t, n in zip(schema.entity_type.tolist(), names)]
    held = max(1, triples.shape[0] // 10)
    graph = TypedGraph.from_triples(
        schema,
        {"training": triples[2 * held :], "validation": triples[held : 2 * held], "testing": triples[:held]},
        entity_labels=labels,
        create_inverse_triples=create_inverse_triples,
    )
    return graph.repartition(num_partitions, seed=seed) if num_partitions > 1 else graph


def labeled(factory) -> list[tuple[str, str, str]]:
    """The triples of a factory by labels, sorted (comparable across id systems)."""
    return sorted(map(tuple, factory.label_triples(factory.mapped_triples).tolist()))
