"""Interactions of the BESS scoring functions that PyKEEN lacks: InterHT and TranS.

Both represent an entity by two vectors (a main and an auxiliary one) and score a triple by the
negative ``p``-norm of a translation in which the head is scaled by the tail's auxiliary vector
and vice versa. Their fast shared-candidate scorers are
:class:`pykeen_bess.scoring.InterHTScorer` and :class:`pykeen_bess.scoring.TranSScorer`; the models
are :class:`pykeen_bess.nn.models.InterHT` and :class:`pykeen_bess.nn.models.TranS`.
"""

from __future__ import annotations

from docdata import parse_docdata
from pykeen.nn.modules import NormBasedInteraction
from pykeen.typing import FloatTensor
from pykeen.utils import negative_norm_of_sum

__all__ = [
    "InterHTInteraction",
    "TranSInteraction",
]


class _OffsetNormInteraction(NormBasedInteraction):
    """A norm-based interaction with a scalar offset ``u`` added to the auxiliary entity vectors."""

    def __init__(self, u: float | None = 1.0, p: int = 2, power_norm: bool = False):
        """Initialize the interaction.

        :param u: the scalar offset added to the auxiliary entity vectors; ``None`` (or 0) disables it
        :param p: the norm used with :func:`torch.linalg.vector_norm`, typically 1 or 2
        :param power_norm: whether to use the ``p``-th power of the ``L_p`` norm, ``sum_i |x_i|^p``
        """
        super().__init__(p=p, power_norm=power_norm)
        self.u = u

    @property
    def offset(self) -> float:
        """The offset as a number (0 when disabled)."""
        return self.u or 0.0


@parse_docdata
class InterHTInteraction(_OffsetNormInteraction):
    r"""The InterHT interaction from [wang2022]_.

    Entities are represented by a main and an auxiliary vector, $(\mathbf{e}, \mathbf{e}_a)$ with
    $\mathbf{e}, \mathbf{e}_a \in \mathbb{R}^d$, relations by a vector $\mathbf{r} \in \mathbb{R}^d$.
    The head is scaled by the tail's auxiliary vector and the tail by the head's:

    .. math::

        f(h, r, t) = -\|\mathbf{h} \odot (\mathbf{t}_a + u) - \mathbf{t} \odot (\mathbf{h}_a + u)
                       + \mathbf{r}\|_p

    with a scalar offset $u$ (``u``, default 1). With ``power_norm=True`` the score is
    $-\|\cdot\|_p^p$.

    .. note ::

        For equivalence to the paper (and to BESS-KGE), the four entity vectors should be
        normalized to unit Euclidean length, as :class:`pykeen_bess.nn.models.InterHT` does.

    .. seealso:: https://github.com/destwang/InterHT

    ---
    name: InterHT
    citation:
        author: Wang
        year: 2022
        link: https://arxiv.org/abs/2202.04897
        arxiv: 2202.04897
        github: destwang/InterHT
    """

    # main and auxiliary entity vectors
    entity_shape = ("d", "d")
    relation_shape = ("d",)

    def forward(
        self,
        h: tuple[FloatTensor, FloatTensor],
        r: FloatTensor,
        t: tuple[FloatTensor, FloatTensor],
    ) -> FloatTensor:
        """Evaluate the interaction function on broadcastable representations.

        :param h: shape: ``(*batch_dims, d)``, twice: the head's main and auxiliary vectors
        :param r: shape: ``(*batch_dims, d)``, the relation vector
        :param t: shape: ``(*batch_dims, d)``, twice: the tail's main and auxiliary vectors
        :return: shape: ``batch_dims``, the scores
        """
        head, head_aux = h
        tail, tail_aux = t
        u = self.offset
        return negative_norm_of_sum(
            head * (tail_aux + u), -tail * (head_aux + u), r, p=self.p, power_norm=self.power_norm
        )


@parse_docdata
class TranSInteraction(_OffsetNormInteraction):
    r"""The TranS interaction from [zhang2022]_.

    Entities are represented by a main and a "tilde" vector, $(\mathbf{e}, \tilde{\mathbf{e}})$,
    relations by three vectors $(\mathbf{r}, \bar{\mathbf{r}}, \hat{\mathbf{r}})$, all in
    $\mathbb{R}^d$. The relation is a synthetic combination of a main relation vector and two
    entity-scaling vectors:

    .. math::

        f(h, r, t) = -\|\mathbf{h} \odot (\tilde{\mathbf{t}} + u + \bar{\mathbf{r}})
                       - \mathbf{t} \odot (\tilde{\mathbf{h}} + u - \hat{\mathbf{r}})
                       + \mathbf{r}\|_p

    with a scalar offset $u$ (``u``, default 1). With ``power_norm=True`` the score is
    $-\|\cdot\|_p^p$.

    .. note ::

        For equivalence to the paper (and to BESS-KGE), the four entity vectors should be
        normalized to unit Euclidean length, as :class:`pykeen_bess.nn.models.TranS` does.

    ---
    name: TranS
    citation:
        author: Zhang
        year: 2022
        link: https://arxiv.org/abs/2204.08401
        arxiv: 2204.08401
    """

    # main and tilde entity vectors
    entity_shape = ("d", "d")
    # r, r_bar, r_hat
    relation_shape = ("d", "d", "d")

    def forward(
        self,
        h: tuple[FloatTensor, FloatTensor],
        r: tuple[FloatTensor, FloatTensor, FloatTensor],
        t: tuple[FloatTensor, FloatTensor],
    ) -> FloatTensor:
        """Evaluate the interaction function on broadcastable representations.

        :param h: shape: ``(*batch_dims, d)``, twice: the head's main and tilde vectors
        :param r: shape: ``(*batch_dims, d)``, three times: ``r``, ``r_bar`` and ``r_hat``
        :param t: shape: ``(*batch_dims, d)``, twice: the tail's main and tilde vectors
        :return: shape: ``batch_dims``, the scores
        """
        head, head_tilde = h
        tail, tail_tilde = t
        relation, r_bar, r_hat = r
        u = self.offset
        return negative_norm_of_sum(
            head * (tail_tilde + u + r_bar),
            -tail * (head_tilde + u - r_hat),
            relation,
            p=self.p,
            power_norm=self.power_norm,
        )
