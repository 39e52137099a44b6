"""Who writes a model's outputs: the main process of a declared topology, never a process-global guess."""

from __future__ import annotations

import pathlib
import types

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.models import DistMult

from pykeen_bess import pbg
from pykeen_bess.data.sharding import EntitySharding
from pykeen_bess.distributed import LocalTopology, export
from pykeen_bess.distributed.export import export_model, gathered_model, writer_topology
from pykeen_bess.tables.representation import ShardedEmbedding


class SecondProcess(LocalTopology):
    """A topology in which this process is rank 1 (not the main process): it writes nothing."""

    @property
    def rank(self) -> int:
        return 1


def whole_model() -> DistMult:
    return DistMult(triples_factory=Nations().training, embedding_dim=4, random_seed=0)


def sharded_model(topology: LocalTopology) -> DistMult:
    model = whole_model()
    sharding = EntitySharding.create(model.num_entities, 2, seed=0)
    table = ShardedEmbedding(model.entity_representations[0], sharding, local_shards=[0, 1])
    table.topology = topology
    model.entity_representations[0] = table
    return model


def test_the_writing_topology_is_the_given_one_then_the_loops_then_the_tables() -> None:
    given, loops, tables = LocalTopology(1), LocalTopology(2), LocalTopology(2)
    model = sharded_model(tables)
    loop = types.SimpleNamespace(topology=loops)
    assert writer_topology(model, loop, given) is given
    assert writer_topology(model, loop) is loops
    assert writer_topology(model) is tables
    alone = writer_topology(whole_model())
    assert isinstance(alone, LocalTopology) and alone.is_main_process


def test_a_whole_model_in_a_process_group_without_a_topology_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setattr(export, "world_size", lambda: 2)  # as under torchrun with 2 ranks
    model = whole_model()
    with pytest.raises(ValueError, match="whole in each of the 2 processes"):
        writer_topology(model)
    with pytest.raises(ValueError, match="whole in each of the 2 processes"):
        export_model(model, tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()
    # declared: this one process writes
    export_model(model, tmp_path / "model.pt", topology=LocalTopology(1))
    assert (tmp_path / "model.pt").is_file()


def test_only_the_main_process_of_the_topology_gets_and_writes_the_model(tmp_path: pathlib.Path) -> None:
    model = whole_model()
    with gathered_model(model, SecondProcess(1)) as full:
        assert full is None
    with gathered_model(model, LocalTopology(1)) as full:
        assert full is model
    export_model(model, tmp_path / "model.pt", topology=SecondProcess(1))
    assert not (tmp_path / "model.pt").exists()
    sharded = sharded_model(SecondProcess(2))  # the tables' topology decides for a sharded model
    with gathered_model(sharded) as full:
        assert full is None


def test_a_pytorch_biggraph_checkpoint_is_written_by_the_main_process_only(tmp_path: pathlib.Path) -> None:
    from typed_graphs import typed_graph

    graph = typed_graph()
    model = DistMult(triples_factory=graph.training, embedding_dim=4, random_seed=0)
    pbg.write_checkpoint(model, graph, tmp_path / "other", version=1, topology=SecondProcess(1))
    assert not (tmp_path / "other").exists()
    pbg.write_checkpoint(model, graph, tmp_path / "main", version=1, topology=LocalTopology(1))
    assert (tmp_path / "main" / "checkpoint_version.txt").read_text() == "1\n"
    with torch.no_grad():
        expected = model.score_hrt(graph.training.mapped_triples[:8])
        again = pbg.read_checkpoint(tmp_path / "main", graph).score_hrt(graph.training.mapped_triples[:8])
    torch.testing.assert_close(again, expected, rtol=1e-6, atol=1e-6)
