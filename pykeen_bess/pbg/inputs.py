"""PyTorch-BigGraph input directories: :func:`read` and :func:`write` a typed graph.

:func:`read` imports a PyTorch-BigGraph 1.0 input directory (or its pre-release layout,
:mod:`~pykeen_bess.pbg.legacy`): the entity types and partitions of the config and the count files,
the names, the relation types, and one split per edge path. Large inputs are read bucket by bucket
in chunks of edges and mapped to global ids with vectorised arithmetic (no per-edge Python): the
triples take 24 bytes each (int64 ``[T, 3]``), plus one chunk while reading. :func:`write` writes a
typed graph as such a directory, and :func:`graph_config` a PyTorch-BigGraph config for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import files
from .config import check_expressible, load_config, relation_weights, write_config
from .graph import EDGE_PATH_KEY, SPLITS, TypedGraph
from .schema import GraphSchema

__all__ = [
    "graph_config",
    "read",
    "read_edges",
    "write",
    "write_entities",
    "write_split",
]

logger = logging.getLogger(__name__)

#: the name of the single relation entry of a dynamic-relations config written here
DYNAMIC_RELATION = "all_edges"


# -- reading -------------------------------------------------------------------------------------


def _side_tables(schema: GraphSchema, sides: Sequence[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Return the buckets of one side (lhs or rhs) and the start and size of every ``(type, bucket partition)``.

    An unpartitioned type is in every bucket at its only partition.
    """
    num_parts = max((len(schema.partition_sizes[t]) for t in set(sides)), default=1)
    starts = torch.zeros(schema.num_types, num_parts, dtype=torch.long)
    sizes = torch.zeros(schema.num_types, num_parts, dtype=torch.long)
    for t, partition_sizes in enumerate(schema.partition_sizes):
        for p in range(num_parts):
            own = p if len(partition_sizes) > 1 else 0
            if own < len(partition_sizes):
                ids = schema.partition_range(t, own)
                starts[t, p], sizes[t, p] = ids.start, len(ids)
    return num_parts, starts, sizes


def read_edges(directory: pathlib.Path, schema: GraphSchema, one_based: bool = False) -> torch.Tensor:
    """Read the bucket files of one edge path as global-id triples ``[T, 3]`` (bucket by bucket, in chunks).

    :param directory: the edge path
    :param schema: the graph schema (types, partitions, relations)
    :param one_based: the pre-release layout: 1-based partition numbers and offsets (no ``format_version``)
    :raises FileNotFoundError: if the directory or all of its bucket files are missing
    :raises ValueError: naming the file, for relation ids or offsets out of range
    """
    if not directory.is_dir():
        raise FileNotFoundError(f"Edge path {directory} does not exist.")
    lhs_parts, lhs_start, lhs_size = _side_tables(schema, schema.relation_lhs)
    rhs_parts, rhs_start, rhs_size = _side_tables(schema, schema.relation_rhs)
    relation_lhs = torch.tensor(schema.relation_lhs, dtype=torch.long)
    relation_rhs = torch.tensor(schema.relation_rhs, dtype=torch.long)
    base = 1 if one_based else 0
    chunks = []
    found = 0
    for lhs_part in range(lhs_parts):
        for r in range(rhs_parts):
            path = files.bucket_file(directory, lhs_part + base, r + base)
            if not path.is_file():
                continue  # PyTorch-BigGraph's importer writes no file for an empty bucket
            found += 1
            for lhs, rel, rhs in files.iter_edge_chunks(path, check_version=not one_based):
                heads, relations, tails = (torch.from_numpy(a) for a in (lhs, rel, rhs))
                if one_based:
                    heads, tails = heads - 1, tails - 1
                if relations.numel() == 0:
                    continue
                if int(relations.min()) < 0 or int(relations.max()) >= schema.num_relations:
                    raise ValueError(
                        f"{path}: relation ids in [{int(relations.min())}, {int(relations.max())}] outside "
                        f"[0, {schema.num_relations}) (the config's relations or dynamic_rel_count.txt)."
                    )
                types_l, types_r = relation_lhs[relations], relation_rhs[relations]
                for side, offsets, types, size in (
                    ("lhs", heads, types_l, lhs_size[:, lhs_part]),
                    ("rhs", tails, types_r, rhs_size[:, r]),
                ):
                    bad = (offsets < 0) | (offsets >= size[types])
                    if bool(bad.any()):
                        index = int(bad.nonzero()[0])
                        raise ValueError(
                            f"{path}: {side} offset {int(offsets[index]) + base} of edge {index} is outside "
                            f"[{base}, {int(size[types[index]]) + base}) of entity type "
                            f"{schema.entity_types[int(types[index])]!r} (its entity count file)."
                        )
                chunks.append(
                    torch.stack([lhs_start[types_l, lhs_part] + heads, relations, rhs_start[types_r, r] + tails], dim=1)
                )
    if not found:
        raise FileNotFoundError(
            f"Edge path {directory} holds no bucket files edges_{{lhs}}_{{rhs}}.h5 "
            f"({lhs_parts} x {rhs_parts} buckets expected, partitions {base}-based)."
        )
    return torch.cat(chunks) if chunks else torch.zeros(0, 3, dtype=torch.long)


def _resolve(
    value: str | os.PathLike,
    config_directory: pathlib.Path | None,
    entity_path: pathlib.Path | None,
    config_entity_path: str | None,
) -> pathlib.Path:
    """Find a path of a config: moved with the entity path, as given, or relative to the config's directory.

    A path under the config's entity path is taken under the entity path read (first: a copied or moved input
    directory keeps its config, whose absolute paths name the original, which may hold other files by now).
    """
    path = pathlib.Path(value)
    candidates = []
    if entity_path is not None and config_entity_path is not None:
        try:
            candidates.append(entity_path / path.relative_to(pathlib.Path(config_entity_path)))
        except ValueError:
            pass
    candidates.append(path)
    if not path.is_absolute() and config_directory is not None:
        candidates.append(config_directory / path)
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{value} not found (tried {', '.join(str(c) for c in candidates)}).")


def read(
    path: str | os.PathLike | None = None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    *,
    splits: Sequence[str] | None = None,
    create_inverse_triples: bool = False,
) -> TypedGraph:
    """Read a PyTorch-BigGraph input: entity types and partitions, relation types, edge paths.

    PyTorch-BigGraph 1.0's files (``entity_count_{type}_{part}.txt``, ``edges_{l}_{r}.h5`` with
    ``format_version = 1``) and the pre-release layout (``entity_count_*.pt``, 1-based
    partitions and offsets) are detected and read alike.

    :param path: the entity path (default: the config's ``entity_path``)
    :param config: a PyTorch-BigGraph config (``.py`` with ``get_torchbiggraph_config()``, ``.json``, or a
        dict); default: ``config.json`` or ``config.py`` in ``path``
    :param splits: which split each of the config's ``edge_paths`` is, in order (default: training,
        validation, testing for up to three edge paths)
    :param create_inverse_triples: PyKEEN's inverse triples
    :returns: the typed graph: one id space, the splits as PyKEEN factories with the schema
    :raises FileNotFoundError: naming the missing file
    :raises ValueError: for what PyKEEN cannot express and for invalid files (naming the file)
    """
    from . import legacy

    entity_path = pathlib.Path(path) if path is not None else None
    config_directory = None
    if config is None:
        if entity_path is None:
            raise ValueError("Pass the entity path, a config, or both.")
        found = [entity_path / name for name in ("config.json", "config.py") if (entity_path / name).is_file()]
        if not found:
            raise FileNotFoundError(f"No config given and none in {entity_path} (config.json or config.py).")
        config = found[0]
    if not isinstance(config, Mapping):
        config_directory = pathlib.Path(config).parent
    source = str(config) if not isinstance(config, Mapping) else "the config"
    settings = load_config(config)
    check_expressible(settings, source)
    if entity_path is None:
        entity_path = _resolve(settings["entity_path"], config_directory, None, None)
    if not entity_path.is_dir():
        raise FileNotFoundError(f"Entity path {entity_path} does not exist.")
    one_based = legacy.is_legacy_entity_path(entity_path)
    schema, labels = (legacy.read_legacy_entities if one_based else _read_entities)(entity_path, settings)
    edge_values = list(settings["edge_paths"])
    names = list(splits) if splits is not None else list(SPLITS[: len(edge_values)])
    if len(names) != len(edge_values):
        raise ValueError(
            f"The config has {len(edge_values)} edge paths; name their splits with splits=(...) "
            f"(one of {list(SPLITS)} each)."
        )
    edge_paths = {
        name: _resolve(value, config_directory, entity_path, settings.get("entity_path"))
        for name, value in zip(names, edge_values)
    }
    triples = {name: read_edges(directory, schema, one_based=one_based) for name, directory in edge_paths.items()}
    logger.info(
        "Read %s from %s: %s.",
        schema,
        entity_path,
        ", ".join(f"{n} {t.shape[0]:,} triples" for n, t in triples.items()),
    )
    return TypedGraph.from_triples(
        schema,
        triples,
        entity_labels=labels,
        create_inverse_triples=create_inverse_triples,
        config=settings,
        entity_path=entity_path,
        edge_paths=edge_paths,
    )


def _read_entities(entity_path: pathlib.Path, config: Mapping[str, Any]) -> tuple[GraphSchema, list[str] | None]:
    """Read the entity counts and names and the relation types of a PyTorch-BigGraph 1.0 entity path."""
    types = list(config["entities"])
    partition_sizes = [
        tuple(
            files.read_count(files.count_file(entity_path, t, p))
            for p in range(config["entities"][t]["num_partitions"])
        )
        for t in types
    ]
    names = [
        [files.read_names(files.names_file(entity_path, t, p), count) for p, count in enumerate(sizes)]
        for t, sizes in zip(types, partition_sizes)
    ]
    relations = config["relations"]
    if config["dynamic_relations"]:
        count = files.read_count(entity_path / "dynamic_rel_count.txt")
        relation_names = files.read_names(entity_path / "dynamic_rel_names.json", count)
        if relation_names is None:
            relation_names = [f"relation_{i}" for i in range(count)]
        lhs = [types.index(relations[0]["lhs"])] * count
        rhs = [types.index(relations[0]["rhs"])] * count
    else:
        relation_names = [r["name"] for r in relations]
        lhs = [types.index(r["lhs"]) for r in relations]
        rhs = [types.index(r["rhs"]) for r in relations]
    weights = relation_weights(config, len(relation_names))
    return _schema_and_labels(
        types, partition_sizes, names, relation_names, lhs, rhs, config["dynamic_relations"], weights
    )


def _schema_and_labels(
    types: Sequence[str],
    partition_sizes: Sequence[Sequence[int]],
    names: Sequence[Sequence[list[str] | None]],
    relation_names: Sequence[str],
    lhs: Sequence[int],
    rhs: Sequence[int],
    dynamic: bool,
    weights: Sequence[float] = (),
) -> tuple[GraphSchema, list[str] | None]:
    """Build the schema and the entity labels (qualified with the type where names repeat across types)."""
    present = [n is not None for parts in names for n in parts]
    if any(present) and not all(present):
        logger.warning("Some entity names files are missing: the entities are read without names.")
    qualified = False
    labels = None
    if all(present):
        per_type = [[name for part in parts for name in part] for parts in names]  # type: ignore[union-attr]
        for t, type_names in zip(types, per_type):
            if len(set(type_names)) != len(type_names):
                raise ValueError(f"Entity type {t!r} has repeated names in its names files.")
        labels = [name for type_names in per_type for name in type_names]
        qualified = len(set(labels)) != len(labels)
        if qualified:
            labels = [f"{t}:{name}" for t, type_names in zip(types, per_type) for name in type_names]
    schema = GraphSchema(
        entity_types=tuple(types),
        partition_sizes=tuple(tuple(s) for s in partition_sizes),
        relation_names=tuple(relation_names),
        relation_lhs=tuple(lhs),
        relation_rhs=tuple(rhs),
        dynamic_relations=bool(dynamic),
        qualified_labels=qualified,
        relation_weights=tuple(weights),
    )
    return schema, labels


# -- writing -------------------------------------------------------------------------------------


def write(
    graph: TypedGraph,
    directory: str | os.PathLike,
    *,
    config: Mapping[str, Any] | None = None,
) -> TypedGraph:
    """Write a typed graph as PyTorch-BigGraph 1.0 input files.

    ``directory`` becomes the entity path (counts, names, ``dynamic_rel_count.txt``,
    ``dynamic_rel_names.json``) and gets one edge path per split (``training/``, ``validation/``,
    ``testing/``, every bucket file, empty ones too). With ``config`` (at least ``dimension`` and the
    ``operator``) a ``config.json`` / ``config.py`` is written too, listing the edge paths training,
    validation, testing (as PyTorch-BigGraph's examples do: ``torchbiggraph_train config.py -p
    edge_paths=<training>`` trains on the first; :func:`read` maps them back to the splits).

    :param graph: the typed graph (its schema lays out the files)
    :param directory: the input directory (created; its resolved path is the entity path)
    :param config: PyTorch-BigGraph config keys of the written ``config.json`` (see :func:`graph_config`);
        None: no config is written

    :returns: the graph, now knowing its files
    """
    directory = pathlib.Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    write_entities(graph, directory)
    edge_paths = {}
    for name, factory in graph.splits.items():
        edge_paths[name] = directory / name
        write_split(factory.mapped_triples, graph.schema, edge_paths[name])
    graph = dataclasses.replace(graph, entity_path=directory, edge_paths=edge_paths)
    graph.record_paths()
    if config is not None:
        settings = graph_config(
            graph, config, checkpoint_path=directory / "checkpoints", edge_paths=[*edge_paths.values()]
        )
        write_config(settings, directory)
    logger.info("Wrote %s to %s.", graph.schema, directory)
    return graph


def write_entities(graph: TypedGraph, directory: pathlib.Path) -> None:
    """Write the entity counts and names and the relation names of a graph into an entity path."""
    schema = graph.schema
    labels = graph.entity_labels()
    for t, name in enumerate(schema.entity_types):
        for p, size in enumerate(schema.partition_sizes[t]):
            files.write_count(files.count_file(directory, name, p), size)
            names = graph.names(t, p, labels)
            if names is not None:
                files.write_names(files.names_file(directory, name, p), names)
    # PyTorch-BigGraph's exporter reads the relation names from here even without dynamic relations
    files.write_count(directory / "dynamic_rel_count.txt", schema.num_relations)
    files.write_names(directory / "dynamic_rel_names.json", list(schema.relation_names))


def write_split(triples: torch.Tensor, schema: GraphSchema, directory: pathlib.Path) -> None:
    """Write one split as the bucket files of an edge path (all buckets, empty ones too)."""
    directory.mkdir(parents=True, exist_ok=True)
    lhs_parts = _side_tables(schema, schema.relation_lhs)[0]
    rhs_parts = _side_tables(schema, schema.relation_rhs)[0]
    triples = triples.long()
    heads, relations, tails = triples.unbind(1)
    partition, offset = schema.entity_partition, schema.entity_offset
    bucket = partition[heads] * rhs_parts + partition[tails]
    order = torch.sort(bucket, stable=True).indices
    counts = torch.bincount(bucket, minlength=lhs_parts * rhs_parts).tolist()
    columns = [offset[heads][order].numpy(), relations[order].numpy(), offset[tails][order].numpy()]
    start = 0
    for index, count in enumerate(counts):
        lhs_part, rhs_part = divmod(index, rhs_parts)
        bucket_columns = (column[start : start + count] for column in columns)
        files.write_edges(files.bucket_file(directory, lhs_part, rhs_part), *bucket_columns)
        start += count


def graph_config(
    graph: TypedGraph | GraphSchema,
    settings: Mapping[str, Any],
    checkpoint_path: str | os.PathLike,
    entity_path: str | os.PathLike | None = None,
    edge_paths: Sequence[str | os.PathLike] | None = None,
) -> dict[str, Any]:
    """Return a PyTorch-BigGraph config for a graph: its types and relations, paths, and ``settings``.

    ``settings`` holds at least ``dimension`` and the relations' ``operator`` (one for all) and may
    override any other key (``comparator``, ``lr``, ``num_epochs``, ...), except the graph's layout: its
    entity types and their partitions, its relations' names and sides, and the paths given here or known
    to the graph (a config's own ``entities`` and ``relations`` add their other settings, such as a
    relation's operator; its paths apply only where neither gives one). A config naming other
    partitions than the files hold would make PyTorch-BigGraph and :func:`read` see part of the graph.
    ``global_emb`` is off and
    ``eval_fraction`` is 0 (PyTorch-BigGraph would otherwise add a vector per type, and hold 5% of the
    edges out of training); the edge paths default to the training split's files (the one PyTorch-BigGraph
    trains on, so that its checkpoint versions count epochs), if the graph knows them.
    """
    schema = graph.schema if isinstance(graph, TypedGraph) else graph
    settings = dict(settings)
    operator = settings.pop("operator", "none")
    types = schema.entity_types
    entities = {t: {"num_partitions": len(sizes)} for t, sizes in zip(types, schema.partition_sizes)}
    weights = list(schema.relation_weights or (1.0,) * schema.num_relations)
    if schema.dynamic_relations:
        if len(set(weights)) > 1:
            raise ValueError(
                "PyTorch-BigGraph's dynamic relations share one loss weight; this graph's relations have "
                f"{len(set(weights))} different ones."
            )
        relations = [
            {
                "name": DYNAMIC_RELATION,
                "lhs": types[schema.relation_lhs[0]],
                "rhs": types[schema.relation_rhs[0]],
                "operator": operator,
                "weight": weights[0] if weights else 1.0,
            }
        ]
    else:
        relations = [
            {"name": name, "lhs": types[lhs], "rhs": types[rhs], "operator": operator, "weight": weight}
            for name, lhs, rhs, weight in zip(schema.relation_names, schema.relation_lhs, schema.relation_rhs, weights)
        ]
    if edge_paths is None:
        training = None
        if isinstance(graph, TypedGraph):
            training = graph.edge_paths.get("training") or graph.training.metadata.get(EDGE_PATH_KEY)
        edge_paths = [training] if training is not None else []
    if entity_path is None and isinstance(graph, TypedGraph) and graph.entity_path is not None:
        entity_path = graph.entity_path
    config = dict(
        dynamic_relations=schema.dynamic_relations,
        entity_path=str(entity_path) if entity_path is not None else str(settings.get("entity_path", "")),
        edge_paths=[str(path) for path in (edge_paths or settings.get("edge_paths") or [])],
        checkpoint_path=str(checkpoint_path),
        global_emb=False,
        eval_fraction=0.0,
        num_edge_chunks=1,
    )
    layout = ("entities", "relations", "dynamic_relations", "entity_path", "edge_paths", "checkpoint_path")
    config.update({key: value for key, value in settings.items() if key not in layout})
    own_entities = dict(settings.get("entities") or {})
    config["entities"] = {name: {**dict(own_entities.get(name) or {}), **entity} for name, entity in entities.items()}
    own_relations = {relation.get("name"): relation for relation in settings.get("relations") or []}
    config["relations"] = [
        {**relation, **{k: v for k, v in own_relations.get(relation["name"], {}).items() if k not in ("lhs", "rhs")}}
        for relation in relations
    ]
    return config
