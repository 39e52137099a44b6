"""Filtered evaluation of models without a fast scorer: PyKEEN's RankBasedEvaluator vs BessEvaluator.

Most interactions score a query against all entities by one product (BessEvaluator's fast scorers,
measured by ``benchmarks/evaluation.py``). The others (NTN, SE, TransD, KG2E, ConvKB, ...) have
no such form; where one process holds the whole model, BessEvaluator ranks their queries by PyKEEN's
own score rows, as many queries per call as PyKEEN's evaluator takes on the CPU. This benchmark
times both evaluators on the same model and checks that every metric is equal.

Each run (``--run MODELS@ENTITIES/QUERIES``, repeatable; default: NTN, SE, TransD and KG2E on 2,000
entities with 800 test triples, ConvKB on 500 entities with 200) generates a graph of ``ENTITIES``
entities, 50 relations and 40,000 uniformly drawn triples (seed 0); its first ``QUERIES`` triples are
the test triples, ranked on both sides, filtered by all triples. Every model is PyKEEN's class with
``embedding_dim`` ``--dim`` (default 32), randomly initialised (seed 0: evaluation costs what training
leaves it, the ranks are what PyKEEN gives the same model). PyKEEN's evaluator runs at the batch sizes
``--pykeen-batch-sizes`` (default: its own choice, and 32; the fastest is the reference), BessEvaluator
with its defaults. Every evaluator runs once untimed, then ``--repeats`` timed runs (default 1), the best
of which counts; every run is a new evaluator (none reuses what an earlier one built: BessEvaluator
builds its filter index and chooses its sizes in every run, as in a first evaluation). The table
reports the wall time, the peak memory (the growth of the process's resident-set high-water mark,
:func:`pykeen_bess.runtime.memory.measure_peak`), whether every key of ``to_flat_dict()`` is equal to
the reference's (exactly) and the speed-up over it.

``--output FILE.json`` writes the rows as the benchmarks page reads them (:mod:`result_files`).

    python benchmarks/evaluation_models.py --output benchmarks/results/evaluation-models-cpu.json
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pykeen.evaluation import Evaluator, RankBasedEvaluator
from pykeen.models import model_resolver
from pykeen.triples import CoreTriplesFactory

from evaluation import run
from result_files import write_result

from pykeen_bess.evaluation import BessEvaluator

#: the default runs: the models of each, on how many entities, with how many test triples
DEFAULT_RUNS = ("NTN,SE,TransD,KG2E@2000/800", "ConvKB@500/200")
NUM_RELATIONS, NUM_TRIPLES = 50, 40_000


def parse_run(text: str) -> tuple[list[str], int, int]:
    """Parse ``MODEL[,MODEL...]@ENTITIES/QUERIES``."""
    try:
        models, sizes = text.split("@")
        entities, queries = (int(part) for part in sizes.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MODEL[,MODEL...]@ENTITIES/QUERIES") from None
    names = [name for name in models.split(",") if name]
    if not names or entities < 2 or not 0 < queries <= NUM_TRIPLES:
        raise argparse.ArgumentTypeError(f"{text!r}: name a model, at least 2 entities and 1 to {NUM_TRIPLES} queries")
    for name in names:
        try:
            model_resolver.lookup(name)
        except (KeyError, ValueError):
            raise argparse.ArgumentTypeError(f"{name!r} is not a PyKEEN model") from None
    return names, entities, queries


def generated_splits(num_entities: int, num_queries: int) -> dict[str, CoreTriplesFactory]:
    """A uniform random graph (seed 0): all triples train, the first ``num_queries`` are the test triples."""
    generator = torch.Generator().manual_seed(0)
    triples = torch.stack(
        [
            torch.randint(num_entities, (NUM_TRIPLES,), generator=generator),
            torch.randint(NUM_RELATIONS, (NUM_TRIPLES,), generator=generator),
            torch.randint(num_entities, (NUM_TRIPLES,), generator=generator),
        ],
        dim=1,
    )

    def factory(part: torch.Tensor) -> CoreTriplesFactory:
        return CoreTriplesFactory.create(mapped_triples=part, num_entities=num_entities, num_relations=NUM_RELATIONS)

    return {"train": factory(triples), "valid": factory(triples[:0]), "test": factory(triples[:num_queries])}


def model_rows(
    runs: Sequence[tuple[list[str], int, int]],
    dim: int,
    repeats: int,
    batch_sizes: Sequence[int | None] = (None, 32),
    log: Callable[[str], object] = print,
) -> list[dict[str, Any]]:
    """Time both evaluators on every model of every run; return one row per model and evaluator.

    :param batch_sizes: PyKEEN's evaluator's batch sizes (None: its own choice); the fastest is the reference
    """
    rows = []
    for names, num_entities, num_queries in runs:
        splits = generated_splits(num_entities, num_queries)
        graph = f"generated ({num_entities:,} entities, {NUM_TRIPLES:,} triples, {num_queries:,} test triples)"
        for name in names:
            model = model_resolver.make(name, triples_factory=splits["train"], embedding_dim=dim, random_seed=0)
            evaluators: list[tuple[str, Callable[[], Evaluator], int | None]] = [
                *((f"PyKEEN RankBasedEvaluator, batch_size={size}", RankBasedEvaluator, size) for size in batch_sizes),
                ("BessEvaluator", BessEvaluator, None),
            ]
            outcomes = {}
            for label, make, batch_size in evaluators:
                # a new evaluator for every run: none keeps what an earlier run built (BessEvaluator's filter index,
                # excluded pairs and sizes, which a repeated evaluation of early stopping reuses), as PyKEEN keeps none
                runs = [run(make(), model, splits, batch_size) for _ in range(1 + repeats)][1:]
                outcomes[label] = min(runs, key=lambda outcome: outcome["seconds"])
                if any(outcome["metrics"] != runs[0]["metrics"] for outcome in runs):
                    raise RuntimeError(f"{label} gave other metrics in another run of {name}.")
                log(f"{graph}, {name}, {label}: {outcomes[label]['seconds']:.2f} s")
            # the fastest PyKEEN run is the reference of the speed-ups and of the metrics
            reference = min(
                (o for label, o in outcomes.items() if label.startswith("PyKEEN")), key=lambda o: o["seconds"]
            )
            for label, outcome in outcomes.items():
                rows.append(
                    {
                        "graph": graph,
                        "model": name,
                        "evaluator": label,
                        "seconds": round(outcome["seconds"], 3),
                        "peak_mib": None if outcome["peak_bytes"] is None else round(outcome["peak_bytes"] / 2**20),
                        "metrics_equal_to_pykeen": outcome["metrics"] == reference["metrics"],
                        "x_pykeen": round(reference["seconds"] / outcome["seconds"], 2),
                        "mrr": outcome["metrics"]["both.realistic.inverse_harmonic_mean_rank"],
                    }
                )
    return rows


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run",
        type=parse_run,
        action="append",
        default=None,
        help=f"MODEL[,MODEL...]@ENTITIES/QUERIES, repeatable (default: {' and '.join(DEFAULT_RUNS)})",
    )
    parser.add_argument("--dim", type=int, default=32, help="every model's embedding_dim")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each evaluator (the best counts)")
    parser.add_argument(
        "--pykeen-batch-sizes",
        default="default,32",
        help="comma-separated batch sizes of PyKEEN's evaluator ('default': its own choice); the fastest counts",
    )
    parser.add_argument("--output", type=pathlib.Path, default=None, help="write the rows as a result file (JSON)")
    args = parser.parse_args()
    if args.dim < 1 or args.repeats < 1:
        parser.error("--dim and --repeats must be positive")
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)
    runs = args.run or [parse_run(text) for text in DEFAULT_RUNS]
    try:
        batch_sizes = [None if t == "default" else int(t) for t in args.pykeen_batch_sizes.split(",") if t]
    except ValueError:
        parser.error(f"--pykeen-batch-sizes {args.pykeen_batch_sizes!r}: integers or 'default'")
    if not batch_sizes or any(size is not None and size < 1 for size in batch_sizes):
        parser.error("--pykeen-batch-sizes: at least one, each positive or 'default'")
    rows = model_rows(runs, args.dim, args.repeats, batch_sizes, log=lambda line: print(line, flush=True))
    print()
    print("| graph | model | evaluator | wall time (s) | peak memory (MiB) | metrics equal to PyKEEN | x PyKEEN best |")
    print("|---|---|---|---:|---:|---|---:|")
    for row in rows:
        print(
            f"| {row['graph']} | {row['model']} | {row['evaluator']} | {row['seconds']:.2f} | {row['peak_mib']} | "
            f"{'yes' if row['metrics_equal_to_pykeen'] else 'NO'} | {row['x_pykeen']:.2f}x |"
        )
    if args.output is not None:
        configuration = (
            f"models without a fast scorer, embedding_dim {args.dim}, random initialisation (seed 0); uniform "
            f"generated graphs ({NUM_RELATIONS} relations, {NUM_TRIPLES:,} triples, the first ones the test "
            f"triples), both sides, filtered by all triples; PyKEEN's RankBasedEvaluator at batch sizes "
            f"{args.pykeen_batch_sizes.replace(',', ', ')} (the fastest is the reference), BessEvaluator's defaults; "
            f"best of {args.repeats} after an untimed run, a new evaluator for every run; metrics compared exactly to "
            "the reference's"
        )
        write_result(args.output, "evaluation-models", "benchmarks/evaluation_models.py", rows, configuration, "cpu")


if __name__ == "__main__":
    main()
