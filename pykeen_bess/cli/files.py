"""What the command line reads and writes besides its arguments: datasets, configurations, run metadata."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

__all__ = [
    "UsageError",
    "check_triple_lines",
    "load_config",
    "load_dataset",
    "non_negative_int",
    "positive_int",
    "run_metadata",
]


class UsageError(ValueError):
    """A problem with the command line's input (printed without a traceback)."""


def positive_int(text: str) -> int:
    """Parse a positive integer argument (``--dim``: 0 or a negative dimension failed inside PyKEEN)."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """Parse a non-negative integer argument (a seed)."""
    return _int_at_least(text, 0, "a non-negative integer")


def _int_at_least(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, not {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, not {value}")
    return value


def load_dataset(name_or_path: str, dataset_kwargs: Mapping[str, Any] | None = None) -> Any:
    """Return a PyKEEN dataset from a name or a directory of label TSV files.

    :param name_or_path: a PyKEEN dataset name, or a directory with ``train.txt``, ``valid.txt``, ``test.txt``
    :param dataset_kwargs: the dataset's keyword arguments (a configuration's ``dataset_kwargs``, such as
        ``create_inverse_triples``), also for a directory (PyKEEN ignores them for a dataset object)
    :raises UsageError: for a missing directory or file, bad lines, an unknown name or unknown keyword arguments
    """
    from pykeen.datasets import PathDataset, get_dataset

    path = pathlib.Path(name_or_path)
    dataset_kwargs = dict(dataset_kwargs or {})
    if path.is_dir():
        files = {split: path / f"{split}.txt" for split in ("train", "valid", "test")}
        missing = [str(file) for file in files.values() if not file.is_file()]
        if missing:
            raise UsageError(f"Dataset directory {path} lacks {', '.join(missing)}.")
        for file in files.values():
            check_triple_lines(file)
        try:
            return PathDataset(
                training_path=files["train"],
                testing_path=files["test"],
                validation_path=files["valid"],
                **dataset_kwargs,
            )
        except TypeError as error:
            raise UsageError(
                f"dataset_kwargs {dataset_kwargs} do not fit the dataset directory {path}: {error}"
            ) from None
    if os.sep in name_or_path or name_or_path.startswith("."):  # a path, not a name
        what = "a file, not a directory of" if path.exists() else "no directory with"
        raise UsageError(f"--dataset {name_or_path}: {what} train.txt, valid.txt and test.txt.")
    from pykeen.datasets import dataset_resolver

    try:
        dataset_resolver.lookup(name_or_path)
    except (KeyError, ValueError) as error:
        raise UsageError(
            f"Unknown dataset {name_or_path!r}: neither a PyKEEN dataset name nor a directory ({error})."
        ) from None
    try:
        return get_dataset(dataset=name_or_path, dataset_kwargs=dataset_kwargs or None)
    except TypeError as error:
        raise UsageError(f"dataset_kwargs {dataset_kwargs} do not fit the dataset {name_or_path!r}: {error}") from None
    except (KeyError, ValueError) as error:
        raise UsageError(
            f"Unknown dataset {name_or_path!r}: neither a PyKEEN dataset name nor a directory ({error})."
        ) from None


def check_triple_lines(path: pathlib.Path) -> None:
    """Check a label TSV file before PyKEEN reads it: three non-empty tab-separated labels on every non-blank line.

    PyKEEN's reader would read a shorter line's missing labels, and an empty column, as empty strings
    (an entity ``''``), labels with spaces around them as other labels than without, a double quote as
    the start of a quoted field (failing without naming the file), and an empty file as an error naming none.

    :raises UsageError: naming the file and the first line that is not such a triple, or an empty file
    """
    triples = 0
    with path.open(encoding="utf-8", newline="") as lines:
        for number, line in enumerate(lines, start=1):
            line = line.rstrip("\r\n")
            if not line:
                continue  # PyKEEN's reader skips blank lines
            labels = line.split("\t")
            where = f"{path}, line {number}"
            if len(labels) != 3:
                raise UsageError(
                    f"{where}: {len(labels)} tab-separated column{'s' if len(labels) != 1 else ''}, expected 3 "
                    f"(head, relation, tail): {line[:80]!r}"
                )
            for column, label in zip(("head", "relation", "tail"), labels):
                if not label.strip():
                    problem = "is empty"
                elif label != label.strip():
                    problem = "has spaces around it (another label than without them)"
                elif '"' in label:
                    problem = "holds a double quote, which PyKEEN's reader takes for quoting"
                else:
                    continue
                raise UsageError(f"{where}: the {column} label {label!r} {problem}: {line[:80]!r}")
            triples += 1
    if not triples:
        raise UsageError(f"{path} holds no triples.")


def load_config(path: pathlib.Path) -> dict[str, Any]:
    """Read the pipeline keyword arguments of a configuration file (``{"pipeline": {...}}`` or the keywords)."""
    if not path.is_file():
        raise UsageError(f"Configuration file {path} does not exist.")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in {".yaml", ".yml"}:
        import yaml

        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            line = f" (line {where.line + 1})" if where is not None else ""
            problem = getattr(error, "problem", None) or type(error).__name__
            raise UsageError(f"Configuration file {path} is not valid YAML{line}: {problem}.") from None
    else:
        try:
            config = json.loads(text)
        except json.JSONDecodeError as error:
            raise UsageError(f"Configuration file {path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise UsageError(f"Configuration file {path} must hold an object of pipeline() arguments.")
    config = dict(config.get("pipeline", config))
    from ..training import BessTrainingLoop

    loop = config.pop("training_loop", "bess")
    # the loop's name, or its qualified name (as the metadata.json of an earlier run records it)
    qualified = f"{BessTrainingLoop.__module__}.{BessTrainingLoop.__qualname__}"
    if loop is not BessTrainingLoop and str(loop).lower() not in {"bess", "besstrainingloop", qualified.lower()}:
        raise UsageError(f"{path} asks for training_loop={loop!r}; this command trains with BESS only.")
    return config


_OMITTED = object()


def _json_value(value: Any, path: str, omitted: list[str]) -> Any:
    """Return ``value`` as JSON data (a class as its qualified name); ``_OMITTED`` (its path noted) if it has none."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        converted = {key: _json_value(item, f"{path}.{key}", omitted) for key, item in value.items()}
        return {key: item for key, item in converted.items() if item is not _OMITTED}
    if isinstance(value, list | tuple):
        items = [_json_value(item, f"{path}[{index}]", omitted) for index, item in enumerate(value)]
        if all(item is not _OMITTED for item in items):
            return items
    omitted.append(path)
    return _OMITTED


def run_metadata(kwargs: Mapping[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Return what ``--output``'s ``metadata.json`` records of a run.

    The versions of pykeen-bess, PyKEEN and PyTorch, and the keyword arguments of ``pipeline()``
    that are JSON data (classes by their qualified names; a dataset object by the name or directory
    it was given as); the paths of the others are listed under ``"omitted"``.
    """
    import pykeen.version
    import torch

    from .. import __version__

    omitted: list[str] = []
    recorded: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "metadata":
            continue
        if key == "dataset" and not isinstance(value, str):
            source = getattr(args, "pbg", None) or getattr(args, "dataset", None)
            source = source or (getattr(value, "metadata", None) or {}).get("name")
            value = str(source) if source is not None else value
        converted = _json_value(value, key, omitted)
        if converted is not _OMITTED:
            recorded[key] = converted
    return dict(
        pykeen_bess_version=__version__,
        pykeen_version=pykeen.version.VERSION,
        torch_version=torch.__version__,
        pipeline=recorded,
        omitted=omitted,
    )
