"""The early stopper's best weights beside a checkpoint, so that a resumed run can restore them when it stops.

PyKEEN's :class:`~pykeen.stoppers.EarlyStopper` saves the best epoch's weights to a file of its own
(``best_model_path``: by default a new name in PyKEEN's folder for every run) and loads them when it
stops. A checkpoint keeps the stopper's state (its best epoch, patience and results) but not that file,
and the stopper of a resumed run has another file, which does not exist: a run killed after its best
epoch and resumed failed when it stopped, after all its training (``FileNotFoundError``; PyKEEN's own
loops too). It also cannot be the checkpoint's best-epoch model (PyKEEN's ``best_epoch_model_checkpoint``):
PyKEEN writes that only for runs resumed with one, and loading it would reset the loop's epochs and
losses to the best epoch, which an uninterrupted run does not do.

So the loop keeps a copy of the stopper's file beside each checkpoint, named by the best epoch it holds
(:func:`stopper_weights_file`: ``NAME.best-weights-epochE.pt``, with the rank's suffix under a process
group): copied before the checkpoint is written (:func:`keep_stopper_weights`), the copies of other
epochs (and of another layout of processes) removed after it was (:func:`prune_stopper_weights`), so
the checkpoint and the copy of its best epoch are consistent whenever the writer is killed. A resumed
run copies it to its stopper's file before the first epoch (:func:`restore_stopper_weights`). The copy
is one state dict of the model (the stopper's file), written once per new best epoch.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
from typing import Any

__all__ = [
    "keep_stopper_weights",
    "process_suffix",
    "prune_stopper_weights",
    "restore_stopper_weights",
    "stopper_weights_file",
]

logger = logging.getLogger(__name__)


def process_suffix(topology: Any) -> str:
    """Return the suffix of this process' own files under a process group (``.rankR-of-W``), else ``""``."""
    return f".rank{topology.rank}-of-{topology.world_size}" if topology.is_distributed else ""


def stopper_weights_file(checkpoint: pathlib.Path, epoch: int, suffix: str = "") -> pathlib.Path:
    """Return the copy of the stopper's best weights of ``epoch`` beside ``checkpoint``.

    :param suffix: the process' own suffix under a process group (``.rankR-of-W``), else empty
    """
    return checkpoint.with_name(f"{checkpoint.name}.best-weights-epoch{epoch}{suffix}.pt")


def _best(stopper: Any) -> tuple[pathlib.Path, int] | None:
    """Return the stopper's best-weights file and best epoch (None: no such file, or no best epoch yet)."""
    path, epoch = getattr(stopper, "best_model_path", None), getattr(stopper, "best_epoch", None)
    if path is None or epoch is None:
        return None
    return pathlib.Path(path), int(epoch)


def keep_stopper_weights(checkpoint: pathlib.Path, stopper: Any, suffix: str = "") -> None:
    """Copy the stopper's best weights beside ``checkpoint`` (before it is written), unless they are there already.

    Nothing is copied before the stopper has a best epoch, or once it removed its file (when it stopped).
    """
    best = _best(stopper)
    if best is None or not best[0].is_file():
        return
    target = stopper_weights_file(checkpoint, best[1], suffix)
    if target.is_file():
        return
    temporary = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.copyfile(best[0], temporary)
    os.replace(temporary, target)


def prune_stopper_weights(checkpoint: pathlib.Path, stopper: Any, suffix: str = "") -> None:
    """Remove the copies beside ``checkpoint`` (after it was written) that it does not need.

    Those of other epochs than the stopper's best, and those of another layout of processes (a resharded
    run's past), whichever process wrote them: under a process group every process has written its copy
    before the checkpoint is complete.
    """
    best = _best(stopper)
    if best is None or not stopper_weights_file(checkpoint, best[1], suffix).is_file():
        return
    layout = re.fullmatch(r"\.rank\d+(-of-\d+)", suffix)
    own = layout.group(1) if layout is not None else None
    pattern = re.compile(rf"^{re.escape(checkpoint.name)}\.best-weights-epoch(\d+)(?:\.rank\d+(-of-\d+))?\.pt$")
    for file in checkpoint.parent.iterdir():
        found = pattern.match(file.name)
        if found is not None and (int(found.group(1)) != best[1] or found.group(2) != own):
            file.unlink(missing_ok=True)


def restore_stopper_weights(checkpoint: pathlib.Path, stopper: Any, suffix: str = "") -> None:
    """Give a resumed run's stopper the best weights kept beside ``checkpoint`` (before its first epoch).

    A warning says when they are not there (a checkpoint of another layout of ranks, or of a version that
    did not keep them): unless the resumed run finds a better epoch, the model then keeps the last epoch's
    weights when the stopper stops (:class:`~pykeen_bess.training.training_run.RowShardStopperCallback`).
    """
    best = _best(stopper)
    if best is None or best[0].is_file():
        return
    path, epoch = best
    source = stopper_weights_file(checkpoint, epoch, suffix)
    if not source.is_file():
        logger.warning(
            "The early stopper's best epoch (%d) of checkpoint %s has no weights file %s beside it (written by "
            "another layout of processes, or by a version that did not keep them): unless the resumed run finds a "
            "better epoch, the model keeps the last epoch's weights when the stopper stops.",
            epoch,
            checkpoint,
            source.name,
        )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, path)
    logger.info("The early stopper's best weights (epoch %d) are restored from %s.", epoch, source)
