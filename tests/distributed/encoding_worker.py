"""One rank of the encoding-partition tests (started by ``tests/distributed/test_encoding_ranks.py``).

Every scenario trains a float64 model with ``partition="encoding"`` (one column part per rank),
records the step losses, the bytes the column sums sent and the rank's column part, then (after
training, when the parts are row shards) evaluates, predicts and exports the model. Writes
``{output}/{name}/rank{r}.pt``.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import torch
import torch.distributed as dist
from pykeen.datasets import Nations
from pykeen.training import TrainingCallback

from pykeen_bess.distributed import export_model, init_from_environment
from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.training import BessTrainingLoop

DATASET = Nations()

#: the models of the scenarios (float64, small), by name
MODELS = {
    "DistMult": dict(model="DistMult", model_kwargs=dict(embedding_dim=7)),
    "ComplEx": dict(model="ComplEx", model_kwargs=dict(embedding_dim=5)),
    "TransE1": dict(model="TransE", model_kwargs=dict(embedding_dim=7, scoring_fct_norm=1)),
    "TransE2": dict(model="TransE", model_kwargs=dict(embedding_dim=7, scoring_fct_norm=2)),
    "RotatE": dict(model="RotatE", model_kwargs=dict(embedding_dim=5)),
    "DistMult-wide": dict(model="DistMult", model_kwargs=dict(embedding_dim=64)),
    "RESCAL": dict(model="RESCAL", model_kwargs=dict(embedding_dim=5)),
    # no constraint or regularizer: only the scores' column sums move (the cost model's case)
    "TransE-plain": dict(
        model="TransE", model_kwargs=dict(embedding_dim=7, scoring_fct_norm=2, entity_constrainer=None)
    ),
}


def build_loop(
    scenario: dict[str, Any], num_shards: int | None, partition: str | None, process_group: Any = None
) -> BessTrainingLoop:
    """The loop of a scenario; the single-process reference builds it with one token shard."""
    from pykeen.models import model_resolver

    dataset = DATASET
    spec = MODELS[scenario["model"]]
    model = model_resolver.make(
        spec["model"], triples_factory=dataset.training, random_seed=0, **spec["model_kwargs"]
    ).double()
    optimizer = scenario.get("optimizer", "adam")
    return BessTrainingLoop(
        model=model,
        triples_factory=dataset.training,
        num_shards=num_shards,
        process_group=process_group,
        replicas=scenario.get("replicas"),
        replica_grouping=scenario.get("replica_grouping"),
        checkpoint_retrieval=scenario.get("checkpoint_retrieval", "one_per_group"),
        partition=partition,
        exchange=scenario.get("exchange") if partition != "token" else None,
        storage=scenario.get("storage"),
        storage_path=scenario.get("storage_path"),
        num_negs_per_pos=scenario.get("num_negs_per_pos", 6),
        seed=5,
        optimizer=optimizer,
        sparse_updates=scenario.get("sparse_updates", True),
        optimizer_kwargs=dict(lr=0.05 if optimizer == "adam" else 0.1),
        automatic_memory_optimization=False,
    )


class Recorder(TrainingCallback):
    """Records the loss of every step."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_batch(self, epoch: int, batch: Any, batch_loss: float, **kwargs: Any) -> None:
        self.losses.append(batch_loss)


def train(loop: BessTrainingLoop, scenario: dict[str, Any]) -> list[float]:
    """Train a scenario's epochs; return the step losses."""
    recorder = Recorder()
    loop.train(
        DATASET.training,
        num_epochs=scenario.get("num_epochs", 2),
        batch_size=scenario.get("batch_size", 200),
        sub_batch_size=scenario.get("sub_batch_size"),
        use_tqdm=False,
        callbacks=recorder,
        gradient_clipping_max_norm=scenario.get("gradient_clipping_max_norm"),
    )
    if "continue_to" in scenario:  # continued training: PyKEEN's num_epochs counts all epochs
        loop.train(
            DATASET.training,
            num_epochs=scenario["continue_to"],
            batch_size=scenario.get("batch_size", 200),
            use_tqdm=False,
            callbacks=recorder,
            continue_training=True,
        )
    return recorder.losses


def run(name: str, scenario: dict[str, Any], output: pathlib.Path, rank: int) -> None:
    """Train, evaluate and export one scenario as this rank (or record the error it must raise)."""
    directory = output / name
    directory.mkdir(parents=True, exist_ok=True)
    if scenario.get("storage") == "mmap":  # every rank's files in one directory (their names differ)
        (directory / "tables").mkdir(exist_ok=True)
        scenario = dict(scenario, storage_path=str(directory / "tables"))
    if "error" in scenario:
        try:
            loop = build_loop(scenario, None, scenario.get("partition", "encoding"))
            loop.train(DATASET.training, num_epochs=1, batch_size=200, use_tqdm=False, **scenario["error"])
        except ValueError as error:
            torch.save(dict(error=str(error)), directory / f"rank{rank}.pt")
            return
        raise AssertionError(f"scenario {name} did not raise")
    loop = build_loop(scenario, None, scenario.get("partition", "encoding"))
    first = loop.topology
    before = first.bytes_sent
    from pykeen_bess.training.steps.static_update import StaticUpdate

    # the updates a GPU runs (every occurrence with its row's sum, device-tensor rules), forced on the CPU
    StaticUpdate.host_rules = not scenario.get("device_updates", False)
    if not StaticUpdate.host_rules:  # (and the optimizers' capturable form)
        sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
        from capturable import allow_capturable_on_the_cpu

        allow_capturable_on_the_cpu()
    try:
        result: dict[str, Any] = dict(step_losses=train(loop, scenario))
    finally:
        StaticUpdate.host_rules = True
    result["static_step"] = loop.static is not None
    result["scheme"] = loop.runner.scheme.get_name() if loop.runner is not None else None
    topology = loop.topology  # exchange="auto" may have chosen the partition at the start of training
    result.update(
        bytes_sent=topology.bytes_sent - (before if topology is first else 0),
        partition=loop.config.partition,
        column_part=topology.local_columns[0],
        n_column=topology.n_column,
        replicas=topology.replicas,
        part_width=loop.tables[0].row_width,
    )
    dataset = DATASET
    metrics = BessEvaluator().evaluate(
        loop.model,
        dataset.testing.mapped_triples,
        additional_filter_triples=[dataset.training.mapped_triples],
        use_tqdm=False,
    )
    result["metrics"] = metrics.to_flat_dict()
    with torch.no_grad():
        result["score_hrt"] = loop.model.score_hrt(dataset.testing.mapped_triples[rank : rank + 4]).detach()
    export_model(loop.model, directory / "model.pt")
    if scenario.get("count_ops"):  # a further step of every kind, its operators counted (as a GPU would run it)
        from distributed_worker import count_static_step_ops

        result["static_step_ops"] = count_static_step_ops(loop, scenario.get("num_epochs", 2) + 1)
    torch.save(result, directory / f"rank{rank}.pt")


def main(run_scenario: Any = None) -> None:
    """Run the scenarios ``{"output": ..., "runs": {name: scenario}}`` one after the other (with ``run_scenario``).

    :param run_scenario: what runs one scenario as this rank, ``(name, scenario, output, rank)`` (default: :func:`run`)
    """
    config = json.loads(sys.argv[1])
    output = pathlib.Path(config["output"])
    init_from_environment()
    rank = dist.get_rank()
    for name, scenario in config["runs"].items():
        (run_scenario or run)(name, scenario, output, rank)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
