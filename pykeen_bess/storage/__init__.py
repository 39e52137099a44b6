"""Storage tiers of the shard tables: where a process keeps its entity tables and their optimizer state.

A BESS step touches a few thousand rows of tables that may hold hundreds of millions, so the
tables need not live where the arithmetic happens. A :class:`TableStorage` (one per process,
chosen with ``training_loop_kwargs=dict(storage=...)``) holds every shard table of the process
and, for the row-sparse optimizer rules, its per-row state:

============ ================================================================================
``storage``  where the tables and their row state live
============ ================================================================================
``"device"`` :class:`DeviceStorage` (default): on the model's device, the tables as parameters
             of the model (as before storage tiers existed)
``"host"``   :class:`HostStorage`: in host memory, not parameters of the model (``model.to``
             does not move them); each step gathers its unique rows to the compute device and
             writes the updated rows and state back. On CUDA the static step stages its
             rows into fixed device buffers around every step (:mod:`.staging`)
``"mmap"``   :class:`MmapStorage`: in ``.npy`` memory maps under ``storage_path``, one file per
             table and state tensor; the operating system pages rows in and out, so tables
             may exceed the machine's memory (resident memory is the page cache, not the
             process' anonymous memory); the files reserve their disk blocks and take paging
             advice (:mod:`.disk`), and are marked with the checkpoints of their run (:mod:`.marks`)
============ ================================================================================

Every tier counts the bytes it moves (:class:`StorageTraffic`): reading a step's unique rows of a
table and of each row-state tensor, and writing them back, so a step with ``U`` unique rows of
width ``W`` and ``s`` row-state tensors of the same width moves ``U * W * (1 + s) * 4`` bytes each
way (float32). The arithmetic is the same code in every tier (:mod:`pykeen_bess.tables.optim`), so the
tiers train bitwise alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from class_resolver import ClassResolver

from .base import HeldTable, StorageTraffic, TableStorage, available_host_memory, format_bytes
from .device import DeviceStorage
from .disk import fsync
from .files import MmapStorage
from .host import HostStorage

__all__ = [
    "DeviceStorage",
    "HeldTable",
    "HostStorage",
    "MmapStorage",
    "StorageTraffic",
    "TableStorage",
    "available_host_memory",
    "format_bytes",
    "fsync",
    "make_storage",
    "storage_resolver",
]

#: resolves ``storage=`` names (``"device"``, ``"host"``, ``"mmap"``) and classes
storage_resolver: ClassResolver[TableStorage] = ClassResolver(
    [DeviceStorage, HostStorage, MmapStorage],
    base=TableStorage,  # type: ignore[type-abstract]
    suffix="Storage",
)


def make_storage(
    storage: Any = None, storage_path: str | os.PathLike | None = None, storage_kwargs: Mapping[str, Any] | None = None
) -> TableStorage:
    """Resolve ``storage=`` (a name, a class, an instance or None for the device) with its arguments.

    :raises ValueError: for an unknown name, or a ``storage_path`` given to a tier without files
    """
    if isinstance(storage, TableStorage):
        return storage
    kwargs = dict(storage_kwargs or {})
    try:
        cls = storage_resolver.lookup(storage if storage is not None else "device")
    except (KeyError, ValueError, TypeError):
        raise ValueError(
            f"Unknown storage={storage!r}; expected one of {sorted(storage_resolver.lookup_dict)} "
            f"(or a TableStorage class)."
        ) from None
    if storage_path is not None:
        if cls is not MmapStorage:
            raise ValueError(f"storage_path is the directory of storage='mmap'; storage={cls.name!r} keeps no files.")
        kwargs["storage_path"] = storage_path
    return cls(**kwargs)
