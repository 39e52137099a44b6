"""The memory plan of a process' shard tables: bytes per entity, totals, and bytes moved per step.

Stated (logged) and checked against the storage tier (:meth:`~pykeen_bess.storage.TableStorage.check_capacity`)
before anything is allocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .optim import SPARSE_RULES, state_shapes
from .row_rules import RULES
from ..storage import format_bytes

__all__ = [
    "MemoryPlan",
]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What one process' shard tables and their optimizer state take, stated before anything is allocated."""

    #: rows of each table held by the process (its shards, padding included)
    rows: int
    #: bytes of one row of every table together (weights)
    row_bytes: int
    #: bytes of the optimizer's row state of one row of every table (0: none, e.g. SGD)
    state_row_bytes: int
    #: the number of row-state values per table value (Adam 2, Adagrad 1, row-wise Adagrad ``1 / W``)
    state_tensors: int

    @classmethod
    def create(cls, embeddings: Sequence[Any], rows_per_table: int, optimizer: Any) -> MemoryPlan:
        """Plan the tables of ``embeddings`` (PyKEEN embeddings) with ``rows_per_table`` rows each."""
        row_bytes = state_row_bytes = tensors = 0
        rule = SPARSE_RULES.get(type(optimizer))
        group = dict(RULES[rule].defaults) if rule is not None else {}
        for embedding in embeddings:
            weight = embedding._embeddings.weight
            width, size = int(weight.shape[1]), weight.element_size()
            row_bytes += width * size
            if rule is not None:
                shapes = state_shapes(rule, (1, width), group)
                tensors = len(shapes)
                state_row_bytes += sum(int(np.prod(shape)) * size for shape, _ in shapes.values())
        return cls(
            rows=int(rows_per_table), row_bytes=row_bytes, state_row_bytes=state_row_bytes, state_tensors=tensors
        )

    @property
    def table_bytes(self) -> int:
        """Bytes of the tables."""
        return self.rows * self.row_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of the optimizer's row state."""
        return self.rows * self.state_row_bytes

    @property
    def bytes_per_entity(self) -> int:
        """Bytes per entity row (weights and optimizer state)."""
        return self.row_bytes + self.state_row_bytes

    def step_bytes(self, unique_rows: int) -> int:
        """Bytes a step moves from the tier to the compute device (and back) for ``unique_rows`` rows."""
        return unique_rows * self.bytes_per_entity

    def describe(self) -> str:
        """One line for the log."""
        return (
            f"{self.rows:,} rows per table, {self.bytes_per_entity} bytes per entity "
            f"({self.row_bytes} weights + {self.state_row_bytes} optimizer state), "
            f"{format_bytes(self.table_bytes)} tables + {format_bytes(self.state_bytes)} optimizer state"
        )
