"""Helpers that run real PyTorch-BigGraph (torchbiggraph 1.0.0) on the files this package writes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import typing
import warnings
from typing import Any

import torch

from pykeen_bess.pbg import GraphSchema

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torchbiggraph imports pkg_resources
    import torchbiggraph
    import torchbiggraph.schema
    from torchbiggraph.checkpoint_manager import CheckpointManager
    from torchbiggraph.config import ConfigSchema
    from torchbiggraph.edgelist import EdgeList
    from torchbiggraph.entitylist import EntityList
    from torchbiggraph.model import make_model
    from torchbiggraph.types import Side

#: the scripts of torchbiggraph's command-line tools, next to this interpreter
BIN = pathlib.Path(sys.executable).parent


def _unpack_optional(type_: Any) -> Any:
    """``Optional[X]`` -> ``X``, by the type's structure.

    torchbiggraph 1.0.0 compares ``type_ is Optional[X]``, relying on ``typing``'s cache of
    subscripted types (128 entries); in a long test session the entry is evicted, a new object is
    built, and every config fails to load ("Unknown type: typing.Optional[int]").
    """
    arguments = typing.get_args(type_)
    if typing.get_origin(type_) is not typing.Union or len(arguments) != 2 or type(None) not in arguments:
        raise TypeError("Not an optional type")
    return next(argument for argument in arguments if argument is not type(None))


torchbiggraph.schema.unpack_optional = _unpack_optional


def pbg_config(directory: pathlib.Path, **overrides: Any) -> ConfigSchema:
    """Read a checkpoint's config.json as PyTorch-BigGraph does (``ConfigSchema.from_dict``)."""
    raw = json.loads((directory / "config.json").read_text())
    raw.update(overrides)
    return ConfigSchema.from_dict(raw)


def pbg_model(directory: pathlib.Path) -> tuple[Any, CheckpointManager, ConfigSchema]:
    """Build PyTorch-BigGraph's model of a checkpoint and load its relations with ``strict=True`` (all keys match)."""
    raw = json.loads((directory / "config.json").read_text())
    for relation in raw["relations"]:
        relation["all_negs"] = True  # score against all entities of the bucket
    raw["num_uniform_negs"] = 0
    config = ConfigSchema.from_dict(raw)
    model = make_model(config)
    manager = CheckpointManager(str(directory))
    state, _ = manager.read_model()
    model.load_state_dict(state, strict=True)
    model.eval()
    return model, manager, config


def pbg_scores(
    directory: pathlib.Path, schema: GraphSchema, triples: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score global-id triples with PyTorch-BigGraph, one edge at a time (its own bucket's embeddings).

    :returns: ``[T]`` head-prediction scores (PBG's ``lhs_pos``: ``c(u, h_r(v))``) and ``[T]``
        tail-prediction scores (``rhs_pos``: ``c(g_r(u), v)``)
    """
    model, manager, config = pbg_model(directory)
    types = schema.entity_types
    partition, offset, entity_type = schema.entity_partition, schema.entity_offset, schema.entity_type
    cache: dict[tuple[str, int], torch.nn.Parameter] = {}

    def rows(entity: int) -> tuple[str, torch.nn.Parameter]:
        key = (types[entity_type[entity]], int(partition[entity]))
        if key not in cache:
            cache[key] = torch.nn.Parameter(manager.read(*key)[0])
        return key[0], cache[key]

    head_scores = torch.empty(triples.shape[0])
    tail_scores = torch.empty(triples.shape[0])
    for index, (h, r, t) in enumerate(triples.tolist()):
        model.set_embeddings(*rows(h), Side.LHS)
        model.set_embeddings(*rows(t), Side.RHS)
        relation = torch.tensor([r]) if config.dynamic_relations else torch.tensor(r)
        edges = EdgeList(EntityList.from_tensor(offset[[h]]), EntityList.from_tensor(offset[[t]]), relation)
        with torch.no_grad():
            scores = model(edges)
        head_scores[index], tail_scores[index] = scores.lhs_pos[0], scores.rhs_pos[0]
    return head_scores, tail_scores


def run(tool: str, *args: str, cwd: pathlib.Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run one of torchbiggraph's command-line tools (raises with its output if it fails)."""
    result = subprocess.run([str(BIN / tool), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        raise AssertionError(f"{tool} {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def import_one_relation(
    path: pathlib.Path, lines: str, lhs: str, relation: str, rhs: str, num_partitions: int
) -> tuple[Any, dict[str, Any]]:
    """Import the TSV ``lines`` of one relation from entity type ``lhs`` to ``rhs``, each in ``num_partitions``.

    :returns: the typed graph and its PyTorch-BigGraph config (dimension 8, ``diagonal`` + ``dot``)
    """
    from pykeen_bess import pbg

    path.write_text(lines)
    config = dict(
        entities={lhs: {"num_partitions": num_partitions}, rhs: {"num_partitions": num_partitions}},
        relations=[{"name": relation, "lhs": lhs, "rhs": rhs, "operator": "diagonal"}],
        dimension=8,
        comparator="dot",
    )
    return pbg.import_tsv(path, config=config), config
