"""PyTorch-BigGraph configurations: read (``config.json``, a PBG ``.py`` config, or a dict), check, write.

PyTorch-BigGraph 1.0 describes a run by a ``ConfigSchema``: the entity types (``entities``: number
of partitions, ``featurized``), the relation types (``relations``: name, ``lhs`` / ``rhs`` types,
``operator``, ``all_negs``, ``weight``), the ``dimension``, the ``comparator`` and the paths
(``entity_path``, ``edge_paths``, ``checkpoint_path``, ``init_path``). Its own loader imports a
Python file and calls ``get_torchbiggraph_config()``; checkpoints store the config as
``config.json``. Both are read here without importing ``torchbiggraph``; keys are normalised as
PBG normalises them (``numPartitions`` -> ``num_partitions``) and PBG's defaults are filled in. A key
no PyTorch-BigGraph version knows is refused, as PBG's own loader refuses it (a misspelt key would
otherwise be ignored silently).

:func:`check_expressible` raises a clear error for what a PyKEEN model cannot express
(featurized entities, ``all_negs``); :func:`relation_weights` reads the relations' loss weights
(the graph schema keeps them, the BESS loop trains with them). :func:`write_config` writes both
``config.json`` and a ``config.py`` that PBG's command-line tools accept.
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import json
import math
import os
import pathlib
import pprint
import re
import sys
import uuid
from collections.abc import Mapping
from typing import Any

__all__ = [
    "DEFAULTS",
    "ENTITY_DEFAULTS",
    "RELATION_DEFAULTS",
    "check_expressible",
    "load_config",
    "normalize_config",
    "relation_weights",
    "write_config",
]

#: PyTorch-BigGraph 1.0.0's ``ConfigSchema`` defaults (the required keys have none)
DEFAULTS: dict[str, Any] = dict(
    init_scale=0.001,
    max_norm=None,
    global_emb=True,
    comparator="cos",
    bias=False,
    loss_fn="ranking",
    margin=0.1,
    init_path=None,
    checkpoint_preservation_interval=None,
    num_epochs=1,
    num_edge_chunks=None,
    max_edges_per_chunk=1_000_000_000,
    bucket_order="inside_out",
    workers=None,
    batch_size=1000,
    num_batch_negs=50,
    num_uniform_negs=50,
    disable_lhs_negs=False,
    disable_rhs_negs=False,
    lr=0.01,
    relation_lr=None,
    eval_fraction=0.05,
    eval_num_batch_negs=1000,
    eval_num_uniform_negs=1000,
    background_io=False,
    verbose=0,
    hogwild_delay=2,
    dynamic_relations=False,
    num_machines=1,
    num_partition_servers=-1,
    distributed_init_method=None,
    distributed_tree_init_order=True,
)
#: top-level keys later PyTorch-BigGraph versions added to 1.0's (GPU training, partition servers): accepted and
#: kept, none changes what is read here
LATER_KEYS = ("num_gpus", "num_groups_for_partition_server", "half_precision")
#: keys of PyTorch-BigGraph's pre-release layout and their PyTorch-BigGraph 1.0 names
LEGACY_KEYS = {"outdir": "checkpoint_path", "load_path": "init_path"}
#: the required top-level keys
REQUIRED = ("entities", "relations", "dimension", "entity_path", "edge_paths", "checkpoint_path")
#: ``EntitySchema`` defaults
ENTITY_DEFAULTS: dict[str, Any] = dict(featurized=False)
#: ``EntitySchema``'s keys (``dimension``, a type's own dimension, from versions after 1.0)
ENTITY_KEYS = ("num_partitions", "featurized", "dimension")
#: ``RelationSchema`` defaults
RELATION_DEFAULTS: dict[str, Any] = dict(weight=1.0, operator="none", all_negs=False)
#: ``RelationSchema``'s keys
RELATION_KEYS = ("name", "lhs", "rhs", "weight", "operator", "all_negs")
#: the operators and comparators of PyTorch-BigGraph 1.0
OPERATORS = ("none", "diagonal", "translation", "linear", "affine", "complex_diagonal")
COMPARATORS = ("dot", "cos", "l2", "squared_l2")


def _snake(key: str) -> str:
    """``numPartitions`` -> ``num_partitions`` (PBG's loader accepts the old mixed-case keys)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def normalize_config(config: Mapping[str, Any], source: str = "the config", paths: bool = True) -> dict[str, Any]:
    """Return the config with snake-case keys and PyTorch-BigGraph's defaults filled in.

    :param config: a PBG config dictionary (``ConfigSchema.to_dict()``, ``get_torchbiggraph_config()``)
    :param source: named in error messages
    :param paths: whether the paths (``entity_path``, ``edge_paths``, ``checkpoint_path``) are required, as
        PyTorch-BigGraph requires them; without, missing ones are empty (an import writes its own)
    :raises ValueError: for unknown or missing required keys, unknown operators or comparators, relations
        naming unknown entity types
    """
    config = {_snake(key): copy.deepcopy(value) for key, value in config.items()}
    for old, new in LEGACY_KEYS.items():  # the pre-release layout's names
        if old in config and new not in config:
            config[new] = config.pop(old)
    _check_keys(config, (*DEFAULTS, *REQUIRED, *LATER_KEYS), source)
    if not paths:
        config = {"entity_path": "", "edge_paths": [], "checkpoint_path": "", **config}
    missing = [key for key in REQUIRED if key not in config]
    if missing:
        raise ValueError(f"{source} lacks the required PyTorch-BigGraph keys {missing}.")
    entities = {str(name): _normalize_entity(name, entity, source) for name, entity in dict(config["entities"]).items()}
    relations = [
        _normalize_relation(index, relation, entities, source) for index, relation in enumerate(config["relations"])
    ]
    config = {**DEFAULTS, **config, "entities": entities, "relations": relations}
    if not relations:
        raise ValueError(f"{source} has no relations.")
    if config["comparator"] not in COMPARATORS:
        raise ValueError(
            f"{source}: comparator {config['comparator']!r}; PyTorch-BigGraph's comparators are {list(COMPARATORS)}."
        )
    if config["dynamic_relations"] and len(relations) != 1:
        raise ValueError(f"{source}: with dynamic_relations the config has exactly one relation entry.")
    if isinstance(config["edge_paths"], str):
        config["edge_paths"] = [config["edge_paths"]]
    config["dimension"] = int(config["dimension"])
    return config


def _check_keys(config: Mapping[str, Any], known: tuple[str, ...], source: str, part: str = "") -> None:
    """Raise a clear error for keys of a config (or of one of its entity types or relations) PBG does not know.

    :raises ValueError: naming the unknown keys, with the known keys closest to each
    """
    unknown = [key for key in config if key not in known]
    if unknown:
        hints = [f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)
                 for key in unknown for close in [difflib.get_close_matches(key, known, n=1)]]  # fmt: skip
        raise ValueError(
            f"{source}{part}: unknown PyTorch-BigGraph keys {', '.join(hints)}; PyTorch-BigGraph's config schema "
            f"refuses them too."
        )


def _normalize_entity(name: Any, entity: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Return an entity type's config with snake-case keys and defaults (:func:`normalize_config`)."""
    entity = {_snake(key): value for key, value in dict(entity).items()}
    _check_keys(entity, ENTITY_KEYS, source, f", entity type {name!r}")
    if "num_partitions" not in entity:
        raise ValueError(f"{source}: entity type {name!r} lacks num_partitions.")
    if int(entity["num_partitions"]) < 1:
        raise ValueError(f"{source}: entity type {name!r} has num_partitions={entity['num_partitions']}.")
    return {**ENTITY_DEFAULTS, **entity, "num_partitions": int(entity["num_partitions"])}


def _normalize_relation(
    index: int, relation: Mapping[str, Any], entities: Mapping[str, Any], source: str
) -> dict[str, Any]:
    """Return a relation's config with snake-case keys and defaults, checked against the entity types."""
    relation = {**RELATION_DEFAULTS, **{_snake(key): value for key, value in dict(relation).items()}}
    _check_keys(relation, RELATION_KEYS, source, f", relation {relation.get('name', index)!r}")
    for key in ("name", "lhs", "rhs"):
        if key not in relation:
            raise ValueError(f"{source}: relation {index} lacks {key!r}.")
    for key in ("lhs", "rhs"):
        if relation[key] not in entities:
            raise ValueError(
                f"{source}: relation {relation['name']!r} has {key}={relation[key]!r}, which is not one of the "
                f"entity types {sorted(entities)}."
            )
    if relation["operator"] not in OPERATORS:
        raise ValueError(
            f"{source}: relation {relation['name']!r} has operator {relation['operator']!r}; PyTorch-BigGraph's "
            f"operators are {list(OPERATORS)}."
        )
    return relation


def load_config(config: str | os.PathLike | Mapping[str, Any], paths: bool = True) -> dict[str, Any]:
    """Read a PyTorch-BigGraph config: a dict, a ``.json`` file, or a ``.py`` file with ``get_torchbiggraph_config()``.

    A Python config is imported as PBG imports it (its ``get_torchbiggraph_config()`` is called).

    :param paths: whether its paths are required (see :func:`normalize_config`)

    :returns: the normalised config (:func:`normalize_config`)
    :raises FileNotFoundError: if the file does not exist
    :raises ValueError: for an unreadable or invalid config
    """
    if isinstance(config, Mapping):
        return normalize_config(config, paths=paths)
    path = pathlib.Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"PyTorch-BigGraph config {path} does not exist.")
    if path.suffix == ".py":
        name = f"pykeen_bess_pbg_config_{uuid.uuid4().hex}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        finally:
            sys.modules.pop(name, None)
        function = getattr(module, "get_torchbiggraph_config", None)
        if function is None:
            raise ValueError(f"{path} defines no get_torchbiggraph_config() (PyTorch-BigGraph's config function).")
        return normalize_config(function(), source=str(path), paths=paths)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object (a PyTorch-BigGraph config).")
    return normalize_config(raw, source=str(path), paths=paths)


def check_expressible(config: Mapping[str, Any], source: str = "the config") -> None:
    """Raise a clear error for what a PyKEEN model and BESS cannot express.

    :raises ValueError: for featurized entity types, types with a dimension of their own, ``all_negs`` and
        invalid relation weights
    """
    featurized = [name for name, entity in config["entities"].items() if entity.get("featurized")]
    if featurized:
        raise ValueError(
            f"{source}: entity types {featurized} are featurized (an entity is the mean of feature embeddings); "
            f"PyKEEN's models have one embedding per entity, so featurized graphs cannot be imported."
        )
    dimensions = {
        name: entity["dimension"]
        for name, entity in config["entities"].items()
        if entity.get("dimension") is not None and int(entity["dimension"]) != int(config["dimension"])
    }
    if dimensions:
        raise ValueError(
            f"{source}: entity types have dimensions of their own {dimensions} (the config's dimension is "
            f"{config['dimension']}); a PyKEEN model embeds every entity in one dimension."
        )
    all_negs = [r["name"] for r in config["relations"] if r.get("all_negs")]
    if all_negs:
        raise ValueError(
            f"{source}: relations {all_negs} train with all_negs=True (every entity a negative); BESS draws "
            f"num_negs_per_pos shared negatives per block. Set all_negs=False."
        )
    weights = {r["name"]: r.get("weight", 1.0) for r in config["relations"]}
    bad = {}
    for name, weight in weights.items():
        try:
            value = float(weight)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value) or value < 0:
            bad[name] = weight
    if bad:
        raise ValueError(f"{source}: relation weights must be finite, non-negative numbers: {bad}.")
    if weights and not any(float(weight) > 0 for weight in weights.values()):
        raise ValueError(f"{source}: every relation has weight 0; nothing would be trained.")


def relation_weights(config: Mapping[str, Any], num_relations: int) -> tuple[float, ...]:
    """Return PyTorch-BigGraph's loss ``weight`` of every relation id (empty if all are 1).

    With dynamic relations the config's one relation entry gives the weight of all
    ``num_relations`` relations; otherwise relation id ``i`` is the config's relation ``i``.
    """
    relations = config["relations"]
    if config.get("dynamic_relations"):
        weights = (float(relations[0].get("weight", 1.0)),) * num_relations
    else:
        weights = tuple(float(r.get("weight", 1.0)) for r in relations)
    return weights if any(weight != 1.0 for weight in weights) else ()


def write_config(config: Mapping[str, Any], directory: str | pathlib.Path) -> pathlib.Path:
    """Write ``config.json`` and ``config.py`` (for PyTorch-BigGraph's command-line tools) into ``directory``.

    :returns: the path of ``config.py``
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    (directory / "config.json").write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    python = directory / "config.py"
    python.write_text(
        '"""PyTorch-BigGraph config written by pykeen-bess (the same as config.json)."""\n\n\n'
        "def get_torchbiggraph_config():\n"
        f"    return {pprint.pformat(config, indent=4, width=100, sort_dicts=False)}\n",
        encoding="utf-8",
    )
    return python
