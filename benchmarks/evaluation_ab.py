"""BessEvaluator of this checkout against another commit's, in fresh processes, A B A B.

Answers "is the evaluator of this tree slower than that of commit X?" on the same machine, data and
model. The driver (this checkout) builds the test sets of :mod:`evaluation` (a dataset directory,
``--data``, and the generated FB15k-237-sized graph, ``--generated``), one DistMult model each
(dimension 256, seed 0, random or ``--train-epochs`` BESS epochs), and writes them to a temporary
file. Then, ``--pairs`` times and for every ``--shards`` count, a child process of the baseline
(``--baseline CHECKOUT``, e.g. a ``git worktree`` of the commit) and one of this checkout each
evaluate every test set: filtered by train and valid, both sides, one untimed run, then
``--repeats`` timed runs (the best counts). A child imports only ``pykeen_bess.evaluation.BessEvaluator``
from its tree (the tree first on ``PYTHONPATH``, started from a directory without a package of its own),
so any commit since the evaluator exists can be the baseline. A baseline whose plugin registers
other module paths than this checkout's installed package needs an interpreter of its own
(``--baseline-python``: a virtual environment with that checkout installed).

Every pair's ratio is this tree's time over the baseline's (below 1: this tree is faster); the
rows give both medians and the ratios' median, minimum and maximum, both trees' MRRs (of the
first pair) and whether they were identical in every pair.

    git worktree add /tmp/base 9cd02c1
    python benchmarks/evaluation_ab.py --baseline /tmp/base --data ../shared/data/wn18rr \\
        --output benchmarks/results/evaluation-ab-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

#: the metric the trees must agree on (every other one follows from the same ranks)
METRIC = "both.realistic.inverse_harmonic_mean_rank"


def child(data_file: pathlib.Path, num_shards: int, repeats: int) -> None:
    """Evaluate every test set of ``data_file`` with this process' ``BessEvaluator``; print JSON (the last line)."""
    from pykeen.models import DistMult
    from pykeen.triples import CoreTriplesFactory

    from pykeen_bess.evaluation import BessEvaluator

    torch.set_num_threads(int(os.environ.get("EVALUATION_AB_THREADS", torch.get_num_threads())))
    results = {}
    for name, entry in torch.load(data_file, weights_only=False).items():
        train = CoreTriplesFactory.create(entry["train"], entry["num_entities"], entry["num_relations"])
        model = DistMult(triples_factory=train, embedding_dim=entry["dim"], random_seed=0, regularizer=None)
        model.load_state_dict(entry["state"])
        evaluator = BessEvaluator(num_shards=num_shards)
        filters = [entry["train"], entry["valid"]]
        times, value = [], None
        for index in range(repeats + 1):
            start = time.perf_counter()
            result = evaluator.evaluate(model, entry["test"], additional_filter_triples=filters, use_tqdm=False)
            if index:  # the first run builds the evaluator's filter index and searches its sizes: untimed
                times.append(time.perf_counter() - start)
            value = result.get_metric(METRIC)
        results[name] = {"seconds": min(times), "mrr": value}
    print(json.dumps(results))


def prepare(args: argparse.Namespace, path: pathlib.Path) -> list[str]:
    """Build the test sets and their models (this checkout), write them to ``path``; return the sets' names."""
    from evaluation import generate_splits, load_splits, make_model

    datasets = {}
    if args.data is not None:
        datasets[args.data.name] = load_splits(args.data)
    if args.generated:
        datasets[f"generated {args.generated}"] = generate_splits(args.generated)
    entries = {}
    for name, splits in datasets.items():
        model = make_model(splits, args.dim, args.train_epochs, torch.device("cpu"))
        train = splits["train"]
        entries[name] = dict(
            train=train.mapped_triples,
            valid=splits["valid"].mapped_triples,
            test=splits["test"].mapped_triples,
            num_entities=train.num_entities,
            num_relations=train.num_relations,
            dim=args.dim,
            state=model.state_dict(),
        )
    torch.save(entries, path)
    return list(entries)


def run_child(python: str, tree: pathlib.Path, data_file: pathlib.Path, num_shards: int, repeats: int) -> dict:
    """Run one child of ``tree`` (its package first on the path) and return its results."""
    command = [python, str(pathlib.Path(__file__).resolve()), "--child", str(data_file)]
    command += ["--shards", str(num_shards), "--repeats", str(repeats)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    result = subprocess.run(command, check=True, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    return json.loads(result.stdout.strip().splitlines()[-1])


def ab_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time the baseline's evaluator against this tree's, alternately; return one row per test set and shard count."""
    from result_files import commit

    here = pathlib.Path(__file__).resolve().parent.parent
    baseline = commit(args.baseline) or str(args.baseline)
    with tempfile.TemporaryDirectory() as folder:
        data_file = pathlib.Path(folder) / "evaluation-ab.pt"
        names = prepare(args, data_file)
        measured: dict[tuple[str, int], dict[str, list]] = {
            (name, n): {"baseline": [], "this": [], "mrr": []} for name in names for n in args.shards
        }
        for pair in range(args.pairs):
            for n in args.shards:
                theirs = run_child(args.baseline_python, args.baseline, data_file, n, args.repeats)
                mine = run_child(sys.executable, here, data_file, n, args.repeats)
                for name in names:
                    entry = measured[name, n]
                    entry["baseline"].append(theirs[name]["seconds"])
                    entry["this"].append(mine[name]["seconds"])
                    entry["mrr"].append((theirs[name]["mrr"], mine[name]["mrr"]))
                    print(
                        f"# pair {pair + 1}, {name}, n={n}: baseline {theirs[name]['seconds']:.3f} s, this tree "
                        f"{mine[name]['seconds']:.3f} s",
                        flush=True,
                    )
    rows = []
    for (name, n), entry in measured.items():
        ratios = [mine / theirs for mine, theirs in zip(entry["this"], entry["baseline"])]
        rows.append(
            dict(
                dataset=name,
                num_shards=n,
                baseline=baseline,
                baseline_seconds=round(statistics.median(entry["baseline"]), 4),
                this_seconds=round(statistics.median(entry["this"]), 4),
                ratio_median=round(statistics.median(ratios), 3),
                ratio_min=round(min(ratios), 3),
                ratio_max=round(max(ratios), 3),
                pairs=len(ratios),
                baseline_mrr=entry["mrr"][0][0],
                this_mrr=entry["mrr"][0][1],
                identical_mrr=all(theirs == mine for theirs, mine in entry["mrr"]),
            )
        )
    return rows


def main() -> None:
    """Parse the arguments; run a child, or the A/B comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=pathlib.Path, help="a checkout of the commit to compare against")
    parser.add_argument("--baseline-python", default=sys.executable, help="the baseline children's interpreter")
    parser.add_argument("--data", type=pathlib.Path, help="a dataset directory (train/valid/test.txt)")
    parser.add_argument("--generated", default="14505:237:272115:2000", help="the generated graph (empty: none)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--train-epochs", type=int, default=0, help="BESS epochs before evaluating (0: random)")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--pairs", type=int, default=3, help="baseline/this pairs per shard count")
    parser.add_argument("--repeats", type=int, default=3, help="timed evaluations per child (the best counts)")
    parser.add_argument("--output", help="write the rows as a result file (JSON)")
    parser.add_argument("--child", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.shards[0], args.repeats)
        return
    if args.baseline is None:
        parser.error("give --baseline CHECKOUT")
    rows = ab_rows(args)
    for row in rows:
        print(
            f"{row['dataset']}, n={row['num_shards']}: baseline {row['baseline_seconds']:.3f} s, this tree "
            f"{row['this_seconds']:.3f} s, ratio {row['ratio_median']:.3f} ({row['ratio_min']:.3f}-"
            f"{row['ratio_max']:.3f} over {row['pairs']} pairs), identical MRR: {row['identical_mrr']}"
        )
    if args.output:
        from devices import describe
        from result_files import write_result

        configuration = (
            f"BessEvaluator of this tree against {rows[0]['baseline']}'s (a checkout at {args.baseline}), "
            f"alternately in fresh processes; DistMult d{args.dim} ({args.train_epochs} training epochs), "
            f"filtered by train and valid, both sides; best of {args.repeats} timed evaluations per process "
            f"after one untimed"
        )
        write_result(
            args.output,
            "evaluation-ab",
            "benchmarks/evaluation_ab.py",
            rows,
            configuration,
            describe(torch.device("cpu")),
        )


if __name__ == "__main__":
    main()
