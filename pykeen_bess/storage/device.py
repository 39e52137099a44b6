"""The device tier: the tables as parameters of the model on its device (the default)."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .base import HeldTable, TableStorage, check_host_memory, format_bytes

__all__ = ["DeviceStorage"]


class DeviceStorage(TableStorage):
    """The tables as parameters of the model on its device (the default)."""

    name = "device"
    copies_back_after_training = True

    @property
    def storage_device(self) -> torch.device:  # noqa: D102
        return self.compute_device

    def create_table(  # noqa: D102
        self, label: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, trainable: bool
    ) -> torch.Tensor:
        return nn.Parameter(torch.zeros(tuple(shape), dtype=dtype, device=device), requires_grad=trainable)

    def attach_index(self, module: nn.Module, name: str, index: torch.Tensor) -> None:
        """Keep an index tensor as a buffer of the module: ``model.to`` moves it with the table."""
        module.register_buffer(name, index, persistent=False)

    def anchor_device(self, module: nn.Module, device: torch.device) -> None:
        """Nothing: the table is a parameter of the model."""

    def table_device(self, table: HeldTable) -> torch.device:  # noqa: D102
        return table.weight.device

    def optimizer_parameter(self, table: HeldTable) -> nn.Parameter:
        """Return the table itself (a parameter)."""
        return table.weight  # type: ignore[return-value]

    def gradient(self, table: HeldTable) -> torch.Tensor | None:  # noqa: D102
        return table.weight.grad

    def set_gradient(self, table: HeldTable, value: torch.Tensor | None) -> None:  # noqa: D102
        table.weight.grad = value

    def clear_gradient(self, table: HeldTable) -> None:
        """Nothing: the optimizer's ``zero_grad`` clears a parameter's gradient."""

    def lookup_rows(self, weight: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:  # noqa: D102
        if isinstance(rows, slice):
            return weight[rows]
        return weight.index_select(0, rows.to(weight.device))

    def draws_in_chunks(self, num_bytes: int, limit: int) -> bool:
        """Never: the full table fits where the tables live."""
        return False

    def row_state(self, table: HeldTable, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """Return the optimizer's state of the parameter (created at its first step)."""
        return optimizer_state

    def reset_row_state(self, table: HeldTable, shapes: Mapping[str, tuple[Sequence[int], float]]) -> None:
        """Nothing: a parameter's state is created at its first step."""

    def release_table(self, table: HeldTable) -> None:
        """Nothing: the tables are parameters of the model."""

    def check_updates(self, sparse_updates: bool) -> None:
        """Any updates: dense ones too."""

    def check_meta_model(self) -> None:  # noqa: D102
        raise ValueError(
            "The model was built on the meta device (its entity tables have no memory): train it with "
            "storage='host' or storage='mmap', whose tiers allocate the shard tables."
        )

    def captured_step_obstacle(self) -> str | None:  # noqa: D102
        return None

    def state_entry(self, table: HeldTable, directory: pathlib.Path | None, omit_weight: bool) -> dict[str, Any] | None:
        """None: the table is a parameter of the model, in the state dict already."""
        return None

    def _gather(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return tensor.index_select(0, rows)  # on the device the arithmetic runs on

    def place(self, label: str, shape: Sequence[int], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:  # noqa: D102
        return torch.full(tuple(shape), fill, dtype=dtype, device=self.compute_device)

    def check_capacity(self, num_bytes: int, device: torch.device) -> None:  # noqa: D102
        if device.type != "cuda":
            check_host_memory(num_bytes, self.name)
            return
        free, _ = torch.cuda.mem_get_info(device)
        if num_bytes > free:
            raise MemoryError(
                f"The shard tables and their optimizer state need {format_bytes(num_bytes)} on "
                f"{device}, which has {format_bytes(free)} free. Keep them in host memory "
                f"(storage='host') or in files (storage='mmap'), use optimizer='rowwise_adagrad' (one float of state "
                f"per row), or use more shards."
            )
