"""One rank of a typed-graph run (started by test_typed_ranks.py): typed negatives, PBG-layout checkpoints.

Usage: ``python typed_worker.py '<json config>'`` with torchrun's environment; writes ``{output}/rank{r}.pt``.
A config with ``die_at: [epoch, step]`` ends rank 1 abruptly there (a crash).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Any

import torch
import torch.distributed as dist
from pykeen.models import DistMult
from pykeen.training import TrainingCallback

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))  # the test helpers

from typed_graphs import typed_graph

from pykeen_bess.distributed import init_from_environment
from pykeen_bess.training import BessTrainingLoop


class Recorder(TrainingCallback):
    def __init__(self, die_at: tuple[int, int] | None) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.die_at = die_at

    def on_batch(self, epoch: int, batch: Any, batch_loss: float, **kwargs: Any) -> None:
        self.losses.append(batch_loss)
        if self.die_at is not None and (epoch, batch.step) == tuple(self.die_at):
            os._exit(17)


def build_loop(config: dict[str, Any]) -> tuple[BessTrainingLoop, Any]:
    """The loop on the typed graph, as the single-process reference builds it."""
    graph = typed_graph(num_partitions=2, seed=1)
    model = DistMult(triples_factory=graph.training, embedding_dim=6, random_seed=0, regularizer=None).double()
    loop = BessTrainingLoop(
        model=model,
        triples_factory=graph.training,
        num_shards=config.get("num_shards"),
        negatives=config.get("negatives", "typed"),
        checkpoint_format="pbg" if config.get("checkpoint_directory") else "pykeen",
        exchange=config.get("exchange", "embedding"),
        num_negs_per_pos=4,
        optimizer=config.get("optimizer", "rowwise_adagrad"),
        optimizer_kwargs=dict(lr=0.1),
        seed=5,
        automatic_memory_optimization=False,
    )
    return loop, graph


def main() -> None:
    config = json.loads(sys.argv[1])
    output = pathlib.Path(config["output"])
    output.mkdir(parents=True, exist_ok=True)
    init_from_environment()
    rank = dist.get_rank()
    loop, graph = build_loop(config)
    recorder = Recorder(config.get("die_at") if rank == 1 else None)
    loop.train(
        graph.training,
        num_epochs=config["num_epochs"],
        batch_size=32,
        use_tqdm=False,
        callbacks=recorder,
        checkpoint_directory=config.get("checkpoint_directory"),
        checkpoint_name="bess.pt" if config.get("checkpoint_directory") else None,
        checkpoint_frequency=0,
    )
    if config.get("export"):  # collective: the rows of every partition are looked up, rank 0 writes
        from pykeen_bess import pbg

        pbg.write_checkpoint(loop.model, graph, output / "export", training_loop=loop)
    table = loop.tables[0]
    shard = loop.topology.local_shards[0]
    torch.save(
        dict(
            losses=recorder.losses,
            table=table.shard_tables()[0].detach().clone(),
            global_ids=table.sharding.shard_entities[shard].clone(),
            relation=loop.model.relation_representations[0]._embeddings.weight.detach().clone(),
        ),
        output / f"rank{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
