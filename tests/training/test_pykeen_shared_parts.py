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
