"""Exact conversions between PyKEEN interactions and PyTorch-BigGraph operators and comparators.

PyTorch-BigGraph scores an edge ``(u, r, v)`` as ``c(u, f_r(v))`` for head prediction (its
``rhs`` operator) and, with dynamic relations, ``c(g_r(u), v)`` for tail prediction (its ``lhs``
operator), where ``c`` is the comparator (``dot``: ``sum a b``, ``l2``: ``-||a - b||``,
``squared_l2``: ``-||a - b||^2``). Complex rows are stored ``[real half | imaginary half]``
(PyKEEN stores them interleaved). One class per PyKEEN interaction PBG can express:

=========================  ==========================  =============================  ===========================
PyKEEN model               operator + comparator       ``rhs`` (head prediction)      ``lhs`` (tail prediction)
=========================  ==========================  =============================  ===========================
DistMult                   ``diagonal`` + ``dot``      ``diagonal = r``               ``diagonal = r``
TransE, p = 2              ``translation`` + ``l2``    ``translation = -r``           ``translation = r``
TransE, p = 2, power norm  ``translation`` + ``squared_l2``  as above                 as above
ComplEx                    ``complex_diagonal`` + ``dot``  ``conj(r)``                ``r``
RotatE (``|r| = 1``)       ``complex_diagonal`` + ``l2``   ``conj(r)``                ``r``
RESCAL                     ``linear`` + ``dot``        ``linear_transformation = M``  ``M^T``
=========================  ==========================  =============================  ===========================

A model trained with inverse triples (PyKEEN predicts heads through the inverse relation ``r'``)
maps to dynamic relations exactly: ``lhs`` from ``r``, ``rhs`` from ``r'`` (``c`` is symmetric, so
the head prediction of ``r`` is the tail prediction of ``r'``). Everything else (PyKEEN's default
TransE with ``p = 1``, other interactions; PBG's ``cos`` comparator, ``affine``, operators mixed
over relations, ``bias``) has no exact counterpart and gets a clear error.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from pykeen.models import ERModel
from pykeen.nn.modules import (
    ComplExInteraction,
    DistMultInteraction,
    RESCALInteraction,
    RotatEInteraction,
    TransEInteraction,
)

__all__ = [
    "CONVERSIONS",
    "Conversion",
    "conversion_for_model",
    "conversion_for_model_name",
    "conversion_for_operator",
    "entity_rows",
    "rows_to_weight",
]

#: a relation's operator parameters, e.g. ``{"diagonal": tensor [D]}`` (PBG's names, typed mode)
Parameters = dict[str, torch.Tensor]


class Conversion(ABC):
    """One PyKEEN interaction as a PyTorch-BigGraph operator and comparator."""

    #: the PyKEEN model class name built from a checkpoint
    model: ClassVar[str]
    #: PBG's operator and comparator
    operator: ClassVar[str]
    comparator: ClassVar[str]
    #: whether entity rows are complex (PBG dimension ``2 d``)
    is_complex: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def matches(cls, model: ERModel) -> bool:
        """Whether the model's interaction is this conversion's."""

    @abstractmethod
    def lhs(self, relation: torch.Tensor) -> Parameters:
        """Return the ``lhs`` operator's parameters ``g`` with ``c(g(u), v) = f(u, r, v)``.

        :param relation: shape: ``[R, *shape]``, PyKEEN's relation representation (complex if complex)
        :returns: PBG's parameters, each ``[R, ...]``
        """

    @abstractmethod
    def rhs(self, relation: torch.Tensor) -> Parameters:
        """Return the ``rhs`` operator's parameters ``h`` with ``c(u, h(v)) = f(u, r, v)``."""

    @abstractmethod
    def from_lhs(self, parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Return PyKEEN's relation representation from ``lhs`` parameters (the inverse of :meth:`lhs`)."""

    @abstractmethod
    def from_rhs(self, parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Return PyKEEN's relation representation from ``rhs`` parameters (the inverse of :meth:`rhs`)."""

    def model_kwargs(self, dimension: int) -> dict[str, Any]:
        """Return the PyKEEN model keyword arguments of a checkpoint of PBG ``dimension`` (PBG has no constraints)."""
        return dict(embedding_dim=dimension // 2 if self.is_complex else dimension)

    def describe(self) -> str:
        """Return ``"DistMult = diagonal + dot"``."""
        return f"{self.model} = {self.operator} + {self.comparator}"


class DistMultConversion(Conversion):
    """DistMult ``sum h r t``: ``diagonal`` + ``dot``."""

    model = "DistMult"
    operator = "diagonal"
    comparator = "dot"

    @classmethod
    def matches(cls, model: ERModel) -> bool:
        return type(model.interaction) is DistMultInteraction

    def lhs(self, relation: torch.Tensor) -> Parameters:
        return {"diagonal": relation}

    rhs = lhs

    def from_lhs(self, parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return parameters["diagonal"]

    from_rhs = from_lhs

    def model_kwargs(self, dimension: int) -> dict[str, Any]:
        return dict(embedding_dim=dimension, entity_constrainer=None, regularizer=None)


class TransEConversion(Conversion):
    """TransE with ``p = 2``, ``-||h + r - t||``: ``translation`` + ``l2`` (``squared_l2`` with power norm)."""

    model = "TransE"
    operator = "translation"
    comparator = "l2"
    #: PyKEEN's ``power_norm`` (``-||h + r - t||^2``, PBG's ``squared_l2``)
    power_norm: ClassVar[bool] = False

    @classmethod
    def matches(cls, model: ERModel) -> bool:
        interaction = model.interaction
        return (
            type(interaction) is TransEInteraction
            and float(interaction.p) == 2.0
            and bool(interaction.power_norm) == cls.power_norm
        )

    def lhs(self, relation: torch.Tensor) -> Parameters:
        return {"translation": relation}

    def rhs(self, relation: torch.Tensor) -> Parameters:
        return {"translation": -relation}

    def from_lhs(self, parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return parameters["translation"]

    def from_rhs(self, parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return -parameters["translation"]

    def model_kwargs(self, dimension: int) -> dict[str, Any]:
        return dict(embedding_dim=dimension, scoring_fct_norm=2, power_norm=self.power_norm, entity_constrainer=None)


class SquaredTransEConversion(TransEConversion):
    """TransE with ``p = 2`` and ``power_norm=True``, ``-||h + r - t||^2``: ``translation`` + ``squared_l2``."""

    comparator = "squared_l2"
    power_norm = True


class ComplExConversion(Conversion):
    """ComplEx ``Re(sum h r conj(t))``: ``complex_diagonal`` + ``dot``."""

    model = "ComplEx"
    operator = "complex_diagonal"
    comparator = "dot"
    is_complex = True

    @classmethod
    def matches(cls, model: ERModel) -> bool:
        return type(model.interaction) is ComplExInteraction

    def lhs(self, relation: torch.Tensor) -> Parameters:
        return {"real": relation.real, "imag": relation.imag}

    def rhs(self, relation: torch.Tensor) -> Parameters:
        return {"real": relation.real, "imag": -relation.imag}

    def from_lhs(self, parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.complex(parameters["real"], parameters["imag"])

    def from_rhs(self, parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.complex(parameters["real"], -parameters["imag"])

    def model_kwargs(self, dimension: int) -> dict[str, Any]:
        return dict(embedding_dim=dimension // 2, regularizer=None)


class RotatEConversion(ComplExConversion):
    """RotatE ``-||h * r - t||`` with ``|r| = 1``: ``complex_diagonal`` + ``l2``."""

    model = "RotatE"
    comparator = "l2"
    #: the largest deviation of a relation's modulus from 1 that is still RotatE
    modulus_tolerance: ClassVar[float] = 1e-4

    @classmethod
    def matches(cls, model: ERModel) -> bool:
        return type(model.interaction) is RotatEInteraction

    def _check(self, relation: torch.Tensor) -> torch.Tensor:
        deviation = float((relation.abs() - 1).abs().max()) if relation.numel() else 0.0
        if deviation > self.modulus_tolerance:
            raise ValueError(
                f"complex_diagonal + l2 is PyKEEN's RotatE only for relations of modulus 1, but moduli deviate from 1 "
                f"by up to {deviation:.3g} (-||u - c v|| = -|c| ||u conj(c)/|c| - v|| is no rotation)."
            )
        return relation

    def rhs(self, relation: torch.Tensor) -> Parameters:
        return super().rhs(self._check(relation))

    def from_lhs(self, parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._check(super().from_lhs(parameters))

    def from_rhs(self, parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._check(super().from_rhs(parameters))

    def model_kwargs(self, dimension: int) -> dict[str, Any]:
        return dict(embedding_dim=dimension // 2)


class RESCALConversion(Conversion):
    """RESCAL ``h^T M t``: ``linear`` + ``dot``."""

    model = "RESCAL"
    operator = "linear"
    comparator = "dot"

    @classmethod
    def matches(cls, model: ERModel) -> bool:
        return type(model.interaction) is RESCALInteraction

    def lhs(self, relation: torch.Tensor) -> Parameters:
        return {"linear_transformation": relation.transpose(-1, -2)}

    def rhs(self, relation: torch.Tensor) -> Parameters:
        return {"linear_transformation": relation}

    def from_lhs(self, parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return parameters["linear_transformation"].transpose(-1, -2)

    def from_rhs(self, parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return parameters["linear_transformation"]

    def model_kwargs(self, dimension: int) -> dict[str, Any]:
        # RESCAL takes its default L2 regularizer for regularizer=None; PyKEEN's NoRegularizer adds nothing
        # (its resolver would hand it the default's keyword arguments unless some are given)
        return dict(embedding_dim=dimension, regularizer="no", regularizer_kwargs=dict(weight=1.0))


#: every conversion, tried in order
CONVERSIONS: tuple[type[Conversion], ...] = (
    DistMultConversion,
    TransEConversion,
    SquaredTransEConversion,
    ComplExConversion,
    RotatEConversion,
    RESCALConversion,
)

#: PBG's names of the operator parameters in dynamic mode (``[num_relations, ...]`` tensors)
DYNAMIC_NAMES = {
    "diagonal": "diagonals",
    "translation": "translations",
    "linear_transformation": "linear_transformations",
    "real": "real",
    "imag": "imag",
}


def _supported() -> str:
    return "; ".join(cls().describe() for cls in CONVERSIONS) + " (TransE with scoring_fct_norm=2)"


def conversion_for_model(model: ERModel) -> Conversion:
    """Return the conversion of a PyKEEN model's interaction.

    :raises ValueError: naming the supported models if PyTorch-BigGraph cannot express the interaction
    """
    for cls in CONVERSIONS:
        if cls.matches(model):
            return cls()
    interaction = model.interaction
    hint = ""
    if type(interaction) is TransEInteraction:
        hint = f" (this TransE has p={interaction.p}: PyTorch-BigGraph has only the L2 distance)"
    raise ValueError(
        f"PyTorch-BigGraph cannot express {type(model).__name__} with {type(interaction).__name__}{hint}; "
        f"exact conversions exist for: {_supported()}."
    )


def conversion_for_operator(operator: str, comparator: str, source: str = "the checkpoint") -> Conversion:
    """Return the conversion of a PBG operator and comparator.

    :raises ValueError: naming the supported pairs
    """
    for cls in CONVERSIONS:
        if cls.operator == operator and cls.comparator == comparator:
            return cls()
    raise ValueError(
        f"{source} scores with operator {operator!r} and comparator {comparator!r}, which no PyKEEN interaction "
        f"equals; exact conversions exist for: {_supported()}."
    )


def conversion_for_model_name(name: str) -> Conversion:
    """Return the conversion of a PyKEEN model name (``"DistMult"``, ``"TransE"`` (p = 2), ``"ComplEx"``, ...).

    :raises ValueError: naming the supported models
    """
    for cls in CONVERSIONS:
        if cls.model.lower() == name.lower():
            return cls()
    raise ValueError(
        f"PyTorch-BigGraph cannot express the model {name!r}; exact conversions exist for: {_supported()}."
    )


def entity_rows(values: torch.Tensor) -> torch.Tensor:
    """Return PyKEEN's entity representation ``[n, *s]`` (complex or real) as PBG rows ``[n, D]`` (same precision).

    ``n`` may be 0 (an empty partition): ``D`` is then still the row width.
    """
    if values.is_complex():
        values = torch.cat([values.real, values.imag], dim=-1)
    return values.reshape(values.shape[0], math.prod(values.shape[1:]))


def rows_to_weight(rows: torch.Tensor, is_complex: bool) -> torch.Tensor:
    """Return PBG rows ``[n, D]`` as PyKEEN's stored weight (complex: interleaved ``[re0, im0, re1, ...]``)."""
    if not is_complex:
        return rows
    half = rows.shape[1] // 2
    return torch.stack([rows[:, :half], rows[:, half:]], dim=-1).reshape(rows.shape[0], -1)
