"""Filtered evaluation: PyKEEN's RankBasedEvaluator vs BessEvaluator, and both vs the machine's matmul rate.

Two test sets, each filtered by its train + valid triples and ranked on both sides:

* a dataset directory (``--data``, e.g. WN18RR: 3,134 test triples, 40,943 entities), optional;
* a generated graph of FB15k-237's size (``--generated``, default 14,505 entities, 237 relations,
  272,115 triples of which 2,000 are held out as test triples and 2,000 as valid triples; skewed
  degrees), where every query has many known answers to filter; built in-process, no download;

each by one DistMult model (dimension 256, seed 0, no relation regularizer, trained for 5 quick
BESS epochs; ``--train-epochs 0`` keeps the random initialisation) with

* PyKEEN's ``RankBasedEvaluator`` at its default batch size (``None``: PyKEEN's own choice, 32 on
  the CPU) and at explicit batch sizes (``--pykeen-batch-sizes``, default ``default,256``);
* ``BessEvaluator`` with ``n = 1`` and ``n = 4`` shards (``--bess-shards``), sizes chosen
  automatically;

all in one run, on the same model. Every evaluator runs once untimed (``--no-warmup`` times it
too: CUDA kernels load, PyKEEN and BessEvaluator search their sizes on the first run), then
``--repeats`` (BessEvaluator, default 3) or ``--pykeen-repeats`` (default 1) timed runs, the best
of which counts. A markdown table reports the wall time, the peak memory (the increase of the
process's resident-set high-water mark during the evaluation, see
:func:`pykeen_bess.runtime.memory.measure_peak`, after returning freed heap memory to the system;
BessEvaluator's own memory probe resets the high-water mark once, early in its run), whether every
key of ``to_flat_dict()`` equals the fastest PyKEEN run's value (relative tolerance ``--rtol``),
the speed-up over the fastest PyKEEN run, and the *effective rate*: the ``2 Q E d`` floating-point
operations of scoring ``Q`` queries (both sides) against all ``E`` entities divided by the wall
time, as a percentage of the machine's matmul rate measured in the same run on the same shapes
(``[batch_size, d] x [d, slice_size]`` products covering the same ``Q x E`` scores, with
BessEvaluator's block sizes; best of three); for BessEvaluator also the rate of its ranking stage
alone (scoring, filtering and counting: :attr:`~pykeen_bess.evaluation.BessEvaluator.last_timings`,
without building the filter index, the memory search and PyKEEN's metric computation). Two more
columns: the wall time over *one product* of the same total size (``[Q, d] x [d, E]``, all the
arithmetic of the evaluation in one call, best of three), and the *first evaluation* (the untimed
run of a new evaluator, which builds its filter index and searches its sizes; the timed runs are
repeated evaluations, as early stopping makes them). Targets: at least 20x PyKEEN's best with
identical metrics, at least 30% of the matmul rate on a GPU, and on the CPU no longer than 1.25x
one product.

``--output FILE.json`` writes the rows (every evaluator's metrics too) as the benchmarks page reads
them (:mod:`result_files`).

Other scripts call :func:`evaluation_rows` (``from evaluation import evaluation_rows`` with
``benchmarks/`` on ``sys.path``), which returns the rows as dicts instead of printing a table.

``--device`` (:mod:`devices`; default: CUDA when torch sees a GPU) is where the model, both
evaluators and the matmul reference run; on CUDA the peak memory is torch's peak of allocated
device memory instead of the resident set.

    python benchmarks/evaluation.py --data ../shared/data/wn18rr
    python benchmarks/evaluation.py --data ../shared/data/wn18rr --device cuda

The entity and relation mappings are built from all three splits, so that no test triple is
dropped (some test entities never occur in training).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import math
import pathlib
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from pykeen.evaluation import Evaluator, RankBasedEvaluator
from pykeen.models import DistMult
from pykeen.triples import CoreTriplesFactory, TriplesFactory
from pykeen.triples.triples_factory import (
    create_entity_mapping,
    create_relation_mapping,
)
from pykeen.triples.utils import load_triples

from devices import CLI_HOST_SETTINGS, add_device_argument, describe, synchronize
from result_files import write_result
from training import generate_graph

from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.runtime.memory import measure_peak

SPLITS = ("train", "valid", "test")


def load_splits(directory: pathlib.Path) -> dict[str, CoreTriplesFactory]:
    """Load the three splits with one entity / relation mapping built from all of them."""
    labeled = np.concatenate([load_triples(directory / f"{split}.txt") for split in SPLITS])
    entity_to_id = create_entity_mapping(labeled)
    relation_to_id = create_relation_mapping(labeled[:, 1])
    return {
        split: TriplesFactory.from_path(
            directory / f"{split}.txt", entity_to_id=entity_to_id, relation_to_id=relation_to_id
        )
        for split in SPLITS
    }


def make_model(splits: Mapping[str, CoreTriplesFactory], dim: int, train_epochs: int, device: torch.device) -> DistMult:
    """DistMult on ``device``, randomly initialised (seed 0), optionally trained for a few BESS epochs.

    Without PyKEEN's default relation regularizer: with 64 negatives per positive it shrinks the
    relations so fast that 5 epochs (stock loop or BESS alike) leave a near-random model (MRR about
    0.03), whose many near-ties are not what an evaluator usually ranks.
    """
    model = DistMult(triples_factory=splits["train"], embedding_dim=dim, random_seed=0, regularizer=None).to(device)
    if train_epochs:
        from pykeen_bess.training import BessTrainingLoop

        loop = BessTrainingLoop(model=model, triples_factory=splits["train"], num_shards=1, **CLI_HOST_SETTINGS)
        loop.train(triples_factory=splits["train"], num_epochs=train_epochs, batch_size=1024, use_tqdm=False)
    return model


def release_free_memory() -> None:
    """Return freed heap memory to the operating system (glibc), so that each peak starts from a low baseline."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def run(
    evaluator: Evaluator, model: DistMult, splits: Mapping[str, CoreTriplesFactory], batch_size: int | None
) -> dict[str, Any]:
    """Evaluate once; return the wall time, the peak memory and the metrics."""
    kwargs = {
        "additional_filter_triples": [splits["train"].mapped_triples, splits["valid"].mapped_triples],
        "use_tqdm": False,
    }
    release_free_memory()
    device = model.device
    if device.type == "cuda":  # memory cached by an earlier evaluator would look taken to the next one
        torch.cuda.empty_cache()
    with measure_peak(device) as peak:
        synchronize(device)
        start = time.perf_counter()
        result = evaluator.evaluate(model, splits["test"].mapped_triples, batch_size=batch_size, **kwargs)
        synchronize(device)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_bytes": peak.bytes, "metrics": dict(result.to_flat_dict())}


def timed_runs(
    evaluator: Evaluator,
    model: DistMult,
    splits: Mapping[str, CoreTriplesFactory],
    batch_size: int | None,
    repeats: int,
    warmup: bool,
) -> dict[str, Any]:
    """Evaluate ``repeats`` times (after an untimed first run if ``warmup``); the best time, the first metrics.

    Every run's metrics must be the same (an evaluator's result must not depend on its history).
    """
    outcomes = [run(evaluator, model, splits, batch_size) for _ in range(repeats + int(warmup))]
    timed = outcomes[int(warmup) :]
    best = min(timed, key=lambda outcome: outcome["seconds"])
    stable = all(outcome["metrics"] == outcomes[0]["metrics"] for outcome in outcomes)
    return {
        **best,
        "all_seconds": [o["seconds"] for o in timed],
        "first_seconds": outcomes[0]["seconds"],
        "repeatable": stable,
    }


def profiled_run(
    evaluator: Evaluator, model: DistMult, splits: Mapping[str, CoreTriplesFactory], top: int = 6
) -> dict[str, Any]:
    """One more evaluation under ``torch.profiler``: its kernels, host synchronisations and busiest host operators.

    Returns ``seconds`` (under the profiler), ``kernels`` and ``syncs`` (counts), ``device_busy`` (the fraction
    of the wall time some device activity ran; None on the CPU) and ``host_ops`` (the ``top`` operators by
    their own host time, milliseconds and calls).
    """
    from torch.profiler import ProfilerActivity, profile

    device = model.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        seconds = run(evaluator, model, splits, None)["seconds"]
    intervals, kernels, syncs = [], 0, 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            intervals.append((event.time_range.start, event.time_range.end))
            kernels += 1
        elif "Synchronize" in event.name or event.name == "cudaMemcpy":
            syncs += 1
    busy = None
    if intervals:
        covered, end = 0.0, -math.inf
        for start, stop in sorted(intervals):
            covered += max(0.0, stop - max(start, end))
            end = max(end, stop)
        busy = covered / 1e6 / seconds
    averages = sorted(prof.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
    host_ops = [(event.key, event.self_cpu_time_total / 1e3, event.count) for event in averages[:top]]
    return dict(seconds=seconds, kernels=kernels, syncs=syncs, device_busy=busy, host_ops=host_ops)


def compare(expected: Mapping[str, float], actual: Mapping[str, float], rtol: float) -> tuple[bool, int, float]:
    """Return whether all keys match (within ``rtol``), how many are equal and the largest relative difference."""
    if set(expected) != set(actual):
        return False, 0, math.inf
    exact, largest = 0, 0.0
    for key, value in expected.items():
        other = actual[key]
        if value == other or (math.isnan(value) and math.isnan(other)):
            exact += 1
            continue
        largest = max(largest, abs(value - other) / max(abs(value), 1e-300))
    return largest <= rtol, exact, largest


def generate_splits(spec: str, seed: int = 0) -> dict[str, CoreTriplesFactory]:
    """Generate ``entities:relations:triples:held_out`` with skewed degrees; hold out test and valid triples.

    Heads and tails are drawn with weights ``1 / sqrt(rank)`` (a few hubs with many known answers,
    as in FB15k-237), relations uniformly; duplicates are removed, then ``held_out`` random triples
    become the test set and ``held_out`` more the validation set.
    """
    num_entities, num_relations, num_triples, held_out = (int(x) for x in spec.split(":"))
    triples = generate_graph(num_entities, num_relations, num_triples, seed=seed).mapped_triples
    triples = triples[torch.randperm(triples.shape[0], generator=torch.Generator().manual_seed(seed))]
    parts = {"test": triples[:held_out], "valid": triples[held_out : 2 * held_out], "train": triples[2 * held_out :]}
    return {
        split: CoreTriplesFactory.create(mapped_triples=part, num_entities=num_entities, num_relations=num_relations)
        for split, part in parts.items()
    }


def matmul_seconds(
    num_queries: int, num_entities: int, dim: int, batch_size: int, slice_size: int, device: torch.device
) -> float:
    """Time the score products alone: ``[batch_size, d] x [d, slice_size]`` blocks covering ``Q x E``; best of 3."""
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(num_queries, dim, generator=generator).to(device)
    entities = torch.randn(num_entities, dim, generator=generator).to(device)
    slices = [part.t().contiguous() for part in entities.split(slice_size)]
    best = math.inf
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        for batch in queries.split(batch_size):
            for candidates in slices:
                torch.mm(batch, candidates)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def one_product_seconds(num_queries: int, num_entities: int, dim: int, device: torch.device) -> float:
    """Time one ``[Q, d] x [d, E]`` product, all of an evaluation's arithmetic in one call; best of 3."""
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(num_queries, dim, generator=generator).to(device)
    entities = torch.randn(dim, num_entities, generator=generator).to(device)
    best = math.inf
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        product = queries @ entities
        synchronize(device)
        best = min(best, time.perf_counter() - start)
        del product
    return best


def benchmark_dataset(
    name: str,
    splits: Mapping[str, CoreTriplesFactory],
    device: torch.device,
    dim: int = 256,
    train_epochs: int = 5,
    pykeen_batch_sizes: Sequence[int | None] = (None,),
    bess_shards: Sequence[int] = (1, 4),
    repeats: int = 3,
    pykeen_repeats: int = 1,
    warmup: bool = True,
    rtol: float = 0.0,
    log: Callable[[str], None] = print,
    profile: bool = False,
) -> list[dict[str, Any]]:
    """Run every evaluator on one dataset and the matmul reference; return one row per evaluator.

    Each row: ``dataset``, ``name``, ``setting``, ``seconds`` (best timed run), ``all_seconds``,
    ``peak_bytes``, ``metrics`` (PyKEEN's flat dict), ``speedup`` (over the fastest PyKEEN row),
    ``percent_of_matmul`` (the effective rate ``2 Q E d / seconds`` against the matmul alone),
    ``metrics_equal`` (every key within ``rtol`` of the fastest PyKEEN row; ``rtol=0``: identical),
    ``bit_identical`` (how many keys are identical), ``max_rel_diff``, ``first_seconds`` (the untimed
    first run: a new evaluator's first evaluation), ``one_product_seconds`` and ``x_one_product`` (the
    wall time over one ``[Q, d] x [d, E]`` product, all the arithmetic in one call); BESS rows also ``timings``,
    ``ranking_percent_of_matmul``, ``block_sizes`` and ``ranked_again`` (queries ranked again per target), and
    with ``profile`` a ``profile`` of one more evaluation (:func:`profiled_run`).
    """
    model = make_model(splits, dim, train_epochs, device)
    test = splits["test"]
    log(
        f"# {name}: {test.num_entities:,} entities, test {test.num_triples:,} triples; DistMult d={dim}, "
        f"{train_epochs} training epochs; torch {torch.__version__}, {describe(device)}"
    )
    # BESS and the matmul references first: PyKEEN's evaluator allocates gigabytes, whose release disturbed the
    # timings after it (WN18RR at n=1: 1.98 s right after it, 1.18-1.26 s in a process of its own)
    bess_rows: list[dict[str, Any]] = []
    sizes = None
    for num_shards in bess_shards:
        evaluator = BessEvaluator(num_shards=num_shards, **CLI_HOST_SETTINGS)
        outcome = timed_runs(evaluator, model, splits, None, repeats, warmup)
        sizes = sizes or evaluator.last_block_sizes
        outcome.update(
            timings=evaluator.last_timings,
            block_sizes=evaluator.last_block_sizes,
            ranked_again=evaluator.last_ranked_again,
        )
        if profile:
            outcome["profile"] = profiled_run(evaluator, model, splits)
        bess_rows.append(dict(dataset=name, name="BessEvaluator", setting=f"n={num_shards}", **outcome))
        log(
            f"  BESS n={num_shards}: {outcome['seconds']:.4f} s (block sizes {evaluator.last_block_sizes}, "
            f"ranked again {evaluator.last_ranked_again}, stages {evaluator.last_timings})"
        )
    num_queries = 2 * test.num_triples
    flops = 2.0 * num_queries * test.num_entities * dim
    batch_size, slice_size = sizes or (256, test.num_entities)
    seconds = matmul_seconds(num_queries, test.num_entities, dim, batch_size, slice_size, device)
    log(f"  matmul alone ({batch_size} x {slice_size} blocks): {seconds:.4f} s, {flops / seconds / 1e9:.0f} GFLOP/s")
    one_product = one_product_seconds(num_queries, test.num_entities, dim, device)
    log(f"  one product [{num_queries} x {dim}] x [{dim} x {test.num_entities}]: {one_product:.4f} s")
    pykeen_rows: list[dict[str, Any]] = []
    for batch_size in pykeen_batch_sizes:
        text = "default" if batch_size is None else str(batch_size)
        outcome = timed_runs(RankBasedEvaluator(), model, splits, batch_size, pykeen_repeats, warmup)
        outcome.update(timings=None, block_sizes=None, ranked_again=None)
        pykeen_rows.append(
            dict(dataset=name, name="PyKEEN RankBasedEvaluator", setting=f"batch_size={text}", **outcome)
        )
        log(f"  PyKEEN batch_size={text}: {outcome['seconds']:.3f} s")
    rows = pykeen_rows + bess_rows
    best = min(pykeen_rows, key=lambda row: row["seconds"]) if pykeen_rows else None
    for row in rows:
        row["matmul_seconds"] = seconds
        row["rate"] = flops / row["seconds"]
        row["matmul_rate"] = flops / seconds
        row["percent_of_matmul"] = 100 * seconds / row["seconds"]
        row["one_product_seconds"] = one_product
        row["x_one_product"] = row["seconds"] / one_product
        timings = row["timings"]
        row["ranking_percent_of_matmul"] = 100 * seconds / timings["ranking"] if timings else None
        if best is None:
            row.update(speedup=None, metrics_equal=None, bit_identical=None, max_rel_diff=None)
        else:
            same, exact, largest = compare(best["metrics"], row["metrics"], rtol)
            row.update(
                speedup=best["seconds"] / row["seconds"], metrics_equal=same, bit_identical=exact, max_rel_diff=largest
            )
    return rows


def evaluation_rows(
    device: torch.device | str,
    data: str | pathlib.Path | None = None,
    generated: str | None = "14505:237:272115:2000",
    dim: int = 256,
    train_epochs: int = 5,
    pykeen_batch_sizes: Sequence[int | None] = (None,),
    bess_shards: Sequence[int] = (1, 4),
    repeats: int = 3,
    pykeen_repeats: int = 1,
    warmup: bool = True,
    rtol: float = 0.0,
    log: Callable[[str], None] | None = print,
    profile: bool = False,
) -> list[dict[str, Any]]:
    """Time PyKEEN's RankBasedEvaluator and BessEvaluator on the same models and device; return the rows.

    For use from other scripts (``from evaluation import evaluation_rows`` with ``benchmarks/`` on
    ``sys.path``). The generated graph (``entities:relations:triples:held_out``, see
    :func:`generate_splits`) is built in-process, without downloads; ``data`` adds a directory with
    ``train.txt`` / ``valid.txt`` / ``test.txt`` (e.g. WN18RR). Per dataset one DistMult model is
    trained for ``train_epochs`` BESS epochs, then BessEvaluator runs with each of ``bess_shards``
    ``repeats`` times, the matmul references run, and PyKEEN's evaluator at each of
    ``pykeen_batch_sizes`` (None: PyKEEN's own choice) ``pykeen_repeats`` times (last: the gigabytes
    it allocates disturbed what ran after it), each after an untimed ``warmup`` run; the rows
    are those of :func:`benchmark_dataset` (with ``speedup``, ``percent_of_matmul``,
    ``metrics_equal``, ``max_rel_diff``).

    On an H100 the defaults take about 30 s, most of it PyKEEN's evaluator and the training.

    :param device: where the models, the evaluators and the matmul reference run
    :param data: a dataset directory, or None
    :param generated: the generated graph's spec, or None for none
    :param log: prints progress lines (None: silent)
    :returns: the rows of all datasets
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    datasets: dict[str, Mapping[str, CoreTriplesFactory]] = {}
    if data is not None:
        directory = pathlib.Path(data)
        datasets["WN18RR" if directory.name.lower() == "wn18rr" else directory.name] = load_splits(directory)
    if generated:
        datasets[f"generated {generated}"] = generate_splits(generated)
    rows = []
    for name, splits in datasets.items():
        rows.extend(
            benchmark_dataset(
                name,
                splits,
                device,
                dim=dim,
                train_epochs=train_epochs,
                pykeen_batch_sizes=pykeen_batch_sizes,
                bess_shards=bess_shards,
                repeats=repeats,
                pykeen_repeats=pykeen_repeats,
                warmup=warmup,
                rtol=rtol,
                log=log or (lambda line: None),
                profile=profile,
            )
        )
    return rows


def print_table(rows: Sequence[Mapping[str, Any]]) -> None:
    """Print the rows of :func:`evaluation_rows` as a markdown table."""
    print()
    print(
        "| dataset | evaluator | setting | wall time (s) | peak memory (MiB) | MRR | hits@10 | metrics equal to PyKEEN "
        "best | speed-up vs PyKEEN best | effective GFLOP/s | % of matmul rate | ranking alone: % of matmul rate | "
        "x one product | first evaluation (s) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for name in dict.fromkeys(row["dataset"] for row in rows):
        mine = [row for row in rows if row["dataset"] == name]
        for row in mine:
            if row["metrics_equal"] is None:
                equal, speedup = "n/a", "n/a"
            else:
                equal = (
                    f"{'yes' if row['metrics_equal'] else 'NO'} ({row['bit_identical']}/{len(row['metrics'])} "
                    f"bit-identical, max rel. diff {row['max_rel_diff']:.1e})"
                )
                speedup = f"{row['speedup']:.1f}x"
            ranking = row["ranking_percent_of_matmul"]
            ranking_text = "" if ranking is None else f"{ranking:.0f}%"
            peak = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:,.0f}"
            mrr = row["metrics"]["both.realistic.inverse_harmonic_mean_rank"]
            hits = row["metrics"]["both.realistic.hits_at_10"]
            print(
                f"| {name} | {row['name']} | {row['setting']} | {row['seconds']:.3f} | {peak} | {mrr:.4f} | "
                f"{hits:.4f} | {equal} | {speedup} | {row['rate'] / 1e9:.1f} | "
                f"{row['percent_of_matmul']:.0f}% | {ranking_text} | {row['x_one_product']:.2f}x | "
                f"{row.get('first_seconds', row['seconds']):.3f} |"
            )
        if mine:
            print(
                f"| {name} | matmul alone | same block shapes | {mine[0]['matmul_seconds']:.3f} | | | | | | "
                f"{mine[0]['matmul_rate'] / 1e9:.1f} | 100% | | | |"
            )
            product = mine[0]["one_product_seconds"]
            print(f"| {name} | one product | [Q, d] x [d, E] | {product:.3f} | | | | | | | | | 1x | |")


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=pathlib.Path, default=None, help="a dataset directory (train/valid/test.txt)")
    parser.add_argument(
        "--generated",
        default="14505:237:272115:2000",
        help="entities:relations:triples:held_out of the generated graph (empty: skip it)",
    )
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument(
        "--pykeen-batch-sizes",
        default="default,256",
        help="comma-separated batch sizes for PyKEEN's evaluator; 'default' lets PyKEEN choose (empty: skip PyKEEN)",
    )
    parser.add_argument("--bess-shards", default="1,4", help="comma-separated shard counts for BessEvaluator")
    parser.add_argument(
        "--train-epochs", type=int, default=5, help="BESS training epochs before evaluating (0: the random model)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each BessEvaluator (the best counts)")
    parser.add_argument("--pykeen-repeats", type=int, default=1, help="timed runs of each PyKEEN evaluator")
    parser.add_argument("--no-warmup", action="store_true", help="time the first run of every evaluator too")
    parser.add_argument("--rtol", type=float, default=1e-6, help="relative tolerance of 'equal' metrics")
    parser.add_argument("--output", type=pathlib.Path, default=None, help="write the rows as a result file (JSON)")
    add_device_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", message="Encountered tensors on device_types")
    rows = evaluation_rows(
        args.device,
        data=args.data,
        generated=args.generated or None,
        dim=args.dim,
        train_epochs=args.train_epochs,
        pykeen_batch_sizes=[
            None if t == "default" else int(t) for t in filter(None, args.pykeen_batch_sizes.split(","))
        ],
        bess_shards=[int(t) for t in filter(None, args.bess_shards.split(","))],
        repeats=args.repeats,
        pykeen_repeats=args.pykeen_repeats,
        warmup=not args.no_warmup,
        rtol=args.rtol,
        log=lambda line: print(line, flush=True),
    )
    print_table(rows)
    if args.output is not None:
        pykeen = args.pykeen_batch_sizes.replace(",", ", ") or "none"
        configuration = (
            f"DistMult d{args.dim} (seed 0, no relation regularizer) trained {args.train_epochs} BESS epochs; "
            "filtered by train + valid, both sides; PyKEEN's RankBasedEvaluator at batch sizes "
            f"{pykeen} (best of {args.pykeen_repeats}), BessEvaluator n = {args.bess_shards.replace(',', ', ')} "
            f"(best of {args.repeats}), {'after an untimed run' if not args.no_warmup else 'no untimed run'}; "
            f"metrics equal within rtol {args.rtol:g}; the matmul rate on the same block shapes; one [Q, d] x [d, E] "
            "product; the first evaluation is the untimed run (a new evaluator: filter index, sizes)"
        )
        write_result(args.output, "evaluation", "benchmarks/evaluation.py", rows, configuration, describe(args.device))


if __name__ == "__main__":
    main()
