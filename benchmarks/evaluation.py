"""Filtered evaluation: PyKEEN's RankBasedEvaluator vs BessEvaluator on WN18RR.

The filtered test set of WN18RR (3,134 triples, both sides, filtered by train + valid) is ranked
by one DistMult model (dimension 256, seed 0, no relation regularizer, trained for 5 quick BESS
epochs so that the top ranks are meaningful; ``--train-epochs 0`` keeps the random
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
and the speed-up over the fastest PyKEEN run. The project's target is a speed-up of at least 20x with identical metrics.

    python benchmarks/evaluation.py --data ../shared/data/wn18rr

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
from pykeen.triples import TriplesFactory
from pykeen.triples.triples_factory import (
    create_entity_mapping,
    create_relation_mapping,
)
from pykeen.triples.utils import load_triples

from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.memory import measure_peak

SPLITS = ("train", "valid", "test")


def load_splits(directory: pathlib.Path) -> dict[str, TriplesFactory]:
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


def make_model(splits: Mapping[str, TriplesFactory], dim: int, train_epochs: int) -> DistMult:
    """DistMult, randomly initialised (seed 0), optionally trained for a few BESS epochs.

    Without PyKEEN's default relation regularizer: with 64 negatives per positive it shrinks the
    relations so fast that 5 epochs (stock loop or BESS alike) leave a near-random model (MRR about
    0.03), whose many near-ties are not what an evaluator usually ranks.
    """
    model = DistMult(triples_factory=splits["train"], embedding_dim=dim, random_seed=0, regularizer=None)
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
    evaluator: Evaluator, model: DistMult, splits: Mapping[str, TriplesFactory], batch_size: int | None
) -> dict[str, Any]:
    """Evaluate once; return the wall time, the peak memory and the metrics."""
    kwargs = {
        "additional_filter_triples": [splits["train"].mapped_triples, splits["valid"].mapped_triples],
        "use_tqdm": False,
    }
    release_free_memory()
    with measure_peak(torch.device("cpu")) as peak:
        start = time.perf_counter()
        result = evaluator.evaluate(model, splits["test"].mapped_triples, batch_size=batch_size, **kwargs)
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


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=pathlib.Path, required=True, help="the WN18RR directory (train/valid/test.txt)")
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
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", message="Encountered tensors on device_types")

    splits = load_splits(args.data)
    model = make_model(splits, args.dim, args.train_epochs)
    print(
        f"WN18RR: {splits['train'].num_entities:,} entities, test {splits['test'].num_triples:,} triples; "
        f"DistMult d={args.dim}, {args.train_epochs} training epochs; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )

    rows: list[dict[str, Any]] = []
    for text in filter(None, args.pykeen_batch_sizes.split(",")):
        batch_size = None if text == "default" else int(text)
        outcome = run(RankBasedEvaluator(), model, splits, batch_size)
        rows.append(dict(name="PyKEEN RankBasedEvaluator", setting=f"batch_size={text}", **outcome))
        print(f"  PyKEEN batch_size={text}: {outcome['seconds']:.1f} s", flush=True)
    for text in filter(None, args.bess_shards.split(",")):
        outcome = run(BessEvaluator(num_shards=int(text)), model, splits, None)
        rows.append(dict(name="BessEvaluator", setting=f"n={text}", **outcome))
        print(f"  BESS n={text}: {outcome['seconds']:.2f} s", flush=True)

    pykeen_rows = [row for row in rows if row["name"].startswith("PyKEEN")]
    best = min(pykeen_rows, key=lambda row: row["seconds"]) if pykeen_rows else None
    print()
    print(
        "| evaluator | setting | wall time (s) | peak memory (MiB) | MRR | hits@10 | metrics equal to PyKEEN best "
        "| speed-up vs PyKEEN best |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for row in rows:
        if best is None:
            equal, speedup = "n/a", "n/a"
        else:
            same, exact, largest = compare(best["metrics"], row["metrics"], args.rtol)
            equal = (
                f"{'yes' if same else 'NO'} ({exact}/{len(best['metrics'])} bit-identical, max rel. diff {largest:.1e})"
            )
            speedup = f"{best['seconds'] / row['seconds']:.1f}x"
        peak = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:,.0f}"
        mrr = row["metrics"]["both.realistic.inverse_harmonic_mean_rank"]
        hits = row["metrics"]["both.realistic.hits_at_10"]
        print(
            f"| {row['name']} | {row['setting']} | {row['seconds']:.2f} | {peak} | {mrr:.4f} | {hits:.4f} | {equal} "
            f"| {speedup} |"
        )
    if best is not None:
        print(f"\nPyKEEN best: {best['setting']} ({best['seconds']:.1f} s).")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
