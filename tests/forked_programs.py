"""Run many short programs, each in a child forked from an interpreter that has loaded what they import.

A fresh interpreter per program spends most of its seconds importing torch, pandas, scipy and
scikit-learn (and PyKEEN). This script (``python forked_programs.py [--preload dependencies|plugin]``)
imports them once, then forks one child per program, as a fresh interpreter would run it
(``__main__``, its own ``sys.argv``, working directory and output), at most ``--workers`` chains at a
time. It prints one JSON list: per chain, per step, the exit status, stdout, stderr and seconds.

* ``--preload dependencies`` (default) imports what PyKEEN and the plugin import, but no module of
  either (checked): a program's first PyKEEN import is its own (the registration tests).
* ``--preload plugin`` imports PyKEEN's pipeline and the plugin too (code that uses them).

Input on stdin: a JSON list of chains; a chain is a list of steps run one after another (each in
its own child, so a step sees the files, not the state, of the steps before it); a step is
``{"code": str, "argv": [str]}`` (``python -c code argv``), ``{"module": str, "argv": [str]}``
(``python -m module argv``) or ``{"script": str, "argv": [str]}`` (``python script argv``), with an
optional ``"cwd"``. Set ``OMP_NUM_THREADS`` for this script to give every child that many threads.
POSIX only (``os.fork``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys
import tempfile
import time
import traceback
from typing import Any

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
#: what ``--preload plugin`` imports besides
PLUGIN = ("pykeen.pipeline", "pykeen.hpo", "pykeen.datasets", "pykeen_bess", "pykeen_bess.cli")


def _theirs(name: str) -> bool:
    return name in ("pykeen", "pykeen_bess", "pykeen_bess_autoload") or name.startswith(("pykeen.", "pykeen_bess."))


def _run_step(step: dict[str, Any], label: str) -> int:
    """Run one step as a fresh interpreter would (in this forked process); return its exit status."""
    try:
        if "cwd" in step:
            os.chdir(step["cwd"])
        if "module" in step:
            sys.argv = [step["module"], *step.get("argv", [])]
            runpy.run_module(step["module"], run_name="__main__", alter_sys=True)
        elif "script" in step:
            script = os.path.abspath(step["script"])
            sys.argv = [script, *step.get("argv", [])]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
        else:
            sys.argv = ["-c", *step.get("argv", [])]
            exec(compile(step["code"], label, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:  # noqa: BLE001 - the program's failure is its report
        traceback.print_exc()
        return 1
    return 0


def _step_child(step: dict[str, Any], label: str, stdout: str, stderr: str) -> None:
    """In a forked child: run the step with its output in two files; never return."""
    with open(stdout, "w") as out, open(stderr, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        status = _run_step(step, label)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


def _chain_child(chain: list[dict[str, Any]], index: int, folder: str) -> None:
    """In a forked child: run a chain's steps one after another, each in a child of its own; never return."""
    results = []
    for number, step in enumerate(chain):
        stdout, stderr = (os.path.join(folder, f"{index}.{number}.{name}") for name in ("out", "err"))
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _step_child(step, f"<chain {index}, step {number}>", stdout, stderr)
        _, status = os.waitpid(pid, 0)
        seconds = time.monotonic() - start
        with open(stdout) as out, open(stderr) as err:
            outcome = dict(status=os.waitstatus_to_exitcode(status), stdout=out.read(), stderr=err.read())
        results.append(dict(outcome, seconds=seconds))
    with open(os.path.join(folder, f"{index}.json"), "w") as file:
        json.dump(results, file)
    os._exit(0)


def main() -> None:
    """Read the chains, run them as forked children, print their steps' statuses and outputs as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="chains running at a time")
    parser.add_argument("--preload", choices=("dependencies", "plugin"), default="dependencies")
    args = parser.parse_args()
    chains = json.loads(sys.stdin.read())
    for name in DEPENDENCIES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    loaded = sorted(name for name in sys.modules if _theirs(name))
    if loaded:
        raise SystemExit(f"PyKEEN or the plugin was loaded with its dependencies: {loaded}")
    if args.preload == "plugin":
        for name in PLUGIN:
            importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    running: dict[int, int] = {}
    with tempfile.TemporaryDirectory() as folder:
        for index, chain in enumerate(chains):
            while len(running) >= args.workers:
                running.pop(os.wait()[0])
            pid = os.fork()
            if pid == 0:
                _chain_child(chain, index, folder)
            running[pid] = index
        while running:
            running.pop(os.wait()[0])
        results = []
        for index, chain in enumerate(chains):
            path = os.path.join(folder, f"{index}.json")
            if os.path.exists(path):
                with open(path) as file:
                    results.append(json.load(file))
            else:  # the chain's runner died
                results.append([dict(status=-1, stdout="", stderr="the chain's runner died") for _ in chain])
    print(json.dumps(results))


def run_chains(chains: list[list[dict[str, Any]]], preload: str = "dependencies", **env: str) -> list[list[dict]]:
    """Run chains of steps with this script (from a test): per chain, per step, status, stdout and stderr."""
    import subprocess

    result = subprocess.run(
        [sys.executable, __file__, "--preload", preload],
        input=json.dumps(chains),
        capture_output=True,
        text=True,
        timeout=1800,
        env=dict(os.environ, **env),
    )
    if result.returncode != 0:
        raise RuntimeError(f"forked_programs.py failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
