"""The command line's options as keyword arguments of :func:`pykeen.pipeline.pipeline`.

:func:`pipeline_kwargs` starts from :data:`DEFAULTS` (or from a ``--config`` file) and sets each
group of options in turn: the graph, the model, the training loop's options, training, early
stopping, the process's CPU threads and allocator, and evaluation.
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Mapping
from typing import Any

from .pbg import use_pbg_graph
from .files import UsageError, load_config, load_dataset

__all__ = ["DEFAULTS", "pipeline_kwargs"]

#: the settings used without ``--config`` (a flag given explicitly always wins)
DEFAULTS: dict[str, Any] = dict(
    dataset="nations",
    model="DistMult",
    dim=64,
    corruption="ht",
    batch_size=512,
    epochs=100,
    optimizer="adam",
    lr=0.01,
    evaluator="bess",
    seed=42,
)


def _merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Merge two levels deep: ``*_kwargs`` dictionaries are updated key by key."""
    merged = dict(base)
    for key, value in update.items():
        if key.endswith("_kwargs") and isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


class _PipelineKwargs:
    """Keyword arguments of :func:`pykeen.pipeline.pipeline`, built option by option."""

    def __init__(self, kwargs: dict[str, Any]):
        self.kwargs = kwargs

    def set(self, key: str, value: Any, inner: str | None = None) -> None:
        """Set ``key`` (or the entry ``inner`` of the ``key`` dictionary, keeping its other entries)."""
        self.kwargs = _merge(self.kwargs, {key: value} if inner is None else {key: {inner: value}})

    def inner(self, key: str) -> Mapping[str, Any]:
        """Return the ``key`` dictionary (empty if not set)."""
        return self.kwargs.get(key) or {}

    def bess_evaluator(self) -> bool:
        """Whether the run evaluates with the bess evaluator.

        It is the command line's default; a configuration without an evaluator gets PyKEEN's default,
        the rank-based one.
        """
        return str(self.kwargs.get("evaluator", "")).lower() in {"bess", "bessevaluator"}


def pipeline_kwargs(args: argparse.Namespace, in_group: bool = False) -> dict[str, Any]:
    """Turn parsed arguments (and ``--config``) into keyword arguments of :func:`pykeen.pipeline.pipeline`.

    :param args: the parsed arguments; options that were not given are absent
    :param in_group: whether this process is one rank of a process group (``num_shards`` is then the
        world size)
    :returns: the keyword arguments
    :raises UsageError: for inconsistent options
    """
    given = vars(args)
    from_config = "config" in given
    if from_config:
        settings: dict[str, Any] = {}
        kwargs = _PipelineKwargs(load_config(given["config"]))
    else:
        settings = dict(DEFAULTS)
        kwargs = _PipelineKwargs({})
    settings.update({key: value for key, value in given.items() if key not in {"command", "config"}})
    _set_dataset(settings, given, kwargs)
    _set_model(settings, kwargs)
    _set_bess(settings, kwargs, in_group, from_config)
    _set_training(settings, kwargs)
    _set_stopper(settings, kwargs)
    _set_host(settings, kwargs)
    _set_evaluation(settings, kwargs)

    from ..training import BessTrainingLoop

    kwargs.kwargs["training_loop"] = BessTrainingLoop
    return kwargs.kwargs


def _set_dataset(settings: dict[str, Any], given: dict[str, Any], kwargs: _PipelineKwargs) -> None:
    """Set the graph: PyTorch-BigGraph's files, a dataset (name or directory), or the configuration's."""
    dataset_keys = ("dataset", "dataset_kwargs", "training", "testing", "validation")
    if "pbg" in settings:
        for key in dataset_keys:
            kwargs.kwargs.pop(key, None)
        use_pbg_graph(settings, given, kwargs.kwargs)
    elif "pbg_config" in settings:
        raise UsageError("--pbg-config needs --pbg.")
    elif "inverse_triples" in settings:
        raise UsageError("--inverse-triples needs --pbg (for a dataset: dataset_kwargs in a --config).")
    elif "dataset" in settings:  # (a configuration's dataset_kwargs, e.g. create_inverse_triples, stay)
        for key in ("dataset", "training", "testing", "validation"):
            kwargs.kwargs.pop(key, None)
        kwargs.set("dataset", load_dataset(settings["dataset"], kwargs.kwargs.get("dataset_kwargs")))
    elif isinstance(kwargs.kwargs.get("dataset"), str) and pathlib.Path(kwargs.kwargs["dataset"]).is_dir():
        # (PyKEEN ignores dataset_kwargs for a dataset object: they are applied here)
        kwargs.kwargs["dataset"] = load_dataset(kwargs.kwargs["dataset"], kwargs.kwargs.get("dataset_kwargs"))


def _set_model(settings: dict[str, Any], kwargs: _PipelineKwargs) -> None:
    """Set the model, loss, optimizer, evaluator, device, dimension, learning rate and seed."""
    for key in ("model", "loss", "optimizer", "evaluator", "model_kwargs", "loss_kwargs", "optimizer_kwargs", "device"):
        if key in settings:
            kwargs.set(key, settings[key])
    for flag, key, inner in (("dim", "model_kwargs", "embedding_dim"), ("lr", "optimizer_kwargs", "lr")):
        if flag in settings:
            kwargs.set(key, settings[flag], inner)
    if "seed" in settings:
        kwargs.set("random_seed", settings["seed"])


#: command-line options passed unchanged to the training loop
_LOOP_OPTIONS = (
    "replicas",
    "replica_grouping",
    "checkpoint_retrieval",
    "checkpoint_format",
    "storage",
    "storage_path",
    "partition",
    "sharding",
    "exchange",
    "corruption",
    "loss_weighter",
    "storage_kwargs",
    "memory_budget",
)


def _set_bess(settings: dict[str, Any], kwargs: _PipelineKwargs, in_group: bool, from_config: bool = False) -> None:
    """Set the training loop's options: shards, replicas, storage, partition, negatives, updates.

    Without ``--config`` (and outside a process group) the command line trains 2 shards unless told otherwise;
    a configuration keeps the loop's own default, as ``pipeline_from_path`` would.
    """
    replicated = "replicas" in settings or "replica_grouping" in settings
    if "num_shards" in settings:
        if in_group and not replicated and settings["num_shards"] != _world_size():
            raise UsageError(
                f"--num-shards {settings['num_shards']} under torchrun ({_world_size()} processes) needs --replicas "
                "(num_shards * replicas = the world size); without replicas every rank holds one shard."
            )
        kwargs.set("training_loop_kwargs", settings["num_shards"], "num_shards")
    elif not in_group and not from_config and "num_shards" not in kwargs.inner("training_loop_kwargs"):
        kwargs.set("training_loop_kwargs", 2, "num_shards")
    for flag in _LOOP_OPTIONS:
        if flag in settings:
            kwargs.set("training_loop_kwargs", settings[flag], flag)
    negatives = _negatives(settings)
    if negatives is not None:
        kwargs.set("training_loop_kwargs", negatives, "negatives")
    if settings.get("dense_updates"):
        kwargs.set("training_loop_kwargs", False, "sparse_updates")
    if "static_step" in settings:  # auto: None, the loop's default
        kwargs.set("training_loop_kwargs", {"on": True, "off": False}.get(settings["static_step"]), "static_step")
    if "negatives" in settings:
        kwargs.set("negative_sampler_kwargs", settings["negatives"], "num_negs_per_pos")
        if "num_negs_per_pos" in kwargs.inner("training_kwargs"):  # (HPO's best configurations have it there)
            kwargs.set("training_kwargs", settings["negatives"], "num_negs_per_pos")


def _world_size() -> int:
    """Return the size of the default process group (1 without one)."""
    from ..distributed.launch import world_size

    return world_size()


def _negatives(settings: dict[str, Any]) -> str | None:
    """Return the ``negatives`` scheme the flags choose (None: the loop's default)."""
    block = bool(settings.get("block_negatives"))
    if settings.get("typed_negatives"):  # one set per step unless --block-negatives
        return "typed" if block else "typed_step"
    if block or settings.get("step_negatives"):
        return "block" if block else "step"
    return None


def _set_training(settings: dict[str, Any], kwargs: _PipelineKwargs) -> None:
    """Set the epochs, batch sizes, checkpoints and progress bars."""
    if "epochs" in settings:
        kwargs.set("training_kwargs", settings["epochs"], "num_epochs")
    if "batch_size" in settings:
        kwargs.set("training_kwargs", settings["batch_size"] or None, "batch_size")
    name = settings.get("checkpoint_name")
    if name is not None and (name in ("", ".", "..") or pathlib.Path(name).name != name):
        raise UsageError(f"--checkpoint-name {name!r}: a file name (the folder is --checkpoint-directory), not a path.")
    for flag in ("sub_batch_size", "checkpoint_name", "checkpoint_frequency", "checkpoint_directory"):
        if flag in settings:
            value = str(settings[flag]) if flag == "checkpoint_directory" else settings[flag]
            kwargs.set("training_kwargs", value, flag)
    training = kwargs.inner("training_kwargs")  # PyKEEN writes no checkpoint without a name
    named = training.get("checkpoint_name") or training.get("checkpoint_on_failure")
    if {"checkpoint_directory", "checkpoint_frequency"} & set(settings) and not named:
        raise UsageError("--checkpoint-directory and --checkpoint-frequency need --checkpoint-name.")
    if "export_pbg" in settings:  # the optimizer's row state goes into the exported checkpoint
        kwargs.set("clear_optimizer", False)
    quiet = bool(settings.get("quiet"))
    for target in ("training_kwargs", "evaluation_kwargs"):  # a configuration's use_tqdm stays unless --quiet
        if quiet or "use_tqdm" not in kwargs.inner(target):
            kwargs.set(target, not quiet, "use_tqdm")


def _set_stopper(settings: dict[str, Any], kwargs: _PipelineKwargs) -> None:
    """Set early stopping and its options."""
    if settings.get("early_stopping"):
        kwargs.set("stopper", "early")
    stopper_flags = {"stopper_frequency": "frequency", "stopper_patience": "patience", "stopper_metric": "metric"}
    for flag, key in stopper_flags.items():
        if flag in settings:
            least = {"stopper_frequency": 1, "stopper_patience": 0}.get(flag)
            if least is not None and settings[flag] < least:
                raise UsageError(f"--{flag.replace('_', '-')} must be at least {least}, not {settings[flag]}.")
            if kwargs.kwargs.get("stopper") is None:
                raise UsageError(f"--{flag.replace('_', '-')} needs --early-stopping.")
            kwargs.set("stopper_kwargs", settings[flag], key)
    if "stopper_metric" in settings:  # (PyKEEN would fail at the first validation, after its epochs)
        # an evaluator given its own metrics (a configuration's hits@k with other k) may hold other ones
        _check_stopper_metric(
            settings["stopper_metric"], default_metrics="metrics" not in kwargs.inner("evaluator_kwargs")
        )


def _check_stopper_metric(metric: str, default_metrics: bool = True) -> None:
    """Raise a usage error unless ``metric`` names a rank-based metric (e.g. ``hits@10``, ``mrr``).

    :param default_metrics: the evaluator computes its default metrics: ``metric`` must be one of them
    """
    from pykeen.evaluation import RankBasedEvaluator
    from pykeen.evaluation.rank_based_evaluator import RankBasedMetricResults

    try:
        key = RankBasedMetricResults.string_or_key_to_key(metric).metric
    except (ValueError, KeyError):
        key = None
    # the metrics of the evaluators' default (BessEvaluator's are PyKEEN's)
    known = key is not None and (not default_metrics or key in {m.key for m in RankBasedEvaluator().metrics})
    if not known:
        raise UsageError(
            f"--stopper-metric {metric!r} is not one of the evaluation's metrics: e.g. hits@1, hits@3, hits@5, "
            f"hits@10, mrr, mean_rank, adjusted_arithmetic_mean_rank_index."
        )


def _set_host(settings: dict[str, Any], kwargs: _PipelineKwargs) -> None:
    """Set the CPU threads and the host allocator of the loop and the bess evaluator.

    The library leaves both alone unless asked; the command line asks (``auto``) unless an option or the
    configuration says otherwise (``keep``: None, leave the process as it is).
    """
    for flag, key in (("threads", "num_threads"), ("host_allocator", "host_allocator")):
        targets = ["training_loop_kwargs"] + (["evaluator_kwargs"] if kwargs.bess_evaluator() else [])
        for target in targets:
            if flag in settings:
                kwargs.set(target, None if settings[flag] == "keep" else settings[flag], key)
            elif key not in kwargs.inner(target):
                kwargs.set(target, "auto", key)


def _set_evaluation(settings: dict[str, Any], kwargs: _PipelineKwargs) -> None:
    """Set the evaluation's batch and slice sizes (checked here: the evaluation runs after the training)."""
    for flag in ("eval_batch_size", "eval_slice_size"):
        if flag in settings and settings[flag] < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, not {settings[flag]}.")
    if "memory_budget" in settings and kwargs.bess_evaluator():  # the budget of the device, evaluation too
        kwargs.set("evaluator_kwargs", settings["memory_budget"], "memory_budget")
    if "eval_batch_size" in settings:
        kwargs.set("evaluation_kwargs", settings["eval_batch_size"], "batch_size")
    if "eval_slice_size" in settings:
        if not kwargs.bess_evaluator():
            raise UsageError("--eval-slice-size applies to the bess evaluator only.")
        kwargs.set("evaluator_kwargs", settings["eval_slice_size"], "slice_size")
