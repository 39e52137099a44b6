"""The CPU's updates of a static step's rows: the step's distinct rows, found on the host, updated once each.

On the CPU reading a value costs no synchronisation, so :class:`~pykeen_bess.training.steps.static_update.StaticUpdate`
hands the rows to :class:`HostRows` there (:attr:`~pykeen_bess.training.steps.static_update.StaticUpdate.host_rules`):

* **sums**: one sort numbers the step's distinct rows (:func:`distinct_rows`); every table's occurrence
  gradients ``[N, W]`` are summed into ``[U, W]``, and each row's value is taken from its first occurrence
  among the values the step looked up (contiguous, not read from the table again);
* **updates**: the eager step's in-place rules (:meth:`~pykeen_bess.tables.row_rules.RowRule.update_`: lazy Adam
  in PyTorch's fused kernel, one pass, where the device-tensor rule takes about ten and its gate three
  more) on those rows; a step with a non-finite loss writes nothing, and rows only padding slots looked
  up are left out, by indices read on the host;
* **buffers kept across steps**: the sums, values and state rows are read into buffers of the most
  rows a step can have, narrowed to the step's count, so that the C library's allocator does not map
  (and the kernel zero) fresh pages every step: about 1,000 page faults a step otherwise (DistMult
  d256, batch 512, 64 negatives), more than the step's arithmetic costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...tables.optim import BessOptimizer
from ...tables.representation import ShardedEmbedding
from ...tables.row_rules import RULES, state_shapes
from .static_rules import StepRows

__all__ = ["HostRows", "distinct_rows"]


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return the sorted distinct rows ``[U]``, every occurrence's number among them ``[N]``, their first occurrences.

    ``torch.unique(rows, return_inverse=True)`` and the first occurrences, from one sort of ``row * 2^b +
    position`` keys (numpy's sort of integers; ``b`` bits hold a position): about half the time of torch's
    ``unique`` for a step's few thousand rows, which sorts values and positions apart. Rows outside
    ``[0, 2^(63 - b))`` take torch's ``unique`` and a scatter for the first occurrences instead.

    :param rows: shape: ``[N]``, int64 on the CPU, rows with repetitions
    """
    n = rows.numel()
    bits = max(1, (n - 1).bit_length())
    if n == 0 or int(rows.min()) < 0 or int(rows.max()) >= 1 << (63 - bits):
        distinct, group = torch.unique(rows, return_inverse=True)
        positions = torch.arange(n, dtype=torch.long)
        first = torch.full_like(distinct, n).scatter_reduce_(0, group, positions, reduce="amin")
        return distinct, group, first
    keys = np.left_shift(rows.numpy(), bits)
    keys |= np.arange(n, dtype=np.int64)
    keys.sort()
    ordered = keys >> bits
    starts = np.empty(n, dtype=bool)
    starts[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    numbers = np.cumsum(starts)
    numbers -= 1
    positions = keys & ((1 << bits) - 1)
    group = np.empty(n, dtype=np.int64)
    group[positions] = numbers
    return torch.from_numpy(ordered[starts]), torch.from_numpy(group), torch.from_numpy(positions[starts])


class HostRows:
    """Sums and updates a static step's distinct rows on the CPU, in buffers kept across steps."""

    def __init__(self, optimizer: BessOptimizer, trainable: Sequence[ShardedEmbedding]):
        """Update the rows of the trainable tables with the optimizer's row rule and state.

        :param optimizer: the loop's optimizer (its row state is read and written through the tables' tiers)
        :param trainable: the trainable shard tables, in the order of the step's gradients
        """
        self.optimizer = optimizer
        self.trainable = list(trainable)
        self._buffers: dict[tuple, torch.Tensor] = {}

    def sums(
        self,
        rows: torch.Tensor,
        values: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        real: torch.Tensor | None,
    ) -> StepRows:
        """Sum every table's occurrence gradients per distinct row; take the rows' values from their first occurrences.

        :param rows: shape: ``[N]``, the flat local row of every occurrence
        :param values: per trainable table, shape: ``[N, W]``, the occurrences' values as the step looked them up
            (the tables are unchanged until the update: a distinct row's value is any of its occurrences')
        :param grads: per trainable table, shape: ``[N, W]`` (None: no gradient)
        :param real: shape: ``[N]``, whether an occurrence belongs to a real slot or negative (None: all do)
        :returns: the distinct rows ``[U]`` (each its own first occurrence), their values and summed gradients
        """
        distinct, group, first = distinct_rows(rows)
        count, most = distinct.numel(), rows.numel()
        if real is not None:  # a row is updated if any occurrence is real
            real = torch.zeros_like(distinct).index_add_(0, group, real.long()) > 0
        summed = [
            None if grad is None else self._buffer(("summed", i), grad, count, most).zero_().index_add_(0, group, grad)
            for i, grad in enumerate(grads)
        ]
        old = [  # (the row rules' input; the user's optimizer updates tables in the dense groups whole)
            torch.index_select(occurrences, 0, first, out=self._buffer(("old", i), occurrences, count, most))
            for i, occurrences in enumerate(values)
            if self.optimizer.sparse_groups
        ]
        first = torch.ones_like(distinct, dtype=torch.bool)
        return StepRows(rows=distinct, first=first, real=real, old=old, summed=summed, most=most)

    def update(self, step_rows: StepRows, applied: bool, counts: Sequence[torch.Tensor | None]) -> None:
        """Apply the row rule to the rows of :meth:`sums` (nothing if the step is not applied).

        :param step_rows: from :meth:`sums`
        :param applied: whether the step's loss is finite
        :param counts: per trainable table, its step count including this step (None: no gradient)
        """
        if not applied:
            return
        rows = step_rows.rows
        keep = None if step_rows.real is None else step_rows.real.nonzero().view(-1)
        group = self.optimizer.sparse_groups[0]
        rule = group["rule"]
        for i, (table, old, summed, count) in enumerate(zip(self.trainable, step_rows.old, step_rows.summed, counts)):
            if summed is None or count is None:
                continue
            param, storage = table.optimizer_parameter, table.storage
            values, written = old, rows
            if keep is not None:
                values, summed, written = old.index_select(0, keep), summed.index_select(0, keep), rows[keep]
            row_state: dict[str, Any] = storage.row_state(table, self.optimizer.state[param])
            names = list(state_shapes(rule, table.weight.shape, group))
            state_rows = {
                name: storage.read(
                    row_state[name],
                    written,
                    out=self._buffer((name, i), row_state[name], written.numel(), step_rows.most),
                )
                for name in names
            }
            row_mean = table.row_mean if RULES[rule].whole_rows else None
            new, new_state = RULES[rule].update_(values, summed, state_rows, group, float(count), row_mean)
            constraint = self.optimizer._row_constraints.get(id(param))
            if constraint is not None:
                new = constraint(new)
            storage.write(table.weight, written, new)
            for name in names:
                storage.write(row_state[name], written, new_state[name])

    def _buffer(self, key: tuple, like: torch.Tensor, count: int, most: int) -> torch.Tensor:
        """Return ``[count, *like.shape[1:]]`` of a buffer of at least ``most`` rows, kept across steps."""
        buffer = self._buffers.get(key)
        if (
            buffer is None
            or buffer.shape[0] < count
            or buffer.shape[1:] != like.shape[1:]
            or buffer.dtype != like.dtype
        ):
            buffer = torch.empty((max(count, most), *like.shape[1:]), dtype=like.dtype, device=like.device)
            self._buffers[key] = buffer
        return buffer[:count]
