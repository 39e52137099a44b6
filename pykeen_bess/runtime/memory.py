"""Automatic memory search: the largest batch (or slice) that fits, agreed by all processes.

PyKEEN's own training-time search probes one process at a time and catches out-of-memory
errors; under a process group one rank running out of memory while the others wait in a
collective deadlocks. Here a *probe* runs the memory-relevant work of one step without
communicating (see :class:`pykeen_bess.distributed.ProbeTopology`), each process decides whether it
fitted, and the processes agree through an all-reduce of the failure flags, so every rank takes
the same decision.

"Fits" means: no out-of-memory error (:func:`torch_max_mem.api.is_oom_error`) and, on the
CPU, where exhausting memory summons the operating system's OOM killer instead of raising, a
measured peak below a budget (by default half of the memory available when the search starts;
the peak is read from ``/proc/self/status`` after resetting it through ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
from collections.abc import Callable, Iterator

import torch
from torch_max_mem.api import is_oom_error

from ..distributed import Topology

__all__ = [
    "measure_peak",
    "available_memory",
    "fits_in_memory",
    "search_largest",
]

logger = logging.getLogger(__name__)

_PROC_STATUS = "/proc/self/status"


def _read_status(field: str) -> int | None:
    try:
        with open(_PROC_STATUS) as file:
            match = re.search(rf"^{field}:\s+(\d+)\s+kB", file.read(), flags=re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:
        return False
    return True


class _Peak:
    """The result of :func:`measure_peak`: the peak bytes above the baseline (None if unknown)."""

    bytes: int | None = None


@contextlib.contextmanager
def measure_peak(device: torch.device) -> Iterator[_Peak]:
    """Measure the peak memory allocated by the enclosed code above the memory in use before.

    :param device: the device whose memory to measure
    :yields: an object whose ``bytes`` attribute holds the peak after the block (None if the
        platform offers no measurement)
    """
    result = _Peak()
    # the young generations only: a full collection costs ~0.2 s in a process with PyKEEN loaded, and the
    # tensors of a finished probe are freed by reference counting (an out-of-memory error is collected fully
    # by fits_in_memory)
    gc.collect(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result.bytes = torch.cuda.max_memory_allocated(device) - baseline
        return
    cpu_baseline = _read_status("VmRSS") if _reset_cpu_peak() else None
    yield result
    peak = _read_status("VmHWM")
    if cpu_baseline is not None and peak is not None:
        result.bytes = max(peak - cpu_baseline, 0)


def available_memory(device: torch.device) -> int | None:
    """Return the memory currently available on a device, in bytes (None if unknown)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return _read_status_meminfo()


def _read_status_meminfo() -> int | None:
    try:
        with open("/proc/meminfo") as file:
            match = re.search(r"^MemAvailable:\s+(\d+)\s+kB", file.read(), flags=re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def fits_in_memory(run: Callable[[], None], device: torch.device, budget: int | None) -> tuple[bool, int | None]:
    """Run ``run`` and report whether it fitted.

    :param run: the probe
    :param device: the device to measure
    :param budget: the maximum peak in bytes (None: only out-of-memory errors count)
    :returns: whether it fitted, and the measured peak in bytes (None if unknown)
    :raises RuntimeError: any error of ``run`` that is not an out-of-memory error
    """
    try:
        with measure_peak(device) as peak:
            run()
    except (RuntimeError, MemoryError) as error:
        if isinstance(error, RuntimeError) and not is_oom_error(error):
            raise
        logger.debug("probe ran out of memory: %s", error)
        del error  # the traceback's frames may hold the probe's tensors in reference cycles
        gc.collect()
        return False, None
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if budget is not None and peak.bytes is not None and peak.bytes > budget:
        return False, peak.bytes
    return True, peak.bytes


def search_largest(
    fits: Callable[[int], bool],
    start: int,
    maximum: int,
    topology: Topology,
    description: str = "value",
) -> tuple[int, bool]:
    """Find the largest power-of-two multiple/fraction of ``start`` that fits, on all processes.

    The search doubles while the value fits and stays at most ``maximum``, and halves while it
    does not. Every decision is the logical AND of all processes' results (one all-reduce).

    :param fits: ``fits(value)`` runs a local probe and returns whether it fitted
    :param start: the first value to try (``>= 1``)
    :param maximum: the largest meaningful value
    :param topology: the process topology whose processes agree
    :param description: what is searched, for log messages
    :returns: the value and whether it fitted (False: even 1 did not fit)
    """

    def agreed(value: int) -> bool:
        ok = bool(fits(value))
        everywhere = topology.agree(ok)
        logger.debug("memory search: %s=%d fits=%s (all processes: %s)", description, value, ok, everywhere)
        return everywhere

    value = max(1, min(start, maximum))
    if agreed(value):
        while value * 2 <= maximum and agreed(value * 2):
            value *= 2
        logger.info("memory search: largest %s that fits is %d", description, value)
        return value, True
    while value > 1:
        value //= 2
        if agreed(value):
            logger.info("memory search: largest %s that fits is %d", description, value)
            return value, True
    return 1, False
