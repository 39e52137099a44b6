"""Process-group helpers: joining the group ``torchrun`` describes, and who is the main process.

``torchrun`` starts one process per rank and passes ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (or its rendezvous) in the environment. :func:`init_from_environment` joins that
group with gloo on CPU or NCCL on GPU. A collective that waits longer than ``timeout`` (default:
``PYKEEN_BESS_TIMEOUT`` seconds, else 300) fails instead of hanging, so a rank that dies makes the
others exit with an error.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

__all__ = [
    "init_from_environment",
    "is_main_process",
    "default_timeout",
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
        logger.info("joined process group: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend)
    return dist.group.WORLD


def is_main_process() -> bool:
    """Whether this process is rank 0 of the default group (or not in a group at all)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
