"""Reading PyTorch-BigGraph checkpoints into PyKEEN models: :func:`read_checkpoint`, :func:`initial_model`.

:func:`read_checkpoint` reads PyTorch-BigGraph 1.0 checkpoints (and the pre-release layout,
:mod:`~pykeen_bess.pbg.legacy`) into a PyKEEN model with exactly PyTorch-BigGraph's scores: global
embeddings and ``max_norm`` are folded into the rows; PyTorch-BigGraph's separate head- and
tail-prediction operators of dynamic relations become PyKEEN's inverse relations
(``create_inverse_triples=True``) where they differ; a missing file is an error (PyTorch-BigGraph
would silently re-initialise it). :func:`initial_model` turns a checkpoint into a model's
initializers (PyTorch-BigGraph's ``init_path``).
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any, cast

import torch
from pykeen.models import ERModel, model_resolver
from pykeen.nn.init import PretrainedInitializer
from pykeen.nn.representation import Embedding

from . import files
from .config import load_config
from .conversion import DYNAMIC_NAMES, Conversion, conversion_for_model, conversion_for_operator, rows_to_weight
from .graph import TypedGraph, as_typed_graph
from .legacy import is_legacy_checkpoint, read_legacy_checkpoint
from .schema import GraphSchema

__all__ = [
    "CheckpointInitializer",
    "checkpoint_conversion",
    "initial_model",
    "partition_rows",
    "read_checkpoint",
    "relations_from_parameters",
    "set_relations",
]

logger = logging.getLogger(__name__)


def read_checkpoint(
    directory: str | os.PathLike,
    graph: TypedGraph | Any,
    *,
    model: ERModel | None = None,
    version: int | None = None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
) -> ERModel:
    """Read a PyTorch-BigGraph checkpoint (1.0, or the pre-release layout) into a PyKEEN model.

    :param directory: the checkpoint directory
    :param graph: the typed graph (or its training factory) the checkpoint was trained on (same types,
        partitions and relations); the model is built on its training factory
    :param model: a model to fill (default: built from the config: DistMult, TransE, ComplEx, RotatE or
        RESCAL without constraints or regularizers, as PyTorch-BigGraph trains)
    :param version: the version to read (default: the committed one)
    :param config: the checkpoint's config (default: its ``config.json``, else the graph's)
    :returns: the model, scoring every triple as PyTorch-BigGraph does
    :raises FileNotFoundError: naming a missing file (PyTorch-BigGraph would silently re-initialise it)
    :raises ValueError: for operators, comparators or settings without an exact PyKEEN counterpart
    """
    typed = as_typed_graph(graph)
    schema = typed.schema
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"Checkpoint directory {directory} does not exist.")
    settings: Mapping[str, Any] | None
    if is_legacy_checkpoint(directory):
        rows_by_part, parameters, legacy_config, version = read_legacy_checkpoint(directory, schema)
        settings = (
            load_config(config)
            if config is not None
            else (load_config(legacy_config) if legacy_config is not None else typed.config)
        )
    else:
        if config is not None:
            settings = load_config(config)
        elif (directory / "config.json").is_file():
            settings = load_config(directory / "config.json")
        else:
            settings = typed.config
        if version is None:
            version = files.read_version(directory)
        rows_by_part = {}
        for t, name in enumerate(schema.entity_types):
            for p in range(len(schema.partition_sizes[t])):
                rows_by_part[(t, p)] = files.read_embeddings(files.embeddings_file(directory, name, p, version))[0]
        parameters = files.read_model(files.model_file(directory, version))
    if settings is None:
        raise ValueError(f"{directory} has no config.json; pass config= (the run's PyTorch-BigGraph config).")
    source = str(directory)
    conversion = checkpoint_conversion(settings, source)
    dimension = int(settings["dimension"])
    rows = _entity_rows(rows_by_part, schema, parameters, settings, source)
    relation = relations_from_parameters(parameters, schema, settings, conversion, typed.training, source)
    if model is None:
        model = cast(
            ERModel,
            model_resolver.make(conversion.model, triples_factory=typed.training, **conversion.model_kwargs(dimension)),
        )
    elif type(conversion_for_model(model)) is not type(conversion):
        raise ValueError(f"{source} holds {conversion.describe()}, not the given {type(model).__name__}.")
    entity = cast(Embedding, model.entity_representations[0])._embeddings.weight
    with torch.no_grad():
        entity.copy_(rows_to_weight(rows, conversion.is_complex).to(entity))
    set_relations(model, relation)
    logger.info("Read PyTorch-BigGraph checkpoint %s version %d as %s.", directory, version, conversion.describe())
    return model


def initial_model(
    directory: str | os.PathLike,
    graph: TypedGraph | Any,
    *,
    version: int | None = None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """Return the PyKEEN model name and keyword arguments that start from a PyTorch-BigGraph checkpoint.

    The checkpoint's rows and relations become the model's initializers
    (:class:`~pykeen.nn.init.PretrainedInitializer`), so a fresh training (any loop; BESS shards them
    instead of drawing new values) starts from them: PyTorch-BigGraph's ``init_path``::

        model, model_kwargs = pbg.initial_model("pbg_init/", graph)
        pipeline(training=graph.training, ..., model=model, model_kwargs=model_kwargs, training_loop="bess")

    :param directory: the checkpoint directory
    :param graph: the typed graph (or its training factory) the checkpoint was trained on
    :param version: the version to read (default: the committed one)
    :param config: the checkpoint's config (default: its ``config.json``, else the graph's)
    :returns: the model name (DistMult, TransE, ComplEx, RotatE or RESCAL) and its keyword arguments
    """
    model = read_checkpoint(directory, graph, version=version, config=config)
    kwargs = conversion_for_model(model).model_kwargs(int(_dimension(model)))
    for key, representation in (
        ("entity_initializer", model.entity_representations[0]),
        ("relation_initializer", model.relation_representations[0]),
    ):
        embedding = cast(Embedding, representation)
        values = embedding._embeddings.weight.detach().view(embedding.max_id, *embedding._shape)
        kwargs[key] = CheckpointInitializer(values.clone())
    return type(model).__name__, kwargs


class CheckpointInitializer(PretrainedInitializer):
    """PyKEEN's pre-trained initializer, handing out a copy of its values at every call.

    PyKEEN's own returns its tensor itself, which then becomes the embedding's weight: the reset of the
    embedding's inner ``nn.Embedding`` (``normal_``, in place, before the outer reset) overwrites the
    stored values, so a second ``reset_parameters_()`` (every fresh training calls one) loses them.
    """

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return super().__call__(x).clone()


def _dimension(model: ERModel) -> int:
    """PyTorch-BigGraph's dimension of a model: its entity rows' width (complex: real and imaginary parts)."""
    return int(cast(Embedding, model.entity_representations[0])._embeddings.weight.shape[1])


def _entity_rows(
    rows_by_part: Mapping[tuple[int, int], torch.Tensor],
    schema: GraphSchema,
    parameters: Mapping[str, torch.Tensor],
    settings: Mapping[str, Any],
    source: str,
) -> torch.Tensor:
    """Concatenate the partitions in id order (see :func:`partition_rows`)."""
    return torch.cat(
        [
            partition_rows(rows_by_part[(t, p)], schema, t, p, parameters, settings, source)
            for t in range(schema.num_types)
            for p in range(len(schema.partition_sizes[t]))
        ]
    )


def partition_rows(
    rows: torch.Tensor,
    schema: GraphSchema,
    entity_type: int,
    partition: int,
    parameters: Mapping[str, torch.Tensor],
    settings: Mapping[str, Any],
    source: str,
) -> torch.Tensor:
    """Return one partition's rows as PyTorch-BigGraph scores them (global embedding and ``max_norm`` folded in).

    :raises ValueError: for rows of another shape than the partition's entity count and the dimension
    """
    name = schema.entity_types[entity_type]
    size = schema.partition_sizes[entity_type][partition]
    dimension = int(settings["dimension"])
    if tuple(rows.shape) != (size, dimension):
        raise ValueError(
            f"{source}: partition {partition} of entity type {name!r} has embeddings of shape {tuple(rows.shape)}, "
            f"expected ({size}, {dimension}) (the graph's entity count and the config's dimension)."
        )
    max_norm = settings.get("max_norm")
    if max_norm:  # PyTorch-BigGraph renormalises every looked-up row (torch.embedding_renorm_), then adds
        norms = rows.norm(dim=1, keepdim=True)
        rows = torch.where(norms > max_norm, rows * (max_norm / (norms + 1e-7)), rows)
    if settings.get("global_emb"):
        key = f"entities/{name}/global_embedding"
        if key not in parameters:
            raise ValueError(f"{source}: global_emb=True but the model file lacks {key}.")
        rows = rows + parameters[key]
    return rows


def checkpoint_conversion(settings: Mapping[str, Any], source: str) -> Conversion:
    """Return the conversion of a checkpoint's config (one operator for all relations, no bias).

    :raises ValueError: for several operators, ``bias``, or a pair without a PyKEEN interaction
    """
    if settings.get("bias"):
        raise ValueError(f"{source}: bias=True adds the first coordinates as biases; no PyKEEN interaction does.")
    operators = {r["operator"] for r in settings["relations"]} - {"none"}
    if len(operators) > 1:
        raise ValueError(f"{source}: the relations use several operators {sorted(operators)}; a PyKEEN model has one.")
    return conversion_for_operator(operators.pop() if operators else "none", settings["comparator"], source)


def set_relations(model: ERModel, relation: torch.Tensor) -> None:
    """Write PyKEEN's relation representation ``[R', ...]`` (complex for complex models) into the model's weight."""
    weight = cast(Embedding, model.relation_representations[0])._embeddings.weight
    if relation.is_complex():
        relation = torch.view_as_real(relation)
    with torch.no_grad():
        weight.copy_(relation.reshape(weight.shape).to(weight))


def _identity(conversion: Conversion, shape: tuple[int, ...], count: int) -> dict[str, torch.Tensor]:
    """Return the parameters of relations with operator ``none`` under the conversion's operator."""
    dimension = shape[-1]
    if conversion.operator == "diagonal":
        return {"diagonal": torch.ones(count, dimension)}
    if conversion.operator == "translation":
        return {"translation": torch.zeros(count, dimension)}
    if conversion.operator == "complex_diagonal":
        return {"real": torch.ones(count, dimension // 2), "imag": torch.zeros(count, dimension // 2)}
    return {"linear_transformation": torch.eye(dimension).expand(count, dimension, dimension).clone()}


def relations_from_parameters(
    parameters: Mapping[str, torch.Tensor],
    schema: GraphSchema,
    settings: Mapping[str, Any],
    conversion: Conversion,
    factory: Any,
    source: str,
) -> torch.Tensor:
    """Return PyKEEN's relation representation ``[R', ...]`` from PyTorch-BigGraph's operator parameters."""
    dimension = int(settings["dimension"])
    names = {"diagonal", "translation", "linear_transformation", "real", "imag"}
    inverse = bool(factory.create_inverse_triples)
    if schema.dynamic_relations:
        sides = {}
        for side in ("lhs", "rhs"):
            found = {
                name: parameters[f"relations/0/operator/{side}/{DYNAMIC_NAMES[name]}"]
                for name in names
                if f"relations/0/operator/{side}/{DYNAMIC_NAMES[name]}" in parameters
            }
            if settings["relations"][0]["operator"] == "none":
                found = _identity(conversion, (dimension,), schema.num_relations)
            if not found:
                raise ValueError(
                    f"{source}: the model file lacks the {side} operator of the dynamic relations (PyTorch-BigGraph "
                    f"would silently use the identity)."
                )
            sides[side] = found
        forward = conversion.from_lhs(sides["lhs"])
        if inverse:
            return _interleave(forward, conversion.from_lhs(sides["rhs"]), factory)
        from_rhs = conversion.from_rhs(sides["rhs"])
        if not torch.allclose(forward, from_rhs, rtol=1e-5, atol=1e-6):
            raise ValueError(
                f"{source}: the dynamic relations' head-prediction (rhs) and tail-prediction (lhs) operators differ "
                f"(PyTorch-BigGraph trains them separately); in PyKEEN that is a model with inverse relations: read "
                f"the graph with create_inverse_triples=True (command line: train --pbg ... --inverse-triples)."
            )
        return forward
    relations = []
    for index, relation in enumerate(settings["relations"]):
        if relation["operator"] == "none":
            relations.append(conversion.from_rhs(_identity(conversion, (dimension,), 1)).squeeze(0))
            continue
        found = {
            name: parameters[key] for name in names if (key := f"relations/{index}/operator/rhs/{name}") in parameters
        }
        if not found:
            raise ValueError(
                f"{source}: the model file lacks the operator of relation {relation['name']!r} "
                f"(relations/{index}/operator/rhs/...; PyTorch-BigGraph would silently use the identity)."
            )
        relations.append(conversion.from_rhs({k: v.unsqueeze(0) for k, v in found.items()}).squeeze(0))
    forward = torch.stack(relations)
    if inverse:  # c is symmetric: the inverse relation's tail prediction is the rhs operator's head prediction
        rhs = conversion.rhs(forward)
        return _interleave(forward, conversion.from_lhs(rhs), factory)
    return forward


def _interleave(forward: torch.Tensor, inverse: torch.Tensor, factory: Any) -> torch.Tensor:
    """Place forward and inverse relations at PyKEEN's relation ids (the factory's inverter)."""
    real = torch.arange(forward.shape[0])
    batch = torch.stack([torch.zeros_like(real), real, torch.zeros_like(real)], dim=1)
    forward_ids = factory.relation_inverter.map(batch=batch)[:, 1]
    inverse_ids = factory.relation_inverter.map(batch=batch, invert=True)[:, 1]
    result = forward.new_zeros((2 * forward.shape[0], *forward.shape[1:]))
    result[forward_ids] = forward
    result[inverse_ids] = inverse
    return result
