"""Quality parity: do ``n`` shards train as well as one with the settings a user gets by default?

Trains through the command line's own settings (``python -m pykeen_bess train``'s defaults:
DistMult dimension 64 with PyKEEN's default regularizer, Adam lr 0.01, batch 512, 64 negatives,
100 epochs) for every dataset, variant, shard count and seed, and prints the filtered test MRR
(both sides, realistic ranks) per shard count: the mean over the seeds with its standard error,
and the difference from one shard, paired by seed (the seed also draws the sharding), with the
standard error of that difference.

A *variant* is a name and the command-line flags it adds, ``NAME=FLAGS`` (``defaults=`` adds
nothing). ``--data`` takes directories of ``train.txt``, ``valid.txt``, ``test.txt`` or the names of
the datasets PyKEEN ships (``umls``, ``nations``, ``kinships``); ``structured`` is the generated graph
of ``structured.py`` (people, groups, cities and items; about 47k triples).

    python benchmarks/parity.py --data umls structured ../shared/data/wn18rr --seeds 0 1
    python benchmarks/parity.py --data structured --variants "defaults=" "block=--block-negatives" \\
        "adagrad=--optimizer adagrad --lr 0.1" --output results/parity.json

Every finished run is written to ``--output`` at once; running the same command again skips the runs
the file already holds (a long comparison can be split over several sessions).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shlex
import tempfile
import time
from statistics import mean, stdev


from pykeen_bess.cli import _configure_logging, build_parser, pipeline_kwargs
from result_files import header as result_header
from structured import write_splits

MRR = "both.realistic.inverse_harmonic_mean_rank"


def run(data: str, flags: list[str], num_shards: int, seed: int) -> dict:
    """Train and evaluate one setting through the command line's settings; return its MRR and time."""
    from pykeen.pipeline import pipeline

    argv = ["train", "--dataset", data, "--num-shards", str(num_shards), "--seed", str(seed), "--quiet", *flags]
    kwargs = pipeline_kwargs(build_parser().parse_args(argv))
    start = time.perf_counter()
    result = pipeline(**kwargs)
    return dict(mrr=float(result.metric_results.to_flat_dict()[MRR]), seconds=time.perf_counter() - start)


def standard_error(values: list[float]) -> float:
    """The standard error of the mean of ``values`` (NaN for fewer than two)."""
    return stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def summarize(runs: list[dict], shard_counts: list[int]) -> list[dict]:
    """One row per dataset, variant and shard count: mean MRR, its standard error, the paired difference from n = 1."""
    rows = []
    keys = sorted({(run["data"], run["variant"]) for run in runs}, key=lambda key: [str(part) for part in key])
    for data, variant in keys:
        by_seed = {
            (run["num_shards"], run["seed"]): run["mrr"]
            for run in runs
            if run["data"] == data and run["variant"] == variant
        }
        base = shard_counts[0]
        for n in shard_counts:
            values = [mrr for (count, _), mrr in sorted(by_seed.items()) if count == n]
            if not values:
                continue
            differences = [
                by_seed[n, seed] - by_seed[base, seed]
                for (count, seed) in sorted(by_seed)
                if count == n and (base, seed) in by_seed
            ]
            rows.append(
                dict(
                    data=data,
                    variant=variant,
                    num_shards=n,
                    seeds=len(values),
                    mrr=mean(values),
                    mrr_se=standard_error(values),
                    difference=mean(differences) if differences and n != base else None,
                    difference_se=standard_error(differences) if n != base else None,
                )
            )
    return rows


def table(rows: list[dict]) -> str:
    """The summary as a markdown table."""

    def number(value: float | None, digits: int = 4, sign: bool = False) -> str:
        if value is None or math.isnan(value):
            return ""
        return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"

    lines = [
        "| data | variant | n | seeds | MRR (mean ± se) | difference from n = 1 (paired, ± se) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        difference = number(row["difference"], sign=True)
        if difference and not math.isnan(row["difference_se"] or math.nan):
            difference += f" ± {row['difference_se']:.4f}"
        lines.append(
            f"| {row['data']} | {row['variant']} | {row['num_shards']} | {row['seeds']} "
            f"| {number(row['mrr'])} ± {number(row['mrr_se'])} | {difference} |"
        )
    return "\n".join(lines)


def variant(text: str) -> tuple[str, list[str]]:
    """Parse ``NAME=FLAGS``."""
    name, separator, flags = text.partition("=")
    if not separator or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=FLAGS (e.g. 'block=--block-negatives')")
    return name, shlex.split(flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", default=["umls", "structured"], help="datasets (see above)")
    parser.add_argument("--variants", type=variant, nargs="+", default=[("defaults", [])], help="NAME=FLAGS ...")
    parser.add_argument("--num-shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--output", type=pathlib.Path, help="a JSON file of the runs (and the summary)")
    args = parser.parse_args()
    _configure_logging(verbose=False)
    if args.num_shards[0] != 1:
        parser.error("--num-shards must start with 1 (the reference)")
    done: list[dict] = []
    if args.output is not None and args.output.exists():
        done = json.loads(args.output.read_text()).get("runs", [])
    header = result_header(
        "parity",
        "benchmarks/parity.py",
        "the command line's defaults (DistMult d64, Adam lr 0.01, batch 512, 64 negatives, 100 epochs), changed by "
        "each variant's flags (every run names them)",
        "cpu",
    )
    with tempfile.TemporaryDirectory() as scratch:
        for data in args.data:
            path = str(write_splits(pathlib.Path(scratch) / "structured")) if data == "structured" else data
            name = pathlib.Path(data).name
            for variant_name, flags in args.variants:
                for seed in args.seeds:
                    for n in args.num_shards:
                        key = dict(data=name, variant=variant_name, flags=shlex.join(flags), num_shards=n, seed=seed)
                        if any(all(run.get(k) == v for k, v in key.items()) for run in done):
                            continue
                        finished = {**key, **run(path, flags, n, seed)}
                        print(json.dumps(finished), flush=True)
                        done.append(finished)
                        if args.output is not None:
                            summary = summarize(done, args.num_shards)
                            args.output.write_text(json.dumps(dict(header, runs=done, summary=summary), indent=1))
    print(table(summarize(done, args.num_shards)))


if __name__ == "__main__":
    main()
