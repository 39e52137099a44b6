"""The typed graph: entity types, partitions and relation types (PyTorch-BigGraph's data model) over PyKEEN ids.

Every entity has one *entity type*; the entities of a type are split into *partitions*; every
relation has a left-hand (head) and a right-hand (tail) entity type. PyKEEN has no types, so a
:class:`GraphSchema` travels with PyKEEN's own triples factories, in their ``metadata`` (key
``"graph_schema"``, :func:`schema_of`), and the ids are PyKEEN's: there is no second id system.
The global entity ids are laid out type by type, partition by partition::

    id = type_offset[type] + partition_offset[type][partition] + index within the partition

so the rows of partition ``p`` of type ``t`` are one contiguous id range, the rows of
PyTorch-BigGraph's ``embeddings_{t}_{p}`` file in order. Relation ids are PyKEEN's relation ids
(the relations of a PyTorch-BigGraph config, or its dynamic relations, in order).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..data.sharding import TypedSharding

__all__ = [
    "SCHEMA_KEY",
    "GraphSchema",
    "schema_of",
]

#: the key of the schema in a triples factory's ``metadata``
SCHEMA_KEY = "graph_schema"


@dataclasses.dataclass(frozen=True, eq=False)
class GraphSchema:
    """Entity types with their partitions, and the head / tail type of every relation."""

    #: the names of the entity types, in id order
    entity_types: tuple[str, ...]
    #: per type, the number of entities of each of its partitions (one partition: unpartitioned)
    partition_sizes: tuple[tuple[int, ...], ...]
    #: the relation names, by relation id
    relation_names: tuple[str, ...]
    #: per relation, the index of its head (left-hand side) type
    relation_lhs: tuple[int, ...]
    #: per relation, the index of its tail (right-hand side) type
    relation_rhs: tuple[int, ...]
    #: PyTorch-BigGraph's dynamic relations: every relation shares one schema entry (one head and one tail type)
    dynamic_relations: bool = False
    #: whether entity labels are ``"{type}:{name}"`` (names repeat across types) instead of the names
    qualified_labels: bool = False
    #: per relation, PyTorch-BigGraph's loss ``weight`` (empty: every relation weighs 1)
    relation_weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        """Check the schema's consistency (types, partitions, relations)."""
        if not self.entity_types:
            raise ValueError("A graph schema needs at least one entity type.")
        if len(set(self.entity_types)) != len(self.entity_types):
            raise ValueError(f"Entity types must be unique: {list(self.entity_types)}.")
        if len(self.partition_sizes) != len(self.entity_types):
            raise ValueError(f"{len(self.partition_sizes)} partition lists for {len(self.entity_types)} entity types.")
        for name, sizes in zip(self.entity_types, self.partition_sizes):
            if not sizes or any(size < 0 for size in sizes):
                raise ValueError(f"Entity type {name!r} has invalid partition sizes {list(sizes)}.")
        partitioned = {len(sizes) for sizes in self.partition_sizes if len(sizes) > 1}
        if len(partitioned) > 1:
            raise ValueError(
                f"All partitioned entity types must have the same number of partitions (PyTorch-BigGraph's rule), "
                f"not {sorted(partitioned)}: "
                + ", ".join(f"{t}: {len(s)}" for t, s in zip(self.entity_types, self.partition_sizes))
            )
        if not len(self.relation_names) == len(self.relation_lhs) == len(self.relation_rhs):
            raise ValueError("relation_names, relation_lhs and relation_rhs must have the same length.")
        if len(set(self.relation_names)) != len(self.relation_names):
            raise ValueError("Relation names must be unique.")
        for side in (self.relation_lhs, self.relation_rhs):
            bad = [t for t in side if not 0 <= t < len(self.entity_types)]
            if bad:
                raise ValueError(f"Relations refer to entity type indices {bad[:5]} outside the schema.")
        if self.relation_weights:
            if len(self.relation_weights) != len(self.relation_names):
                raise ValueError(
                    f"{len(self.relation_weights)} relation weights for {len(self.relation_names)} relations."
                )
            weights = torch.tensor(self.relation_weights, dtype=torch.float64)
            if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()) or not bool((weights > 0).any()):
                raise ValueError(
                    f"Relation weights must be finite and non-negative, not all 0: {list(self.relation_weights)[:10]}."
                )
        if self.dynamic_relations and (len(set(self.relation_lhs)) > 1 or len(set(self.relation_rhs)) > 1):
            raise ValueError("With dynamic relations every relation has the same head type and the same tail type.")

    # -- sizes and layout --------------------------------------------------------------------------

    @property
    def num_types(self) -> int:
        """The number of entity types."""
        return len(self.entity_types)

    @property
    def num_relations(self) -> int:
        """The number of relations."""
        return len(self.relation_names)

    @functools.cached_property
    def num_entities(self) -> int:
        """The number of entities of all types."""
        return sum(sum(sizes) for sizes in self.partition_sizes)

    @property
    def num_partitions(self) -> int:
        """The number of partitions of the partitioned types (1 if no type is partitioned)."""
        return max(len(sizes) for sizes in self.partition_sizes)

    @functools.cached_property
    def type_offsets(self) -> tuple[int, ...]:
        """The first global id of every type, and the number of entities last (``T + 1`` values)."""
        offsets = [0]
        for sizes in self.partition_sizes:
            offsets.append(offsets[-1] + sum(sizes))
        return tuple(offsets)

    def type_index(self, name: str) -> int:
        """Return the index of an entity type by name."""
        try:
            return self.entity_types.index(name)
        except ValueError:
            raise KeyError(f"Unknown entity type {name!r}; the types are {list(self.entity_types)}.") from None

    def partition_range(self, entity_type: int, partition: int) -> range:
        """Return the global ids of one partition of one type."""
        sizes = self.partition_sizes[entity_type]
        start = self.type_offsets[entity_type] + sum(sizes[:partition])
        return range(start, start + sizes[partition])

    @functools.cached_property
    def entity_type(self) -> torch.Tensor:
        """shape: ``[N]``, the type index of every entity."""
        counts = torch.tensor([sum(sizes) for sizes in self.partition_sizes])
        return torch.repeat_interleave(torch.arange(self.num_types), counts)

    @functools.cached_property
    def entity_partition(self) -> torch.Tensor:
        """shape: ``[N]``, the partition of every entity within its type."""
        sizes = torch.tensor([size for sizes in self.partition_sizes for size in sizes])
        partitions = torch.cat([torch.arange(len(sizes)) for sizes in self.partition_sizes])
        return torch.repeat_interleave(partitions, sizes)

    @functools.cached_property
    def entity_offset(self) -> torch.Tensor:
        """shape: ``[N]``, the index of every entity within its partition."""
        starts = [r.start for t, sizes in enumerate(self.partition_sizes) for r in self._ranges(t)]
        sizes = torch.tensor([size for sizes in self.partition_sizes for size in sizes])
        return torch.arange(self.num_entities) - torch.repeat_interleave(torch.tensor(starts, dtype=torch.long), sizes)

    def _ranges(self, entity_type: int) -> list[range]:
        return [self.partition_range(entity_type, p) for p in range(len(self.partition_sizes[entity_type]))]

    def sharding_strategy(self) -> TypedSharding:
        """Return the sharding of this graph: every shard an equal share of every type (see :class:`TypedSharding`)."""
        return TypedSharding(
            entity_types=self.entity_type,
            entity_partitions=self.entity_partition,
            type_partitions=tuple(len(sizes) for sizes in self.partition_sizes),
        )

    # -- relations ---------------------------------------------------------------------------------

    def relation_sides(self, factory: Any = None) -> torch.Tensor:
        """Return the head and tail type of every relation id a factory trains, ``[R', 2]``.

        With inverse triples (``factory.create_inverse_triples``) PyKEEN's relation ids change and
        the inverse of a relation swaps its types; the factory's own inverter maps them.
        """
        sides = torch.stack(
            [torch.tensor(self.relation_lhs), torch.arange(self.num_relations), torch.tensor(self.relation_rhs)], dim=1
        ).long()
        if factory is not None:
            sides = factory._add_inverse_triples_if_necessary(sides)
            table = torch.full((int(sides[:, 1].max()) + 1, 2), -1, dtype=torch.long)
            table[sides[:, 1]] = sides[:, [0, 2]]
            return table
        return sides[:, [0, 2]]

    @property
    def weighted(self) -> bool:
        """Whether some relation has a loss weight other than 1."""
        return any(float(weight) != 1.0 for weight in self.relation_weights)

    def relation_weight_tensor(self, factory: Any = None) -> torch.Tensor:
        """Return the loss weight of every relation id a factory trains, ``[R']`` (float64).

        An inverse relation (``factory.create_inverse_triples``) weighs what its forward relation
        weighs, as PyTorch-BigGraph weighs both sides' losses of an edge alike.
        """
        weights = torch.tensor(self.relation_weights or (1.0,) * self.num_relations, dtype=torch.float64)
        if factory is None:
            return weights
        relations = torch.arange(self.num_relations).repeat_interleave(3).view(-1, 3)
        relations = factory._add_inverse_triples_if_necessary(relations)
        table = torch.ones(int(relations[:, 1].max()) + 1, dtype=torch.float64)
        table[relations[:, 1]] = weights[relations[:, 0]]
        return table

    def check_triples(self, mapped_triples: torch.Tensor, source: str = "the triples") -> None:
        """Check that every triple's head and tail have its relation's types.

        :raises ValueError: naming the source, the offending relations and a few triples
        """
        if mapped_triples.numel() == 0:
            return
        mapped_triples = mapped_triples.long()
        heads, relations, tails = mapped_triples.unbind(1)
        if int(relations.min()) < 0 or int(relations.max()) >= self.num_relations:
            raise ValueError(f"{source} use relation ids outside [0, {self.num_relations}).")
        for side, ids in (("head", heads), ("tail", tails)):
            if int(ids.min()) < 0 or int(ids.max()) >= self.num_entities:
                raise ValueError(f"{source} use {side} ids outside [0, {self.num_entities}).")
        if self.num_types == 1:
            return  # every entity has the only type
        lhs, rhs = torch.tensor(self.relation_lhs), torch.tensor(self.relation_rhs)
        types = self.entity_type
        wrong = (types[heads] != lhs[relations]) | (types[tails] != rhs[relations])
        if bool(wrong.any()):
            bad = mapped_triples[wrong]
            names = sorted({self.relation_names[r] for r in bad[:, 1].unique().tolist()})
            examples = "; ".join(
                f"({self.entity_types[types[h]]} {h}, {self.relation_names[r]}, {self.entity_types[types[t]]} {t})"
                for h, r, t in bad[:3].tolist()
            )
            raise ValueError(
                f"{source}: {int(wrong.sum())} triples violate their relation's entity types (relations "
                f"{names[:5]}); e.g. {examples}. Each relation's heads must have its lhs type and its tails its rhs "
                f"type: "
                + ", ".join(
                    f"{self.relation_names[r]}: {self.entity_types[self.relation_lhs[r]]} -> "
                    f"{self.entity_types[self.relation_rhs[r]]}"
                    for r in bad[:, 1].unique()[:5].tolist()
                )
            )

    # -- labels ------------------------------------------------------------------------------------

    def label(self, entity_type: int, name: str) -> str:
        """Return the PyKEEN label of an entity (its name, or ``"{type}:{name}"`` if names repeat across types)."""
        return f"{self.entity_types[entity_type]}:{name}" if self.qualified_labels else name

    def name_of(self, entity_type: int, label: str) -> str:
        """Return the name of an entity of ``entity_type`` from its PyKEEN label (the inverse of :meth:`label`).

        The type's own prefix is removed (a type name may contain ``":"`` itself).

        :raises ValueError: if a qualified label does not start with the type's name
        """
        if not self.qualified_labels:
            return label
        prefix = f"{self.entity_types[entity_type]}:"
        if not label.startswith(prefix):
            raise ValueError(f"The label {label!r} is not of an entity of type {self.entity_types[entity_type]!r}.")
        return label[len(prefix) :]

    # -- changes -----------------------------------------------------------------------------------

    def with_partitions(self, partition_sizes: Sequence[Sequence[int]]) -> GraphSchema:
        """Return the same schema with other partitions."""
        return dataclasses.replace(
            self, partition_sizes=tuple(tuple(int(s) for s in sizes) for sizes in partition_sizes)
        )

    def __repr__(self) -> str:
        """Return a short description (the schema is printed with its factory)."""
        types = ", ".join(
            f"{name}: {sum(sizes):,} in {len(sizes)} partition{'s' if len(sizes) > 1 else ''}"
            for name, sizes in zip(self.entity_types, self.partition_sizes)
        )
        mode = "dynamic " if self.dynamic_relations else ""
        weighted = ", weighted" if self.weighted else ""
        return f"GraphSchema({types}; {self.num_relations} {mode}relations{weighted})"


def schema_of(factory: Any) -> GraphSchema | None:
    """Return the graph schema a triples factory carries in its metadata (None for an untyped factory).

    :param factory: a PyKEEN triples factory (a typed graph's split carries the schema)
    :raises ValueError: if the schema does not describe the factory's entities and relations
    """
    metadata = getattr(factory, "metadata", None) or {}
    schema = metadata.get(SCHEMA_KEY)
    if schema is None:
        return None
    if not isinstance(schema, GraphSchema):
        raise TypeError(
            f"metadata[{SCHEMA_KEY!r}] of the triples factory is a {type(schema).__name__}, not a GraphSchema."
        )
    if schema.num_entities != factory.num_entities or schema.num_relations != factory.real_num_relations:
        raise ValueError(
            f"The factory's graph schema describes {schema.num_entities} entities and {schema.num_relations} "
            f"relations, "
            f"the factory has {factory.num_entities} and {factory.real_num_relations}: it no longer fits the factory."
        )
    return schema
