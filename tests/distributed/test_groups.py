"""Replica groups as pure functions: the rank tables of seed 004 and the checks of a layout (no processes)."""

from __future__ import annotations

import pytest

from pykeen_bess.distributed import GROUPINGS, RankLayout, describe_differences, make_topology


def _seed_table(kind: str) -> list[list[int]]:
    """Seed 004's tables for 16 replicas and (where it applies) a group size of 4, typed in from the seed."""
    if kind == "all":
        return [list(range(16))]
    if kind == "none":
        return [[r] for r in range(16)]
    if kind == "consecutive":
        return [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    return [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


@pytest.mark.parametrize(
    ("grouping", "num_shards", "replicas"),
    [("all", 1, 16), ("none", 16, 1), ("consecutive", 4, 4), ("orthogonal", 4, 4)],
)
def test_the_seeds_sixteen_replica_tables(grouping: str, num_shards: int, replicas: int) -> None:
    layout = RankLayout.create(16, num_shards, replicas, grouping)
    assert layout.replica_groups() == _seed_table(grouping)
    assert (layout.num_shards, layout.replicas, layout.grouping) == (num_shards, replicas, grouping)


@pytest.mark.parametrize("grouping", ["consecutive", "orthogonal"])
@pytest.mark.parametrize(("world", "replicas"), [(8, 2), (8, 4), (6, 3), (12, 2), (4, 2)])
def test_every_rank_is_one_replica_of_one_shard(grouping: str, world: int, replicas: int) -> None:
    layout = RankLayout.create(world, replicas=replicas, grouping=grouping)
    n = world // replicas
    assert layout.num_shards == n
    # the two axes partition the ranks; a shard group holds each shard once, in shard order
    replica_groups, shard_groups = layout.replica_groups(), layout.shard_groups()
    assert sorted(r for g in replica_groups for r in g) == list(range(world))
    assert sorted(r for g in shard_groups for r in g) == list(range(world))
    for shard, group in enumerate(replica_groups):
        assert [layout.shard_of(r) for r in group] == [shard] * replicas
        assert [layout.replica_of(r) for r in group] == list(range(replicas))
    for replica, group in enumerate(shard_groups):
        assert [layout.shard_of(r) for r in group] == list(range(n))
        assert {layout.replica_of(r) for r in group} == {replica}
    for rank in range(world):
        assert layout.rank_of(layout.shard_of(rank), layout.replica_of(rank)) == rank
    # the seed's definitions: consecutive = adjacent ranks, orthogonal = a stride of num_groups
    if grouping == "consecutive":
        assert replica_groups[0] == list(range(replicas))
        assert shard_groups[0] == list(range(0, world, replicas))
    else:
        assert replica_groups[0] == list(range(0, world, n))
        assert shard_groups[0] == list(range(n))  # the per-step all-to-all on consecutive ranks (one node)


def test_defaults_follow_from_the_other_numbers() -> None:
    assert RankLayout.create(4) == RankLayout(4, 4, 1, "none")
    assert RankLayout.create(4, num_shards=2) == RankLayout(4, 2, 2, "orthogonal")
    assert RankLayout.create(4, replicas=4) == RankLayout(4, 1, 4, "all")
    assert RankLayout.create(4, grouping="all") == RankLayout(4, 1, 4, "all")
    assert RankLayout.create(4, replicas=1, grouping="orthogonal") == RankLayout(4, 4, 1, "none")
    assert set(GROUPINGS) == {"none", "all", "consecutive", "orthogonal"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(replicas=3), "not divisible by replicas=3"),
        (dict(num_shards=3, replicas=2), "num_shards=3 x replicas=2 = 6 ranks, but the world has 4"),
        (dict(num_shards=3), "not divisible"),
        (dict(grouping="ring"), "Unknown replica_grouping='ring'"),
        (dict(num_shards=2, grouping="all"), "num_shards=1 and replicas=4"),
        (dict(replicas=2, grouping="none"), "num_shards=4 (the world size) and replicas=1"),
        (dict(replicas=0), "replicas must be a positive integer"),
        (dict(num_shards=True), "num_shards must be a positive integer"),
    ],
)
def test_bad_layouts_are_refused_naming_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RankLayout.create(4, **{"num_shards": None, "replicas": None, "grouping": None, **kwargs})


def test_the_rank_table_is_logged_readably() -> None:
    table = RankLayout.create(4, num_shards=2, grouping="consecutive").describe()
    assert "4 ranks = 2 shards x 2 replicas (replica_grouping='consecutive')" in table
    assert table.splitlines()[2:] == [
        "   0 |     0 |       0",
        "   1 |     0 |       1",
        "   2 |     1 |       0",
        "   3 |     1 |       1",
    ]


def test_replicas_need_a_process_group() -> None:
    with pytest.raises(ValueError, match="need a process group of several ranks"):
        make_topology(2, replicas=2)
    with pytest.raises(ValueError, match="need a process group"):
        make_topology(2, replica_grouping="orthogonal")
    assert make_topology(2, replicas=1).n_shard == 2
    # a misspelt grouping is named, not taken for one that needs ranks
    with pytest.raises(ValueError, match="Unknown replica_grouping='orthogonl'"):
        make_topology(2, replica_grouping="orthogonl")
    # a backend's or group's name is not a process group (an AttributeError on .size() before)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed process group.*not 'world'"):
        make_topology(2, process_group="world")


def test_differences_name_the_setting_and_every_rank() -> None:
    assert describe_differences([dict(a=1, b=2), dict(a=1, b=2)]) == ""
    assert describe_differences([dict(a=1, b=2), dict(a=1, b=3)]) == "  b: rank 0=2, rank 1=3"


class DeviceMesh:
    """Stands in for torch.distributed.device_mesh.DeviceMesh: the layout checks run before any collective."""

    def __init__(self, ranks: list[list[int]], names: tuple[str, ...] | None) -> None:
        import torch

        self.mesh = torch.tensor(ranks)
        self.mesh_dim_names = names


@pytest.mark.parametrize(
    ("mesh", "kwargs", "message"),
    [
        (DeviceMesh([[0, 1], [2, 3]], ("dp", "shard")), {}, r"exactly the dimensions \('replica', 'shard'\)"),
        (DeviceMesh([[0, 1], [2, 3]], None), {}, "exactly the dimensions"),
        (DeviceMesh([[0, 2], [3, 1]], ("replica", "shard")), {}, "neither orthogonally nor consecutively"),
        (DeviceMesh([[0, 1], [2, 3]], ("replica", "shard")), dict(num_shards=4), "not num_shards=4"),
        (DeviceMesh([[0, 1], [2, 3]], ("replica", "shard")), dict(replica_grouping="consecutive"), "'orthogonal'"),
    ],
)
def test_a_device_mesh_must_name_and_lay_out_its_dimensions(mesh: DeviceMesh, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_topology(process_group=mesh, **kwargs)
