"""Checkpoints and early stopping of the encoding partition over 2 and 4 gloo ranks, equal to one process.

The encoding partition's checkpoints are the token partition's files of the row shards its column
parts make: they resume with the encoding partition on the same or another number of processes, and
with the token partition. Early stopping evaluates those row shards. Every run is compared with the
one-process run of one token shard (the encoding partition's reference) or, for the token partition
over 2 ranks, of 2 logical shards.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import rank_zygote
import torch
from column_checkpoint_worker import train_phase
from encoding_worker import build_loop


pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).with_name("column_checkpoint_worker.py")
STOPPER = dict(frequency=1, patience=1, metric="inverse_harmonic_mean_rank")

#: the scenarios of each world size (one launch each): phases of fresh loops
SCENARIOS: dict[int, dict[str, list[dict[str, Any]]]] = {
    2: {
        # two epochs, then a new loop resumes the checkpoint and trains the third
        "resumed": [dict(num_epochs=2, checkpoint="c.pt"), dict(num_epochs=3, checkpoint="c.pt")],
        # the token partition on the same ranks loads the files as its own (nothing left to train)
        "to-token": [dict(num_epochs=2, checkpoint="c.pt"), dict(partition="token", num_epochs=2, checkpoint="c.pt")],
        "early-stopping": [dict(num_epochs=8, stopper=STOPPER)],
        # the column parts (and the row shards lent meanwhile) in a storage tier
        "resumed-mmap": [
            dict(num_epochs=2, checkpoint="c.pt", storage="mmap"),
            dict(num_epochs=3, checkpoint="c.pt", storage="mmap"),
        ],
        "early-stopping-mmap": [dict(num_epochs=8, stopper=STOPPER, storage="mmap")],
        "early-stopping-token": [dict(partition="token", num_epochs=10, stopper=STOPPER)],  # (stops at 9)
    },
    4: {
        # written by 2 of the ranks (2 column parts), resumed by 4 (4 column parts): one accumulator per whole
        # row, the same on every part, one value per row in the files
        "resharded-rowwise": [
            dict(ranks=2, num_epochs=2, checkpoint="c.pt", optimizer="rowwise_adagrad"),
            dict(num_epochs=3, checkpoint="c.pt", optimizer="rowwise_adagrad"),
        ],
        # and by the token partition on 3 of the ranks: resharded from 2 row shards to 3
        "resharded-to-token": [
            dict(ranks=2, num_epochs=2, checkpoint="c.pt"),
            dict(ranks=3, partition="token", num_epochs=2, checkpoint="c.pt"),
        ],
        "resharded-rowwise-to-token": [
            dict(ranks=2, num_epochs=2, checkpoint="c.pt", optimizer="rowwise_adagrad"),
            dict(ranks=3, partition="token", num_epochs=2, checkpoint="c.pt", optimizer="rowwise_adagrad"),
        ],
        # 2 column parts x 2 replicas (the first replica of each part writes its row shard's file), resumed
        # by 4 column parts without replicas (resharded from 2 row shards to 4)
        "replicas-resharded": [
            dict(num_epochs=2, checkpoint="c.pt", replicas=2),
            dict(num_epochs=3, checkpoint="c.pt"),
        ],
        "replicas-early-stopping": [dict(num_epochs=8, stopper=STOPPER, replicas=2)],
        "replicas-mmap": [
            dict(num_epochs=2, checkpoint="c.pt", replicas=2, storage="mmap"),
            dict(num_epochs=3, checkpoint="c.pt", replicas=2, storage="mmap"),
        ],
        # every replica writes its file; resuming checks that the replicas of each part agree
        "replicas-all-files": [
            dict(num_epochs=2, checkpoint="c.pt", replicas=2, checkpoint_retrieval="all_replicas"),
            dict(num_epochs=3, checkpoint="c.pt", replicas=2, checkpoint_retrieval="all_replicas"),
        ],
        # a replica's file changed: the replicas of part 1 disagree (checked on the row shards loaded)
        "replicas-tampered": [
            dict(
                num_epochs=2,
                checkpoint="c.pt",
                replicas=2,
                checkpoint_retrieval="all_replicas",
                tamper="c.pt.v*.rank1-of-2.replica1-of-2",
            ),
            dict(num_epochs=3, checkpoint="c.pt", replicas=2, checkpoint_retrieval="all_replicas", expect_error=True),
        ],
    },
}


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any]]:
    world_size = request.param
    output = tmp_path_factory.mktemp(f"columns{world_size}")
    config = dict(output=str(output), runs=SCENARIOS[world_size])
    results = rank_zygote.launch(world_size, [str(WORKER), json.dumps(config)], timeout=600)
    assert results.ok, results.report()
    loaded = {
        name: dict(
            ranks=[torch.load(output / name / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)],
            model=torch.load(output / name / "model.pt", weights_only=False)
            if (output / name / "model.pt").exists()
            else None,
        )
        for name in SCENARIOS[world_size]
    }
    return world_size, loaded


def reference(
    num_epochs: int, num_shards: int = 1, stopper: dict | None = None, optimizer: str = "adam"
) -> tuple[Any, list[float], Any]:
    """The one-process run: the loop, its step losses and its stopper."""
    loop = build_loop(dict(model="DistMult", optimizer=optimizer), num_shards, "token")
    phase: dict[str, Any] = dict(num_epochs=num_epochs)
    if stopper is not None:
        phase["stopper"] = stopper
    losses, made = train_phase(loop, phase, None)
    return loop, losses, made


def assert_same_model(exported: torch.nn.Module, model: torch.nn.Module) -> None:
    for ours, theirs in zip(exported.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def assert_same_token_state(state: dict[str, Any], loop: Any) -> None:
    """A token rank's rows and Adam moments equal the one-process run's rows of the same entities."""
    table = loop.tables[0]
    ids = state["ids"]
    rows = table.entity_rows[ids[ids >= 0]]
    torch.testing.assert_close(state["rows"][ids >= 0], table.weight.detach()[rows], rtol=1e-10, atol=1e-12)
    expected = loop.optimizer.state[table.optimizer_parameter]
    assert sorted(state["state"]) == sorted(name for name, value in expected.items() if value.ndim > 0)
    for name, value in state["state"].items():
        torch.testing.assert_close(value[ids >= 0], expected[name][rows], rtol=1e-10, atol=1e-12)


def scenario_of(world_size: int, name: str) -> list[dict[str, Any]]:
    """The phases of a scenario of this launch (skip the test on the launches without it)."""
    if name not in SCENARIOS[world_size]:
        pytest.skip(f"no {name} on {world_size} ranks")
    return SCENARIOS[world_size][name]


RESUMED = ["resumed", "resumed-mmap", "resharded-rowwise", "replicas-resharded", "replicas-all-files", "replicas-mmap"]


@pytest.mark.parametrize("name", RESUMED)
def test_a_resumed_checkpoint_continues_as_one_process(ranks: tuple[int, dict[str, Any]], name: str) -> None:
    """Resumed on the same or another number of column parts (and replicas): the remaining steps and the model."""
    world_size, results = ranks
    first, last = scenario_of(world_size, name)
    loop, losses, _ = reference(3, optimizer=last.get("optimizer", "adam"))
    steps_per_epoch = len(losses) // 3
    for rank, result in enumerate(results[name]["ranks"]):
        # a rank that did not write the checkpoint joins for the third epoch
        expected = losses if rank < first.get("ranks", world_size) else losses[2 * steps_per_epoch :]
        assert result["step_losses"] == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert_same_model(results[name]["model"], loop.model)


@pytest.mark.parametrize("name", ["to-token", "resharded-to-token", "resharded-rowwise-to-token"])
def test_the_token_partition_resumes_the_checkpoint(ranks: tuple[int, dict[str, Any]], name: str) -> None:
    """On the same number of processes (its own files) and on another (resharded): rows, optimizer state, model."""
    world_size, results = ranks
    first, last = scenario_of(world_size, name)
    loop, losses, _ = reference(2, optimizer=last.get("optimizer", "adam"))
    for rank, result in enumerate(results[name]["ranks"][: last.get("ranks", world_size)]):
        expected = losses if rank < first.get("ranks", world_size) else []  # nothing left to train
        assert result["step_losses"] == pytest.approx(expected, rel=1e-10, abs=1e-12)
        assert_same_token_state(result["token_state"], loop)
    assert_same_model(results[name]["model"], loop.model)


@pytest.mark.parametrize(
    "name", ["early-stopping", "early-stopping-token", "early-stopping-mmap", "replicas-early-stopping"]
)
def test_early_stopping_equals_one_process(ranks: tuple[int, dict[str, Any]], name: str) -> None:
    """The stopper's evaluations, its stop and the best epoch's model restored (token: 2 logical shards)."""
    world_size, results = ranks
    (phase,) = scenario_of(world_size, name)
    num_shards = world_size if phase.get("partition") == "token" else 1
    loop, losses, stopper = reference(phase["num_epochs"], num_shards=num_shards, stopper=STOPPER)
    assert stopper.stopped and stopper.best_epoch < len(stopper.results)  # the best epoch is restored
    for result in results[name]["ranks"]:
        assert result["step_losses"] == pytest.approx(losses, rel=1e-10, abs=1e-12)
        assert result["stopper"]["best_epoch"] == stopper.best_epoch
        assert result["stopper"]["results"] == pytest.approx(stopper.results, rel=1e-9)
    assert_same_model(results[name]["model"], loop.model)


def test_a_changed_replica_file_is_found(ranks: tuple[int, dict[str, Any]]) -> None:
    """With every replica's file, resuming compares the replicas' row shards (not the column parts' old values)."""
    world_size, results = ranks
    scenario_of(world_size, "replicas-tampered")
    for result in results["replicas-tampered"]["ranks"]:
        assert "The replicas of shard 1" in result["error"] and "hold different values" in result["error"]
