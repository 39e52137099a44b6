"""A model left sharded over processes is refused by PyKEEN's saving before a file is written."""

from __future__ import annotations

import pathlib
import pickle
import types

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.models import TransE
from pykeen.pipeline.api import PipelineResult

from pykeen_bess.distributed import LocalTopology
from pykeen_bess.distributed.export import guard_pipeline_results
from pykeen_bess.tables.representation import ShardedEmbedding
from pykeen_bess.data.sharding import EntitySharding
from pykeen_bess.tables.shard_tables import DistributedShardTables


def partial_result() -> PipelineResult:
    """A pipeline result whose model holds shard 0 of 2 of its entity table, as a rank under torchrun does."""
    training = Nations().training
    model = TransE(triples_factory=training, random_seed=0, embedding_dim=4)
    sharding = EntitySharding.create(model.num_entities, 2, seed=0)
    model.entity_representations[0] = ShardedEmbedding(model.entity_representations[0], sharding, local_shards=[0])
    return PipelineResult(
        random_seed=0,
        model=model,
        training=training,
        training_loop=None,
        losses=[1.0],
        metric_results=types.SimpleNamespace(to_dict=dict),  # type: ignore[arg-type]
        train_seconds=0.0,
        evaluate_seconds=0.0,
    )


def test_training_on_part_of_the_shards_guards_pipeline_results(tmp_path: pathlib.Path) -> None:
    # what a DistributedShardTables does when training ends (the model stays sharded)
    DistributedShardTables.uninstall(types.SimpleNamespace(tables=[]))  # type: ignore[arg-type]
    result = partial_result()
    good = tmp_path / PipelineResult.MODEL_FILE_NAME
    torch.save(torch.nn.Linear(2, 2), good)
    before = good.read_bytes()
    with pytest.raises(pickle.PicklingError, match="holds 1 of 2 shards"):
        result.save_to_directory(tmp_path)
    assert good.read_bytes() == before  # the good model is untouched
    assert not (tmp_path / PipelineResult.RESULT_FILE_NAME).exists()  # nothing else written either
    with pytest.raises(pickle.PicklingError, match="holds 1 of 2 shards"):
        result.save_model(good)
    assert good.read_bytes() == before
    # without the model, nothing partial is written: saving the rest works
    result.save_to_directory(tmp_path / "other", save_replicates=False, save_training=False)
    assert (tmp_path / "other" / PipelineResult.RESULT_FILE_NAME).is_file()


class _RankOfTwo(LocalTopology):
    """A process of a two-rank process group (replicas of one shard: the model is whole in both)."""

    def __init__(self, rank: int) -> None:
        super().__init__(1)
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def is_distributed(self) -> bool:
        return True


@pytest.mark.parametrize("rank", [0, 1])
def test_only_the_main_process_writes_a_model_every_process_holds(
    tmp_path: pathlib.Path, rank: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Replicas of one shard hold the same model: rank 0 writes it, the others write nothing (they raced)."""
    import logging

    guard_pipeline_results()
    result = partial_result()
    result.model.entity_representations[0] = result.model.entity_representations[0].base_embedding  # whole
    result.training_loop = types.SimpleNamespace(topology=_RankOfTwo(rank))  # type: ignore[assignment]
    with caplog.at_level(logging.INFO, logger="pykeen_bess"):
        result.save_to_directory(tmp_path / "out")
        result.save_model(tmp_path / "model.pkl")
    written = sorted(p.name for p in tmp_path.iterdir())
    if rank == 0:
        assert written == ["model.pkl", "out"]
        assert (tmp_path / "out" / PipelineResult.RESULT_FILE_NAME).is_file()
    else:
        assert written == [] and "Rank 1 does not write" in caplog.text
