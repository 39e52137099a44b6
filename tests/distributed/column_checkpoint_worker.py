"""One rank of the encoding partition's checkpoint and early-stopping tests (``test_encoding_checkpoints.py``).

Every scenario is a list of phases run one after the other, each a fresh loop (a new process
would build the same) on all ranks or on the first ``ranks`` of them:
``{"partition": "encoding" | "token", "num_epochs": N, "checkpoint": NAME, "tamper": PATTERN,
"stopper": {...}, "optimizer": NAME, "storage": TIER, "replicas": R, "ranks": k}``. A phase with ``checkpoint``
trains with that checkpoint (written at every epoch's end; an existing one is resumed); ``tamper``
changes a value in the checkpoint file matching a pattern (rank 0, after the phase); with
``expect_error`` the phase records the ``ValueError`` it raises; ``stopper`` trains with PyKEEN's
early stopper on Nations' validation triples. Writes
``{output}/{name}/rank{r}.pt``: the step losses of all phases, the stopper's results, and the
exported model and the last token phase's table rows and optimizer state.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch
import torch.distributed as dist
from encoding_worker import DATASET, Recorder, build_loop, main
from pykeen.stoppers import EarlyStopper

from pykeen_bess.distributed import export_model
from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.training import BessTrainingLoop


def make_stopper(loop: BessTrainingLoop, settings: dict[str, Any]) -> EarlyStopper:
    """PyKEEN's early stopper on Nations' validation triples (also the reference's)."""
    return EarlyStopper(
        model=loop.model,
        evaluator=BessEvaluator(),
        training_triples_factory=DATASET.training,
        evaluation_triples_factory=DATASET.validation,
        use_tqdm=False,
        **settings,
    )


def train_phase(
    loop: BessTrainingLoop, phase: dict[str, Any], directory: pathlib.Path | None
) -> tuple[list[float], EarlyStopper | None]:
    """Train one phase (with its checkpoint in ``directory`` and its stopper); return the step losses."""
    recorder = Recorder()
    kwargs: dict[str, Any] = {}
    if "checkpoint" in phase:
        assert directory is not None
        kwargs.update(checkpoint_name=phase["checkpoint"], checkpoint_directory=str(directory), checkpoint_frequency=0)
    stopper = make_stopper(loop, phase["stopper"]) if "stopper" in phase else None
    loop.train(
        DATASET.training,
        num_epochs=phase["num_epochs"],
        batch_size=200,
        use_tqdm=False,
        callbacks=recorder,
        stopper=stopper,
        **kwargs,
    )
    return recorder.losses, stopper


def token_state(loop: BessTrainingLoop) -> dict[str, Any]:
    """The rows of the first table and their optimizer state held by this process of a token loop."""
    table = loop.tables[0]
    shard = loop.topology.local_shards[0]
    state = loop.optimizer.state.get(table.optimizer_parameter, {})
    return dict(
        ids=table.sharding.shard_entities[shard].clone(),
        rows=table.shard_tables()[0].detach().clone(),
        state={name: value.clone() for name, value in state.items() if torch.is_tensor(value) and value.ndim > 0},
    )


def run(name: str, phases: list[dict[str, Any]], output: pathlib.Path, rank: int) -> None:
    """Run a scenario's phases as this rank."""
    directory = output / name
    directory.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = dict(step_losses=[], stopper=None)
    loop = None
    for phase in phases:
        ranks = phase.get("ranks", dist.get_world_size())
        group = dist.new_group(list(range(ranks))) if ranks < dist.get_world_size() else None
        if rank < ranks:
            scenario = dict(
                model="DistMult",
                optimizer=phase.get("optimizer", "adam"),
                storage=phase.get("storage"),
                replicas=phase.get("replicas"),
                checkpoint_retrieval=phase.get("checkpoint_retrieval", "one_per_group"),
            )
            if phase.get("storage") == "mmap":  # every rank's files in one directory (their names differ)
                (directory / "tables").mkdir(exist_ok=True)
                scenario["storage_path"] = str(directory / "tables")
            loop = build_loop(scenario, None, phase.get("partition", "encoding"), process_group=group)
            try:
                losses, stopper = train_phase(loop, phase, directory / "checkpoints")
            except ValueError as error:
                if not phase.get("expect_error"):
                    raise
                torch.save(dict(error=str(error)), directory / f"rank{rank}.pt")
                return
            result["step_losses"].extend(losses)
            if stopper is not None:
                result["stopper"] = dict(results=list(stopper.results), best_epoch=stopper.best_epoch)
            if loop.config.partition == "token":
                result["token_state"] = token_state(loop)
        dist.barrier()
        if "tamper" in phase and rank == 0:  # change a value in the checkpoint file matching the pattern
            (file,) = (directory / "checkpoints").glob(phase["tamper"])
            state = torch.load(file, weights_only=False)
            key = next(k for k in state["model_state_dict"] if "entity_representations" in k)
            state["model_state_dict"][key][0, 0] += 1.0
            torch.save(state, file)
        dist.barrier()
    if rank < phases[-1].get("ranks", dist.get_world_size()):  # the ranks of the last phase hold the model
        assert loop is not None
        export_model(loop.model, directory / "model.pt")
    torch.save(result, directory / f"rank{rank}.pt")


if __name__ == "__main__":  # the scenarios {"output": ..., "runs": {name: [phase, ...]}}
    main(run)
