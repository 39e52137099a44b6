"""Replica groups: which rank holds which shard, when shards are replicated for data parallelism.

A world of ``W`` ranks trains ``n`` entity shards, each held by ``R = W / n`` replicas. Following
Graphcore's communication groups (``CommGroupType``), the *replica groups* are the
sets of ranks holding the same shard (the same variable value):

========================= ========== ============================================================
``replica_grouping``      shards     replica groups (``W = 16``, ``R = 4``)
========================= ========== ============================================================
``"none"``                ``W``      every rank its own group: ``{0}, {1}, ..., {15}`` (``R = 1``)
``"all"``                 ``1``      one group of all ranks: ``{0, ..., 15}`` (pure data parallelism)
``"consecutive"``         ``W / R``  adjacent ranks: ``{0..3}, {4..7}, {8..11}, {12..15}``
``"orthogonal"``          ``W / R``  a stride of ``n``: ``{0,4,8,12}, {1,5,9,13}, {2,6,10,14}, {3,7,11,15}``
========================= ========== ============================================================

The *shard groups* are the other axis: one rank of every replica group, together holding all ``n``
shards; a BESS step's all-to-all runs inside a shard group, every step. With ``"orthogonal"`` the
shard groups are consecutive ranks (``{0..3}, {4..7}, ...``), so under ``torchrun
--nproc-per-node n`` the chatty per-step all-to-all stays inside a node and only the replicas'
gradient sums cross nodes; with ``"consecutive"`` it is the other way round.

Everything here is a pure function of the four numbers (no process group is needed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

__all__ = [
    "GROUPINGS",
    "Grouping",
    "RankLayout",
    "describe_differences",
]

#: how replicas of a shard are laid out over the ranks
Grouping = Literal["none", "all", "consecutive", "orthogonal"]
GROUPINGS: tuple[str, ...] = ("none", "all", "consecutive", "orthogonal")


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """The shard and replica of every rank of a world (see the module docstring)."""

    #: the number of ranks ``W``
    world_size: int
    #: the number of entity shards ``n``
    num_shards: int
    #: the number of replicas of every shard ``R`` (``n * R = W``)
    replicas: int
    #: how the replicas are laid out
    grouping: Grouping

    @classmethod
    def create(
        cls,
        world_size: int,
        num_shards: int | None = None,
        replicas: int | None = None,
        grouping: str | None = None,
    ) -> RankLayout:
        """Validate a layout; missing numbers follow from the others and the grouping.

        :param world_size: the number of ranks
        :param num_shards: the number of shards (default: ``world_size / replicas``)
        :param replicas: the replicas per shard (default: ``world_size / num_shards``, else 1)
        :param grouping: ``"none"``, ``"all"``, ``"consecutive"`` or ``"orthogonal"`` (default:
            ``"none"`` without replicas, ``"all"`` with one shard, else ``"orthogonal"``)
        :returns: the layout
        :raises ValueError: naming the inconsistency and how to fix it
        """
        _check_types(world_size, num_shards, replicas, grouping)
        if grouping == "all":
            if num_shards not in (None, 1) or replicas not in (None, world_size):
                raise ValueError(
                    f"replica_grouping='all' holds the whole table on every rank: num_shards=1 and replicas="
                    f"{world_size} (the world size), not num_shards={num_shards}, replicas={replicas}."
                )
            num_shards, replicas = 1, world_size
        elif grouping == "none":
            if replicas not in (None, 1) or num_shards not in (None, world_size):
                raise ValueError(
                    f"replica_grouping='none' gives every rank its own shard: num_shards={world_size} (the world "
                    f"size) and replicas=1, not num_shards={num_shards}, replicas={replicas}."
                )
            num_shards, replicas = world_size, 1
        if replicas is None and num_shards is not None and world_size % num_shards:
            raise ValueError(
                f"The world size {world_size} is not divisible by num_shards={num_shards}: every shard needs the "
                f"same number of replicas (num_shards * replicas == world size)."
            )
        if replicas is None:
            replicas = 1 if num_shards is None else world_size // num_shards
        if world_size % replicas:
            raise ValueError(
                f"The world size {world_size} is not divisible by replicas={replicas}: every shard needs the same "
                f"number of replicas."
            )
        if num_shards is None:
            num_shards = world_size // replicas
        if num_shards * replicas != world_size:
            raise ValueError(
                f"num_shards={num_shards} x replicas={replicas} = {num_shards * replicas} ranks, but the world has "
                f"{world_size}: choose num_shards * replicas == world size."
            )
        if grouping is None:
            grouping = "none" if replicas == 1 else "all" if num_shards == 1 else "orthogonal"
        elif grouping in ("consecutive", "orthogonal") and replicas == 1:
            grouping = "none"
        return cls(world_size=world_size, num_shards=num_shards, replicas=replicas, grouping=grouping)  # type: ignore[arg-type]

    def shard_of(self, rank: int) -> int:
        """Return the shard a rank holds."""
        if self.grouping == "consecutive":
            return rank // self.replicas
        return rank % self.num_shards

    def replica_of(self, rank: int) -> int:
        """Return which replica of its shard a rank is (0 for the first)."""
        if self.grouping == "consecutive":
            return rank % self.replicas
        return rank // self.num_shards

    def rank_of(self, shard: int, replica: int) -> int:
        """Return the rank holding ``replica`` of ``shard``."""
        if self.grouping == "consecutive":
            return shard * self.replicas + replica
        return replica * self.num_shards + shard

    def replica_groups(self) -> list[list[int]]:
        """Return the ranks holding each shard, by shard (the seed's groups)."""
        return [[self.rank_of(shard, replica) for replica in range(self.replicas)] for shard in range(self.num_shards)]

    def shard_groups(self) -> list[list[int]]:
        """Return, per replica index, the ranks holding shards ``0..n-1`` in shard order (a step's all-to-all)."""
        return [[self.rank_of(shard, replica) for shard in range(self.num_shards)] for replica in range(self.replicas)]

    def describe(self) -> str:
        """Return the rank table (for the log at the start of training)."""
        lines = [
            f"{self.world_size} ranks = {self.num_shards} shards x {self.replicas} replicas "
            f"(replica_grouping={self.grouping!r})",
            "rank | shard | replica",
        ]
        lines += [
            f"{rank:>4} | {self.shard_of(rank):>5} | {self.replica_of(rank):>7}" for rank in range(self.world_size)
        ]
        return "\n".join(lines)


def describe_differences(settings: Sequence[Mapping[str, Any]]) -> str:
    """Return the settings that differ between ranks, one line each (empty if all ranks agree).

    :param settings: every rank's settings, in rank order
    :returns: lines ``"  key: rank 0=a, rank 1=b"``
    """
    keys = sorted(set().union(*settings)) if settings else []
    lines = [
        f"  {key}: " + ", ".join(f"rank {rank}={values.get(key)}" for rank, values in enumerate(settings))
        for key in keys
        if len({repr(values.get(key)) for values in settings}) > 1
    ]
    return "\n".join(lines)


def _check_types(world_size: int, num_shards: int | None, replicas: int | None, grouping: str | None) -> None:
    """Refuse a layout's arguments of the wrong type or range (:meth:`RankLayout.create`).

    :raises ValueError: naming the argument
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"The world size must be a positive integer, but is {world_size!r}.")
    for name, value in (("num_shards", num_shards), ("replicas", replicas)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, but is {value!r}.")
    if grouping is not None and grouping not in GROUPINGS:
        raise ValueError(f"Unknown replica_grouping={grouping!r}; expected one of {GROUPINGS}.")
