"""Digests of the files a checkpoint writes, verified before a checkpoint is resumed.

A flipped byte in a checkpoint must not be resumed silently (and then overwritten by the next
checkpoint). Every file a checkpoint writes carries CRC-32 digests, computed while it is written and
checked before any of it is used:

* ``torch.save`` files (PyKEEN's checkpoint dictionary, rank files, pointers): a zip archive with a
  CRC-32 of every record (the pickled dictionary and each tensor's bytes), which ``torch.load``
  never checks; :func:`verify_torch_file` does. ``torch.save`` can compute them itself, on its one
  thread while it serialises; :func:`write_with_digests` writes the archive without them and then
  adds them from the written file, two records at a time, which costs a checkpoint of a large table
  far less.
* ``.npy`` copies of tables kept in files: the digest of each copy's bytes, computed from the
  source file while the kernel copies it, is stored in the checkpoint dictionary next to the copy's
  name (:func:`crc32_of_file`).
* PyTorch-BigGraph's HDF5 files: each dataset the checkpoint writes carries its digest as an
  attribute (:data:`DIGEST_ATTRIBUTE`, ignored by PyTorch-BigGraph), checked when it is read.

CRC-32 detects accidental corruption (any burst of up to 32 flipped bits, and all but one in 4 billion
others); it is not a defence against deliberate tampering. It costs a fraction of the write: the
digests are computed from memory at about 4 GB/s.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import struct
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

__all__ = [
    "DIGEST_ATTRIBUTE",
    "CorruptCheckpointError",
    "add_record_digests",
    "crc32_of_array",
    "crc32_of_file",
    "sha256_of_array",
    "verify_array",
    "verify_torch_file",
    "write_with_digests",
]

#: the attribute of an HDF5 dataset holding the CRC-32 of its values
DIGEST_ATTRIBUTE = "pykeen_bess_crc32"

#: what a user can do about a corrupted checkpoint (nothing was written over it)
ADVICE = (
    "Nothing was resumed or written. Restore the checkpoint's files from a backup, or move them away to train "
    "from the start."
)


class CorruptCheckpointError(ValueError):
    """A checkpoint file does not hold what was written to it (its digest differs)."""


def _chunks(array: np.ndarray, chunk_bytes: int = 64 << 20) -> Iterator[np.ndarray]:
    flat = array.reshape(-1) if array.flags.c_contiguous else np.ascontiguousarray(array).reshape(-1)
    step = max(chunk_bytes // max(flat.itemsize, 1), 1)
    for start in range(0, flat.shape[0], step):
        yield flat[start : start + step]


def crc32_of_array(array: np.ndarray | torch.Tensor) -> int:
    """Return the CRC-32 of an array's values in C order (a memory map is read chunk by chunk)."""
    if torch.is_tensor(array):
        array = array.detach().cpu().contiguous().numpy()
    digest = 0
    for chunk in _chunks(np.asarray(array)):
        digest = zlib.crc32(chunk.view(np.uint8).data, digest)
    return digest


def sha256_of_array(array: np.ndarray | torch.Tensor) -> bytes:
    """Return the SHA-256 of an array's values in C order: an identity of its content (caches key on it).

    A CRC-32 detects corruption but not a different content made to match it (it is linear: flipping chosen
    bits keeps it), so a cache keyed on it could hand back the result of other values. SHA-256 takes about
    2.5x a CRC-32's time (0.27 s for 400 MB on a 2-core machine).
    """
    if torch.is_tensor(array):
        array = array.detach().cpu().contiguous().numpy()
    digest = hashlib.sha256()
    for chunk in _chunks(np.asarray(array)):
        digest.update(chunk.view(np.uint8).data)
    return digest.digest()


def crc32_of_file(path: pathlib.Path, chunk_bytes: int = 8 << 20) -> int:
    """Return the CRC-32 of a file's bytes."""
    buffer = bytearray(chunk_bytes)
    view = memoryview(buffer)
    digest = 0
    with open(path, "rb") as reader:
        while count := reader.readinto(buffer):
            digest = zlib.crc32(view[:count], digest)
    return digest


def verify_array(array: np.ndarray | torch.Tensor, expected: int | None, file: Any, what: str = "") -> None:
    """Check an array read from ``file`` against the digest written with it (None: written without one).

    :raises CorruptCheckpointError: naming the file
    """
    if expected is None:
        return
    if crc32_of_array(array) != int(expected):
        raise CorruptCheckpointError(
            f"Checkpoint file {file} is corrupted: {what or 'its values'} differ from what was written (CRC-32 "
            f"mismatch). {ADVICE}"
        )


def write_with_digests(path: pathlib.Path, write: Callable[[], object]) -> None:
    """Run ``write`` (``torch.save`` to ``path``) without torch's digests; :func:`add_record_digests` adds them."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        write()
    finally:
        torch.serialization.set_crc32_options(before)
    add_record_digests(path)


#: the first bytes of a zip archive (its first local file header), which ``torch.save`` writes
_ZIP_START = b"PK\x03\x04"


def verify_torch_file(path: pathlib.Path) -> None:
    """Check every record of a ``torch.save`` file against the CRC-32 written with it.

    A file written with torch's digests turned off (every record's CRC-32 zero) cannot be checked and
    passes. A file that starts as a zip archive but is none (its directory at the end is missing: a
    truncated copy), or is empty, is corrupted; any other file (torch's legacy format) is left to
    ``torch.load``.

    :raises CorruptCheckpointError: naming the file and the first record that differs
    """
    path = pathlib.Path(path)
    if not zipfile.is_zipfile(path):
        with path.open("rb") as file:
            start = file.read(len(_ZIP_START))
        if start == _ZIP_START or not start:
            state = "empty" if not start else "truncated (a zip archive without its directory)"
            raise CorruptCheckpointError(f"Checkpoint file {path} is {state}. {ADVICE}")
        return
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
            if all(record.CRC == 0 for record in records if record.file_size):
                return  # written without digests
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:  # damaged headers
        raise CorruptCheckpointError(f"Checkpoint file {path} is corrupted ({error}). {ADVICE}") from error
    if bad is not None:
        raise CorruptCheckpointError(
            f"Checkpoint file {path} is corrupted: its record {bad!r} differs from what was written (CRC-32 "
            f"mismatch). {ADVICE}"
        )


def _record_crc(path: pathlib.Path, start: int, size: int, chunk_bytes: int = 8 << 20) -> int:
    digest = 0
    descriptor = os.open(path, os.O_RDONLY)
    try:
        for offset in range(start, start + size, chunk_bytes):
            digest = zlib.crc32(os.pread(descriptor, min(chunk_bytes, start + size - offset), offset), digest)
    finally:
        os.close(descriptor)
    return digest


def add_record_digests(path: pathlib.Path, threads: int = 2) -> None:
    """Write the CRC-32 of every record into a ``torch.save`` archive written without them.

    ``torch.save`` computes the digests while it serialises, on one thread and slower than zlib; a
    checkpoint is written with them turned off and gets them here, from the written file (in the page
    cache), ``threads`` records at a time: the archive is then exactly what ``torch.save`` with digests
    writes, and :func:`verify_torch_file` checks it.
    """
    path = pathlib.Path(path)
    with zipfile.ZipFile(path) as archive:
        records = archive.infolist()
        start_dir = archive.start_dir
    with open(path, "r+b") as file:
        starts = []
        for record in records:
            file.seek(record.header_offset + 26)
            name_length, extra_length = struct.unpack("<HH", file.read(4))
            starts.append(record.header_offset + 30 + name_length + extra_length)
        with ThreadPoolExecutor(threads) as pool:
            digests = list(
                pool.map(lambda item: _record_crc(path, item[0], item[1].compress_size), zip(starts, records))
            )
        for record, start, digest in zip(records, starts, digests):
            packed = struct.pack("<I", digest)
            if record.flag_bits & 0x08:  # a data descriptor after the data: [signature,] CRC-32, sizes
                file.seek(start + record.compress_size)
                signature = file.read(4)
                file.seek(start + record.compress_size + (4 if signature == b"PK\x07\x08" else 0))
            else:  # the local header's field
                file.seek(record.header_offset + 14)
            file.write(packed)
        position = start_dir
        for digest in digests:  # the central directory's entries, in the same order
            file.seek(position)
            header = file.read(46)
            if header[:4] != b"PK\x01\x02":
                raise ValueError(f"{path}: unexpected central directory entry at byte {position}.")
            file.seek(position + 16)
            file.write(struct.pack("<I", digest))
            name_length, extra_length, comment_length = struct.unpack("<HHH", header[28:34])
            position += 46 + name_length + extra_length + comment_length
