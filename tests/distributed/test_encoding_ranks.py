"""The encoding partition on 2 and 3 gloo ranks (one column part each) equals the one-shard run in one process."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import rank_zygote
import torch
from encoding_worker import DATASET, build_loop, train

from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.schemes import EncodingLookupScheme, EncodingScheme

pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).with_name("encoding_worker.py")

#: the scenarios of each world size (one launch each)
SCENARIOS: dict[int, dict[str, dict[str, Any]]] = {
    2: {
        "DistMult": dict(model="DistMult"),  # unit-norm constraint and relation regularizer
        "ComplEx": dict(model="ComplEx"),  # entity Lp regularizer (whole rows through column sums)
        "TransE1": dict(model="TransE1"),
        "TransE2": dict(model="TransE2"),
        "RotatE": dict(model="RotatE"),
        "TransE-plain": dict(model="TransE-plain"),
        "sub-batches": dict(model="DistMult", sub_batch_size=50, gradient_clipping_max_norm=0.5, optimizer="sgd"),
        # exchange="auto" without a partition: wide rows and small batches choose the encoding partition
        "auto": dict(model="DistMult-wide", exchange="auto", partition=None, batch_size=16, num_epochs=1),
        # whole rows assembled from the column parts: a non-separable interaction (the default for it), and DistMult
        "RESCAL-lookup": dict(model="RESCAL"),
        "DistMult-lookup": dict(model="DistMult", exchange="encoding_lookup", sub_batch_size=30, count_ops=True),
        "TransE-plain-lookup": dict(model="TransE-plain", exchange="encoding_lookup"),
        # continue_training: the row shards of the first training become column parts again
        "continued": dict(model="DistMult", continue_to=3),
        # one accumulator per whole row: the parts' squares summed over the processes
        "rowwise": dict(model="DistMult", optimizer="rowwise_adagrad"),
        "rowwise-complex": dict(model="ComplEx", optimizer="rowwise_adagrad", continue_to=3),
        # dense updates: the parts' squares of every row summed (one all-reduce of a value per row)
        "rowwise-dense": dict(model="DistMult", optimizer="rowwise_adagrad", sparse_updates=False),
        "rowwise-device": dict(model="DistMult", optimizer="rowwise_adagrad", device_updates=True),
        # the column parts in a storage tier (and the row shards they become)
        "host": dict(model="DistMult", storage="host"),
        "mmap-continued": dict(model="ComplEx", storage="mmap", continue_to=3),
        "not-separable": dict(model="DistMult", partition="encoding", exchange="score", error={}),
    },
    3: {
        "DistMult": dict(model="DistMult"),  # 7 coordinates: parts of 3, 2, 2
        "RotatE": dict(model="RotatE"),  # 5 complex coordinates: 2, 2, 1
        "TransE-plain": dict(model="TransE-plain"),
        "RESCAL-lookup": dict(model="RESCAL", sub_batch_size=30),  # slots 67, 67, 66: uneven sub-batches
        "TransE2-lookup": dict(model="TransE2", exchange="encoding_lookup"),  # constraints over the parts
    },
    # 2 column parts x 2 replicas: the replicas of a part split every step's slots and sum their row gradients
    4: {
        "DistMult": dict(model="DistMult", replicas=2),  # orthogonal: parts {0, 1} and {2, 3}
        "RotatE": dict(model="RotatE", replicas=2, replica_grouping="consecutive"),
        "RESCAL-lookup": dict(model="RESCAL", replicas=2, sub_batch_size=30),
        "rowwise": dict(model="DistMult", optimizer="rowwise_adagrad", replicas=2),
        # the replicas' files apart in one storage_path (column parts and the row shards after training)
        "mmap-continued": dict(model="DistMult", storage="mmap", replicas=2, continue_to=3),
        "sub-batches": dict(
            model="DistMult", replicas=2, sub_batch_size=50, gradient_clipping_max_norm=0.5, optimizer="sgd"
        ),
    },
}


@pytest.fixture(scope="module", params=[2, 3, 4])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any]]:
    world_size = request.param
    output = tmp_path_factory.mktemp(f"encoding{world_size}")
    config = dict(output=str(output), runs=SCENARIOS[world_size])
    results = rank_zygote.launch(world_size, [str(WORKER), json.dumps(config)], timeout=600)
    assert results.ok, results.report()
    loaded = {
        name: [torch.load(output / name / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
        for name in SCENARIOS[world_size]
    }
    for name in SCENARIOS[world_size]:
        if (output / name / "model.pt").exists():
            loaded[name].append(torch.load(output / name / "model.pt", weights_only=False))
    return world_size, loaded


def trained_scenarios(world_size: int) -> list[str]:
    return [name for name, scenario in SCENARIOS[world_size].items() if "error" not in scenario]


@pytest.mark.parametrize("name", sorted({n for w in SCENARIOS for n in trained_scenarios(w)}))
def test_training_equals_the_one_shard_run(ranks: tuple[int, dict[str, Any]], name: str) -> None:
    """Per-step losses, the exported model, metrics and scores on the row shards the parts become."""
    world_size, results = ranks
    if name not in trained_scenarios(world_size):
        pytest.skip(f"no {name} scenario on {world_size} ranks")
    scenario = SCENARIOS[world_size][name]
    *per_rank, exported = results[name]
    reference = build_loop({**scenario, "storage": None, "replicas": None, "replica_grouping": None}, 1, "token")
    losses = train(reference, scenario)
    model = reference.model
    replicas = scenario.get("replicas", 1)
    for result in per_rank:
        assert result["partition"] == "encoding" and result["replicas"] == replicas
        assert result["static_step"], result["scheme"]  # every scenario, whole rows looked up too
        assert result["step_losses"] == pytest.approx(losses, rel=1e-10, abs=1e-12)
    parts = sorted(result["column_part"] for result in per_rank)
    assert parts == sorted(list(range(world_size // replicas)) * replicas)  # every part held by its replicas
    widths = {result["column_part"]: result["part_width"] for result in per_rank}
    assert sum(widths.values()) == model.entity_representations[0]._embeddings.weight.shape[1]
    for ours, theirs in zip(exported.parameters(), model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    metrics = BessEvaluator().evaluate(
        model,
        DATASET.testing.mapped_triples,
        additional_filter_triples=[DATASET.training.mapped_triples],
        use_tqdm=False,
    )
    for rank, result in enumerate(per_rank):
        assert result["metrics"] == pytest.approx(metrics.to_flat_dict(), rel=1e-9)
        with torch.no_grad():
            expected = model.score_hrt(DATASET.testing.mapped_triples[rank : rank + 4])
        torch.testing.assert_close(result["score_hrt"], expected)


def test_bytes_sent_equal_the_cost_model(ranks: tuple[int, dict[str, Any]]) -> None:
    """Without constraints or regularizers only the scores' column sums move: exactly the cost model."""
    world_size, results = ranks
    if world_size == 4:
        pytest.skip("the cost model of one replica group: checked on 2 and 3 ranks")
    steps = -(-DATASET.training.num_triples // 200) * 2  # 2 epochs of batches of 200
    # the one block of 200 slots (the last step's padding slots too) and 6 negatives, float64
    per_step = EncodingScheme.batch_cost(world_size, 200, 6, element_size=8)
    for result in results["TransE-plain"][:world_size]:
        assert result["bytes_sent"] == steps * per_step
    if world_size == 2:  # the token plan's block size gives the same cost
        assert EncodingScheme.cost(2, 50, 6, 0, 0, element_size=8) == per_step
        # whole rows assembled: at most the lookup's cost model (duplicate rows send less), forward and backward
        bound = EncodingLookupScheme.cost(2, 50, 6, 7, 0, element_size=8)
        for result in results["TransE-plain-lookup"][:world_size]:
            assert 0 < result["bytes_sent"] <= steps * bound  # 14 entities: many duplicate rows


def test_unsupported_settings_fail_before_training(ranks: tuple[int, dict[str, Any]]) -> None:
    world_size, results = ranks
    if world_size != 2:
        pytest.skip("checked on 2 ranks")
    messages = {
        "not-separable": "works on the 'token' partition",
    }
    for name, message in messages.items():
        for result in results[name]:
            assert message in result["error"], (name, result)


def test_whole_rows_looked_up_on_ranks_read_nothing_on_the_host(ranks: tuple[int, dict[str, Any]]) -> None:
    """The lookup's static step on 2 ranks: fixed-shape requests and all-to-alls, no synchronising operator."""
    world_size, results = ranks
    if world_size != 2:
        pytest.skip("counted on 2 ranks")
    for result in results["DistMult-lookup"][:world_size]:
        counts = result["static_step_ops"]
        assert counts, "no step kind counted"
        for count in counts.values():
            assert count["synchronising"] == []
            # measured: 762-917 by step kind (4 sub-batches of 25 slots per part; a padded kind adds its masks)
            assert 0 < count["total"] <= 1000, counts
