"""Let torch's optimizers run their capturable form on the CPU, as a GPU's static step runs it.

``torch.optim``'s optimizers refuse ``capturable=True`` for parameters outside an accelerator (an
assertion on the device type, made before any arithmetic). The arithmetic itself is device-generic, and
the CPU tests of a GPU's static step (``StaticUpdate.host_rules = False``) run it, so the device types
allowed are widened by the CPU here; nothing else changes.

The capturable form computes Adam's bias correction from the step count tensor (in the default dtype)
and orders its arithmetic differently from the plain form (Python floats): in float32 the two differ by
float32 rounding, in float64 by float64 rounding. Tests that compare a GPU's updates with the CPU's to
float64-level tolerances run in float64 (:func:`default_dtype`).
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections.abc import Iterator

import torch
import torch.optim

__all__ = ["allow_capturable_on_the_cpu", "default_dtype"]


def allow_capturable_on_the_cpu() -> None:
    """Add the CPU to the device types every ``torch.optim`` module accepts with ``capturable=True``."""
    for info in pkgutil.iter_modules(torch.optim.__path__):
        module = importlib.import_module(f"torch.optim.{info.name}")
        original = getattr(module, "_get_capturable_supported_devices", None)
        if original is None or getattr(original, "with_the_cpu", False):
            continue

        def with_the_cpu(*args, _original=original, **kwargs) -> list[str]:
            return [*_original(*args, **kwargs), "cpu"]

        with_the_cpu.with_the_cpu = True  # type: ignore[attr-defined]
        module._get_capturable_supported_devices = with_the_cpu  # type: ignore[attr-defined]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Within the block, models, tables and optimizer step counts are made in ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
