"""Reproducible seeds derived from a run's seed, the same in every process and interpreter.

Every random draw of BESS (the entity permutation, the initial tables, the epoch order and the
negatives of every epoch) has its own stream, seeded by :func:`derive_seed` from the run's seed and
a few integers that say what the stream is for. The derivation is
:class:`numpy.random.SeedSequence` (a documented hash of the integers), not Python's ``hash()``,
whose values are an interpreter detail.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "derive_seed",
]


def derive_seed(*keys: int) -> int:
    """Return a 63-bit seed determined by ``keys`` (non-negative integers: the run's seed, then purposes).

    :param keys: the integers the stream depends on
    :returns: a seed for :meth:`torch.Generator.manual_seed`
    :raises ValueError: for negative keys
    """
    values = [int(key) for key in keys]
    if any(value < 0 for value in values):
        raise ValueError(f"Seed keys must be non-negative integers, got {values}.")
    state = np.random.SeedSequence(values).generate_state(1, dtype=np.uint64)
    return int(state[0]) & ((1 << 63) - 1)
