"""Storage tiers: the same BESS training with the tables on the device, in host memory and in files.

For every tier (``--tiers``, default device host mmap) and optimizer (``--optimizers``, default
adam rowwise_adagrad), one fresh process trains ``--epochs`` epochs of DistMult (dimension 256,
64 negatives per positive, batch 512, ``--shards`` logical shards) on the given graph and reports
triples per second (steady epochs: the first is left out when there are several), the bytes moved
between the tier and the compute device per step (the tier's counters), the peak resident memory
(``VmHWM``) and the anonymous resident memory after training (``RssAnon``: for files, the table is
page cache, not anonymous memory), and the filtered MRR on ``--eval-triples`` test triples.
``--device`` (:mod:`devices`; default: CUDA when torch sees a GPU) is the compute device. On the
CPU "device" storage is the CPU too: the rows of host and file tiers are copied per step although
compute and storage share the memory, which is the overhead the table shows; on CUDA the host and
file tiers stage their rows through pinned host memory.

    python benchmarks/storage.py --data ../shared/data/wn18rr

``--large ENTITIES`` instead trains a generated graph whose table does not fit this machine's
memory, e.g. ``--large 60000000 --dim 128`` (31 GB of float32 table) with ``storage="mmap"`` and
row-wise Adagrad under ``--storage-dir``: the model is built on the meta device (PyKEEN's
constructor would otherwise allocate the full table), the tables are initialised chunk by chunk,
``--large-steps`` steps of ``--batch-size`` uniformly drawn triples are trained, and
``--eval-triples`` held-out triples are ranked against every entity (filtered). It reports the
time of each stage, steps per second, the process' peak resident, anonymous and file-backed
memory, and the bytes it read from and wrote to the disk (``/proc/self/io``). It computes on the
CPU: BessTrainingLoop materialises a model built on the meta device on the CPU, so ``--large``
runs there without ``--device`` and refuses a CUDA ``--device``.

    python benchmarks/storage.py --large 60000000 --dim 128 --storage-dir /work/big --eval-triples 300

``--output FILE.json`` writes the table (the tiers, or the stages of ``--large``) as the benchmarks
page reads it (:mod:`result_files`).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import time

from devices import CLI_HOST_SETTINGS, add_device_argument, describe, parse_device, synchronize
from result_files import command_line, write_result

OPTIMIZERS = {"adam": "Adam", "rowwise_adagrad": "row-wise Adagrad"}


def _status(field: str) -> int:
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def worker(args: argparse.Namespace) -> None:
    """Train on one tier in this process and print the measurements as JSON."""
    import torch
    from pykeen.models import DistMult
    from pykeen.training import TrainingCallback
    from pykeen.triples import TriplesFactory

    from pykeen_bess.evaluation import BessEvaluator
    from pykeen_bess.training import BessTrainingLoop

    torch.set_num_threads(args.threads)
    training = TriplesFactory.from_path(args.data / "train.txt")
    testing = TriplesFactory.from_path(
        args.data / "test.txt", entity_to_id=training.entity_to_id, relation_to_id=training.relation_to_id
    )
    model = DistMult(triples_factory=training, embedding_dim=args.dim, random_seed=0, regularizer=None).to(args.device)
    with tempfile.TemporaryDirectory(dir=args.storage_dir) as directory:
        loop = BessTrainingLoop(
            model=model,
            triples_factory=training,
            num_shards=args.shards,
            num_negs_per_pos=args.negatives,
            **CLI_HOST_SETTINGS,
            optimizer=args.optimizer,
            optimizer_kwargs=dict(lr=0.1 if args.optimizer == "rowwise_adagrad" else 1e-3),
            automatic_memory_optimization=False,
            seed=0,
            storage=args.tier,
            storage_path=directory if args.tier == "mmap" else None,
        )
        storage = loop.tables.storage
        times: list[float] = []
        steps: list[int] = []

        class Clock(TrainingCallback):
            """Epoch times: from the end of the previous epoch (of the training's start) to the end of this one."""

            def __init__(self) -> None:
                super().__init__()
                self.start = time.perf_counter()

            def on_batch(self, **kwargs):  # type: ignore[no-untyped-def]
                steps.append(1)

            def post_epoch(self, **kwargs):  # type: ignore[no-untyped-def]
                synchronize(args.device)
                now = time.perf_counter()
                times.append(now - self.start)
                self.start = now

        loop.train(training, num_epochs=args.epochs, batch_size=args.batch_size, use_tqdm=False, callbacks=Clock())
        steady = times[1:] if len(times) > 1 else times
        triples = training.num_triples
        moved = storage.traffic.bytes_read / len(steps)
        start = time.perf_counter()
        metrics = BessEvaluator(**CLI_HOST_SETTINGS).evaluate(
            loop.model,
            testing.mapped_triples[: args.eval_triples],
            additional_filter_triples=[training.mapped_triples],
            use_tqdm=False,
        )
        evaluation = time.perf_counter() - start
        print(
            json.dumps(
                dict(
                    triples_per_s=triples * len(steady) / sum(steady),
                    bytes_per_step=moved,
                    peak_rss=_status("VmHWM"),
                    anonymous=_status("RssAnon"),
                    mrr=metrics.get_metric("both.realistic.inverse_harmonic_mean_rank"),
                    evaluation_s=evaluation,
                    plan=loop.memory_plan.describe(),
                )
            )
        )


def _io() -> dict[str, int]:
    with open("/proc/self/io") as file:
        return {key: int(value) for key, value in (line.split(": ") for line in file)}


def _gib(after: dict[str, int], before: dict[str, int], key: str) -> str:
    return f"{(after[key] - before[key]) / 2**30:.1f}"


def large(args: argparse.Namespace) -> None:
    """Train and evaluate a generated graph whose table exceeds the machine's memory, in files."""
    import torch
    from pykeen.models import DistMult
    from pykeen.training import TrainingCallback
    from pykeen.triples import CoreTriplesFactory

    from pykeen_bess.evaluation import BessEvaluator
    from pykeen_bess.training import BessTrainingLoop

    torch.set_num_threads(args.threads)
    stages: list[tuple[str, float, str]] = []
    clock = time.perf_counter()

    def stage(name: str, detail: str = "") -> None:
        nonlocal clock
        now = time.perf_counter()
        stages.append((name, now - clock, detail))
        print(f"{name}: {now - clock:.1f} s {detail}", file=sys.stderr, flush=True)
        clock = now

    num_entities, num_relations = args.large, 100
    generator = torch.Generator().manual_seed(0)
    num_triples = args.large_steps * args.batch_size + args.eval_triples
    triples = torch.stack(
        [
            torch.randint(num_entities, (num_triples,), generator=generator),
            torch.randint(num_relations, (num_triples,), generator=generator),
            torch.randint(num_entities, (num_triples,), generator=generator),
        ],
        dim=1,
    )
    training = CoreTriplesFactory.create(triples[args.eval_triples :], num_entities, num_relations)
    testing = triples[: args.eval_triples]
    with torch.device("meta"):  # no full entity table in memory
        model = DistMult(triples_factory=training, embedding_dim=args.dim, random_seed=0, regularizer=None)
    stage("graph and model")
    # the table files (31 GB in the example) are removed when the run ends, also on an error
    files = tempfile.TemporaryDirectory(dir=args.storage_dir)
    directory = files.name
    loop = BessTrainingLoop(
        model=model,
        triples_factory=training,
        num_shards=args.shards,
        num_negs_per_pos=args.negatives,
        **CLI_HOST_SETTINGS,
        optimizer="rowwise_adagrad",
        optimizer_kwargs=dict(lr=0.1),
        automatic_memory_optimization=False,
        seed=0,
        storage="mmap",
        storage_path=directory,
    )
    stage("loop (files created)", loop.memory_plan.describe())
    times: list[float] = []

    counters: list[dict[str, int]] = []

    class Steps(TrainingCallback):
        def on_batch(self, **kwargs):  # type: ignore[no-untyped-def]
            times.append(time.perf_counter())
            if len(times) == 1:
                counters.append(_io())

    before = _io()
    loop.train(training, num_epochs=1, batch_size=args.batch_size, use_tqdm=False, callbacks=Steps())
    after = _io()
    nonlocal_clock = clock
    stages.append(
        (
            "initialise the tables (in chunks above 1 GiB), write them to the files",
            times[0] - nonlocal_clock,
            f"disk written {_gib(counters[0], before, 'write_bytes')} GiB",
        )
    )
    steady = (len(times) - 11) / (times[-1] - times[10]) if len(times) > 20 else float("nan")
    clock = times[0]
    stage(
        f"{len(times)} training steps",
        f"{steady:.1f} steps/s after the first 10 ({steady * args.batch_size:,.0f} triples/s); disk read "
        f"{_gib(after, counters[0], 'read_bytes')} GiB, written {_gib(after, counters[0], 'write_bytes')} GiB",
    )
    stage(
        "memory after training",
        f"RssAnon {_status('RssAnon') / 2**30:.2f} GiB, RssFile {_status('RssFile') / 2**30:.2f} GiB",
    )
    before = _io()
    metrics = BessEvaluator(batch_size=args.eval_triples, **CLI_HOST_SETTINGS).evaluate(
        loop.model, testing, additional_filter_triples=[training.mapped_triples], use_tqdm=False
    )
    after = _io()
    stage(
        f"filtered evaluation of {args.eval_triples} triples x {num_entities:,} entities",
        f"MRR {metrics.get_metric('mrr'):.2e} (random ranking: {(math.log(num_entities) + 0.58) / num_entities:.1e}); "
        f"disk read {_gib(after, before, 'read_bytes')} GiB",
    )
    print(f"\n{num_entities:,} entities x {args.dim} dimensions, storage='mmap', row-wise Adagrad, n={args.shards}")
    print(f"peak resident {_status('VmHWM') / 2**30:.2f} GiB, anonymous now {_status('RssAnon') / 2**30:.2f} GiB")
    print("| stage | seconds | detail |\n|---|---|---|")
    for name, seconds, detail in stages:
        print(f"| {name} | {seconds:.1f} | {detail} |")
    files.cleanup()
    if args.output is not None:
        title = (
            f"a generated graph of {num_entities:,} entities, DistMult d{args.dim}, storage='mmap', row-wise Adagrad, "
            f"n={args.shards}; peak resident {_status('VmHWM') / 2**30:.2f} GiB"
        )
        rows = [dict(stage=name, seconds=round(seconds, 3), what=detail) for name, seconds, detail in stages]
        configuration = (
            f"{num_entities:,} entities, {num_relations} relations, {args.large_steps} steps of batch "
            f"{args.batch_size} uniformly drawn triples, {args.negatives} negatives, "
            f"{args.threads} threads; the tables in files"
        )
        table = dict(title=title, command=command_line("benchmarks/storage.py"), rows=rows)
        write_result(args.output, "storage", "benchmarks/storage.py", [table], configuration, describe(args.device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, help="a folder with train.txt and test.txt")
    parser.add_argument("--large", type=int, help="entities of a generated graph trained with storage='mmap'")
    parser.add_argument("--large-steps", type=int, default=200, help="training steps of --large")
    parser.add_argument("--tiers", nargs="+", default=["device", "host", "mmap"])
    parser.add_argument("--optimizers", nargs="+", default=["adam", "rowwise_adagrad"])
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--negatives", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--eval-triples", type=int, default=500)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--storage-dir", default=None, help="where the mmap tier's files go (default: the temp dir)")
    parser.add_argument("--output", type=pathlib.Path, help="write the table as a result file (JSON)")
    parser.add_argument("--worker", nargs=2, metavar=("TIER", "OPTIMIZER"), help=argparse.SUPPRESS)
    add_device_argument(parser, default=None)  # --large: the CPU; otherwise "auto"
    args = parser.parse_args()
    if args.device is None:
        args.device = parse_device("cpu" if args.large else "auto")
    if args.worker:
        args.tier, args.optimizer = args.worker
        worker(args)
        return
    if args.large:
        if args.device.type != "cpu":
            parser.error("--large computes on the CPU (a model built on the meta device is materialised there)")
        large(args)
        return
    if args.data is None:
        parser.error("--data is required (or --large)")
    rows = []
    for optimizer in args.optimizers:
        for tier in args.tiers:
            command = [sys.executable, __file__, "--worker", tier, optimizer]
            passed = ("data", "shards", "epochs", "dim", "negatives", "batch_size", "eval_triples", "threads", "device")
            for name in passed:
                command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            if args.storage_dir:
                command += ["--storage-dir", args.storage_dir]
            run = subprocess.run(command, capture_output=True, text=True)
            if run.returncode != 0:  # the worker's own error, not only its exit status
                sys.exit(f"The {tier} / {optimizer} worker failed ({run.returncode}):\n{run.stderr[-3000:]}")
            result = json.loads(run.stdout.strip().splitlines()[-1])
            rows.append((optimizer, tier, result))
            print(f"{optimizer} {tier}: {result['plan']}", file=sys.stderr)
    setting = f"DistMult d{args.dim}, {args.negatives} negatives, batch {args.batch_size}, n={args.shards}"
    print(f"\n{args.data.name}, {setting}; compute device {args.device}")
    print(
        "| optimizer | storage | triples/s | vs device | MiB moved per step | peak RSS (MiB) | RssAnon after (MiB) "
        "| eval s | MRR |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for optimizer, tier, result in rows:
        device = next(r for o, t, r in rows if o == optimizer and t == "device") if "device" in args.tiers else result
        print(
            f"| {optimizer} | {tier} | {result['triples_per_s']:,.0f} | "
            f"{result['triples_per_s'] / device['triples_per_s']:.2f}x | {result['bytes_per_step'] / 2**20:.2f} | "
            f"{result['peak_rss'] / 2**20:,.0f} | {result['anonymous'] / 2**20:,.0f} | {result['evaluation_s']:.1f} | "
            f"{result['mrr']:.3f} |"
        )
    if args.output is not None:
        rates = {"adam": "lr 1e-3", "rowwise_adagrad": "lr 0.1"}
        optimizers = ", ".join(f"{OPTIMIZERS.get(o, o)} {rates.get(o, '')}".strip() for o in args.optimizers)
        steady = {1: "the one epoch", 2: "epoch 2 of 2"}.get(args.epochs, f"epochs 2-{args.epochs} of {args.epochs}")
        threads = f"{args.threads} thread{'s' if args.threads > 1 else ''}"
        configuration = (
            f"{args.data.name}, {setting}; {optimizers}; throughput of {steady}; {threads}, one fresh "
            f"process per row; filtered MRR and evaluation time on {args.eval_triples} test triples"
        )
        table = dict(title="tiers", rows=tier_rows(rows, args.eval_triples))
        write_result(args.output, "storage", "benchmarks/storage.py", [table], configuration, describe(args.device))


def tier_rows(rows: list[tuple[str, str, dict]], eval_triples: int) -> list[dict]:
    """The tiers' rows of the result file (:mod:`result_files`): against the device tier of the same optimizer."""
    written = []
    for optimizer, tier, result in rows:
        device = next((r for o, t, r in rows if o == optimizer and t == "device"), None)
        written.append(
            {
                "optimizer": OPTIMIZERS.get(optimizer, optimizer),
                "storage": tier,
                "triples_per_s": result["triples_per_s"],
                "vs_device": None if device is None else result["triples_per_s"] / device["triples_per_s"],
                "mib_moved_per_step": result["bytes_per_step"] / 2**20,
                "peak_rss_mib": result["peak_rss"] / 2**20,
                "rss_anon_after_mib": result["anonymous"] / 2**20,
                f"eval_{eval_triples}_seconds": result["evaluation_s"],
                f"mrr_{eval_triples}": result["mrr"],
            }
        )
    return written


if __name__ == "__main__":
    main()
