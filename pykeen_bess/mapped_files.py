"""Memory-mapped files of the ``"mmap"`` storage tier: the kernel's paging advice, and flushing to disk."""

from __future__ import annotations

import mmap
import os
import pathlib

import numpy as np

__all__ = ["advise_random", "advise_will_need", "fsync"]


def advise_random(array: np.memmap) -> None:
    """Tell the kernel that rows are read at random: no read-ahead around each page a step touches.

    Without it every row a step reads from a table larger than the page cache faults in the
    kernel's read-ahead window (typically 128 KiB) instead of one 4 KiB page.
    """
    handle = getattr(array, "_mmap", None)
    if handle is not None and hasattr(handle, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        handle.madvise(mmap.MADV_RANDOM)


def advise_will_need(array: np.memmap, start: int, stop: int) -> None:
    """Ask the kernel to read rows ``start:stop`` of a memory map ahead (one request instead of a fault per page)."""
    handle = getattr(array, "_mmap", None)
    if handle is None or not hasattr(handle, "madvise") or not hasattr(mmap, "MADV_WILLNEED"):
        return
    row_bytes = array.strides[0]
    mapped_from = array.offset - array.offset % mmap.ALLOCATIONGRANULARITY  # where numpy's map begins
    begin = array.offset - mapped_from + start * row_bytes
    aligned = begin - begin % mmap.PAGESIZE
    length = min((stop - start) * row_bytes + begin - aligned, len(handle) - aligned)
    if length > 0:
        handle.madvise(mmap.MADV_WILLNEED, aligned, length)


def fsync(file: pathlib.Path) -> None:
    """Flush a file (or a directory's entries) to disk."""
    descriptor = os.open(file, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
