"""wikikg2 scale on one machine: every stage of a BESS run on a 2.5M-entity, 17M-triple graph, timed and measured.

A skewed graph of ogbl-wikikg2's size is generated (``--entities`` 2,500,000, ``--relations`` 500,
``--triples`` 17,000,000 before removing duplicates; heads and tails drawn with weights
``1 / rank^0.75`` by inverse-CDF sampling, relations with weights ``1 / rank``; ``--test`` triples
held out). Then, for each shard count in ``--shards`` (default ``1,4``), the stages of a run:

1. *factory*: ``CoreTriplesFactory.create`` of the training and test triples;
2. *model*: PyKEEN's ``TransE`` (``--dim`` 100, ``--norm`` 1 as PyKEEN's default: an L1 distance,
   which a CPU computes far slower than the matrix product of ``--norm 2``), its 2.5M-row entity
   table initialised;
3. *loop*: ``BessTrainingLoop`` (sharding) and the shardpair partition of the training triples;
4. *first step*: ``train()`` up to the first training step (table installation, initialisation,
   sampler);
5. *epoch*: one epoch of training (``--negatives`` 256 per positive, ``--batch-size`` 4096, Adam),
   or its first ``--steps`` steps (throughput extrapolated, marked in the table);
6. *evaluation*: a filtered evaluation of the ``--test`` triples (both sides) against all
   entities, filtered by the training triples (BessEvaluator with the loop's sharding); its
   note gives the time per query and the evaluator's stages.

For each stage the table gives the wall time, the peak resident memory of the process during the
stage (sampled every 5 ms by a background thread, so probes that reset the kernel's high-water
mark do not hide anything) and its increase over the memory before the stage, next to the sizes
that bound it: the entity table (``E x d`` floats, plus Adam's two moments once trained), the
triples (``T x 3`` int64) and the filter index (24 bytes per triple). Setup (stages 1-4) is
compared with the one-minute target. Nothing may grow with ``E x E`` or ``T x negatives``:
``E x E`` floats would be 25 TB, ``T x negatives`` 17 GB.

``--device`` (:mod:`devices`; default: CUDA when torch sees a GPU) is where the model is trained
and evaluated; on CUDA every stage also reports torch's peak of allocated device memory. The
graph, the triples factory and the partition stay in host memory.

``--output FILE.json`` writes the table as the benchmarks page reads it (:mod:`result_files`).

    python benchmarks/scale.py                        # the full run (about half an hour on 2 cores)
    python benchmarks/scale.py --steps 200            # a shorter check: 200 training steps per shard count
    python benchmarks/scale.py --device cuda          # on a GPU (target: 10M triples/s, TransE d100)
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from pykeen.models import TransE
from pykeen.training.callbacks import TrainingCallback
from pykeen.triples import CoreTriplesFactory

from devices import CLI_HOST_SETTINGS, add_device_argument, describe, synchronize
from result_files import write_result
from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.training import BessTrainingLoop

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """The process's resident set size in bytes."""
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * PAGE


class Stage:
    """Wall time, sampled peak resident memory and (on CUDA) peak allocated device memory of one stage."""

    def __init__(self, name: str, device: torch.device | None = None):
        self.name = name
        self.seconds = 0.0
        self.before = self.peak = resident_bytes()
        self.device = device if device is not None and device.type == "cuda" else None
        self.device_peak: int | None = None
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.note = ""

    def sample(self) -> None:
        self.peak = max(self.peak, resident_bytes())


@contextmanager
def stage(name: str, stages: list[Stage], device: torch.device | None = None) -> Iterator[Stage]:
    """Time a stage and sample its memory every 5 ms (and its peak memory on a CUDA ``device``)."""
    gc.collect()
    record = Stage(name, device)
    done = threading.Event()

    def sampler() -> None:
        while not done.wait(0.005):
            record.sample()

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    start = time.perf_counter()
    try:
        yield record
    finally:
        if record.device is not None:
            synchronize(record.device)
        record.seconds = time.perf_counter() - start
        done.set()
        thread.join()
        record.sample()
        if record.device is not None:
            record.device_peak = torch.cuda.max_memory_allocated(record.device)
        stages.append(record)
        on_device = "" if record.device_peak is None else f", peak CUDA memory {record.device_peak / 2**30:.2f} GiB"
        print(
            f"  {name}: {record.seconds:.1f} s, peak {record.peak / 2**30:.2f} GiB "
            f"(+{(record.peak - record.before) / 2**30:.2f}){on_device} {record.note}",
            flush=True,
        )


def skewed(count: int, size: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """Draw ``count`` ids below ``size`` with weights ``1 / rank^exponent`` (inverse CDF, ids shuffled)."""
    weights = torch.arange(1, size + 1, dtype=torch.float64).pow_(-exponent)
    cdf = torch.cumsum(weights, 0)
    cdf /= cdf[-1].clone()
    ids = torch.searchsorted(cdf, torch.rand(count, dtype=torch.float64, generator=generator)).clamp_(max=size - 1)
    return torch.randperm(size, generator=generator)[ids]


def generate(num_entities: int, num_relations: int, num_triples: int, seed: int = 0) -> torch.Tensor:
    """A skewed graph without duplicate triples, ``[T, 3]`` int64, in random order."""
    generator = torch.Generator().manual_seed(seed)
    heads = skewed(num_triples, num_entities, 0.75, generator)
    relations = skewed(num_triples, num_relations, 1.0, generator)
    tails = skewed(num_triples, num_entities, 0.75, generator)
    # deduplicate by one int64 key (E^2 R < 2^63), not by unique(dim=0) (minutes at this size)
    keys = torch.unique((heads * num_relations + relations) * num_entities + tails)
    del heads, relations, tails
    keys = keys[torch.randperm(keys.shape[0], generator=generator)]
    tails = keys % num_entities
    rest = keys // num_entities
    return torch.stack([rest // num_relations, rest % num_relations, tails], dim=1)


class FirstStep(TrainingCallback):
    """Record when the first step starts (after the device's set-up work) and stop after ``max_steps`` steps."""

    def __init__(self, max_steps: int | None, device: torch.device):
        super().__init__()
        self.max_steps = max_steps
        self.device = device
        self.first: float | None = None
        self.steps = 0

    def pre_batch(self, **kwargs: Any) -> None:
        if self.first is None:
            synchronize(self.device)
            self.first = time.perf_counter()
        elif self.max_steps is not None and self.steps >= self.max_steps:
            # before the next step, not after the last one: callbacks registered later (the optimizer
            # update of BESS's step) must see every counted step through
            raise StopTraining

    def post_batch(self, epoch: int, batch: Any, **kwargs: Any) -> None:
        self.steps += 1


class StopTraining(Exception):
    """Ends a partial epoch."""


def run(args: argparse.Namespace, triples: torch.Tensor, num_shards: int) -> list[Stage]:
    """Run all stages for one shard count."""
    stages: list[Stage] = []
    print(f"# n={num_shards}", flush=True)
    setup_start = time.perf_counter()
    with stage("factory", stages):
        train = CoreTriplesFactory.create(
            mapped_triples=triples[args.test :], num_entities=args.entities, num_relations=args.relations
        )
        test = triples[: args.test]
    with stage("model", stages, args.device) as record:
        model = TransE(triples_factory=train, embedding_dim=args.dim, scoring_fct_norm=args.norm, random_seed=0).to(
            args.device
        )
        record.note = f"(entity table {args.entities * args.dim * 4 / 2**30:.2f} GiB)"
    with stage("loop: sharding and partition", stages, args.device):
        loop = BessTrainingLoop(
            model=model,
            triples_factory=train,
            num_shards=num_shards,
            num_negs_per_pos=args.negatives,
            optimizer="adam",
            optimizer_kwargs=dict(lr=1e-3),
            automatic_memory_optimization=False,
            **CLI_HOST_SETTINGS,
        )
        loop.partition(train)
    callback = FirstStep(args.steps, args.device)
    start = time.perf_counter()
    steps_per_epoch = 0
    with stage("train: setup and epoch", stages, args.device) as record:
        try:
            loop.train(train, num_epochs=1, batch_size=args.batch_size, use_tqdm=not args.quiet, callbacks=callback)
        except StopTraining:
            pass
        synchronize(args.device)
        end = time.perf_counter()
        steps_per_epoch = len(loop.epoch_batches(train, batch_size=args.batch_size))
    assert callback.first is not None
    first_step, setup = callback.first - start, callback.first - setup_start
    epoch_seconds = end - callback.first
    partial = callback.steps < steps_per_epoch
    rate = callback.steps * args.batch_size / epoch_seconds if partial else train.num_triples / epoch_seconds
    record.note = (
        f"(setup {first_step:.1f} s; {callback.steps}/{steps_per_epoch} steps in {epoch_seconds:.1f} s: "
        f"{rate:,.0f} triples/s{', partial epoch' if partial else ''})"
    )
    print(f"  {record.note}; setup before the first step in all: {setup:.1f} s", flush=True)
    with stage("evaluation", stages, args.device) as record:
        evaluator = BessEvaluator(**CLI_HOST_SETTINGS)
        result = evaluator.evaluate(
            model, test, additional_filter_triples=[train.mapped_triples], use_tqdm=not args.quiet
        )
        per_query = sum(evaluator.last_timings.values()) / (2 * args.test)
        record.note = (
            f"({2 * args.test:,} queries x {args.entities:,} entities, {1000 * per_query:.1f} ms per query, MRR "
            f"{result.get_metric('both.realistic.inverse_harmonic_mean_rank'):.4f}; "
            + ", ".join(f"{k} {v:.1f} s" for k, v in evaluator.last_timings.items())
            + ")"
        )
    stages.insert(0, Stage(f"setup before the first step (target < 60 s): {setup:.1f} s"))
    stages[0].seconds = setup
    stages[0].note = f"{rate:,.0f} triples/s{' (partial epoch)' if partial else ''}"
    del loop, model, train
    gc.collect()
    return stages


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=2_500_000)
    parser.add_argument("--relations", type=int, default=500)
    parser.add_argument("--triples", type=int, default=17_000_000, help="drawn before removing duplicates")
    parser.add_argument("--test", type=int, default=1_000)
    parser.add_argument("--dim", type=int, default=100)
    parser.add_argument("--norm", type=int, default=1, help="TransE's p (PyKEEN's default 1; 2 scores by matmul)")
    parser.add_argument("--negatives", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--shards", default="1,4")
    parser.add_argument("--steps", type=int, default=None, help="train only this many steps (default: one epoch)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--output", type=pathlib.Path, help="write the table as a result file (JSON)")
    add_device_argument(parser)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {describe(args.device)}", flush=True)
    stages: list[Stage] = []
    with stage("generate the graph (not part of a run)", stages) as record:
        triples = generate(args.entities, args.relations, args.triples)
        record.note = f"({triples.shape[0]:,} distinct triples, {triples.numel() * 8 / 2**30:.2f} GiB)"
    results = {int(n): run(args, triples, int(n)) for n in args.shards.split(",")}
    print()
    print(
        f"Graph: {args.entities:,} entities, {args.relations} relations, {triples.shape[0]:,} triples; {stages[0].note}"
    )
    print()
    cuda = args.device.type == "cuda"
    cuda_column = " peak CUDA (GiB) |" if cuda else ""
    print(f"| n | stage | wall time (s) | peak RSS (GiB) | increase (GiB) |{cuda_column} notes |")
    print(f"|---:|---|---:|---:|---:|{'---:|' if cuda else ''}---|")
    for n, run_stages in results.items():
        summary, *rest = run_stages
        for record in rest:
            on_device = ""
            if cuda:
                on_device = " |" if record.device_peak is None else f" {record.device_peak / 2**30:.2f} |"
            print(
                f"| {n} | {record.name} | {record.seconds:.1f} | {record.peak / 2**30:.2f} | "
                f"{(record.peak - record.before) / 2**30:.2f} |{on_device} {record.note} |"
            )
        blank = " |" if cuda else ""
        print(f"| {n} | **{summary.name.split(':')[0]}** | {summary.seconds:.1f} | | |{blank} {summary.note} |")
    if args.output is not None:
        configuration = (
            f"a skewed graph: {args.entities:,} entities, {args.relations} relations, {triples.shape[0]:,} distinct "
            f"triples ({args.test:,} held out as test triples); PyKEEN's TransE d{args.dim}, p = {args.norm}; "
            f"{args.negatives} negatives per positive, batch {args.batch_size:,}, Adam; "
            + ("one whole epoch" if args.steps is None else f"at most {args.steps} steps")
            + " per shard count; peak resident memory sampled every 5 ms"
        )
        rows = [row for n, run_stages in results.items() for row in result_rows(n, run_stages, cuda)]
        write_result(
            args.output,
            "scale",
            "benchmarks/scale.py",
            [dict(title="stages", rows=rows)],
            configuration,
            describe(args.device),
        )


def result_rows(num_shards: int, stages: list[Stage], cuda: bool) -> list[dict[str, Any]]:
    """One shard count's stages as rows of the result file (:mod:`result_files`), the setup summary last."""
    summary, *rest = stages
    rows = [
        dict(
            num_shards=num_shards,
            stage=record.name,
            seconds=round(record.seconds, 3),
            peak_rss_gib=round(record.peak / 2**30, 3),
            increase_gib=round((record.peak - record.before) / 2**30, 3),
            **(
                {"peak_cuda_gib": None if record.device_peak is None else round(record.device_peak / 2**30, 3)}
                if cuda
                else {}
            ),
            notes=record.note.removeprefix("(").removesuffix(")"),
        )
        for record in rest
    ]
    rows.append(
        dict(
            num_shards=num_shards,
            stage=summary.name.split(" (")[0],
            seconds=round(summary.seconds, 3),
            peak_rss_gib=None,
            increase_gib=None,
            **({"peak_cuda_gib": None} if cuda else {}),
            notes=summary.note,
        )
    )
    return rows


if __name__ == "__main__":
    main()
