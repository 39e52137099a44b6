r"""PyTorch-BigGraph 1.0's files, one function per file kind (no dependency on ``torchbiggraph``).

Inputs (an *entity path* and one directory per *edge path*):

* ``entity_count_{type}_{part}.txt``: ``"N\\n"``; ``entity_names_{type}_{part}.json``: a JSON list;
* ``dynamic_rel_count.txt``, ``dynamic_rel_names.json``;
* ``edges_{l}_{r}.h5`` per bucket: int64 datasets ``lhs``, ``rhs`` (offsets within the partitions)
  and ``rel``, root attribute ``format_version = 1``. PyTorch-BigGraph's trainer needs every bucket
  file, so empty buckets are written too.

Checkpoints (one directory):

* ``embeddings_{type}_{part}.v{N}.h5``: dataset ``embeddings`` (float32 ``[count, D]``), optional
  ``optimizer/state_dict`` (a ``torch.save`` blob as ``np.void`` bytes, e.g. row-wise Adagrad's
  ``{"state": {0: {"step": 0, "sum": [count]}}, "param_groups": [{"lr": ...}]}``; its ``lr``
  overrides the config's when PyTorch-BigGraph loads it);
* ``model.v{N}.h5``: group ``model`` with ``relations/{idx}/operator/{side}/{param}`` datasets
  (attribute ``state_dict_key``);
* ``checkpoint_version.txt``: the committed version, written last (with ``fsync``); PyTorch-BigGraph
  resumes at iteration ``N`` (``N = epochs x edge paths x edge chunks``);
* ``config.json`` (:mod:`~pykeen_bess.pbg.config`).

Every file is written under a temporary name and renamed into place, so a crash never leaves a
partial file under its final name. The datasets of the checkpoint files carry the CRC-32 of their
values (attribute ``pykeen_bess_crc32``, which PyTorch-BigGraph ignores), checked when they are read.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..storage import fsync
from ..storage.digests import DIGEST_ATTRIBUTE, crc32_of_array, verify_array

__all__ = [
    "FORMAT_VERSION",
    "VERSION_FILE",
    "bucket_file",
    "count_file",
    "embeddings_file",
    "iter_edge_chunks",
    "model_file",
    "names_file",
    "read_count",
    "read_embeddings",
    "read_model",
    "read_names",
    "read_version",
    "remove_version",
    "write_count",
    "write_edges",
    "write_embeddings",
    "write_model",
    "write_names",
    "write_version",
]

#: the ``format_version`` of PyTorch-BigGraph 1.0's HDF5 files
FORMAT_VERSION = 1
#: the version pointer of a checkpoint directory
VERSION_FILE = "checkpoint_version.txt"
#: edges read per chunk from a bucket file
EDGE_CHUNK = 1 << 22


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ImportError("Reading and writing PyTorch-BigGraph files needs h5py (pip install h5py).") from None
    return h5py


def _replace(temporary: pathlib.Path, path: pathlib.Path) -> None:
    """Move a finished temporary file into place (atomic on POSIX)."""
    os.replace(temporary, path)


def _temporary(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


# -- entities and relations ----------------------------------------------------------------------


def count_file(directory: pathlib.Path, entity_type: str, part: int) -> pathlib.Path:
    """``entity_count_{type}_{part}.txt``."""
    return directory / f"entity_count_{entity_type}_{part}.txt"


def names_file(directory: pathlib.Path, entity_type: str, part: int) -> pathlib.Path:
    """``entity_names_{type}_{part}.json``."""
    return directory / f"entity_names_{entity_type}_{part}.json"


def read_count(path: pathlib.Path) -> int:
    """Read a count file (``N`` and a newline).

    :raises FileNotFoundError: naming the file
    :raises ValueError: naming the file, if it holds no non-negative integer
    """
    if not path.is_file():
        raise FileNotFoundError(f"PyTorch-BigGraph count file {path} is missing.")
    text = path.read_text(encoding="utf-8").strip()
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{path} must hold an integer, not {text[:40]!r}.") from None
    if value < 0:
        raise ValueError(f"{path} holds a negative count ({value}).")
    return value


def write_count(path: pathlib.Path, count: int) -> None:
    """Write a count file."""
    temporary = _temporary(path)
    temporary.write_text(f"{int(count)}\n", encoding="utf-8")
    _replace(temporary, path)


def read_names(path: pathlib.Path, count: int | None = None) -> list[str] | None:
    """Read a names file (None if it does not exist).

    :raises ValueError: naming the file, if it is not a list of strings or has another length than ``count``
    """
    if not path.is_file():
        return None
    try:
        names = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(names, list):
        raise ValueError(f"{path} must hold a JSON list of names.")
    if count is not None and len(names) != count:
        raise ValueError(f"{path} holds {len(names)} names, but its count file says {count}.")
    return [str(name) for name in names]


def write_names(path: pathlib.Path, names: list[str]) -> None:
    """Write a names file."""
    temporary = _temporary(path)
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(list(names), file)
    _replace(temporary, path)


# -- edges ---------------------------------------------------------------------------------------


def bucket_file(directory: pathlib.Path, lhs: int, rhs: int) -> pathlib.Path:
    """``edges_{lhs}_{rhs}.h5``."""
    return directory / f"edges_{lhs}_{rhs}.h5"


def iter_edge_chunks(
    path: pathlib.Path, check_version: bool = True, chunk: int = EDGE_CHUNK
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yield ``(lhs, rel, rhs)`` int64 arrays of a bucket file, ``chunk`` edges at a time.

    :raises ValueError: naming the file, for another ``format_version``, missing or unequal datasets,
        or featurized edges
    """
    h5py = _h5py()
    with h5py.File(path, "r") as file:
        if check_version:
            version = file.attrs.get("format_version")
            if version is None or np.ndim(version) != 0 or isinstance(version, str | bytes) or int(version) != 1:
                raise ValueError(
                    f"{path} has format_version={_shown(version)}; PyTorch-BigGraph 1.0 edge files have "
                    f"format_version=1."
                )
        if any(key.endswith("d_offsets") or key.endswith("d_data") for key in file):
            raise ValueError(
                f"{path} holds featurized edges (lhsd_/rhsd_ datasets); PyKEEN's models have one embedding per "
                f"entity, so featurized graphs cannot be imported."
            )
        missing = [key for key in ("lhs", "rhs", "rel") if key not in file]
        if missing:
            raise ValueError(f"{path} lacks the datasets {missing} (a bucket file has lhs, rhs and rel).")
        lhs, rhs, rel = file["lhs"], file["rhs"], file["rel"]
        if not lhs.shape == rhs.shape == rel.shape or len(lhs.shape) != 1:
            raise ValueError(
                f"{path}: lhs, rhs and rel must be 1-d of equal length, not {lhs.shape}, {rhs.shape}, {rel.shape}."
            )
        for start in range(0, lhs.shape[0], chunk):
            stop = min(start + chunk, lhs.shape[0])
            yield (
                np.asarray(lhs[start:stop], dtype=np.int64),
                np.asarray(rel[start:stop], dtype=np.int64),
                np.asarray(rhs[start:stop], dtype=np.int64),
            )


def write_edges(path: pathlib.Path, lhs: np.ndarray, rel: np.ndarray, rhs: np.ndarray) -> None:
    """Write a bucket file (int64 datasets, ``format_version = 1``); empty buckets too."""
    with _new_file(path) as file:
        for key, values in (("lhs", lhs), ("rhs", rhs), ("rel", rel)):
            file.create_dataset(key, data=np.ascontiguousarray(values, dtype=np.int64))


@contextlib.contextmanager
def _new_file(path: pathlib.Path, attrs: Mapping[str, Any] | None = None, sync: bool = False) -> Iterator[Any]:
    """Write an HDF5 file of PyTorch-BigGraph 1.0 (``format_version = 1``) under a temporary name, then rename it.

    :param path: the file
    :param attrs: more root attributes
    :param sync: flush the file to disk before it is renamed (checkpoints)
    :yields: the open file
    """
    h5py = _h5py()
    temporary = _temporary(path)
    try:
        with h5py.File(temporary, "w") as file:
            file.attrs["format_version"] = FORMAT_VERSION
            for key, value in (attrs or {}).items():
                file.attrs[key] = value
            yield file
        if sync:
            fsync(temporary)
        _replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _floats(values: torch.Tensor) -> np.ndarray:
    """Return a tensor as a numpy array of its float precision (float16, 32 or 64; others as float32)."""
    dtype = values.dtype if values.dtype in (torch.float16, torch.float32, torch.float64) else torch.float32
    return values.detach().to("cpu", dtype).contiguous().numpy()


# -- checkpoints ---------------------------------------------------------------------------------


def embeddings_file(directory: pathlib.Path, entity_type: str, part: int, version: int) -> pathlib.Path:
    """``embeddings_{type}_{part}.v{version}.h5``."""
    return directory / f"embeddings_{entity_type}_{part}.v{version}.h5"


def model_file(directory: pathlib.Path, version: int) -> pathlib.Path:
    """``model.v{version}.h5``."""
    return directory / f"model.v{version}.h5"


def _optimizer_blob(state: Mapping[str, Any]) -> np.ndarray:
    """Return a ``torch.save`` blob as PyTorch-BigGraph stores it (``np.void`` bytes)."""
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return np.frombuffer(buffer.getvalue(), dtype=np.dtype("V1"))


def _read_optimizer_blob(dataset: Any, path: pathlib.Path) -> dict[str, Any]:
    return torch.load(io.BytesIO(_verified(dataset, path).tobytes()), weights_only=True)


def _digested_dataset(group: Any, name: str, values: np.ndarray) -> Any:
    """Create a dataset carrying the CRC-32 of its values (:data:`~pykeen_bess.storage.digests.DIGEST_ATTRIBUTE`)."""
    dataset = group.create_dataset(name, data=values)
    dataset.attrs[DIGEST_ATTRIBUTE] = np.int64(crc32_of_array(values))
    return dataset


def _verified(dataset: Any, path: pathlib.Path) -> np.ndarray:
    """Read a dataset, checked against its digest if it has one (PyTorch-BigGraph's own files have none).

    :raises CorruptCheckpointError: naming the file and the dataset
    """
    values = np.asarray(dataset[...])
    expected = dataset.attrs.get(DIGEST_ATTRIBUTE)
    verify_array(values, None if expected is None else int(expected), path, f"dataset {dataset.name!r}")
    return values


def write_embeddings(
    path: pathlib.Path,
    rows: torch.Tensor,
    optimizer_state: Mapping[str, Any] | None = None,
    attrs: Mapping[str, Any] | None = None,
) -> None:
    """Write an entity partition's checkpoint file.

    :param path: the file
    :param rows: shape: ``[count, D]``, written in their precision (float16, float32 or float64: PyTorch-BigGraph
        reads any of them as float32; a float64 run resumes exactly), other dtypes as float32
    :param optimizer_state: PyTorch-BigGraph's optimizer state dict of the partition (tensors, ints,
        floats, lists and dicts only: PyTorch-BigGraph loads it with ``weights_only=True``)
    :param attrs: informational root attributes (PyTorch-BigGraph's ``iteration/...``)
    """
    with _new_file(path, attrs, sync=True) as file:
        _digested_dataset(file, "embeddings", _floats(rows))
        if optimizer_state is not None:
            _digested_dataset(file, "optimizer/state_dict", _optimizer_blob(optimizer_state))


def read_embeddings(path: pathlib.Path) -> tuple[torch.Tensor, dict[str, Any] | None]:
    """Read an entity partition's checkpoint file: the rows (in their stored precision) and the optimizer state.

    :raises FileNotFoundError: naming the file
    :raises ValueError: naming the file, for another ``format_version`` or a missing ``embeddings`` dataset
    """
    h5py = _h5py()
    if not path.is_file():
        raise FileNotFoundError(f"PyTorch-BigGraph embeddings file {path} is missing.")
    with h5py.File(path, "r") as file:
        _check_format(file, path)
        if "embeddings" not in file:
            raise ValueError(f"{path} has no 'embeddings' dataset.")
        rows = torch.from_numpy(_verified(file["embeddings"], path))
        if not rows.is_floating_point():
            raise ValueError(f"{path}: embeddings of dtype {rows.dtype} are not floating point.")
        state = None
        if "optimizer/state_dict" in file:
            state = _read_optimizer_blob(file["optimizer/state_dict"], path)
    if rows.ndim != 2:
        raise ValueError(f"{path}: embeddings must be [count, dimension], not {tuple(rows.shape)}.")
    return rows, state


def write_model(
    path: pathlib.Path,
    parameters: Mapping[str, torch.Tensor],
    attrs: Mapping[str, Any] | None = None,
    optimizer_state: Mapping[str, Any] | None = None,
) -> None:
    """Write ``model.v{N}.h5``.

    :param path: the file
    :param parameters: dataset path under ``model`` (e.g. ``relations/0/operator/rhs/diagonal``) -> values;
        each dataset gets PyTorch-BigGraph's ``state_dict_key`` attribute
    :param attrs: informational root attributes
    :param optimizer_state: the relation parameters' optimizer state (omitted: PyTorch-BigGraph starts a fresh one)
    """
    with _new_file(path, attrs, sync=True) as file:
        group = file.create_group("model")
        for name, value in parameters.items():
            _digested_dataset(group, name, _floats(value)).attrs["state_dict_key"] = _state_dict_key(name)
        if optimizer_state is not None:
            _digested_dataset(file, "optimizer/state_dict", _optimizer_blob(optimizer_state))


def _state_dict_key(name: str) -> str:
    """``relations/{i}/operator/{side}/{param}`` -> ``{side}_operators.{i}.{param}`` (PyTorch-BigGraph's mapping)."""
    parts = name.split("/")
    if len(parts) == 5 and parts[0] == "relations" and parts[2] == "operator":
        return f"{parts[3]}_operators.{parts[1]}.{parts[4]}"
    if len(parts) == 3 and parts[0] == "entities" and parts[2] == "global_embedding":
        return f"global_embs.emb_{parts[1]}"
    raise ValueError(f"Not a PyTorch-BigGraph model parameter: {name!r}.")


def read_model(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """Read ``model.v{N}.h5``: dataset path under ``model`` -> values.

    :raises FileNotFoundError: naming the file
    :raises ValueError: naming the file, for another ``format_version``
    """
    h5py = _h5py()
    if not path.is_file():
        raise FileNotFoundError(f"PyTorch-BigGraph model file {path} is missing.")
    parameters: dict[str, torch.Tensor] = {}
    with h5py.File(path, "r") as file:
        _check_format(file, path)
        if "model" not in file:
            return parameters

        def visit(name: str, item: Any) -> None:
            if isinstance(item, h5py.Dataset):
                parameters[name] = torch.from_numpy(_verified(item, path))

        file["model"].visititems(visit)
    return parameters


def _check_format(file: Any, path: pathlib.Path) -> None:
    version = file.attrs.get("format_version")
    if version is None or np.ndim(version) != 0 or isinstance(version, str | bytes) or int(version) != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version={_shown(version)}; PyTorch-BigGraph 1.0 files have format_version=1."
        )


def _shown(value: Any) -> str:
    """Return a file attribute for a message (numpy scalars as plain numbers)."""
    return repr(value.item() if hasattr(value, "item") and np.ndim(value) == 0 else value)


def read_version(directory: pathlib.Path) -> int:
    """Return the committed version of a checkpoint directory (0 without ``checkpoint_version.txt``).

    :raises ValueError: naming the file, if it holds no integer
    """
    path = directory / VERSION_FILE
    if not path.is_file():
        return 0
    text = path.read_text(encoding="utf-8").strip()
    if not text:
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path} must hold the checkpoint version, not {text[:40]!r}.") from None


def write_version(directory: pathlib.Path, version: int) -> None:
    """Commit ``version``: write ``checkpoint_version.txt`` under a temporary name, fsync, rename, fsync its folder."""
    path = directory / VERSION_FILE
    temporary = _temporary(path)
    with open(temporary, "w", encoding="utf-8") as file:
        file.write(f"{int(version)}\n")
        file.flush()
        os.fsync(file.fileno())
    _replace(temporary, path)
    fsync(directory)


def remove_version(directory: pathlib.Path, version: int) -> None:
    """Remove the entity and model files of one version (after a newer one is committed)."""
    for path in directory.glob(f"embeddings_*.v{int(version)}.h5"):
        path.unlink(missing_ok=True)
    model_file(directory, version).unlink(missing_ok=True)
