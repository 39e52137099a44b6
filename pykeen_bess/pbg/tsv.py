"""Fast import of label TSV files (``head<TAB>relation<TAB>tail``) as a typed graph.

PyKEEN's ``TriplesFactory.from_path`` maps labels with Python-level loops and string arrays; for
tens of millions of triples this module reads the files with Apache Arrow's multi-threaded CSV
reader and factorises the labels with vectorised hash lookups (no per-label Python). Entity ids are
the labels' sorted order (as PyKEEN assigns them) within each type; relation ids likewise, or the
order of the config's relations. Memory: the files' text in Arrow buffers (about the file size,
released after the mapping), then 24 bytes per triple (int64 ``[T, 3]``) and the labels' Python
strings for the factory's label index (about 100 bytes per entity).

With a PyTorch-BigGraph config every relation has a head and a tail type: an entity is a (type,
name) pair, as in PyTorch-BigGraph's own importer, and a relation that is not in the config is
an error naming it and the file (with dynamic relations any relation is accepted).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .config import check_expressible, load_config, relation_weights
from .graph import DEFAULT_TYPE, TypedGraph
from .schema import GraphSchema

__all__ = [
    "import_tsv",
    "read_label_columns",
]

logger = logging.getLogger(__name__)


def read_label_columns(path: str | os.PathLike, columns: Sequence[int] = (0, 1, 2), delimiter: str = "\t") -> Any:
    """Read three columns of a delimited text file as Arrow string columns (head, relation, tail).

    The file may have more columns (e.g. a weight), as many on every line as on its first; the others are
    skipped, as PyTorch-BigGraph's importer skips them.

    :raises FileNotFoundError: if the file does not exist
    :raises ValueError: naming the file, if a line has too few columns, or another number than the first line
    """
    import pyarrow as pa
    import pyarrow.csv as csv

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Triples file {path} does not exist.")
    with path.open("rb") as file:
        first = file.readline().rstrip(b"\r\n")
    width = len(first.split(delimiter.encode())) if first else 0
    names = [f"column_{i}" for i in range(max(width, max(columns) + 1))]
    try:
        table = csv.read_csv(
            path,
            read_options=csv.ReadOptions(column_names=names, block_size=1 << 26),
            parse_options=csv.ParseOptions(delimiter=delimiter, quote_char=False, invalid_row_handler=None),
            convert_options=csv.ConvertOptions(
                column_types={name: pa.string() for name in names},
                include_columns=[names[c] for c in columns],
                strings_can_be_null=False,
            ),
        )
    except pa.ArrowInvalid as error:
        raise ValueError(f"{path}: not a file of {len(names)} {delimiter!r}-separated columns: {error}") from None
    return [table.column(names[c]) for c in columns]


def _factorize(values: Any, vocabulary: Any) -> np.ndarray:
    """Return the index of every value in a vocabulary (int64, -1 if absent), vectorised."""
    import pyarrow.compute as pc

    indices = pc.fill_null(pc.index_in(values, value_set=vocabulary), -1)  # -1: not in the vocabulary
    return np.asarray(indices.to_numpy(zero_copy_only=False), dtype=np.int64)


def _encode(columns: Sequence[Any], pool: concurrent.futures.Executor) -> tuple[Any, list[np.ndarray]]:
    """Factorise string columns jointly: the sorted vocabulary and every column's codes (int64).

    Every column is dictionary-encoded on its own (one hash pass, in parallel on the pool), then only
    the columns' dictionaries are merged and sorted, and each column's codes are remapped by indexing.

    :returns: the vocabulary (an Arrow string array, sorted) and, per column, the index of each value in it
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    def encode(column: Any) -> Any:
        return pc.dictionary_encode(column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column)

    encoded = list(pool.map(encode, columns))
    # the columns' dictionaries, encoded together: their entries' positions in one vocabulary, then sorted
    merged = pc.dictionary_encode(pa.concat_arrays([e.dictionary for e in encoded]))
    order = np.asarray(pc.array_sort_indices(merged.dictionary))
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size)
    positions = np.split(
        rank[merged.indices.to_numpy(zero_copy_only=False)], np.cumsum([len(e.dictionary) for e in encoded])[:-1]
    )
    codes = list(
        pool.map(lambda pair: pair[0][pair[1].indices.to_numpy(zero_copy_only=False)], zip(positions, encoded))
    )
    return merged.dictionary.take(pa.array(order)), codes


def _triples(heads: np.ndarray, relations: np.ndarray, tails: np.ndarray) -> torch.Tensor:
    """Stack id columns into ``[T, 3]`` int64 triples."""
    triples = torch.empty((heads.size, 3), dtype=torch.long)
    for index, column in enumerate((heads, relations, tails)):
        triples[:, index] = torch.from_numpy(column)
    return triples


def import_tsv(
    training: str | os.PathLike,
    validation: str | os.PathLike | None = None,
    testing: str | os.PathLike | None = None,
    *,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    num_partitions: int | None = None,
    seed: int = 0,
    columns: Sequence[int] = (0, 1, 2),
    delimiter: str = "\t",
    create_inverse_triples: bool = False,
) -> TypedGraph:
    """Import label TSV files (one per split, sharing one id space) as a typed graph.

    :param training: the training triples file
    :param validation: the validation triples file
    :param testing: the testing triples file
    :param config: a PyTorch-BigGraph config giving the entity types and each relation's head / tail
        types (default: one entity type, dynamic relations); its paths are not needed (the graph gets
        its own when written)
    :param num_partitions: split every type into this many random partitions (seeded); default: the config's
        ``num_partitions`` of each type (PyTorch-BigGraph's rule: the partitioned types have one count, the
        others 1), else 1
    :param seed: the seed of the partitions
    :param columns: the head, relation and tail columns (PyTorch-BigGraph's ``-l``, ``--rel-col``, ``-r``)
    :param delimiter: the column separator
    :param create_inverse_triples: PyKEEN's inverse triples
    :returns: the typed graph
    :raises ValueError: for relations missing from a config, malformed files (naming the file), a non-positive
        ``num_partitions``, or none given with a config whose partitioned types have different counts
    """
    import pyarrow as pa

    paths = {
        name: pathlib.Path(path)
        for name, path in (("training", training), ("validation", validation), ("testing", testing))
        if path is not None
    }
    read = {name: read_label_columns(path, columns, delimiter) for name, path in paths.items()}
    settings = load_config(config, paths=False) if config is not None else None
    source = str(config) if not isinstance(config, Mapping) else "the config"
    partitions = _partitions(num_partitions, settings, source)
    if settings is not None:
        check_expressible(settings, source)
    types = list(settings["entities"]) if settings is not None else [DEFAULT_TYPE]
    dynamic = settings is None or bool(settings["dynamic_relations"])
    names = list(read)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # Arrow's kernels release the GIL
        name_vocabulary, entity_codes = _encode(
            [column for name in names for column in (read[name][0], read[name][2])], pool
        )
        if dynamic:
            relation_vocabulary, relation_codes = _encode([read[name][1] for name in names], pool)
            relation_names = relation_vocabulary.to_pylist()
        else:
            assert settings is not None
            relation_names = [r["name"] for r in settings["relations"]]
            vocabulary = pa.array(relation_names, type=pa.string())
            relation_codes = [_factorize(read[name][1], vocabulary) for name in names]
    relation_ids = dict(zip(names, relation_codes))
    for name in names:
        unknown_ids = relation_ids[name] < 0
        if unknown_ids.any():
            unknown = sorted(set(read[name][1].filter(pa.array(unknown_ids)).to_pylist()))[:5]
            raise ValueError(
                f"{paths[name]}: relations {unknown} are not in the config's relations {relation_names[:10]}."
            )
    lhs_type = rhs_type = 0
    if settings is not None and dynamic:
        lhs_type, rhs_type = (types.index(settings["relations"][0][side]) for side in ("lhs", "rhs"))
    sides = {name: (entity_codes[2 * i], entity_codes[2 * i + 1]) for i, name in enumerate(names)}
    del read
    num_names = len(name_vocabulary)
    if settings is None:  # one type: the sorted names are the ids
        relation_lhs = relation_rhs = [0] * len(relation_names)
        type_sizes = [num_names]
        triples = {name: _triples(h, relation_ids[name], t) for name, (h, t) in sides.items()}
        labels = name_vocabulary.to_pylist()
        qualified = False
    else:
        if dynamic:
            relation_lhs, relation_rhs = [lhs_type] * len(relation_names), [rhs_type] * len(relation_names)
        else:
            relation_lhs = [types.index(r["lhs"]) for r in settings["relations"]]
            relation_rhs = [types.index(r["rhs"]) for r in settings["relations"]]
        lhs_of, rhs_of = np.asarray(relation_lhs, dtype=np.int64), np.asarray(relation_rhs, dtype=np.int64)
        keys = {
            name: (lhs_of[relation_ids[name]] * num_names + h, rhs_of[relation_ids[name]] * num_names + t)
            for name, (h, t) in sides.items()
        }
        # an entity is a (type, name) pair; sorted keys lay the ids out type by type, names sorted within
        unique, inverse = np.unique(np.concatenate([k for pair in keys.values() for k in pair]), return_inverse=True)
        type_sizes = np.bincount(unique // num_names, minlength=len(types)).tolist()
        triples = {}
        start = 0
        for name, (h, t) in keys.items():
            heads, tails = inverse[start : start + h.size], inverse[start + h.size : start + h.size + t.size]
            start += h.size + t.size
            triples[name] = _triples(heads, relation_ids[name], tails)
        entity_names = name_vocabulary.take(pa.array(unique % num_names)).to_pylist()
        qualified = len(set(entity_names)) != len(entity_names)
        entity_types = (unique // num_names).tolist()
        labels = [f"{types[t]}:{n}" for t, n in zip(entity_types, entity_names)] if qualified else entity_names
    schema = GraphSchema(
        entity_types=tuple(types),
        partition_sizes=tuple((size,) for size in type_sizes),
        relation_names=tuple(relation_names),
        relation_lhs=tuple(relation_lhs),
        relation_rhs=tuple(relation_rhs),
        dynamic_relations=dynamic,
        qualified_labels=qualified,
        relation_weights=relation_weights(settings, len(relation_names)) if settings is not None else (),
    )
    graph = TypedGraph.from_triples(
        schema, triples, entity_labels=labels, create_inverse_triples=create_inverse_triples, config=settings
    )
    logger.info("Imported %s from %s.", schema, ", ".join(str(p) for p in paths.values()))
    return graph.repartition(partitions, seed=seed) if max(partitions) > 1 else graph


def _partitions(num_partitions: int | None, settings: Mapping[str, Any] | None, source: str) -> list[int]:
    """Return the partitions of every type: ``num_partitions``, else the config's (per type), else 1."""
    types = len(settings["entities"]) if settings is not None else 1
    if num_partitions is not None:
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be positive, not {num_partitions}.")
        return [num_partitions] * types
    if settings is None:
        return [1]
    counts = {name: int(entity["num_partitions"]) for name, entity in settings["entities"].items()}
    if len({count for count in counts.values() if count > 1}) > 1:
        raise ValueError(
            f"{source} partitions its entity types into different numbers of partitions ({counts}); PyTorch-BigGraph "
            f"allows one count for the partitioned types (the others 1): give num_partitions (--partitions)."
        )
    return list(counts.values())
