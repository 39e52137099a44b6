"""BessTrainingLoop: equality with a straightforward reference, PyKEEN features, bad input."""

from __future__ import annotations

import logging

import pathlib
from typing import Any

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.losses import SoftplusLoss
from pykeen.models import ComplEx, DistMult, TransE
from pykeen.nn.representation import Embedding
from pykeen.pipeline import pipeline
from pykeen.training import TrainingCallback
from pykeen.training.training_loop import NonFiniteLossError
from pykeen.triples import CoreTriplesFactory

from pykeen_bess.data.partition import ShardPairPartition
from pykeen_bess.data.sampling import NEGATIVES
from pykeen_bess.data.sharding import EntitySharding
from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.training import BessTrainingLoop

from capturable import default_dtype
from reference import reference_scores


@pytest.fixture(scope="module")
def dataset() -> Nations:
    return Nations()


@pytest.fixture(scope="module")
def small_factory(dataset: Nations) -> CoreTriplesFactory:
    """A few hundred Nations triples: an epoch is a handful of steps."""
    return CoreTriplesFactory.create(
        mapped_triples=dataset.training.mapped_triples[:300],
        num_entities=dataset.num_entities,
        num_relations=dataset.num_relations,
    )


class Recorder(TrainingCallback):
    """Records the parameters before the first step and every step's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.initial: dict[str, torch.Tensor] | None = None
        self.losses: list[float] = []

    def pre_batch(self, **kwargs) -> None:
        if self.initial is None:
            self.initial = {
                "entity": self.training_loop.tables[0].full_table().clone(),
                "relation": self.model.relation_representations[0]._embeddings.weight.detach().clone(),
            }

    def on_batch(self, epoch: int, batch, batch_loss: float, **kwargs) -> None:
        self.losses.append(batch_loss)


def make_loop(factory: CoreTriplesFactory, model_cls=DistMult, model_kwargs=None, **kwargs) -> BessTrainingLoop:
    model = model_cls(
        triples_factory=factory, random_seed=0, loss="softplus", **(model_kwargs or dict(embedding_dim=8))
    ).double()
    kwargs.setdefault("automatic_memory_optimization", False)
    return BessTrainingLoop(model=model, triples_factory=factory, **kwargs)


@pytest.mark.parametrize(
    ("n_shard", "exchange", "clip", "optimizer_name", "negatives"),
    [
        (1, "embedding", None, "adagrad", "step"),
        (3, "embedding", None, "adagrad", "step"),
        (3, "embedding", None, "adagrad", "block"),
        (3, "score", None, "adagrad", "block"),
        (3, "score", None, "adagrad", "step"),
        (3, "embedding", 0.05, "adagrad", "step"),
        (3, "embedding", None, "rowwise_adagrad", "block"),
    ],
)
def test_training_equals_dense_reference(
    small_factory: CoreTriplesFactory,
    n_shard: int,
    exchange: str,
    clip: float | None,
    optimizer_name: str,
    negatives: str,
) -> None:
    """Sharded training, row-sparse updates, constraints and clipping equal a dense global-id implementation."""
    from pykeen.optimizers import optimizer_resolver

    loop = make_loop(
        small_factory,
        num_shards=n_shard,
        exchange=exchange,
        num_negs_per_pos=2 * n_shard,
        seed=5,
        optimizer=optimizer_name,
        optimizer_kwargs=dict(lr=0.1),
        negatives=negatives,
    )
    model = loop.model
    recorder = Recorder()
    block_size = 4
    loop.train(
        small_factory,
        num_epochs=2,
        batch_size=block_size * n_shard**2,
        callbacks=recorder,
        use_tqdm=False,
        gradient_clipping_max_norm=clip,
    )

    # the reference: the same global plan, full tables, PyKEEN's interaction, dense Adagrad
    reference = DistMult(triples_factory=small_factory, embedding_dim=8, random_seed=0).double()
    entity = reference.entity_representations[0]._embeddings.weight
    relation = reference.relation_representations[0]._embeddings.weight
    with torch.no_grad():
        entity.copy_(recorder.initial["entity"])
        relation.copy_(recorder.initial["relation"])
    optimizer = optimizer_resolver.lookup(optimizer_name)([entity, relation], lr=0.1)
    sharding = loop.sharding  # the loop's (balanced) sharding: the plan is the same, the tables are global
    sampler = NEGATIVES[negatives](
        ShardPairPartition.from_triples(small_factory.mapped_triples, sharding),
        block_size=block_size,
        num_negs_per_pos=2 * n_shard,
        corruption="ht",
        seed=5,
    )
    regularizer = reference.relation_representations[0].regularizer
    losses = []
    for epoch in (1, 2):
        for batch in sampler.epoch(epoch):
            optimizer.zero_grad()
            positive, negative = reference_scores(reference, sharding, batch, grad=True)
            regularizer.reset()  # forget the lookups PyKEEN's representations regularized on the way
            valid = batch.valid
            loss = SoftplusLoss().process_slcwa_scores(positive[valid].unsqueeze(-1), negative[valid])
            # the relation regularizer sees the relations of the real positives twice, as in PyKEEN's sLCWA
            # (the positives' lookup and the negative triples', which repeat the relation)
            heads_relations = reference.relation_representations[0]._embeddings(batch.relations[valid])
            regularizer.update(heads_relations, heads_relations)
            loss = (loss + regularizer.pop_regularization_term()).sum()
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([entity, relation], clip)
            optimizer.step()
            reference.post_parameter_update()
            losses.append(loss.item())
    assert recorder.losses == pytest.approx(losses, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(model.entity_representations[0]._embeddings.weight, entity, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(model.relation_representations[0]._embeddings.weight, relation, rtol=1e-9, atol=1e-12)
    if optimizer_name == "rowwise_adagrad":  # one float of state per row of a shard table
        table = loop.tables[0].weight
        assert loop.optimizer.state[table]["sum"].shape == (table.shape[0],)


def test_sub_batching_gives_the_same_result(small_factory: CoreTriplesFactory) -> None:
    outcomes = []
    for sub_batch_size in (None, 2 * 9):
        loop = make_loop(
            small_factory, num_shards=3, num_negs_per_pos=6, optimizer="adam", optimizer_kwargs=dict(lr=0.05)
        )
        losses = loop.train(
            small_factory, num_epochs=3, batch_size=5 * 9, sub_batch_size=sub_batch_size, use_tqdm=False
        )
        outcomes.append((losses, loop.model.entity_representations[0]._embeddings.weight.detach().clone()))
    assert outcomes[0][0] == pytest.approx(outcomes[1][0], rel=1e-10)
    torch.testing.assert_close(outcomes[0][1], outcomes[1][1])


def test_checkpoint_resume_continues_identically(small_factory: CoreTriplesFactory, tmp_path: pathlib.Path) -> None:
    def run(num_epochs: int, name: str) -> tuple[list[float], torch.Tensor]:
        loop = make_loop(
            small_factory, num_shards=2, num_negs_per_pos=4, optimizer="adam", optimizer_kwargs=dict(lr=0.05)
        )
        losses = loop.train(
            small_factory,
            num_epochs=num_epochs,
            batch_size=16,
            use_tqdm=False,
            checkpoint_directory=tmp_path,
            checkpoint_name=name,
            checkpoint_frequency=0,
        )
        return losses, loop.model.entity_representations[0]._embeddings.weight.detach().clone()

    uninterrupted, weights = run(4, "full.pt")
    first, _ = run(2, "resumed.pt")
    resumed, resumed_weights = run(4, "resumed.pt")  # loads the checkpoint written after epoch 2
    assert first == pytest.approx(uninterrupted[:2])
    assert resumed == pytest.approx(uninterrupted, rel=1e-12)
    torch.testing.assert_close(resumed_weights, weights)


def test_pipeline_trains_a_sensible_model_and_saves_it(dataset: Nations, tmp_path: pathlib.Path) -> None:
    common = dict(
        dataset=dataset,
        model="DistMult",
        model_kwargs=dict(embedding_dim=32),
        random_seed=1,
        optimizer="adam",
        optimizer_kwargs=dict(lr=0.02),
        negative_sampler_kwargs=dict(num_negs_per_pos=32),
        training_kwargs=dict(num_epochs=15, batch_size=256, use_tqdm=False),
        evaluation_kwargs=dict(use_tqdm=False),
    )
    bess = pipeline(training_loop=BessTrainingLoop, training_loop_kwargs=dict(num_shards=2), **common)
    stock = pipeline(training_loop="slcwa", **common)
    assert bess.get_metric("mrr") >= 0.8 * stock.get_metric("mrr")
    # an ordinary PyKEEN model afterwards
    model = bess.model
    assert type(model.entity_representations[0]) is Embedding
    assert set(model.state_dict()) == set(stock.model.state_dict())
    from pykeen.predict import predict_target

    predictions = predict_target(model=model, head="brazil", relation="intergovorgs", triples_factory=dataset.training)
    assert len(predictions.df) == dataset.num_entities
    # the sharded evaluator evaluates with the training's sharding by default
    from pykeen_bess.evaluation import ShardedScoring

    assert ShardedScoring.for_model(model).rows.sharding.n_shard == 2
    bess.save_to_directory(tmp_path)
    loaded = torch.load(tmp_path / "trained_model.pkl", weights_only=False)
    batch = dataset.testing.mapped_triples[:10]
    torch.testing.assert_close(loaded.score_hrt(batch), model.score_hrt(batch))


@pytest.mark.parametrize(
    ("model", "model_kwargs"),
    [
        ("TransE", dict(embedding_dim=8)),
        ("ComplEx", dict(embedding_dim=8)),
        ("RotatE", dict(embedding_dim=8)),
        ("PairRE", dict(embedding_dim=8)),
        ("interht", dict(embedding_dim=8)),
        ("trans", dict(embedding_dim=8)),
    ],
)
def test_models_train(dataset: Nations, model: str, model_kwargs: dict) -> None:
    from pykeen_bess.nn.models import InterHT, TranS

    model_cls = {"interht": InterHT, "trans": TranS}.get(model, model)
    result = pipeline(
        dataset=dataset,
        model=model_cls,
        model_kwargs=model_kwargs,
        training_loop=BessTrainingLoop,
        training_loop_kwargs=dict(num_shards=2),
        training_kwargs=dict(num_epochs=2, batch_size=128, use_tqdm=False),
        negative_sampler_kwargs=dict(num_negs_per_pos=8),
        random_seed=0,
        evaluation_kwargs=dict(use_tqdm=False),
    )
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert 0 < result.get_metric("mrr") <= 1


@pytest.mark.parametrize("loss", ["softplus", "bcewithlogits", "marginranking", "nssa", "crossentropy"])
def test_pykeen_losses(dataset: Nations, loss: str) -> None:
    result = pipeline(
        dataset=dataset,
        model="DistMult",
        model_kwargs=dict(embedding_dim=8),
        loss=loss,
        training_loop=BessTrainingLoop,
        training_loop_kwargs=dict(num_shards=2, corruption="t"),
        training_kwargs=dict(num_epochs=2, batch_size=128, use_tqdm=False),
        random_seed=0,
        evaluation_kwargs=dict(use_tqdm=False),
    )
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))


def test_a_pre_step_callback_zeroing_the_gradients_leaves_the_model_as_a_zero_learning_rate(dataset: Nations) -> None:
    """The eager step's row-sparse update reads the rows of the gradient it finds (zero_() drops every row).

    It used the rows gathered before the callback ran: the fused Adam kernel got mismatched shapes and the
    interpreter crashed (segmentation fault).
    """

    class ZeroGrads(TrainingCallback):
        def pre_step(self, **kwargs: Any) -> None:
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    parameter.grad.zero_()

    models = []
    for lr, callbacks in ((0.01, [ZeroGrads()]), (0.0, [])):
        # (no constrainer: a zero learning rate constrains the rows it updates, the zeroed gradients touch none)
        model = ComplEx(triples_factory=dataset.training, embedding_dim=8, random_seed=0, regularizer=None)
        loop = BessTrainingLoop(
            model=model, triples_factory=dataset.training, num_shards=2, static_step=False,
            optimizer_kwargs=dict(lr=lr),
        )  # fmt: skip
        losses = loop.train(dataset.training, num_epochs=2, batch_size=256, use_tqdm=False, callbacks=callbacks)
        assert all(torch.isfinite(torch.tensor(losses)))
        models.append(model)
    for (name, zeroed), (_, unchanged) in zip(models[0].state_dict().items(), models[1].state_dict().items()):
        torch.testing.assert_close(zeroed, unchanged, rtol=0, atol=0, msg=name)


def test_pykeens_checkpoint_callback_saves_pykeens_layout(dataset: Nations, tmp_path: pathlib.Path) -> None:
    """Its files load into a fresh PyKEEN model: the saved rows are the model's after that epoch, in entity order.

    (They held the shard tables: a key no PyKEEN model has, rows in shard order.) Where no process can give the
    model its embeddings during training (tables in host memory here) it is refused before training.
    """
    from pykeen.checkpoints.base import load_state_torch

    def run(num_epochs: int, root: pathlib.Path | None, **loop_kwargs: Any) -> Any:
        every = dict(schedule="every", schedule_kwargs=dict(frequency=1), root=root)
        callbacks = dict(callbacks="checkpoint", callbacks_kwargs=every) if root else {}
        return pipeline(
            dataset=dataset, model="DistMult", model_kwargs=dict(embedding_dim=8), random_seed=0,
            training_loop=BessTrainingLoop, training_loop_kwargs=dict(num_shards=2, **loop_kwargs),
            training_kwargs=dict(num_epochs=num_epochs, batch_size=256, use_tqdm=False, **callbacks),
            evaluation_kwargs=dict(use_tqdm=False),
        )  # fmt: skip

    result = run(2, tmp_path / "every")
    files = sorted((tmp_path / "every").iterdir())
    # (PyKEEN 1.11's callback adds one to the 1-based epoch its loop passes, and so names its own loop's files)
    assert [file.name for file in files] == ["checkpoint_0000002.pt", "checkpoint_0000003.pt"]
    for file, model in zip(files, (run(1, None).model, result.model)):
        fresh = DistMult(triples_factory=dataset.training, embedding_dim=8)
        fresh.load_state_dict(load_state_torch(file)["state_dict"])
        for name, value in model.state_dict().items():
            torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=0, msg=name)
    # the same callback object, given to PyKEEN's own loop afterwards, saves as it does there
    from pykeen.training.callbacks import CheckpointTrainingCallback
    from pykeen.training import SLCWATrainingLoop

    callback = CheckpointTrainingCallback(schedule="every", schedule_kwargs=dict(frequency=1), root=tmp_path / "both")
    for loop_class in (BessTrainingLoop, SLCWATrainingLoop):
        model = DistMult(triples_factory=dataset.training, embedding_dim=8, random_seed=0)
        loop_class(model=model, triples_factory=dataset.training).train(
            dataset.training, num_epochs=1, batch_size=256, use_tqdm=False, callbacks=callback
        )
        fresh = DistMult(triples_factory=dataset.training, embedding_dim=8)
        fresh.load_state_dict(load_state_torch(tmp_path / "both" / "checkpoint_0000002.pt")["state_dict"])
    with pytest.raises(ValueError, match="checkpoint callback saves the model during training, where the tables live"):
        run(1, tmp_path / "host", storage="host")
    assert not any((tmp_path / "host").iterdir())


def test_schedulers_stoppers_trackers_callbacks(dataset: Nations) -> None:
    seen_batches = []

    class Count(TrainingCallback):
        def post_batch(self, epoch: int, batch, **kwargs) -> None:
            seen_batches.append(epoch)

    result = pipeline(
        dataset=dataset,
        model="DistMult",
        model_kwargs=dict(embedding_dim=8),
        training_loop=BessTrainingLoop,
        training_loop_kwargs=dict(num_shards=2),
        lr_scheduler="StepLR",
        lr_scheduler_kwargs=dict(step_size=1, gamma=0.5),
        stopper="early",
        stopper_kwargs=dict(frequency=1, patience=1, relative_delta=0.5),
        result_tracker="python",
        random_seed=0,
        clear_optimizer=False,
        training_kwargs=dict(num_epochs=20, batch_size=256, use_tqdm=False, callbacks=Count()),
        evaluation_kwargs=dict(use_tqdm=False),
    )
    assert result.stopper.stopped  # the huge relative delta stops early
    assert len(result.losses) < 20
    assert len(seen_batches) > 0
    assert result.training_loop.lr_scheduler.optimizer is result.training_loop.optimizer
    assert result.training_loop.optimizer.param_groups[0]["lr"] < 1e-3
    python_tracker = next(t for t in result.training_loop.result_tracker.trackers if hasattr(t, "metrics"))
    tracked = {key for metrics in python_tracker.metrics.values() for key in metrics}
    assert any("loss" in key for key in tracked)  # the epoch losses were tracked


@pytest.mark.parametrize(
    ("scheduler", "kwargs"), [("LinearLR", dict(start_factor=0.5, total_iters=2)), ("ConstantLR", dict(factor=0.5))]
)
def test_a_scheduler_that_scales_the_rate_when_made_scales_it_once(dataset: Nations, scheduler: str, kwargs) -> None:
    """LinearLR's start factor was applied twice (the loop took the scaled rate as the optimizer's, then rebuilt the
    scheduler for its own optimizer): training ran at half the rate torch's schedule gives."""
    rates: dict[int, float] = {}

    class Rates(TrainingCallback):
        def post_batch(self, epoch: int, batch, **kwargs) -> None:
            rates.setdefault(epoch, self.training_loop.optimizer.param_groups[0]["lr"])

    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.01)
    reference = getattr(torch.optim.lr_scheduler, scheduler)(optimizer, **kwargs)
    expected = []
    for _ in range(4):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()
    pipeline(
        dataset=dataset, model="DistMult", model_kwargs=dict(embedding_dim=8), training_loop=BessTrainingLoop,
        training_loop_kwargs=dict(num_shards=2), optimizer="SGD", optimizer_kwargs=dict(lr=0.01),
        lr_scheduler=scheduler, lr_scheduler_kwargs=kwargs, random_seed=0,
        training_kwargs=dict(num_epochs=4, batch_size=512, use_tqdm=False, callbacks=Rates()),
        evaluation_kwargs=dict(use_tqdm=False),
    )  # fmt: skip
    assert [rates[epoch] for epoch in sorted(rates)] == pytest.approx(expected, rel=1e-12)


def test_a_scheduler_whose_state_lacks_its_settings_is_refused_clearly(dataset: Nations) -> None:
    """OneCycleLR failed with "missing 1 required positional argument: 'max_lr'" from the loop's rebuilding."""
    with pytest.raises(ValueError, match="lr_scheduler=OneCycleLR cannot be made again.*StepLR"):
        BessTrainingLoop(
            model=DistMult(triples_factory=dataset.training, embedding_dim=8), triples_factory=dataset.training,
            lr_scheduler="OneCycleLR", lr_scheduler_kwargs=dict(max_lr=0.1, total_steps=10, cycle_momentum=False),
        )  # fmt: skip


def test_reduce_lr_on_plateau_is_refused_before_training(dataset: Nations) -> None:
    """PyKEEN steps its scheduler without a metric: ReduceLROnPlateau failed with a TypeError after an epoch."""
    with pytest.raises(ValueError, match="lr_scheduler=ReduceLROnPlateau steps by a metric"):
        BessTrainingLoop(
            model=DistMult(triples_factory=dataset.training, embedding_dim=8), triples_factory=dataset.training,
            lr_scheduler="ReduceLROnPlateau",
        )  # fmt: skip


def test_inverse_triples_and_gradient_clipping(dataset: Nations) -> None:
    inverse = Nations(create_inverse_triples=True)
    result = pipeline(
        dataset=inverse,
        model="DistMult",
        model_kwargs=dict(embedding_dim=8),
        training_loop=BessTrainingLoop,
        training_loop_kwargs=dict(num_shards=2),
        random_seed=0,
        training_kwargs=dict(
            num_epochs=2,
            batch_size=128,
            use_tqdm=False,
            gradient_clipping_max_norm=0.1,
            gradient_clipping_max_abs_value=0.01,
        ),
        evaluation_kwargs=dict(use_tqdm=False),
    )
    assert result.model.use_inverse_triples
    assert len(result.training_loop.partition(inverse.training).heads) == 2 * inverse.training.num_triples


def test_non_finite_loss_stops_with_the_step_and_writes_no_checkpoint(
    small_factory: CoreTriplesFactory, tmp_path: pathlib.Path
) -> None:
    class Poison(TrainingCallback):
        def post_batch(self, epoch: int, batch, **kwargs) -> None:
            if epoch == 2 and batch.step == 1:
                with torch.no_grad():
                    self.model.relation_representations[0]._embeddings.weight.fill_(float("nan"))

    loop = make_loop(small_factory, num_shards=2, num_negs_per_pos=4)
    with pytest.raises(NonFiniteLossError, match=r"epoch 2, step 3/"):
        loop.train(
            small_factory,
            num_epochs=3,
            batch_size=16,
            use_tqdm=False,
            callbacks=Poison(),
            checkpoint_directory=tmp_path,
            checkpoint_name="run.pt",
            checkpoint_frequency=0,
            checkpoint_on_failure=True,
        )
    # the checkpoint of epoch 1 is intact, no failure checkpoint was written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pt"]
    assert torch.load(tmp_path / "run.pt", weights_only=False)["epoch"] == 1
    # the model was restored as a plain model holding finite entity weights of the last step
    assert type(loop.model.entity_representations[0]) is Embedding
    assert bool(torch.isfinite(loop.model.entity_representations[0]._embeddings.weight).all())


def test_memory_search_chooses_a_batch_size_and_falls_back_to_sub_batching(
    small_factory: CoreTriplesFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probes that 'run out of memory' above 8 slots per block shrink batches, then sub-batches."""
    from pykeen_bess.training.setup.sizes import StepSizes

    original = StepSizes.probe
    probed = []

    def probe(self, partition, block_size, sub_block_size, label_smoothing):
        fits = sub_block_size <= 8
        probed.append((block_size, sub_block_size, fits))
        if not fits:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, partition, block_size, sub_block_size, label_smoothing)

    monkeypatch.setattr(StepSizes, "probe", probe)
    loop = make_loop(small_factory, num_shards=2, num_negs_per_pos=4, automatic_memory_optimization=True)
    loop.train(small_factory, num_epochs=1, batch_size=None, use_tqdm=False)
    # the search started at all 300 triples (75 slots per block) and halved until a batch fitted
    assert probed[0] == (75, 75, False)
    assert [fits for _, _, fits in probed].count(True) >= 1
    assert all(block <= 8 for block, _, fits in probed if fits)
    probed.clear()
    loop = make_loop(small_factory, num_shards=2, num_negs_per_pos=4, automatic_memory_optimization=True)
    loop.train(small_factory, num_epochs=1, batch_size=64 * 4, use_tqdm=False)
    assert probed[0] == (64, 64, False)
    assert probed[-1] == (64, 8, True)  # blocks of 64 slots in sub-batches of 8


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(num_shards=0), ValueError, "positive integer"),
        (dict(num_shards=15), ValueError, "larger than the number of entities"),
        (dict(exchange="carrier-pigeon"), ValueError, "Unknown exchange"),
        (dict(corruption="r"), ValueError, "Unknown corruption"),
        (dict(num_shards=3, num_negs_per_pos=4), ValueError, "multiple of num_shards"),
        (dict(num_negs_per_pos=0), ValueError, "positive integer"),
        (dict(negative_sampler="bernoulli"), ValueError, "negative_sampler"),
        (dict(negative_sampler_kwargs=dict(filtered=True)), ValueError, "filtered"),
        (dict(optimizer="rmsprop"), ValueError, "row-sparse"),
        (dict(num_shards=10**9), ValueError, "larger than the number of entities"),  # before laying them out
        (dict(replicas=0), ValueError, "replicas must be a positive integer"),
        (dict(replicas="2"), ValueError, "replicas must be a positive integer"),
        (dict(sparse_updates="False"), ValueError, "sparse_updates must be True or False"),
        (dict(num_threads=10**6), ValueError, "more than 4096 threads"),
    ],
)
def test_bad_input_is_rejected_before_training(dataset: Nations, kwargs: dict, error: type, message: str) -> None:
    model = DistMult(triples_factory=dataset.training, embedding_dim=4, random_seed=0)
    with pytest.raises(error, match=message):
        BessTrainingLoop(model=model, triples_factory=dataset.training, **kwargs)


@pytest.mark.parametrize(
    ("sampler_kwargs", "loop_kwargs"),
    [
        (dict(filtered=False), {}),  # PyKEEN's default: no filtering
        (dict(corruption_scheme=("head", "tail")), {}),  # PyKEEN's default: the loop's default corruption="ht"
        (dict(corruption_scheme=None), {}),  # PyKEEN's sampler reads None and () as its default, head and tail
        (dict(corruption_scheme=()), {}),
        (dict(corruption_scheme=["tail"]), dict(corruption="t")),
        (dict(corruption_scheme="head"), dict(corruption="h")),
    ],
)
def test_negative_sampler_kwargs_that_mean_what_the_loop_does_are_accepted(
    dataset: Nations, sampler_kwargs: dict, loop_kwargs: dict
) -> None:
    model = DistMult(triples_factory=dataset.training, embedding_dim=4, random_seed=0)
    kwargs = dict(negative_sampler_kwargs=dict(num_negs_per_pos=4, **sampler_kwargs), **loop_kwargs)
    loop = BessTrainingLoop(model=model, triples_factory=dataset.training, num_shards=2, **kwargs)
    assert loop.config.num_negs_per_pos == 4


@pytest.mark.parametrize(
    ("sampler_kwargs", "loop_kwargs"),
    [
        (dict(corruption_scheme=("head",)), {}),  # another side than the loop's corruption: not silently ignored
        (dict(corruption_scheme=("head", "relation", "tail")), {}),
        (dict(corruption_scheme=("head", "tail")), dict(corruption="t")),
        (dict(corruption_scheme=None), dict(corruption="h")),
    ],
)
def test_a_corruption_scheme_other_than_the_loops_is_refused(
    dataset: Nations, sampler_kwargs: dict, loop_kwargs: dict
) -> None:
    model = DistMult(triples_factory=dataset.training, embedding_dim=4, random_seed=0)
    with pytest.raises(ValueError, match="corruption_scheme=.*training_loop_kwargs=dict.corruption="):
        BessTrainingLoop(
            model=model, triples_factory=dataset.training, negative_sampler_kwargs=sampler_kwargs, **loop_kwargs
        )


@pytest.mark.parametrize("exchange", ["Auto", "AUTO", "Embedding", "ScoreMoving", "score_moving_scheme"])
def test_exchange_names_are_matched_as_the_scheme_resolver_matches_them(dataset: Nations, exchange: str) -> None:
    """``exchange="Auto"`` was refused ("Unknown exchange='Auto'") where "Embedding" or "EncodingScheme" worked."""
    model = DistMult(triples_factory=dataset.training, embedding_dim=4, random_seed=0)
    loop = BessTrainingLoop(model=model, triples_factory=dataset.training, num_shards=2, exchange=exchange)
    assert loop.settings.exchange == {"auto": "auto", "embedding": "embedding"}.get(exchange.lower(), "score")


def test_named_options_are_matched_as_pykeen_matches_names(dataset: Nations) -> None:
    """``partition="Token"``, ``corruption="HT"``, ``negatives="Step"`` or ``checkpoint_retrieval="one-per-group"``
    were refused ("Unknown partition='Token'") where ``storage="Host"`` and ``exchange="Auto"`` were accepted."""
    spelled = dict(
        partition="Token",
        corruption="HT",
        negatives="Step",
        sharding="Balanced",
        checkpoint_retrieval="One-Per-Group",
        checkpoint_format="PyKEEN",
        replica_grouping="None",
    )
    losses = []
    for options in (spelled, {key: value.lower().replace("-", "_") for key, value in spelled.items()}):
        model = DistMult(triples_factory=dataset.training, embedding_dim=4, random_seed=0)
        loop = BessTrainingLoop(model=model, triples_factory=dataset.training, num_shards=2, **options)
        assert {key: getattr(loop.settings, key) for key in spelled} == {
            key: value.lower().replace("-", "_") for key, value in spelled.items()
        }
        losses.append(loop.train(dataset.training, num_epochs=2, batch_size=256, use_tqdm=False))
    assert losses[0] == losses[1]
    with pytest.raises(ValueError, match="Unknown partition='tokens'"):
        BessTrainingLoop(model=model, triples_factory=dataset.training, partition="tokens")


def test_a_misspelt_option_names_the_loop_and_the_option_meant(dataset: Nations) -> None:
    """``num_shard=2`` was refused as "TrainingLoop.__init__() got an unexpected keyword argument" (PyKEEN's base)."""
    model = DistMult(triples_factory=dataset.training, embedding_dim=4, random_seed=0)
    with pytest.raises(TypeError, match="BessTrainingLoop got an unexpected keyword argument 'num_shard'; did you mean "
                       "'num_shards'"):  # fmt: skip
        BessTrainingLoop(model=model, triples_factory=dataset.training, num_shard=2)
    with pytest.raises(TypeError, match="'xyzzy'; its options: .*num_shards"):
        BessTrainingLoop(model=model, triples_factory=dataset.training, xyzzy=2)

    class Subclass(BessTrainingLoop):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)

    with pytest.raises(TypeError, match="Subclass got an unexpected keyword argument 'num_shard'; did you mean 'num"):
        Subclass(model=model, triples_factory=dataset.training, num_shard=2)  # the base classes' options suggested
    BessTrainingLoop(model=model, triples_factory=dataset.training, automatic_memory_optimization=False)  # PyKEEN's
    with pytest.raises(TypeError, match="BessEvaluator got an unexpected keyword argument 'num_shard'; did you mean "
                       "'num_shards'"):  # fmt: skip
        BessEvaluator(num_shard=4)
    BessEvaluator(clear_on_finalize=False, add_defaults=True)  # PyKEEN's


def test_a_batch_beyond_the_training_set_is_one_step_of_its_blocks(small_factory: CoreTriplesFactory) -> None:
    """A batch larger than every shardpair's triples trains as the batch that just holds them (no huge blocks)."""
    losses = [
        make_loop(small_factory, num_shards=2, num_threads=1).train(
            small_factory, num_epochs=2, batch_size=batch_size, use_tqdm=False
        )
        for batch_size in (10**7, 4 * small_factory.num_triples)
    ]
    assert losses[0] == losses[1]


def test_unsupported_models_are_named(dataset: Nations) -> None:
    from pykeen.models import ERModel
    from pykeen.nn.representation import LowRankRepresentation

    model = ERModel(
        triples_factory=dataset.training,
        interaction="DistMult",
        entity_representations=LowRankRepresentation,
        entity_representations_kwargs=dict(shape=4, num_bases=2),
        relation_representations_kwargs=dict(shape=4),
    )
    with pytest.raises(ValueError, match="not a plain pykeen.nn.Embedding.*Supported are"):
        BessTrainingLoop(model=model, triples_factory=dataset.training)


@pytest.mark.parametrize("static_step", [True, False])
@pytest.mark.parametrize(("optimizer", "kwargs"), [("adam", {}), ("sgd", dict(momentum=0.9))])
def test_dense_updates_keep_every_row_constrained(
    dataset: Nations, static_step: bool, optimizer: str, kwargs: dict
) -> None:
    """A dense update moves rows outside the step (running averages): only the step's rows were constrained, and
    DistMult's unit norm was off by up to 0.48 after two epochs (PyKEEN constrains the whole table every step)."""
    generator = torch.Generator().manual_seed(0)
    triples = torch.stack(
        [torch.randint(400, (1200,), generator=generator), torch.randint(5, (1200,), generator=generator),
         torch.randint(400, (1200,), generator=generator)], dim=1,
    )  # fmt: skip
    factory = CoreTriplesFactory.create(mapped_triples=triples, num_entities=400, num_relations=5)
    model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)
    loop = BessTrainingLoop(
        model=model, triples_factory=factory, num_shards=2, num_threads=1, optimizer=optimizer,
        optimizer_kwargs=dict(lr=0.05, **kwargs), sparse_updates=False, static_step=static_step,
        automatic_memory_optimization=False, num_negs_per_pos=4,
    )  # fmt: skip
    loop.train(factory, num_epochs=2, batch_size=32, use_tqdm=False)  # a step's rows: a few of the 400
    norms = model.entity_representations[0](indices=None).detach().norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=1e-6)


def test_dense_updates_accept_any_optimizer(small_factory: CoreTriplesFactory) -> None:
    loop = make_loop(small_factory, num_shards=2, num_negs_per_pos=4, optimizer="rmsprop", sparse_updates=False)
    losses = loop.train(small_factory, num_epochs=2, batch_size=16, use_tqdm=False)
    assert len(losses) == 2


def test_error_during_setup_loses_no_weights(small_factory: CoreTriplesFactory) -> None:
    loop = make_loop(small_factory, num_shards=2, num_negs_per_pos=4)
    before = loop.model.entity_representations[0]._embeddings.weight.detach().clone()
    with pytest.raises(ValueError, match="slice_size"):
        loop.train(small_factory, num_epochs=1, batch_size=16, slice_size=4, use_tqdm=False)
    assert type(loop.model.entity_representations[0]) is Embedding
    torch.testing.assert_close(loop.model.entity_representations[0]._embeddings.weight, before)


def test_transe_trains_with_scores_moving(small_factory: CoreTriplesFactory) -> None:
    loop = make_loop(small_factory, model_cls=TransE, num_shards=2, exchange="score", num_negs_per_pos=4)
    assert len(loop.train(small_factory, num_epochs=2, batch_size=16, use_tqdm=False)) == 2


@pytest.mark.parametrize(
    ("train_kwargs", "message"),
    [
        (dict(batch_size=0), "batch_size must be a positive integer"),
        (dict(batch_size=-16), "batch_size must be a positive integer"),
        (dict(batch_size=2.5), "batch_size must be a positive integer"),
        (dict(batch_size=16, sub_batch_size=0), "sub_batch_size must be a positive integer"),
        (dict(batch_size=16, num_epochs=-1), "num_epochs must be an integer >= 0"),
        (dict(batch_size=16, num_negs_per_pos=0), "num_negs_per_pos must be a positive integer"),
        # a negative bound flips or fixes every gradient, 0 stops learning: refused, not clipped
        (dict(batch_size=16, gradient_clipping_max_norm=-1.0), "gradient_clipping_max_norm must be a positive finite"),
        (dict(batch_size=16, gradient_clipping_max_norm=0), "gradient_clipping_max_norm must be a positive finite"),
        (dict(batch_size=16, gradient_clipping_max_abs_value=-1.0), "gradient_clipping_max_abs_value must be a posit"),
        (dict(batch_size=16, gradient_clipping_max_abs_value="1"), "gradient_clipping_max_abs_value must be a posit"),
        (
            dict(batch_size=16, gradient_clipping_max_norm=1.0, gradient_clipping_norm_type=-3),
            "gradient_clipping_norm_type must be a positive number or inf",
        ),
    ],
)
def test_bad_sizes_are_rejected_before_training(
    small_factory: CoreTriplesFactory, train_kwargs: dict, message: str
) -> None:
    loop = make_loop(small_factory, num_shards=2, num_negs_per_pos=4)
    before = loop.model.entity_representations[0]._embeddings.weight.detach().clone()
    train_kwargs = dict(dict(num_epochs=1), **train_kwargs)
    with pytest.raises(ValueError, match=message):
        loop.train(small_factory, use_tqdm=False, **train_kwargs)
    assert type(loop.model.entity_representations[0]) is Embedding
    torch.testing.assert_close(loop.model.entity_representations[0]._embeddings.weight, before)


@pytest.mark.parametrize("seed", ["abc", -1, 1.5, True])
def test_a_bad_seed_is_named(small_factory: CoreTriplesFactory, seed) -> None:
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        make_loop(small_factory, num_shards=2, num_negs_per_pos=4, seed=seed)


def test_triples_outside_the_model_are_rejected_before_training(small_factory: CoreTriplesFactory) -> None:
    loop = make_loop(small_factory, num_shards=2, num_negs_per_pos=4)
    triples = small_factory.mapped_triples.clone()
    triples[5, 1] = small_factory.num_relations + 3  # a relation the model does not have
    changed = CoreTriplesFactory.create(
        mapped_triples=triples, num_entities=small_factory.num_entities, num_relations=small_factory.num_relations + 4
    )
    with pytest.raises(ValueError, match=r"relation ids outside \[0, 55\) such as \[58\].*changed after the model"):
        loop.train(changed, num_epochs=1, batch_size=16, use_tqdm=False)


def test_batch_size_is_rounded_quietly(dataset: Nations, caplog: pytest.LogCaptureFixture) -> None:
    """pipeline()'s default batch_size=256 with 3 shards: no warning, the chosen size at INFO."""
    import logging

    with caplog.at_level(logging.INFO, logger="pykeen_bess"):
        pipeline(
            dataset=dataset,
            model="DistMult",
            model_kwargs=dict(embedding_dim=4),
            training_loop=BessTrainingLoop,
            training_loop_kwargs=dict(num_shards=3, automatic_memory_optimization=False),
            training_kwargs=dict(num_epochs=1, use_tqdm=False),
            evaluation_kwargs=dict(use_tqdm=False),
            random_seed=0,
        )
    bess_records = [r for r in caplog.records if r.name.startswith("pykeen_bess")]
    assert not [r for r in bess_records if r.levelno >= logging.WARNING], [r.message for r in bess_records]
    assert any("batch_size=256 rounded up to 261" in r.getMessage() for r in bess_records)


def test_sub_batch_size_rounding_is_logged(small_factory: CoreTriplesFactory, caplog: pytest.LogCaptureFixture) -> None:
    """A sub-batch takes the same slots of all num_shards**2 blocks: 5 became 9 (above the bound asked for) silently."""
    import logging

    for sub_batch_size, level, message in (
        (5, logging.WARNING, "raised to 9"),
        (17, logging.INFO, "rounded down to 9"),
    ):
        caplog.clear()
        loop = make_loop(small_factory, num_shards=3, num_negs_per_pos=3)
        with caplog.at_level(logging.INFO, logger="pykeen_bess"):
            loop.train(small_factory, num_epochs=1, batch_size=90, sub_batch_size=sub_batch_size, use_tqdm=False)
        records = [r for r in caplog.records if f"sub_batch_size={sub_batch_size} {message}" in r.getMessage()]
        assert records and records[0].levelno == level, [r.getMessage() for r in caplog.records]


def test_batch_search_does_not_pick_a_mostly_padded_epoch() -> None:
    """Kinships has 8,544 training triples: a batch of 8,192 would make two steps with 48% padding."""
    from pykeen.datasets import Kinships

    factory = Kinships().training
    slots = []

    class Slots(TrainingCallback):
        def on_batch(self, epoch: int, batch, batch_loss: float, **kwargs) -> None:
            slots.append((int(batch.valid.sum()), batch.valid.numel()))

    loop = make_loop(factory, num_shards=1, num_negs_per_pos=4, automatic_memory_optimization=True)
    loop.train(factory, num_epochs=1, batch_size=None, use_tqdm=False, callbacks=Slots())
    assert len(slots) == 2  # the largest batch that fits (8,192) gives two steps ...
    real, total = map(sum, zip(*slots))
    assert real == factory.num_triples
    assert 1 - real / total < 0.01  # ... of equal size, instead of 8,192 + 352 real triples


def test_tuned_num_negs_per_pos_is_rounded_to_the_shards(small_factory: CoreTriplesFactory) -> None:
    loop = make_loop(small_factory, num_shards=3, num_negs_per_pos=6)
    loop.train(small_factory, num_epochs=1, batch_size=18, num_negs_per_pos=16, use_tqdm=False)
    assert loop.config.num_negs_per_pos == 18


def test_a_tuned_num_negs_per_pos_survives_a_setup_assembled_again(small_factory, tmp_path) -> None:
    """Resuming a checkpoint of another derived seed assembles the setup again: it trained the constructor's value."""
    checkpoint = dict(checkpoint_directory=tmp_path, checkpoint_name="c.pt", checkpoint_frequency=0)

    def loop(random_seed: int) -> BessTrainingLoop:
        model = DistMult(triples_factory=small_factory, embedding_dim=8, random_seed=random_seed)
        return BessTrainingLoop(
            model=model, triples_factory=small_factory, num_shards=3, num_negs_per_pos=6,
            automatic_memory_optimization=False,
        )  # fmt: skip

    loop(0).train(small_factory, num_epochs=1, batch_size=18, use_tqdm=False, **checkpoint)
    resumed = loop(1)  # another model seed: the checkpoint's derived seed is adopted
    resumed.train(small_factory, num_epochs=2, batch_size=18, use_tqdm=False, num_negs_per_pos=12, **checkpoint)
    assert resumed.config.seed == 0 and resumed.config.num_negs_per_pos == 12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_a_model_of_mixed_dtypes_is_refused_as_such(dataset: Nations, dtype: torch.dtype) -> None:
    """Entity tables of another dtype than the relations: refused by the constructor, naming both.

    The error said the model changed its dtype after the loop was built, at train().
    """
    entity_kwargs = dict(dtype=dtype)
    model = DistMult(
        triples_factory=dataset.training, embedding_dim=4, random_seed=0, entity_representations_kwargs=entity_kwargs
    )
    with pytest.raises(ValueError, match=f"mixes parameter dtypes .*{dtype}: entity_representations.0"):
        BessTrainingLoop(model=model, triples_factory=dataset.training)


def test_a_reset_that_changes_a_parameters_dtype_is_refused(dataset: Nations) -> None:
    """QuatE converted with .double(): PyKEEN's re-initialisation draws its relations in float32 again.

    BESS trained it in mixed precision, silently (PyKEEN's own loop fails on it); refused before any step,
    and the model created under the default dtype trains in float64 throughout.
    """
    from pykeen.models import QuatE

    model = QuatE(triples_factory=dataset.training, embedding_dim=4, random_seed=0).double()
    loop = BessTrainingLoop(model=model, triples_factory=dataset.training, automatic_memory_optimization=False)
    with pytest.raises(ValueError, match="re-initialisation .* drew relation_representations.0.* as torch.float32"):
        loop.train(dataset.training, num_epochs=1, batch_size=64, use_tqdm=False)
    from pykeen.nn import quaternion

    with default_dtype(torch.float64):
        quaternion.multiplication_table.cache_clear()  # (PyKEEN caches QuatE's table in the first model's dtype)
        model = QuatE(triples_factory=dataset.training, embedding_dim=4, random_seed=0)
        loop = BessTrainingLoop(model=model, triples_factory=dataset.training, automatic_memory_optimization=False)
        loop.train(dataset.training, num_epochs=1, batch_size=64, use_tqdm=False)
    quaternion.multiplication_table.cache_clear()
    assert {p.dtype for p in model.parameters()} == {torch.float64}


def test_a_chosen_num_negs_per_pos_replaced_by_train_warns(small_factory: CoreTriplesFactory, caplog) -> None:
    """hpo_pipeline tunes num_negs_per_pos as a training argument: the value given to the loop was replaced silently."""
    loop = make_loop(small_factory, num_shards=3, num_negs_per_pos=6)
    with caplog.at_level(logging.WARNING, logger="pykeen_bess"):
        loop.train(small_factory, num_epochs=1, batch_size=18, num_negs_per_pos=16, use_tqdm=False)
    assert "train(num_negs_per_pos=16) replaces the loop's num_negs_per_pos=6" in caplog.text
    assert "training_kwargs=dict(num_negs_per_pos=6)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pykeen_bess"):  # back to the chosen value: nothing replaced
        loop.train(small_factory, num_epochs=1, batch_size=18, num_negs_per_pos=6, use_tqdm=False)
    assert "replaces" not in caplog.text
    for loop, tuned in (
        (make_loop(small_factory, num_shards=3), 16),
        (make_loop(small_factory, num_shards=3, num_negs_per_pos=6), 5),
    ):
        with caplog.at_level(logging.WARNING, logger="pykeen_bess"):  # the loop's default, or the same rounded
            loop.train(small_factory, num_epochs=1, batch_size=18, num_negs_per_pos=tuned, use_tqdm=False)
    assert "replaces" not in caplog.text


def test_hpo_with_a_shard_count_that_is_not_a_power_of_two(dataset: Nations) -> None:
    from pykeen.hpo import hpo_pipeline

    result = hpo_pipeline(
        dataset=dataset,
        model="DistMult",
        model_kwargs=dict(embedding_dim=4),
        training_loop=BessTrainingLoop,
        training_loop_kwargs=dict(num_shards=3),
        training_kwargs=dict(num_epochs=1, use_tqdm=False),
        evaluator="bess",
        evaluation_kwargs=dict(use_tqdm=False),
        n_trials=3,
        sampler="random",
        sampler_kwargs=dict(seed=3),
    )
    states = [trial.state.name for trial in result.study.trials]
    assert states == ["COMPLETE"] * 3
    assert any(trial.params["training.num_negs_per_pos"] % 3 for trial in result.study.trials)


@pytest.mark.parametrize("model_name", ["DistMult", "ComplEx", "RotatE"])
def test_initial_tables_are_pykeens_and_do_not_depend_on_the_sharding(dataset: Nations, model_name: str) -> None:
    """The shard tables start from exactly what PyKEEN's own initialisation draws from the table's seed."""
    from pykeen.models import model_resolver

    from pykeen_bess.tables.representation import INITIALIZATION_STREAM
    from pykeen_bess.data.seeds import derive_seed

    tables = []
    for n_shard in (1, 3):
        model = model_resolver.make(model_name, triples_factory=dataset.training, embedding_dim=6, random_seed=0)
        loop = BessTrainingLoop(model=model, triples_factory=dataset.training, num_shards=n_shard, seed=11)
        with loop.tables.installed(copy_weights=False):
            model.reset_parameters_()
            tables.append(loop.tables[0].full_table().clone())
    torch.testing.assert_close(tables[0], tables[1], rtol=0, atol=0)
    # PyKEEN's Embedding.reset_parameters under the table's seed draws the same values (same shapes, same fans)
    embedding = model_resolver.make(
        model_name, triples_factory=dataset.training, embedding_dim=6
    ).entity_representations[0]
    embedding.constrainer = None
    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(11, INITIALIZATION_STREAM, 0))
        embedding.reset_parameters()
    torch.testing.assert_close(tables[0], embedding._embeddings.weight.detach(), rtol=0, atol=0)


def test_whole_table_weight_regularizers_are_refused(dataset: Nations) -> None:
    from pykeen.models import TransH

    with pytest.raises(ValueError, match="regularizes the whole entity table"):
        BessTrainingLoop(
            model=TransH(triples_factory=dataset.training, embedding_dim=4), triples_factory=dataset.training
        )
    # with weight 0 (as the message says) it trains
    model = TransH(
        triples_factory=dataset.training, embedding_dim=4, regularizer="normlimit", regularizer_kwargs=dict(weight=0.0)
    )
    loop = BessTrainingLoop(model=model, triples_factory=dataset.training, num_shards=2)
    assert len(loop.train(dataset.training, num_epochs=1, batch_size=256, use_tqdm=False)) == 1


def test_entity_representations_sharing_a_table_are_refused(dataset: Nations) -> None:
    """One Embedding in two entity positions (tied roles) was trained as two tables, drawn and updated apart, and
    written back into the one Embedding (the last won)."""
    from pykeen.models import ERModel
    from pykeen.nn.representation import Embedding

    tied = Embedding(max_id=dataset.num_entities, shape=4)
    model = ERModel(
        triples_factory=dataset.training, interaction="SimplE", entity_representations=[tied, tied],
        relation_representations_kwargs=[dict(shape=4), dict(shape=4)],
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"entity representations \[0, 1\] are one table"):
        BessTrainingLoop(model=model, triples_factory=dataset.training)
    shared = Embedding(max_id=max(dataset.num_entities, dataset.num_relations), shape=4)
    model = ERModel(
        triples_factory=dataset.training, interaction="DistMult", entity_representations=[shared],
        relation_representations=[shared],
    )  # fmt: skip
    with pytest.raises(ValueError, match="a relation representation uses an entity table"):
        BessTrainingLoop(model=model, triples_factory=dataset.training)


@pytest.mark.parametrize(
    ("constrainer", "kwargs", "refused"),
    [
        ("clampnorm", dict(maxnorm=1.0), True),  # PyKEEN's clamp_norm without dim: the whole table's norm
        ("clampnorm", dict(maxnorm=1.0, dim=-1), False),
        ("normalize", dict(dim=0), True),  # across entities
        ("normalize", None, False),
        ("clamp", dict(min=-1.0, max=1.0), False),
    ],
)
def test_constrainers_of_the_whole_table_are_refused(dataset: Nations, constrainer, kwargs, refused) -> None:
    """A step constrains the rows it updated: PyKEEN's clamp_norm without dim clamped those rows' joint norm."""
    model = DistMult(
        triples_factory=dataset.training, embedding_dim=4,
        entity_representations_kwargs=dict(constrainer=constrainer, constrainer_kwargs=kwargs),
    )  # fmt: skip
    if refused:
        with pytest.raises(ValueError, match="constrains the whole table at once.*dim=-1"):
            BessTrainingLoop(model=model, triples_factory=dataset.training)
    else:
        BessTrainingLoop(model=model, triples_factory=dataset.training)


@pytest.mark.parametrize("name", __import__("pykeen_bess.training").training.SUPPORTED_MODEL_EXAMPLES)
def test_the_models_named_as_supported_exist_and_train(dataset: Nations, name: str) -> None:
    """Every model the error message names is a registered model that BESS accepts."""
    from pykeen.models import model_resolver

    model = model_resolver.make(name, triples_factory=dataset.training, random_seed=0)
    loop = BessTrainingLoop(model=model, triples_factory=dataset.training, num_shards=2, num_negs_per_pos=4)
    assert len(loop.train(dataset.training, num_epochs=1, batch_size=512, use_tqdm=False)) == 1


def test_the_partition_cache_never_serves_stale_triples(small_factory: CoreTriplesFactory) -> None:
    """The partition is rebuilt for changed triples: in place (same tensor) or a new tensor (whatever its id)."""
    loop = make_loop(small_factory, num_shards=2, num_negs_per_pos=4)
    triples = small_factory.mapped_triples.clone()
    factory = CoreTriplesFactory.create(
        mapped_triples=triples, num_entities=small_factory.num_entities, num_relations=small_factory.num_relations
    )
    first = loop.partition(factory)
    assert loop.partition(factory) is first  # cached
    with torch.no_grad():
        triples[:5, 1] = (triples[:5, 1] + 1) % small_factory.num_relations  # changed in place: same tensor, same id
    changed = loop.partition(factory)
    assert changed is not first
    assert torch.equal(changed.global_triples()[changed.triple_ids.argsort()], triples)
    # another tensor with the same content is another tensor (never compared by id alone)
    other = CoreTriplesFactory.create(
        mapped_triples=triples.clone(),
        num_entities=small_factory.num_entities,
        num_relations=small_factory.num_relations,
    )
    assert loop.partition(other) is not changed


def test_dataclasses_holding_tensors_compare_by_identity() -> None:
    """Frozen dataclasses with tensors get no generated ``__eq__`` (comparing tensors would raise)."""
    from pykeen_bess.evaluation.filtering import FilterIndex

    sharding = EntitySharding.create(10, 2, seed=0)
    partition = ShardPairPartition.from_triples(torch.tensor([[0, 0, 1], [2, 1, 3]]), sharding)
    index = FilterIndex.from_triples(torch.tensor([[0, 0, 1]]), 10, 2)
    for value, twin in (
        (sharding, EntitySharding.create(10, 2, seed=0)),
        (partition, ShardPairPartition.from_triples(torch.tensor([[0, 0, 1], [2, 1, 3]]), sharding)),
        (index, FilterIndex.from_triples(torch.tensor([[0, 0, 1]]), 10, 2)),
        (index.tail, index.tail),
    ):
        assert value == value
        assert (value == twin) is (value is twin)


def test_the_compared_configuration_sees_settings_a_repr_hides(small_factory: CoreTriplesFactory) -> None:
    """Ranks compare their configurations: a loss's margin, a regularizer's weight, a scheduler's settings, the
    entity initializer and the sharding strategy each make a difference (each trained a mixture silently)."""

    def configuration(**changes: Any) -> dict[str, str]:
        model_kwargs = dict(embedding_dim=8, loss="marginranking", loss_kwargs=dict(margin=1.0))
        model_kwargs.update(changes.pop("model", {}))
        model = DistMult(triples_factory=small_factory, random_seed=0, **model_kwargs)
        loop_kwargs = dict(num_shards=2, lr_scheduler="ExponentialLR", lr_scheduler_kwargs=dict(gamma=0.9))
        loop = BessTrainingLoop(model=model, triples_factory=small_factory, **{**loop_kwargs, **changes})
        return loop.run_configuration(small_factory)

    base = configuration()
    assert configuration() == base  # the same in every process: no addresses
    for expected, changes in {
        "loss": dict(model=dict(loss_kwargs=dict(margin=2.0))),
        "regularizers": dict(model=dict(regularizer_kwargs=dict(weight=0.5))),
        "lr_scheduler": dict(lr_scheduler_kwargs=dict(gamma=0.5)),
        "entity_initializers": dict(model=dict(entity_initializer="normal_")),
        "sharding": dict(sharding="random"),
    }.items():
        other = configuration(**changes)
        assert [key for key in base if other.get(key) != base[key]] == [expected], expected


def test_a_model_without_relation_representations_trains(small_factory: CoreTriplesFactory) -> None:
    """UM (no relation representation) trains, the static step as the eager one, both exchanges alike."""
    from pykeen.models import UM

    def losses(**kwargs: Any) -> list[float]:
        model = UM(triples_factory=small_factory, embedding_dim=8, random_seed=0).double()
        loop = BessTrainingLoop(model=model, triples_factory=small_factory, num_threads=1, seed=0, **kwargs)
        return loop.train(small_factory, num_epochs=2, batch_size=64, use_tqdm=False)

    assert losses(num_shards=1) == losses(num_shards=1, static_step=False)
    torch.testing.assert_close(losses(num_shards=2), losses(num_shards=2, exchange="score"))


def test_a_model_converted_after_the_loop_was_built_is_refused(small_factory: CoreTriplesFactory) -> None:
    """The loop copied the float32 tables: a model made float64 afterwards is refused before any step."""
    model = DistMult(triples_factory=small_factory, embedding_dim=8, random_seed=0)
    loop = BessTrainingLoop(model=model, triples_factory=small_factory, num_shards=2)
    model.double()
    with pytest.raises(ValueError, match="changed its dtype after the loop was built"):
        loop.train(small_factory, num_epochs=1, batch_size=64, use_tqdm=False)


def test_continue_training_with_an_optimizer_without_state(small_factory: CoreTriplesFactory) -> None:
    """Plain SGD (dense) keeps no state: a trained loop continues all the same (PyKEEN's refuses it)."""
    loop = make_loop(small_factory, num_shards=2, num_threads=1, optimizer="sgd", sparse_updates=False)
    first = loop.train(small_factory, num_epochs=1, batch_size=64, use_tqdm=False)
    assert not loop.optimizer.state
    assert loop.train(small_factory, num_epochs=2, batch_size=64, use_tqdm=False, continue_training=True)[0] == first[0]
    fresh = make_loop(small_factory, num_shards=2, num_threads=1, optimizer="sgd", sparse_updates=False)
    with pytest.raises(ValueError, match="without being trained once"):
        fresh.train(small_factory, num_epochs=1, batch_size=64, use_tqdm=False, continue_training=True)


def test_continue_training_after_the_optimizer_was_cleared(small_factory: CoreTriplesFactory) -> None:
    """pipeline() clears the optimizer by default: continuing says what to do instead of an AttributeError."""
    loop = make_loop(small_factory, num_shards=2, num_threads=1)
    loop.train(small_factory, num_epochs=1, batch_size=64, use_tqdm=False, clear_optimizer=True)
    with pytest.raises(ValueError, match="clear_optimizer=False"):
        loop.train(small_factory, num_epochs=2, batch_size=64, use_tqdm=False, continue_training=True)


def test_clearing_the_optimizer_frees_its_state(small_factory: CoreTriplesFactory) -> None:
    """``clear_optimizer`` (pipeline()'s default) lets the optimizer and its state go: the loop's steps held them
    (with Adam, twice the entity table kept alive as long as the pipeline's result)."""
    import gc
    import weakref

    loop = make_loop(small_factory, num_shards=2, num_threads=1)
    loop.train(small_factory, num_epochs=1, batch_size=64, use_tqdm=False, clear_optimizer=False)
    optimizer = weakref.ref(loop.optimizer)
    assert loop.optimizer.state and loop.static is not None
    loop.train(small_factory, num_epochs=2, batch_size=64, use_tqdm=False, continue_training=True, clear_optimizer=True)
    gc.collect()
    assert loop.optimizer is None and optimizer() is None


@pytest.mark.parametrize("num_shards", [1, 2])
def test_a_relation_normalizer_normalizes_each_row(dataset: Nations, num_shards: int) -> None:
    """PyKEEN's "normalize" normalizer (``F.normalize``, ``dim=1``) ran on relation rows ``[L, n, b', d]``: across
    the shard axis, so the positives' scores were not the model's (1,529 of 1,592 at one shard, up to 7.1)."""
    from pykeen.models import ERModel

    class Recording(SoftplusLoss):
        def process_slcwa_scores(self, positive_scores, negative_scores, *args, **kwargs):
            if positive_scores.dtype == torch.float32:  # (not the loss's float64 probe of its reduction)
                seen.append(positive_scores.detach().reshape(-1).clone())
            return super().process_slcwa_scores(positive_scores, negative_scores, *args, **kwargs)

    seen: list[torch.Tensor] = []
    factory = dataset.training
    model = ERModel(
        triples_factory=factory, interaction="distmult", loss=Recording(), random_seed=1,
        entity_representations_kwargs=dict(shape=8),
        relation_representations_kwargs=dict(shape=8, normalizer="normalize"),
    )  # fmt: skip
    loop = BessTrainingLoop(
        model=model, triples_factory=factory, num_shards=num_shards, optimizer="sgd", optimizer_kwargs=dict(lr=0.0),
        automatic_memory_optimization=False, corruption="t",
    )  # fmt: skip
    loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
    with torch.no_grad():
        truth = model.score_hrt(factory.mapped_triples).reshape(-1)
    got = torch.cat(seen)
    distance = (got.unsqueeze(1) - truth.unsqueeze(0)).abs().min(dim=1).values  # every positive is some triple's score
    assert got.numel() >= factory.num_triples and float(distance.max()) < 1e-5


@pytest.mark.parametrize("static_step", [True, False])
@pytest.mark.parametrize(("batch_size", "settings"), [(2, {}), (8, dict(num_negs_per_pos=1))])
def test_rotate_trains_steps_with_one_head_corrupted_slot_or_one_negative(
    static_step: bool, batch_size: int, settings: dict
) -> None:
    """RotatE's head-side features of one row (one head-corrupted slot, or one negative) failed in the backward pass
    ("storage_offset divisible by 2") where PyKEEN trains."""
    from pykeen.models import RotatE

    triples = torch.tensor([[0, 0, 1], [1, 0, 2], [2, 1, 3], [3, 1, 4]])
    factory = CoreTriplesFactory.create(mapped_triples=triples, num_entities=5, num_relations=2)
    model = RotatE(triples_factory=factory, embedding_dim=2, random_seed=0)
    loop = BessTrainingLoop(
        model=model, triples_factory=factory, num_shards=1, num_threads=1, static_step=static_step, **settings
    )
    losses = loop.train(factory, num_epochs=2, batch_size=batch_size, use_tqdm=False)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("static_step", [True, False])
def test_an_l2_regularizer_subclass_collecting_its_terms_its_own_way_is_honoured(
    dataset: Nations, static_step: bool
) -> None:
    """A subclass of PyKEEN's L2 regularizer that scales its collected term (a warm-up factor, by overriding
    ``pop_regularization_term``) trains as PyKEEN's regularizer of the scaled weight; the fast L2 path ignored it."""
    from pykeen.regularizers import LpRegularizer

    class Tripled(LpRegularizer):
        def pop_regularization_term(self) -> torch.Tensor:
            return 3.0 * super().pop_regularization_term()

    results = []
    for regularizer in (Tripled(weight=0.5, p=2.0), LpRegularizer(weight=1.5, p=2.0)):
        model = DistMult(triples_factory=dataset.training, embedding_dim=8, random_seed=0, regularizer=regularizer)
        loop = BessTrainingLoop(
            model=model, triples_factory=dataset.training, num_shards=2, num_threads=1, static_step=static_step,
            automatic_memory_optimization=False, num_negs_per_pos=4, optimizer="sgd", optimizer_kwargs=dict(lr=0.1),
        )  # fmt: skip
        losses = loop.train(dataset.training, num_epochs=2, batch_size=256, use_tqdm=False)
        results.append((losses, model.entity_representations[0](indices=None).detach()))
    (tripled_losses, tripled), (losses, weights) = results
    assert tripled_losses == pytest.approx(losses, rel=1e-6)
    torch.testing.assert_close(tripled, weights, rtol=1e-5, atol=1e-6)
