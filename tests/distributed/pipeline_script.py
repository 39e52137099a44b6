"""An ordinary PyKEEN pipeline script, as a user would write it (no pykeen_bess imports, no process group).

The tests run it under ``torchrun`` and in one process. Settings come from the environment:
``OUTPUT`` (directory for ``rank{r}.json``), ``CHECKPOINT_DIRECTORY``, ``NUM_SHARDS`` (unset: the
loop's default), ``REPLICAS`` and ``REPLICA_GROUPING`` (unset: none), ``DIE_AT_EPOCH`` / ``DIE_RANK``
(this rank exits abruptly at the first step of that epoch, as a crash would), ``LOG`` (set: show
pykeen-bess' INFO messages).
"""

import json
import logging
import os
import pathlib

from pykeen.pipeline import pipeline
from pykeen.training import TrainingCallback


class Crash(TrainingCallback):
    """Exit abruptly at the first step of an epoch."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_batch(self, epoch: int, batch, batch_loss: float, **kwargs) -> None:
        if epoch == self.epoch:
            os._exit(17)


rank = int(os.environ.get("RANK", "0"))
callbacks = []
if os.environ.get("DIE_AT_EPOCH") and rank == int(os.environ.get("DIE_RANK", "0")):
    callbacks.append(Crash(int(os.environ["DIE_AT_EPOCH"])))
training_loop_kwargs = dict(exchange="embedding")
if os.environ.get("NUM_SHARDS"):
    training_loop_kwargs["num_shards"] = int(os.environ["NUM_SHARDS"])
if os.environ.get("REPLICAS"):
    training_loop_kwargs["replicas"] = int(os.environ["REPLICAS"])
if os.environ.get("REPLICA_GROUPING"):
    training_loop_kwargs["replica_grouping"] = os.environ["REPLICA_GROUPING"]
if os.environ.get("LOG"):
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("pykeen_bess").setLevel(logging.INFO)

result = pipeline(
    dataset="nations",
    model="DistMult",
    model_kwargs=dict(embedding_dim=16),
    training_loop="bess",
    training_loop_kwargs=training_loop_kwargs,
    negative_sampler_kwargs=dict(num_negs_per_pos=8),
    optimizer="adam",
    optimizer_kwargs=dict(lr=0.05),
    training_kwargs=dict(
        num_epochs=4,
        batch_size=128,
        use_tqdm=False,
        checkpoint_directory=os.environ["CHECKPOINT_DIRECTORY"],
        checkpoint_name="run.pt",
        checkpoint_frequency=0,
        callbacks=callbacks,
    ),
    evaluator="bess",
    evaluation_kwargs=dict(use_tqdm=False),
    random_seed=7,
)
loop = result.training_loop
output = pathlib.Path(os.environ["OUTPUT"])
output.mkdir(parents=True, exist_ok=True)
(output / f"rank{rank}.json").write_text(
    json.dumps(
        dict(
            losses=result.losses,
            metrics=result.metric_results.to_flat_dict(),
            num_shards=loop.topology.n_shard,
            replicas=loop.topology.replicas,
            distributed=loop.topology.is_distributed,
            entity_rows=int(next(result.model.entity_representations[0].parameters()).shape[0]),
        )
    )
)
