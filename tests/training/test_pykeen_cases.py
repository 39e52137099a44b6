"""BessTrainingLoop under the behaviours PyKEEN's generic training-loop cases expect of every loop.

What PyKEEN's sLCWA cases pass and check, written for this loop: ``filterer=None`` as "no
filtering", training and sub-batching with each of PyKEEN's losses, a result tracker receiving the
losses, resuming a checkpoint with a fresh model of another random seed, ``drop_last`` without a
single batch, a non-finite loss from a subclass's ``_process_batch``, and the error type for a
model with batch normalization.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.losses import Loss, loss_resolver
from pykeen.models import ConvE, TransE
from pykeen.trackers.base import PythonResultTracker
from pykeen.training import SLCWATrainingLoop
from pykeen.training.callbacks import EvaluationLossTrainingCallback, TrainingCallback
from pykeen.training.training_loop import NonFiniteLossError, NoTrainingBatchError
from pykeen.triples import CoreTriplesFactory

from pykeen_bess.distributed import Topology
from pykeen_bess.training import BessTrainingLoop, UnsupportedModelError

LOSSES = sorted(loss_resolver, key=lambda cls: cls.__name__)


@pytest.fixture(scope="module")
def factory() -> CoreTriplesFactory:
    return Nations().training


def make_loop(
    factory: CoreTriplesFactory, loss: type[Loss] | None = None, random_seed: int = 0, cls=BessTrainingLoop, **kwargs
) -> BessTrainingLoop:
    """A loop as PyKEEN's cases build it: TransE, Adam, the basic sampler with ``filterer=None``.

    One intra-op thread: the measured thread count (``num_threads="auto"``) may differ between two
    loops, and with it the last bits of some sums, which would break the exact comparisons.
    """
    model = TransE(triples_factory=factory, loss=None if loss is None else loss(), random_seed=random_seed)
    kwargs.setdefault("automatic_memory_optimization", False)
    kwargs.setdefault("num_threads", 1)
    return cls(
        model=model,
        triples_factory=factory,
        optimizer=torch.optim.Adam(model.get_grad_params()),
        negative_sampler="basic",
        negative_sampler_kwargs={"filterer": None},
        **kwargs,
    )


def test_filterer_none_means_no_filtering(factory: CoreTriplesFactory) -> None:
    loop = make_loop(factory)
    assert loop.config.num_negs_per_pos == 64
    model = TransE(triples_factory=factory, random_seed=0)
    loop = BessTrainingLoop(
        model=model, triples_factory=factory, negative_sampler_kwargs=dict(filterer=None, num_negs_per_pos=8)
    )
    assert loop.config.num_negs_per_pos == 8


def test_filterer_refused(factory: CoreTriplesFactory) -> None:
    model = TransE(triples_factory=factory, random_seed=0)
    with pytest.raises(ValueError, match="does not filter false negatives"):
        BessTrainingLoop(model=model, triples_factory=factory, negative_sampler_kwargs=dict(filterer="bloom"))


@pytest.mark.parametrize("loss", LOSSES, ids=lambda cls: cls.__name__)
def test_train_sub_batches_and_tracker(factory: CoreTriplesFactory, loss: type[Loss]) -> None:
    """Training, sub-batching (sub-batches add up to the step) and the result tracker, for every loss."""
    kwargs = dict(triples_factory=factory, num_epochs=1, batch_size=512, use_tqdm=False)
    whole = make_loop(factory, loss).train(**kwargs)
    loop = make_loop(factory, loss)
    loop.result_tracker = tracker = PythonResultTracker()
    split = loop.train(sub_batch_size=100, **kwargs)
    assert whole is not None and split is not None
    assert split == pytest.approx(whole, rel=1e-4, abs=1e-6)
    assert tracker.metrics  # the epoch loss reached the tracker
    assert tracker.metrics[1]["loss"] == pytest.approx(split[0])


def test_tracker_records_the_sizes_that_train(factory: CoreTriplesFactory) -> None:
    """A batch size and negatives that do not fit the shard count are rounded; the tracker gets what trained."""
    loop = make_loop(factory, num_shards=3)
    loop.result_tracker = tracker = PythonResultTracker()
    loop.train(triples_factory=factory, num_epochs=1, batch_size=100, num_negs_per_pos=10, use_tqdm=False)
    assert tracker.configuration["bess"] == dict(batch_size=108, num_negs_per_pos=12, num_shards=3)


@pytest.mark.parametrize("loss", LOSSES, ids=lambda cls: cls.__name__)
def test_resume_with_fresh_model_of_another_seed(
    factory: CoreTriplesFactory, loss: type[Loss], tmp_path: pathlib.Path
) -> None:
    """PyKEEN restores everything from a checkpoint: the new model's random seed does not matter."""
    kwargs = dict(triples_factory=factory, batch_size=512, use_tqdm=False)
    uninterrupted = make_loop(factory, loss, random_seed=0).train(num_epochs=4, **kwargs)
    checkpoint = dict(checkpoint_name="checkpoint.pt", checkpoint_directory=tmp_path, checkpoint_frequency=0)
    make_loop(factory, loss, random_seed=0).train(num_epochs=2, **checkpoint, **kwargs)
    resumed = make_loop(factory, loss, random_seed=123).train(num_epochs=4, **checkpoint, **kwargs)
    assert resumed == uninterrupted


def test_explicit_seed_is_kept_on_resume(factory: CoreTriplesFactory, tmp_path: pathlib.Path) -> None:
    """An explicit seed other than the checkpoint's is not replaced: the checkpoint does not match."""
    checkpoint = dict(checkpoint_name="checkpoint.pt", checkpoint_directory=tmp_path, checkpoint_frequency=0)
    kwargs = dict(triples_factory=factory, batch_size=512, use_tqdm=False)
    make_loop(factory, seed=1).train(num_epochs=1, **checkpoint, **kwargs)
    with pytest.raises(RuntimeError, match="seed"):
        make_loop(factory, seed=2).train(num_epochs=2, **checkpoint, **kwargs)


def test_no_training_batch(factory: CoreTriplesFactory) -> None:
    loop = make_loop(factory)
    with pytest.raises(NoTrainingBatchError):
        loop.train(triples_factory=factory, num_epochs=1, drop_last=True, batch_size=100_000, use_tqdm=False)
    # a batch no larger than the triples: BESS pads, drop_last drops nothing
    losses = loop.train(
        triples_factory=factory, num_epochs=1, drop_last=True, batch_size=factory.num_triples, use_tqdm=False
    )
    assert losses is not None and len(losses) == 1


class CountingLoop(BessTrainingLoop):
    """Records the calls of the hook and returns a NaN loss from the ``patience``-th call on."""

    patience: int | None = None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[tuple[int, int]] = []
        self.returned: list[float] = []

    def _process_batch(self, *args, **kwargs):
        loss = super()._process_batch(*args, **kwargs)
        self.calls.append((kwargs["start"], kwargs["stop"]))
        if self.patience is not None and len(self.calls) > self.patience:
            return torch.as_tensor([float("nan")], device=loss.device, dtype=torch.float32)
        self.returned.append(float(loss.detach()))
        return loss


def test_process_batch_hook_is_called(factory: CoreTriplesFactory) -> None:
    """The hook computes every sub-batch's loss; the step losses are the sums of what it returned."""
    kwargs = dict(triples_factory=factory, num_epochs=2, batch_size=512, use_tqdm=False)
    plain = make_loop(factory).train(**kwargs)
    loop = make_loop(factory, cls=CountingLoop, static_step=None)
    hooked = loop.train(sub_batch_size=200, **kwargs)
    steps = 2 * len(loop.epoch_batches(factory, batch_size=512))
    assert len(loop.calls) == 3 * steps  # 512 slots in sub-batches of 200
    assert loop.calls[:3] == [(0, 200), (200, 400), (400, 512)]
    assert hooked == pytest.approx(plain, rel=1e-5)
    assert sum(loop.returned) / (steps // 2) == pytest.approx(sum(hooked), rel=1e-5)


def test_non_finite_loss_from_hook(factory: CoreTriplesFactory) -> None:
    """PyKEEN's case: a subclass's ``_process_batch`` returning NaN raises NonFiniteLossError."""

    class NaNLoop(CountingLoop):
        patience = 2

    model = TransE(triples_factory=factory)
    loop = NaNLoop(model=model, triples_factory=factory, optimizer=torch.optim.Adam(model.get_grad_params()))
    with pytest.raises(NonFiniteLossError):
        loop.train(triples_factory=factory, num_epochs=3, batch_size=128, use_tqdm=False)
    assert loop._epoch == 0 and len(loop.calls) == 3


def test_uncalled_hooks_refused(factory: CoreTriplesFactory) -> None:
    class EpochLoop(BessTrainingLoop):
        def _train_epoch(self, *args, **kwargs):
            raise AssertionError

    with pytest.raises(NotImplementedError, match="_train_epoch"):
        make_loop(factory, cls=EpochLoop)


class RandomState(TrainingCallback):
    """Keep torch's random state at the end of every epoch (before the evaluation-loss callback draws)."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[torch.Tensor] = []

    def post_epoch(self, epoch: int, epoch_loss: float, **kwargs) -> None:
        self.states.append(torch.get_rng_state())


@pytest.mark.parametrize("storage", ["device", "host"])
def test_evaluation_loss_callback(factory: CoreTriplesFactory, storage: str) -> None:
    """PyKEEN's evaluation-loss callback: one finite loss per epoch, PyKEEN's value, and training unchanged."""
    validation = Nations().validation
    kwargs = dict(triples_factory=factory, num_epochs=2, batch_size=256, use_tqdm=False)
    plain = make_loop(factory, storage=storage, num_shards=2).train(**kwargs)
    tracker, state = PythonResultTracker(), RandomState()
    loop = make_loop(factory, storage=storage, num_shards=2, result_tracker=tracker)
    evaluation = dict(triples_factory=validation, prefix="validation", maximum_batch_size=64)
    losses = loop.train(**kwargs, callbacks=[state, "evaluation-loss"], callbacks_kwargs=[None, evaluation])
    assert losses == pytest.approx(plain, rel=1e-6)  # no update, no table write, no change of BESS's draws
    recorded = [tracker.metrics[epoch]["validation.loss"] for epoch in (1, 2)]
    assert all(0 < loss < float("inf") for loss in recorded)
    # PyKEEN's own callback and sLCWA loop on the trained model, with the same random state
    reference_tracker = PythonResultTracker()
    reference = SLCWATrainingLoop(
        model=loop.model,
        triples_factory=factory,
        negative_sampler_kwargs=dict(num_negs_per_pos=loop.config.num_negs_per_pos),
        result_tracker=reference_tracker,
    )
    callback = EvaluationLossTrainingCallback(**evaluation)
    callback.register_training_loop(reference)
    torch.set_rng_state(state.states[-1])
    callback.post_epoch(epoch=2, epoch_loss=0.0)
    assert reference_tracker.metrics[2]["validation.loss"] == pytest.approx(recorded[-1], rel=1e-6)


def test_evaluation_loss_refused_under_process_group(factory: CoreTriplesFactory, monkeypatch) -> None:
    """Under a process group no process holds the whole model: refused before training starts."""
    loop = make_loop(factory)
    monkeypatch.setattr(Topology, "is_distributed", property(lambda self: True))
    with pytest.raises(NotImplementedError, match="evaluation-loss callback"):
        loop.train(
            triples_factory=factory,
            num_epochs=1,
            batch_size=256,
            callbacks="evaluation-loss",
            callbacks_kwargs=dict(triples_factory=factory),
        )
    assert loop._epoch == 0


def test_batch_norm_model_error_type(factory: CoreTriplesFactory) -> None:
    """ConvE: PyKEEN's loops raise NotImplementedError for its sub-batches; BESS refuses it when created."""
    model = ConvE(triples_factory=factory, random_seed=0)
    for error in (NotImplementedError, ValueError, UnsupportedModelError):
        with pytest.raises(error, match="batch normalization"):
            BessTrainingLoop(model=model, triples_factory=factory)


@pytest.mark.parametrize(
    ("model_kwargs", "match"),
    [
        (dict(regularizer="normlimit", regularizer_kwargs=dict(max_norm=0.1)), r"NormLimitRegularizer\(dim=-1\)"),
        (dict(regularizer="lp", regularizer_kwargs=dict(dim=0)), r"LpRegularizer\(dim=0\)"),
        (dict(regularizer="lp", regularizer_kwargs=dict(apply_only_once=True)), "apply_only_once=True"),
    ],
)
def test_regularizers_bess_cannot_weigh_are_refused(factory: CoreTriplesFactory, model_kwargs, match) -> None:
    """BESS weighs a step's rows as PyKEEN's per-row-mean regularizers; others would be weighted otherwise, silently.

    (A NormLimitRegularizer sums over rows, an LpRegularizer over dim=0 averages columns, apply_only_once counts
    only the first lookup of a batch.)
    """
    from pykeen.models import DistMult

    model = DistMult(triples_factory=factory, random_seed=0, **model_kwargs)
    with pytest.raises(UnsupportedModelError, match=match):
        BessTrainingLoop(model=model, triples_factory=factory)


def test_relation_regularizers_applied_once_are_refused(factory: CoreTriplesFactory) -> None:
    """apply_only_once on a relation table: refused as on entity tables (it was accepted and ignored)."""
    from pykeen.models import ERModel

    model = ERModel(
        triples_factory=factory,
        interaction="DistMult",
        entity_representations_kwargs=dict(shape=8),
        relation_representations_kwargs=dict(
            shape=8, regularizer="lp", regularizer_kwargs=dict(apply_only_once=True, weight=1.0)
        ),
        random_seed=0,
    )
    with pytest.raises(UnsupportedModelError, match="apply_only_once=True"):
        BessTrainingLoop(model=model, triples_factory=factory)


@pytest.mark.parametrize("static_step", [True, False])
def test_pykeens_clipping_callbacks_are_refused(factory: CoreTriplesFactory, static_step: bool) -> None:
    """PyKEEN's clipping callbacks edit gradients before optimizer.step(), which BESS's steps never call.

    The static step ignored them silently (its update had consumed the gradients); the eager step's sparse row
    gradients crashed them. The training kwargs clip every step's gradients instead.
    """
    from pykeen.training.callbacks import GradientAbsClippingTrainingCallback, GradientNormClippingTrainingCallback

    for callback, option in (
        (GradientNormClippingTrainingCallback(max_norm=1e-6), "gradient_clipping_max_norm"),
        (GradientAbsClippingTrainingCallback(clip_value=1e-6), "gradient_clipping_max_abs_value"),
    ):
        loop = make_loop(factory, static_step=static_step)
        with pytest.raises(ValueError, match=option):
            loop.train(factory, num_epochs=1, batch_size=256, use_tqdm=False, callbacks=callback)


def test_a_pre_step_hook_under_the_static_step_is_warned_about(factory: CoreTriplesFactory) -> None:
    """A callback's pre_step runs after the static step's update: changing gradients there has no effect."""

    class Hook(TrainingCallback):
        def pre_step(self, **kwargs) -> None:
            pass

    loop = make_loop(factory, static_step=True)
    with pytest.warns(UserWarning, match="Hook.pre_step runs after BESS's update"):
        loop.train(factory, num_epochs=1, batch_size=256, use_tqdm=False, callbacks=Hook())
