"""BessTrainingLoop against PyKEEN's own SLCWATrainingLoop for the parts of ``_train`` they share.

The loop restates PyKEEN's ``TrainingLoop._train`` with named differences (see
:mod:`pykeen_bess.training.epochs`). What they share must stay the same when PyKEEN changes: the
order in which callbacks are called, what the result tracker receives, when the stopper
evaluates and which best epoch is restored, and what a checkpoint holds. One shard, one step per
PyKEEN batch, no sub-batches: the two loops then make the same calls, so an upgrade of PyKEEN
that changes any of them fails here.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.evaluation import RankBasedEvaluator
from pykeen.models import DistMult
from pykeen.stoppers import EarlyStopper
from pykeen.trackers.base import PythonResultTracker
from pykeen.training import SLCWATrainingLoop
from pykeen.training.callbacks import TrainingCallback

from pykeen_bess.training import BessTrainingLoop

BATCH_SIZE = 400  # Nations' 1,592 training triples: 4 batches, the last one incomplete


@pytest.fixture(scope="module")
def dataset() -> Nations:
    return Nations()


class CallRecorder(TrainingCallback):
    """Records every callback hook with the epoch it was called in."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []

    def pre_batch(self, **kwargs: Any) -> None:
        self.calls.append(("pre_batch",))

    def on_batch(self, epoch: int, batch: Any, batch_loss: float, **kwargs: Any) -> None:
        self.calls.append(("on_batch", epoch))

    def pre_step(self, **kwargs: Any) -> None:
        self.calls.append(("pre_step",))

    def post_batch(self, epoch: int, batch: Any, **kwargs: Any) -> None:
        self.calls.append(("post_batch", epoch))

    def post_epoch(self, epoch: int, epoch_loss: float, **kwargs: Any) -> None:
        self.calls.append(("post_epoch", epoch))

    def post_train(self, losses: list[float], **kwargs: Any) -> None:
        self.calls.append(("post_train", len(losses)))


class MetricRecorder(PythonResultTracker):
    """Records the names and steps of the metrics a loop logs."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[tuple[str, ...], int | None, str | None]] = []

    def log_metrics(self, metrics: Any, step: int | None = None, prefix: str | None = None) -> None:
        self.logged.append((tuple(sorted(metrics)), step, prefix))
        super().log_metrics(metrics, step=step, prefix=prefix)


def make_loop(dataset: Nations, bess: bool, **kwargs: Any) -> SLCWATrainingLoop:
    model = DistMult(triples_factory=dataset.training, embedding_dim=16, random_seed=1)
    optimizer = torch.optim.Adam(model.get_grad_params(), lr=0.01)
    if bess:
        return BessTrainingLoop(
            model=model,
            triples_factory=dataset.training,
            optimizer=optimizer,
            num_shards=1,
            num_negs_per_pos=4,
            num_threads=1,
            automatic_memory_optimization=False,
            **kwargs,
        )
    return SLCWATrainingLoop(
        model=model,
        triples_factory=dataset.training,
        optimizer=optimizer,
        negative_sampler_kwargs=dict(num_negs_per_pos=4),
        automatic_memory_optimization=False,
        **kwargs,
    )


def train(loop: SLCWATrainingLoop, dataset: Nations, **kwargs: Any) -> list[float] | None:
    return loop.train(dataset.training, batch_size=BATCH_SIZE, use_tqdm=False, **kwargs)


def test_callbacks_are_called_in_pykeens_order(dataset: Nations) -> None:
    recorded = {}
    for bess in (False, True):
        recorder = CallRecorder()
        train(make_loop(dataset, bess), dataset, num_epochs=3, callbacks=recorder)
        recorded[bess] = recorder.calls
    assert recorded[True] == recorded[False]
    assert recorded[False].count(("post_epoch", 3)) == 1 and recorded[False][-1] == ("post_train", 3)


def test_the_tracker_receives_pykeens_metrics(dataset: Nations) -> None:
    logged = {}
    for bess in (False, True):
        tracker = MetricRecorder()
        train(make_loop(dataset, bess, result_tracker=tracker), dataset, num_epochs=3)
        logged[bess] = tracker.logged
    assert logged[True] == logged[False] and len(logged[False]) == 3


def test_the_stopper_evaluates_at_pykeens_epochs_and_restores_the_best(dataset: Nations) -> None:
    outcome = {}
    for bess in (False, True):
        loop = make_loop(dataset, bess)
        stopper = EarlyStopper(
            model=loop.model,
            evaluator=RankBasedEvaluator(),
            training_triples_factory=dataset.training,
            evaluation_triples_factory=dataset.validation,
            frequency=2,
            patience=50,
            evaluation_batch_size=256,
        )
        losses = train(loop, dataset, num_epochs=6, stopper=stopper)
        assert losses is not None
        outcome[bess] = (len(stopper.results), stopper.number_results, stopper.best_epoch is not None, len(losses))
    assert outcome[True] == outcome[False] == (3, 3, True, 6)


def test_a_checkpoint_holds_what_pykeens_holds(dataset: Nations, tmp_path: pathlib.Path) -> None:
    contents = {}
    for bess in (False, True):
        directory = tmp_path / ("bess" if bess else "pykeen")
        train(make_loop(dataset, bess), dataset, num_epochs=2, checkpoint_name="c.pt", checkpoint_directory=directory)
        contents[bess] = torch.load(directory / "c.pt", weights_only=False)
    assert set(contents[False]) <= set(contents[True])
    for key in ("epoch", "random_seed"):
        assert contents[True][key] == contents[False][key]
    assert len(contents[True]["loss"]) == len(contents[False]["loss"]) == 2


@pytest.mark.parametrize("partition", ["token", "encoding"])
def test_the_stoppers_file_after_training_is_the_models_state_dict(
    dataset: Nations, tmp_path: pathlib.Path, partition: str
) -> None:
    """PyKEEN's best_model_path file held the shard tables (key ``...0.weight``, rows in shard order): PyKEEN's
    ``model.load_state_dict(torch.load(path))`` failed, and with the key renamed it gave entities other rows."""
    model = DistMult(triples_factory=dataset.training, embedding_dim=16, random_seed=1)
    loop = BessTrainingLoop(
        model=model, triples_factory=dataset.training, num_shards=2, num_negs_per_pos=4, num_threads=1,
        automatic_memory_optimization=False, partition=partition, optimizer_kwargs=dict(lr=0.05),
    )  # fmt: skip
    path = tmp_path / "best.pt"
    stopper = EarlyStopper(
        model=model, evaluator=RankBasedEvaluator(), training_triples_factory=dataset.training,
        evaluation_triples_factory=dataset.validation, frequency=1, patience=50, best_model_path=path,
        clean_up_checkpoint=False, evaluation_batch_size=256, metric="mrr",
    )  # fmt: skip

    def metric() -> float:
        results = RankBasedEvaluator().evaluate(
            model, dataset.validation.mapped_triples, additional_filter_triples=dataset.training.mapped_triples,
            batch_size=256, use_tqdm=False,
        )  # fmt: skip
        return results.get_metric("mrr")

    train(loop, dataset, num_epochs=4, stopper=stopper)
    state = torch.load(path, weights_only=False)
    assert set(state) == set(model.state_dict())
    last = {key: value.clone() for key, value in model.state_dict().items()}
    model.load_state_dict(state)  # PyKEEN's recipe
    assert metric() == stopper.best_metric
    model.load_state_dict(last)
    # trained on with the same stopper, which stops at once: it loads its file with the tables in the model
    stopper._stopper.remaining_patience = 1
    for group in loop.optimizer.param_groups:
        group["lr"] = 0.0
    train(loop, dataset, num_epochs=5, stopper=stopper, continue_training=True)
    assert stopper.stopped
    assert metric() == stopper.best_metric
    torch.testing.assert_close(model.state_dict(), torch.load(path, weights_only=False), rtol=0, atol=0)


def test_the_model_of_a_checkpoint_by_resuming_it_with_its_epochs(dataset: Nations, tmp_path: pathlib.Path) -> None:
    """The documented way to the model of a checkpoint, whose model_state_dict holds the shard tables."""

    def loop() -> BessTrainingLoop:
        model = DistMult(triples_factory=dataset.training, embedding_dim=8, random_seed=1)
        return BessTrainingLoop(
            model=model, triples_factory=dataset.training, num_shards=2, automatic_memory_optimization=False
        )

    kwargs = dict(num_epochs=3, batch_size=128, checkpoint_name="c.pt", checkpoint_directory=tmp_path, use_tqdm=False)
    trained = loop()
    trained.train(dataset.training, **kwargs)
    with pytest.raises(RuntimeError, match="Missing key"):
        DistMult(triples_factory=dataset.training, embedding_dim=8).load_state_dict(
            torch.load(tmp_path / "c.pt", weights_only=False)["model_state_dict"]
        )
    resumed = loop()
    resumed.train(dataset.training, **kwargs)  # nothing left to train
    plain = DistMult(triples_factory=dataset.training, embedding_dim=8)
    plain.load_state_dict(resumed.model.state_dict())
    torch.testing.assert_close(plain.state_dict(), trained.model.state_dict(), rtol=0, atol=0)


def test_the_stoppers_file_is_in_the_tables_layout_while_training_goes_on(
    dataset: Nations, tmp_path: pathlib.Path
) -> None:
    """Training on wrote a checkpoint before the stopper's first evaluation: the copy of its file beside it was in
    PyKEEN's layout, and resuming the checkpoint on another number of shards failed (KeyError). A file this stopper
    did not write (another run's, at the same path) is not rewritten."""
    path = tmp_path / "best.pt"
    torch.save({"another run's": torch.zeros(3)}, path)

    def make(num_shards: int) -> tuple[BessTrainingLoop, EarlyStopper]:
        model = DistMult(triples_factory=dataset.training, embedding_dim=8, random_seed=1)
        loop = BessTrainingLoop(
            model=model, triples_factory=dataset.training, num_shards=num_shards, num_threads=1,
            automatic_memory_optimization=False,
        )  # fmt: skip
        stopper = EarlyStopper(
            model=model, evaluator=RankBasedEvaluator(), training_triples_factory=dataset.training,
            evaluation_triples_factory=dataset.validation, frequency=2, patience=50, best_model_path=path,
            clean_up_checkpoint=False, evaluation_batch_size=256,
        )  # fmt: skip
        return loop, stopper

    loop, stopper = make(2)
    loop.train(dataset.training, num_epochs=2, batch_size=256, use_tqdm=False, stopper=stopper)
    kwargs = dict(batch_size=256, use_tqdm=False, checkpoint_name="c.pt", checkpoint_directory=tmp_path)
    loop.train(dataset.training, num_epochs=3, stopper=stopper, continue_training=True, **kwargs)
    (copy,) = tmp_path.glob("c.pt.best-weights*")
    assert "entity_representations.0.weight" in torch.load(copy, weights_only=False)  # the tables' layout
    loop, stopper = make(3)
    assert len(loop.train(dataset.training, num_epochs=4, stopper=stopper, **kwargs)) == 4
    assert "entity_representations.0._embeddings.weight" in torch.load(path, weights_only=False)
