"""Choosing the process topology: a process group (given, initialised, or torchrun's), a device mesh, or shards."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias, cast

import torch
import torch.distributed as dist

from .groups import GROUPINGS, RankLayout
from .launch import join_torchrun_group
from .process_group import ColumnTopology, DistributedTopology
from .topology import LocalTopology, Topology

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ProcessGroupHint", "make_topology", "shard_count_advice"]

#: what a loop's or evaluator's ``process_group`` is: a process group, a device mesh with the dimensions
#: ``("replica", "shard")``, or None (the initialised world, or torchrun's)
ProcessGroupHint: TypeAlias = "dist.ProcessGroup | DeviceMesh | None"


def make_topology(
    num_shards: int | None = None,
    process_group: ProcessGroupHint = None,
    *,
    replicas: int | None = None,
    replica_grouping: str | None = None,
    in_process: bool = False,
    columns: bool = False,
) -> Topology:
    """Choose the topology: a process group (given, initialised, or ``torchrun``'s) or logical shards.

    :param num_shards: the number of shards; under a process group None means the group's size
        divided by ``replicas``; in one process None means 1
    :param process_group: a ``torch.distributed`` process group (default: the initialised world,
        joining ``torchrun``'s first if this process was started by it), or a
        :class:`torch.distributed.device_mesh.DeviceMesh` with the dimensions ``("replica", "shard")``
    :param replicas: the processes holding each shard (default: 1, or what the mesh says)
    :param replica_grouping: how the replicas are laid out over the ranks (see
        :mod:`pykeen_bess.distributed.groups`)
    :param in_process: hold all shards in this process even inside a process group (e.g. to
        evaluate a model that is not sharded over the processes)
    :param columns: split every row's columns instead of the rows (the encoding partition):
        ``num_shards`` column parts, one per rank under a process group (:class:`ColumnTopology`)
    :returns: the topology
    :raises ValueError: for settings that do not fit the processes, or an unknown ``replica_grouping``
    :raises TypeError: for a ``process_group`` that is a name or a number
    """
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise ValueError(f"replicas must be a positive integer or None, but is {replicas!r}.")
    if replica_grouping is not None and replica_grouping not in GROUPINGS:  # before any message about ranks
        raise ValueError(f"Unknown replica_grouping={replica_grouping!r}; expected one of {GROUPINGS} or None.")
    if isinstance(process_group, str | int | float):  # e.g. "world", "gloo": a backend's name is not a group
        raise TypeError(
            f"process_group must be a torch.distributed process group (e.g. dist.group.WORLD or dist.new_group(...)), "
            f"a DeviceMesh with the dimensions ('replica', 'shard'), or None (the initialised world, or torchrun's), "
            f"not {process_group!r}."
        )
    if in_process:
        return LocalTopology(1 if num_shards is None else num_shards)
    if columns:
        if process_group is None:
            join_torchrun_group()
        if process_group is not None or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return _column_topology(process_group, num_shards, replicas, replica_grouping)
        if (replicas or 1) > 1 or replica_grouping not in (None, "none"):
            raise ValueError(
                f"replicas={replicas}, replica_grouping={replica_grouping!r} need a process group of several ranks "
                f"(torchrun); in one process every column part is held once."
            )
        return LocalTopology(1, n_column=1 if num_shards is None else num_shards)
    if _is_device_mesh(process_group):
        return _mesh_topology(process_group, num_shards, replicas, replica_grouping)
    if process_group is None:
        join_torchrun_group()
    in_group = process_group is not None or (
        dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    )
    if in_group:
        group = cast("dist.ProcessGroup | None", process_group)  # (not a device mesh: see above)
        return DistributedTopology(group, _group_layout(group, num_shards, replicas, replica_grouping))
    if (replicas or 1) > 1 or replica_grouping not in (None, "none"):
        raise ValueError(
            f"replicas={replicas}, replica_grouping={replica_grouping!r} need a process group of several ranks "
            f"(torchrun); in one process every shard is held once."
        )
    return LocalTopology(1 if num_shards is None else num_shards)


def _column_topology(
    process_group: Any, num_shards: int | None, replicas: int | None, replica_grouping: str | None
) -> ColumnTopology:
    """Return the column parts of the encoding partition over a process group: one per rank of a shard group.

    :raises ValueError: for a device mesh, or settings that do not fit the processes
    """
    if _is_device_mesh(process_group):
        raise ValueError(
            "partition='encoding' takes a process group, not a device mesh: give num_shards (the column parts), "
            "replicas and replica_grouping instead."
        )
    layout = _group_layout(process_group, num_shards, replicas, replica_grouping, parts="column part")
    return ColumnTopology(process_group, layout)


def _group_layout(
    process_group: Any,
    num_shards: int | None,
    replicas: int | None,
    replica_grouping: str | None,
    parts: str = "shard",
) -> RankLayout:
    """Return the layout of the group's ranks: ``num_shards`` shards (or column parts) in ``replicas`` replicas.

    :raises ValueError: if the ranks disagree on the settings (checked before any subgroup is created:
        ranks that disagree would wait for each other forever), or the settings do not fit the group
    """
    world_size = dist.get_world_size(process_group)
    DistributedTopology.check_same_settings(
        process_group, dict(num_shards=num_shards, replicas=replicas, replica_grouping=replica_grouping)
    )
    if replicas is None and replica_grouping is None and num_shards not in (None, world_size):
        raise ValueError(
            f"num_shards={num_shards} differs from the process group's size {world_size}; under "
            f"torch.distributed every rank holds one {parts} (leave num_shards unset)"
            f"{shard_count_advice(world_size, num_shards)}"
        )
    return RankLayout.create(world_size, num_shards, replicas, replica_grouping)


def shard_count_advice(world_size: int, num_shards: int) -> str:
    """Return how ``num_shards`` shards can fit ``world_size`` ranks (the end of an error message).

    Each shard needs the same number of replicas, so ``num_shards`` must divide the world size:
    then ``replicas`` says how many; else the shard counts that divide it, or world sizes that
    ``num_shards`` divides.
    """
    if num_shards <= world_size and world_size % num_shards == 0:
        return f", or give replicas={world_size // num_shards} so that num_shards * replicas == {world_size}."
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return (
        f". {num_shards} shards cannot share {world_size} ranks (every shard needs the same number of replicas): "
        f"use num_shards in {divisors} (with replicas = {world_size} / num_shards), or run {num_shards} shards on "
        f"a multiple of {num_shards} ranks (e.g. torchrun --nproc-per-node={num_shards})."
    )


def _is_device_mesh(value: Any) -> bool:
    return value is not None and type(value).__name__ == "DeviceMesh" and hasattr(value, "mesh_dim_names")


def _mesh_topology(mesh: Any, num_shards: int | None, replicas: int | None, grouping: str | None) -> Topology:
    """Return the topology of a device mesh with the dimensions ``("replica", "shard")`` (in either order)."""
    names = tuple(mesh.mesh_dim_names or ())
    if sorted(names) != ["replica", "shard"]:
        raise ValueError(
            f"A device mesh for BESS needs exactly the dimensions ('replica', 'shard'), but has {names}; e.g. "
            f"init_device_mesh('cpu', (replicas, shards), mesh_dim_names=('replica', 'shard'))."
        )
    ranks = mesh.mesh if names == ("replica", "shard") else mesh.mesh.t()
    mesh_replicas, mesh_shards = ranks.shape
    if (num_shards or mesh_shards) != mesh_shards or (replicas or mesh_replicas) != mesh_replicas:
        raise ValueError(
            f"The mesh has {mesh_shards} shards x {mesh_replicas} replicas, not num_shards={num_shards}, "
            f"replicas={replicas}."
        )
    world = torch.arange(ranks.numel()).to(ranks)
    if torch.equal(ranks, world.view(mesh_replicas, mesh_shards)):
        layout_grouping = "orthogonal" if mesh_replicas > 1 else "none"
    elif torch.equal(ranks, world.view(mesh_shards, mesh_replicas).t()):
        layout_grouping = "consecutive" if mesh_shards > 1 else "all"
    else:
        raise ValueError(f"The mesh's ranks {ranks.tolist()} are laid out neither orthogonally nor consecutively.")
    if mesh_shards == 1:
        layout_grouping = "all"
    if grouping is not None and grouping != layout_grouping:
        raise ValueError(f"The mesh lays its replicas out {layout_grouping!r}, not replica_grouping={grouping!r}.")
    layout = RankLayout.create(int(ranks.numel()), mesh_shards, mesh_replicas, layout_grouping)
    return DistributedTopology(
        None, layout, shard_group=mesh.get_group("shard"), replica_group=mesh.get_group("replica")
    )
