"""Real multi-process BESS: gloo process groups on loopback, one process per rank (the shared harness).

Each test starts the ranks as separate interpreters (``distributed_worker.py``, with the
environment ``torchrun`` would set) and compares what they wrote with a single-process run that
holds the same number of logical shards.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import pytest
import rank_zygote
import torch
from distributed_worker import build_loop, small_factory

from pykeen_bess.distributed import harness

pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).with_name("distributed_worker.py")


def launch(world_size: int, config: dict[str, Any], timeout: float = 300, collective_timeout: float = 60):
    """Start one process per rank of the worker; return (return codes, stderr texts, seconds until all exited)."""
    results = rank_zygote.launch(
        world_size, [str(WORKER), json.dumps(config)], timeout=timeout, collective_timeout=collective_timeout
    )
    return results.returncodes, results.stderr, results.seconds


def run_ok(world_size: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    codes, errors, _ = launch(world_size, config)
    assert codes == [0] * world_size, "\n\n".join(errors)
    return [
        torch.load(pathlib.Path(config["output"]) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)
    ]


def assemble(results: list[dict[str, Any]], num_entities: int) -> torch.Tensor:
    """The full entity table from the ranks' shards, in global order."""
    width = results[0]["table"].shape[1]
    table = torch.full((num_entities, width), float("nan"), dtype=results[0]["table"].dtype)
    for result in results:
        real = result["global_ids"] >= 0
        table[result["global_ids"][real]] = result["table"][real]
    return table


def local_reference(config: dict[str, Any], num_shards: int, static_step: bool | None = False):
    """The same training in one process with ``num_shards`` logical shards, on the eager step by default.

    The ranks train on the static step (the default wherever it applies), so their equality with this
    reference is also the static step's with the eager one.
    """
    factory, dataset = small_factory(config.get("num_triples", 300))
    loop = build_loop({**config, "num_shards": num_shards, "static_step": static_step}, factory)
    losses: list[float] = []

    from pykeen.training import TrainingCallback

    class Record(TrainingCallback):
        def on_batch(self, epoch, batch, batch_loss, **kwargs):
            losses.append(batch_loss)

    epoch_losses = loop.train(
        factory,
        num_epochs=config["num_epochs"],
        batch_size=config["batch_size"],
        sub_batch_size=config.get("sub_batch_size"),
        use_tqdm=False,
        callbacks=Record(),
        gradient_clipping_max_norm=config.get("gradient_clipping_max_norm"),
    )
    return loop, epoch_losses, losses, dataset


BASE = dict(num_negs_per_pos=4, batch_size=16, num_epochs=2)

#: the scenarios that succeed, by world size: each world size is launched once (see the fixtures)
SCENARIOS = {
    2: dict(
        embedding=dict(BASE, exchange="embedding", batch_size=4 * 2**2),
        score=dict(BASE, exchange="score", batch_size=4 * 2**2),
        sub_batches=dict(BASE, sub_batch_size=8, batch_size=16, evaluate=True),
        extra_parameter=dict(BASE, extra_parameter=True, optimizer="adam", num_epochs=2),
        export=dict(BASE, export=True),
        # PyKEEN's softplus divides its weighted mean by the weights' sum: exact over ranks and sub-batches
        weighted=dict(BASE, sub_batch_size=2, loss_weighter="relation"),
        weighted_nssa=dict(BASE, sub_batch_size=2, loss_weighter="subsampling", loss="weightednssa"),
        # one set of negatives per step: all-gathered (embedding) or scored in one product per shard (score)
        step_embedding=dict(BASE, exchange="embedding", negatives="step", sub_batch_size=8),
        step_score=dict(BASE, exchange="score", negatives="step"),
        # the eager step over ranks (what trains the configurations the static step cannot)
        eager=dict(BASE, exchange="embedding", static_step=False, sub_batch_size=8),
        clipping=dict(BASE, exchange="score", gradient_clipping_max_norm=0.05, count_ops=True),
        # tables in host memory, every step's rows staged into buffers around it (what a GPU does)
        staged_host=dict(BASE, exchange="score", storage="host", stage_rows=True),
        # TransE's gradients are piecewise constant: a rounding difference flips signs and the runs drift apart
        transe=dict(BASE, model="TransE", loss="marginranking", float32=True, negatives="step", num_epochs=8),
    ),
    4: dict(
        embedding=dict(BASE, exchange="embedding", batch_size=4 * 4**2),
        score=dict(BASE, exchange="score", batch_size=4 * 4**2),
        step_embedding=dict(BASE, exchange="embedding", negatives="step", batch_size=4 * 4**2),
        step_score=dict(BASE, exchange="score", negatives="step", batch_size=4 * 4**2),
    ),
}


def run_launch(
    world_size: int, output: pathlib.Path, runs: dict[str, dict[str, Any]], timeout: float = 300
) -> dict[str, list[dict[str, Any]]]:
    """Run several scenarios in one launch (one process group); return each scenario's rank results."""
    codes, errors, _ = launch(world_size, dict(output=str(output), runs=runs), timeout=timeout)
    assert codes == [0] * world_size, "\n\n".join(errors)
    return {
        name: [torch.load(output / name / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
        for name in runs
    }


def launch_scenarios(world_size: int, output: pathlib.Path) -> dict[str, list[dict[str, Any]]]:
    """Run all scenarios of a world size in one launch; return each scenario's rank results."""
    return run_launch(world_size, output, SCENARIOS[world_size])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    output = tmp_path_factory.mktemp("two-ranks")
    return dict(launch_scenarios(2, output), output=output)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    output = tmp_path_factory.mktemp("four-ranks")
    return dict(launch_scenarios(4, output), output=output)


def check_equals_local_reference(results: list[dict[str, Any]], config: dict[str, Any], num_shards: int):
    """The ranks' losses, assembled entity table and relations equal one process with ``num_shards`` logical shards.

    :returns: the reference loop and dataset
    """
    loop, epoch_losses, step_losses, dataset = local_reference(config, num_shards)
    for result in results:  # every rank reports the same (global) losses
        assert result["step_losses"] == pytest.approx(step_losses, rel=1e-9)
        assert result["epoch_losses"] == pytest.approx(epoch_losses, rel=1e-9)
    # the shards put together are the single-process model's entity table; relations agree
    model = loop.model
    torch.testing.assert_close(
        assemble(results, model.num_entities), model.entity_representations[0]._embeddings.weight
    )
    for result in results:
        torch.testing.assert_close(result["relation"], model.relation_representations[0]._embeddings.weight)
    return loop, dataset


@pytest.mark.parametrize(("world_size", "exchange"), [(2, "embedding"), (2, "score"), (4, "embedding"), (4, "score")])
def test_ranks_equal_logical_shards(request: pytest.FixtureRequest, world_size: int, exchange: str) -> None:
    results = request.getfixturevalue("two_ranks" if world_size == 2 else "four_ranks")[exchange]
    loop, _ = check_equals_local_reference(results, SCENARIOS[world_size][exchange], world_size)
    # each rank holds only its shard of the entity table
    shard_size = loop.sharding.shard_size
    for result in results:
        assert result["table"].shape == (shard_size, 8)
        assert result["entity_parameter_numel"] == shard_size * 8


@pytest.mark.parametrize(("world_size", "exchange"), [(2, "embedding"), (2, "score"), (4, "embedding"), (4, "score")])
def test_step_shared_negatives_on_ranks_equal_logical_shards(
    request: pytest.FixtureRequest, world_size: int, exchange: str
) -> None:
    """negatives="step" (the schemes' one-set path: all-gather, one product per shard) on gloo ranks."""
    scenario = f"step_{exchange}"
    results = request.getfixturevalue("two_ranks" if world_size == 2 else "four_ranks")[scenario]
    check_equals_local_reference(results, SCENARIOS[world_size][scenario], world_size)
    _, _, per_block, _ = local_reference({**SCENARIOS[world_size][scenario], "negatives": "uniform"}, world_size)
    assert results[0]["step_losses"] != pytest.approx(per_block, rel=1e-6)  # other negatives: another run


@pytest.mark.parametrize("scenario", ["eager", "clipping"])
def test_eager_and_clipped_steps_on_ranks_equal_logical_shards(two_ranks: dict[str, Any], scenario: str) -> None:
    """The eager step over ranks (sub-batches), and the static step with clipping by the global norm."""
    check_equals_local_reference(two_ranks[scenario], SCENARIOS[2][scenario], 2)


def test_staged_host_tables_on_ranks_equal_logical_shards(two_ranks: dict[str, Any]) -> None:
    """Host tables whose rows every rank stages around its steps (as on a GPU) train as one process does.

    The reference: host tables in one process with two logical shards, on the eager step.
    """
    config = SCENARIOS[2]["staged_host"]
    loop, epoch_losses, step_losses, _ = local_reference(config, 2)
    results = two_ranks["staged_host"]
    for result in results:
        assert result["staged"]
        assert result["step_losses"] == pytest.approx(step_losses, rel=1e-9)
        assert result["epoch_losses"] == pytest.approx(epoch_losses, rel=1e-9)
        torch.testing.assert_close(result["relation"], loop.model.relation_representations[0]._embeddings.weight)
    torch.testing.assert_close(assemble(results, loop.model.num_entities), loop.tables[0].full_table())


def test_transe_on_two_ranks_equals_two_logical_shards_bitwise(two_ranks: dict[str, Any]) -> None:
    """float32 TransE: one process sums its shards' scores and shared rows' gradients per shard, as two ranks do.

    The loss is a sum scaled once (the same per-value gradient in every topology). With one joint sum over both
    shards the gradients rounded otherwise, and TransE's sign-valued gradients let an ulp grow into a different
    run (1e-2 filtered MRR). The tables are equal bitwise; the reported losses (summed over the ranks by an
    all-reduce, over the shards in one process) round apart by an ulp or so.
    """
    config = SCENARIOS[2]["transe"]
    loop, epoch_losses, step_losses, _ = local_reference(config, 2, static_step=None)  # the same step as the ranks
    results = two_ranks["transe"]
    for result in results:
        assert result["step_losses"] == pytest.approx(step_losses, rel=1e-5)
        assert result["epoch_losses"] == pytest.approx(epoch_losses, rel=1e-5)
        assert torch.equal(result["relation"], loop.model.relation_representations[0]._embeddings.weight.detach())
    table = loop.model.entity_representations[0]._embeddings.weight.detach()
    assert torch.equal(assemble(results, loop.model.num_entities), table)


def test_the_static_step_on_ranks_reads_nothing_on_the_host(two_ranks: dict[str, Any]) -> None:
    """Every step kind on every rank: no synchronising operator (its collectives have fixed shapes), a bounded count.

    The score-moving scheme with clipping by the global norm (the clipping norm's all-reduce and the loss's are
    the step's only scalar collectives); about 400 operators, as in one process.
    """
    for result in two_ranks["clipping"]:
        counts = result["static_step_ops"]
        assert len(counts) >= 2  # the full steps and at least one padded kind
        for count in counts.values():
            assert count["synchronising"] == []
            assert 0 < count["total"] <= 480, count


@pytest.mark.parametrize("scenario", ["weighted", "weighted_nssa"])
def test_loss_weights_under_a_process_group(two_ranks: dict[str, Any], scenario: str) -> None:
    """Loss weights (PyKEEN's relation weighter with softplus; Sun et al.'s subsampling weights with the
    weighted NSSA): the ranks (in sub-batches) equal one process, and the weights change the run."""
    config = SCENARIOS[2][scenario]
    check_equals_local_reference(two_ranks[scenario], config, 2)
    _, _, unweighted, _ = local_reference({**config, "loss_weighter": None}, 2)
    assert two_ranks[scenario][0]["step_losses"] != pytest.approx(unweighted, rel=1e-6)


def test_sub_batches_and_metrics_under_a_process_group(two_ranks: dict[str, Any]) -> None:
    results = two_ranks["sub_batches"]
    loop, _, step_losses, dataset = local_reference(SCENARIOS[2]["sub_batches"], 2)
    assert results[0]["step_losses"] == pytest.approx(step_losses, rel=1e-9)
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
    for result in results:
        assert result["metrics"] == pytest.approx(expected, rel=1e-9)


def test_a_replicated_parameter_without_gradient_is_skipped_as_in_one_process(two_ranks: dict[str, Any]) -> None:
    """A replicated parameter with a gradient in every other step only: Adam skips it in the others, everywhere."""
    results = two_ranks["extra_parameter"]
    loop, _, step_losses, _ = local_reference(SCENARIOS[2]["extra_parameter"], 2)
    assert results[0]["step_losses"] == pytest.approx(step_losses, rel=1e-9)
    for result in results:
        torch.testing.assert_close(result["extra"], loop.model.extra.detach())
    torch.testing.assert_close(
        assemble(results, loop.model.num_entities), loop.model.entity_representations[0]._embeddings.weight
    )


def test_export_gathers_the_full_model(two_ranks: dict[str, Any]) -> None:
    results = two_ranks["export"]
    model = torch.load(two_ranks["output"] / "export" / "model.pt", weights_only=False)
    from pykeen.nn.representation import Embedding

    assert type(model.entity_representations[0]) is Embedding
    torch.testing.assert_close(
        model.entity_representations[0]._embeddings.weight, assemble(results, model.num_entities)
    )
    assert model.score_hrt(torch.tensor([[0, 0, 1]])).shape == (1, 1)


def test_mismatched_configuration_fails_at_start(tmp_path: pathlib.Path) -> None:
    config = dict(BASE, output=str(tmp_path), rank_overrides={"1": dict(num_negs_per_pos=8)})
    codes, errors, _ = launch(2, config)
    assert all(code != 0 for code in codes)
    for rank in range(2):
        error = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)["error"]
        assert "different configurations" in error and "num_negs_per_pos" in error and "rank 1=8" in error
        assert "step_losses" not in torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)


def test_a_killed_rank_makes_the_others_fail_fast(tmp_path: pathlib.Path) -> None:
    config = dict(
        BASE, output=str(tmp_path), num_epochs=3, num_negs_per_pos=6, batch_size=18, die_ranks=[1], die_at=[2, 1]
    )
    codes, errors, seconds = launch(3, config, timeout=120, collective_timeout=20)
    assert codes[1] == 17  # the crashed rank
    assert codes[0] != 0 and codes[2] != 0, errors
    assert seconds < 90  # they did not hang


def test_torchrun_command_line(tmp_path: pathlib.Path) -> None:
    result = harness.torchrun(
        2,
        ["-m", "pykeen_bess", "train", "--dataset", "nations", "--epochs", "2", "--quiet", "--json"]
        + ["--output", str(tmp_path / "out")],
    )
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)  # printed once, by rank 0
    assert 0 < metrics["both.realistic.inverse_harmonic_mean_rank"] <= 1
    assert (tmp_path / "out" / "trained_model.pkl").is_file()


def test_example_script(tmp_path: pathlib.Path) -> None:
    """examples/train.py runs in one process (and, per the test above, the CLI under torchrun)."""
    example = pathlib.Path(__file__).parents[2] / "examples" / "train.py"
    result = subprocess.run(
        [sys.executable, str(example)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr
    assert "MRR" in result.stdout
    assert (tmp_path / "bess-nations" / "trained_model.pkl").is_file()


PIPELINE_SCRIPT = pathlib.Path(__file__).with_name("pipeline_script.py")


def run_script(tmp_path: pathlib.Path, name: str, nproc: int | None, **env: str) -> subprocess.CompletedProcess:
    """Run the plain pipeline script under torchrun with ``nproc`` ranks (None: one ordinary process)."""
    environment = {"OUTPUT": str(tmp_path / name), "CHECKPOINT_DIRECTORY": str(tmp_path / f"{name}-checkpoints"), **env}
    if nproc is not None:
        return harness.torchrun(nproc, [str(PIPELINE_SCRIPT)], env=environment)
    return subprocess.run(
        [sys.executable, str(PIPELINE_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", **environment),
    )


def read_ranks(directory: pathlib.Path, world_size: int) -> list[dict[str, Any]]:
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(world_size)]


@pytest.fixture(scope="module")
def script_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The plain pipeline script in one ordinary process with two logical shards (what the ranks must equal)."""
    folder = tmp_path_factory.mktemp("script-reference")
    local = run_script(folder, "local", None, NUM_SHARDS="2")
    assert local.returncode == 0, local.stderr
    return read_ranks(folder / "local", 1)[0]


def test_an_unmodified_pipeline_script_under_torchrun_resumes_after_a_kill(
    tmp_path: pathlib.Path, script_reference: dict[str, Any]
) -> None:
    """The README's kind of script, without init_from_environment(): one world (also with replicas), resumable.

    Each run trains as the same script does in one process with two logical shards; the uninterrupted run of
    two ranks is not run on its own (``test_ranks_equal_logical_shards`` runs ranks against logical shards).
    """
    reference = script_reference
    # 2 shards x 2 replicas (training_loop_kwargs=dict(num_shards=2, replicas=2)): the same as 2 logical shards
    replicated = run_script(tmp_path, "replicated", 4, NUM_SHARDS="2", REPLICAS="2", LOG="1")
    assert replicated.returncode == 0, replicated.stderr[-3000:]
    ranks = read_ranks(tmp_path / "replicated", 4)
    assert [(r["num_shards"], r["replicas"]) for r in ranks] == [(2, 2)] * 4
    assert all(r["losses"] == ranks[0]["losses"] and r["metrics"] == ranks[0]["metrics"] for r in ranks)
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert ranks[0]["metrics"] == pytest.approx(reference["metrics"], rel=1e-5, abs=1e-7)
    # the rank table is logged once, at the start
    assert replicated.stderr.count("4 ranks = 2 shards x 2 replicas (replica_grouping='orthogonal')") == 1
    assert "rank | shard | replica" in replicated.stderr

    # rank 1 crashes at the start of epoch 3 (after the checkpoint of epoch 2); torchrun stops the world
    crashed = run_script(tmp_path, "resumed", 2, DIE_AT_EPOCH="3", DIE_RANK="1")
    assert crashed.returncode != 0
    assert not (tmp_path / "resumed" / "rank0.json").exists()
    # the same command again resumes from the checkpoint, through pipeline()
    resumed = run_script(tmp_path, "resumed", 2)
    assert resumed.returncode == 0, resumed.stderr
    result = read_ranks(tmp_path / "resumed", 2)
    # one world of two ranks, each holding one of the two shards (not two copies with all entities)
    assert [r["num_shards"] for r in result] == [2, 2] and all(r["distributed"] for r in result)
    assert [r["entity_rows"] for r in result] == [7, 7]
    assert result[0]["losses"] == result[1]["losses"] and result[0]["metrics"] == result[1]["metrics"]
    # the whole run, the epochs before the crash included, as one process with two logical shards trains
    assert len(result[0]["losses"]) == len(reference["losses"])
    assert result[0]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert result[0]["metrics"] == pytest.approx(reference["metrics"], rel=1e-5, abs=1e-7)


def test_checkpoints_move_between_one_process_and_ranks(
    tmp_path: pathlib.Path, script_reference: dict[str, Any]
) -> None:
    """A one-process checkpoint with 2 logical shards resumes on 2 ranks, and back, as an uninterrupted run trains.

    Also resharded: the ranks' checkpoint resumes in one process with 4 logical shards.
    """
    expected = script_reference

    # one process stops after the checkpoint of epoch 2; two ranks resume its file
    forward = dict(CHECKPOINT_DIRECTORY=str(tmp_path / "forward-checkpoints"))
    stopped = run_script(tmp_path, "forward", None, NUM_SHARDS="2", DIE_AT_EPOCH="3", **forward)
    assert stopped.returncode != 0 and (tmp_path / "forward-checkpoints" / "run.pt").is_file()
    resumed = run_script(tmp_path, "forward", 2, LOG="1", **forward)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(2 logical shards in one process) into shard(s) [1] of 2" in resumed.stderr
    ranks = read_ranks(tmp_path / "forward", 2)
    assert [r["distributed"] for r in ranks] == [True, True]
    assert ranks[0]["losses"] == pytest.approx(expected["losses"], rel=1e-5)
    assert ranks[0]["metrics"] == pytest.approx(expected["metrics"], rel=1e-5, abs=1e-7)

    # two ranks stop after the checkpoint of epoch 2; one process with 2 logical shards resumes their files
    backward = dict(CHECKPOINT_DIRECTORY=str(tmp_path / "backward-checkpoints"))
    stopped = run_script(tmp_path, "backward", 2, DIE_AT_EPOCH="3", DIE_RANK="1", **backward)
    assert stopped.returncode != 0
    resharded = tmp_path / "resharded-checkpoints"
    shutil.copytree(tmp_path / "backward-checkpoints", resharded)
    resumed = run_script(tmp_path, "backward", None, NUM_SHARDS="2", LOG="1", **backward)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(2 ranks) into shard(s) [0, 1] of 2" in resumed.stderr
    local = read_ranks(tmp_path / "backward", 1)[0]
    assert local["losses"] == pytest.approx(expected["losses"], rel=1e-5)
    assert local["metrics"] == pytest.approx(expected["metrics"], rel=1e-5, abs=1e-7)

    # and into another number of shards: the two completed epochs are kept, the run goes on
    resumed = run_script(tmp_path, "resharded", None, NUM_SHARDS="4", CHECKPOINT_DIRECTORY=str(resharded))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    local = read_ranks(tmp_path / "resharded", 1)[0]
    assert local["num_shards"] == 4 and len(local["losses"]) == 4
    assert local["losses"][:2] == pytest.approx(expected["losses"][:2], rel=1e-6)


def test_hpo_under_torchrun_with_three_ranks(tmp_path: pathlib.Path) -> None:
    """hpo_pipeline with a world size of 3 (num_negs_per_pos drawn from powers of two) completes every trial."""
    completed = harness.torchrun(
        3, [str(pathlib.Path(__file__).with_name("hpo_script.py"))], env=dict(OUTPUT=str(tmp_path)), timeout=600
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    ranks = read_ranks(tmp_path, 3)
    assert [t["state"] for t in ranks[0]] == ["COMPLETE", "COMPLETE"]
    assert ranks[0] == ranks[1] == ranks[2]  # the same trials and metrics on every rank
