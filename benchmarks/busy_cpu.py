"""A shared CPU: training and evaluation with a busy neighbour process, by intra-op thread setting.

The same work runs with the cores idle and with another process busy-looping on one core (pinned
to the last usable core with ``sched_setaffinity``), for every ``num_threads`` setting of
:mod:`pykeen_bess.runtime.threads`: all usable cores (fixed), 1 thread (fixed) and the default
(``"auto"``: measured), each otherwise with the loop's and evaluator's defaults, as a ``pipeline()``
user gets them (the host allocator left alone). The work:

* one epoch of BESS training on WN18RR (DistMult d256, 64 negatives, batch 512, Adam), at ``n = 1``
  and ``n = 4`` logical shards, as in ``benchmarks/training.py``;
* PyKEEN's stock sLCWA loop with its own default threads on a prefix of the same epoch
  (``--stock-batches``), the reference the issue compares with;
* a filtered evaluation of the WN18RR test set (BessEvaluator, ``n = 1``), as in
  ``benchmarks/evaluation.py``.

Each cell is the best of ``--repeats`` runs. The table gives throughput idle and busy, and the
busy run's slowdown against the best idle setting of the same work: a busy neighbour on one of
``c`` cores takes ``1/c`` of the machine, so the target is a slowdown of at most ``c / (c - 1)``
(2x on 2 cores).

It has no ``--device``: it measures how CPU threads share cores, so everything runs on the CPU.

``--output FILE.json`` writes the table as the benchmarks page reads it (:mod:`result_files`).

    python benchmarks/busy_cpu.py --data ../shared/data/wn18rr
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from evaluation import load_splits
from evaluation import make_model as make_evaluation_model
from result_files import write_result
from training import load_wn18rr, make_model, time_stock

from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.runtime.threads import usable_cores
from pykeen_bess.training import BessTrainingLoop

CPU = torch.device("cpu")


@contextlib.contextmanager
def busy_neighbour(busy: bool) -> Iterator[None]:
    """Run a busy-looping process pinned to the last usable core while the block runs (if ``busy``)."""
    if not busy:
        yield
        return
    core = sorted(os.sched_getaffinity(0))[-1]
    process = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {core})
    )
    time.sleep(0.5)
    try:
        yield
    finally:
        process.kill()
        process.wait()


def bess_epoch(tf, num_shards: int, settings: dict) -> float:
    """Return positives per second of one BESS epoch (``settings``: the loop's thread options, else its defaults)."""
    loop = BessTrainingLoop(
        model=make_model(tf, 256, CPU),
        triples_factory=tf,
        num_shards=num_shards,
        num_negs_per_pos=64,
        optimizer="adam",
        automatic_memory_optimization=False,
        **settings,
    )
    start = time.perf_counter()
    loop.train(tf, num_epochs=1, batch_size=512, use_tqdm=False)
    return tf.num_triples / (time.perf_counter() - start)


def evaluation(splits, model, settings: dict) -> float:
    """Return evaluated test triples per second of a filtered BessEvaluator run (both sides)."""
    evaluator = BessEvaluator(num_shards=1, **settings)
    kwargs = dict(
        additional_filter_triples=[splits["train"].mapped_triples, splits["valid"].mapped_triples], use_tqdm=False
    )
    evaluator.evaluate(model, splits["test"].mapped_triples, **kwargs)  # the memory search, once
    start = time.perf_counter()
    evaluator.evaluate(model, splits["test"].mapped_triples, **kwargs)
    return splits["test"].num_triples / (time.perf_counter() - start)


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, required=True, help="the WN18RR directory")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs per cell")
    parser.add_argument("--stock-batches", type=int, default=30, help="batches of PyKEEN's stock loop timed")
    parser.add_argument("--output", type=pathlib.Path, help="write the table as a result file (JSON)")
    args = parser.parse_args()
    cores = usable_cores()
    most = torch.get_num_threads()
    if cores < 2:
        sys.exit("A busy neighbour needs at least 2 usable cores.")
    tf = load_wn18rr(args.data)
    splits = load_splits(args.data)
    evaluation_model = make_evaluation_model(splits, 256, 0, CPU)
    settings: list[tuple[str, dict]] = [
        (f"{most} threads", dict(num_threads=most)),
        ("1 thread", dict(num_threads=1)),
        ("auto (default)", {}),  # what pipeline() gives
    ]
    work: dict[str, tuple[str, list[tuple[str, Callable[[], float]]]]] = {
        "BESS training n=1": ("positives/s", [(n, lambda t=t: bess_epoch(tf, 1, t)) for n, t in settings]),
        "BESS training n=4": ("positives/s", [(n, lambda t=t: bess_epoch(tf, 4, t)) for n, t in settings]),
        "PyKEEN sLCWA (stock)": (
            "positives/s",
            [(f"torch default ({most})", lambda: time_stock(tf, 256, 64, 512, args.stock_batches, CPU))],
        ),
        "BESS evaluation n=1": (
            "test triples/s",
            [(n, lambda t=t: evaluation(splits, evaluation_model, t)) for n, t in settings],
        ),
    }
    print(f"{cores} usable cores, torch {torch.__version__}; busy neighbour pinned to one core", flush=True)
    results: dict[tuple[str, str, bool], float] = {}
    for busy in (False, True):
        with busy_neighbour(busy):
            for name, (_, cells) in work.items():
                for setting, run in cells:
                    value = max(run() for _ in range(args.repeats))
                    results[name, setting, busy] = value
                    print(f"{'busy' if busy else 'idle'} {name} {setting}: {value:,.0f}", flush=True)
    print()
    print(f"| work | threads | idle | busy neighbour | slowdown vs best idle (target <= {cores / (cores - 1):.1f}x) |")
    print("|---|---|---:|---:|---:|")
    for name, (unit, cells) in work.items():
        best_idle = max(results[name, setting, False] for setting, _ in cells)
        for setting, _ in cells:
            idle, busy = results[name, setting, False], results[name, setting, True]
            print(f"| {name} ({unit}) | {setting} | {idle:,.0f} | {busy:,.0f} | {best_idle / busy:.2f}x |")
    if args.output is not None:
        units = {name: unit for name, (unit, _) in work.items()}
        configuration = (
            f'the busy neighbour is `python -c "while True: pass"` pinned to one of {cores} usable cores; one BESS '
            "epoch of DistMult d256, 64 negatives, batch 512, Adam; PyKEEN's stock loop on "
            f"{args.stock_batches} batches after the first 5; "
            f"the filtered test evaluation (BessEvaluator n = 1); the loop's and evaluator's defaults but for "
            f"the threads (the host allocator left alone, as in pipeline()); best of {args.repeats} "
            f"runs per cell; units: " + ", ".join(f"{name} {unit}" for name, unit in units.items())
        )
        table = dict(
            title="throughput idle and beside a busy process",
            rows=result_rows({name: [setting for setting, _ in cells] for name, (_, cells) in work.items()}, results),
        )
        device = f"CPU, {cores} usable cores, torch {torch.__version__}"
        write_result(args.output, "busy CPU", "benchmarks/busy_cpu.py", [table], configuration, device)


def result_rows(work: dict[str, list[str]], results: dict[tuple[str, str, bool], float]) -> list[dict]:
    """The rows of the result file (:mod:`result_files`).

    :param work: the thread settings of each work
    :param results: the throughput of each (work, setting, busy)
    """
    rows = []
    for name, settings in work.items():
        best_idle = max(results[name, setting, False] for setting in settings)
        for setting in settings:
            idle, busy = results[name, setting, False], results[name, setting, True]
            rows.append(
                dict(
                    work=name,
                    threads=setting.removesuffix(" threads").removesuffix(" thread"),
                    idle=idle,
                    busy_neighbour=busy,
                    slowdown_vs_best_idle=best_idle / busy,
                )
            )
    return rows


if __name__ == "__main__":
    main()
