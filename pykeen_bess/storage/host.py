"""The host tier: the tables in host memory, each step's rows staged to the compute device and back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .base import TableStorage, check_host_memory

__all__ = ["HostStorage"]


class HostStorage(TableStorage):
    """The tables in host memory; each step's rows move to the compute device and back.

    With a CUDA compute device, reads go through two pinned staging buffers used in turn: a
    buffer is refilled only after the device copy from it has completed (a CUDA event), and
    write-backs complete before :meth:`write` returns, so the next step's reads never see rows
    older than the last update.
    """

    name = "host"

    def __init__(self) -> None:
        """Create the tier."""
        super().__init__()
        self._staging: list[torch.Tensor | None] = [None, None]
        self._events: list[Any] = [None, None]
        self._turn = 0

    def place(self, label: str, shape: Sequence[int], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:  # noqa: D102
        return torch.full(tuple(shape), fill, dtype=dtype)

    def check_capacity(self, num_bytes: int, device: torch.device) -> None:  # noqa: D102
        check_host_memory(num_bytes, self.name)

    def _gather(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if self.compute_device.type != "cuda":
            return tensor.index_select(0, rows)
        # pinned, double-buffered staging (pinning needs CUDA: never on a CPU-only build)
        turn = self._turn
        self._turn = 1 - turn
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # the previous copy out of this buffer has finished
        num_bytes = rows.numel() * tensor[0].numel() * tensor.element_size()
        buffer = self._staging[turn]
        if buffer is None or buffer.numel() < num_bytes:
            buffer = torch.empty(max(num_bytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
            self._staging[turn] = buffer
        staged = buffer[:num_bytes].view(tensor.dtype).view(rows.numel(), *tensor.shape[1:])
        torch.index_select(tensor, 0, rows, out=staged)
        result = staged.to(self.compute_device, non_blocking=True)
        recorded = torch.cuda.Event()
        recorded.record()
        self._events[turn] = recorded
        return result
