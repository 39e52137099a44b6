"""Named options as PyKEEN matches names: any case, with or without ``_``, ``-`` and spaces.

PyKEEN's resolvers accept ``"DistMult"``, ``"distmult"`` or ``"dist_mult"`` alike; the loop's named options
(``partition="Token"``, ``corruption="HT"``, ``checkpoint_retrieval="one-per-group"``, ...) are matched the
same way (:func:`canonical_choice`) where they enter, so that every later comparison sees the canonical name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from class_resolver import normalize_string

__all__ = [
    "canonical_choice",
]


def canonical_choice(value: Any, choices: Iterable[str]) -> Any:
    """Return the choice that ``value`` names (``"Token"`` -> ``"token"``, ``"One-Per-Group"`` -> ``"one_per_group"``).

    Anything that names no choice (another string, None, a class) is returned unchanged: the caller's
    check refuses it with the list of choices.

    :param value: the given option
    :param choices: the canonical names
    """
    if not isinstance(value, str):
        return value
    key = normalize_string(value)
    for choice in choices:
        if normalize_string(choice) == key:
            return choice
    return value
