"""Run many short programs, each as a child forked from an interpreter that loaded PyKEEN's dependencies only.

A fresh interpreter per program spends most of its seconds importing torch, pandas, scipy and
scikit-learn; what a registration test varies is the order of the *PyKEEN* imports. This script
(run as ``python forked_programs.py``) imports those dependencies once, checks that no module of
PyKEEN or of the plugin is loaded, then forks one child per program (at most ``--workers`` at a
time). Each child runs its program as ``__main__`` would run and exits; the script prints one JSON
object: per program its exit status and its output (stdout and stderr together).

Programs come as a JSON list of strings on stdin. POSIX only (``os.fork``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import traceback

#: what PyKEEN and the plugin import that is not theirs, the costly part of starting them
DEPENDENCIES = (
    "torch",
    "numpy",
    "pandas",
    "scipy.sparse",
    "scipy.stats",
    "scipy.optimize",
    "sklearn",
    "sklearn.model_selection",
    "class_resolver",
    "docdata",
    "tqdm.autonotebook",
    "pystow",
    "click",
    "more_click",
    "torch_max_mem",
    "torch_ppr",
    "tabulate",
    "requests",
    "yaml",
    "h5py",
    "optuna",
)


def _theirs(name: str) -> bool:
    return name in ("pykeen", "pykeen_bess", "pykeen_bess_autoload") or name.startswith(("pykeen.", "pykeen_bess."))


def _child(code: str, index: int, output: str) -> None:
    """Run one program in this (forked) process with its output in ``output``; never return."""
    status = 0
    with open(output, "w") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        try:
            exec(compile(code, f"<program {index}>", "exec"), {"__name__": "__main__"})
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else 1
        except BaseException:  # noqa: BLE001 - the program's failure is its report
            traceback.print_exc()
            status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    os._exit(status)


def main() -> None:
    """Read the programs, run them as forked children, print their statuses and outputs as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="children running at a time")
    args = parser.parse_args()
    programs = json.loads(sys.stdin.read())
    for name in DEPENDENCIES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    loaded = sorted(name for name in sys.modules if _theirs(name))
    if loaded:
        raise SystemExit(f"PyKEEN or the plugin was loaded before the programs ran: {loaded}")
    sys.stdout.flush()
    results: dict[int, dict[str, object]] = {}
    running: dict[int, tuple[int, str]] = {}
    with tempfile.TemporaryDirectory() as folder:

        def reap() -> None:
            pid, status = os.wait()
            index, output = running.pop(pid)
            with open(output) as file:
                results[index] = dict(status=os.waitstatus_to_exitcode(status), output=file.read())

        for index, code in enumerate(programs):
            while len(running) >= args.workers:
                reap()
            output = os.path.join(folder, f"{index}.txt")
            pid = os.fork()
            if pid == 0:
                _child(code, index, output)
            running[pid] = (index, output)
        while running:
            reap()
    print(json.dumps([results[index] for index in range(len(programs))]))


if __name__ == "__main__":
    main()
