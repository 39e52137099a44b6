"""Filtered evaluation: PyKEEN's RankBasedEvaluator vs BessEvaluator, and both vs the machine's matmul rate.

Two test sets, each filtered by its train + valid triples and ranked on both sides:

* WN18RR (``--data``; 3,134 test triples, 40,943 entities);
* a generated graph of FB15k-237's size (``--generated``, default 14,505 entities, 237 relations,
  272,115 triples of which 2,000 are held out as test triples and 2,000 as valid triples; skewed
  degrees), where every query has many known answers to filter;

each by one DistMult model (dimension 256, seed 0, no relation regularizer, trained for 5 quick
BESS epochs so that the top ranks are meaningful; ``--train-epochs 0`` keeps the random
initialisation) with

* PyKEEN's ``RankBasedEvaluator`` at its default batch size (``None``: PyKEEN's own choice, 32 on
  the CPU) and at explicit batch sizes (``--pykeen-batch-sizes``, default ``default,256``);
* ``BessEvaluator`` with ``n = 1`` and ``n = 4`` shards (``--bess-shards``), sizes chosen
  automatically;

all in one run, on the same model. A markdown table reports the wall time, the peak memory (the
increase of the process's resident-set high-water mark during the evaluation, see
:func:`pykeen_bess.memory.measure_peak`, after returning freed heap memory to the system;
BessEvaluator's own memory probe resets the high-water mark once, early in its run), whether every
key of ``to_flat_dict()`` equals the fastest PyKEEN run's value (relative tolerance ``--rtol``),
the speed-up over the fastest PyKEEN run, and the *effective rate*: the ``2 Q E d`` floating-point
operations of scoring ``Q`` queries (both sides) against all ``E`` entities divided by the wall
time, as a percentage of the machine's matmul rate measured in the same run on the same shapes
(``[batch_size, d] x [d, slice_size]`` products covering the same ``Q x E`` scores, with
BessEvaluator's block sizes; best of three); for BessEvaluator also the rate of its ranking stage
alone (scoring, filtering and counting: :attr:`~pykeen_bess.evaluation.BessEvaluator.last_timings`,
without building the filter index, the memory search and PyKEEN's metric computation). Targets: at
least 20x PyKEEN's best with identical metrics, and at least 50% of the matmul rate (filter index,
counting and Python per block cost less than the scoring).

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
import json
import logging
import math
import pathlib
import time
import warnings
from collections.abc import Mapping
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

from devices import add_device_argument, describe, synchronize
from training import generate_graph

from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.memory import measure_peak

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

        loop = BessTrainingLoop(model=model, triples_factory=splits["train"], num_shards=1)
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
    with measure_peak(device) as peak:
        synchronize(device)
        start = time.perf_counter()
        result = evaluator.evaluate(model, splits["test"].mapped_triples, batch_size=batch_size, **kwargs)
        synchronize(device)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_bytes": peak.bytes, "metrics": dict(result.to_flat_dict())}


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


def benchmark_dataset(
    name: str, splits: Mapping[str, CoreTriplesFactory], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Run every evaluator on one dataset and the matmul reference; return the rows of the table."""
    model = make_model(splits, args.dim, args.train_epochs, args.device)
    test = splits["test"]
    print(
        f"# {name}: {test.num_entities:,} entities, test {test.num_triples:,} triples; DistMult d={args.dim}, "
        f"{args.train_epochs} training epochs; torch {torch.__version__}, {describe(args.device)}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for text in filter(None, args.pykeen_batch_sizes.split(",")):
        batch_size = None if text == "default" else int(text)
        outcome = run(RankBasedEvaluator(), model, splits, batch_size)
        rows.append(dict(dataset=name, name="PyKEEN RankBasedEvaluator", setting=f"batch_size={text}", **outcome))
        print(f"  PyKEEN batch_size={text}: {outcome['seconds']:.1f} s", flush=True)
    sizes = None
    for text in filter(None, args.bess_shards.split(",")):
        evaluator = BessEvaluator(num_shards=int(text))
        outcome = run(evaluator, model, splits, None)
        sizes = sizes or evaluator.last_block_sizes
        outcome["timings"] = evaluator.last_timings
        rows.append(dict(dataset=name, name="BessEvaluator", setting=f"n={text}", **outcome))
        print(f"  BESS n={text}: {outcome['seconds']:.2f} s (block sizes {evaluator.last_block_sizes})", flush=True)
    num_queries = 2 * test.num_triples
    flops = 2.0 * num_queries * test.num_entities * args.dim
    batch_size, slice_size = sizes or (256, test.num_entities)
    seconds = matmul_seconds(num_queries, test.num_entities, args.dim, batch_size, slice_size, args.device)
    print(f"  matmul alone ({batch_size} x {slice_size} blocks): {seconds:.2f} s, {flops / seconds / 1e9:.0f} GFLOP/s")
    for row in rows:
        row["matmul_seconds"] = seconds
        row["rate"] = flops / row["seconds"]
        row["matmul_rate"] = flops / seconds
    return rows


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=pathlib.Path, required=True, help="the WN18RR directory (train/valid/test.txt)")
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
    parser.add_argument("--rtol", type=float, default=1e-6, help="relative tolerance of 'equal' metrics")
    parser.add_argument("--output", type=pathlib.Path, default=None, help="also write the raw results as JSON here")
    add_device_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", message="Encountered tensors on device_types")

    datasets: dict[str, Mapping[str, CoreTriplesFactory]] = {
        "WN18RR" if args.data.name.lower() == "wn18rr" else args.data.name: load_splits(args.data)
    }
    if args.generated:
        datasets[f"generated {args.generated}"] = generate_splits(args.generated)
    rows = [row for name, splits in datasets.items() for row in benchmark_dataset(name, splits, args)]

    print()
    print(
        "| dataset | evaluator | setting | wall time (s) | peak memory (MiB) | MRR | hits@10 | metrics equal to PyKEEN "
        "best | speed-up vs PyKEEN best | effective GFLOP/s | % of matmul rate | ranking alone: % of matmul rate |"
    )
    print("|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for name in datasets:
        mine = [row for row in rows if row["dataset"] == name]
        pykeen_rows = [row for row in mine if row["name"].startswith("PyKEEN")]
        best = min(pykeen_rows, key=lambda row: row["seconds"]) if pykeen_rows else None
        for row in mine:
            if best is None:
                equal, speedup = "n/a", "n/a"
            else:
                same, exact, largest = compare(best["metrics"], row["metrics"], args.rtol)
                equal = (
                    f"{'yes' if same else 'NO'} ({exact}/{len(best['metrics'])} bit-identical, "
                    f"max rel. diff {largest:.1e})"
                )
                speedup = f"{best['seconds'] / row['seconds']:.1f}x"
            timings = row.get("timings")
            ranking = "" if not timings else f"{100 * row['matmul_seconds'] / timings['ranking']:.0f}%"
            peak = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:,.0f}"
            mrr = row["metrics"]["both.realistic.inverse_harmonic_mean_rank"]
            hits = row["metrics"]["both.realistic.hits_at_10"]
            print(
                f"| {name} | {row['name']} | {row['setting']} | {row['seconds']:.2f} | {peak} | {mrr:.4f} | "
                f"{hits:.4f} | {equal} | {speedup} | {row['rate'] / 1e9:.1f} | "
                f"{100 * row['rate'] / row['matmul_rate']:.0f}% | {ranking} |"
            )
        if mine:
            print(
                f"| {name} | matmul alone | same block shapes | {mine[0]['matmul_seconds']:.2f} | | | | | | "
                f"{mine[0]['matmul_rate'] / 1e9:.1f} | 100% | |"
            )
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
