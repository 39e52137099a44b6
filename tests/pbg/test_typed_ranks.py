"""Typed negatives and PyTorch-BigGraph-layout checkpoints on 2 gloo ranks, equal to one process with 2 shards."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import rank_zygote
import torch
from pbg_tools import pbg_scores
from pykeen.training import TrainingCallback
from typed_worker import build_loop

from pykeen_bess import pbg
from pykeen_bess.distributed import harness
from pykeen_bess.pbg import files

pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).with_name("typed_worker.py")


def launch(config: dict[str, Any]) -> harness.RankResults:
    return rank_zygote.launch(2, [str(WORKER), json.dumps(config)], timeout=300, collective_timeout=30)


def results(output: pathlib.Path) -> list[dict[str, Any]]:
    return [torch.load(output / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def reference(num_epochs: int, **config: Any) -> tuple[Any, list[float]]:
    """The same training in one process with 2 logical shards."""
    loop, graph = build_loop(dict(num_shards=2, **config))
    losses: list[float] = []

    class Record(TrainingCallback):
        def on_batch(self, epoch, batch, batch_loss, **kwargs):
            losses.append(batch_loss)

    loop.train(graph.training, num_epochs=num_epochs, batch_size=32, use_tqdm=False, callbacks=Record())
    return loop, losses


def test_ranks_equal_one_process_and_resume_from_their_own_partition_files(tmp_path: pathlib.Path) -> None:
    loop, losses = reference(3)
    # uninterrupted, each rank writing its own partitions
    full = launch(
        dict(output=str(tmp_path / "full"), checkpoint_directory=str(tmp_path / "full-ckpt"), num_epochs=3, export=True)
    )
    assert full.ok, full.report()
    table = loop.model.entity_representations[0]._embeddings.weight.detach()
    for result in results(tmp_path / "full"):
        assert result["losses"] == pytest.approx(losses, rel=1e-9)
        real = result["global_ids"] >= 0
        torch.testing.assert_close(result["table"][real], table[result["global_ids"][real]])
        torch.testing.assert_close(result["relation"], loop.model.relation_representations[0]._embeddings.weight)
    directory = tmp_path / "full-ckpt"
    assert files.read_version(directory) == 3
    assert sorted(p.name for p in directory.glob("bess.pt.v3.*")) == ["bess.pt.v3.rank0-of-2", "bess.pt.v3.rank1-of-2"]
    # PyTorch-BigGraph scores the ranks' partition files as the single process' model
    graph = build_loop(dict(num_shards=2))[1]
    triples = graph.testing.mapped_triples[:12]
    head, _ = pbg_scores(directory, graph.schema, triples)
    with torch.no_grad():
        torch.testing.assert_close(head, loop.model.score_hrt(triples).view(-1).float(), rtol=1e-5, atol=1e-6)
    # a sharded model written by write_checkpoint on its ranks is the single process' model
    exported = pbg.read_checkpoint(tmp_path / "full" / "export", graph)
    with torch.no_grad():
        torch.testing.assert_close(exported.score_hrt(triples), loop.model.score_hrt(triples).float())
    sums = loop.optimizer.state[loop.tables[0].optimizer_parameter]["sum"]
    _, state = files.read_embeddings(files.embeddings_file(tmp_path / "full" / "export", "user", 1, 3))
    ids = graph.schema.partition_range(0, 1)
    expected = sums[loop.tables[0].entity_rows[torch.arange(ids.start, ids.stop)]].float()
    torch.testing.assert_close(state["state"][0]["sum"], expected)
    # killed in epoch 3, resumed from version 2: the same losses and tables
    killed = launch(
        dict(output=str(tmp_path / "killed"), checkpoint_directory=str(tmp_path / "ckpt"), num_epochs=3, die_at=[3, 1])
    )
    assert killed.returncodes[1] == 17 and killed.returncodes[0] != 0
    assert files.read_version(tmp_path / "ckpt") == 2
    resumed = launch(dict(output=str(tmp_path / "resumed"), checkpoint_directory=str(tmp_path / "ckpt"), num_epochs=3))
    assert resumed.ok, resumed.report()
    for before, after in zip(results(tmp_path / "full"), results(tmp_path / "resumed")):
        assert after["losses"] == pytest.approx(before["losses"][-len(after["losses"]) :], rel=1e-9)
        torch.testing.assert_close(after["table"], before["table"])


@pytest.mark.parametrize("exchange", ["embedding", "score"])
def test_ranks_with_step_shared_typed_negatives_equal_one_process(tmp_path: pathlib.Path, exchange: str) -> None:
    """negatives="typed_step" (one set per step, scored once) on 2 gloo ranks equals 2 logical shards."""
    loop, losses = reference(2, negatives="typed_step", exchange=exchange)
    run = launch(dict(output=str(tmp_path), num_epochs=2, negatives="typed_step", exchange=exchange))
    assert run.ok, run.report()
    table = loop.model.entity_representations[0]._embeddings.weight.detach()
    for result in results(tmp_path):
        assert result["losses"] == pytest.approx(losses, rel=1e-9)
        real = result["global_ids"] >= 0
        torch.testing.assert_close(result["table"][real], table[result["global_ids"][real]])
        torch.testing.assert_close(result["relation"], loop.model.relation_representations[0]._embeddings.weight)
