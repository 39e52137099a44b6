"""What BESS can train of a PyKEEN model: its entity tables, regularizers, constrainers, dtypes and triples.

Checked when the loop is built (:func:`check_model`), when training starts (:func:`check_triples_fit_model`,
:func:`check_model_dtype`) and after PyKEEN re-initialises the model.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from pykeen.models import ERModel, Model
from pykeen.nn.representation import Embedding
from pykeen.regularizers import (
    CombinedRegularizer,
    LpRegularizer,
    NoRegularizer,
    PowerSumRegularizer,
    Regularizer,
)
from pykeen.triples import CoreTriplesFactory
from pykeen.utils import clamp_norm, get_batchnorm_modules

__all__ = [
    "SUPPORTED_MODEL_EXAMPLES",
    "UnsupportedModelError",
    "check_model",
    "check_model_dtype",
    "check_one_dtype",
    "check_own_tables",
    "check_triples_fit_model",
    "describe_regularizer",
]

#: model names (``model_resolver`` keys, after registration) that BESS trains, named in error messages
SUPPORTED_MODEL_EXAMPLES = (
    "TransE",
    "DistMult",
    "ComplEx",
    "RotatE",
    "PairRE",
    "SimplE",
    "CP",
    "RESCAL",
    "InterHT",
    "TranS",
)


class UnsupportedModelError(ValueError, NotImplementedError):
    """A model BESS cannot shard or train (raised by :func:`check_model` when the loop is created).

    A :class:`ValueError` (as before) and a :class:`NotImplementedError`, the type PyKEEN raises for
    models its own loops cannot train in some way (e.g. sub-batching with batch normalization), so
    callers catching either keep working.
    """


def check_model(model: Model) -> list[Embedding]:
    """Check that BESS can shard the model; return its entity embeddings.

    :raises UnsupportedModelError: (a ValueError and NotImplementedError) naming what is not supported and the
        supported models
    """
    supported = (
        f"ERModel subclasses whose entity representations are pykeen.nn.Embedding (models such as "
        f"{', '.join(SUPPORTED_MODEL_EXAMPLES)}), or an ERModel built from such embeddings and any interaction "
        f"(e.g. interaction='TripleRE' or 'LineaRE')"
    )
    if not isinstance(model, ERModel):
        raise UnsupportedModelError(f"BESS cannot shard {type(model).__name__}: supported are {supported}.")
    embeddings = list(model.entity_representations)
    for representation in embeddings:
        if type(representation) is not Embedding:
            raise UnsupportedModelError(
                f"BESS cannot shard {type(model).__name__}: its entity representation {type(representation).__name__} "
                f"is not a plain pykeen.nn.Embedding. Supported are {supported}."
            )
    tables = cast(list[Embedding], embeddings)  # (checked above)
    check_own_tables(model, tables)
    entity_weights = {id(p) for representation in embeddings for p in representation.parameters()}
    for module in model.modules():
        if not isinstance(module, Regularizer) or isinstance(module, NoRegularizer) or not bool(module.weight):
            continue
        if any(id(p) in entity_weights for p in module.tracked_parameters):
            raise UnsupportedModelError(
                f"BESS cannot train {type(model).__name__} with its {type(module).__name__}: it regularizes the whole "
                f"entity table every step, which is never in one place under BESS. Give it weight 0 (for TransH: "
                f"model_kwargs=dict(regularizer='normlimit', regularizer_kwargs=dict(weight=0.0)))."
            )
    for position, representation in enumerate(tables):
        if not _row_wise_constrainer(representation):
            raise UnsupportedModelError(
                f"BESS cannot apply {type(model).__name__}'s constrainer {representation.constrainer!r} of entity "
                f"representation {position}: it constrains the whole table at once (or across entities), which is "
                f"never in one place under BESS; a step constrains the rows it updated. Constrain each row instead "
                f"(e.g. constrainer_kwargs=dict(maxnorm=..., dim=-1))."
            )
    for representation in [*embeddings, *model.relation_representations]:
        regularizer = getattr(representation, "regularizer", None)
        if regularizer is not None and regularizer.apply_only_once:
            raise UnsupportedModelError(
                f"BESS does not support regularizers with apply_only_once=True ({type(regularizer).__name__} of "
                f"{type(model).__name__}'s {type(representation).__name__}): PyKEEN applies them to the first "
                f"lookup of a batch only, which has no counterpart in a step split over shards."
            )
        if regularizer is not None and bool(regularizer.weight) and not _row_mean(regularizer):
            raise UnsupportedModelError(
                f"BESS cannot apply {type(model).__name__}'s {describe_regularizer(regularizer)}: it weighs the rows "
                f"of a step as PyKEEN's regularizers that average one value per row (LpRegularizer and "
                f"PowerSumRegularizer over dim=-1, and combinations of them), which this one does not."
            )
    check_one_dtype(model)
    if get_batchnorm_modules(model):
        raise UnsupportedModelError(
            f"BESS cannot train {type(model).__name__}: it has batch normalization layers, whose statistics would "
            f"depend on how a step is split into blocks."
        )
    return tables


def check_own_tables(model: ERModel, embeddings: Sequence[Embedding]) -> None:
    """Check that every entity representation has a table of its own (BESS shards one table per representation).

    :raises UnsupportedModelError: naming the representations that share a table (tied roles, such as
        ``entity_representations=[e, e]``), or an entity table a relation representation uses too
    """
    positions: dict[int, list[int]] = {}
    for position, representation in enumerate(embeddings):
        positions.setdefault(id(representation._embeddings.weight), []).append(position)
    tied = [found for found in positions.values() if len(found) > 1]
    relations = {id(p) for representation in model.relation_representations for p in representation.parameters()}
    if tied or relations & set(positions):
        what = (
            f"its entity representations {tied[0]} are one table"
            if tied
            else "a relation representation uses an entity table"
        )
        raise UnsupportedModelError(
            f"BESS cannot train {type(model).__name__}: {what}, and BESS trains one shard table per entity "
            f"representation (they would be drawn and trained apart). Give each its own Embedding."
        )


def _row_wise_constrainer(representation: Embedding) -> bool:
    """Whether an entity embedding's constrainer acts on each row alone (what a step's updated rows can get).

    PyKEEN's ``clamp_norm`` without ``dim`` clamps the norm of the whole table; ``normalize`` or ``clamp_norm`` over
    the entity axis mixes entities. Per-coordinate constrainers (``clamp``, ``complex_normalize``) are row-wise; a
    function of the user's is taken as row-wise (see the limitations).
    """
    constrainer = representation.constrainer
    if constrainer is None:
        return True
    function, kwargs = (
        (constrainer.func, constrainer.keywords) if isinstance(constrainer, functools.partial) else (constrainer, {})
    )
    if function is clamp_norm:
        dims = kwargs.get("dim")
    elif function is torch.nn.functional.normalize:
        dims = kwargs.get("dim", 1)
    else:
        return True
    if dims is None:
        return False
    ndim = 1 + len(representation.shape)  # PyKEEN constrains the whole table, [num_entities, *shape]
    return all(int(dim) % ndim != 0 for dim in (dims if isinstance(dims, Iterable) else (dims,)))


def check_one_dtype(model: Model) -> None:
    """Check that the model's parameters share one (real) dtype: the tables and the step compute in it.

    :raises ValueError: naming the parameters of each dtype (e.g. entity tables of float64 built by
        ``entity_representations_kwargs=dict(dtype=torch.float64)`` beside float32 relations)
    """
    by_dtype: dict[str, list[str]] = {}
    for name, parameter in model.named_parameters():
        if parameter.is_floating_point() or parameter.is_complex():
            by_dtype.setdefault(str(parameter.dtype.to_real()), []).append(name)
    if len(by_dtype) > 1:
        described = "; ".join(f"{dtype}: {', '.join(names[:3])}" for dtype, names in sorted(by_dtype.items()))
        raise ValueError(
            f"{type(model).__name__} mixes parameter dtypes ({described}), and BESS trains a model of one dtype. "
            f"Give every representation the same dtype, or build the model under torch.set_default_dtype(...)."
        )


def _row_mean(regularizer: Regularizer) -> bool:
    """Whether a regularizer's term is the mean of one value per row (what BESS's step weighs by rows)."""
    if isinstance(regularizer, NoRegularizer):
        return True
    if type(regularizer).forward is CombinedRegularizer.forward:
        return all(_row_mean(part) for part in cast(Any, regularizer).regularizers)
    per_row = type(regularizer).forward in (LpRegularizer.forward, PowerSumRegularizer.forward)
    return per_row and getattr(regularizer, "dim", None) == -1


def describe_regularizer(regularizer: Regularizer) -> str:
    """Name a regularizer with the settings that decide whether BESS can apply it."""
    dim = getattr(regularizer, "dim", None)
    return f"{type(regularizer).__name__}" + (f"(dim={dim})" if dim is not None else "")


def check_triples_fit_model(triples_factory: CoreTriplesFactory, model: Model) -> None:
    """Check that the training triples use only entity and relation ids the model has.

    :raises ValueError: naming the offending ids (a factory changed after the model was created)
    """
    triples = triples_factory.mapped_triples
    if triples.ndim != 2 or triples.shape[1] != 3:
        raise ValueError(f"triples_factory.mapped_triples must have shape [n, 3], but has {list(triples.shape)}.")
    if triples.shape[0] == 0:
        raise ValueError("triples_factory holds no training triples.")
    problems = []
    for name, ids, upper in (
        ("entity", triples[:, [0, 2]], model.num_entities),
        ("relation", triples[:, 1], model.num_real_relations),
    ):
        bad = ids[(ids < 0) | (ids >= upper)]
        if bad.numel():
            problems.append(f"{name} ids outside [0, {upper}) such as {bad.unique()[:5].tolist()}")
    if problems:
        raise ValueError(
            f"The training triples contain {' and '.join(problems)}: they do not fit the model (was the triples "
            f"factory changed after the model was created?)."
        )


def check_model_dtype(model: Model, table_dtypes: set[torch.dtype], after_reset: bool = False) -> None:
    """Check that the model's parameters still have the shard tables' (real) dtype.

    The loop copies the entity tables when it is built: a model converted afterwards (``model.double()``)
    would meet float32 tables inside the first step. PyKEEN's re-initialisation of a fresh training may
    draw a parameter in the default dtype again (QuatE's relations after ``model.double()``), which would
    train in mixed precision (PyKEEN's own loop fails on it).

    :param after_reset: the check follows the model's re-initialisation (the message says so)
    :raises ValueError: naming both dtypes
    """
    model_dtypes = {p.dtype.to_real() for p in model.parameters() if p.is_floating_point() or p.is_complex()}
    changed = sorted(str(dtype) for dtype in model_dtypes - table_dtypes)
    if changed and after_reset:
        names = [name for name, p in model.named_parameters() if str(p.dtype.to_real()) in changed]
        raise ValueError(
            f"The model's re-initialisation (reset_parameters_, at the start of a fresh training) drew "
            f"{', '.join(names)} as {', '.join(changed)}, but the loop's entity tables are "
            f"{', '.join(sorted(map(str, table_dtypes)))}. Create and train the model under "
            f"torch.set_default_dtype(...) of the tables' dtype instead of converting it."
        )
    if changed:
        raise ValueError(
            f"The model's parameters are {', '.join(changed)}, but the loop's entity tables "
            f"{', '.join(sorted(map(str, table_dtypes)))}: the model changed its dtype after the loop was built. "
            f"Convert the model first (model.double(), .to(dtype)), then build the loop."
        )
