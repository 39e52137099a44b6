"""Link-prediction quality from the shipped configs (``configs/``): time and filtered test metrics.

Runs a PyKEEN pipeline configuration (the JSON that ``pykeen experiments run`` and ``python -m
pykeen_bess train --config`` read) on a dataset directory of label TSV files (``train.txt``,
``valid.txt``, ``test.txt``) for each shard count in ``--num-shards``, and prints the wall time
(training and evaluation), the epochs trained and the filtered test metrics (both sides,
realistic ranks, filtered by train and valid). With an early stopper in the configuration the
JSON line also gives its validation curve and the best epoch, whose model is the one tested.

The entity ids come from all three splits, as in LibKGE and the papers' evaluations: WN18RR's test
set has 210 triples with an entity that never occurs in training; they are ranked with their
(untrained) embeddings instead of being dropped, as PyKEEN's ``PathDataset`` (and so ``pykeen
experiments run``) would drop them. The MRR over the triples whose entities occur in training is
printed too.

    python benchmarks/quality.py --config configs/wn18rr_rotate.json --data ../shared/data/wn18rr --num-shards 1 4
    python benchmarks/quality.py --config configs/nations_rotate.json --data nations --num-shards 1
    python benchmarks/quality.py --config configs/umls_rotate.json --data umls --num-shards 1 4 --seeds 0 1 2

``--seeds`` overrides the configuration's ``random_seed``: every shard count is run with every seed,
and a last line gives, per seed, the MRR difference of each larger shard count from the smallest
(the issue's target: n = 4 within 0.005 of n = 1 with the same configuration).

``--device`` (:mod:`devices`; default: CUDA when torch sees a GPU) is passed to ``pipeline()``.

``--output FILE.json`` writes the runs as the benchmarks page reads them (:mod:`result_files`): one
table (the dataset and config) of one row per run, with a mean row per shard count over several
seeds, and the shard counts' MRR differences as its summary.

A long run can be split over several sessions with ``--checkpoints DIR``: training writes a
checkpoint every 10 minutes, and the same command resumes from it (the printed time is then the
last session's only).
"""

from __future__ import annotations

import argparse
import inspect
import json
import pathlib
import sys
from statistics import mean, stdev
import time

import numpy as np
import torch
from pykeen.datasets import dataset_resolver
from pykeen.evaluation import Evaluator, RankBasedEvaluator
from pykeen.pipeline import pipeline
from pykeen.training import TrainingLoop
from pykeen.triples import TriplesFactory
from pykeen.triples.utils import load_triples

from devices import add_device_argument, describe
from result_files import write_result
from pykeen_bess.evaluation import BessEvaluator


def load(directory: pathlib.Path, create_inverse_triples: bool = False) -> dict[str, TriplesFactory]:
    """The splits with one entity and relation index over all of them (the config's ``dataset_kwargs``)."""
    labels = {name: load_triples(directory / f"{name}.txt") for name in ("train", "valid", "test")}
    base = TriplesFactory.from_labeled_triples(np.concatenate(list(labels.values())))
    return {
        name: TriplesFactory.from_labeled_triples(
            triples,
            entity_to_id=base.entity_to_id,
            relation_to_id=base.relation_to_id,
            create_inverse_triples=create_inverse_triples,
        )
        for name, triples in labels.items()
    }


def run(
    config: dict,
    splits: dict[str, TriplesFactory],
    num_shards: int | None,
    checkpoints: pathlib.Path | None = None,
    device: torch.device | None = None,
    seed: int | None = None,
) -> dict:
    """Train and evaluate the configuration with ``num_shards`` shards (on ``device``); return time and metrics.

    ``num_shards=None`` runs stock PyKEEN instead: the configuration with PyKEEN's sLCWA loop (its
    basic negative sampler, ``num_negs_per_pos`` unshared negatives per positive) and rank-based
    evaluator; of the ``training_loop_kwargs`` and ``evaluator_kwargs`` it keeps those PyKEEN's loop and
    evaluator take (a loss weighter; not BESS's thread and allocator settings).

    With ``checkpoints`` (a directory) training writes a checkpoint there every 10 minutes and at
    the end, and a run of the same configuration, shard count and seed resumes from it; the time is
    then that of this run only. ``seed`` (if given) replaces the configuration's ``random_seed``.
    """
    kwargs = dict(config)
    for key in ("dataset", "dataset_kwargs", "training", "validation", "testing"):
        kwargs.pop(key, None)
    if seed is not None:
        kwargs["random_seed"] = seed
    if num_shards is None:  # keep what PyKEEN's loop takes too (a loss weighter), drop BESS's options
        stock_parameters = inspect.signature(TrainingLoop.__init__).parameters
        loop_kwargs = kwargs.pop("training_loop_kwargs", None) or {}
        kwargs.update(
            training_loop="slcwa",
            evaluator="rankbased",
            training_loop_kwargs={key: value for key, value in loop_kwargs.items() if key in stock_parameters},
        )
        # and of the evaluator's, those PyKEEN's takes (not BESS's num_threads and host_allocator)
        evaluator_parameters = {
            *inspect.signature(RankBasedEvaluator.__init__).parameters,
            *inspect.signature(Evaluator.__init__).parameters,
        }
        evaluator_kwargs = kwargs.pop("evaluator_kwargs", None) or {}
        kwargs["evaluator_kwargs"] = {
            key: value for key, value in evaluator_kwargs.items() if key in evaluator_parameters
        }
    else:
        kwargs["training_loop_kwargs"] = {**kwargs.get("training_loop_kwargs", {}), "num_shards": num_shards}
    name = "stock" if num_shards is None else f"n{num_shards}"
    training_kwargs = kwargs["training_kwargs"] = dict(kwargs.get("training_kwargs", {}), use_tqdm=False)
    if checkpoints is not None:
        checkpoints.mkdir(parents=True, exist_ok=True)
        training_kwargs.update(
            checkpoint_directory=str(checkpoints),
            checkpoint_name=f"quality-{name}.pt" if seed is None else f"quality-{name}-seed{seed}.pt",
            checkpoint_frequency=10,
        )
    kwargs.setdefault("evaluation_kwargs", {})["use_tqdm"] = False
    if device is not None:
        kwargs["device"] = device
    start = time.perf_counter()
    result = pipeline(training=splits["train"], validation=splits["valid"], testing=splits["test"], **kwargs)
    seconds = time.perf_counter() - start
    seen = set(splits["train"].mapped_triples[:, [0, 2]].reshape(-1).tolist())
    test = splits["test"].mapped_triples
    keep = [i for i, (h, _, t) in enumerate(test.tolist()) if h in seen and t in seen]
    seen_metrics = BessEvaluator().evaluate(
        result.model,
        test[keep],
        additional_filter_triples=[splits["train"].mapped_triples, splits["valid"].mapped_triples],
        use_tqdm=False,
    )
    stopper = getattr(result, "stopper", None)
    stopping = {}
    if stopper is not None and getattr(stopper, "results", None):  # an early stopper: its validation curve
        stopping = dict(
            best_epoch=stopper.best_epoch,
            validation=[
                (stopper.frequency * (index + 1), round(value, 4)) for index, value in enumerate(stopper.results)
            ],
        )
    return dict(
        epochs=len(result.losses),
        **stopping,
        seconds=seconds,
        mrr=result.get_metric("mrr"),
        hits_at_1=result.get_metric("hits@1"),
        hits_at_3=result.get_metric("hits@3"),
        hits_at_10=result.get_metric("hits@10"),
        test_triples=test.shape[0],
        seen_mrr=seen_metrics.get_metric("mrr"),
        seen_triples=len(keep),
    )


def data_directory(text: str) -> pathlib.Path:
    """A directory of ``train.txt``, ``valid.txt``, ``test.txt``, or the name of a dataset PyKEEN ships with them."""
    path = pathlib.Path(text)
    if path.is_dir():
        return path
    try:
        module = sys.modules[dataset_resolver.lookup(text).__module__]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a directory nor a PyKEEN dataset name") from None
    path = pathlib.Path(module.__file__ or "").parent
    if not (path / "train.txt").is_file():
        raise argparse.ArgumentTypeError(f"PyKEEN's {text!r} does not ship train.txt (it downloads): pass a directory")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=pathlib.Path, required=True)
    parser.add_argument(
        "--data",
        type=data_directory,
        required=True,
        help="a directory of train.txt, valid.txt, test.txt, or a dataset PyKEEN ships (nations, kinships, umls)",
    )
    parser.add_argument("--num-shards", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--checkpoints",
        type=pathlib.Path,
        help="a directory for training checkpoints (every 10 minutes): running the command again resumes",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="random seeds replacing the config's random_seed: each shard count runs with each seed",
    )
    parser.add_argument(
        "--stock",
        action="store_true",
        help="also run the config with stock PyKEEN (sLCWA loop, unshared negatives, rank-based evaluator) first",
    )
    parser.add_argument("--output", type=pathlib.Path, help="write the runs as a result file (JSON)")
    add_device_argument(parser)
    args = parser.parse_args()
    print(f"# device: {describe(args.device)}", flush=True)
    raw = json.loads(args.config.read_text())
    config = raw.get("pipeline", raw)
    dataset_kwargs = dict(config.get("dataset_kwargs") or {})
    create_inverse_triples = bool(dataset_kwargs.pop("create_inverse_triples", False))
    if dataset_kwargs:
        parser.error(f"the config's dataset_kwargs {sorted(dataset_kwargs)} are not supported here")
    splits = load(args.data, create_inverse_triples)
    seeds: list[int | None] = list(args.seeds) if args.seeds else [None]
    rows = []
    for seed in seeds:
        for n in ([None] if args.stock else []) + list(args.num_shards):
            result = run(config, splits, n, args.checkpoints, args.device, seed)
            shown = config.get("random_seed") if seed is None else seed
            print(json.dumps({"num_shards": n, "seed": shown, **result}), flush=True)
            rows.append((n, shown, result))
    print()
    print(
        "| config | shards | seed | wall time (min) | epochs | test MRR (all test triples) | Hits@1 | Hits@3 "
        "| Hits@10 | MRR of the triples whose entities occur in training |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, shown, r in rows:
        epochs = f"{r['epochs']}" + (f" (best {r['best_epoch']})" if r.get("best_epoch") else "")
        shards = "stock PyKEEN (sLCWA)" if n is None else n
        print(
            f"| `{args.config.name}` | {shards} | {shown} | {r['seconds'] / 60:.1f} | {epochs} "
            f"| {r['mrr']:.4f} ({r['test_triples']:,}) "
            f"| {r['hits_at_1']:.4f} | {r['hits_at_3']:.4f} | {r['hits_at_10']:.4f} "
            f"| {r['seen_mrr']:.4f} ({r['seen_triples']:,}) |"
        )
    lines = differences(rows)
    if lines:
        print()
        print("\n".join(f"# {line}" for line in lines))
    if args.output is not None:
        dataset = "WN18RR" if args.data.name.lower() == "wn18rr" else args.data.name
        table = dict(
            title=f"{dataset}, {args.config}",
            rows=result_rows(str(args.config), dataset, rows),
            summary="; ".join(lines) or None,
        )
        configuration = (
            f"{args.config}; filtered test metrics, both sides, realistic ranks, filtered by train and valid; "
            "'mrr' over all test triples, 'mrr_seen_entities' over the test triples whose entities occur in training"
        )
        write_result(args.output, "quality", "benchmarks/quality.py", [table], configuration, describe(args.device))


def differences(rows: list[tuple[int | None, int | None, dict]]) -> list[str]:
    """The BESS runs' MRR over seeds (mean, standard deviation) and, per seed, the difference of every
    larger shard count from the smallest (with its mean and the mean's standard error), as lines."""
    by_shards: dict[int, dict] = {}
    for n, seed, r in rows:
        if n is not None:  # not stock PyKEEN
            by_shards.setdefault(n, {})[seed] = r["mrr"]
    if not by_shards:
        return []
    lines = []
    if len(next(iter(by_shards.values()))) > 1:
        for n, mrrs in by_shards.items():
            values = list(mrrs.values())
            lines.append(
                f"test MRR, n = {n}, {len(values)} seeds: mean {mean(values):.4f}, "
                f"standard deviation {stdev(values):.4f}"
            )
    smallest = min(by_shards)
    for n in sorted(set(by_shards) - {smallest}):
        differences = {seed: mrr - by_shards[smallest][seed] for seed, mrr in by_shards[n].items()}
        parts = ", ".join(f"seed {seed} {difference:+.4f}" for seed, difference in differences.items())
        values = list(differences.values())
        error = f", standard error {stdev(values) / len(values) ** 0.5:.4f}" if len(values) > 1 else ""
        lines.append(
            f"test MRR, n = {n} minus n = {smallest}: {parts}; mean {mean(values):+.4f}{error} (target: within 0.005)"
        )
    return lines


def seed_range(seeds: list) -> str:
    """``0-9`` for consecutive seeds, else the seeds separated by commas."""
    if all(isinstance(seed, int) for seed in seeds) and seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def result_rows(config: str, dataset: str, rows: list[tuple[int | None, int | None, dict]]) -> list[dict]:
    """The rows of the result file (:mod:`result_files`): one per run, then a mean row per contender over seeds."""
    written = []
    for n, seed, r in rows:
        written.append(
            dict(
                config=config,
                dataset=dataset,
                contender="stock PyKEEN (sLCWA loop, unshared negatives, RankBasedEvaluator)" if n is None else "BESS",
                num_shards=n,
                seeds=str(seed),
                minutes=round(r["seconds"] / 60, 2),
                epochs=r["epochs"],
                best_epoch=r.get("best_epoch"),
                mrr=r["mrr"],
                hits_at_1=r["hits_at_1"],
                hits_at_3=r["hits_at_3"],
                hits_at_10=r["hits_at_10"],
                mrr_seen_entities=r["seen_mrr"],
                test_triples=r["test_triples"],
            )
        )
    for n in dict.fromkeys(n for n, _, _ in rows):
        runs = [(seed, r) for m, seed, r in rows if m == n]
        if len(runs) < 2:
            continue
        minutes = [r["seconds"] / 60 for _, r in runs]
        written.append(
            dict(
                written[[m for m, _, _ in rows].index(n)],
                seeds=f"{seed_range([seed for seed, _ in runs])} (mean)",
                minutes=f"{min(minutes):.1f}-{max(minutes):.1f}",
                epochs=None,
                best_epoch=None,
                **{
                    key: mean(r[source] for _, r in runs)
                    for key, source in (
                        ("mrr", "mrr"),
                        ("hits_at_1", "hits_at_1"),
                        ("hits_at_3", "hits_at_3"),
                        ("hits_at_10", "hits_at_10"),
                        ("mrr_seen_entities", "seen_mrr"),
                    )
                },
                mrr_sd=stdev(r["mrr"] for _, r in runs),
            )
        )
    return written


if __name__ == "__main__":
    main()
