"""PyKEEN models for the BESS scoring functions that PyKEEN lacks: InterHT and TranS.

The models are module-level :class:`~pykeen.models.ERModel` subclasses (unlike models built with
``ERModel(interaction=...)``, they can be pickled, e.g. by
:meth:`pykeen.pipeline.PipelineResult.save_to_directory`). They follow BESS-KGE's defaults: two
entity vectors, each L2-normalised when it is looked up, and uniform initialisation on
``[-1/d, 1/d]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from class_resolver import OneOrManyOptionalKwargs
from pykeen.constants import DEFAULT_EMBEDDING_HPO_EMBEDDING_DIM_RANGE
from pykeen.losses import Loss, NSSALoss
from pykeen.nn.init import initializer_resolver
from pykeen.models import ERModel
from pykeen.typing import Hint, Initializer, Normalizer
from torch.nn import functional
from torch.nn.init import uniform_

from .interactions import InterHTInteraction, TranSInteraction

__all__ = [
    "InterHT",
    "TranS",
]


def _uniform_kwargs(
    initializer: Hint[Initializer], kwargs: Mapping[str, Any] | None, embedding_dim: int
) -> dict[str, Any] | None:
    """Default :func:`torch.nn.init.uniform_` to BESS-KGE's ``init_KGE_uniform`` range ``[-1/d, 1/d]``.

    The initializer given by name (``"uniform"``, as in a configuration file) is the same function.
    """
    kwargs = dict(kwargs or {})
    if isinstance(initializer, str) and initializer.strip():
        initializer = initializer_resolver.lookup(initializer)
    if initializer is uniform_:
        kwargs.setdefault("a", -1.0 / embedding_dim)
        kwargs.setdefault("b", 1.0 / embedding_dim)
    return kwargs or None


def _merge_kwargs(defaults: Sequence[dict[str, Any]], overrides: OneOrManyOptionalKwargs) -> list[dict[str, Any]]:
    """Update each representation's default kwargs by one mapping (for all) or one mapping per representation."""
    if overrides is None:
        return list(defaults)
    if isinstance(overrides, Mapping):
        overrides = [overrides] * len(defaults)
    if len(overrides) != len(defaults):
        raise ValueError(f"Expected {len(defaults)} representation kwargs, got {len(overrides)}.")
    return [{**default, **(override or {})} for default, override in zip(defaults, overrides)]


class _TwoVectorEntityModel(ERModel):
    """Shared construction of :class:`InterHT` and :class:`TranS`.

    Entities: two ``d``-dimensional embeddings (main and auxiliary), each normalised by the entity
    normalizer; relations: :attr:`num_relation_vectors` ``d``-dimensional embeddings.
    """

    #: the interaction class
    interaction_cls: ClassVar[type[InterHTInteraction | TranSInteraction]]
    #: the number of relation vectors
    num_relation_vectors: ClassVar[int]

    #: The default strategy for optimizing the model's hyper-parameters
    hpo_default: ClassVar[Mapping[str, Any]] = {
        "embedding_dim": DEFAULT_EMBEDDING_HPO_EMBEDDING_DIM_RANGE,
        "p": {"type": int, "low": 1, "high": 2},
    }

    #: the default loss function is the self-adversarial negative sampling loss
    loss_default: ClassVar[type[Loss]] = NSSALoss
    #: The default parameters for the default loss function class
    loss_default_kwargs: ClassVar[Mapping[str, Any] | None] = {
        "margin": 6.0,
        "adversarial_temperature": 1.0,
        "reduction": "mean",
    }

    #: The default entity normalizer parameters: unit L2 length, as BESS-KGE's ``normalize_entities``
    default_entity_normalizer_kwargs: ClassVar[Mapping[str, Any]] = {"p": 2, "dim": -1}

    def __init__(
        self,
        *,
        embedding_dim: int = 200,
        p: int = 2,
        power_norm: bool = False,
        u: float | None = 1.0,
        entity_initializer: Hint[Initializer] = uniform_,
        entity_initializer_kwargs: Mapping[str, Any] | None = None,
        entity_normalizer: Hint[Normalizer] = functional.normalize,
        entity_normalizer_kwargs: Mapping[str, Any] | None = None,
        relation_initializer: Hint[Initializer] = uniform_,
        relation_initializer_kwargs: Mapping[str, Any] | None = None,
        entity_representations_kwargs: OneOrManyOptionalKwargs = None,
        relation_representations_kwargs: OneOrManyOptionalKwargs = None,
        **kwargs,
    ) -> None:
        r"""Initialize the model.

        :param embedding_dim: the dimension $d$ of every entity and relation vector
        :param p: the norm used with :func:`torch.linalg.vector_norm`, typically 1 or 2
        :param power_norm: whether to use the ``p``-th power of the $L_p$ norm
        :param u: the scalar offset added to the auxiliary entity vectors (``None`` or 0 disables it)
        :param entity_initializer: the entity initializer; :func:`torch.nn.init.uniform_` defaults to
            the range $[-1/d, 1/d]$
        :param entity_initializer_kwargs: keyword arguments of the entity initializer
        :param entity_normalizer: the normalizer applied to both entity vectors when they are looked
            up; ``None`` disables it
        :param entity_normalizer_kwargs: keyword arguments of the entity normalizer; defaults to unit
            L2 length over the last dimension
        :param relation_initializer: the relation initializer; :func:`torch.nn.init.uniform_` defaults
            to the range $[-1/d, 1/d]$
        :param relation_initializer_kwargs: keyword arguments of the relation initializer
        :param entity_representations_kwargs: overrides of the two entity representations' keyword
            arguments: one mapping for both, or one per representation (main, auxiliary)
        :param relation_representations_kwargs: overrides of the relation representations' keyword
            arguments: one mapping for all, or one per representation
        :param kwargs: remaining keyword arguments passed through to :class:`~pykeen.models.ERModel`
        """
        entity = {
            "shape": embedding_dim,
            "initializer": entity_initializer,
            "initializer_kwargs": _uniform_kwargs(entity_initializer, entity_initializer_kwargs, embedding_dim),
            "normalizer": entity_normalizer,
            "normalizer_kwargs": {**self.default_entity_normalizer_kwargs, **(entity_normalizer_kwargs or {})}
            if entity_normalizer is not None
            else None,
        }
        relation = {
            "shape": embedding_dim,
            "initializer": relation_initializer,
            "initializer_kwargs": _uniform_kwargs(relation_initializer, relation_initializer_kwargs, embedding_dim),
        }
        super().__init__(
            interaction=self.interaction_cls,
            interaction_kwargs={"u": u, "p": p, "power_norm": power_norm},
            entity_representations_kwargs=_merge_kwargs([entity, dict(entity)], entity_representations_kwargs),
            relation_representations_kwargs=_merge_kwargs(
                [dict(relation) for _ in range(self.num_relation_vectors)], relation_representations_kwargs
            ),
            **kwargs,
        )


class InterHT(_TwoVectorEntityModel):
    r"""An implementation of InterHT from [wang2022]_.

    Entities are represented by a main and an auxiliary vector $\mathbf{e}, \mathbf{e}_a \in \mathbb{R}^d$,
    both normalised to unit L2 length, relations by a vector $\mathbf{r} \in \mathbb{R}^d$, all stored
    in :class:`~pykeen.nn.representation.Embedding` matrices. The representations are passed to
    :class:`~pykeen_bess.nn.interactions.InterHTInteraction`:

    .. math::

        f(h, r, t) = -\|\mathbf{h} \odot (\mathbf{t}_a + u) - \mathbf{t} \odot (\mathbf{h}_a + u)
                       + \mathbf{r}\|_p

    .. seealso::

        - Authors' implementation: https://github.com/destwang/InterHT
        - BESS-KGE's ``besskge.scoring.InterHT``

    ---
    citation:
        author: Wang
        year: 2022
        link: https://arxiv.org/abs/2202.04897
        arxiv: 2202.04897
        github: destwang/InterHT
    """

    interaction_cls = InterHTInteraction
    num_relation_vectors = 1


class TranS(_TwoVectorEntityModel):
    r"""An implementation of TranS from [zhang2022]_.

    Entities are represented by a main and a "tilde" vector $\mathbf{e}, \tilde{\mathbf{e}} \in \mathbb{R}^d$,
    both normalised to unit L2 length, relations by three vectors
    $\mathbf{r}, \bar{\mathbf{r}}, \hat{\mathbf{r}} \in \mathbb{R}^d$, all stored in
    :class:`~pykeen.nn.representation.Embedding` matrices. The representations are passed to
    :class:`~pykeen_bess.nn.interactions.TranSInteraction`:

    .. math::

        f(h, r, t) = -\|\mathbf{h} \odot (\tilde{\mathbf{t}} + u + \bar{\mathbf{r}})
                       - \mathbf{t} \odot (\tilde{\mathbf{h}} + u - \hat{\mathbf{r}}) + \mathbf{r}\|_p

    .. seealso:: BESS-KGE's ``besskge.scoring.TranS``

    ---
    citation:
        author: Zhang
        year: 2022
        link: https://arxiv.org/abs/2204.08401
        arxiv: 2204.08401
    """

    interaction_cls = TranSInteraction
    num_relation_vectors = 3
