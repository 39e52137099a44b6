"""The kernel's side of the file tier: reserved blocks, paging advice, flushing to disk."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import pathlib
import shutil
from typing import Any

import numpy as np

from .base import format_bytes

__all__ = ["advise_random", "advise_will_need", "fsync", "reserve_blocks"]


def reserve_blocks(file: pathlib.Path, name: str | None = None) -> None:
    """Reserve the disk blocks of a new (sparse) file, so that a full disk is an error now, not a crash later.

    A memory-mapped page of a sparse file gets its block when first written: on a disk filled meanwhile (by
    checkpoint copies, another program) that write kills the process with ``SIGBUS``, no Python error. The
    C library's ``fallocate`` reserves the blocks without writing them; a filesystem without it (NFSv3, older
    ZFS, FUSE) and a system without it keep the file sparse (``posix_fallocate`` would write a byte into every
    block instead: minutes for a large table).

    :param file: the file
    :param name: the file's name in the error (default: its own)
    :raises MemoryError: if the disk has no room for the file
    """
    size = file.stat().st_size
    if _fallocate is None or size == 0:
        return
    descriptor = os.open(file, os.O_RDWR)
    try:
        failed = _fallocate(descriptor, 0, 0, size) != 0
        error = ctypes.get_errno() if failed else 0
    finally:
        os.close(descriptor)
    if error == errno.ENOSPC:
        raise MemoryError(
            f"storage='mmap': no room for {name or file.name} ({format_bytes(size)}) on the disk of {file.parent} "
            f"({format_bytes(shutil.disk_usage(file.parent).free)} free). Use a larger disk, "
            f"optimizer='rowwise_adagrad' (one float of state per row), or more shards."
        )
    if failed and error not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        raise OSError(error, f"fallocate of {file}: {os.strerror(error)}")


def _libc_fallocate() -> Any:
    """Return the C library's ``fallocate(fd, mode, offset, length)`` with 64-bit offsets (Linux), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    function.restype = ctypes.c_int
    return function


_fallocate = _libc_fallocate()


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
