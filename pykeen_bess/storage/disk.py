"""The kernel's side of the file tier: reserved blocks, paging advice, flushing to disk."""

from __future__ import annotations

import errno
import mmap
import os
import pathlib
import shutil

import numpy as np

from .base import format_bytes

__all__ = ["advise_random", "advise_will_need", "fsync", "reserve_blocks"]


def reserve_blocks(file: pathlib.Path) -> None:
    """Reserve the disk blocks of a new (sparse) file, so that a full disk is an error now, not a crash later.

    A memory-mapped page of a sparse file gets its block when first written: on a disk filled meanwhile (by
    checkpoint copies, another program) that write kills the process with ``SIGBUS``, no Python error.
    Filesystems without preallocation (and systems without ``posix_fallocate``) keep the file sparse.

    :raises MemoryError: if the disk has no room for the file
    """
    if not hasattr(os, "posix_fallocate"):
        return
    descriptor = os.open(file, os.O_RDWR)
    try:
        os.posix_fallocate(descriptor, 0, os.fstat(descriptor).st_size)
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise MemoryError(
                f"storage='mmap': no room for {file.name} ({format_bytes(os.fstat(descriptor).st_size)}) on the "
                f"disk of {file.parent} ({format_bytes(shutil.disk_usage(file.parent).free)} free). Use a larger "
                f"disk, optimizer='rowwise_adagrad' (one float of state per row), or more shards."
            ) from None
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    finally:
        os.close(descriptor)


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
