"""Filtered ranking without dense masks: an index of the known triples.

PyKEEN filters a batch of ``B`` evaluation triples by comparing it with *every* known triple
(``[B, num_filter_triples]`` boolean masks for each target). A :class:`FilterIndex` is built once
from the known triples and answers "which entities complete ``(h, r, ?)`` / ``(?, r, t)`` to a
known triple" for a whole batch in ``O(B log T + m)``, ``m`` being the number of answers, with
two :func:`torch.searchsorted` calls and no Python loop.

Layout, for each side, over the ``T`` *distinct* known triples:

* ``keys``: int64 ``[T]``, sorted, the key of the fixed pair: ``h * num_relations + r`` for tail
  filtering (the answers are tails), ``r * num_entities + t`` for head filtering;
* ``entities``: int32 ``[T]`` (int64 if there are more than ``2^31 - 1`` entities), the answer of
  each key, sorted within equal keys.

The entries with the key of a query form one contiguous run ``[start, stop)`` found by binary
search; the answers are ``entities[start:stop]``.

Synchronisation: a lookup's output size is the number of answers, so it reads one number on the
host (``repeat_interleave``); the evaluator looks up all queries of an evaluation at once. Building
reads the id ranges on the host for the checks.

Memory: exactly ``2 * (8 + 4) = 24`` bytes per distinct known triple (``2 * (8 + 8) = 32`` bytes
with more than ``2^31 - 1`` entities), i.e. :data:`BYTES_PER_TRIPLE`, plus constant object
overhead; duplicates are removed when the index is built. A lookup allocates ``O(B + m)``. For
comparison, PyKEEN's :func:`pykeen.evaluation.evaluator.create_sparse_positive_filter_` builds
three boolean ``[B, T]`` masks per batch, ``3 B`` bytes per known triple (768 bytes at ``B = 256``).

Building sorts the combined keys ``key * num_entities + entity`` once per side (``O(T log T)``,
vectorised, by numpy on the CPU; two stable sorts when that would overflow int64); transient memory during the build is
a few int64 copies of the ``[T, 3]`` triples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from ..storage.digests import sha256_of_array

__all__ = [
    "BYTES_PER_TRIPLE",
    "FilterIndex",
    "FilterIndexCache",
    "SideIndex",
]

#: the index size in bytes per distinct known triple (both sides), by entity id width
BYTES_PER_TRIPLE = {torch.int32: 24, torch.int64: 32}

#: the predicted side: "tail" answers ``(h, r, ?)``, "head" answers ``(?, r, t)``
FilterSide = Literal["head", "tail"]


@dataclasses.dataclass(frozen=True, eq=False)
class SideIndex:
    """The answers of one side: sorted keys with the answer entity of each (see the module docstring)."""

    #: shape: ``[T]``, int64, sorted keys of the fixed pair
    keys: torch.Tensor
    #: shape: ``[T]``, int32 or int64, the answer entity of each key (sorted within equal keys)
    entities: torch.Tensor

    @property
    def nbytes(self) -> int:
        """The storage of the index in bytes."""
        return self.keys.numel() * self.keys.element_size() + self.entities.numel() * self.entities.element_size()

    def lookup(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return all answers of a batch of keys.

        :param keys: shape: ``[B]``, int64 query keys
        :returns: two int64 tensors of shape ``[m]``: the position of the query in the batch
            (ascending) and the answer entity; the answers of one query are sorted
        """
        keys = keys.to(device=self.keys.device, dtype=torch.long)
        start = torch.searchsorted(self.keys, keys, right=False)
        stop = torch.searchsorted(self.keys, keys, right=True)
        counts = stop - start
        # the number of answers decides the output's size: the one read of the lookup on the host
        query_index = torch.repeat_interleave(torch.arange(keys.shape[0], device=keys.device), counts)
        # position of each answer within its query's run, plus the run's start
        first_output = torch.cumsum(counts, dim=0) - counts
        positions = (
            torch.arange(query_index.shape[0], device=keys.device) - first_output[query_index] + start[query_index]
        )
        return query_index, self.entities[positions].long()


@dataclasses.dataclass(frozen=True, eq=False)
class FilterIndex:
    """An index of known triples for filtered ranking (see the module docstring for the layout).

    Build it with :meth:`from_triples`; query it with :meth:`filtered`.
    """

    #: the number of entities (ids are ``0 <= e < num_entities``)
    num_entities: int
    #: the number of relations (ids are ``0 <= r < num_relations``)
    num_relations: int
    #: answers of ``(h, r, ?)``
    tail: SideIndex
    #: answers of ``(?, r, t)``
    head: SideIndex

    @classmethod
    def from_triples(
        cls,
        triples: torch.Tensor | Sequence[torch.Tensor],
        num_entities: int | None = None,
        num_relations: int | None = None,
        device: torch.device | str = "cpu",
    ) -> FilterIndex:
        """Index the known triples.

        :param triples: shape: ``[T, 3]``, ``(h, r, t)`` ids, or several such tensors (concatenated);
            duplicates are allowed
        :param num_entities: the number of entities; inferred from the triples if None
        :param num_relations: the number of relations; inferred from the triples if None
        :param device: where the index is built and kept (a GPU sorts the keys in milliseconds)
        :returns: the index
        :raises ValueError: for malformed triples or ids outside the given ranges
        """
        joined: torch.Tensor | None
        if isinstance(triples, torch.Tensor):
            joined = triples
        else:
            joined = (
                torch.cat([torch.as_tensor(t).view(-1, 3).to(device) for t in triples], dim=0) if len(triples) else None
            )
        if joined is None or joined.ndim != 2 or joined.shape[1] != 3:
            raise ValueError(
                f"Expected known triples of shape [T, 3], got {None if joined is None else list(joined.shape)}."
            )
        triples = joined.detach().to(device=device, dtype=torch.long)
        if num_entities is None:
            num_entities = int(torch.cat([triples[:, 0], triples[:, 2]]).max()) + 1 if len(triples) else 0
        if num_relations is None:
            num_relations = int(triples[:, 1].max()) + 1 if len(triples) else 0
        if len(triples):
            heads, relations, tails = triples.unbind(dim=1)
            bad_entity = (
                int(torch.cat([heads, tails]).min()) < 0 or int(torch.cat([heads, tails]).max()) >= num_entities
            )
            bad_relation = int(relations.min()) < 0 or int(relations.max()) >= num_relations
            if bad_entity or bad_relation:
                raise ValueError(
                    f"Known triples contain ids outside [0, {num_entities}) for entities or [0, {num_relations}) for "
                    f"relations."
                )
        entity_dtype = torch.int32 if num_entities <= torch.iinfo(torch.int32).max else torch.long
        heads, relations, tails = triples.unbind(dim=1)
        return cls(
            num_entities=int(num_entities),
            num_relations=int(num_relations),
            tail=_build_side(heads * num_relations + relations, tails, num_entities, entity_dtype),
            head=_build_side(relations * num_entities + tails, heads, num_entities, entity_dtype),
        )

    @property
    def num_triples(self) -> int:
        """The number of distinct known triples."""
        return self.tail.keys.shape[0]

    @property
    def nbytes(self) -> int:
        """The storage of the index in bytes (:data:`BYTES_PER_TRIPLE` per distinct triple)."""
        return self.tail.nbytes + self.head.nbytes

    def to(self, device: torch.device | str) -> FilterIndex:
        """Return the index on another device."""
        return dataclasses.replace(
            self,
            tail=SideIndex(keys=self.tail.keys.to(device), entities=self.tail.entities.to(device)),
            head=SideIndex(keys=self.head.keys.to(device), entities=self.head.entities.to(device)),
        )

    def filtered(
        self, side: FilterSide, known: torch.Tensor, relations: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the known answers of a batch of queries as ``(query index, entity id)`` pairs.

        :param side: ``"tail"`` for queries ``(h, r, ?)`` (``known`` are heads), ``"head"`` for
            queries ``(?, r, t)`` (``known`` are tails)
        :param known: shape: ``[B]``, the known entity of each query
        :param relations: shape: ``[B]``, the (original, non-inverse) relation of each query
        :returns: two int64 tensors of shape ``[m]``: the query's position in the batch (ascending)
            and an entity completing it to a known triple; each pair occurs once
        :raises ValueError: for an invalid side
        """
        known = known.long()
        relations = relations.long()
        if side == "tail":
            return self.tail.lookup(known * self.num_relations + relations)
        if side == "head":
            return self.head.lookup(relations * self.num_entities + known)
        raise ValueError(f"Invalid side={side!r}; expected 'head' or 'tail'.")


def _build_side(keys: torch.Tensor, entities: torch.Tensor, num_entities: int, entity_dtype: torch.dtype) -> SideIndex:
    """Sort ``(key, entity)`` pairs lexicographically and drop duplicates.

    When ``key * num_entities + entity`` fits into int64 (always below ``2^63``, e.g. 2.5M entities
    and 500 relations need ``3 * 10^15``) one sort of the combined keys does it; otherwise two stable
    sorts (by entity, then by key) and a comparison of neighbours.

    :param keys: shape: ``[T]``, int64, below ``num_keys`` (the product of the other two id ranges)
    :param entities: shape: ``[T]``, int64, below ``num_entities``
    :param num_entities: the number of entities
    :param entity_dtype: the storage type of the answers
    :returns: the side index
    """
    largest_key = int(keys.max()) if keys.numel() else 0
    if (largest_key + 1) * max(num_entities, 1) <= torch.iinfo(torch.long).max:
        combined = keys * num_entities + entities
        if combined.device.type == "cpu":
            # numpy sorts int64 2-3x as fast as torch.unique on the CPU (vectorised on x86; FB15k-237's 290k
            # known triples: 1.8 ms instead of 5 ms per side); equal neighbours are the duplicates
            ordered = torch.from_numpy(np.sort(combined.numpy()))
            combined = torch.cat([ordered[:1], ordered[1:][ordered[1:] != ordered[:-1]]])
        else:
            combined = torch.unique(combined, sorted=True)
        keys, entities = combined // num_entities, combined % num_entities
        return SideIndex(keys=keys.contiguous(), entities=entities.to(entity_dtype).contiguous())
    # lexicographic sort: by entity, then stably by key
    order = torch.argsort(entities, stable=True)
    keys, entities = keys[order], entities[order]
    order = torch.argsort(keys, stable=True)
    keys, entities = keys[order], entities[order]
    if keys.numel():
        new = torch.ones_like(keys, dtype=torch.bool)
        new[1:] = (keys[1:] != keys[:-1]) | (entities[1:] != entities[:-1])
        keys, entities = keys[new], entities[new]
    return SideIndex(keys=keys.contiguous(), entities=entities.to(entity_dtype).contiguous())


class FilterIndexCache:
    """The filter index of the last evaluation, built again only for other known triples, sizes or device.

    Early stopping evaluates the same validation triples every few epochs: the second evaluation
    builds nothing. The key holds a SHA-256 of every known-triples tensor's values (a few
    milliseconds for a million triples), so other triples, or a tensor changed in place, build a new index
    (a CRC-32 could be matched by other triples, which then got the old index).
    """

    def __init__(self) -> None:
        """Start empty."""
        self._entry: tuple[tuple, FilterIndex] | None = None

    def get(
        self, known: Sequence[torch.Tensor], num_entities: int, num_relations: int, device: torch.device
    ) -> FilterIndex:
        """Return the index of the known triples (``[T_i, 3]`` each), built if they, the sizes or the device differ."""
        key = (
            num_entities,
            num_relations,
            str(device),
            tuple((tuple(triples.shape), str(triples.dtype), sha256_of_array(triples)) for triples in known),
        )
        if self._entry is None or self._entry[0] != key:
            self._entry = None  # release the old index before building the new one
            self._entry = key, FilterIndex.from_triples(list(known), num_entities, num_relations, device=device)
        return self._entry[1]
