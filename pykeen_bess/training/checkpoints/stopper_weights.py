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
and by the layout of shards it holds (:func:`stopper_weights_file` with :func:`copy_suffix`:
``NAME.best-weights-epochE.N-shards.pt`` for one process holding all ``N`` shards,
``NAME.best-weights-epochE.shardS-of-N.pt`` for a rank holding shard ``S``, with ``.replicaR-of-P`` under
replicas): copied before the checkpoint is written (:func:`keep_stopper_weights`), the copies of other
epochs (and of other layouts) removed after it was (:func:`prune_stopper_weights`), so the checkpoint
and the copies of its best epoch are consistent whenever the writer is killed. A resumed run copies its
own to its stopper's file before the first epoch (:func:`restore_stopper_weights`); a run resumed on
another layout (another number of shards, or ranks instead of one process), whose checkpoint was
resharded, builds its shards' rows from the copies of the checkpoint's layout as the checkpoint's own
rows are (:func:`reshard_stopper_weights`), never taking a copy of other shards for its own. The copy is
one state dict of the model (the stopper's file), written once per new best epoch. A new run removes the
copies an earlier run left under the same checkpoint name, and a stopped run's last checkpoint (which holds
the best weights) removes its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ...data.sharding import EntitySharding
from .resharding import ShardFiles, reshard_rank_state

__all__ = [
    "copy_suffix",
    "keep_stopper_weights",
    "layout_suffixes",
    "process_suffix",
    "prune_stopper_weights",
    "remove_copies",
    "reshard_stopper_weights",
    "restore_stopper_weights",
    "pykeen_layout_stopper_file",
    "stopper_file_layout",
    "stopper_weights_file",
    "table_keys",
]

logger = logging.getLogger(__name__)


def process_suffix(topology: Any) -> str:
    """Return the suffix of this process' own files under a process group (``.rankR-of-W``), else ``""``."""
    return f".rank{topology.rank}-of-{topology.world_size}" if topology.is_distributed else ""


def copy_suffix(topology: Any) -> str:
    """Return the suffix of this process' copies of the stopper's weights: the layout of the shards it holds.

    ``.N-shards`` for one process (all ``N`` shards), ``.shardS-of-N`` for a rank of a process group (with
    ``.replicaR-of-P`` under replicas).
    """
    shard, distributed = topology.local_shards[0], topology.is_distributed
    return _suffix(topology.n_shard, shard, topology.replica, topology.replicas, distributed)


def layout_suffixes(topology: Any) -> set[str]:
    """Return the suffixes of the copies every process of ``topology``'s layout keeps (see :func:`copy_suffix`)."""
    if not topology.is_distributed:
        return {copy_suffix(topology)}
    n, replicas = topology.n_shard, topology.replicas
    return {_suffix(n, shard, replica, replicas, True) for shard in range(n) for replica in range(replicas)}


def _suffix(n_shard: int, shard: int, replica: int, replicas: int, distributed: bool) -> str:
    if not distributed:
        return f".{n_shard}-shards"
    return f".shard{shard}-of-{n_shard}" + (f".replica{replica}-of-{replicas}" if replicas > 1 else "")


def stopper_weights_file(checkpoint: pathlib.Path, epoch: int, suffix: str = "") -> pathlib.Path:
    """Return the copy of the stopper's best weights of ``epoch`` beside ``checkpoint``.

    :param suffix: the layout of the shards it holds (:func:`copy_suffix`; empty or a process' suffix
        ``.rankR-of-W``: the names of earlier versions)
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


def prune_stopper_weights(checkpoint: pathlib.Path, stopper: Any, suffix: str, layout: set[str]) -> None:
    """Remove the copies beside ``checkpoint`` (after it was written) that it does not need.

    Those of other epochs than the stopper's best, and those of other layouts (a resharded run's past, or
    earlier versions' names), whichever process wrote them: under a process group every process has
    written its copy before the checkpoint is complete. Once the stopper stopped, all of them: the
    checkpoint holds the best weights it restored, and a stopped run trains no further.

    :param suffix: this process' (:func:`copy_suffix`)
    :param layout: the suffixes of every process of the layout (:func:`layout_suffixes`)
    """
    if getattr(stopper, "stopped", False):
        remove_copies(checkpoint)
        return
    best = _best(stopper)
    if best is None or not stopper_weights_file(checkpoint, best[1], suffix).is_file():
        return
    for file, epoch, file_suffix in _copies(checkpoint):
        if epoch != best[1] or file_suffix not in layout:
            file.unlink(missing_ok=True)


def remove_copies(checkpoint: pathlib.Path) -> None:
    """Remove every copy beside ``checkpoint``."""
    for file, _, _ in _copies(checkpoint):
        file.unlink(missing_ok=True)


def _copies(checkpoint: pathlib.Path) -> list[tuple[pathlib.Path, int, str]]:
    """Return every copy beside ``checkpoint``: its file, best epoch and suffix."""
    pattern = re.compile(rf"^{re.escape(checkpoint.name)}\.best-weights-epoch(\d+)(\.[^/]*?)?\.pt$")
    found = []
    for file in checkpoint.parent.iterdir():
        match = pattern.match(file.name)
        if match is not None:
            found.append((file, int(match.group(1)), match.group(2) or ""))
    return found


def restore_stopper_weights(
    checkpoint: pathlib.Path,
    stopper: Any,
    topology: Any,
    resharded: Callable[[pathlib.Path, int], bool] | None = None,
) -> None:
    """Give a resumed run's stopper the best weights kept beside ``checkpoint`` (before its first epoch).

    Its own copy (:func:`copy_suffix`), else a copy of its shard written by another replica, else (a
    checkpoint read as written, so of this layout) the copy of an earlier version's name. A resharded
    checkpoint's copies hold other shards: ``resharded`` builds this process' from them instead
    (:func:`reshard_stopper_weights`), replacing a file at the stopper's path (a path the user gave, written by
    the other layout), which is removed where nothing can be built. A warning says when none is there:
    unless the resumed run finds a better epoch, the model then keeps the last epoch's weights when the
    stopper stops (:class:`~pykeen_bess.training.training_run.RowShardStopperCallback`). A run whose stopper has
    no best epoch yet (a new run, or one resumed before its first evaluation) removes the copies beside the
    checkpoint's name instead: they are an earlier run's under that name (a copy of the same epoch was taken for
    the new run's, and restored when it was resumed). Copies of other epochs than the checkpoint's best go too
    (a later best of an attempt killed before its checkpoint was written would be taken for the resumed run's).

    :param topology: this run's process topology
    :param resharded: for a checkpoint read from another layout of shards, builds the stopper's file (its
        path) of the best epoch (the int) from that layout's copies and returns whether it could; None: the
        checkpoint was read as written
    """
    best = _best(stopper)
    if best is None:  # no best epoch yet: copies beside the checkpoint's name are an earlier run's, never this one's
        remove_copies(checkpoint)  # (the first copy of this run is written after an evaluation: by then all ranks ran)
        return
    for file, epoch, _ in _copies(checkpoint):  # another epoch's: a killed attempt's later best, never the checkpoint's
        if epoch != best[1]:
            file.unlink(missing_ok=True)
    if best[0].is_file() and resharded is None:  # (a file of this layout: the run's own)
        return
    path, epoch = best
    path.parent.mkdir(parents=True, exist_ok=True)
    if resharded is not None:  # a file at the stopper's path (a path the user gave) holds another layout's rows
        if resharded(path, epoch):
            logger.info("The early stopper's best weights (epoch %d) are resharded from their copies.", epoch)
            return
        if path.is_file():  # never loaded as this layout's (its rows are in the copies beside the checkpoint)
            path.unlink()
        source = None
    else:
        source = next((file for file in _own_candidates(checkpoint, epoch, topology) if file.is_file()), None)
    if source is None:
        logger.warning(
            "The early stopper's best epoch (%d) of checkpoint %s has no copy of its weights for this run's shards "
            "beside it (%s; a copy is missing, its tables are outside the model, or it was written by a version "
            "that did not keep them): unless the resumed run finds a better epoch, the model keeps the last epoch's "
            "weights when the stopper stops.",
            epoch,
            checkpoint,
            stopper_weights_file(checkpoint, epoch, copy_suffix(topology)).name,
        )
        return
    shutil.copyfile(source, path)
    logger.info("The early stopper's best weights (epoch %d) are restored from %s.", epoch, source)


def _own_candidates(checkpoint: pathlib.Path, epoch: int, topology: Any) -> list[pathlib.Path]:
    """Return the copies that hold this process' shards, in the order to try: its own, another replica's, legacy."""
    own = stopper_weights_file(checkpoint, epoch, copy_suffix(topology))
    candidates = [own]
    if topology.is_distributed:
        shard = f".shard{topology.local_shards[0]}-of-{topology.n_shard}"
        candidates += sorted(
            file
            for file, found, suffix in _copies(checkpoint)
            if found == epoch and (suffix == shard or suffix.startswith(f"{shard}.replica"))
        )
    return candidates + [stopper_weights_file(checkpoint, epoch, process_suffix(topology))]


def table_keys(model: Any, tables: Sequence[Any]) -> list[str]:
    """Return the state-dict keys of the entity tables ``tables`` (their weights, as parameters of ``model``)."""
    weights = {id(table.weight) for table in tables}
    return [name for name, parameter in model.named_parameters() if id(parameter) in weights]


def reshard_stopper_weights(
    checkpoint: pathlib.Path,
    epoch: int,
    target: pathlib.Path,
    files: ShardFiles,
    sharding: EntitySharding,
    shards: Sequence[int],
    keys: Sequence[str],
) -> bool:
    """Write this process' stopper file ``target`` from the copies of another layout beside ``checkpoint``.

    The copies of the best ``epoch`` written by the layout of ``files`` (the checkpoint's files, which were
    resharded) hold its shards; this process' rows (``shards`` of ``sharding``) are taken from them, one
    copy at a time, as a resharded checkpoint's rows are
    (:func:`~pykeen_bess.training.checkpoints.resharding.reshard_rank_state`); the rest of the state dict is
    the first copy's (replicated).

    :param keys: the state-dict keys of the entity tables (:func:`table_keys`; none: tables outside the model,
        whose copies are not resharded)
    :returns: whether every copy needed was there (else nothing is written)
    """
    if not keys:
        return False
    sources = _layout_copies(checkpoint, epoch, files)
    if sources is None:
        return False
    state = reshard_rank_state(
        CopiedShards(files.path, files.n_shard, sources=tuple(sources)), sharding, shards, list(keys), []
    )
    temporary = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    torch.save(state["model_state_dict"], temporary)
    os.replace(temporary, target)
    return True


def _layout_copies(
    checkpoint: pathlib.Path, epoch: int, files: ShardFiles
) -> list[tuple[pathlib.Path, tuple[int, ...]]] | None:
    """Return the copies of ``epoch`` written by the layout of ``files``, each with the shards it holds (None: missing).

    One process' copy holds all its shards (or, from an earlier version, has no suffix); a rank's holds its
    shard (any replica's: replicas hold the same; from an earlier version ``.rankS-of-W`` without replicas,
    where rank ``S`` holds shard ``S``).
    """
    n = files.n_shard
    if files.pointer is None:
        named = [stopper_weights_file(checkpoint, epoch, name) for name in (f".{n}-shards", "")]
        found = next((file for file in named if file.is_file()), None)
        return None if found is None else [(found, tuple(range(n)))]
    copies = {(found, suffix): file for file, found, suffix in _copies(checkpoint)}
    replicas = int(files.pointer.get("replicas", 1))
    processes = int(files.pointer.get("processes", n * replicas))
    sources: list[tuple[pathlib.Path, tuple[int, ...]]] = []
    for shard in range(n):
        names = [f".shard{shard}-of-{n}", *(f".shard{shard}-of-{n}.replica{r}-of-{replicas}" for r in range(replicas))]
        if replicas == 1:
            names.append(f".rank{shard}-of-{processes}")
        file = next((copies[epoch, name] for name in names if (epoch, name) in copies), None)
        if file is None:
            return None
        sources.append((file, (shard,)))
    return sources


@dataclasses.dataclass(frozen=True)
class CopiedShards(ShardFiles):
    """The copies of the stopper's weights of one layout, read as a checkpoint's shard files (model state only)."""

    #: every copy, with the shards its tables hold (in their order)
    sources: tuple[tuple[pathlib.Path, tuple[int, ...]], ...] = ()

    def shards(self, sharding: EntitySharding) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """Yield every copy's rows as global entity ids and its state dict as a checkpoint's (no optimizer state)."""
        for file, held in self.sources:
            rows = torch.cat([sharding.shard_entities[shard] for shard in held])
            state = torch.load(file, map_location="cpu", weights_only=False)  # the stopper's own file, copied
            yield rows, {"model_state_dict": state, "optimizer_state_dict": {"state": {}}}


def stopper_file_layout(stopper: Any, tables: Sequence[Any], representations: Any = None) -> None:
    """Rewrite the early stopper's best-weights file in PyKEEN's layout after training, or back before it.

    PyKEEN documents the file (``best_model_path``, left behind when training ends without stopping, or with
    ``clean_up_checkpoint=False``) as the best epoch's ``model.state_dict()``. During training the stopper
    saves and loads it with the shard tables in the model (``entity_representations.I.weight``, rows in shard
    order, padding rows zero); after training, where the model holds its own embeddings again
    (``representations`` given: their key ``entity_representations.I._embeddings.weight``, rows in entity
    order), it gets their layout, so that PyKEEN's ``model.load_state_dict(torch.load(path))`` restores the
    best epoch; before a later training with the same stopper (``representations`` None) it goes back to the
    tables' layout (for the stopper, and for the copies kept beside checkpoints). Only a file this stopper
    wrote (it has a best epoch); one process holding every shard only (under a process group each rank keeps
    its own shards' file).

    :param stopper: the early stopper (anything without a best epoch or a best-weights file is left alone)
    :param tables: the tables the loop trains, ``[padded_rows, row_width]`` each (or column parts of such rows)
        with its ``entity_rows``
    :param representations: the model's entity representations after training (a module list), or None
    """
    path = getattr(stopper, "best_model_path", None)
    if path is None or getattr(stopper, "best_epoch", None) is None or not pathlib.Path(path).is_file():
        return
    state = torch.load(path, weights_only=False, map_location="cpu")
    changed = False
    for index, table in enumerate(tables):
        table_key = f"entity_representations.{index}.weight"
        pykeen_key = f"entity_representations.{index}._embeddings.weight"
        rows = table.entity_rows.cpu()
        if representations is None and pykeen_key in state:  # the tables again (their padding rows are zero)
            values = state.pop(pykeen_key)
            weight = values.new_zeros(table.weight.shape[0], *values.shape[1:])
            weight[rows] = values
            state[table_key], changed = weight, True
        elif representations is not None and index < len(representations) and table_key in state:
            if not hasattr(representations[index], "entity_rows"):  # the model's own embedding again
                state[pykeen_key], changed = state.pop(table_key)[rows], True
    if changed:
        temporary = pathlib.Path(path).with_name(f"{pathlib.Path(path).name}.tmp-{os.getpid()}")
        torch.save(state, temporary)
        os.replace(temporary, path)


def pykeen_layout_stopper_file(stopper: Any, tables: Sequence[Any], representations: Any) -> None:
    """Rewrite the stopper's file in PyKEEN's layout after training (:func:`stopper_file_layout`); never raises.

    It runs after the training, also one that failed: a file it cannot rewrite is left as it is (logged),
    rather than replacing the training's result or exception.
    """
    try:
        stopper_file_layout(stopper, tables, representations)
    except Exception as error:  # noqa: BLE001 - after training: its outcome comes first
        logger.warning(
            "The early stopper's file %s stays in the layout of the shard tables: %s",
            getattr(stopper, "best_model_path", None),
            error,
        )
