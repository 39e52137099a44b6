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
