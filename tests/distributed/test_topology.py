"""The process topology: the layout and collectives of the three back ends, in one process and over gloo ranks."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from pykeen_bess.distributed import LocalTopology, ProbeTopology, harness, make_topology
from pykeen_bess.distributed.factory import shard_count_advice


def test_local_topology_collectives_are_transposes_and_copies() -> None:
    topology = LocalTopology(3)
    assert topology.local_shards == (0, 1, 2) and topology.holds_all_shards and not topology.is_distributed
    x = torch.arange(3 * 3 * 2).view(3, 3, 2)
    torch.testing.assert_close(topology.all_to_all(x), x.transpose(0, 1))
    gathered = topology.all_gather(torch.arange(6).view(3, 2))
    assert gathered.shape == (3, 3, 2) and torch.equal(gathered[1], torch.arange(6).view(3, 2))
    torch.testing.assert_close(topology.all_gather_once(torch.arange(6).view(3, 2)), gathered[0])
    z = torch.tensor([1 + 2j, 3 - 1j])
    torch.testing.assert_close(topology.all_reduce(z), z)
    assert topology.all_reduce_coalesced([torch.ones(2), z])[1] is not z
    assert topology.broadcast_object({"a": 1}) == {"a": 1} and topology.all_gather_object(5) == [5]
    assert topology.agree(True) and not topology.agree(False)
    with pytest.raises(ValueError, match="Expected leading dimensions"):
        topology.all_to_all(torch.zeros(2, 3))


def test_probe_topology_keeps_shapes_without_communicating() -> None:
    probe = ProbeTopology(LocalTopology(2))
    assert probe.all_gather(torch.zeros(2, 5)).shape == (2, 2, 5)
    assert probe.all_gather_once(torch.zeros(2, 5)).shape == (2, 5)
    assert probe.all_to_all(torch.zeros(2, 2, 3)).shape == (2, 2, 3)


@pytest.mark.parametrize(("world_size", "num_shards"), [(2, 3), (4, 3), (6, 4), (8, 4), (6, 3), (2, 1)])
def test_shard_count_advice_can_be_followed(world_size: int, num_shards: int) -> None:
    """The advice for num_shards that differs from the world size names settings that exist."""
    advice = shard_count_advice(world_size, num_shards)
    if world_size % num_shards == 0:
        replicas = world_size // num_shards
        assert f"replicas={replicas} " in advice and num_shards * replicas == world_size
    else:
        assert "replicas=" not in advice
        assert f"num_shards in {[d for d in range(1, world_size + 1) if world_size % d == 0]}" in advice
        assert f"--nproc-per-node={num_shards}" in advice


def test_joining_torchruns_group_unasked_is_a_warning(monkeypatch, caplog) -> None:
    """A library that joins a process group by itself (process-wide state) says so at WARNING."""
    import logging

    from pykeen_bess.distributed import launch

    joined = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(launch, "init_from_environment", lambda: joined.append(True))
    with caplog.at_level(logging.WARNING, logger=launch.__name__):
        launch.join_torchrun_group()
    assert joined == [True]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "joined torchrun's process group" in caplog.text and "init_from_environment()" in caplog.text
    # once for the world: the other ranks say it at INFO
    caplog.clear()
    monkeypatch.setattr(launch, "is_main_process", lambda: False)
    with caplog.at_level(logging.INFO, logger=launch.__name__):
        launch.join_torchrun_group()
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_make_topology_without_a_group() -> None:
    assert make_topology().n_shard == 1 and make_topology(num_shards=4).n_shard == 4
    with pytest.raises(ValueError, match="positive integer"):
        make_topology(num_shards=0)


WORKER = """
import json, os, sys, torch
import torch.distributed as dist
from pykeen_bess.distributed import DistributedTopology, init_from_environment
init_from_environment()
rank = dist.get_rank()
# a subgroup of ranks 1 and 2: group-relative ranks in broadcast and gather
sub = dist.new_group([1, 2])
out = {}
if rank in (1, 2):
    topology = DistributedTopology(sub)
    x = torch.tensor([float(rank)])
    out["broadcast"] = topology.broadcast_(x.clone(), source=1).item()  # group rank 1 = global rank 2
    gathered = topology.gather_shards(torch.tensor([[rank * 10.0]]))
    out["gathered"] = None if gathered is None else gathered.view(-1).tolist()
    out["object"] = topology.broadcast_object(f"from {rank}", source=1)
world = DistributedTopology()
out["complex"] = torch.view_as_real(world.all_reduce(torch.tensor([1 + 1j]) * (rank + 1))).view(-1).tolist()
a, b = world.all_reduce_coalesced([torch.tensor([1.0, 2.0]), torch.tensor([rank], dtype=torch.long)])
out["coalesced"] = [a.tolist(), b.tolist()]
out["max"] = world.all_reduce(torch.tensor([rank]), op="max").item()
out["objects"] = world.all_gather_object(rank * 2)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as file:
    json.dump(out, file)
dist.barrier()
"""


@pytest.mark.slow
def test_distributed_collectives_on_three_gloo_ranks(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = harness.launch(3, [str(script), str(tmp_path)], timeout=120)
    assert results.ok, results.report()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for out in ranks:
        assert out["complex"] == [6.0, 6.0]  # (1 + 1j) * (1 + 2 + 3)
        assert out["coalesced"] == [[3.0, 6.0], [3]]
        assert out["max"] == 2 and out["objects"] == [0, 2, 4]
    assert ranks[1]["broadcast"] == ranks[2]["broadcast"] == 2.0
    assert ranks[1]["gathered"] == [10.0, 20.0] and ranks[2]["gathered"] is None  # on group rank 0 (global 1)
    assert ranks[1]["object"] == ranks[2]["object"] == "from 2"
