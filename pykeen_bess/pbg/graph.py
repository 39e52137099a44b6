"""A typed graph: PyKEEN triples factories (training, validation, testing) with one graph schema.

:class:`TypedGraph` holds the splits; :meth:`TypedGraph.from_triples` builds them from global-id
triples (checked against the schema), :meth:`TypedGraph.from_factories` types PyKEEN's own factories
(one entity type, dynamic relations) and :meth:`TypedGraph.repartition` splits every type into a
number of partitions. Reading and writing PyTorch-BigGraph's input directories is
:mod:`~pykeen_bess.pbg.inputs`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from pykeen.triples import CoreTriplesFactory, TriplesFactory
from pykeen.triples.weights import RelationLossWeighter

from .schema import SCHEMA_KEY, GraphSchema, schema_of

__all__ = [
    "DEFAULT_TYPE",
    "EDGE_PATH_KEY",
    "SPLITS",
    "TypedGraph",
    "as_typed_graph",
]

logger = logging.getLogger(__name__)

#: the splits of a graph, in the order PyTorch-BigGraph configs usually list their edge paths
SPLITS = ("training", "validation", "testing")
#: the entity type of an untyped PyKEEN graph
DEFAULT_TYPE = "entity"
#: the metadata key of a factory's PyTorch-BigGraph edge path (where it was read from or written to)
EDGE_PATH_KEY = "pbg_edge_path"


@dataclasses.dataclass
class TypedGraph:
    """The splits of a graph as PyKEEN triples factories that carry one :class:`GraphSchema`.

    Use the factories as PyKEEN's (``pipeline(training=graph.training, testing=graph.testing, ...)``);
    the BESS training loop reads the schema from the training factory (type-stratified shards, typed
    negatives, PyTorch-BigGraph checkpoints).
    """

    schema: GraphSchema
    #: the training triples (a ``TriplesFactory`` if the entities have names, else a ``CoreTriplesFactory``)
    training: CoreTriplesFactory
    validation: CoreTriplesFactory | None = None
    testing: CoreTriplesFactory | None = None
    #: the PyTorch-BigGraph config the graph was read with (normalised), if any
    config: dict[str, Any] | None = None
    #: where the graph's PyTorch-BigGraph files are (read from or written to): the entity path and
    #: one edge path per split
    entity_path: pathlib.Path | None = None
    edge_paths: dict[str, pathlib.Path] = dataclasses.field(default_factory=dict)

    @property
    def splits(self) -> dict[str, CoreTriplesFactory]:
        """The factories of the splits present, by name."""
        return {name: factory for name in SPLITS if (factory := getattr(self, name)) is not None}

    def record_paths(self) -> None:
        """Note every split's edge path in its factory's metadata (where a PBG checkpoint's config points)."""
        for name, factory in self.splits.items():
            if name in self.edge_paths:
                factory.metadata = {**factory.metadata, EDGE_PATH_KEY: str(self.edge_paths[name])}

    def dataset(self) -> Any:
        """Return the graph as a PyKEEN dataset (``pipeline(dataset=graph.dataset())``).

        :raises ValueError: without testing triples
        """
        from pykeen.datasets import EagerDataset

        if self.testing is None:
            raise ValueError("A PyKEEN dataset needs testing triples; this graph has none.")
        return EagerDataset(training=self.training, testing=self.testing, validation=self.validation)

    def loss_weighter(self) -> RelationLossWeighter | None:
        """Return the relations' loss weights (PyTorch-BigGraph's ``weight``) as PyKEEN's loss weighter.

        The BESS loop applies them by itself; pass this to another training loop
        (``training_loop_kwargs=dict(loss_weighter=graph.loss_weighter())``). The weights are indexed by
        the relation ids the training factory trains (an inverse relation weighs what its relation does).

        :returns: None if every relation weighs 1
        """
        if not self.schema.weighted:
            return None
        weights = self.schema.relation_weight_tensor(self.training).to(torch.get_default_dtype())
        return RelationLossWeighter(weights=weights)

    def entity_labels(self) -> list[str] | None:
        """Return the label of every entity in id order (None without names)."""
        return _labels(self.training)

    def names(self, entity_type: int, partition: int, labels: Sequence[str] | None = None) -> list[str] | None:
        """Return the names of one partition of one type (None without names)."""
        labels = self.entity_labels() if labels is None else labels
        if labels is None:
            return None
        ids = self.schema.partition_range(entity_type, partition)
        return [self.schema.name_of(entity_type, labels[i]) for i in ids]

    # -- constructors and changes --------------------------------------------------------------

    @classmethod
    def from_triples(
        cls,
        schema: GraphSchema,
        splits: Mapping[str, torch.Tensor],
        entity_labels: Sequence[str] | None = None,
        create_inverse_triples: bool = False,
        **kwargs: Any,
    ) -> TypedGraph:
        """Build the factories of id-based splits (global ids of the schema's layout), checked against the schema.

        :param schema: the graph schema
        :param splits: split name (``"training"``, ``"validation"``, ``"testing"``) -> ``[T, 3]`` triples
        :param entity_labels: the label of every entity in id order (None: factories without labels)
        :param create_inverse_triples: PyKEEN's inverse triples
        :param kwargs: the other fields of the graph (config, paths)
        :raises ValueError: if a triple violates its relation's types, or a split name is unknown
        """
        unknown = sorted(set(splits) - set(SPLITS))
        if unknown:
            raise ValueError(f"Unknown splits {unknown}; the splits are {list(SPLITS)}.")
        if "training" not in splits:
            raise ValueError("A typed graph needs training triples.")
        for name, triples in splits.items():
            schema.check_triples(triples, source=str(kwargs.get("edge_paths", {}).get(name, f"the {name} triples")))
        metadata = {SCHEMA_KEY: schema}
        training: CoreTriplesFactory
        if entity_labels is not None:
            if len(entity_labels) != schema.num_entities:
                raise ValueError(f"{len(entity_labels)} entity labels for {schema.num_entities} entities.")
            entity_to_id = {label: index for index, label in enumerate(entity_labels)}
            if len(entity_to_id) != schema.num_entities:
                raise ValueError("Entity labels must be unique (use qualified labels when names repeat across types).")
            relation_to_id = {name: index for index, name in enumerate(schema.relation_names)}
            training = TriplesFactory(
                mapped_triples=splits["training"],
                entity_to_id=entity_to_id,
                relation_to_id=relation_to_id,
                create_inverse_triples=create_inverse_triples,
                metadata=metadata,
            )
        else:
            training = CoreTriplesFactory(
                mapped_triples=splits["training"],
                num_entities=schema.num_entities,
                num_relations=schema.num_relations,
                create_inverse_triples=create_inverse_triples,
                metadata=metadata,
            )
        others = {name: _with_triples(training, triples) for name, triples in splits.items() if name != "training"}
        graph = cls(
            schema=schema,
            training=training,
            validation=others.get("validation"),
            testing=others.get("testing"),
            **kwargs,
        )
        graph.record_paths()
        return graph

    @classmethod
    def from_factories(
        cls,
        training: CoreTriplesFactory,
        validation: CoreTriplesFactory | None = None,
        testing: CoreTriplesFactory | None = None,
        *,
        schema: GraphSchema | None = None,
        num_partitions: int = 1,
        seed: int = 0,
    ) -> TypedGraph:
        """Type PyKEEN's factories (sharing one id space).

        :param training: the training triples
        :param validation: the validation triples
        :param testing: the testing triples
        :param schema: the graph schema of the ids (default: the training factory's, else one entity type
            ``"entity"`` and dynamic relations)
        :param num_partitions: split every type into this many partitions (random, seeded; the entity ids
            change so that partitions are contiguous, see :meth:`repartition`)
        :param seed: the seed of the partitions
        :returns: the typed graph
        """
        schema = schema or schema_of(training)
        if schema is None:
            relation_names: Sequence[str]
            if isinstance(training, TriplesFactory):
                relation_names = [training.relation_id_to_label[i] for i in range(training.real_num_relations)]
            else:
                relation_names = [f"relation_{i}" for i in range(training.real_num_relations)]
            schema = GraphSchema(
                entity_types=(DEFAULT_TYPE,),
                partition_sizes=((training.num_entities,),),
                relation_names=tuple(relation_names),
                relation_lhs=(0,) * len(relation_names),
                relation_rhs=(0,) * len(relation_names),
                dynamic_relations=True,
            )
        splits = {"training": training.mapped_triples}
        splits.update({name: f.mapped_triples for name, f in (("validation", validation), ("testing", testing)) if f})
        graph = cls.from_triples(
            schema,
            splits,
            entity_labels=_labels(training),
            create_inverse_triples=training.create_inverse_triples,
        )
        return graph.repartition(num_partitions, seed=seed) if num_partitions != schema.num_partitions else graph

    def repartition(self, num_partitions: int | Sequence[int], seed: int = 0) -> TypedGraph:
        """Return the graph with every entity type split into random partitions.

        As PyTorch-BigGraph's importer: a type's entities are shuffled (here seeded) and cut into
        partitions of ``ceil(p N / P)`` boundaries; the entity ids change so that every partition is a
        contiguous id range (labels, triples and schema follow).

        :param num_partitions: the partitions of every type, or per type (in the schema's order; PyTorch-BigGraph's
            rule: the partitioned types have one count, the others 1)
        :param seed: the seed of the shuffles
        :raises ValueError: if a count is not positive, or the counts are not one per type
        """
        types = len(self.schema.entity_types)
        counts = [num_partitions] * types if isinstance(num_partitions, int) else [int(c) for c in num_partitions]
        if len(counts) != types or any(count < 1 for count in counts):
            raise ValueError(
                f"num_partitions must be positive, one count or one per entity type, not {num_partitions}."
            )
        generator = torch.Generator().manual_seed(int(seed))
        old_of_new = []
        sizes = []
        for t, (total, count) in enumerate(zip((sum(s) for s in self.schema.partition_sizes), counts)):
            start = self.schema.type_offsets[t]
            order = torch.randperm(total, generator=generator) if count > 1 else torch.arange(total)
            old_of_new.append(order + start)
            bounds = [math.ceil(p * total / count) for p in range(count + 1)]
            sizes.append(tuple(b - a for a, b in zip(bounds, bounds[1:])))
        old = torch.cat(old_of_new)
        new_of_old = torch.empty_like(old)
        new_of_old[old] = torch.arange(old.numel())
        schema = self.schema.with_partitions(sizes)
        labels = self.entity_labels()
        splits = {name: _remap(factory.mapped_triples, new_of_old) for name, factory in self.splits.items()}
        return TypedGraph.from_triples(
            schema,
            splits,
            entity_labels=None if labels is None else [labels[i] for i in old.tolist()],
            create_inverse_triples=self.training.create_inverse_triples,
            config=self.config,
        )


def _with_triples(factory: CoreTriplesFactory, triples: torch.Tensor) -> CoreTriplesFactory:
    """Return the factory with other triples, sharing its labels and metadata (no second label index)."""
    new = copy.copy(factory)
    new.mapped_triples = triples.long()
    new.metadata = dict(factory.metadata)
    return new


def _labels(factory: CoreTriplesFactory) -> list[str] | None:
    if not isinstance(factory, TriplesFactory):
        return None
    labels: list[str] = [""] * factory.num_entities
    for label, index in factory.entity_to_id.items():
        labels[index] = label
    return labels


def _remap(triples: torch.Tensor, new_of_old: torch.Tensor) -> torch.Tensor:
    return torch.stack([new_of_old[triples[:, 0]], triples[:, 1], new_of_old[triples[:, 2]]], dim=1)


def as_typed_graph(graph: TypedGraph | Any) -> TypedGraph:
    """Accept a typed graph or a triples factory (typed, or untyped: one type, one partition)."""
    if isinstance(graph, TypedGraph):
        return graph
    schema = schema_of(graph)
    if schema is not None:
        return TypedGraph(schema=schema, training=graph)
    return TypedGraph.from_factories(graph)
