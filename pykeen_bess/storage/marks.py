"""Which run the table files under a ``storage_path`` belong to: their marks, and the decision about existing files.

A run marks its files (``FILE.checkpoint``) with the checkpoints it writes; a new run decides from them whether
it takes existing files over or refuses them (:meth:`~pykeen_bess.storage.MmapStorage.claim_existing`).
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Sequence

__all__ = ["checkpoints_of", "decide", "exists_message", "mark", "marker"]

logger = logging.getLogger(__name__)


def decide(
    deferred: dict[int, pathlib.Path],
    marks: dict[int, list[str]],
    owner: str | None,
    resuming: bool,
    path: pathlib.Path,
) -> tuple[str | None, bool]:
    """Decide about existing files (see :meth:`~pykeen_bess.storage.MmapStorage.claim_existing`).

    :returns: why they are refused (None: they are not), and whether they are resumed (their run's checkpoint,
        or the same command run again after a crash before its first checkpoint)
    """
    if deferred and not resuming and owner is not None and all(m[:1] == [owner] for m in marks.values()):
        logger.info(
            "storage='mmap': the files under %s are of an earlier run of checkpoint %s that wrote no checkpoint; "
            "this run replaces them.",
            path,
            owner,
        )
        return None, True
    if resuming:
        foreign = [key for key, m in marks.items() if owner not in m]
        if foreign:  # another run's files (a storage_path of another run): resuming would replace them
            return _foreign_message(deferred[foreign[0]], marks[foreign[0]], owner), True
        return None, True
    if deferred:
        return (
            f"{exists_message(min(deferred.values()))} No checkpoint is being resumed (train(checkpoint_name=...) "
            "with an existing checkpoint would resume it and reuse the files).",
            False,
        )
    return None, False


def marker(file: pathlib.Path) -> pathlib.Path:
    """Return the file beside a table file that names the checkpoint of the run that placed it."""
    return file.with_name(f"{file.name}.checkpoint")


def checkpoints_of(file: pathlib.Path) -> list[str]:
    """Return the checkpoints of a table file's run: the one it writes ('' for none), then the others it wrote.

    Empty if the file has no mark (a run without checkpoints, or none of its files' marks survived).
    """
    try:
        return marker(file).read_text().splitlines()
    except OSError:
        return []


def mark(file: pathlib.Path, owner: str | None, history: Sequence[str] = ()) -> None:
    """Mark a table file as of a run that writes checkpoint ``owner`` and wrote or resumed ``history``.

    A file of a run without any checkpoint has no mark.
    """
    lines = [owner or "", *(c for c in history if c != owner)]
    if lines == [""]:
        marker(file).unlink(missing_ok=True)
    elif checkpoints_of(file) != lines:
        marker(file).write_text("\n".join(lines))


def _foreign_message(file: pathlib.Path, marks: list[str], checkpoint: str | None) -> str:
    run = f"a run of checkpoint(s) {', '.join(c for c in marks if c)}" if any(marks) else "a run without checkpoints"
    return (
        f"{file} is of {run}, not of the run of the resumed checkpoint {checkpoint}: resuming would replace it. "
        "Pass the storage_path of the checkpoint's run, or storage_kwargs=dict(overwrite=True) to replace these "
        "files."
    )


def exists_message(file: pathlib.Path) -> str:
    """Return the error of a table file of an earlier run (with the ways out)."""
    return (
        f"{file} exists (from an earlier run?). Remove it, use another storage_path, or pass "
        "storage_kwargs=dict(overwrite=True) (on the command line: --storage-kwargs '{\"overwrite\": true}')."
    )
