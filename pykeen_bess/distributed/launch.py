"""Joining the process group ``torchrun`` describes.

``torchrun`` starts one process per rank and passes ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (or its rendezvous) in the environment. :func:`init_from_environment` joins that
group with gloo on CPU or NCCL on GPU; the BESS training loop and evaluator call it themselves
(:func:`join_torchrun_group`) when they run under ``torchrun`` without a group. A collective that
waits longer than the timeout (``PYKEEN_BESS_TIMEOUT`` seconds, default 300) fails instead of
hanging, so a rank that dies makes the others exit with an error.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os

import torch
import torch.distributed as dist

__all__ = [
    "TIMEOUT_VARIABLE",
    "default_timeout",
    "in_torchrun",
    "init_from_environment",
    "is_main_process",
    "join_torchrun_group",
    "world_size",
]

logger = logging.getLogger(__name__)

#: environment variable with the collective timeout in seconds
TIMEOUT_VARIABLE = "PYKEEN_BESS_TIMEOUT"


def default_timeout() -> datetime.timedelta:
    """Return the collective timeout (``PYKEEN_BESS_TIMEOUT`` seconds, default 300)."""
    return datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_VARIABLE, "300")))


def in_torchrun() -> bool:
    """Whether this process is one of several started by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def init_from_environment(
    backend: str | None = None, timeout: datetime.timedelta | None = None
) -> dist.ProcessGroup | None:
    """Join the process group described by ``torchrun``'s environment, if there is one.

    :param backend: ``"gloo"`` or ``"nccl"``; default: NCCL when CUDA is available, else gloo
    :param timeout: how long a collective may wait (default: :func:`default_timeout`)
    :returns: the world group, or None outside ``torchrun`` (or with a world size of 1)
    """
    if not in_torchrun() or not dist.is_available():
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


def join_torchrun_group() -> None:
    """Join ``torchrun``'s process group if this process was started by it and no group exists yet.

    The BESS training loop and evaluator call this, so that an unmodified ``pipeline()`` script
    under ``torchrun`` trains as one world instead of as independent copies.
    """
    if in_torchrun() and dist.is_available() and not dist.is_initialized():
        init_from_environment()
        (logger.warning if is_main_process() else logger.info)(  # once for the whole world
            "pykeen-bess joined torchrun's process group (WORLD_SIZE=%s) by itself; call "
            "pykeen_bess.distributed.init_from_environment() (or torch.distributed.init_process_group) first to "
            "choose its backend and timeout.",
            os.environ["WORLD_SIZE"],
        )


def is_main_process() -> bool:
    """Whether this process is rank 0 of the default group (or not in a group at all).

    The package's own outputs ask a :class:`~pykeen_bess.distributed.Topology` instead (the training
    loop's, or the one passed to them): its group may be a sub-group of the world.
    """
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def world_size() -> int:
    """Return the number of processes of the initialised default group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
