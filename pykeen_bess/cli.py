"""Command line: ``python -m pykeen_bess train ...`` (also installed as ``pykeen-bess``).

Trains a model with BESS through PyKEEN's ``pipeline`` and prints the test metrics. Under
``torchrun`` every rank runs the same command; the ranks form a ``torch.distributed`` process
group (gloo on CPU, NCCL on GPU) and each holds one entity shard.

    python -m pykeen_bess train --dataset nations --num-shards 2
    torchrun --nproc-per-node 4 -m pykeen_bess train --dataset path/to/wn18rr --epochs 50
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

__all__ = [
    "main",
    "build_parser",
    "load_dataset",
]

#: metrics printed after training, as (PyKEEN metric key, label)
REPORTED_METRICS = (
    ("both.realistic.inverse_harmonic_mean_rank", "MRR"),
    ("both.realistic.hits_at_1", "Hits@1"),
    ("both.realistic.hits_at_3", "Hits@3"),
    ("both.realistic.hits_at_10", "Hits@10"),
    ("both.realistic.arithmetic_mean_rank", "MR"),
)


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser."""
    parser = argparse.ArgumentParser(prog="pykeen-bess", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train and evaluate a model with BESS")
    train.add_argument(
        "--dataset",
        default="nations",
        help="a PyKEEN dataset name (nations, kinships, umls ship with PyKEEN) or a directory with "
        "train.txt / valid.txt / test.txt (tab-separated labels)",
    )
    train.add_argument("--model", default="DistMult", help="a PyKEEN model name (default: DistMult)")
    train.add_argument("--dim", type=int, default=64, help="embedding dimension (default: 64)")
    train.add_argument("--num-shards", type=int, default=None, help="entity shards (default: world size, else 2)")
    train.add_argument("--exchange", default="embedding", choices=["embedding", "score", "auto"])
    train.add_argument("--corruption", default="ht", choices=["h", "t", "ht"])
    train.add_argument("--negatives", type=int, default=64, help="negatives per positive (default: 64)")
    train.add_argument("--batch-size", type=int, default=512, help="positives per step (default: 512)")
    train.add_argument("--epochs", type=int, default=100, help="training epochs (default: 100)")
    train.add_argument("--optimizer", default="adam")
    train.add_argument("--lr", type=float, default=0.01, help="learning rate (default: 0.01)")
    train.add_argument("--loss", default=None, help="a PyKEEN loss name (default: the model's default loss)")
    train.add_argument("--evaluator", default="bess", choices=["bess", "rankbased"])
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--output", type=pathlib.Path, default=None, help="save_to_directory() here")
    train.add_argument("--json", action="store_true", help="print all metrics as JSON")
    train.add_argument("--quiet", action="store_true", help="no progress bars")
    train.add_argument("--verbose", action="store_true", help="show PyKEEN's and pykeen-bess' log messages")
    return parser


def load_dataset(name_or_path: str) -> Any:
    """Return a PyKEEN dataset from a name or a directory of label TSV files."""
    from pykeen.datasets import PathDataset, get_dataset

    path = pathlib.Path(name_or_path)
    if path.is_dir():
        files = {split: path / f"{split}.txt" for split in ("train", "valid", "test")}
        missing = [str(file) for file in files.values() if not file.is_file()]
        if missing:
            raise SystemExit(f"Dataset directory {path} lacks {', '.join(missing)}")
        return PathDataset(training_path=files["train"], testing_path=files["test"], validation_path=files["valid"])
    return get_dataset(dataset=name_or_path)


def train(args: argparse.Namespace) -> dict[str, float]:
    """Run the pipeline for parsed arguments; return the flat metric dictionary."""
    from pykeen.pipeline import pipeline

    from .distributed import init_from_environment
    from .training import BessTrainingLoop

    group = init_from_environment()
    num_shards = args.num_shards if group is None else None
    if group is None and num_shards is None:
        num_shards = 2
    dataset = load_dataset(args.dataset)
    evaluator_kwargs: dict[str, Any] = {}
    result = pipeline(
        dataset=dataset,
        model=args.model,
        model_kwargs=dict(embedding_dim=args.dim),
        loss=args.loss,
        optimizer=args.optimizer,
        optimizer_kwargs=dict(lr=args.lr),
        training_loop=BessTrainingLoop,
        training_loop_kwargs=dict(num_shards=num_shards, exchange=args.exchange, corruption=args.corruption),
        negative_sampler_kwargs=dict(num_negs_per_pos=args.negatives),
        training_kwargs=dict(num_epochs=args.epochs, batch_size=args.batch_size, use_tqdm=not args.quiet),
        evaluator=args.evaluator,
        evaluator_kwargs=evaluator_kwargs,
        evaluation_kwargs=dict(use_tqdm=not args.quiet),
        random_seed=args.seed,
    )
    if args.output is not None:
        from .distributed import save_to_directory

        save_to_directory(result, args.output)  # collective; rank 0 writes the full model
    return result.metric_results.to_flat_dict()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line."""
    args = build_parser().parse_args(argv)
    level = logging.INFO if getattr(args, "verbose", False) else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for name in ("pykeen", "pykeen_bess"):
        logging.getLogger(name).setLevel(level)
    if args.command == "train":
        metrics = train(args)
        from .distributed import is_main_process

        if is_main_process():
            if args.json:
                print(json.dumps(metrics, indent=2, sort_keys=True))
            else:
                print(f"{'metric':<10} {'value':>10}")
                for key, label in REPORTED_METRICS:
                    print(f"{label:<10} {metrics[key]:>10.4f}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
