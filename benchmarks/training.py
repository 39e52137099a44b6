"""Training throughput: PyKEEN's stock sLCWA loop, BessTrainingLoop, a hand-written step and PyTorch-BigGraph.

**DistMult workload** (the default): DistMult (dimension 256, 64 negatives per positive, batch 512,
Adam) trained with

* PyKEEN's ``SLCWATrainingLoop`` (64 *unshared* negatives per positive, its basic sampler), timed
  on batches after the first few (``--stock-batches``; an epoch takes minutes);
* ``BessTrainingLoop`` with ``n = 1`` and ``n = 4`` logical shards (the default negatives: one set
  of 64 drawn equally from every shard and shared by all 16 blocks of a step, gathered and scored
  once), and with ``n = 4`` and ``negatives="block"`` (BESS's original scheme: 64 per block);
* a minimal hand-written PyTorch step with the same objective as BESS with one shard: a batch of
  random triples, 64 negatives shared by the whole batch (half of the batch corrupts heads, half
  tails), PyKEEN's DistMult loss and regularizer, ``nn.Embedding(sparse=True)`` with
  ``torch.optim.SparseAdam`` for entities, Adam for relations, unit-norm entity rows as PyKEEN's
  DistMult constrains them — the practical ceiling on this machine;

on WN18RR (``--data``) and on a generated graph. BESS and the hand-written step run ``--epochs``
epochs; their throughput is that of the steady-state epochs (the best after the first, which pays
for the set-up and the thread-count trial). Targets: BESS >= 40x the stock loop at n = 1 and 4,
n = 4 within 1.5x of n = 1. BESS runs with the command line's settings of the process
(``num_threads="auto"``, ``host_allocator="auto"``; the Python API leaves both alone unless asked).
The stock loop is timed first, with the C library's allocator as PyKEEN users have it; then BESS's
allocator setting (:mod:`pykeen_bess.runtime.allocator`) is made, process-wide and for good, and the stock
loop is timed again beside everything else. As the setting cannot be undone, its effect on BESS is
measured apart, on WN18RR: BESS at n = 1 and n = 4, each run in a fresh process, alternately with
``host_allocator="auto"`` and ``None`` (``--allocator-runs`` pairs; the median counts).

**PyTorch-BigGraph's workload** (``--pbg-workload``, with ``torchbiggraph`` installed): ComplEx with
64 complex dimensions, batch 1,000, PyTorch-BigGraph's 100 uniform + 50 batch negatives (152
shared negatives for BESS, a multiple of 4), Adagrad (BESS: ``rowwise_adagrad``, PyTorch-BigGraph's
``RowAdagrad``), on two generated graphs: 500,000 triples over 100,000 entities (``--pbg-entities``,
``--pbg-triples``), and a smaller, skewed one, 200,000 triples over 20,000 entities whose heads
follow Zipf's law (exponent 1.1; ``--pbg-skewed ENTITIES:TRIPLES``, ``none`` to skip). Measured in
the same run: ``torchbiggraph_train`` with 2 Hogwild workers (its own "Processed N edges in T s"
per epoch; the best epoch), and BESS at n = 1 and n = 4 (and n = 4 with ``negatives="block"``),
all without a regularizer (PyTorch-BigGraph regularizes nothing); then BESS at n = 1 and n = 4 with
ComplEx's default regularizer (PyKEEN's L2 term on entity and relation rows), each beside the same
setting unregularized, the two loops training in turn epoch by epoch in one process (which of them
goes first alternates too: of two identical loops the first ran about 2% faster) for
``--ratio-epochs`` epochs; reported as the median of their epochs' ratios (after the first epoch, over
all ``--repeats``), which compares them under the same machine load (separate runs differed by more
than the regularizer's cost; with 2 ratios per repeat the median of one run moved between 0.82 and 1.0
while the operators the regularizer adds take 3-4% of a step's, by the profiler). Targets:
BESS n = 1 >= 1.5x PyTorch-BigGraph, n = 4 >= 1.0x; a regularized step at least 0.9x an
unregularized one.

**A step against another commit's** (``--baseline CHECKOUT``, e.g. a ``git worktree`` of the commit
before a change): BESS on WN18RR at ``--ab-shards`` (default 1 and 4), each run in a fresh process
that imports ``pykeen_bess`` from the checkout or from this one, alternately (``--ab-runs`` pairs;
``--threads`` intra-op threads, the C library's allocator left alone); the medians and the pairs'
ratios.

``--output FILE.json`` writes the rows of the tables with the date, commit, machine and settings.

``--device`` (:mod:`devices`) picks the compute device of PyKEEN's loop, BESS and the hand-written
step (default: CUDA when torch sees a GPU); PyTorch-BigGraph always trains on the CPU, as its
Hogwild workers do.

    python benchmarks/training.py --data ../shared/data/wn18rr
    python benchmarks/training.py --pbg-workload
    python benchmarks/training.py --data ../shared/data/wn18rr --device cuda
    python benchmarks/training.py --data ../shared/data/wn18rr --baseline ../base --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as functional
from pykeen.losses import MarginRankingLoss
from pykeen.models import ComplEx, DistMult
from pykeen.regularizers import LpRegularizer
from pykeen.training import SLCWATrainingLoop, TrainingCallback
from pykeen.triples import CoreTriplesFactory, TriplesFactory

from devices import CLI_HOST_SETTINGS, add_device_argument, describe, synchronize
from result_files import commit, paired_columns, write_result
from pykeen_bess.runtime.allocator import resolve_allocator
from pykeen_bess.training import BessTrainingLoop


def load_wn18rr(directory: pathlib.Path) -> CoreTriplesFactory:
    """Load the WN18RR training triples."""
    return TriplesFactory.from_path(directory / "train.txt")


def generate_graph(
    num_entities: int, num_relations: int, num_triples: int, seed: int = 0, head_exponent: float = 0.5
) -> CoreTriplesFactory:
    """Generate a random graph with a skewed (Zipf-like) entity degree distribution.

    Entity ``k`` (from 1) is a tail with weight ``k ** -0.5`` and a head with weight ``k ** -head_exponent``
    (Zipf's law for exponents about 1: a few heads hold most triples).
    """
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, num_entities + 1, dtype=torch.float64) ** 0.5
    head_weights = 1.0 / torch.arange(1, num_entities + 1, dtype=torch.float64) ** head_exponent
    heads = torch.multinomial(head_weights, num_triples, replacement=True, generator=generator)
    tails = torch.multinomial(weights, num_triples, replacement=True, generator=generator)
    relations = torch.randint(num_relations, (num_triples,), generator=generator)
    triples = torch.stack([heads, relations, tails], dim=1).unique(dim=0)
    return CoreTriplesFactory.create(mapped_triples=triples, num_entities=num_entities, num_relations=num_relations)


def make_model(triples_factory: CoreTriplesFactory, dim: int, device: torch.device) -> DistMult:
    """Create the benchmark model on ``device``."""
    return DistMult(triples_factory=triples_factory, embedding_dim=dim, random_seed=0).to(device)


class EpochClock(TrainingCallback):
    """Records when every epoch ends (the first one's start is the training's), after the device's work."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.ends: list[float] = []

    def post_epoch(self, epoch: int, epoch_loss: float, **kwargs) -> None:
        synchronize(self.device)
        self.ends.append(time.perf_counter())


class _Done(Exception):
    pass


def time_stock(
    tf: CoreTriplesFactory, dim: int, negatives: int, batch_size: int, batches: int, device: torch.device
) -> float:
    """Return positives per second of PyKEEN's sLCWA loop on ``batches`` batches after the first 5."""
    model = make_model(tf, dim, device)
    loop = SLCWATrainingLoop(
        model=model,
        triples_factory=tf,
        optimizer="adam",
        negative_sampler_kwargs=dict(num_negs_per_pos=negatives),
        automatic_memory_optimization=False,
    )
    times: list[float] = []

    class Clock(TrainingCallback):
        def post_batch(self, epoch: int, batch, **kwargs) -> None:
            synchronize(device)
            times.append(time.perf_counter())
            if len(times) > 5 + batches:
                raise _Done

    try:
        loop.train(tf, num_epochs=1, batch_size=batch_size, use_tqdm=False, callbacks=Clock())
    except _Done:
        pass
    done = len(times) - 1 - 5
    return done * batch_size / (times[-1] - times[5])


def steady(starts: float, ends: list[float], num_triples: int) -> tuple[float, float]:
    """Positives per second of the first epoch (with the set-up) and of the best later epoch."""
    durations = [b - a for a, b in zip([starts, *ends[:-1]], ends)]
    later = durations[1:] or durations
    return num_triples / durations[0], num_triples / min(later)


def time_bess(tf: CoreTriplesFactory, model, epochs: int, batch_size: int, **loop_kwargs) -> tuple[float, float]:
    """Return positives per second of BESS: the first epoch (set-up included) and the best steady epoch."""
    loop_kwargs = {**CLI_HOST_SETTINGS, **loop_kwargs}
    loop = BessTrainingLoop(model=model, triples_factory=tf, automatic_memory_optimization=False, **loop_kwargs)
    device = next(model.parameters()).device
    clock = EpochClock(device)
    synchronize(device)
    start = time.perf_counter()
    loop.train(tf, num_epochs=epochs, batch_size=batch_size, use_tqdm=False, callbacks=clock)
    return steady(start, clock.ends, tf.num_triples)


def time_alternating(
    tf: CoreTriplesFactory, models: dict[str, Any], epochs: int, batch_size: int, **loop_kwargs
) -> dict[str, list[float]]:
    """Return the positives per second of every epoch of BESS loops that train their models in turn, epoch by epoch.

    Their ratios epoch by epoch compare the loops under the same machine load (separate runs, or fresh
    processes, differed by more than the difference measured; the first epoch includes the set-up). The
    order reverses every epoch: of two identical loops training in turn the first was faster (median
    ratio 0.98 over 6 epochs, 2-core CPU).
    """
    loop_kwargs = {**CLI_HOST_SETTINGS, **loop_kwargs}
    loops = {
        key: BessTrainingLoop(model=model, triples_factory=tf, automatic_memory_optimization=False, **loop_kwargs)
        for key, model in models.items()
    }
    rates: dict[str, list[float]] = {key: [] for key in loops}
    for epoch in range(1, epochs + 1):
        order = list(loops.items())
        for key, loop in order if epoch % 2 else order[::-1]:
            device = next(loop.model.parameters()).device
            synchronize(device)
            start = time.perf_counter()
            loop.train(tf, num_epochs=epoch, batch_size=batch_size, use_tqdm=False, continue_training=epoch > 1)
            synchronize(device)
            rates[key].append(tf.num_triples / (time.perf_counter() - start))
    return rates


def time_handwritten(
    tf: CoreTriplesFactory, dim: int, negatives: int, batch_size: int, epochs: int, device: torch.device
) -> float:
    """Return positives per second of a minimal hand-written step with the same objective (best steady epoch).

    The step optimises what BessTrainingLoop optimises for PyKEEN's DistMult with one shard: a batch
    of random triples, ``negatives`` entities shared by the whole batch (the first half of the batch
    corrupts heads, the second half tails), PyKEEN's default DistMult loss (margin ranking) and
    relation regularizer, unit-norm entity rows, lazy Adam (``torch.optim.SparseAdam`` on an
    ``nn.Embedding(sparse=True)``) for entities and Adam for relations.
    """
    synchronize(device)
    start = time.perf_counter()
    torch.manual_seed(0)
    entities = torch.nn.Embedding(tf.num_entities, dim, sparse=True, device=device)
    relations = torch.nn.Embedding(tf.num_relations, dim, device=device)
    with torch.no_grad():
        entities.weight.copy_(functional.normalize(entities.weight, dim=-1))
    entity_optimizer = torch.optim.SparseAdam(entities.parameters(), lr=1e-3)
    relation_optimizer = torch.optim.Adam(relations.parameters(), lr=1e-3)
    loss_function = MarginRankingLoss()
    regularizer = LpRegularizer(**DistMult.regularizer_default_kwargs).to(device)
    triples = tf.mapped_triples.to(device)
    half = batch_size // 2
    ends = []
    for _ in range(epochs):
        order = torch.randperm(triples.shape[0], device=device)
        for batch_start in range(0, triples.shape[0], batch_size):
            batch = triples[order[batch_start : batch_start + batch_size]]
            negative_ids = torch.randint(tf.num_entities, (negatives,), device=device)
            h, r, t = entities(batch[:, 0]), relations(batch[:, 1]), entities(batch[:, 2])
            negative = entities(negative_ids)
            positive_scores = (h * r * t).sum(dim=-1, keepdim=True)
            negative_scores = torch.cat([(r[:half] * t[:half]) @ negative.t(), (h[half:] * r[half:]) @ negative.t()])
            regularizer.update(r)
            loss = (
                loss_function.process_slcwa_scores(positive_scores, negative_scores)
                + regularizer.pop_regularization_term()
            )
            entity_optimizer.zero_grad()
            relation_optimizer.zero_grad()
            loss.sum().backward()
            entity_optimizer.step()
            relation_optimizer.step()
            with torch.no_grad():
                touched = torch.cat([batch[:, 0], batch[:, 2], negative_ids]).unique()
                entities.weight[touched] = functional.normalize(entities.weight[touched], dim=-1)
        synchronize(device)
        ends.append(time.perf_counter())
    return steady(start, ends, triples.shape[0])[1]


#: the BESS runs of both workloads: (shards, negatives); one shard draws the same either way
BESS_SETTINGS = ((1, "step"), (4, "step"), (4, "block"))
#: the BESS settings also timed in fresh processes with and without the allocator setting
ALLOCATOR_SETTINGS = ((1, "step"), (4, "step"))
#: the rows of those runs, by ``host_allocator``
ALLOCATOR_LOOPS = {
    "auto": "BessTrainingLoop, fresh process, host_allocator='auto'",
    "keep": "BessTrainingLoop, fresh process, host_allocator=None",
}


#: the BESS settings of PyTorch-BigGraph's workload also timed with ComplEx's default regularizer
REGULARIZED_SHARDS = (1, 4)
#: the key suffix of those runs
REGULARIZED = ", regularized"
#: the key suffix of their speed over the unregularized step's, measured in alternate epochs of one process
ALTERNATING = ", over unregularized"


def label(n: int, negatives: str) -> str:
    """Name a BESS run in the tables (the default negatives, one set per step, unnamed)."""
    return f"n={n}" + ("" if negatives == "step" else f', negatives="{negatives}"')


def run_bess(
    tf: CoreTriplesFactory, args: argparse.Namespace, n: int, negatives: str, **loop_kwargs
) -> tuple[float, float]:
    """Time BESS on the DistMult workload with ``n`` shards and a negatives scheme (first and best epoch)."""
    return time_bess(
        tf,
        make_model(tf, args.dim, args.device),
        args.epochs,
        args.batch_size,
        num_shards=n,
        exchange=args.exchange,
        num_negs_per_pos=args.negatives,
        optimizer="adam",
        negatives=negatives,
        **loop_kwargs,
    )


def allocator_runs(args: argparse.Namespace) -> dict[str, dict[tuple[int, str], tuple[float, float]]]:
    """Time BESS on WN18RR in fresh processes, alternately with and without the allocator setting.

    :returns: for ``"auto"`` and ``"keep"``, per setting of :data:`ALLOCATOR_SETTINGS` the medians of the
        first and of the best steady epoch's positives per second
    """
    runs: dict[str, dict[tuple[int, str], list[tuple[float, float]]]] = {
        allocator: {setting: [] for setting in ALLOCATOR_SETTINGS} for allocator in ALLOCATOR_LOOPS
    }
    for _ in range(args.allocator_runs):
        for setting in ALLOCATOR_SETTINGS:
            for allocator in ALLOCATOR_LOOPS:  # A B A B: a drifting machine speed hits both alike
                command = [sys.executable, __file__, "--data", str(args.data), "--dim", str(args.dim)]
                command += ["--negatives", str(args.negatives), "--batch-size", str(args.batch_size)]
                command += ["--epochs", str(args.epochs), "--exchange", args.exchange, "--device", str(args.device)]
                command += ["--one-bess", f"{setting[0]}:{setting[1]}:{allocator}"]
                output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                runs[allocator][setting].append(tuple(json.loads(output.strip().splitlines()[-1])))
    medians = {
        allocator: {
            setting: (statistics.median(r[0] for r in values), statistics.median(r[1] for r in values))
            for setting, values in settings.items()
        }
        for allocator, settings in runs.items()
    }
    for allocator, settings in medians.items():
        print(
            f"# WN18RR, fresh processes, host_allocator={allocator}: "
            + ", ".join(f"{label(*k)} {v[1]:,.0f}/s" for k, v in settings.items()),
            flush=True,
        )
    return medians


def step_ab(args: argparse.Namespace) -> list[dict]:
    """The training step of this tree against a baseline checkout's, in fresh processes, A B A B (``--baseline``).

    Each run is one BESS run on WN18RR (``--one-bess``) with the process's default step: the baseline
    imports ``pykeen_bess`` from ``--baseline`` (a checkout of another commit, e.g. the one before a
    change), this tree from its own checkout. Per setting, the medians of the best steady epoch and of
    the pairs' ratios; the table's rows.
    """
    here = pathlib.Path(__file__).resolve().parent.parent
    runs: dict[tuple[int, str], dict[str, list[float]]] = {
        (n, "step"): {"baseline": [], "this": []} for n in args.ab_shards
    }
    for _ in range(args.ab_runs):
        for setting, measured in runs.items():
            for which, tree in (("baseline", args.baseline), ("this", here)):
                command = [sys.executable, __file__, "--data", str(args.data.resolve()), "--dim", str(args.dim)]
                command += ["--negatives", str(args.negatives), "--batch-size", str(args.batch_size)]
                command += ["--epochs", str(args.epochs), "--exchange", args.exchange, "--device", str(args.device)]
                command += ["--one-bess", f"{setting[0]}:{setting[1]}:keep", "--threads", str(args.threads)]
                # the tree's package first on the path, from a directory without one of its own
                env = dict(os.environ, PYTHONPATH=str(tree))
                result = subprocess.run(
                    command, check=True, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir()
                )
                measured[which].append(json.loads(result.stdout.strip().splitlines()[-1])[1])
    baseline = commit(args.baseline) or str(args.baseline)
    rows = []
    for (n, negatives), measured in runs.items():
        columns = paired_columns(measured["baseline"], measured["this"], "positives_per_s")
        rows.append(
            dict(
                dataset="WN18RR", num_shards=n, negatives=negatives, threads=args.threads, baseline=baseline, **columns
            )
        )
        row = rows[-1]
        print(
            f"# {label(n, negatives)}, {args.threads} thread(s): baseline {row['baseline_positives_per_s']:,.0f}/s, "
            f"this tree {row['this_positives_per_s']:,.0f}/s, ratio {row['ratio_median']:.3f} "
            f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f} over {row['pairs']} pairs)",
            flush=True,
        )
    return rows


def one_bess(args: argparse.Namespace) -> None:
    """Print ``[first, best]`` positives per second of one BESS run on WN18RR (``--one-bess N:NEGATIVES:ALLOCATOR``)."""
    n, negatives, allocator = args.one_bess.split(":")
    if args.threads:
        torch.set_num_threads(args.threads)
    tf = load_wn18rr(args.data)
    first, best = run_bess(tf, args, int(n), negatives, host_allocator=None if allocator == "keep" else "auto")
    print(json.dumps([first, best]))


def distmult_workload(args: argparse.Namespace) -> list[dict]:
    """BESS vs PyKEEN's stock loop vs the hand-written step, on WN18RR and a generated graph; the table's rows."""
    datasets = {
        "WN18RR" if args.data.name.lower() == "wn18rr" else args.data.name: load_wn18rr(args.data),
        "generated": generate_graph(args.generated_entities, 50, args.generated_triples),
    }
    rows = []
    # the stock loop first, with the C library's allocator as PyKEEN users have it: BESS's allocator
    # setting (pykeen_bess.runtime.allocator) is process-wide and stays, and everything after it runs with it,
    # the hand-written step and a second timing of the stock loop included
    stock_default = {}
    for name, tf in datasets.items():
        stock_default[name] = time_stock(tf, args.dim, args.negatives, args.batch_size, args.stock_batches, args.device)
        print(f"# {name}: stock sLCWA {stock_default[name]:,.0f}/s", flush=True)
    allocator = allocator_runs(args) if args.allocator_runs > 0 else {}
    resolve_allocator("auto", args.device).apply()  # on a GPU: left alone, as BESS leaves it
    for name, tf in datasets.items():
        print(f"# {name}: {tf.num_entities:,} entities, {tf.num_triples:,} triples", flush=True)
        stock = stock_default[name]
        stock_retained = time_stock(tf, args.dim, args.negatives, args.batch_size, args.stock_batches, args.device)
        print(f"stock sLCWA with BESS's allocator setting: {stock_retained:,.0f}/s", flush=True)
        # interleaved repeats, best of each: this machine's timings vary by tens of percent
        handwritten = 0.0
        bess = {setting: (0.0, 0.0) for setting in BESS_SETTINGS}
        for _ in range(args.repeats):
            handwritten = max(
                handwritten, time_handwritten(tf, args.dim, args.negatives, args.batch_size, args.epochs, args.device)
            )
            for setting in bess:
                first, best = run_bess(tf, args, *setting)
                bess[setting] = (max(bess[setting][0], first), max(bess[setting][1], best))
        print(
            f"hand-written: {handwritten:,.0f}/s; BESS: "
            + ", ".join(f"{label(*k)} {v[1]:,.0f}/s (first epoch {v[0]:,.0f}/s)" for k, v in bess.items()),
            flush=True,
        )
        dataset = f"{name} ({tf.num_entities:,} entities, {tf.num_triples:,} triples)"
        for loop, value in (
            ("PyKEEN SLCWATrainingLoop", stock),
            ("PyKEEN SLCWATrainingLoop, BESS's allocator setting", stock_retained),
        ):
            rows.append(dict(dataset=dataset, loop=loop, num_shards=None, negatives="unshared", positives_per_s=value))
        rows.append(
            dict(
                dataset=dataset,
                loop="hand-written step (shared negatives)",
                num_shards=1,
                negatives="step",
                positives_per_s=handwritten,
            )
        )
        single = bess[1, "step"][1]
        timed = [("BessTrainingLoop", bess)]
        if name == next(iter(datasets)):  # WN18RR
            timed += [(ALLOCATOR_LOOPS[setting], runs) for setting, runs in allocator.items()]
        for loop, runs in timed:
            for (n, negatives), (first, best) in runs.items():
                rows.append(
                    dict(
                        dataset=dataset,
                        loop=loop,
                        num_shards=n,
                        negatives=negatives,
                        positives_per_s=best,
                        x_stock=round(best / stock, 1),
                        x_handwritten=round(best / handwritten, 2),
                        n1_over_this=round(single / best, 2),
                        first_epoch_positives_per_s=first,
                    )
                )
    print()
    print(
        "| dataset | loop | positives/s (steady) | x stock | x hand-written | n=1 / this | first epoch, positives/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        loop = row["loop"] + (f" {label(row['num_shards'], row['negatives'])}" if "x_stock" in row else "")
        ratios = (
            f"{row['x_stock']:.1f} | {row['x_handwritten']:.2f} | {row['n1_over_this']:.2f} "
            f"| {row['first_epoch_positives_per_s']:,.0f}"
            if "x_stock" in row
            else " | | | "
        )
        print(f"| {row['dataset'].split(' (')[0]} | {loop} | {row['positives_per_s']:,.0f} | {ratios} |")
    return rows


def time_pbg(tf: CoreTriplesFactory, args: argparse.Namespace, directory: pathlib.Path) -> float:
    """Return PyTorch-BigGraph's best epoch (edges per second of its training, 2 Hogwild workers)."""
    from pykeen_bess import pbg

    graph = pbg.write(pbg.TypedGraph.from_factories(tf), directory / "data")
    config = pbg.graph_config(
        graph,
        dict(
            dimension=2 * args.pbg_dim,
            operator="complex_diagonal",
            comparator="dot",
            lr=0.1,
            loss_fn="softmax",
            num_epochs=args.epochs,
            batch_size=1000,
            num_uniform_negs=100,
            num_batch_negs=50,
            workers=2,
            hogwild_delay=0,
        ),
        checkpoint_path=directory / "checkpoint",
    )
    pbg.write_config(config, directory)
    result = subprocess.run(
        [str(pathlib.Path(sys.executable).parent / "torchbiggraph_train"), "config.py"],
        cwd=directory,
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.findall(r"Processed (\d+) edges in ([\d.]+) s", result.stdout + result.stderr)
    return max(int(edges) / float(seconds) for edges, seconds in found)


def pbg_workload(args: argparse.Namespace) -> list[dict]:
    """PyTorch-BigGraph's own workload: ComplEx d64 (complex), 150 negatives, batch 1000, Adagrad; its rows."""
    graphs = {f"generated ({args.pbg_entities:,} entities)": generate_graph(args.pbg_entities, 50, args.pbg_triples)}
    if args.pbg_skewed != "none":
        entities, triples = (int(part) for part in args.pbg_skewed.split(":"))
        graphs[f"skewed ({entities:,} entities, Zipf heads)"] = generate_graph(entities, 50, triples, head_exponent=1.1)
    rows: list[dict] = []
    for name, tf in graphs.items():
        print(f"# {name}: {tf.num_entities:,} entities, {tf.num_triples:,} triples", flush=True)
        results: dict[str, float] = {}
        ratio_runs: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as directory:
                results["pbg"] = max(results.get("pbg", 0.0), time_pbg(tf, args, pathlib.Path(directory)))
            settings = dict(num_negs_per_pos=152, optimizer="rowwise_adagrad", optimizer_kwargs=dict(lr=0.1))
            for n, negatives in BESS_SETTINGS:
                model = ComplEx(triples_factory=tf, embedding_dim=args.pbg_dim, random_seed=0, regularizer=None)
                _, best = time_bess(tf, model.to(args.device), args.epochs, 1000, num_shards=n, negatives=negatives,
                                    **settings)  # fmt: skip
                results[label(n, negatives)] = max(results.get(label(n, negatives), 0.0), best)
            for n in REGULARIZED_SHARDS:
                models = {
                    key: ComplEx(triples_factory=tf, embedding_dim=args.pbg_dim, random_seed=0, **kwargs)
                    for key, kwargs in ((REGULARIZED, {}), ("", {"regularizer": None}))
                }
                models = {key: model.to(args.device) for key, model in models.items()}
                epochs = args.ratio_epochs
                rates = time_alternating(tf, models, epochs, 1000, num_shards=n, negatives="step", **settings)
                key = label(n, "step") + REGULARIZED
                results[key] = max(results.get(key, 0.0), max(rates[REGULARIZED][1:] or rates[REGULARIZED]))
                ratios = [a / b for a, b in zip(rates[REGULARIZED], rates[""])][1:] or [0.0]
                ratio_runs.setdefault(key, []).extend(ratios)
                results[key + ALTERNATING] = statistics.median(ratio_runs[key])
            print(json.dumps({k: round(v, 2) for k, v in results.items()}), flush=True)
        rows.append(
            dict(
                run=name,
                contender="PyTorch-BigGraph, 2 Hogwild workers (CPU)",
                num_shards=None,
                negatives=None,
                positives_per_s=results["pbg"],
                x_pbg=1.0,
            )
        )
        for n, negatives in BESS_SETTINGS:
            value = results[label(n, negatives)]
            rows.append(
                dict(
                    run=name,
                    contender="BessTrainingLoop",
                    num_shards=n,
                    negatives=negatives,
                    positives_per_s=value,
                    x_pbg=round(value / results["pbg"], 2),
                    n1_over_this=round(results["n=1"] / value, 2),
                )
            )
        for n in REGULARIZED_SHARDS:
            value = results[label(n, "step") + REGULARIZED]
            rows.append(
                dict(
                    run=name,
                    contender="BessTrainingLoop, ComplEx's default regularizer",
                    num_shards=n,
                    negatives="step",
                    positives_per_s=value,
                    x_pbg=round(value / results["pbg"], 2),
                    x_unregularized=round(results[label(n, "step") + REGULARIZED + ALTERNATING], 2),
                )
            )
    print()
    print("| graph | loop | positives/s (best epoch) | x PyTorch-BigGraph | n=1 / this | x unregularized |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        loop = (
            row["contender"]
            if row["num_shards"] is None
            else f"{row['contender']} {label(row['num_shards'], row['negatives'])}"
        )
        scaling = f"{row['n1_over_this']:.2f}" if "n1_over_this" in row else ""
        regularized = f"{row['x_unregularized']:.2f}" if "x_unregularized" in row else ""
        rate = f"{row['positives_per_s']:,.0f}"
        print(f"| {row['run']} | {loop} | {rate} | {row['x_pbg']:.2f} | {scaling} | {regularized} |")
    return rows


def write_results(path: pathlib.Path, args: argparse.Namespace, workload: str, rows: list[dict]) -> None:
    """Write a run's rows as the benchmarks page reads them: date, commit, machine, device, configuration, table."""
    configuration = (
        "ComplEx, 64 complex dimensions, batch 1,000, 152 shared negatives (PyTorch-BigGraph: 100 uniform + 50 "
        "batch), row-wise Adagrad lr 0.1 (PyTorch-BigGraph: RowAdagrad)"
        if workload == "pbg"
        else f"DistMult d{args.dim}, {args.negatives} negatives per positive, batch {args.batch_size}, Adam"
    )
    write_result(
        path,
        "training-pbg-workload" if workload == "pbg" else "training",
        "benchmarks/training.py",
        [dict(title="positives per second", rows=rows)],
        configuration,
        device=describe(args.device),
    )


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, help="the WN18RR directory (DistMult workload)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--negatives", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (the first pays the set-up)")
    parser.add_argument("--generated-entities", type=int, default=200_000)
    parser.add_argument("--generated-triples", type=int, default=100_000)
    parser.add_argument("--stock-batches", type=int, default=30, help="stock loop: batches timed after the first 5")
    parser.add_argument("--exchange", default="embedding", choices=["embedding", "score"])
    parser.add_argument("--repeats", type=int, default=2, help="runs per contender, interleaved: the best counts")
    parser.add_argument(
        "--ratio-epochs", type=int, default=7, help="PBG workload: epochs of the regularized and unregularized loops"
    )
    parser.add_argument("--pbg-workload", action="store_true", help="PyTorch-BigGraph's workload instead")
    parser.add_argument("--pbg-entities", type=int, default=100_000)
    parser.add_argument("--pbg-triples", type=int, default=500_000)
    parser.add_argument("--pbg-dim", type=int, default=64, help="complex dimensions (PyTorch-BigGraph's: twice)")
    parser.add_argument(
        "--pbg-skewed", default="20000:200000", help="ENTITIES:TRIPLES of the skewed graph (Zipf heads), or none"
    )
    parser.add_argument(
        "--allocator-runs", type=int, default=3, help="pairs of fresh-process BESS runs with and without the allocator"
    )
    parser.add_argument(
        "--baseline",
        type=pathlib.Path,
        help="a checkout of another commit: time its training step against this tree's instead (fresh processes)",
    )
    parser.add_argument("--ab-runs", type=int, default=5, help="pairs of --baseline runs per setting")
    parser.add_argument("--ab-shards", type=int, nargs="+", default=[1, 4], help="the --baseline runs' shard counts")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads of the --baseline runs (0: torch's)")
    parser.add_argument("--one-bess", help=argparse.SUPPRESS)  # one BESS run of allocator_runs, in this process
    parser.add_argument("--output", type=pathlib.Path, help="write the table's rows as JSON")
    add_device_argument(parser)
    args = parser.parse_args()
    if args.one_bess is not None:
        one_bess(args)
        return
    print(f"# device: {describe(args.device)}; torch {torch.__version__}", flush=True)
    if args.baseline is not None:
        if args.data is None:
            parser.error("--baseline times the DistMult workload on WN18RR: give --data")
        rows = step_ab(args)
        if args.output is not None:
            configuration = (
                f"DistMult d{args.dim}, {args.negatives} negatives per positive, batch {args.batch_size}, Adam; each "
                f"run the process's default step, this tree's against {args.baseline}'s"
            )
            write_result(
                args.output,
                "training-step-ab",
                "benchmarks/training.py",
                [dict(title="this tree's step against the baseline's", rows=rows)],
                configuration,
                device=describe(args.device),
            )
        return
    if args.pbg_workload:
        rows, workload = pbg_workload(args), "pbg"
    elif args.data is None:
        parser.error("--data (the WN18RR directory) is needed for the DistMult workload")
    else:
        rows, workload = distmult_workload(args), "distmult"
    if args.output is not None:
        write_results(args.output, args, workload, rows)


if __name__ == "__main__":
    main()
