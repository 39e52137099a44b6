"""BESS on typed graphs: typed negatives, and checkpoints in PyTorch-BigGraph's layout (one process)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from pbg_tools import pbg_model, pbg_scores
from pykeen.datasets import Nations
from pykeen.models import DistMult, PairRE, TransE
from pykeen.pipeline import pipeline
from pykeen.training import TrainingCallback
from typed_graphs import typed_graph

from pykeen_bess import pbg
from pykeen_bess.data.partition import ShardPairPartition
from pykeen_bess.pbg import TypedGraph, files
from pykeen_bess.data.sampling import StepSharedTypedBessSampler, TypedBessSampler, resolve_negatives
from pykeen_bess.data.sharding import EntitySharding
from pykeen_bess.training import BessTrainingLoop


def typed_sampler(
    graph: TypedGraph,
    n_shard: int,
    corruption: str = "ht",
    block_size: int = 8,
    sampler_class: type[TypedBessSampler] = TypedBessSampler,
) -> TypedBessSampler:
    schema = graph.schema
    sharding = EntitySharding.create(schema.num_entities, n_shard, seed=1, strategy=schema.sharding_strategy())
    partition = ShardPairPartition.from_triples(graph.training.mapped_triples, sharding)
    return sampler_class(
        partition,
        block_size=block_size,
        num_negs_per_pos=3 * n_shard,
        corruption=corruption,
        seed=4,
        relation_sides=schema.relation_sides(graph.training),
        entity_types=schema.entity_type,
        type_names=schema.entity_types,
    )


@pytest.mark.parametrize("sampler_class", [TypedBessSampler, StepSharedTypedBessSampler])
@pytest.mark.parametrize("corruption", ["h", "t", "ht"])
@pytest.mark.parametrize("n_shard", [1, 2, 3])
def test_typed_negatives_never_cross_types(n_shard: int, corruption: str, sampler_class: type) -> None:
    graph = typed_graph(create_inverse_triples=corruption == "t")
    schema = graph.schema
    sampler = typed_sampler(graph, n_shard, corruption, sampler_class=sampler_class)
    sharding = sampler.partition.sharding
    sides = schema.relation_sides(graph.training)
    n, m = n_shard, 3
    drawn: dict[int, set[int]] = {}
    for batch in sampler.epoch(1):
        types = sampler.num_candidate_types
        assert batch.negatives.shape == (n, n, n, types * m)
        assert batch.shared_negatives == (sampler_class is StepSharedTypedBessSampler)
        if batch.shared_negatives:  # one set for all blocks (i, j) of the step
            assert bool((batch.negatives == batch.negatives[:, :1, :1]).all())
        owner = torch.arange(n).view(n, 1, 1, 1).expand_as(batch.negatives)
        negatives = sharding.to_global(owner, batch.negatives).view(n, n, n, types, m)
        assert bool((negatives >= 0).all())  # never padding
        # every shard contributes m entities of every type to every block (its own entities)
        assert bool((sharding.entity_shard[negatives] == owner.view(n, n, n, types, m)).all())
        for i in range(n):
            for j in range(n):
                for slot in range(batch.block_size):
                    relation = int(batch.relations[i, j, slot])
                    side = 0 if slot < batch.num_head_corrupted else 1
                    wanted = int(sides[relation, side])
                    chosen = negatives[:, i, j, int(batch.candidate_types[i, j, slot])]
                    assert bool((schema.entity_type[chosen] == wanted).all())
                for t in range(types):
                    drawn.setdefault(sampler.types[t], set()).update(negatives[:, i, j, t].reshape(-1).tolist())
    # uniform within the type: every entity of the smallest type is drawn at some point
    tag = schema.type_index("tag")
    if tag in drawn:
        assert drawn[tag] == set(schema.partition_range(tag, 0))


def test_step_shared_typed_negatives_with_one_shard_are_the_typed_draws() -> None:
    """negatives="typed_step" with one shard: the step's only block draws what negatives="typed" draws."""
    graph = typed_graph()
    plain, shared = (
        typed_sampler(graph, 1, sampler_class=cls) for cls in (TypedBessSampler, StepSharedTypedBessSampler)
    )
    pairs = list(zip(plain.epoch(1), shared.epoch(1)))
    assert len(pairs) == len(plain) and all(torch.equal(a.negatives, b.negatives) for a, b in pairs)
    # more shards: a new set every step
    steps = list(typed_sampler(graph, 2, sampler_class=StepSharedTypedBessSampler).epoch(1))
    assert not all(torch.equal(a.negatives, b.negatives) for a, b in zip(steps, steps[1:]))
    assert resolve_negatives("typed_step") is StepSharedTypedBessSampler


@pytest.mark.parametrize("negatives", ["typed", "typed_step"])
def test_exchange_auto_counts_the_negatives_of_every_candidate_type(negatives: str) -> None:
    """Typed negatives move and score K of each of the T candidate types: exchange="auto" counts T * K.

    Here (n = 2, blocks of 8, DistMult d64, K = 12, T = 3) the embedding scheme would send fewer bytes
    for K negatives per block, the score scheme for the 36 the blocks really have.
    """
    from pykeen_bess.schemes import ScoreMovingScheme, exchange_cost

    factory = typed_graph().training
    model = DistMult(triples_factory=factory, embedding_dim=64, random_seed=0)
    loop = BessTrainingLoop(
        model=model, triples_factory=factory, num_shards=2, negatives=negatives, num_negs_per_pos=12, exchange="auto"
    )
    shared = negatives == "typed_step"
    costs = {
        k: {s: exchange_cost(s, 2, 8, k, 64, 64, shared_negatives=shared) for s in ("embedding", "score")}
        for k in (12, 36)
    }
    if not shared:  # the choice depends on counting all types
        assert costs[12]["embedding"] < costs[12]["score"] and costs[36]["score"] < costs[36]["embedding"]
    expected = min(costs[36], key=costs[36].get)
    assert type(loop.make_scheme(8)).get_name() == expected
    assert (expected == "score") == (type(loop.make_scheme(8)) is ScoreMovingScheme)


def test_a_type_with_fewer_entities_than_shards() -> None:
    graph = typed_graph()
    with pytest.raises(ValueError, match="entity type 'tag' has 7 entities, fewer than num_shards=8"):
        typed_sampler(graph, 8)


def make_loop(factory, **kwargs) -> BessTrainingLoop:
    model = DistMult(triples_factory=factory, embedding_dim=4, random_seed=0)
    return BessTrainingLoop(model=model, triples_factory=factory, automatic_memory_optimization=False, **kwargs)


@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        (lambda: Nations().training, dict(negatives="typed"), "needs entity types"),
        (lambda: typed_graph().training, dict(negatives="typed", partition="encoding"), "partition='token'"),
        (lambda: Nations().training, dict(negatives="typed_step"), "negatives='typed_step' needs entity types"),
        (lambda: typed_graph().training, dict(negatives="kinds"), "Unknown negatives='kinds'"),
        (lambda: typed_graph(2).training, dict(num_shards=3, checkpoint_format="pbg"), "user: 2, item: 2, tag: 2"),
        (lambda: Nations().training, dict(num_shards=2, checkpoint_format="pbg"), "num_partitions=2"),
        # one shard of one partition: dealt randomly, not PyTorch-BigGraph's id order (an AssertionError before)
        (lambda: Nations().training, dict(num_shards=1, checkpoint_format="pbg"), "entities in id order"),
        (lambda: typed_graph().training, dict(checkpoint_format="pbg", partition="encoding"), "partition='token'"),
        (lambda: typed_graph().training, dict(checkpoint_format="hdf5"), "Unknown checkpoint_format"),
        (lambda: typed_graph().training, dict(num_shards=2, sharding="random"), "does not apply to a typed graph"),
    ],
)
def test_bad_settings_fail_before_training(factory, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_loop(factory(), **kwargs)


def test_a_model_pytorch_biggraph_cannot_express_fails_before_training() -> None:
    factory = typed_graph().training
    with pytest.raises(ValueError, match="cannot express PairRE"):
        BessTrainingLoop(
            model=PairRE(triples_factory=factory, embedding_dim=4), triples_factory=factory, checkpoint_format="pbg"
        )
    with pytest.raises(ValueError, match="p=1"):
        BessTrainingLoop(model=TransE(triples_factory=factory), triples_factory=factory, checkpoint_format="pbg")


# -- checkpoints in PyTorch-BigGraph's layout -----------------------------------------------------


class Losses(TrainingCallback):
    def __init__(self, fail_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.fail_at = fail_at

    def on_batch(self, epoch: int, batch, batch_loss: float, **kwargs) -> None:
        self.losses.append(batch_loss)
        if self.fail_at == (epoch, batch.step):
            raise KeyboardInterrupt("killed")


def train_pbg(
    graph: TypedGraph,
    directory: pathlib.Path,
    num_epochs: int,
    fail_at=None,
    optimizer: str = "rowwise_adagrad",
    storage: str | None = None,
    n_shard: int = 2,
):
    model = DistMult(triples_factory=graph.training, embedding_dim=4, random_seed=0, regularizer=None)
    loop = BessTrainingLoop(
        model=model,
        triples_factory=graph.training,
        num_shards=n_shard,
        negatives="typed",
        checkpoint_format="pbg",
        num_negs_per_pos=2 * n_shard,
        optimizer=optimizer,
        optimizer_kwargs=dict(lr=0.1),
        seed=3,
        storage=storage,
        automatic_memory_optimization=False,
    )
    callback = Losses(fail_at)
    loop.train(
        graph.training,
        num_epochs=num_epochs,
        batch_size=32,
        use_tqdm=False,
        callbacks=callback,
        checkpoint_directory=directory,
        checkpoint_name="bess.pt",
        checkpoint_frequency=0,
    )
    return loop, callback.losses


@pytest.mark.parametrize(("optimizer", "storage"), [("rowwise_adagrad", None), ("adam", None), ("adam", "host")])
def test_pbg_checkpoints_resume_identically(tmp_path: pathlib.Path, optimizer: str, storage: str | None) -> None:
    graph = typed_graph(num_partitions=2)
    full, full_losses = train_pbg(graph, tmp_path / "full", 3, optimizer=optimizer, storage=storage)
    with pytest.raises(KeyboardInterrupt):
        train_pbg(graph, tmp_path / "killed", 3, fail_at=(3, 1), optimizer=optimizer, storage=storage)
    # the killed run's directory is a PyTorch-BigGraph checkpoint of its last completed epoch
    assert files.read_version(tmp_path / "killed") == 2
    resumed, resumed_losses = train_pbg(graph, tmp_path / "killed", 3, optimizer=optimizer, storage=storage)
    assert resumed_losses == pytest.approx(full_losses[-len(resumed_losses) :], rel=1e-12)
    assert len(resumed_losses) == len(full_losses) // 3  # one epoch
    torch.testing.assert_close(
        resumed.model.entity_representations[0](None), full.model.entity_representations[0](None)
    )
    # the rows are in PyTorch-BigGraph's files, not twice: the resume state holds no table
    state = torch.load(tmp_path / "full" / "bess.pt.v3.rank0-of-2", weights_only=False)
    entity_state = {k: v for k, v in state["model_state_dict"].items() if k.startswith("entity_representations")}
    if storage is None:
        assert entity_state == {"entity_representations.0.external_weight": True}
    else:  # the tier's entry keeps the optimizer's row state only
        entry = entity_state["entity_representations.0.stored_table"]
        assert entry["external_weight"] and sorted(entry["tensors"]) == ["state.exp_avg", "state.exp_avg_sq"]
    names = sorted(p.name for p in (tmp_path / "full").iterdir())
    assert names == sorted(
        ["bess.pt", "bess.pt.v3.rank0-of-2", "checkpoint_version.txt", "config.json", "config.py", "entities"]
        + ["model.v3.h5"]
        + [f"embeddings_{t}_{p}.v3.h5" for t in graph.schema.entity_types for p in range(2)]
    )
    # PyTorch-BigGraph scores the checkpoint as PyKEEN scores the trained model
    triples = graph.testing.mapped_triples[:20]
    head, tail = pbg_scores(tmp_path / "full", graph.schema, triples)
    with torch.no_grad():
        expected = full.model.score_hrt(triples).view(-1)
    torch.testing.assert_close(head, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tail, expected, rtol=1e-5, atol=1e-6)


def test_a_pbg_checkpoint_resumes_only_on_the_layout_of_processes_that_wrote_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its optimizer state is kept per process: another layout is refused before training (it crashed in the step).

    The pointer says how many processes wrote it; a one-process run reading one written by 2 ranks is simulated
    by the pointer's reader (the pointer's digest forbids editing it).
    """
    from pykeen_bess.training.checkpoints import pbg as pbg_store

    graph = typed_graph(num_partitions=2)
    train_pbg(graph, tmp_path, 1)
    pointer = pbg_store.read_pointer(tmp_path / "bess.pt")
    assert pointer is not None and pointer["processes"] == 1
    monkeypatch.setattr(pbg_store, "read_pointer", lambda path: dict(pointer, processes=2))
    with pytest.raises(ValueError, match="was written by 2 processes, and this run has one: .* resumes only on the"):
        train_pbg(graph, tmp_path, 2)


def test_row_wise_adagrad_state_is_pytorch_biggraphs_optimizer_blob(tmp_path: pathlib.Path) -> None:
    from torchbiggraph.row_adagrad import RowAdagrad

    graph = typed_graph(num_partitions=2)
    loop, _ = train_pbg(graph, tmp_path, 2)
    table = loop.tables[0]
    sums = loop.optimizer.state[table.optimizer_parameter]["sum"]
    model, manager, config = pbg_model(tmp_path)
    assert config.lr == 0.1
    for t, name in enumerate(graph.schema.entity_types):
        for p in range(2):
            rows, state = manager.read(name, p)
            optimizer = RowAdagrad([torch.nn.Parameter(rows)], lr=123.0)
            optimizer.load_state_dict(state)  # PyTorch-BigGraph's own load
            assert optimizer.param_groups[0]["lr"] == 0.1  # the run's learning rate, not the config default
            ids = graph.schema.partition_range(t, p)
            state = optimizer.state[optimizer.param_groups[0]["params"][0]]
            torch.testing.assert_close(state["sum"], sums[table.entity_rows[torch.arange(ids.start, ids.stop)]])


def test_a_crash_before_the_pointer_moves_keeps_the_previous_version(tmp_path: pathlib.Path, monkeypatch) -> None:
    graph = typed_graph(num_partitions=2)
    train_pbg(graph, tmp_path, 1)
    real = files.write_version

    def crash(directory, version):
        if version == 2:
            raise OSError("disk full")
        real(directory, version)

    monkeypatch.setattr(files, "write_version", crash)
    with pytest.raises(OSError, match="disk full"):
        train_pbg(graph, tmp_path, 2)
    monkeypatch.setattr(files, "write_version", real)
    assert files.read_version(tmp_path) == 1
    assert (tmp_path / "model.v1.h5").is_file() and (tmp_path / "embeddings_user_0.v1.h5").is_file()
    loop, losses = train_pbg(graph, tmp_path, 2)  # resumes from version 1
    assert files.read_version(tmp_path) == 2 and not (tmp_path / "model.v1.h5").exists()
    assert losses and loop._epoch == 2


def test_training_continues_from_a_checkpoint_pytorch_biggraph_wrote(tmp_path: pathlib.Path) -> None:
    """A directory with PyTorch-BigGraph's files only: BESS adopts its rows, relations and epochs."""
    graph = typed_graph(num_partitions=2)
    source = DistMult(triples_factory=graph.training, embedding_dim=4, random_seed=7, regularizer=None)
    pbg.write_checkpoint(source, graph, tmp_path, version=2)  # as PyTorch-BigGraph would after 2 epochs
    loop, losses = train_pbg(graph, tmp_path, 2, optimizer="adam")
    assert losses == []  # 2 epochs completed: nothing to train
    torch.testing.assert_close(loop.model.entity_representations[0](None), source.entity_representations[0](None))
    torch.testing.assert_close(loop.model.relation_representations[0](None), source.relation_representations[0](None))
    loop, losses = train_pbg(graph, tmp_path, 3, optimizer="adam")
    assert losses and files.read_version(tmp_path) == 3  # epoch 3, written as version 3


def test_pipeline_with_a_typed_graph(tmp_path: pathlib.Path) -> None:
    """The issue's user code: read a PBG directory, train with typed negatives, write a PBG checkpoint."""
    pbg.write(
        typed_graph(num_partitions=2),
        tmp_path / "data",
        config=dict(dimension=8, operator="diagonal", comparator="dot"),
    )
    graph = pbg.read(tmp_path / "data", config=tmp_path / "data" / "config.json")
    result = pipeline(
        training=graph.training,
        testing=graph.testing,
        validation=graph.validation,
        model="DistMult",
        model_kwargs=dict(embedding_dim=8),
        training_loop="bess",
        training_loop_kwargs=dict(num_shards=2, negatives="typed"),
        negative_sampler_kwargs=dict(num_negs_per_pos=4),
        training_kwargs=dict(num_epochs=2, batch_size=32, use_tqdm=False),
        evaluator="bess",
        evaluation_kwargs=dict(use_tqdm=False),
        random_seed=0,
    )
    assert 0 < result.get_metric("mrr") <= 1
    pbg.write_checkpoint(result.model, graph, tmp_path / "ckpt", training_loop=result.training_loop)
    assert files.read_version(tmp_path / "ckpt") == 2
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["edge_paths"] == [str((tmp_path / "data" / "training").resolve())]


def test_training_starts_from_a_checkpoints_embeddings(tmp_path: pathlib.Path) -> None:
    """PyTorch-BigGraph's init_path: the checkpoint's rows and relations initialise a fresh BESS training."""
    graph = typed_graph(num_partitions=2)
    source = TransE(triples_factory=graph.training, embedding_dim=4, scoring_fct_norm=2, random_seed=3)
    pbg.write_checkpoint(source, graph, tmp_path / "init")
    model, model_kwargs = pbg.initial_model(tmp_path / "init", graph)
    assert model == "TransE"
    result = pipeline(
        training=graph.training,
        testing=graph.testing,
        model=model,
        model_kwargs=model_kwargs,
        training_loop="bess",
        training_loop_kwargs=dict(num_shards=2, negatives="typed"),
        optimizer="sgd",
        optimizer_kwargs=dict(lr=0.0),  # nothing moves: the model holds the checkpoint's values
        training_kwargs=dict(num_epochs=1, batch_size=64, use_tqdm=False),
        evaluation_kwargs=dict(use_tqdm=False),
    )
    triples = graph.testing.mapped_triples
    with torch.no_grad():
        torch.testing.assert_close(result.model.score_hrt(triples), source.score_hrt(triples))
