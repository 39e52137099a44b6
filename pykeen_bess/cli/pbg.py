"""The command line's PyTorch-BigGraph parts: ``pbg import``, ``pbg export``, and ``train --pbg``'s data and model.

``python -m pykeen_bess pbg import`` turns label TSV files into a PyTorch-BigGraph input directory,
``pbg export`` writes a saved model as a PyTorch-BigGraph checkpoint; :func:`load_pbg_graph` and
:func:`pbg_model_settings` give ``train --pbg`` its triples and its model (see :mod:`pykeen_bess.cli`).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
from collections.abc import Mapping
from typing import Any

from .files import non_negative_int, positive_int

__all__ = [
    "add_pbg_command",
    "export_pbg",
    "load_pbg_graph",
    "pbg_model_settings",
    "run_pbg",
    "use_pbg_graph",
    "warn_untaken_settings",
]

logger = logging.getLogger(__name__)

#: PyTorch-BigGraph's training settings, which ``train --pbg`` does not take from the config (PBG's
#: negatives, optimizer and loss have no one-to-one counterpart), and the flags that set them instead
PBG_TRAINING_FLAGS = {
    "num_epochs": "--epochs",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "relation_lr": "--optimizer-kwargs",
    "loss_fn": "--loss",
    "margin": "--loss-kwargs",
    "num_batch_negs": "--negatives",
    "num_uniform_negs": "--negatives",
    "disable_lhs_negs": "--corruption",
    "disable_rhs_negs": "--corruption",
    "init_scale": "--model-kwargs",
    "max_norm": "--model-kwargs",
}

PBG_DESCRIPTION = """PyTorch-BigGraph's files: import label TSV files as a PyTorch-BigGraph input directory (entity
types and partitions, bucket files), or export a trained PyKEEN model as a PyTorch-BigGraph
checkpoint (loadable by torchbiggraph_train and torchbiggraph_export_to_tsv).
"""

PBG_EPILOG = """examples:
  python -m pykeen_bess pbg import train.tsv valid.tsv test.tsv --output pbg_data/ --partitions 4
  python -m pykeen_bess pbg import edges.tsv --config config.py --output pbg_data/   # typed relations
  python -m pykeen_bess pbg export --model out/trained_model.pkl --graph pbg_data/ --output pbg_ckpt/
"""


def add_pbg_command(commands: Any) -> None:
    """Add the ``pbg`` command (``import``, ``export``) to the command line's subcommands."""
    pbg = commands.add_parser(
        "pbg",
        allow_abbrev=False,
        help="PyTorch-BigGraph's files: import TSV files, export a model",
        description=PBG_DESCRIPTION,
        epilog=PBG_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = pbg.add_subparsers(dest="action", required=True)
    importer = actions.add_parser(
        "import", help="label TSV files -> a PyTorch-BigGraph input directory", allow_abbrev=False
    )
    importer.add_argument("files", nargs="+", type=pathlib.Path, help="training [validation [testing]] TSV files")
    importer.add_argument("--output", type=pathlib.Path, required=True, help="the input directory to write")
    importer.add_argument(
        "--config",
        type=pathlib.Path,
        help="a PyTorch-BigGraph config giving entity types and relation types (default: one entity type, dynamic "
        "relations); the directory's config.json is this config with the directory's paths and partitions",
    )
    importer.add_argument(
        "--model",
        default="DistMult",
        help="without --config: the model whose operator and comparator the directory's config.json names "
        "(DistMult, TransE, ComplEx, RotatE, RESCAL; default: DistMult)",
    )
    importer.add_argument(
        "--dim", type=positive_int, default=100, help="without --config: the embedding dimension (100)"
    )
    importer.add_argument(
        "--partitions",
        type=int,
        help="partitions of every entity type (default: the config's num_partitions, else 1); config.json gets the "
        "partitions written",
    )
    importer.add_argument("--seed", type=non_negative_int, default=0, help="seed of the partitions (default: 0)")
    importer.add_argument("--columns", default="0,1,2", help="the head, relation and tail columns (default: 0,1,2)")
    importer.add_argument("--verbose", action="store_true", help="show log messages, and tracebacks of errors")
    exporter = actions.add_parser(
        "export", help="a saved PyKEEN model -> a PyTorch-BigGraph checkpoint", allow_abbrev=False
    )
    exporter.add_argument("--model", type=pathlib.Path, required=True, help="trained_model.pkl (save_to_directory)")
    exporter.add_argument(
        "--graph", type=pathlib.Path, required=True, help="the model's PyTorch-BigGraph input directory"
    )
    exporter.add_argument("--pbg-config", type=pathlib.Path, help="the input directory's config (default: its own)")
    exporter.add_argument("--output", type=pathlib.Path, required=True, help="the checkpoint directory to write")
    exporter.add_argument("--version", type=int, default=0, help="the checkpoint version (completed epochs; 0)")
    exporter.add_argument("--verbose", action="store_true", help="show log messages, and tracebacks of errors")


def use_pbg_graph(settings: dict[str, Any], given: Mapping[str, Any], kwargs: dict[str, Any]) -> None:
    """``train --pbg``: the pipeline's splits from the directory, and its model from the config unless given.

    :param settings: the command line's settings (``model`` and ``dim`` are removed if the config decides them)
    :param given: the flags given explicitly
    :param kwargs: the pipeline's keyword arguments, updated in place
    """
    from .files import UsageError

    if "dataset" in given:
        raise UsageError("Give either --dataset or --pbg.")
    graph = load_pbg_graph(settings["pbg"], settings.get("pbg_config"), bool(settings.get("inverse_triples")))
    if graph.testing is None:
        raise UsageError(f"{settings['pbg']}: the config's edge paths give no testing split to evaluate.")
    kwargs.update(training=graph.training, testing=graph.testing, validation=graph.validation)
    if graph.config is not None:
        warn_untaken_settings(graph.config, given)
    if "model" not in given and "model" not in kwargs:
        kwargs.update(pbg_model_settings(graph, settings["pbg"]))
        settings.pop("model", None)
        if "dim" not in given:
            settings.pop("dim", None)


def warn_untaken_settings(config: Mapping[str, Any], given: Mapping[str, Any]) -> list[str]:
    """Warn of the config's training settings off PyTorch-BigGraph's defaults, which ``train --pbg`` does not use.

    A setting whose flag (:data:`PBG_TRAINING_FLAGS`) was given is not named: the flag decides.

    :param config: the normalised PyTorch-BigGraph config
    :param given: the flags given explicitly (argparse destinations)
    :returns: the settings named (``key=value``)
    """
    from ..pbg.config import DEFAULTS

    untaken = [
        (f"{key}={config[key]!r}", flag)
        for key, flag in PBG_TRAINING_FLAGS.items()
        if config.get(key, DEFAULTS[key]) != DEFAULTS[key] and flag[2:].replace("-", "_") not in given
    ]
    if untaken:
        logger.warning(
            "train --pbg takes the model from the PyTorch-BigGraph config (operator, comparator, dimension, init_path, "
            "relation weights), not its training settings; not used: %s (the flags %s set them; see the PBG how-to).",
            ", ".join(setting for setting, _ in untaken),
            ", ".join(dict.fromkeys(flag for _, flag in untaken)),
        )
    return [setting for setting, _ in untaken]


def export_check() -> Any:
    """Return a training callback that checks, before the first epoch, that ``--export-pbg`` can export the model.

    :raises UsageError: (when the loop registers it) if PyTorch-BigGraph cannot express the model
    """
    from pykeen.training.callbacks import TrainingCallback

    from .files import UsageError
    from ..pbg.conversion import conversion_for_model

    class ExportCheck(TrainingCallback):
        def register_training_loop(self, training_loop: Any) -> None:
            super().register_training_loop(training_loop)
            try:
                conversion_for_model(training_loop.model)
            except ValueError as error:
                raise UsageError(f"--export-pbg: {error}") from None

    return ExportCheck()


def export_pbg(result: Any, directory: pathlib.Path) -> None:
    """``train --export-pbg``: write the pipeline's trained model as a PyTorch-BigGraph checkpoint."""
    from ..pbg.checkpoint import write_checkpoint

    write_checkpoint(result.model, result.training, directory, training_loop=result.training_loop)


def load_pbg_graph(directory: pathlib.Path, config: pathlib.Path | None, inverse_triples: bool = False) -> Any:
    """Read a PyTorch-BigGraph input directory (:func:`pykeen_bess.pbg.read`) as a typed graph."""
    from .files import UsageError
    from ..pbg.inputs import read

    if not directory.is_dir():
        raise UsageError(f"PyTorch-BigGraph input directory {directory} does not exist.")
    return read(directory, config=config, create_inverse_triples=inverse_triples)


def pbg_model_settings(graph: Any, directory: pathlib.Path) -> dict[str, Any]:
    """Return the pipeline's model and model kwargs of a PyTorch-BigGraph config (its operator and comparator).

    With an ``init_path`` in the config the model starts from that checkpoint's embeddings, as
    PyTorch-BigGraph's training would.
    """
    from .files import UsageError
    from ..pbg.restore import checkpoint_conversion, initial_model

    if graph.config is None:
        return {}
    init = graph.config.get("init_path")
    if init:
        candidates = [pathlib.Path(init), directory / init]
        found = next((path for path in candidates if path.is_dir()), None)
        if found is None:
            raise UsageError(f"The config's init_path {init} does not exist (tried {', '.join(map(str, candidates))}).")
        model, model_kwargs = initial_model(found, graph)
        return dict(model=model, model_kwargs=model_kwargs)
    conversion = checkpoint_conversion(graph.config, "the PyTorch-BigGraph config")
    return dict(model=conversion.model, model_kwargs=conversion.model_kwargs(int(graph.config["dimension"])))


def check_same_ids(training_triples: pathlib.Path, graph: Any) -> None:
    """Check that a saved model's entity and relation ids are the graph's (its ``training_triples`` beside it).

    A model trained on the same label files read another way (``--dataset`` instead of ``--pbg``: PyKEEN's
    sorted labels, where a graph of several partitions numbers entities partition by partition) has as many
    entities and relations, but each row another entity's: the checkpoint would carry every vector under
    another label. Without the saved mapping (a model saved otherwise) this cannot be checked (logged).

    :raises UsageError: naming the first entity or relation whose id differs
    """
    from .files import UsageError

    entity_labels = graph.entity_labels()
    if not (training_triples / "entity_to_id.tsv.gz").is_file():
        if entity_labels is not None:  # (a graph without names, and its models, have no labels to compare)
            logger.warning(
                "No entity labels in %s beside the model: whether its entity ids are the graph's cannot be checked.",
                training_triples,
            )
        return
    from pykeen.triples import TriplesFactory

    factory = TriplesFactory.from_path_binary(training_triples)
    labelled = [("relation", factory.relation_id_to_label, list(graph.schema.relation_names))]
    if entity_labels is not None:
        labelled.insert(0, ("entity", factory.entity_id_to_label, list(entity_labels)))
    for what, model_labels, graph_labels in labelled:
        ids = [model_labels[index] for index in range(len(model_labels))]
        differing = next((i for i, (a, b) in enumerate(zip(ids, graph_labels)) if a != b), None)
        if differing is not None or len(ids) != len(graph_labels):
            where = (
                f" (id {differing}: {ids[differing]!r} in the model, {graph_labels[differing]!r} in the graph)"
                if differing is not None
                else f" ({len(ids)} in the model, {len(graph_labels)} in the graph)"
            )
            raise UsageError(
                f"The model's {what} ids are not the graph's{where}: every vector would be exported under another "
                f"label. Train the model on this graph (train --pbg GRAPH_DIRECTORY)."
            )


def run_pbg(args: argparse.Namespace) -> str:
    """Run ``pbg import`` or ``pbg export``; return what to print."""
    from .files import UsageError
    from ..pbg.checkpoint import write_checkpoint
    from ..pbg.config import write_config
    from ..pbg.conversion import conversion_for_model_name
    from ..pbg.inputs import write
    from ..pbg.tsv import import_tsv

    if args.action == "import":
        if not 1 <= len(args.files) <= 3:
            raise UsageError("pbg import takes 1 to 3 files: training [validation [testing]].")
        try:
            columns = [int(c) for c in args.columns.split(",")]
        except ValueError:
            raise UsageError(f"--columns must be three integers such as 0,1,2, not {args.columns!r}.") from None
        if len(columns) != 3:
            raise UsageError(f"--columns must be three integers such as 0,1,2, not {args.columns!r}.")
        if args.partitions is not None and args.partitions < 1:
            raise UsageError(f"--partitions must be positive, not {args.partitions}.")
        graph = import_tsv(
            *args.files, config=args.config, num_partitions=args.partitions, seed=args.seed, columns=columns
        )
        if graph.config is not None:  # the user's config, with the directory's paths and partitions
            written = write(graph, args.output)
            directory = args.output.resolve()
            config = dict(graph.config, entity_path=str(directory), checkpoint_path=str(directory / "checkpoints"))
            config["edge_paths"] = [str(path) for path in written.edge_paths.values()]
            config["entities"] = {
                name: dict(config["entities"][name], num_partitions=len(sizes))
                for name, sizes in zip(graph.schema.entity_types, graph.schema.partition_sizes)
            }
            write_config(config, directory)
        else:
            conversion = conversion_for_model_name(args.model)
            dimension = 2 * args.dim if conversion.is_complex else args.dim
            write(
                graph,
                args.output,
                config=dict(dimension=dimension, operator=conversion.operator, comparator=conversion.comparator),
            )
        counts = ", ".join(f"{name} {f.num_triples:,}" for name, f in graph.splits.items())
        return f"wrote {graph.schema} ({counts} triples) to {args.output}"
    import torch

    if not args.model.is_file():
        raise UsageError(f"Model file {args.model} does not exist.")
    model = torch.load(args.model, weights_only=False)
    graph = load_pbg_graph(args.graph, args.pbg_config)
    check_same_ids(args.model.parent / "training_triples", graph)
    write_checkpoint(model, graph, args.output, version=args.version)
    return f"wrote PyTorch-BigGraph checkpoint version {args.version} to {args.output}"
