"""Host memory allocation: keep freed tensor memory in the process instead of handing it back every step.

Torch's CPU tensors come from the C library's ``malloc``. glibc serves a block above its *mmap
threshold* (128 KiB at start, raised up to 32 MiB as such blocks are freed) with a fresh ``mmap``
and returns it with ``munmap``, and gives the top of its heap back to the kernel whenever more than
its *trim threshold* is free there. A training step allocates and frees tensors of a few MiB (the
gathered rows of a table and of its optimizer state, their updates, gradient rows), so every step
asks the kernel for fresh pages and page-faults on their first touch (in most processes; how the
thresholds move depends on where the kernel places the heap and the mappings): with ``n = 4`` logical
shards on WN18RR (about 1,900 rows of 256 floats per table and step), the optimizer's row rule took
3x longer than on reused memory and the whole step 1.45x longer (1.2x at ``n = 1``;
``benchmarks/training.py``, when this module was written). With today's step the difference is
within the noise of that benchmark (fresh processes alternating both settings), which is why the
loop and the evaluator leave the allocator alone unless asked. PyTorch's performance guide
recommends preloading jemalloc or tcmalloc on the CPU for the same reason; this module gets the
effect without a preload.

The policy is one class per choice, resolved from the ``host_allocator`` argument of
:class:`~pykeen_bess.training.BessTrainingLoop` and :class:`~pykeen_bess.evaluation.BessEvaluator`:

* :class:`RetainFreedMemory` (``"auto"`` when computing on the CPU with glibc; the command line's
  default, ``--host-allocator auto``): sets
  glibc's mmap threshold to 32 MiB and its trim threshold to 256 MiB with ``mallopt``, so blocks
  below 32 MiB come from the heap and up to 256 MiB of freed memory stay there for the next step.
  The setting is process-wide and stays in effect after the work (glibc cannot go back to its
  adaptive thresholds); the process may keep up to 256 MiB more resident than before.
* :class:`KeepAllocator` (None, the default of the loop and the evaluator: a library leaves
  process-wide state alone unless asked; also ``"auto"`` on a GPU, with another C library, or when the user
  chose for themselves: any of ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
  ``MALLOC_TOP_PAD_``, a ``glibc.malloc`` tunable in ``GLIBC_TUNABLES``, or jemalloc, tcmalloc or
  mimalloc in ``LD_PRELOAD``): the allocator is left alone.

The allocator changes where tensors live, never their values: runs are bit-identical either way.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from typing import Any, ClassVar

import torch

__all__ = [
    "AllocatorHint",
    "HostAllocator",
    "KeepAllocator",
    "RetainFreedMemory",
    "resolve_allocator",
    "user_chose_allocator",
]

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: environment variables through which a user configures the allocator themselves
_ALLOCATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
#: preloaded allocators that replace glibc's malloc
_PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


class HostAllocator:
    """How the C library's allocator serves the CPU tensors of the work (see the module docstring)."""

    #: the value of ``host_allocator`` that selects the policy, for messages
    name: ClassVar[str] = "policy"

    def apply(self) -> None:
        """Configure the allocator for the work that follows (idempotent)."""

    def describe(self) -> str:
        """Return a short description for the log."""
        return self.name


class KeepAllocator(HostAllocator):
    """Leave the allocator as it is."""

    name = "None"


class RetainFreedMemory(HostAllocator):
    """glibc's ``mallopt``: blocks up to ``mmap_threshold`` from the heap, up to ``trim_threshold`` kept free there."""

    name = "auto"
    #: whether a policy of this class configured this process already (mallopt is process-wide)
    applied: ClassVar[bool] = False

    def __init__(self, mmap_threshold: int = 32 * 2**20, trim_threshold: int = 256 * 2**20, libc: Any = None):
        """Create the policy.

        :param mmap_threshold: blocks of at least this many bytes are mapped and unmapped one by one
            (glibc accepts at most 32 MiB on 64-bit systems)
        :param trim_threshold: the free bytes at the top of the heap above which it is trimmed
        :param libc: the C library (default: this process's); tests pass a stand-in
        """
        self.mmap_threshold = mmap_threshold
        self.trim_threshold = trim_threshold
        self._libc = libc

    def apply(self) -> None:
        """Set both thresholds once per process; log a warning if glibc refuses."""
        if type(self).applied:
            return
        libc = self._libc if self._libc is not None else ctypes.CDLL(None)
        refused = [
            name
            for name, parameter, value in (
                ("M_MMAP_THRESHOLD", _M_MMAP_THRESHOLD, self.mmap_threshold),
                ("M_TRIM_THRESHOLD", _M_TRIM_THRESHOLD, self.trim_threshold),
            )
            if libc.mallopt(ctypes.c_int(parameter), ctypes.c_int(value)) != 1
        ]
        if refused:
            logger.warning("glibc refused mallopt(%s); the allocator keeps its defaults there.", ", ".join(refused))
        else:
            logger.info(
                "host allocator: blocks below %d MiB from glibc's heap, up to %d MiB of freed memory kept there "
                "(pykeen_bess.runtime.allocator; host_allocator=None leaves the allocator alone)",
                self.mmap_threshold // 2**20,
                self.trim_threshold // 2**20,
            )
        type(self).applied = True

    def describe(self) -> str:  # noqa: D102
        mmap, trim = self.mmap_threshold // 2**20, self.trim_threshold // 2**20
        return f"auto (glibc heap: mmap threshold {mmap} MiB, trim {trim} MiB)"


def user_chose_allocator(environ: dict[str, str] | None = None) -> bool:
    """Return whether the environment configures or replaces glibc's allocator (then ``"auto"`` leaves it)."""
    environ = dict(os.environ) if environ is None else environ
    if any(name in environ for name in _ALLOCATOR_VARIABLES):
        return True
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return True
    preload = environ.get("LD_PRELOAD", "")
    return any(name in preload for name in _PRELOADED_ALLOCATORS)


#: what ``host_allocator`` accepts: ``"auto"``, None (leave the allocator alone) or a policy
AllocatorHint = str | HostAllocator | None


def resolve_allocator(host_allocator: AllocatorHint, device: torch.device | str | None) -> HostAllocator:
    """Return the allocator policy of a ``host_allocator`` argument (see the module docstring).

    :param host_allocator: ``"auto"``, None (or ``"keep"``, as the command line names it) or a policy
    :param device: the device the work computes on (``"auto"`` leaves the allocator alone on a GPU)
    :returns: the policy
    :raises ValueError: for any other value
    """
    if isinstance(host_allocator, HostAllocator):
        return host_allocator
    if host_allocator is None or host_allocator == "keep":
        return KeepAllocator()
    if host_allocator != "auto":
        raise ValueError(f"host_allocator must be 'auto', None ('keep') or a HostAllocator, but is {host_allocator!r}.")
    if device is not None and torch.device(device).type != "cpu":
        return KeepAllocator()
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or user_chose_allocator():
        return KeepAllocator()
    return RetainFreedMemory()
