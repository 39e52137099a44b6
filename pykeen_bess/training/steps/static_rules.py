"""The rules' side of the static step: the gated, fused rule, the step's rows and its step counts.

* :func:`gated_rule` applies a rule's device form (:meth:`~pykeen_bess.tables.row_rules.RowRule.apply`)
  and a constraint, keeping the old values where a step is not applied (a non-finite loss, or a
  padding row);
* :class:`FusedRule` is that function compiled by ``torch.compile`` on CUDA (a few kernels instead of
  about ten elementwise passes), one per static step;
* :func:`occurrence_groups` numbers a step's distinct rows without a host read (fixed shapes);
* :class:`StepRows` holds the rows a step updates, with their summed gradients;
* :class:`StepCounts` holds the step counts on the device.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "FusedRule",
    "StepCounts",
    "StepRows",
    "gated_rule",
    "occurrence_groups",
]

logger = logging.getLogger(__name__)


def _gate(mask: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``where(mask, new, old)`` with a 0-dimensional mask or one value per leading row (``[U]``)."""
    if mask.dim() == 1 and new.dim() > 1:
        mask = mask.view(-1, *([1] * (new.dim() - 1)))
    return torch.where(mask, new, old)


def gated_rule(
    rule: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
    old: torch.Tensor,
    grad: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    group: Mapping[str, Any],
    step: torch.Tensor,
    lr: torch.Tensor,
    ok: torch.Tensor,
    constraint: Callable[[torch.Tensor], torch.Tensor] | None = None,
    **rule_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Apply a rule and a constraint to values ``[U, *]``; return the new values, or the old ones where ``ok`` is False.

    :param rule: a rule's device form (:meth:`~pykeen_bess.tables.row_rules.RowRule.apply`)
    :param old: the current values
    :param grad: their gradient
    :param state: the rule's state of the values
    :param group: the hyper-parameters
    :param step: the step count including this step (a 0-dimensional tensor)
    :param lr: the learning rate (a 0-dimensional tensor)
    :param ok: whether to apply the step: a 0-dimensional bool tensor, or one per row ``[U]``
    :param constraint: applied to the new values (e.g. a projection to unit norm), or None
    :param rule_kwargs: passed to the rule (row-wise Adagrad's ``squared_mean`` over whole rows)
    :returns: the values and the state to write
    """
    new, new_state = rule(old, grad, state, group, step, lr, **rule_kwargs)
    if constraint is not None:
        new = constraint(new)
    return _gate(ok, new, old), {name: _gate(ok, value, state[name]) for name, value in new_state.items()}


class FusedRule:
    """:func:`gated_rule` compiled by ``torch.compile`` on CUDA; as written elsewhere, or once compiling failed.

    Every instance (one per static step) compiles its own copy of the function. ``torch.compile`` keeps
    its compiled variants on a function's code object, one per rule, hyper-parameters (Python numbers
    in the parameter group: betas, eps) and shapes, up to a limit (8 by default) beyond which the
    function runs uncompiled: one process that trains many models (an HPO study's trials, a benchmark)
    would reach it with a shared function. A copy's variants are not looked up again once its step is gone,
    but torch keeps the compiled code for the rest of the process (about 3 MiB per step, measured on the CPU).
    """

    #: compile on every device (tests compile on the CPU)
    everywhere = False

    def __init__(self) -> None:
        self.compiled: Any = None
        self.failed = False

    def __call__(self, device: torch.device, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Apply :func:`gated_rule` to ``args`` (compiled on CUDA, where values live on ``device``)."""
        if self.failed or (device.type != "cuda" and not self.everywhere):
            return gated_rule(*args, **kwargs)
        if self.compiled is None:
            self.compiled = torch.compile(_own_copy(gated_rule))
        try:
            return self.compiled(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a compiler failure falls back to the same function, uncompiled
            self.failed = True
            logger.warning("BESS: the static step's updates could not be compiled (%s); they run uncompiled.", error)
            return gated_rule(*args, **kwargs)


def _own_copy(function: Callable) -> Callable:
    """Return ``function`` with a code object of its own (where ``torch.compile`` keeps what it compiled)."""
    code = function.__code__.replace()
    globals_, defaults, closure = function.__globals__, function.__defaults__, function.__closure__
    copy = types.FunctionType(code, globals_, function.__name__, defaults, closure)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    return copy


def occurrence_groups(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the number of every occurrence's row among the distinct rows, without a host read (fixed shapes).

    :param rows: shape: ``[N]``, rows with repetitions
    :returns: ``group`` ``[N]``, the number (``0 .. G - 1``, in sorted order) of every occurrence's row, and
        ``first`` ``[N]``, whether an occurrence is the first of its row (one per row)
    """
    ordered, order = torch.sort(rows, stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    group = torch.empty_like(rows).scatter_(0, order, torch.cumsum(starts, 0) - 1)
    first = torch.empty_like(starts).scatter_(0, order, starts)
    return group, first


@dataclasses.dataclass(eq=False)
class StepRows:
    """The rows a step updates: every occurrence with its row's summed gradient (:meth:`StaticUpdate.row_gradients`)."""

    #: shape: ``[M]``, the flat local row of every occurrence (``M = N``, or ``R * N`` over ``R`` replicas)
    rows: torch.Tensor
    #: shape: ``[M]``, whether an occurrence is the first of its row (norms count each row once)
    first: torch.Tensor
    #: shape: ``[M]``, whether an occurrence's row is updated (a real slot or negative looked it up); None: all are
    real: torch.Tensor | None
    #: per trainable table, shape: ``[M, W]``, the rows' values before the step (the CPU reads none when the user's
    #: optimizer updates the tables whole, ``sparse_updates=False``: no row rule needs them)
    old: list[torch.Tensor]
    #: per trainable table, shape: ``[M, W]``, the row's gradient summed over its occurrences (None: no gradient)
    summed: list[torch.Tensor | None]
    #: the number of occurrences (``M`` before the host-side path keeps each row once): the most rows a step has
    most: int


class StepCounts:
    """The step counts of a static step's parameters as float64 device tensors (a captured step reads them).

    A count starts from the optimizer state's (a host tensor, read when the step is first traced) and is
    written back into it at the end of every epoch (:meth:`write`).
    """

    def __init__(self, device: torch.device):
        """Keep the counts on ``device``."""
        self.device = device
        self._counts: dict[int, torch.Tensor] = {}
        #: the parameters with a step count, and their optimizer state
        self.counted: list[tuple[torch.Tensor, dict]] = []

    def count(self, param: torch.Tensor, state: dict, ok: torch.Tensor) -> torch.Tensor:
        """Count a step of ``param`` on the device if ``ok`` (a 0-dimensional bool tensor); return the new count."""
        key = id(param)
        if key not in self._counts:
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)  # as BessOptimizer counts a table's steps
            self._counts[key] = torch.full((), float(state["step"]), dtype=torch.float64, device=self.device)
            self.counted.append((param, state))
        count = self._counts[key]
        current = count + 1
        count.copy_(torch.where(ok, current, count))
        return current

    def values(self) -> list[torch.Tensor]:
        """Return the device step counts of the counted parameters (:attr:`counted`'s order)."""
        return [self._counts[id(param)] for param, _ in self.counted]

    def write(self, counts: Sequence[float]) -> None:
        """Write the step counts (read from :meth:`values`) into the optimizer's state (at the end of an epoch)."""
        for (_, state), count in zip(self.counted, counts):
            state["step"].fill_(count)
