"""One way to start several ranks on this machine: the multi-process harness of the tests and benchmarks.

:func:`launch` starts one interpreter per rank with the environment ``torchrun`` would set
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free loopback
port), a collective timeout, one intra-op thread per rank, and waits for all of them within a
deadline, killing every rank if one hangs. :func:`torchrun` runs a command under ``torchrun``
itself (``python -m torch.distributed.run --standalone``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from .launch import TIMEOUT_VARIABLE

__all__ = [
    "RankResults",
    "free_port",
    "launch",
    "torchrun",
]


def free_port() -> int:
    """Return a TCP port on the loopback interface that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclasses.dataclass(eq=False)
class RankResults:
    """What the ranks of one launch returned."""

    #: the exit status of every rank, in rank order
    returncodes: list[int]
    #: the standard output of every rank
    stdout: list[str]
    #: the standard error of every rank
    stderr: list[str]
    #: seconds from the start until the last rank exited
    seconds: float

    @property
    def ok(self) -> bool:
        """Whether every rank exited with status 0."""
        return all(code == 0 for code in self.returncodes)

    def report(self) -> str:
        """Return the ranks' exit statuses and the ends of their error output (for assertion messages)."""
        return "\n\n".join(
            f"rank {rank} exited with {code}:\n{error[-3000:]}"
            for rank, (code, error) in enumerate(zip(self.returncodes, self.stderr))
        )


def launch(
    world_size: int,
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    collective_timeout: float = 60.0,
    threads: int = 1,
    cwd: str | os.PathLike | None = None,
) -> RankResults:
    """Start ``world_size`` ranks of ``command`` (``sys.executable`` is prepended) and wait for them.

    :param world_size: the number of ranks
    :param command: the arguments after the interpreter, e.g. ``["worker.py", "config"]`` or
        ``["-m", "pykeen_bess", "train"]``
    :param env: more environment variables for every rank
    :param timeout: seconds until every rank is killed (a hang fails instead of blocking)
    :param collective_timeout: seconds a collective may wait (``PYKEEN_BESS_TIMEOUT``)
    :param threads: intra-op threads per rank (``OMP_NUM_THREADS``)
    :param cwd: the ranks' working directory
    :returns: the exit statuses and outputs
    :raises TimeoutError: if the ranks did not all exit within ``timeout``
    """
    port = free_port()
    processes = []
    start = time.monotonic()
    for rank in range(world_size):
        environment = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=str(threads),
            **{TIMEOUT_VARIABLE: str(collective_timeout)},
        )
        environment.update(env or {})
        processes.append(
            subprocess.Popen(
                [sys.executable, *command],
                env=environment,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs, errors = [], []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise TimeoutError(f"the {world_size} ranks did not finish within {timeout} s (a hang)") from None
        outputs.append(stdout)
        errors.append(stderr)
    return RankResults(
        returncodes=[p.returncode for p in processes],
        stdout=outputs,
        stderr=errors,
        seconds=time.monotonic() - start,
    )


def torchrun(
    nproc: int,
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    collective_timeout: float = 60.0,
    threads: int = 1,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc-per-node nproc`` on a command (a script or ``-m module ...``).

    :returns: the completed process (torchrun's own exit status and output)
    """
    environment = dict(os.environ, OMP_NUM_THREADS=str(threads), **{TIMEOUT_VARIABLE: str(collective_timeout)})
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *command],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        cwd=cwd,
    )
