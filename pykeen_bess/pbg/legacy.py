"""PyTorch-BigGraph's pre-release input layout (count files as ``.pt``, 1-based partitions), read as a legacy import.

PyTorch-BigGraph 1.0 cannot read it; this module can. The layout differs from 1.0's in:

* entity counts ``entity_count_{type}_{part}.pt`` (and ``dynamic_rel_count.pt``): ``torch.save`` of
  an integer; partitions numbered from 1;
* edge files ``edges_{lhs}_{rhs}.h5`` with 1-based partition numbers and 1-based entity offsets
  (``rel`` indexes the config's relations from 0), without ``format_version``;
* config keys in mixed case, ``outdir`` (the checkpoint directory) and ``loadPath`` (initial
  embeddings) instead of ``checkpoint_path`` and ``init_path`` (mapped by
  :func:`~pykeen_bess.pbg.config.normalize_config`);
* checkpoints: ``{type}_{part}.pt`` (a tuple of the embeddings, possibly an ``nn.Parameter``, and
  their optimizer state), ``METADATA_1.pt`` (a tuple: the config, two iteration integers, the
  model's state dict without the entity embeddings, the optimizer state) and ``CHECKPOINT_VERSION``
  (the latest version, ASCII); a checkpoint's files end in ``.{version}``, and without
  ``CHECKPOINT_VERSION`` they carry no suffix.

The files are pickles: read them only from sources you trust (as any PyTorch checkpoint).
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Mapping
from typing import Any

import torch

from .config import relation_weights
from .schema import GraphSchema

__all__ = [
    "is_legacy_checkpoint",
    "is_legacy_entity_path",
    "read_legacy_checkpoint",
    "read_legacy_entities",
]

LEGACY_VERSION_FILE = "CHECKPOINT_VERSION"
METADATA_FILE = "METADATA_1.pt"


def is_legacy_entity_path(entity_path: pathlib.Path) -> bool:
    """Whether an entity path holds the pre-release count files (``.pt``) and no 1.0 ones (``.txt``)."""
    return any(entity_path.glob("entity_count_*.pt")) and not any(entity_path.glob("entity_count_*.txt"))


def is_legacy_checkpoint(directory: pathlib.Path) -> bool:
    """Whether a checkpoint directory is in the pre-release layout."""
    return (directory / LEGACY_VERSION_FILE).is_file() or any(directory.glob(f"{METADATA_FILE}*"))


def _load_integer(path: pathlib.Path) -> int:
    if not path.is_file():
        raise FileNotFoundError(f"Pre-release PyTorch-BigGraph count file {path} is missing.")
    value = torch.load(path, weights_only=False)
    if torch.is_tensor(value):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{path} must hold a pickled non-negative integer, not {value!r}.")
    return value


def read_legacy_entities(entity_path: pathlib.Path, config: Mapping[str, Any]) -> tuple[GraphSchema, None]:
    """Read the pre-release entity counts (1-based partitions) and relation types; the layout has no names."""
    types = list(config["entities"])
    partition_sizes = tuple(
        tuple(
            _load_integer(entity_path / f"entity_count_{t}_{p + 1}.pt")
            for p in range(config["entities"][t]["num_partitions"])
        )
        for t in types
    )
    relations = config["relations"]
    if config["dynamic_relations"]:
        count = _load_integer(entity_path / "dynamic_rel_count.pt")
        names = tuple(f"relation_{i}" for i in range(count))
        lhs = (types.index(relations[0]["lhs"]),) * count
        rhs = (types.index(relations[0]["rhs"]),) * count
    else:
        names = tuple(r["name"] for r in relations)
        lhs = tuple(types.index(r["lhs"]) for r in relations)
        rhs = tuple(types.index(r["rhs"]) for r in relations)
    schema = GraphSchema(
        entity_types=tuple(types),
        partition_sizes=partition_sizes,
        relation_names=names,
        relation_lhs=lhs,
        relation_rhs=rhs,
        dynamic_relations=bool(config["dynamic_relations"]),
        relation_weights=relation_weights(config, len(names)),
    )
    return schema, None


def _versioned(directory: pathlib.Path, name: str, version: int | None) -> pathlib.Path:
    return directory / (name if version is None else f"{name}.{version}")


def read_legacy_checkpoint(
    directory: pathlib.Path, schema: GraphSchema
) -> tuple[dict[tuple[int, int], torch.Tensor], dict[str, torch.Tensor], Mapping[str, Any] | None, int]:
    """Read a pre-release checkpoint.

    :returns: the rows of every ``(type, 0-based partition)``, the model parameters under PyTorch-BigGraph
        1.0's dataset names (``relations/{i}/operator/{side}/{param}``), the config of the metadata file
        (None without one), and the version (0 without ``CHECKPOINT_VERSION``)
    :raises FileNotFoundError: naming a missing file
    """
    version_file = directory / LEGACY_VERSION_FILE
    version = int(version_file.read_text(encoding="ascii").strip()) if version_file.is_file() else None
    rows = {}
    for t, name in enumerate(schema.entity_types):
        for p in range(len(schema.partition_sizes[t])):
            path = _versioned(directory, f"{name}_{p + 1}.pt", version)
            if not path.is_file():
                raise FileNotFoundError(f"Pre-release PyTorch-BigGraph embeddings file {path} is missing.")
            content = torch.load(path, weights_only=False)
            embeddings = content[0] if isinstance(content, tuple | list) else content
            rows[(t, p)] = torch.as_tensor(embeddings.detach() if torch.is_tensor(embeddings) else embeddings).float()
    parameters: dict[str, torch.Tensor] = {}
    config = None
    metadata = _versioned(directory, METADATA_FILE, version)
    if metadata.is_file():
        content = torch.load(metadata, weights_only=False)
        config = content[0] if isinstance(content[0], Mapping) else None
        state = next((c for c in content[1:] if isinstance(c, Mapping) and c and _is_model_state(c)), {})
        for key, value in state.items():
            parameters[_dataset_name(key)] = torch.as_tensor(value).detach().float()
    return rows, parameters, config, version or 0


def _is_model_state(state: Mapping[str, Any]) -> bool:
    return all(isinstance(k, str) and re.match(r"^(lhs|rhs)_operators\.|^global_embs\.", k) for k in state)


def _dataset_name(key: str) -> str:
    """Map ``rhs_operators.0.diagonal`` to ``relations/0/operator/rhs/diagonal`` (PyTorch-BigGraph 1.0's names)."""
    match = re.match(r"^(lhs|rhs)_operators\.(\d+)\.(.+)$", key)
    if match:
        side, index, param = match.groups()
        return f"relations/{index}/operator/{side}/{param}"
    match = re.match(r"^global_embs\.emb_(.+)$", key)
    if match:
        return f"entities/{match.group(1)}/global_embedding"
    raise ValueError(f"Unknown parameter {key!r} in a pre-release PyTorch-BigGraph model state.")
