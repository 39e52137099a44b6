"""Names a user writes: option values matched as PyKEEN matches names, and keyword arguments checked by name.

PyKEEN's resolvers accept ``"DistMult"``, ``"distmult"`` or ``"dist_mult"`` alike; the loop's named options
(``partition="Token"``, ``corruption="HT"``, ``checkpoint_retrieval="one-per-group"``, ...) are matched the
same way (:func:`canonical_choice`) where they enter, so that every later comparison sees the canonical name.
Keyword arguments the plugin's classes pass on to PyKEEN's base classes are checked first
(:func:`check_keyword_arguments`), so that a misspelt one names the class and the argument meant.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from class_resolver import normalize_string

__all__ = [
    "canonical_choice",
    "check_keyword_arguments",
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


def check_keyword_arguments(cls: type, base: type, kwargs: Mapping[str, Any]) -> None:
    """Refuse keyword arguments that ``base`` does not take, naming ``cls`` and the closest argument either takes.

    (Passed on to PyKEEN, a misspelt ``num_shard=2`` was refused as ``TrainingLoop.__init__() got an unexpected
    keyword argument``, naming neither the plugin's class nor what was meant.)

    :param cls: the class given the arguments (its own keyword arguments are suggested too)
    :param base: the PyKEEN class ``kwargs`` are passed on to (the arguments of every ``__init__`` of its bases)
    :param kwargs: the keyword arguments passed on to ``base``
    :raises TypeError: for an argument ``base`` does not take
    """
    taken = {
        parameter.name
        for owner in base.__mro__
        if "__init__" in vars(owner) and owner is not object
        for parameter in inspect.signature(vars(owner)["__init__"]).parameters.values()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and parameter.name != "self"
    }
    for name in kwargs:
        if name in taken:
            continue
        known = taken | {
            parameter.name
            for owner in cls.__mro__
            if "__init__" in vars(owner) and owner is not object
            for parameter in inspect.signature(vars(owner)["__init__"]).parameters.values()
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and parameter.name != "self"
        }
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; its options: {', '.join(sorted(known))}."
        raise TypeError(f"{cls.__name__} got an unexpected keyword argument {name!r}{hint}")
