"""Stage 4 of the pipeline: exchange schemes, the ways a BESS step moves data between shards.

Every scheme is a subclass of :class:`ExchangeScheme` (:mod:`~pykeen_bess.schemes.base`), which
gathers the step's rows, scores the positives and computes the regularization term; a scheme
adds only how the negatives are scored (:meth:`ExchangeScheme.negative_scores`) and what that
costs in bytes (:meth:`ExchangeScheme.negative_cost`):

* :class:`EmbeddingMovingScheme` (``exchange="embedding"``): negative embeddings move to the heads' shard;
* :class:`ScoreMovingScheme` (``exchange="score"``): queries move to every shard, scores move back;
* :class:`EncodingScheme` (``exchange="encoding"``, the encoding partition of
  :mod:`pykeen_bess.tables.encoding`): every process holds columns of all rows and scores its columns of
  the whole batch; one all-reduce of partial scores, no row moves (column-separable interactions);
* :class:`EncodingLookupScheme` (``exchange="encoding_lookup"``, the encoding partition): whole rows
  are assembled from the column parts (an encoding lookup) and every part scores its
  share of the slots; any interaction.

``exchange="auto"`` picks the registered scheme that sends the fewest bytes per step
(:func:`choose_scheme`), so a new scheme is one new class registered in :data:`scheme_resolver`.
The token schemes give the same scores, losses and gradients (tested); the encoding scheme gives
those of the one-shard plan (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from class_resolver import ClassResolver
from pykeen.models import ERModel

from ..tables.representation import ShardedEmbedding
from ..scoring import SharedCandidateScorer
from .base import ExchangeScheme
from .embedding import EmbeddingMovingScheme
from .encoding import EncodingScheme
from .encoding_lookup import EncodingLookupScheme
from .score import ScoreMovingScheme

__all__ = [
    "AUTO",
    "EmbeddingMovingScheme",
    "EncodingLookupScheme",
    "EncodingScheme",
    "ExchangeScheme",
    "ScoreMovingScheme",
    "canonical_exchange",
    "choose_scheme",
    "exchange_cost",
    "query_width",
    "replica_cost",
    "scheme_names",
    "scheme_resolver",
]

#: the value of ``exchange=`` that picks the cheapest scheme
AUTO = "auto"

#: the registered exchange schemes (looked up by name, e.g. ``"embedding"``, or class)
scheme_resolver: ClassResolver[ExchangeScheme] = ClassResolver(
    [EmbeddingMovingScheme, ScoreMovingScheme, EncodingScheme, EncodingLookupScheme],
    base=ExchangeScheme,  # type: ignore[type-abstract]
    suffix="Scheme",
)


def scheme_names() -> list[str]:
    """Return the short names of the registered schemes, in registration order (``exchange=`` accepts them)."""
    return [cls.get_name() for cls in scheme_resolver]


def exchange_cost(
    scheme: str | type[ExchangeScheme],
    n_shard: int,
    block_size: int,
    num_negs_per_pos: int,
    entity_width: int,
    query_width: int,
    element_size: int = 4,
    shared_negatives: bool = False,
) -> int:
    """Return the bytes one process sends to the others per step (forward pass) with a scheme.

    See :meth:`ExchangeScheme.cost`: both schemes move the positive tails, ``(n - 1) * b * D``;
    ``embedding`` moves the negatives, ``(n - 1) * K * D``; ``score`` gathers the queries,
    ``(n - 1) * n * b * q``, and moves the scores back, ``(n - 1) * b * K``. With negatives shared by
    all blocks of a step (``shared_negatives``, ``negatives="step"``) ``embedding`` all-gathers
    ``(n - 1) * K / n * D``.

    :raises ValueError: for an unknown scheme
    """
    return resolve_scheme(scheme).cost(
        n_shard, block_size, num_negs_per_pos, entity_width, query_width, element_size, shared_negatives
    )


def replica_cost(
    n_shard: int,
    replicas: int,
    replica_block_size: int,
    num_negs_per_pos: int,
    entity_width: int,
    shard_size: int,
    element_size: int = 4,
    eager_dense: bool = False,
    shared_negatives: bool = False,
) -> int:
    """Return the bytes one process sends to its replicas per step to sum its shard's gradients (at most).

    With row-sparse updates the static step (:mod:`~pykeen_bess.training.steps.static_step`) all-gathers
    every row it looked up, duplicates included (a fixed number per step: no host read), its id (8
    bytes), whether a real slot looked it up (1 byte) and its gradient (``D`` values) to the ``R - 1``
    other replicas: ``2 n b'`` heads and tails of its ``b'`` slots in the ``n`` blocks of its row and
    column, plus its share of the negatives, ``n K`` (one set per block) or ``K / n`` (one set per
    step, ``shared_negatives``). The eager step sends only the distinct rows, at most
    ``min(S, ...)`` of a shard of ``S`` rows, and no flags, so this bounds it too. With dense updates
    (``sparse_updates=False``) the static step sends the same (every replica builds the dense gradient
    from all replicas' rows); the eager step (``eager_dense``) all-reduces the whole shard table,
    ``2 (R - 1) / R * S * D`` values (ring all-reduce), and all-gathers the touched rows (to constrain
    them after the update) with a 4-byte flag each. The exchange inside the shard group
    (:func:`exchange_cost`) comes on top, with ``b'`` slots per block.

    :param n_shard: ``n``
    :param replicas: ``R``
    :param replica_block_size: ``b'``, the slots of every block one replica trains (the largest share)
    :param num_negs_per_pos: ``K``, negatives per block and positive
    :param entity_width: ``D``, packed values per entity row
    :param shard_size: ``S``, rows of a shard table
    :param element_size: bytes per value
    :param eager_dense: the eager step's dense updates (default: the static step, or row-sparse updates)
    :param shared_negatives: whether all blocks of a step share one set of negatives
    :returns: bytes sent per process and step
    """
    if replicas == 1:
        return 0
    negatives = num_negs_per_pos // n_shard if shared_negatives else n_shard * num_negs_per_pos
    rows = 2 * n_shard * replica_block_size + negatives
    if eager_dense:
        rows = min(shard_size, rows)
        return 2 * (replicas - 1) * shard_size * entity_width * element_size // replicas + (replicas - 1) * rows * 12
    return (replicas - 1) * rows * (8 + 1 + entity_width * element_size)


def resolve_scheme(scheme: str | type[ExchangeScheme]) -> type[ExchangeScheme]:
    """Look a scheme up by name or class.

    :raises ValueError: naming the registered schemes
    """
    try:
        return scheme_resolver.lookup(scheme)
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"Unknown exchange={scheme!r}; expected one of {(*scheme_names(), AUTO)} or an ExchangeScheme subclass."
        ) from None


def canonical_exchange(exchange: Any) -> Any:
    """Return an ``exchange=`` value as the loop compares it: None, :data:`AUTO` or a registered scheme's name.

    Names are matched as the resolver matches them (``"Auto"``, ``"Encoding"``, ``"EncodingScheme"``); a scheme
    class stays a class.

    :raises ValueError: for an unknown name
    """
    if not isinstance(exchange, str):
        return exchange
    if scheme_resolver.normalize(exchange) == AUTO:
        return AUTO
    return resolve_scheme(exchange).get_name()


def choose_scheme(
    n_shard: int,
    block_size: int,
    num_negs_per_pos: int,
    entity_width: int,
    query_width: int,
    partitions: Sequence[str] = ("token",),
    model: ERModel | None = None,
    shared_negatives: bool = False,
) -> type[ExchangeScheme]:
    """Return the registered scheme that sends the fewest bytes per step; ties: the first registered.

    :param partitions: the entity-table partitions whose schemes are candidates
    :param model: only schemes that can train this model are candidates (e.g. partial scores need a
        column-separable interaction)
    :param shared_negatives: whether all blocks of a step share one set of negatives
    """
    return min(
        (cls for cls in scheme_resolver if cls.partition in partitions and (model is None or cls.applies(model))),
        key=lambda cls: cls.cost(
            n_shard, block_size, num_negs_per_pos, entity_width, query_width, shared_negatives=shared_negatives
        ),
    )


def query_width(scorer: SharedCandidateScorer, model: ERModel, tables: Sequence[ShardedEmbedding]) -> int:
    """Return the number of values of a query (the mean over both sides) for a model's scorer."""
    with torch.no_grad():
        entities = [table.view_rows(table.weight[:1].detach().to(table.compute_device)) for table in tables]
        first_relation = torch.zeros(1, dtype=torch.long, device=tables[0].compute_device)
        relations = [representation(indices=first_relation) for representation in model.relation_representations]
        relation = relations[0] if len(relations) == 1 else tuple(relations)
        widths = []
        for side, indices in (("head", model.interaction.tail_indices), ("tail", model.interaction.head_indices)):
            known = [entities[i] for i in indices]
            query = scorer.query(side, known[0] if len(known) == 1 else tuple(known), relation)  # type: ignore[arg-type]
            widths.append(query.shape[-1] * (2 if query.is_complex() else 1))
    return sum(widths) // len(widths)
