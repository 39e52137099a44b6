"""The encoding (column) partition: every process holds all entities, ``d / c`` coordinates of each.

The *encoding strategy* of host-embedding designs splits the coordinates of every row over ``c`` column parts instead
of splitting the rows (the *token strategy*, BESS's shards). For an interaction whose score is
``g(sum_i f(h_i, r_i, t_i))`` over coordinates ``i`` ("column-separable"), every part scores its
coordinates, one sum over the parts gives the full score
(:meth:`~pykeen_bess.distributed.Topology.column_sum`, whose backward is the identity), and no
row ever moves. This module holds what that needs, written once for logical parts in one
process and for one part per rank:

* :class:`ColumnSplit`: which coordinates part ``k`` holds (near-equal parts, any ``d``);
* :class:`SeparableScoring`: the partial scorer of an interaction (norms as power sums) and how
  the summed partial scores become scores (``-(-s)^(1/p)``); a clear error for interactions that
  are not separable;
* :class:`ColumnNorm`, :class:`~pykeen_bess.tables.column_regularizer.ColumnRegularizer`: constrainers /
  normalizers (unit or clamped L2 norm) and Lp / power-sum regularizers of rows whose coordinates are spread
  over processes, with the row norms summed over the parts;
* :func:`column_embedding`: the embedding of one part of a table, initialised with the part's
  coordinates of exactly the values a whole table gets from the same seed;
* :func:`rows_from_columns`: after training on several processes, the column parts become row
  shards (one all-to-all), so the model is evaluated, queried and exported as any sharded model.

Complex coordinates (ComplEx, RotatE) and the paired axes of a coordinate stay together: the
split runs along the first axis of every representation's shape.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pykeen.models import ERModel
from pykeen.nn.init import PretrainedInitializer
from pykeen.nn.modules import (
    ComplExInteraction,
    CPInteraction,
    DistMAInteraction,
    DistMultInteraction,
    Interaction,
    LineaREInteraction,
    PairREInteraction,
    RotatEInteraction,
    SimplEInteraction,
    TransEInteraction,
    TripleREInteraction,
    UMInteraction,
)
from pykeen.nn.representation import Embedding
from pykeen.regularizers import NoRegularizer
from pykeen.utils import clamp_norm, complex_normalize

from ..nn.interactions import InterHTInteraction, TranSInteraction
from ..scoring import SharedCandidateScorer, Side, get_scorer
from ..scoring.base import squared_modulus
from .column_regularizer import ColumnRegularizer

__all__ = [
    "INNER_PRODUCT_INTERACTIONS",
    "NORM_INTERACTIONS",
    "ColumnNorm",
    "ColumnRegularizer",
    "ColumnSplit",
    "SeparableScoring",
    "check_encoding_model",
    "column_embedding",
    "columns_from_rows",
    "columns_of_rows",
    "rows_from_columns",
    "rows_of_columns",
    "slice_columns",
]

#: interactions whose score is a sum over coordinates
INNER_PRODUCT_INTERACTIONS: tuple[type[Interaction], ...] = (
    DistMultInteraction,
    ComplExInteraction,
    SimplEInteraction,
    CPInteraction,
    DistMAInteraction,
)
#: interactions whose score is ``-||x||_p`` (or ``-||x||_p^p``) of a coordinate-wise ``x``
NORM_INTERACTIONS: tuple[type[Interaction], ...] = (
    TransEInteraction,
    UMInteraction,
    RotatEInteraction,
    PairREInteraction,
    TripleREInteraction,
    LineaREInteraction,
    InterHTInteraction,
    TranSInteraction,
)


@dataclasses.dataclass(frozen=True)
class ColumnSplit:
    """``dim`` coordinates in ``n_part`` consecutive parts of near-equal size (the first ``dim % n`` one larger)."""

    #: the number of coordinates of a row (the first axis of the representations' shape)
    dim: int
    #: the number of column parts
    n_part: int

    def __post_init__(self) -> None:
        if not 1 <= self.n_part <= self.dim:
            raise ValueError(
                f"The encoding partition splits the {self.dim} coordinates of every row into {self.n_part} "
                f"parts; use at most {self.dim} parts."
            )

    @property
    def sizes(self) -> list[int]:
        """The number of coordinates of every part."""
        return [len(part) for part in np.array_split(np.arange(self.dim), self.n_part)]

    def bounds(self, part: int) -> tuple[int, int]:
        """Return the coordinates ``[start, stop)`` of a part."""
        sizes = self.sizes
        start = sum(sizes[:part])
        return start, start + sizes[part]


def slice_columns(x: torch.Tensor, shape: Sequence[int], start: int, stop: int) -> torch.Tensor:
    """Take coordinates ``[start, stop)`` of representations ``[*, *shape]`` along the first axis of ``shape``."""
    return x.narrow(x.ndim - len(shape), start, stop - start)


def check_encoding_model(model: ERModel, partial_scores: bool = True) -> int:
    """Check that a model can be trained column-partitioned; return its number of coordinates ``d``.

    :param model: the model
    :param partial_scores: check what partial scores need (:class:`~pykeen_bess.schemes.EncodingScheme`:
        a separable interaction, relations split like the entities); else only that the entity
        tables can be split (:class:`~pykeen_bess.schemes.EncodingLookupScheme` assembles whole rows)
    :raises ValueError: naming what is not separable (the interaction, a representation's shape,
        dropout) and the alternatives
    """
    representations = list(model.entity_representations)
    if partial_scores:
        SeparableScoring.check(model.interaction)
        representations += list(model.relation_representations)
    shapes = {tuple(r.shape) for r in representations}
    dims = {shape[0] for shape in shapes if shape}
    if len(dims) != 1 or any(not shape for shape in shapes):
        which = "entities and relations" if partial_scores else "the entity representations"
        raise ValueError(
            f"partition='encoding' splits the first axis of every representation, which must be the same for "
            f"{which}; this model's shapes are {sorted(shapes)}. Use partition='token'."
        )
    if any(getattr(r, "dropout", None) is not None for r in model.entity_representations):
        raise ValueError("partition='encoding' does not support entity dropout (its masks depend on the parts).")
    return dims.pop()


class SeparableScoring:
    """Partial scores of a column part, and how the sum of all parts' partial scores becomes the score.

    Inner-product interactions: the partial score is the interaction on the part's coordinates
    and the score is the sum. Norm interactions ``-||x||_p``: the partial score is
    ``-sum_i |x_i|^p`` over the part (the interaction with ``power_norm=True``) and the score is
    ``-(-s)^(1/p)`` (``s`` itself for ``power_norm=True`` or ``p = 1``).
    """

    def __init__(self, model: ERModel):
        """Build the partial scorer of a model's interaction (checked by :meth:`check`)."""
        interaction = self.check(model.interaction)
        self.p: float = 1.0
        self.root = False
        #: RotatE's own forward always returns ``-||x||_2`` (PyKEEN ignores its ``power_norm``)
        self.fixed_norm = isinstance(interaction, RotatEInteraction)
        partial = interaction
        if isinstance(interaction, NORM_INTERACTIONS):
            norm: Any = interaction
            self.p = 2.0 if self.fixed_norm else float(norm.p)
            self.root = self.fixed_norm or (not norm.power_norm and self.p != 1.0)
            partial = copy.copy(interaction)  # shares the parameters; scores power sums
            partial.power_norm = True  # type: ignore[assignment]
        #: the interaction of a part's coordinates (PyKEEN's forward, for aligned triples)
        self.partial = partial
        #: the scorer of a part's coordinates
        self.scorer: SharedCandidateScorer = get_scorer(
            partial,
            entity_representations=model.entity_representations,
            relation_representations=model.relation_representations,
            allow_slow=False,
        )
        if isinstance(interaction, NORM_INTERACTIONS) and not getattr(self.scorer, "power_norm", True):
            self.scorer.power_norm = True  # type: ignore[attr-defined]  # a scorer with a fixed norm (RotatE's)

    @staticmethod
    def check(interaction: Interaction) -> Interaction:
        """Return the interaction if it is column-separable.

        :raises ValueError: naming the separable interactions and ``partition='token'``
        """
        separable = isinstance(interaction, (*INNER_PRODUCT_INTERACTIONS, *NORM_INTERACTIONS)) and type(
            interaction
        ) in (*INNER_PRODUCT_INTERACTIONS, *NORM_INTERACTIONS)
        p = getattr(interaction, "p", 1)
        if separable and isinstance(interaction, NORM_INTERACTIONS) and not isinstance(interaction, RotatEInteraction):
            separable = isinstance(p, (int, float)) and 0 < p < math.inf
        if not separable:
            names = ", ".join(
                cls.__name__.removesuffix("Interaction") for cls in (*INNER_PRODUCT_INTERACTIONS, *NORM_INTERACTIONS)
            )
            raise ValueError(
                f"exchange='encoding' (partial scores) needs a column-separable interaction (a score summed over "
                f"coordinates, or a finite p-norm of one); {type(interaction).__name__} (p={p!r}) is not. Separable: "
                f"{names}. For other interactions use exchange='encoding_lookup' (whole rows assembled from the "
                f"column parts) or partition='token' (exchange='embedding' or 'score')."
            )
        return interaction

    def positive(self, h: Any, r: Any, t: Any) -> torch.Tensor:
        """Partial scores of aligned triples ``[*]`` by PyKEEN's own interaction (as the token schemes score them)."""
        scores = self.partial(h=h, r=r, t=t)
        return -scores.square() if self.fixed_norm else scores

    def negative(self, side: Side, known: Any, r: Any, candidates: Any) -> torch.Tensor:
        """Partial scores ``[*B, b, K]`` of queries ``[*B, b]`` against shared candidates ``[*B, K]``."""
        return self.scorer.score(side, self.scorer.query(side, known, r), self.scorer.candidates(side, candidates))

    def finish(self, total: torch.Tensor) -> torch.Tensor:
        """Turn the sum of all parts' partial scores into scores."""
        if not self.root:
            return total
        eps = torch.finfo(total.dtype).eps
        return -(((-total).clamp_min(eps**self.p)) ** (1.0 / self.p))


def _function_of(callable_: Any) -> tuple[Any, dict[str, Any]]:
    """Return the function and keyword arguments of a (partially applied) constrainer / normalizer."""
    if isinstance(callable_, functools.partial):
        return callable_.func, dict(callable_.keywords)
    return callable_, {}


class ColumnNorm:
    """A constrainer or normalizer of rows whose coordinates are spread over column parts.

    ``normalize`` (unit L2 norm) and ``clamp_norm`` (L2 norm at most ``maxnorm``) need the norm of
    the whole row: the parts' squared norms are summed (:meth:`Topology.column_sum`) first.
    ``complex_normalize`` acts per coordinate and runs as it is.
    """

    def __init__(self, function: Any, topology: Any, role: str):
        """Wrap a constrainer / normalizer (``role`` names it in errors).

        :raises ValueError: for functions that are not per coordinate or an L2 row norm
        """
        self.function = function
        self.topology = topology
        base, kwargs = _function_of(function)
        self.kind = {
            torch.nn.functional.normalize: "normalize",
            clamp_norm: "clamp",
            complex_normalize: "coordinate",
        }.get(base)
        p = kwargs.get("p", 2 if base is torch.nn.functional.normalize else "fro")
        if self.kind is None or p not in (2, 2.0, "fro") or kwargs.get("dim", -1) not in (-1, 1):
            raise ValueError(
                f"partition='encoding' over several processes supports the {role}s normalize, clamp_norm (L2) and "
                f"complex_normalize, not {function!r}; use partition='token'."
            )
        self.maxnorm = kwargs.get("maxnorm")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Apply to rows ``[*, d_part]`` of this process' column part."""
        if self.kind == "coordinate":
            return self.function(x)
        squared = squared_modulus(x).sum(dim=-1)
        norm = self.topology.column_sum(squared.unsqueeze(0)).sqrt().unsqueeze(-1)
        if self.kind == "normalize":
            return x / norm.clamp_min(1e-12)
        mask = (norm < self.maxnorm).to(norm.dtype)
        return mask * x + (1 - mask) * (x / norm.clamp_min(torch.finfo(norm.dtype).eps) * self.maxnorm)


class _PartInitializer(PretrainedInitializer):
    """The values of one column part: the part's coordinates of the whole table's initial values.

    :attr:`tensor` is drawn when the table is reset, not kept.
    """

    def __init__(self, embedding: Embedding, split: ColumnSplit, part: int, seed: int, table_index: int):
        self.embedding = embedding
        self.split = split
        self.part = part
        self.seed = seed
        self.table_index = table_index

    @property  # type: ignore[override,unused-ignore]
    def tensor(self) -> torch.Tensor:  # type: ignore[override,unused-ignore]
        """Draw the whole table as a token table from the same seed does, and keep the part's coordinates."""
        from .representation import draw_full_table

        full = draw_full_table(self.embedding, self.seed, self.table_index)
        start, stop = self.split.bounds(self.part)
        rows = full.view(full.shape[0], self.split.dim, -1)[:, start:stop]
        return rows.reshape(full.shape[0], -1)


def column_embedding(
    embedding: Embedding, split: ColumnSplit, part: int, topology: Any, seed: int, table_index: int
) -> Embedding:
    """Return the embedding of one column part of a table, for a process holding only that part.

    Its initial values are the part's coordinates of the whole table's (the same seed); its
    constrainer, normalizer and regularizer see whole rows through column sums; dropout is refused
    (:func:`check_encoding_model`).
    """
    start, stop = split.bounds(part)
    weight = embedding._embeddings.weight
    dtype = weight.dtype
    if embedding.is_complex:
        dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    shape = (stop - start, *embedding.shape[1:])
    with torch.random.fork_rng(devices=[]):  # torch's own initialisation of the placeholder must not draw
        result = Embedding(max_id=0, shape=shape, dtype=dtype, trainable=weight.requires_grad)
    result.max_id = embedding.max_id
    result._embeddings.weight.data = result._embeddings.weight.data.to(weight.device)  # [0, width]: never used
    result.initializer = _PartInitializer(embedding, split, part, seed, table_index)
    result.constrainer = (
        None if embedding.constrainer is None else ColumnNorm(embedding.constrainer, topology, "constrainer")
    )
    result.normalizer = (
        None if embedding.normalizer is None else ColumnNorm(embedding.normalizer, topology, "normalizer")
    )
    regularizer = embedding.regularizer
    if regularizer is not None and not isinstance(regularizer, NoRegularizer):
        result.regularizer = ColumnRegularizer(regularizer, topology, split.dim)
    return result


def rows_of_columns(
    values: torch.Tensor, entity_rows: torch.Tensor, ids: torch.Tensor, topology: Any, split: ColumnSplit, inner: int
) -> torch.Tensor:
    """Move a per-row tensor from column parts to row shards: one all-to-all, each process gets whole rows.

    :param values: shape: ``[R, size_k * inner]``, this process' column part ``k`` of every row (a table,
        or an optimizer state of the table's shape), row of entity ``e`` at ``entity_rows[e]``
    :param entity_rows: shape: ``[num_entities]``, the row of every entity in ``values``
    :param ids: shape: ``[c, S]``, the entities of every row shard (process), -1 for padding
    :param topology: the token topology of the row shards (the process of shard ``k`` holds column part ``k``)
    :param split: the column split
    :param inner: the stored values per coordinate (e.g. 2 for a complex coordinate)
    :returns: shape: ``[S, dim * inner]``, this process' row shard (zeros in padding rows)
    """
    picked = values[entity_rows[ids.clamp_min(0)].view(-1)].view(*ids.shape, -1)  # [c, S, size_k * inner]
    picked = picked * (ids >= 0).unsqueeze(-1).to(picked.dtype)
    width = max(split.sizes) * inner
    padded = torch.nn.functional.pad(picked, (0, width - picked.shape[-1]))
    received = topology.all_to_all(padded.unsqueeze(0))[0]  # [c (column part), S, width]
    return torch.cat([received[part, :, : size * inner] for part, size in enumerate(split.sizes)], dim=-1)


def columns_of_rows(
    values: torch.Tensor, ids: torch.Tensor, topology: Any, split: ColumnSplit, part: int, inner: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a per-row tensor from row shards to column parts: the inverse of :func:`rows_of_columns`.

    :param values: shape: ``[S, dim * inner]``, this process' row shard of whole rows
    :param ids: shape: ``[c, S]``, the entities of every row shard (process), -1 for padding
    :param topology: the token topology of the row shards (the process of shard ``k`` holds column part ``k``)
    :param split: the column split
    :param part: the column part of this process
    :param inner: the stored values per coordinate
    :returns: the entities ``[n_real]`` and their coordinates of column part ``part``, ``[n_real, size_part * inner]``
    """
    width = max(split.sizes) * inner
    whole = values.reshape(values.shape[0], split.dim, inner)
    pieces = []
    for column in range(split.n_part):
        start, stop = split.bounds(column)
        piece = whole[:, start:stop].reshape(whole.shape[0], -1)
        pieces.append(torch.nn.functional.pad(piece, (0, width - piece.shape[-1])))
    received = topology.all_to_all(torch.stack(pieces).unsqueeze(0))[0]  # [c (row shard), S, width]
    start, stop = split.bounds(part)
    held = ids >= 0
    return ids[held], received[:, :, : (stop - start) * inner][held.to(received.device)]


def rows_from_columns(
    table: Any,
    embedding: Embedding,
    sharding: Any,
    topology: Any,
    seed: int,
    table_index: int,
    split: ColumnSplit,
    storage: Any = None,
    label_suffix: str = "",
) -> Any:
    """Redistribute a column-partitioned table to row shards: one all-to-all, each process gets whole rows.

    :param table: this process' column part of the table (a :class:`~pykeen_bess.tables.representation.ShardedEmbedding`
        holding all rows)
    :param embedding: the model's embedding of the table (whole rows: shape, constrainer, ...)
    :param sharding: the row sharding to build, one shard per process of ``topology``
    :param topology: the token topology over the same processes (part ``k`` is held by the process of shard ``k``)
    :param seed: the run's seed
    :param table_index: the table's position among the entity representations
    :param split: the column split
    :param storage: the storage tier of the row shard (default: a parameter on the embedding's device)
    :param label_suffix: appended to the row shard's name in its tier (e.g. its replica)
    :returns: a :class:`~pykeen_bess.tables.representation.ShardedEmbedding` of this process' row shard, whole rows
    """
    from .representation import ShardedEmbedding

    rows = ShardedEmbedding(
        embedding,
        sharding,
        topology.local_shards,
        seed=seed,
        table_index=table_index,
        storage=storage,
        label_suffix=label_suffix,
    )
    rows.topology = topology
    with torch.no_grad():
        values = rows_of_columns(
            table.weight.detach(),
            table.entity_rows,
            sharding.shard_entities,
            topology,
            split,
            rows.row_width // split.dim,
        )
        rows.weight.copy_(values.to(rows.weight))
    return rows


def columns_from_rows(table: Any, rows: Any, topology: Any, split: ColumnSplit, part: int) -> None:
    """Fill this process' column part of a table from row shards: the inverse of :func:`rows_from_columns`.

    :param table: this process' column part of the table (a :class:`~pykeen_bess.tables.representation.ShardedEmbedding`
        holding all rows), written in place
    :param rows: this process' row shard of the whole rows (what :func:`rows_from_columns` returned)
    :param topology: the token topology of the row shards (the process of shard ``k`` holds column part ``k``)
    :param split: the column split
    :param part: the column part of this process
    """
    with torch.no_grad():
        ids, values = columns_of_rows(
            rows.weight.detach(), rows.sharding.shard_entities, topology, split, part, rows.row_width // split.dim
        )
        target = table.entity_rows[ids]
        table.weight[target.to(table.weight.device)] = values.to(table.weight)
