"""PyKEEN's Lp / power-sum regularizers of rows whose coordinates are spread over column parts (the encoding partition).

See :mod:`pykeen_bess.tables.encoding`.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from pykeen.regularizers import LpRegularizer, PowerSumRegularizer, Regularizer
from pykeen.utils import get_expected_norm

__all__ = ["ColumnRegularizer"]


class ColumnRegularizer(Regularizer):
    """PyKEEN's Lp / power-sum regularizer of rows whose coordinates are spread over column parts.

    The per-row power sums of the parts are summed over the parts (differentiably), then the
    regularizer's norm and normalisation by the full dimension apply, so every part computes the
    whole term. The weight is the wrapped regularizer's (:attr:`weight`).
    """

    def __init__(self, regularizer: Regularizer, topology: Any, dim: int):
        """Wrap ``regularizer`` (its weight and settings) for rows of ``dim`` coordinates in all.

        :raises ValueError: for other regularizers, and norms other than finite ``p > 0`` (a maximum of the
            parts' coordinates is no sum of the parts)
        """
        if type(regularizer) not in (LpRegularizer, PowerSumRegularizer) or regularizer.dim != -1:
            raise ValueError(
                f"partition='encoding' over several processes supports LpRegularizer and PowerSumRegularizer "
                f"(dim=-1), not {regularizer!r}; use partition='token'."
            )
        p = float(cast(Any, regularizer).p)
        if not (math.isfinite(p) and p > 0):
            raise ValueError(
                f"partition='encoding' over several processes supports regularizers of a finite p > 0, not "
                f"p={p} ({regularizer!r}): the parts' coordinates are summed; use partition='token'."
            )
        super().__init__(weight=1.0, apply_only_once=regularizer.apply_only_once)
        del self._buffers["weight"]  # the wrapped regularizer's (see weight)
        self.regularization_term = torch.zeros_like(regularizer.regularization_term)  # (its dtype: float64 stays)
        self.base = regularizer
        self.topology = topology
        self.full_dim = dim

    @property
    def weight(self) -> torch.Tensor:
        """The wrapped regularizer's weight: a change of either one's weight (in place or a new tensor) counts."""
        base = self._modules.get("base")
        if base is None:  # while Regularizer.__init__ registers a weight of its own (dropped by __init__)
            raise AttributeError("weight")
        return cast(torch.Tensor, base.weight)

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:
        self.base.weight = value

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight if keep_vars else self.weight.detach()  # (its key as before)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        state_dict.pop(prefix + "weight", None)  # the wrapped regularizer's key loads it
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        p = float(cast(Any, self.base).p)
        partial = x.abs().pow(p).sum(dim=-1)
        value = self.topology.column_sum(partial.unsqueeze(0))
        if isinstance(self.base, LpRegularizer):
            value = value ** (1.0 / p)
            if self.base.normalize:
                value = value / get_expected_norm(p=p, d=self.full_dim)
        elif self.base.normalize:
            value = value / self.full_dim
        return value.mean()
