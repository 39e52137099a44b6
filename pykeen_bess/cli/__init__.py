"""Command line: ``python -m pykeen_bess train ...`` (also installed as ``pykeen-bess``).

Trains a model with BESS through PyKEEN's ``pipeline`` and prints the test metrics. Everything
the README's ``pipeline(...)`` example sets has a flag; ``--config`` reads a PyKEEN pipeline
configuration (the JSON or YAML files of ``pykeen experiments run``), which the flags given
explicitly amend. Under ``torchrun`` every rank runs the same command; the ranks form a
``torch.distributed`` process group (gloo on CPU, NCCL on GPU) and each holds one entity shard.

PyTorch-BigGraph's files (:mod:`pykeen_bess.pbg`): ``pbg import`` turns label TSV files into a
PyTorch-BigGraph input directory, ``train --pbg DIR`` trains on one (the model from its config's
operator and comparator unless ``--model`` is given; ``--export-pbg`` writes a PyTorch-BigGraph
checkpoint afterwards), and ``pbg export`` writes a saved model as a PyTorch-BigGraph checkpoint.

Errors (bad options, unsupported settings) are printed as one message with exit status 2;
``--verbose`` shows the traceback and PyKEEN's and pykeen-bess' log messages.

* :mod:`~pykeen_bess.cli.options`: parsed options (and ``--config``) as ``pipeline()``'s arguments;
* :mod:`~pykeen_bess.cli.files`: datasets, configurations and run metadata.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from .pbg import add_pbg_command, export_check, export_pbg, run_pbg
from .files import UsageError, load_config, load_dataset, positive_int, run_metadata
from .options import DEFAULTS, pipeline_kwargs

__all__ = ["DEFAULTS", "UsageError", "build_parser", "load_config", "load_dataset", "main", "pipeline_kwargs"]

#: metrics printed after training, as (PyKEEN metric key, label)
REPORTED_METRICS = (
    ("both.realistic.inverse_harmonic_mean_rank", "MRR"),
    ("both.realistic.hits_at_1", "Hits@1"),
    ("both.realistic.hits_at_3", "Hits@3"),
    ("both.realistic.hits_at_10", "Hits@10"),
    ("both.realistic.arithmetic_mean_rank", "MR"),
)

DESCRIPTION = """\
Train and evaluate a PyKEEN model with BESS (entity shards, balanced batches, shared negatives).
In one process the entities are split into --num-shards logical shards; under torchrun every
rank holds one shard.
"""

EPILOG = """\
examples:
  python -m pykeen_bess train --dataset nations --num-shards 2
  python -m pykeen_bess train --dataset path/to/wn18rr --model ComplEx --dim 128 --epochs 50 \\
      --checkpoint-name wn18rr.pt --early-stopping --output out/
  python -m pykeen_bess train --config experiment.json --epochs 5
  torchrun --nproc-per-node 4 -m pykeen_bess train --dataset path/to/wn18rr --epochs 50
  python -m pykeen_bess train --pbg pbg_data/ --num-shards 2 --typed-negatives --checkpoint-format pbg \\
      --checkpoint-directory pbg_ckpt --checkpoint-name bess.pt --export-pbg pbg_model/
"""


def _threads(text: str) -> str | int:
    """Parse ``--threads``: ``auto``, ``keep`` or a positive integer."""
    if text in ("auto", "keep"):
        return text
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'keep' or a positive integer, not {text!r}")
    return int(text)


def _name(text: str) -> str:
    """Parse a named choice as PyKEEN's resolvers match names: any case, ``-`` or space for ``_`` (``Host``)."""
    return text.strip().lower().replace("-", "_").replace(" ", "_")


def _evaluator(text: str) -> str:
    """Parse ``--evaluator``: also ``BESS``, ``BessEvaluator``, ``rank_based`` or ``RankBasedEvaluator``."""
    name = _name(text).replace("_", "")
    return name[: -len("evaluator")] if name.endswith("evaluator") and name != "evaluator" else name


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"p\": 1}}', got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser (options not given on the command line are absent from the namespace)."""
    # (no abbreviations: a typo such as --epoch must not pass as --epochs)
    parser = argparse.ArgumentParser(
        prog="pykeen-bess", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        allow_abbrev=False,
        help="train and evaluate a model with BESS",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    data = train.add_argument_group("data and model")
    data.add_argument(
        "--config",
        type=pathlib.Path,
        help="a PyKEEN pipeline configuration (.json, .yaml), as for 'pykeen experiments run'; the flags given "
        "explicitly override its values, the defaults below apply only without it (but --threads and "
        "--host-allocator: auto unless the configuration sets num_threads / host_allocator)",
    )
    data.add_argument(
        "--dataset",
        help="a PyKEEN dataset name (nations, kinships, umls ship with PyKEEN) or a directory with train.txt, "
        "valid.txt and test.txt (three tab-separated labels per line: head, relation, tail) (default: nations)",
    )
    data.add_argument(
        "--pbg",
        type=pathlib.Path,
        help="train on a PyTorch-BigGraph input directory (its entity path; the config from --pbg-config or the "
        "directory's config.json / config.py; edge paths: training, validation, testing) instead of --dataset",
    )
    data.add_argument("--pbg-config", type=pathlib.Path, help="the PyTorch-BigGraph config of --pbg (.py or .json)")
    data.add_argument(
        "--inverse-triples",
        action="store_true",
        help="read --pbg with PyKEEN's inverse triples: a model of dynamic relations that PyTorch-BigGraph trained "
        "(separate head- and tail-prediction operators) resumes as one with inverse relations",
    )
    data.add_argument(
        "--model",
        help="a PyKEEN model name (default: DistMult; with --pbg the config's operator and comparator, starting "
        "from its init_path's embeddings if it has one)",
    )
    data.add_argument("--dim", type=positive_int, help="embedding dimension (default: 64)")
    data.add_argument("--model-kwargs", type=_json_object, help="more model options as JSON, e.g. '{\"p\": 1}'")
    data.add_argument("--loss", help="a PyKEEN loss name (default: the model's default loss)")
    data.add_argument("--loss-kwargs", type=_json_object, help="loss options as JSON, e.g. '{\"margin\": 1.0}'")
    data.add_argument("--loss-weighter", help="a PyKEEN loss weighter, e.g. subsampling (default: none)")

    bess = train.add_argument_group("BESS")
    bess.add_argument("--num-shards", type=int, help="entity shards (default: the world size under torchrun, else 2)")
    bess.add_argument(
        "--exchange",
        type=_name,
        choices=["embedding", "score", "encoding", "encoding_lookup", "auto"],
        help="exchange scheme: move embeddings, move scores, sum partial scores of column parts or assemble whole "
        "rows from them (the encoding partition), or the one that moves the fewest bytes (default: embedding; "
        "with --partition encoding: encoding for separable interactions, else encoding_lookup)",
    )
    bess.add_argument(
        "--partition",
        type=_name,
        choices=["token", "encoding"],
        help="split the entity tables by rows (token: BESS's shards) or by columns (encoding: every part holds "
        "d / num_shards coordinates of all entities; separable interactions) (default: token)",
    )
    bess.add_argument("--corruption", type=_name, choices=["h", "t", "ht"], help="corrupted side(s) (default: ht)")
    bess.add_argument(
        "--typed-negatives",
        action="store_true",
        help="draw a relation's negatives from its corrupted side's entity type (typed graphs, --pbg)",
    )
    spread = bess.add_mutually_exclusive_group()
    spread.add_argument(
        "--block-negatives",
        action="store_true",
        help="one set of negatives per block (num_shards ** 2 sets per step: BESS's original scheme), not one per step",
    )
    spread.add_argument(
        "--step-negatives", action="store_true", help="one set of negatives per step, shared by its blocks (default)"
    )
    bess.add_argument(
        "--negatives",
        type=int,
        help="negatives per positive, a multiple of --num-shards (default: 64, rounded up to one)",
    )
    bess.add_argument(
        "--sharding",
        type=_name,
        choices=["balanced", "random"],
        help="deal entities to shards so every shardpair holds about equally many triples (default), or randomly",
    )
    bess.add_argument(
        "--replicas",
        type=int,
        help="under torchrun: the ranks holding each shard (num_shards * replicas = world size) (default: 1)",
    )
    bess.add_argument(
        "--replica-grouping",
        type=_name,
        choices=["orthogonal", "consecutive", "all", "none"],
        help="how replicas are laid out over the ranks (default with replicas: orthogonal)",
    )
    bess.add_argument(
        "--checkpoint-retrieval",
        type=_name,
        choices=["one_per_group", "all_replicas"],
        help="one checkpoint file per shard (default) or one per replica",
    )
    bess.add_argument(
        "--storage",
        type=_name,
        choices=["device", "host", "mmap"],
        help="where the entity tables and their optimizer state live: the model's device (default), host memory, "
        "or .npy files under --storage-path",
    )
    bess.add_argument("--storage-path", help="the (existing) directory of --storage mmap's files")
    bess.add_argument(
        "--storage-kwargs",
        type=_json_object,
        help="more options of the storage tier as JSON, e.g. '{\"overwrite\": true}' (replace an earlier run's files)",
    )
    bess.add_argument(
        "--memory-budget",
        type=int,
        help="bytes the compute device may use, training and the bess evaluator: the peak of a memory probe "
        "(default: half the available memory on the CPU, where the peak is the growth of resident memory; on a GPU, "
        "out-of-memory errors decide); see the options reference",
    )
    bess.add_argument(
        "--dense-updates",
        action="store_true",
        help="update the entity tables densely (any optimizer, slower) instead of row-sparsely",
    )
    bess.add_argument(
        "--static-step",
        type=_name,
        choices=["auto", "on", "off"],
        help="auto (default): the static step wherever it applies (a CUDA graph on a GPU); on: or an error; off: eager",
    )

    training = train.add_argument_group("training")
    training.add_argument("--epochs", type=int, help="training epochs (default: 100)")
    training.add_argument(
        "--batch-size", type=int, help="positives per step; 0 searches the largest that fits (default: 512)"
    )
    training.add_argument("--sub-batch-size", type=int, help="split each step into sub-batches of this many slots")
    training.add_argument("--optimizer", help="a PyTorch optimizer name (default: adam)")
    training.add_argument(
        "--lr",
        type=float,
        help="learning rate (default: 0.01, ten times pipeline()'s, which keeps PyKEEN's Adam default 0.001; pass "
        "--lr 0.001 to match a pipeline() run)",
    )
    training.add_argument("--optimizer-kwargs", type=_json_object, help="more optimizer options as JSON")
    training.add_argument("--seed", type=int, help="random seed (default: 42)")
    training.add_argument("--device", help="e.g. cpu or cuda (default: CUDA where torch sees it, else the CPU)")
    training.add_argument(
        "--threads",
        type=_threads,
        help="intra-op CPU threads of training steps and evaluation blocks: auto (default: measure 1 against all of "
        "the process's threads, again every 500 steps; robust to a busy neighbour process), a number, or keep "
        "(torch's setting)",
    )
    training.add_argument(
        "--host-allocator",
        type=_name,
        choices=["auto", "keep"],
        help="auto (default; on the CPU glibc keeps freed tensor memory for the next step) or keep (leave it alone, "
        "the default of the Python API)",
    )
    training.add_argument("--checkpoint-name", help="checkpoint file name; an existing checkpoint is resumed")
    training.add_argument(
        "--checkpoint-format",
        type=_name,
        choices=["pykeen", "pbg"],
        help="PyKEEN's checkpoint files (default), or PyTorch-BigGraph's checkpoint layout in --checkpoint-directory "
        "(shard k is partition k of every entity type; a checkpoint PyTorch-BigGraph wrote there is continued)",
    )
    training.add_argument("--checkpoint-directory", type=pathlib.Path, help="where checkpoints are written")
    training.add_argument(
        "--checkpoint-frequency", type=int, help="minutes between checkpoints; 0: after every epoch (default: 30)"
    )
    training.add_argument(
        "--early-stopping", action="store_true", help="stop when the validation metric stops improving"
    )
    training.add_argument("--stopper-frequency", type=int, help="epochs between validations (default: 10)")
    training.add_argument("--stopper-patience", type=int, help="validations without improvement (default: 2)")
    training.add_argument("--stopper-metric", help="the validation metric (default: hits@10)")

    evaluation = train.add_argument_group("evaluation and output")
    evaluation.add_argument(
        "--evaluator",
        type=_evaluator,
        choices=["bess", "rankbased"],
        help="sharded (bess) or PyKEEN's evaluator (default: bess)",
    )
    evaluation.add_argument("--eval-batch-size", type=int, help="evaluation triples per batch (default: automatic)")
    evaluation.add_argument(
        "--eval-slice-size", type=int, help="candidates scored at once per shard (default: automatic)"
    )
    evaluation.add_argument(
        "--output",
        type=pathlib.Path,
        help="save the trained model and results here (PyKEEN's files; metadata.json records the versions and the "
        "pipeline() arguments used)",
    )
    evaluation.add_argument(
        "--export-pbg", type=pathlib.Path, help="write the trained model as a PyTorch-BigGraph checkpoint here"
    )
    evaluation.add_argument("--json", action="store_true", help="print all metrics as JSON")
    evaluation.add_argument("--quiet", action="store_true", help="no progress bars")
    evaluation.add_argument("--verbose", action="store_true", help="show log messages, and tracebacks of errors")
    add_pbg_command(commands)
    return parser


def train(args: argparse.Namespace) -> tuple[dict[str, float], bool]:
    """Run the pipeline for parsed arguments; return the flat metric dictionary, and whether this process reports it.

    Under a process group every rank trains; the main process of the training loop's topology reports.
    """
    from pykeen.pipeline import pipeline

    from ..distributed import init_from_environment

    group = init_from_environment()
    kwargs = pipeline_kwargs(args, in_group=group is not None)
    kwargs["device"] = _available_device(kwargs.get("device"))
    for flag in ("output", "export_pbg"):  # before training: a run must not end in an unwritable path
        if flag in args:
            _check_output_directory(getattr(args, flag), flag)
    kwargs["metadata"] = {**run_metadata(kwargs, args), **(kwargs.get("metadata") or {})}  # (the user's callbacks)
    if not isinstance(kwargs.get("dataset"), str | None):  # applied to the dataset object (recorded above)
        kwargs.pop("dataset_kwargs", None)  # (PyKEEN would warn they are not used)
    if "export_pbg" in args:
        training = kwargs.setdefault("training_kwargs", {})
        if "callbacks_kwargs" not in training:  # (else the model is checked when it is exported)
            callbacks = training.get("callbacks")
            given = (
                [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
            )
            training["callbacks"] = [*given, export_check()]
    resumed = _checkpoint_to_resume(kwargs)
    result = pipeline(**kwargs)
    recorded = result.metadata.get("pipeline") if isinstance(result.metadata, dict) else None
    if isinstance(recorded, dict):  # the seed pipeline() used (drawn, or a resumed checkpoint's): reruns repeat it
        recorded["random_seed"] = result.random_seed
    if "output" in args:
        from ..distributed import save_to_directory

        save_to_directory(result, args.output)  # collective; rank 0 writes the full model
    if "export_pbg" in args:
        export_pbg(result, args.export_pbg)
    topology = getattr(result.training_loop, "topology", None)
    reports = topology is None or topology.is_main_process
    if reports and resumed is not None:  # (else a rerun of a finished run would print its metrics as if it trained)
        print(f"pykeen-bess: resumed the checkpoint {resumed}: trained to epoch {len(result.losses)}", file=sys.stderr)
    if reports and resumed is None and not result.losses:
        print("pykeen-bess: no epoch was trained (--epochs 0): the metrics are the untrained model's", file=sys.stderr)
    if reports and getattr(result.stopper, "stopped", False):  # (else only --verbose shows PyKEEN's message)
        best = getattr(result.stopper, "best_epoch", None)
        print(f"pykeen-bess: stopped early after epoch {len(result.losses)} (best: epoch {best})", file=sys.stderr)
    return dict(result.metric_results.to_flat_dict()), reports


def _checkpoint_to_resume(kwargs: dict[str, Any]) -> pathlib.Path | None:
    """Return the checkpoint the run will resume (its pointer or PyKEEN file), or None if it starts afresh."""
    from ..names import canonical_choice
    from ..pbg import files
    from ..training.checkpoints.stores import CHECKPOINT_FORMATS
    from ..training.setup.assembly import checkpoint_path

    path = checkpoint_path(dict(kwargs.get("training_kwargs") or {}))
    if path is None:
        return None
    checkpoint_format = (kwargs.get("training_loop_kwargs") or {}).get("checkpoint_format")
    pbg = canonical_choice(checkpoint_format, CHECKPOINT_FORMATS) == "pbg"  # (a configuration's "PBG" too)
    if path.is_file() or (pbg and path.parent.is_dir() and files.read_version(path.parent) > 0):
        return path
    return None


def _check_output_directory(path: pathlib.Path, flag: str) -> None:
    """Create an output directory before training (it may exist).

    :raises UsageError: if it is a file or cannot be created
    """
    option = "--" + flag.replace("_", "-")
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path} is a file, not a directory.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{option} {path} cannot be created: {error}") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"{option} {path} is not writable.")


def _available_device(device: Any) -> Any:
    """Return the device to train on: CUDA where torch sees it, else the CPU (without PyKEEN's warning).

    :raises UsageError: for a CUDA device on a machine without one (PyKEEN would train on the CPU instead)
    """
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str):
        device = device.strip().lower()  # (CPU, Cuda: as the named choices, any case)
    if isinstance(device, str) and device.split(":")[0] in ("cuda", "gpu") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: torch sees no CUDA device on this machine; use --device cpu.")
    return device


def _configure_logging(verbose: bool) -> None:
    import pykeen  # noqa: F401 - importing PyKEEN sets its logger to INFO: set the level after that

    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for name in ("pykeen", "pykeen_bess"):
        logging.getLogger(name).setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0: success, 2: an error, printed as one message)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = bool(getattr(args, "verbose", False))
    _configure_logging(verbose)
    try:
        if args.command == "pbg":
            print(run_pbg(args))
        elif args.command == "train":
            metrics, reports = train(args)
            if reports:
                if getattr(args, "json", False):
                    print(json.dumps(metrics, indent=2, sort_keys=True))
                else:
                    print(f"{'metric':<10} {'value':>10}")
                    for key, label in REPORTED_METRICS:
                        print(f"{label:<10} {metrics[key]:>10.4f}")
    except KeyboardInterrupt:
        print("pykeen-bess: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - every error becomes one message (and exit status 2)
        if verbose:
            traceback.print_exc()
        kind = "" if isinstance(error, UsageError) else f"{type(error).__name__}: "
        hint = "" if verbose else " (run with --verbose for details)"
        print(f"pykeen-bess: error: {kind}{error}{hint}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
