"""A shard table kept outside the model in the model's state dict (checkpoints of the host and file tiers).

:class:`~pykeen_bess.tables.representation.ShardedEmbedding` registers these hooks: a table in host memory
goes into the state dict as tensors, a table in files as the names of the files' copies in a checkpoint
(else as tensors too), and loading writes them back into the table's tier. State dicts written before
by an earlier version may name a table's live files by path: those are read from the files.
"""

from __future__ import annotations

import pathlib
from typing import Any, Protocol

import torch

from .base import HeldTable, TableStorage
from .digests import ADVICE, CorruptCheckpointError, crc32_of_file

__all__ = [
    "EXTERNAL_WEIGHT_KEY",
    "STORED_TABLE_KEY",
    "StateDictTable",
    "add_stored_table",
    "load_stored_table",
    "verify_stored_tables",
]


class StateDictTable(HeldTable, Protocol):
    """What the state-dict hooks read of a table (a :class:`~pykeen_bess.tables.representation.ShardedEmbedding`)."""

    #: the table's storage tier
    storage: TableStorage
    #: while a checkpoint is written: the directory its copies of the table's files go to; while one is
    #: read: the checkpoint's folder
    snapshot_directory: pathlib.Path | None
    #: while a checkpoint whose own files hold the rows is written: omit them
    external_weights: bool


STORED_TABLE_KEY, EXTERNAL_WEIGHT_KEY = "stored_table", "external_weight"


def add_stored_table(module: StateDictTable, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """Add a table kept outside the model (and its optimizer row state) to the model's state dict.

    Host memory: the tensors themselves. Files: while a checkpoint is written (the store sets
    :attr:`ShardedEmbedding.snapshot_directory`), copies of the flushed files in that directory,
    referenced by name; otherwise the tensors themselves (views of the memory maps), as any module's
    state dict holds its values.
    """
    entry = module.storage.state_entry(module, module.snapshot_directory, omit_weight=module.external_weights)
    if entry is None:  # a parameter of the model: its rows are in the state dict already
        if module.external_weights:
            del state_dict[prefix + "weight"]
            state_dict[prefix + EXTERNAL_WEIGHT_KEY] = True
        return
    if module.external_weights:
        entry[EXTERNAL_WEIGHT_KEY] = True
    state_dict[prefix + STORED_TABLE_KEY] = entry


def load_stored_table(
    module: StateDictTable,
    state_dict: dict,
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
) -> None:
    """Load a table kept outside the model from a state dict (the inverse of :func:`_add_stored_table`)."""
    if state_dict.pop(prefix + EXTERNAL_WEIGHT_KEY, False):  # the rows came from the checkpoint's own files
        state_dict[prefix + "weight"] = module.weight.detach()
    entry = state_dict.pop(prefix + STORED_TABLE_KEY, None)
    storage = module.storage
    written = "device" if entry is None else entry["tier"]
    if written != storage.name:
        if entry is None and prefix + "weight" not in state_dict:
            return  # not a checkpoint of this table at all (PyKEEN reports the missing keys)
        raise ValueError(
            f"This checkpoint keeps the entity tables with storage={written!r}; resume it with the same storage "
            f"(this run uses storage={storage.name!r})."
        )
    if entry is None:
        return
    if tuple(entry["shape"]) != tuple(module.weight.shape):
        raise ValueError(
            f"The checkpoint's table {entry['label']} has shape {entry['shape']}, not {tuple(module.weight.shape)}."
        )
    targets = {"weight": module.weight, **{f"state.{name}": value for name, value in module.row_state.items()}}
    if entry.get(EXTERNAL_WEIGHT_KEY):
        del targets["weight"]
    sources = entry["tensors"] if "tensors" in entry else entry["files"]
    if set(sources) != set(targets):
        raise ValueError(
            f"The checkpoint's table {entry['label']} has optimizer state {sorted(sources)}, this run "
            f"{sorted(targets)} (another optimizer?)."
        )
    for key, target in targets.items():
        source = sources[key]
        if isinstance(source, str):
            if entry["directory"] is None:  # the live files of a state dict taken outside a checkpoint
                file = pathlib.Path(source)
            elif module.snapshot_directory is None:
                raise ValueError(
                    f"The table files of {entry['label']} are in a checkpoint; load it with the training loop."
                )
            else:  # a checkpoint's copy, in a directory next to the checkpoint
                file = module.snapshot_directory / entry["directory"] / source
            storage.restore(target, file)
        else:
            with torch.no_grad():
                target.copy_(source)


def verify_stored_tables(model_state: dict[str, Any], directory: pathlib.Path) -> None:
    """Check the copies of tables in files that a checkpoint's model state names against their digests.

    :param model_state: the checkpoint's model state dict (its ``*.stored_table`` entries name the copies)
    :param directory: the checkpoint's folder (the copies are in a directory next to the checkpoint)
    :raises CorruptCheckpointError: naming the copy whose values differ from what was written
    :raises FileNotFoundError: if a copy is missing
    """
    for key, entry in model_state.items():
        if not key.endswith(STORED_TABLE_KEY) or not isinstance(entry, dict) or entry.get("directory") is None:
            continue
        for name, digest in entry.get("digests", {}).items():
            file = pathlib.Path(directory) / entry["directory"] / entry["files"][name]
            if not file.is_file():
                raise FileNotFoundError(f"The checkpoint's table file {file} is missing.")
            if crc32_of_file(file) != int(digest):
                raise CorruptCheckpointError(
                    f"Checkpoint file {file} is corrupted: it differs from what was written (CRC-32 mismatch). {ADVICE}"
                )
