"""The CPU's updates of a static step's rows: the step's distinct rows, found on the host, updated once each.

On the CPU reading a value costs no synchronisation, so :class:`~pykeen_bess.training.steps.static_update.StaticUpdate`
hands the rows to :class:`HostRows` there (:attr:`~pykeen_bess.training.steps.static_update.StaticUpdate.host_rules`):

* **sums**: ``torch.unique`` numbers the step's distinct rows; every table's occurrence gradients
  ``[N, W]`` are summed into ``[U, W]``, and each row's values are taken from one of its occurrences (the
  step's looked-up values, in cache, rather than the table's rows read again);
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

import torch

from ...tables.optim import BessOptimizer
from ...tables.representation import ShardedEmbedding
from ...tables.row_rules import RULES, state_shapes
from .static_rules import StepRows

__all__ = ["HostRows"]


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
        """Sum every table's occurrence gradients per distinct row; take the rows' values from their occurrences.

        :param rows: shape: ``[N]``, the flat local row of every occurrence
        :param values: per trainable table, shape: ``[N, W]``, the occurrences' values as the step read them (every
            occurrence of a row has its row's values: one of them is taken, not the table read again)
        :param grads: per trainable table, shape: ``[N, W]`` (None: no gradient)
        :param real: shape: ``[N]``, whether an occurrence belongs to a real slot or negative (None: all do)
        :returns: the distinct rows ``[U]`` (each its own first occurrence), their values and summed gradients
        """
        distinct, group = torch.unique(rows, return_inverse=True)
        count, most = distinct.numel(), rows.numel()
        if real is not None:  # a row is updated if any occurrence is real
            real = torch.zeros_like(distinct).index_add_(0, group, real.long()) > 0
        summed = [
            None if grad is None else self._buffer(("summed", i), grad, count, most).zero_().index_add_(0, group, grad)
            for i, grad in enumerate(grads)
        ]
        old: list[torch.Tensor] = []
        if self.optimizer.sparse_groups:  # (the row rules' input; the user's optimizer updates dense groups whole)
            # an occurrence of every distinct row (the step's values are in cache; the table's rows are not)
            occurrence = torch.empty_like(distinct).scatter_(0, group, torch.arange(most, device=rows.device))
            old = [
                torch.index_select(value, 0, occurrence, out=self._buffer(("old", i), value, count, most))
                for i, value in enumerate(values)
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
