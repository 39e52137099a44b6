"""How a step's host tensors (indices, masks, regularization weights) reach the compute device.

The eager step copies them at every use (:class:`DeviceCopies`); the static step keeps the copies of
a step kind (:class:`CachedDeviceCopies`), so that a captured step reads them from device memory.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["UNCACHED", "CachedDeviceCopies", "DeviceCopies"]


class DeviceCopies:
    """How a step's host tensors (indices, masks, regularization weights) reach the compute device: copied at each use.

    The step passes its copies down to the lookups (:meth:`~pykeen_bess.schemes.ExchangeScheme.scores`).
    The eager step copies every time (this class); the static step keeps them
    (:class:`CachedDeviceCopies`), so that a captured step reads them from device memory.
    """

    def copy(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Return a CPU tensor on ``device``."""
        return tensor if tensor.device == device else self._keep(("copy", tensor), device, lambda: tensor.to(device))

    def index(self, selected: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Return the positions ``[k]`` of the True entries of a CPU mask on ``device``."""
        index = selected.nonzero().view(-1)
        return self._keep(("index", index), device, lambda: index.to(device))

    def weights(self, weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Return CPU weights (flat) on the device of ``like``, in its real dtype.

        Weights computed on that device already (a static step's typed negatives) are only cast.
        """
        dtype = like.dtype.to_real()
        flat = weights.reshape(-1)
        if flat.device == like.device:
            return flat.to(dtype)
        return self._keep(("weights", flat, dtype), like.device, lambda: flat.to(like.device, dtype))

    def _keep(self, key: tuple, device: torch.device, make: Any) -> torch.Tensor:
        """Return ``make()`` (a copy to ``device`` of the key's CPU tensor)."""
        return make()


class CachedDeviceCopies(DeviceCopies):
    """Device copies kept by content: a static step's plan is the same in every step of a kind.

    A step whose plan is the same in every step (all slots real) has the same regularization groups
    and masks every step: the first run copies each to the device once, later runs (and a CUDA graph
    captured from them) use those copies, so no host-to-device copy happens inside the step.
    """

    def __init__(self) -> None:
        """Keep no copies yet."""
        self._copies: dict[tuple, torch.Tensor] = {}

    def tensors(self) -> list[torch.Tensor]:
        """Return the copies kept (device memory a captured step reads)."""
        return list(self._copies.values())

    def _keep(self, key: tuple, device: torch.device, make: Any) -> torch.Tensor:
        kind, tensor, *rest = key
        content = (kind, str(device), *map(str, rest), str(tensor.dtype), tuple(tensor.shape), tensor.numpy().tobytes())
        if content not in self._copies:
            self._copies[content] = make()
        return self._copies[content]


#: the copies of a step that keeps none (the eager step's)
UNCACHED = DeviceCopies()
