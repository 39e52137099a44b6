"""Process-group helpers: joining the group ``torchrun`` describes, and saving a sharded model.

``torchrun`` starts one process per rank and passes ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (or its rendezvous) in the environment. :func:`init_from_environment` joins that
group with gloo on CPU or NCCL on GPU; the BESS training loop and evaluator call it themselves
(:func:`join_torchrun_group`) when they run under ``torchrun`` without a group. A collective that waits longer than ``timeout`` (default:
``PYKEEN_BESS_TIMEOUT`` seconds, else 300) fails instead of hanging, so a rank that dies makes the
others exit with an error.

After distributed training every rank holds only its shard of the entity tables. The collective
functions :func:`export_model` and :func:`save_to_directory` gather the tables on rank 0, which
writes an ordinary PyKEEN model (``predict_target``, stock evaluation, ``torch.load``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "init_from_environment",
    "in_torchrun",
    "join_torchrun_group",
    "is_main_process",
    "default_timeout",
    "gathered_model",
    "export_model",
    "save_to_directory",
]

logger = logging.getLogger(__name__)

#: environment variable with the collective timeout in seconds
TIMEOUT_VARIABLE = "PYKEEN_BESS_TIMEOUT"


def default_timeout() -> datetime.timedelta:
    """Return the collective timeout (``PYKEEN_BESS_TIMEOUT`` seconds, default 300)."""
    return datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_VARIABLE, "300")))


def init_from_environment(
    backend: str | None = None, timeout: datetime.timedelta | None = None
) -> dist.ProcessGroup | None:
    """Join the process group described by ``torchrun``'s environment, if there is one.

    :param backend: ``"gloo"`` or ``"nccl"``; default: NCCL when CUDA is available, else gloo
    :param timeout: how long a collective may wait (default: :func:`default_timeout`)
    :returns: the world group, or None outside ``torchrun`` (or with a world size of 1)
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 or not dist.is_available():
        return None
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timeout or default_timeout())
        # the group this function created is released when the interpreter exits (NCCL warns otherwise)
        atexit.register(_destroy_group)
        logger.info("joined process group: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend)
    return dist.group.WORLD


def _destroy_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def in_torchrun() -> bool:
    """Whether this process is one of several started by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def join_torchrun_group() -> None:
    """Join ``torchrun``'s process group if this process was started by it and no group exists yet.

    The BESS training loop and evaluator call this, so that an unmodified ``pipeline()`` script
    under ``torchrun`` trains as one world instead of as independent copies.
    """
    if in_torchrun() and dist.is_available() and not dist.is_initialized():
        init_from_environment()
        logger.info("pykeen-bess joined torchrun's process group (WORLD_SIZE=%s) by itself.", os.environ["WORLD_SIZE"])


def is_main_process() -> bool:
    """Whether this process is rank 0 of the default group (or not in a group at all)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _gather_table(table: Any) -> torch.Tensor | None:
    """Gather a one-shard-per-rank table on rank 0 as ``[num_entities, row_width]`` (None elsewhere)."""
    local = table.weight.detach().contiguous()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    pieces = [torch.empty_like(local) for _ in range(world_size)] if rank == 0 else None
    dist.gather(local, gather_list=pieces, dst=0)
    if rank != 0:
        return None
    sharding = table.sharding
    stacked = torch.stack(pieces).view(world_size * sharding.shard_size, -1)
    rows = sharding.entity_shard * sharding.shard_size + sharding.entity_local
    return stacked[rows.to(stacked.device)].clone()


@contextlib.contextmanager
def gathered_model(model: Any) -> Iterator[Any]:
    """Temporarily give rank 0 the full model (collective: every rank must enter).

    Inside the block rank 0's model has ordinary :class:`pykeen.nn.Embedding` entity
    representations holding all entities; the other ranks get None. Afterwards the model is sharded
    again. A model that is not sharded over ranks is yielded as it is.

    :param model: a model trained by :class:`~pykeen_bess.training.BessTrainingLoop`
    :yields: the full model on rank 0, None on the other ranks
    """
    from .representation import ShardedEmbedding

    tables = [(i, r) for i, r in enumerate(model.entity_representations) if isinstance(r, ShardedEmbedding)]
    if not tables or all(table.holds_all_shards for _, table in tables):
        yield model
        return
    full = [(index, table, _gather_table(table)) for index, table in tables]
    if not is_main_process():
        yield None
        return
    try:
        for index, table, weights in full:
            base = table.base_embedding
            base._embeddings.weight.data = weights.to(table.weight.device)
            model.entity_representations[index] = base
        yield model
    finally:
        for index, table, _ in full:
            base = table.base_embedding
            base._embeddings.weight.data = base._embeddings.weight.data.new_empty(0, table.row_width)
            model.entity_representations[index] = table


def export_model(model: Any, path: str | os.PathLike) -> None:
    """Write the full model to one file on rank 0 (collective), loadable with ``torch.load``.

    :param model: the (sharded) model
    :param path: the file rank 0 writes
    """
    with gathered_model(model) as full:
        if full is not None:
            torch.save(full, pathlib.Path(path))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_to_directory(result: Any, directory: str | os.PathLike, **kwargs: Any) -> None:
    """Call ``PipelineResult.save_to_directory`` on rank 0 with the full model (collective).

    :param result: the pipeline's result (on every rank)
    :param directory: the output directory rank 0 writes
    :param kwargs: passed to :meth:`pykeen.pipeline.PipelineResult.save_to_directory`
    """
    with gathered_model(result.model) as full:
        if full is not None:
            result.save_to_directory(directory, **kwargs)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
