"""Stage 5 of the pipeline: fast scoring of queries against *shared* candidates.

Modules: :mod:`~pykeen_bess.scoring.base` (the scorer interface, shared math),
:mod:`~pykeen_bess.scoring.products` (inner-product interactions),
:mod:`~pykeen_bess.scoring.distances` (norm-based interactions), :mod:`~pykeen_bess.scoring.fallback`
(the exact broadcast fallback, PyKEEN's clamping wrapper); :func:`get_scorer` picks the scorer.

In BESS every positive of a block is scored against the same ``K`` negative entities, and in
evaluation every query is scored against all entities of a shard. PyKEEN's interactions answer
"B queries x K shared candidates" by broadcasting to a ``[B, K, d]`` intermediate, which is
100-200x slower than a matrix product for DistMult, TransE or RotatE. A
:class:`SharedCandidateScorer` splits an interaction into

* :meth:`~SharedCandidateScorer.query`: per-query features, ``[*, q]``, computed from the known
  entity and the relation (``(h, r)`` when tails are predicted, ``(r, t)`` when heads are);
* :meth:`~SharedCandidateScorer.candidates`: per-candidate features, ``[*, c]``;
* :meth:`~SharedCandidateScorer.score`: ``[*B, b, q] x [*B, k, c] -> [*B, b, k]``, a batched
  matrix product (inner-product models, L2 distances by norm expansion) or a memory-bounded
  chunked computation (L1 distances).

Queries and candidates are single tensors so that the exchange stage can move them between
workers (score-moving all-gathers the queries). Scores equal PyKEEN's own interaction on the same
parameters up to floating point rounding (see ``tests/scoring/test_scoring.py``).

Representations are passed exactly as :meth:`pykeen.models.ERModel._get_representations` returns
them: one tensor, or a tuple of tensors for interactions with several entity or relation
representations; complex-valued tensors for ComplEx and RotatE.

Use :func:`get_scorer` to obtain the scorer of an interaction instance.

Formulations (``q``: query vector, ``c``: candidate vector, ``R(.)``: real view of a complex vector):

* inner products (DistMult, ComplEx, RESCAL, SimplE, CP, DistMA, TransF): ``score = <f(q), g(c)>``,
  one matrix product;
* translations ``-||q - c||_p`` (TransE, UM, RotatE tails): for ``p=2`` the norm expansion
  ``|q|^2 - 2 <q, c> + |c|^2`` as one matrix product of ``[-2q, |q|^2, 1]`` and ``[c, 1, |c|^2]``;
  ``p=1`` by :func:`torch.cdist`; other ``p`` chunked;
* sums of elementwise products ``-||q_0 + sum_k q_k * c_k||_p`` (RotatE heads, PairRE, TripleRE,
  LineaRE, InterHT, TranS): for ``p=2`` the expansion of the squared norm into inner products of
  query and candidate features (:func:`product_sum_query_features`), other ``p`` chunked.

The chunked exact computation (:func:`chunked_pairwise`) materialises the explicit
``[*B, b', k', d]`` difference for blocks of queries and candidates with at most
:data:`MAX_CHUNK_ELEMENTS` elements, and recomputes the blocks in the backward pass (activation
checkpointing) so that training memory stays bounded too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import torch
from pykeen.nn.modules import ClampedInteraction, Interaction

from .base import (
    MAX_CHUNK_ELEMENTS,
    SIDES,
    SharedCandidateScorer,
    Side,
    chunked_pairwise,
    difference_candidate_features,
    difference_query_features,
    product_sum_candidate_features,
    product_sum_query_features,
)
from .distances import (
    NormScorer,
    DifferenceScorer,
    ProductSumScorer,
    TransEScorer,
    UMScorer,
    RotatEScorer,
    PairREScorer,
    LineaREScorer,
    TripleREScorer,
    InterHTScorer,
    TranSScorer,
)
from .fallback import BroadcastScorer, ClampedScorer
from .products import (
    InnerProductScorer,
    DistMultScorer,
    ComplExScorer,
    RESCALScorer,
    SimplEScorer,
    CPScorer,
    DistMAScorer,
    TransFScorer,
)


__all__ = [
    "MAX_CHUNK_ELEMENTS",
    "SCORERS",
    "SIDES",
    "BroadcastScorer",
    "CPScorer",
    "ClampedScorer",
    "ComplExScorer",
    "DifferenceScorer",
    "DistMAScorer",
    "DistMultScorer",
    "InnerProductScorer",
    "InterHTScorer",
    "LineaREScorer",
    "NormScorer",
    "PairREScorer",
    "ProductSumScorer",
    "RESCALScorer",
    "RotatEScorer",
    "SharedCandidateScorer",
    "Side",
    "SimplEScorer",
    "TranSScorer",
    "TransEScorer",
    "TransFScorer",
    "TripleREScorer",
    "UMScorer",
    "chunked_pairwise",
    "difference_candidate_features",
    "difference_query_features",
    "get_scorer",
    "product_sum_candidate_features",
    "product_sum_query_features",
    "register_scorer",
    "representation_spec",
    "supported_interactions",
]

logger = logging.getLogger(__name__)

# -- registry ----------------------------------------------------------------------------------

#: fast scorers by interaction class
SCORERS: dict[type[Interaction], type[SharedCandidateScorer]] = {}
#: interactions whose slow fallback was announced (a warning once per process)
_WARNED_FALLBACKS: set[str] = set()


def register_scorer(scorer_cls: type[SharedCandidateScorer]) -> type[SharedCandidateScorer]:
    """Register a fast scorer for the interaction classes it lists (usable as a decorator)."""
    for interaction_cls in scorer_cls.interactions:
        SCORERS[interaction_cls] = scorer_cls
    return scorer_cls


def supported_interactions() -> list[str]:
    """Return the names of the interactions with a fast scorer."""
    return sorted(cls.__name__ for cls in SCORERS)


def representation_spec(representation: torch.nn.Module) -> tuple[tuple[int, ...], bool]:
    """Return ``(shape, is_complex)`` of a PyKEEN representation module."""
    is_complex = bool(getattr(representation, "is_complex", False))
    return tuple(cast(Any, representation).shape), is_complex


def get_scorer(
    interaction: Interaction,
    *,
    entity_representations: Sequence[torch.nn.Module] | None = None,
    relation_representations: Sequence[torch.nn.Module] | None = None,
    allow_slow: bool = True,
) -> SharedCandidateScorer:
    """Return the shared-candidate scorer for an interaction instance.

    The scorer is looked up by the interaction's exact class: a subclass may change ``forward``, so
    it does not inherit its parent's fast scorer unless registered itself. Interactions without a
    fast scorer get the exact but slow :class:`BroadcastScorer`, which needs the model's
    representations to know their shapes.

    :param interaction: the interaction instance
    :param entity_representations: the model's entity representations (for the fallback)
    :param relation_representations: the model's relation representations (for the fallback)
    :param allow_slow: whether to fall back to :class:`BroadcastScorer`
    :returns: the scorer
    :raises NotImplementedError: if there is no fast scorer and the fallback is not allowed or
        not possible
    """
    if type(interaction) is ClampedInteraction:
        base = get_scorer(
            interaction.base,
            entity_representations=entity_representations,
            relation_representations=relation_representations,
            allow_slow=allow_slow,
        )
        return ClampedScorer(interaction, base)
    scorer_cls = SCORERS.get(type(interaction))
    if scorer_cls is not None:
        return scorer_cls(interaction)
    if not allow_slow or entity_representations is None or relation_representations is None:
        raise NotImplementedError(
            f"There is no fast shared-candidate scorer for {type(interaction).__name__}. Supported interactions: "
            f"{', '.join(supported_interactions())}."
        )
    name = type(interaction).__name__
    if name not in _WARNED_FALLBACKS:  # once per interaction and process (training and evaluation both ask)
        _WARNED_FALLBACKS.add(name)
        logger.warning(
            "No fast shared-candidate scorer for %s: training scores with the exact but slow chunked broadcast "
            "fallback (evaluation ranks by PyKEEN's own score rows where one process holds the whole model).",
            name,
        )
    return BroadcastScorer(
        interaction,
        entity_specs=[representation_spec(rep) for rep in entity_representations],
        relation_specs=[representation_spec(rep) for rep in relation_representations],
    )


for _scorer_cls in (
    DistMultScorer,
    ComplExScorer,
    RESCALScorer,
    SimplEScorer,
    CPScorer,
    DistMAScorer,
    TransFScorer,
    TransEScorer,
    UMScorer,
    RotatEScorer,
    PairREScorer,
    LineaREScorer,
    TripleREScorer,
    InterHTScorer,
    TranSScorer,
):
    register_scorer(_scorer_cls)
