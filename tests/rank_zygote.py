"""Ranks for the tests, forked from one interpreter that has imported torch, PyKEEN and the plugin.

:func:`pykeen_bess.distributed.harness.launch` starts a fresh interpreter per rank, as ``torchrun``
does; on a 2-core machine each spends about five seconds importing before it trains for one. The
tests start most of their ranks with :func:`launch` here instead (the same arguments and
:class:`~pykeen_bess.distributed.harness.RankResults`): a server process (this file run as a script,
started once per test session) imports everything once and, for each launch, forks one child per
rank, which sets the environment ``torchrun`` would, its intra-op threads, working directory and
``sys.argv``, runs the script (or ``-m module``) as ``__main__`` and exits with its status; the
server kills every rank of a launch that outlives its timeout. The server itself never computes
(no thread pool exists to be forked). The harness's own launch stays covered by the tests that use
it (the distributed benchmark, ``tests/distributed/test_topology.py``) and by ``torchrun`` runs.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from pykeen_bess.distributed.harness import RankResults, free_port
from pykeen_bess.distributed.launch import TIMEOUT_VARIABLE

#: what the server imports before it forks ranks
PRELOAD = (
    "torch",
    "torch.distributed",
    "numpy",
    "pandas",
    "scipy.sparse",
    "pykeen.pipeline",
    "pykeen.datasets",
    "pykeen.hpo",
    "pykeen_bess",
    "pykeen_bess.training",
    "pykeen_bess.evaluation",
    "pykeen_bess.distributed",
    "h5py",
)


# -- the server --------------------------------------------------------------------------------------------


def _run_rank(request: dict[str, Any], rank: int, stdout: str, stderr: str) -> None:
    """In a forked child: become rank ``rank`` of the launch, run its command, exit with its status."""
    status = 0
    with open(stdout, "w") as out, open(stderr, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's requests are not the rank's input
        sys.stdin = open(os.devnull)
        try:
            world_size = request["world_size"]
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(request["port"]),
                OMP_NUM_THREADS=str(request["threads"]),
                **{TIMEOUT_VARIABLE: str(request["collective_timeout"])},
            )
            os.environ.update(request["env"])
            if request["cwd"] is not None:
                os.chdir(request["cwd"])
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
            command = list(request["command"])
            if command[0] == "-m":
                sys.argv = command[1:]
                runpy.run_module(command[1], run_name="__main__", alter_sys=True)
            else:
                script = os.path.abspath(command[0])
                sys.argv = [script, *command[1:]]
                sys.path.insert(0, os.path.dirname(script))
                runpy.run_path(script, run_name="__main__")
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException:  # noqa: BLE001 - the rank's failure is its report
            traceback.print_exc()
            status = 1
        try:
            atexit._run_exitfuncs()  # as an interpreter's exit would (e.g. leaving the process group)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


def _serve_launch(request: dict[str, Any], folder: str) -> dict[str, Any]:
    """Fork the ranks of one launch, wait for them (killing all after the timeout), return their outcomes."""
    start = time.monotonic()
    files = [
        (os.path.join(folder, f"{rank}.out"), os.path.join(folder, f"{rank}.err"))
        for rank in range(request["world_size"])
    ]
    pids = []
    for rank, (stdout, stderr) in enumerate(files):
        pid = os.fork()
        if pid == 0:
            _run_rank(request, rank, stdout, stderr)
        pids.append(pid)
    codes: dict[int, int] = {}
    timed_out = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if len(codes) < len(pids):
            if time.monotonic() - start > request["timeout"]:
                timed_out = True
                for pid in pids:
                    if pid not in codes:
                        os.kill(pid, signal.SIGKILL)
                        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                break
            time.sleep(0.02)
    outputs = []
    for stdout, stderr in files:
        with open(stdout, errors="replace") as out, open(stderr, errors="replace") as err:
            outputs.append((out.read(), err.read()))
    return dict(
        returncodes=[codes[pid] for pid in pids],
        stdout=[out for out, _ in outputs],
        stderr=[err for _, err in outputs],
        seconds=time.monotonic() - start,
        timed_out=timed_out,
    )


def serve() -> None:
    """Import everything once, then answer one launch per line of stdin with one line of JSON."""
    for name in PRELOAD:
        importlib.import_module(name)
    print(json.dumps(dict(ready=True)), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        # not a TemporaryDirectory: its clean-up runs at exit, and a rank runs the exit functions
        folder = tempfile.mkdtemp(prefix="ranks-")
        try:
            answer = _serve_launch(request, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(json.dumps(answer), flush=True)


# -- the client --------------------------------------------------------------------------------------------

_server: subprocess.Popen | None = None
_lock = threading.Lock()


def _started() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        assert _server.stdout is not None
        ready = _server.stdout.readline()
        if not ready:
            raise RuntimeError("the rank server did not start (see the test's captured output)")
        atexit.register(_stop)
    return _server


def _stop() -> None:
    if _server is not None and _server.poll() is None:
        assert _server.stdin is not None
        _server.stdin.close()
        _server.wait(timeout=30)


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
    """Start ``world_size`` ranks of ``command`` (a script and its arguments, or ``-m module ...``) and wait.

    The arguments and the result are :func:`pykeen_bess.distributed.harness.launch`'s.

    :raises TimeoutError: if the ranks did not all exit within ``timeout``
    """
    request = dict(
        world_size=world_size,
        command=[str(part) for part in command],
        env=dict(env or {}),
        timeout=timeout,
        collective_timeout=collective_timeout,
        threads=threads,
        cwd=None if cwd is None else str(cwd),
        port=free_port(),
    )
    with _lock:
        server = _started()
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
    if not line:
        raise RuntimeError("the rank server exited during a launch")
    answer = json.loads(line)
    if answer.pop("timed_out"):
        raise TimeoutError(f"the {world_size} ranks did not finish within {timeout} s (a hang)")
    return RankResults(**answer)


if __name__ == "__main__":
    serve()
