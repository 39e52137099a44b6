"""Replica groups on real gloo processes: shards x replicas equal one process with the shards as logical shards.

Four ranks (the shared harness, ``distributed_worker.py``) train ``num_shards x replicas``
layouts; each is compared with a single-process run holding ``num_shards`` logical shards and
the same (global) batch size: the replicas of a shard split the slots of every block, so one step
of all replicas is one step of the single-process plan. All succeeding scenarios run in one
launch. The checkpoint tests also cover distributed checkpoints without replicas (a kill and
resume; resharding to 4 x 1 and 2 x 1 ranks).
"""

from __future__ import annotations

import itertools
import pathlib
import shutil
from typing import Any

import pytest
import torch
from test_distributed import BASE, assemble, check_equals_local_reference, launch
from test_distributed import run_launch as run_launch_with_timeout

pytestmark = pytest.mark.slow

REPLICATED = dict(BASE, digests=True, num_epochs=1)

#: 2 shards x 2 replicas: both groupings x both schemes x three optimizers
GRID = {
    f"{grouping}-{exchange}-{optimizer}": dict(
        REPLICATED, num_shards=2, replicas=2, replica_grouping=grouping, exchange=exchange, optimizer=optimizer
    )
    for grouping, exchange, optimizer in itertools.product(
        ("orthogonal", "consecutive"), ("embedding", "score"), ("adam", "adagrad", "sgd")
    )
}

SCENARIOS: dict[str, dict[str, Any]] = {
    **GRID,
    # one shard, four replicas (pure data parallelism); 18 slots split 5, 5, 5, 3
    "all": dict(REPLICATED, num_shards=1, replicas=4, optimizer="adam", batch_size=18, evaluate=True),
    # metrics, sub-batches, dense updates, clipping, a replicated parameter without gradient in some steps
    "evaluate": dict(REPLICATED, num_shards=2, replicas=2, evaluate=True, predict=True, export=True),
    "sub_batches": dict(REPLICATED, num_shards=2, replicas=2, batch_size=32, sub_batch_size=8),
    # loss weights: the replicas of a shard split every block's weights with its slots
    "weighted": dict(REPLICATED, num_shards=2, replicas=2, batch_size=32, sub_batch_size=8, loss_weighter="relation"),
    "weighted_nssa": dict(
        REPLICATED, num_shards=2, replicas=2, batch_size=32, loss_weighter="subsampling", loss="weightednssa"
    ),
    "dense": dict(REPLICATED, num_shards=2, replicas=2, optimizer="adam", sparse_updates=False),
    # one set of negatives per step, which the replicas of a shard gather for their own slots
    "step_embedding": dict(REPLICATED, num_shards=2, replicas=2, batch_size=32, sub_batch_size=8, negatives="step"),
    "step_score": dict(REPLICATED, num_shards=2, replicas=2, exchange="score", optimizer="adam", negatives="step"),
    "clipping": dict(
        REPLICATED, num_shards=2, replicas=2, replica_grouping="consecutive", gradient_clipping_max_norm=0.05
    ),
    "extra_parameter": dict(REPLICATED, num_shards=2, replicas=2, optimizer="adam", extra_parameter=True),
    # a user's device mesh, in both orders of its dimensions
    "mesh": dict(REPLICATED, num_shards=2, replicas=2, mesh=["replica", "shard"]),
    "mesh_transposed": dict(REPLICATED, num_shards=2, replicas=2, mesh=["shard", "replica"]),
    # replicas=1 said explicitly is the path without replicas, bitwise
    "plain": dict(BASE, batch_size=64),
    "no_replicas": dict(BASE, batch_size=64, replicas=1, replica_grouping="none"),
    # checkpoints to resume and reshard (one per shard; one per replica)
    "checkpoint": dict(REPLICATED, num_shards=2, replicas=2, num_epochs=3, batch_size=32, checkpoint_name="a.pt"),
    "checkpoint_all_replicas": dict(
        REPLICATED, num_shards=2, replicas=2, checkpoint_name="c.pt", checkpoint_retrieval="all_replicas"
    ),
    # ranks that disagree on the layout fail at once, naming the setting
    "disagree": dict(
        REPLICATED, num_shards=2, replicas=2, expect_error=True, rank_overrides={"3": dict(replica_grouping="all")}
    ),
}


def run_launch(world_size: int, output: pathlib.Path, runs: dict[str, dict[str, Any]]) -> dict[str, list[dict]]:
    return run_launch_with_timeout(world_size, output, runs, timeout=600)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    output = tmp_path_factory.mktemp("replicas")
    runs = {
        name: dict(config, checkpoint_directory=str(output / "checkpoints")) if "checkpoint_name" in config else config
        for name, config in SCENARIOS.items()
    }
    return dict(run_launch(4, output, runs), output=output)


def check_replicas_identical(results: list[dict[str, Any]]) -> None:
    """The replicas of every shard hold bitwise identical tables and optimizer state after every step."""
    by_shard: dict[int, list[dict[str, Any]]] = {}
    for result in results:
        by_shard.setdefault(result["shard"], []).append(result)
    for shard, replicas in by_shard.items():
        assert sorted(r["replica"] for r in replicas) == list(range(len(replicas)))
        first = replicas[0]
        assert first["digests"], "no step recorded"
        for other in replicas[1:]:
            assert other["digests"] == first["digests"], f"the replicas of shard {shard} diverged"
            assert torch.equal(other["table"], first["table"])


def check_equals_reference(name: str, results: list[dict[str, Any]]):
    config = SCENARIOS[name]
    single = {k: v for k, v in config.items() if k not in ("replicas", "replica_grouping", "mesh")}
    loop, dataset = check_equals_local_reference(results, single, config["num_shards"])
    # the optimizer state of every shard equals the reference's rows of the same entities
    reference_state = loop.optimizer.state.get(loop.tables[0].weight, {})
    for result in results:
        shard_rows = loop.tables[0].shard_tables()  # [n, S, d] views of the reference's state layout
        assert result["table"].shape == shard_rows.shape[1:]
        for key, value in result["optimizer_state"].items():
            expected = reference_state[key].view(*shard_rows.shape)[result["shard"]]
            torch.testing.assert_close(value, expected)
    check_replicas_identical(results)
    return loop, dataset


@pytest.mark.parametrize("name", sorted(GRID))
def test_two_shards_by_two_replicas_equal_two_logical_shards(replicated: dict[str, Any], name: str) -> None:
    check_equals_reference(name, replicated[name])


@pytest.mark.parametrize(
    "name",
    [
        "sub_batches",
        "weighted",
        "weighted_nssa",
        "step_embedding",
        "step_score",
        "dense",
        "clipping",
        "extra_parameter",
        "mesh",
        "mesh_transposed",
    ],
)
def test_replicas_equal_the_reference_with(replicated: dict[str, Any], name: str) -> None:
    loop, _ = check_equals_reference(name, replicated[name])
    if name == "extra_parameter":
        for result in replicated[name]:
            torch.testing.assert_close(result["extra"], loop.model.extra.detach())


@pytest.mark.parametrize("name", ["orthogonal-embedding-adam", "dense"])
def test_replica_traffic_within_the_cost_model(replicated: dict[str, Any], name: str) -> None:
    """Both train on the static step, which all-gathers the rows of every replica for dense updates, too."""
    from pykeen_bess.schemes import replica_cost

    config = SCENARIOS[name]
    for result in replicated[name]:
        steps = len(result["step_losses"])
        bound = replica_cost(
            n_shard=2,
            replicas=2,
            replica_block_size=config["batch_size"] // 4 // 2,
            num_negs_per_pos=config["num_negs_per_pos"],
            entity_width=8,
            shard_size=result["shard_size"],
            element_size=8,  # float64
        )
        assert 0 < result["replica_bytes"] <= bound * steps


def test_one_shard_by_four_replicas_equals_one_process(replicated: dict[str, Any]) -> None:
    results = replicated["all"]
    loop, dataset = check_equals_reference("all", results)
    assert [r["shard"] for r in results] == [0, 0, 0, 0]
    check_metrics(results, loop, dataset)


def check_metrics(results: list[dict[str, Any]], loop: Any, dataset: Any) -> None:
    from pykeen_bess.evaluation import BessEvaluator

    expected = (
        BessEvaluator()
        .evaluate(
            loop.model,
            dataset.testing.mapped_triples,
            additional_filter_triples=[dataset.training.mapped_triples],
            use_tqdm=False,
        )
        .to_flat_dict()
    )
    for result in results:  # identical on every rank, equal to the single-process evaluator
        assert result["metrics"] == results[0]["metrics"]
        assert result["metrics"] == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_metrics_prediction_and_export_with_replicas(replicated: dict[str, Any]) -> None:
    results = replicated["evaluate"]
    loop, dataset = check_equals_reference("evaluate", results)
    check_metrics(results, loop, dataset)
    from pykeen_bess import predict_top_k

    expected = predict_top_k(
        loop.model, dataset.testing.mapped_triples[:7, :2], k=5, filter_triples=dataset.training.mapped_triples
    )
    for result in results:
        assert result["top_k"]["tail_id"] == expected["tail_id"].tolist()
        assert result["top_k"]["score"] == pytest.approx(expected["score"].tolist(), rel=1e-9)
    model = torch.load(replicated["output"] / "evaluate" / "model.pt", weights_only=False)
    torch.testing.assert_close(
        model.entity_representations[0]._embeddings.weight, loop.model.entity_representations[0]._embeddings.weight
    )


@pytest.mark.parametrize(
    ("name", "shard_groups", "replica_groups"),
    [
        # orthogonal (the default): shard groups are consecutive ranks, replicas a stride of 2
        ("orthogonal-embedding-adam", [[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),
        ("consecutive-embedding-adam", [[0, 2], [1, 3], [0, 2], [1, 3]], [[0, 1], [0, 1], [2, 3], [2, 3]]),
        ("mesh", [[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),
        ("all", [[0], [1], [2], [3]], [[0, 1, 2, 3]] * 4),
        ("no_replicas", [[0, 1, 2, 3]] * 4, [None] * 4),
    ],
)
def test_each_ranks_groups(replicated: dict[str, Any], name: str, shard_groups: list, replica_groups: list) -> None:
    results = replicated[name]
    assert [r["groups"]["shard_group"] for r in results] == shard_groups
    assert [r["groups"]["replica_group"] for r in results] == replica_groups


def test_replicas_one_is_the_path_without_replicas_bitwise(replicated: dict[str, Any]) -> None:
    plain, explicit = replicated["plain"], replicated["no_replicas"]
    for a, b in zip(plain, explicit):
        assert a["step_losses"] == b["step_losses"]
        assert torch.equal(a["table"], b["table"]) and torch.equal(a["relation"], b["relation"])


def test_ranks_that_disagree_on_the_layout_fail_before_training(replicated: dict[str, Any]) -> None:
    for result in replicated["disagree"]:
        assert "different configurations" in result["error"]
        assert "replica_grouping: rank 0=None, rank 1=None, rank 2=None, rank 3=all" in result["error"]
        assert "step_losses" not in result


@pytest.fixture(scope="module")
def resumed(replicated: dict[str, Any]) -> dict[str, Any]:
    """Kill a 2x2 run in epoch 2, then resume it, reshard the finished checkpoint and load a tampered one."""
    output = replicated["output"]
    checkpoints = output / "checkpoints"
    crashed = dict(SCENARIOS["checkpoint"], checkpoint_name="b.pt", checkpoint_directory=str(checkpoints))
    codes, _, _ = launch(4, dict(crashed, output=str(output / "crashed"), die_ranks=[0, 1, 2, 3], die_at=[2, 0]))
    assert codes == [17] * 4
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("b.pt")) == [
        "b.pt",
        "b.pt.v1.rank0-of-2",
        "b.pt.v1.rank1-of-2",
    ]
    # the finished 2x2 checkpoint, copied once per resharding (loading it writes a new version)
    for target in ("4x1", "1x4", "2x1"):
        (output / target).mkdir()
        for file in checkpoints.glob("a.pt*"):
            shutil.copy(file, output / target / file.name)
    # a replica's file of the all-replicas checkpoint is changed
    tampered = checkpoints / "c.pt.v1.rank1-of-2.replica1-of-2"
    state = torch.load(tampered, weights_only=False)
    key = next(k for k in state["model_state_dict"] if "entity_representations" in k)
    state["model_state_dict"][key][0, 0] += 1.0
    torch.save(state, tampered)
    base = dict(REPLICATED, num_epochs=3, checkpoint_name="a.pt")
    runs = {
        "resume": crashed,
        "4x1": dict(base, batch_size=64, checkpoint_directory=str(output / "4x1")),
        "1x4": dict(base, num_shards=1, replicas=4, checkpoint_directory=str(output / "1x4")),
        "tampered": dict(
            SCENARIOS["checkpoint_all_replicas"], checkpoint_directory=str(checkpoints), expect_error=True
        ),
    }
    results = run_launch(4, output / "resumed", runs)
    results.update(run_launch(2, output / "two", {"2x1": dict(base, checkpoint_directory=str(output / "2x1"))}))
    return results


def test_a_killed_replicated_run_resumes_identically(replicated: dict[str, Any], resumed: dict[str, Any]) -> None:
    full, again = replicated["checkpoint"], resumed["resume"]
    steps_per_epoch = len(full[0]["step_losses"]) // 3
    for result in again:
        assert result["step_losses"] == pytest.approx(full[0]["step_losses"][steps_per_epoch:], rel=1e-9)
        assert result["epoch_losses"] == pytest.approx(full[0]["epoch_losses"], rel=1e-9)
    torch.testing.assert_close(assemble(again, 14), assemble(full, 14), rtol=0, atol=0)
    check_replicas_identical(again)


@pytest.mark.parametrize(("layout", "ranks"), [("4x1", 4), ("1x4", 4), ("2x1", 2)])
def test_a_replicated_checkpoint_reshards(
    replicated: dict[str, Any], resumed: dict[str, Any], layout: str, ranks: int
) -> None:
    results = resumed[layout]
    assert len(results) == ranks
    for result in results:
        assert result["step_losses"] == []  # the checkpoint is finished: nothing left to train
    torch.testing.assert_close(assemble(results, 14), assemble(replicated["checkpoint"], 14), rtol=0, atol=0)


def test_all_replicas_checkpoints_detect_a_tampered_replica(resumed: dict[str, Any]) -> None:
    for result in resumed["tampered"]:
        assert "The replicas of shard 1" in result["error"] and "hold different values" in result["error"]
        assert "ranks [1]; ranks [3]" in result["error"] or "ranks [3]; ranks [1]" in result["error"]


def test_the_command_line_with_replicas_equals_one_process(tmp_path: pathlib.Path) -> None:
    """``torchrun ... -m pykeen_bess train --num-shards 1 --replicas 2`` equals one process with one shard."""
    import json
    import subprocess
    import sys

    from pykeen_bess.distributed import harness

    common = ["-m", "pykeen_bess", "train", "--quiet", "--json"]
    flags = ["--dataset", "nations", "--model", "DistMult", "--epochs", "2", "--batch-size", "64", "--seed", "3"]
    replicated = harness.torchrun(
        2, [*common, *flags, "--num-shards", "1", "--replicas", "2", "--replica-grouping", "all"], cwd=tmp_path
    )
    assert replicated.returncode == 0, replicated.stderr[-3000:]
    single = subprocess.run(
        [sys.executable, *common, *flags, "--num-shards", "1"], capture_output=True, text=True, cwd=tmp_path
    )
    assert single.returncode == 0, single.stderr[-3000:]
    # printed once, by rank 0
    assert json.loads(replicated.stdout) == pytest.approx(json.loads(single.stdout), rel=1e-5, abs=1e-7)
