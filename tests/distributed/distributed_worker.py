"""One rank of a distributed test run (started by tests/test_distributed.py, one process per rank).

Usage: ``python distributed_worker.py '<json config>'`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` in the environment (as ``torchrun`` sets them). The rank
trains, evaluates and writes what the test compares to ``{output}/rank{r}.pt``; a config with
``"runs"`` runs several scenarios in one process group (one launch, one start-up).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from pykeen.datasets import Nations
from pykeen.models import DistMult, TransE
from pykeen.training import TrainingCallback
from pykeen.triples import CoreTriplesFactory

from pykeen_bess.distributed import export_model, init_from_environment
from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.training import BessTrainingLoop


def small_factory(num_triples: int) -> tuple[CoreTriplesFactory, Nations]:
    """The first ``num_triples`` Nations training triples (the same on every rank)."""
    dataset = Nations()
    factory = CoreTriplesFactory.create(
        mapped_triples=dataset.training.mapped_triples[:num_triples],
        num_entities=dataset.num_entities,
        num_relations=dataset.num_relations,
    )
    return factory, dataset


def state_digest(loop: BessTrainingLoop) -> str:
    """A digest of this process' shard tables and their optimizer state (equal digests: bitwise equal)."""
    digest = hashlib.sha1()
    for table in loop.tables:
        digest.update(table.weight.detach().contiguous().numpy().tobytes())
        # the row state, wherever the storage tier keeps it (the optimizer's state or the tier), and the step count
        state = {**loop.optimizer.state.get(table.optimizer_parameter, {}), **table.row_state}
        for _, value in sorted(state.items()):
            if torch.is_tensor(value):
                digest.update(value.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


class Recorder(TrainingCallback):
    """Records every step's loss (and optionally the tables' digest after it); can kill this process at a step."""

    def __init__(self, die_at: tuple[int, int] | None = None, digests: bool = False) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.digests: list[str] = []
        self.record_digests = digests
        self.die_at = die_at

    def on_batch(self, epoch: int, batch: Any, batch_loss: float, **kwargs: Any) -> None:
        self.losses.append(batch_loss)
        if self.die_at is not None and (epoch, batch.step) == tuple(self.die_at):
            os._exit(17)  # a crash: no clean-up, no exception handling

    def post_batch(self, epoch: int, batch: Any, **kwargs: Any) -> None:
        if self.record_digests:  # after the optimizer step
            self.digests.append(state_digest(self.training_loop))


class DistMultWithExtra(DistMult):
    """A replicated parameter that gets a gradient only in every other step (through the regularization term)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra = torch.nn.Parameter(torch.ones(3))
        self.calls = 0

    def collect_regularization_term(self) -> torch.Tensor:
        term = super().collect_regularization_term()
        self.calls += 1
        if self.calls % 2 == 1:
            term = term + 0.01 * self.extra.pow(2).sum()
        return term


def loss_weighter(name: str | None, factory: CoreTriplesFactory) -> Any:
    """``"relation"``: PyKEEN's relation weighter with fixed weights; other names as given."""
    if name != "relation":
        return name
    from pykeen.triples.weights import RelationLossWeighter

    return RelationLossWeighter(weights=torch.linspace(0.5, 2.0, factory.num_relations, dtype=torch.float64))


#: the models a scenario names (``"model"``)
MODELS = {"DistMult": DistMult, "TransE": TransE}


def build_loop(config: dict[str, Any], factory: CoreTriplesFactory) -> BessTrainingLoop:
    """Create the model and the loop exactly as the single-process reference does."""
    cls = DistMultWithExtra if config.get("extra_parameter") else MODELS[config.get("model", "DistMult")]
    model = cls(triples_factory=factory, embedding_dim=8, random_seed=0, loss=config.get("loss", "softplus"))
    if not config.get("float32"):
        model = model.double()
    optimizer = config.get("optimizer", "adagrad")
    process_group = None
    if config.get("mesh"):  # a user-made device mesh, dimensions in the order the config gives
        from torch.distributed.device_mesh import init_device_mesh

        names = tuple(config["mesh"])
        sizes = dict(replica=config["replicas"], shard=config["num_shards"])
        process_group = init_device_mesh("cpu", tuple(sizes[n] for n in names), mesh_dim_names=names)
    layout = {} if config.get("mesh") else {k: config[k] for k in ("replicas", "replica_grouping") if k in config}
    return BessTrainingLoop(
        model=model,
        triples_factory=factory,
        num_shards=config.get("num_shards"),
        process_group=process_group,
        **layout,
        checkpoint_retrieval=config.get("checkpoint_retrieval", "one_per_group"),
        sparse_updates=config.get("sparse_updates", True),
        exchange=config.get("exchange", "embedding"),
        num_negs_per_pos=config["num_negs_per_pos"],
        seed=5,
        optimizer=optimizer,
        optimizer_kwargs=dict(lr=0.1 if optimizer in ("adagrad", "sgd", "rowwise_adagrad") else 0.05),
        automatic_memory_optimization=False,
        storage=config.get("storage"),
        storage_path=config.get("storage_path"),
        storage_kwargs=config.get("storage_kwargs"),
        loss_weighter=loss_weighter(config.get("loss_weighter"), factory),
        negatives=config.get("negatives", "block"),
        static_step=config.get("static_step"),
    )


@contextlib.contextmanager
def staged_rows(stage: bool) -> Iterator[None]:
    """Have the loops built meanwhile stage their rows around every step (what a GPU does with host tables)."""
    from pykeen_bess.training.steps import static_step

    built = static_step.row_access
    if stage:
        static_step.row_access = lambda *args: built(*args[:4], True, args[5])
    try:
        yield
    finally:
        static_step.row_access = built


def run(config: dict[str, Any], output: pathlib.Path, rank: int) -> None:
    """Train (and evaluate, export) one scenario as this rank; write ``{output}/rank{r}.pt``."""
    output.mkdir(parents=True, exist_ok=True)
    if config.get("rank_overrides") and str(rank) in config["rank_overrides"]:
        config = {**config, **config["rank_overrides"][str(rank)]}
    factory, dataset = small_factory(config.get("num_triples", 300))
    recorder = Recorder(
        die_at=config.get("die_at") if rank in config.get("die_ranks", []) else None,
        digests=config.get("digests", False),
    )
    result: dict[str, Any] = {}
    try:
        loop = build_loop(config, factory)
        with staged_rows(config.get("stage_rows", False)):  # the static step is made in train()
            losses = loop.train(
                factory,
                num_epochs=config["num_epochs"],
                batch_size=config["batch_size"],
                sub_batch_size=config.get("sub_batch_size"),
                use_tqdm=False,
                callbacks=recorder,
                checkpoint_directory=config.get("checkpoint_directory"),
                checkpoint_name=config.get("checkpoint_name"),
                checkpoint_frequency=0 if config.get("checkpoint_name") else None,
                gradient_clipping_max_norm=config.get("gradient_clipping_max_norm"),
            )
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
        torch.save(result, output / f"rank{rank}.pt")
        if config.get("expect_error"):  # the next scenario of the launch goes on
            return
        raise
    table = loop.tables[0]
    topology = loop.topology
    shard = topology.local_shards[0]
    groups = {}
    for name in ("shard_group", "replica_group"):
        group = getattr(topology, name, None)
        if name == "shard_group" and group is None:
            group = dist.group.WORLD  # without replicas the shard group is the world
        groups[name] = dist.get_process_group_ranks(group) if group is not None else None
    result.update(
        epoch_losses=losses,
        step_losses=recorder.losses,
        digests=recorder.digests,
        shard=shard,
        replica=topology.replica,
        replica_bytes=getattr(topology, "replica_bytes_sent", 0),
        shard_size=loop.sharding.shard_size,
        groups=groups,
        table=table.shard_tables()[0].detach().clone(),
        optimizer_state={
            key: value.clone()
            for key, value in {**loop.optimizer.state.get(table.optimizer_parameter, {}), **table.row_state}.items()
            if torch.is_tensor(value) and value.ndim == 2
        },
        global_ids=table.sharding.shard_entities[shard].clone(),
        relation=loop.model.relation_representations[0]._embeddings.weight.detach().clone(),
        entity_parameter_numel=sum(p.numel() for r in loop.model.entity_representations for p in r.parameters()),
        staged=loop.static is not None and loop.static.rows_io.staged,
    )
    if config.get("extra_parameter"):
        result["extra"] = loop.model.extra.detach().clone()
    if config.get("evaluate"):
        metrics = BessEvaluator().evaluate(
            loop.model,
            dataset.testing.mapped_triples,
            additional_filter_triples=[dataset.training.mapped_triples],
            use_tqdm=False,
        )
        result["metrics"] = metrics.to_flat_dict()
    if config.get("predict"):  # the 5 best tails of the first 7 test queries, with the training triples filtered
        from pykeen_bess import predict_top_k

        frame = predict_top_k(
            loop.model,
            dataset.testing.mapped_triples[:7, :2],
            k=5,
            filter_triples=dataset.training.mapped_triples,
        )
        result["top_k"] = frame[["query", "tail_id", "rank", "score"]].to_dict("list")
    if config.get("export"):
        export_model(loop.model, output / "model.pt")
    if config.get("count_ops"):
        result["static_step_ops"] = count_static_step_ops(loop, config["num_epochs"] + 1)
    torch.save(result, output / f"rank{rank}.pt")


def count_static_step_ops(loop: BessTrainingLoop, epoch: int) -> dict[str, Any]:
    """Run a further step of every kind of the loop's static step; count its operators and synchronising ones."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
    from capturable import allow_capturable_on_the_cpu
    from host_reads import DeviceOps, static_step_sources

    from pykeen_bess.training.steps.static_update import StaticUpdate

    static = loop.static
    assert static is not None, "the loop trained eagerly"
    StaticUpdate.host_rules = False  # what a GPU runs (the CPU's host-side unique would synchronise there)
    allow_capturable_on_the_cpu()  # (a GPU's optimizers run in their capturable form)
    counts = {}
    try:
        with loop.tables.installed(copy_weights=False):
            static.load_epoch(epoch)
            static.run(1)  # the first step with these updates creates their device step counts (a host read)
            for kind in static.plan.kinds:
                with DeviceOps(static_step_sources(static)) as ops:
                    static.step(kind)
                counts[kind.index] = dict(total=ops.total, synchronising=ops.synchronising)
    finally:
        StaticUpdate.host_rules = True  # the later scenarios of this process run the CPU's updates again
    return counts


def main() -> None:
    """Run one scenario (``{"output": ..., **settings}``) or several in one group (``{"runs": {name: ...}}``)."""
    config = json.loads(sys.argv[1])
    output = pathlib.Path(config["output"])
    init_from_environment()
    rank = dist.get_rank()
    if "runs" in config:  # several scenarios, one after the other, each in its own folder
        for name, scenario in config["runs"].items():
            run(scenario, output / name, rank)
            dist.barrier()
    else:
        run(config, output, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
