"""Distributed checkpoint files: what PyKEEN reads from the pointer before the loop loads it."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
from pykeen.models import DistMult
from pykeen.stoppers import EarlyStopper

from pykeen_bess.distributed import LocalTopology
from pykeen_bess.training.checkpoints.files import read_pointer, save_distributed_checkpoint


def test_the_pointer_holds_what_pipeline_and_stoppers_read(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "run.pt"
    stopper_dict = dict(best_epoch=3, best_metric=0.5, remaining_patience=2)

    def write(file: pathlib.Path) -> None:
        torch.save({"epoch": 4}, file)

    save_distributed_checkpoint(
        path, LocalTopology(1), write, epoch=4, seed=5, random_seed=123, stopper_dict=stopper_dict
    )
    # pipeline()'s _handle_random_seed and EarlyStopper read these two keys of the file named checkpoint_name
    assert torch.load(path, weights_only=False)["random_seed"] == 123
    assert EarlyStopper.load_summary_dict_from_training_loop_checkpoint(path) == stopper_dict
    assert read_pointer(path)["version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pt", "run.pt.v1.rank0-of-1"]


def test_a_new_version_removes_older_versions_of_every_layout(tmp_path: pathlib.Path) -> None:
    """After resharding (two shards, then one), the two-shard files and their table copies do not stay behind."""
    path = tmp_path / "run.pt"

    def write(file: pathlib.Path) -> None:
        torch.save({"epoch": 1}, file)

    for name in ["run.pt.v1.rank0-of-2", "run.pt.v1.rank1-of-2", "run.pt.v1.rank1-of-2.replica1-of-2"]:
        torch.save({}, tmp_path / name)
    for name in ["run.pt.v1.rank0-of-2.tables-12", "run.pt.v1.rank1-of-2.tmp-13.tables"]:  # now; before the rename
        (tmp_path / name).mkdir()
        (tmp_path / name / "table0.npy").write_bytes(b"")
    (tmp_path / "other.pt.v1.rank0-of-2").write_bytes(b"")  # another checkpoint in the same directory
    save_distributed_checkpoint(path, LocalTopology(1), write, epoch=1, seed=0, version=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.pt.v1.rank0-of-2", "run.pt", "run.pt.v2.rank0-of-1"]


def test_a_single_process_checks_a_distributed_checkpoint_through_pipeline(tmp_path: pathlib.Path) -> None:
    """pipeline() reads the pointer's random seed, then the loop checks its sharding before reading any row."""
    import pytest
    from pykeen.pipeline import pipeline

    save_distributed_checkpoint(
        tmp_path / "run.pt",
        LocalTopology(1),
        lambda file: torch.save({"epoch": 1}, file),
        epoch=1,
        seed=0,
        random_seed=7,
    )
    with pytest.raises(ValueError, match="was written with another sharding"):
        pipeline(
            dataset="nations",
            model="DistMult",
            training_loop="bess",
            training_kwargs=dict(
                num_epochs=1, checkpoint_directory=str(tmp_path), checkpoint_name="run.pt", use_tqdm=False
            ),
        )


@pytest.mark.parametrize("new_shards", [1, 3, 4])
def test_resharding_moves_every_row_wise_state(tmp_path: pathlib.Path, new_shards: int) -> None:
    """Tables and per-row optimizer state (Adam's ``[S, D]`` moments, row-wise Adagrad's ``[S]``) move with entities."""
    from pykeen_bess.data.sharding import EntitySharding
    from pykeen_bess.training.checkpoints.files import shard_file
    from pykeen_bess.training.checkpoints.resharding import ShardFiles, reshard_rank_state

    num_entities, seed, path = 10, 3, tmp_path / "ck.pt"
    old = EntitySharding.create(num_entities, 2, seed=seed)
    for shard in range(2):
        ids = old.shard_entities[shard].to(torch.float64)  # each row holds its global id (-1: padding)
        state = dict(
            model_state_dict=dict(entity=ids.view(-1, 1).repeat(1, 2), relation=torch.ones(3, 2)),
            optimizer_state_dict=dict(
                state={0: dict(step=torch.tensor(7.0), sum=10 * ids, exp_avg=ids.view(-1, 1).repeat(1, 2))},
                param_groups=[],
            ),
        )
        torch.save(state, shard_file(path, 1, shard, 2))
    pointer = dict(version=1, world_size=2, replicas=1, retrieval="one_per_group", seed=seed)
    new = EntitySharding.create(num_entities, new_shards, seed=seed)
    for shard in range(new_shards):
        files = ShardFiles.of_pointer(path, pointer)
        state = reshard_rank_state(files, new, [shard], table_keys=["entity"], table_param_indices=[0])
        ids = new.shard_entities[shard]
        real = ids >= 0
        expected = ids[real].to(torch.float64)
        torch.testing.assert_close(state["model_state_dict"]["entity"][real], expected.view(-1, 1).repeat(1, 2))
        optimizer_state = state["optimizer_state_dict"]["state"][0]
        torch.testing.assert_close(optimizer_state["sum"][real], 10 * expected)
        torch.testing.assert_close(optimizer_state["exp_avg"][real], expected.view(-1, 1).repeat(1, 2))
        assert optimizer_state["sum"].shape == (new.shard_size,)
        assert float(optimizer_state["step"]) == 7.0
        torch.testing.assert_close(state["model_state_dict"]["relation"], torch.ones(3, 2))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(embedding_dim=16), "embedding dimension: the checkpoint's shape is [14, 8], this run's [14, 16]"),
        (dict(model=DistMult), "only in this run ['relation_representations.0.regularizer"),
        (dict(lr=0.01), "the optimizer's settings: lr: checkpoint 0.001, this run 0.01."),
        (dict(seed=5), "(balanced shardpairs; resume with training_loop_kwargs=dict(seed=0))"),
        (
            dict(num_shards=4, seed=5),
            "(balanced shardpairs; resume with training_loop_kwargs=dict(num_shards=2, seed=0))",
        ),
    ],
    ids=["dimension", "model", "optimizer", "seed", "shards and seed"],
)
def test_a_mismatching_checkpoint_says_what_differs(tmp_path: pathlib.Path, change: dict, expected: str) -> None:
    """A checkpoint of another configuration: the error says what differs and what the checkpoint holds."""
    from pykeen.datasets import Nations
    from pykeen.models import TransE
    from pykeen.training.training_loop import CheckpointMismatchError

    from pykeen_bess.training import BessTrainingLoop

    factory = Nations().training

    def train(num_epochs: int, embedding_dim: int = 8, model=TransE, lr: float = 0.001, **kwargs) -> None:
        kwargs.setdefault("num_shards", 2)
        instance = model(triples_factory=factory, embedding_dim=embedding_dim, random_seed=0)
        optimizer = torch.optim.Adam(instance.get_grad_params(), lr=lr)
        loop = BessTrainingLoop(model=instance, triples_factory=factory, optimizer=optimizer, num_threads=1, **kwargs)
        loop.train(
            factory, num_epochs=num_epochs, batch_size=256, use_tqdm=False, checkpoint_name="run.pt",
            checkpoint_directory=tmp_path, checkpoint_frequency=0,
        )  # fmt: skip

    train(1)
    with pytest.raises(CheckpointMismatchError) as error:
        train(2, **change)
    assert expected in str(error.value)
    assert "What differs: " in str(error.value)


def test_a_mismatching_checkpoint_with_padded_shards_says_what_differs(tmp_path: pathlib.Path) -> None:
    """UMLS (135 entities) in 2 shards has 136 rows: the error said num_shards must be at most 135, not what differs.

    Looking for the number of logical shards that wrote the one-process file tried 136 shards of 135 entities.
    """
    from pykeen.datasets import UMLS
    from pykeen.models import DistMult
    from pykeen.training.training_loop import CheckpointMismatchError

    from pykeen_bess.training import BessTrainingLoop

    factory = UMLS().training

    def train(num_epochs: int, lr: float) -> None:
        model = DistMult(triples_factory=factory, embedding_dim=4, random_seed=0)
        optimizer = torch.optim.Adam(model.get_grad_params(), lr=lr)
        loop = BessTrainingLoop(model=model, triples_factory=factory, optimizer=optimizer, num_shards=2, num_threads=1)
        loop.train(
            factory, num_epochs=num_epochs, batch_size=2048, use_tqdm=False, checkpoint_name="run.pt",
            checkpoint_directory=tmp_path, checkpoint_frequency=0,
        )  # fmt: skip

    train(1, lr=0.01)
    with pytest.raises(CheckpointMismatchError, match="lr: checkpoint 0.01, this run 0.005"):
        train(2, lr=0.005)


@pytest.mark.filterwarnings("error:Detected call of `lr_scheduler.step()` before `optimizer.step()`")
def test_a_checkpoint_written_after_a_scheduler_changed_the_rate_resumes(tmp_path: pathlib.Path) -> None:
    """PyKEEN's checksum saw the scheduled learning rate (its own loops refuse such a checkpoint): resumed exactly.

    torch's warning that the scheduler stepped before the optimizer (BESS's steps do not call ``optimizer.step()``)
    is an error here: the loop marks the optimizer as stepped.
    """
    from pykeen.datasets import Nations
    from pykeen.models import DistMult

    from pykeen_bess.training import BessTrainingLoop

    factory = Nations().training

    def train(num_epochs: int, directory: pathlib.Path) -> tuple[list[float], torch.Tensor, float]:
        model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)
        loop = BessTrainingLoop(
            model=model, triples_factory=factory, num_shards=2, num_threads=1, optimizer="adam",
            optimizer_kwargs=dict(lr=0.01), lr_scheduler="StepLR", lr_scheduler_kwargs=dict(step_size=1, gamma=0.5),
        )  # fmt: skip
        losses = loop.train(
            factory, num_epochs=num_epochs, batch_size=256, use_tqdm=False, checkpoint_name="run.pt",
            checkpoint_directory=directory, checkpoint_frequency=0,
        )  # fmt: skip
        return losses, model.entity_representations[0](indices=None).detach(), loop.optimizer.param_groups[0]["lr"]

    train(2, tmp_path / "split")
    resumed = train(4, tmp_path / "split")
    whole = train(4, tmp_path / "whole")
    assert resumed[0] == whole[0] and resumed[2] == whole[2] == 0.01 / 16
    assert torch.equal(resumed[1], whole[1])


def test_a_checkpoint_resumes_only_with_its_learning_rate_scheduler(tmp_path: pathlib.Path) -> None:
    """A checkpoint resumed with another scheduler (or other settings) loaded its state into it silently (StepLR
    gamma 0.5 went on with a user's 0.9 ignored); one written without a scheduler failed with a bare TypeError."""
    from pykeen.datasets import Nations
    from pykeen.training.training_loop import CheckpointMismatchError

    from pykeen_bess.training import BessTrainingLoop
    from pykeen_bess.training.checkpoints import checkpointed

    factory = Nations().training

    def train(num_epochs: int, scheduler: str | None, **kwargs) -> list[float]:
        model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)
        loop = BessTrainingLoop(
            model=model, triples_factory=factory, num_shards=2, num_threads=1, optimizer="adam",
            optimizer_kwargs=dict(lr=0.01), lr_scheduler=scheduler, lr_scheduler_kwargs=kwargs or None,
        )  # fmt: skip
        return loop.train(
            factory, num_epochs=num_epochs, batch_size=256, use_tqdm=False, checkpoint_name="run.pt",
            checkpoint_directory=tmp_path, checkpoint_frequency=0,
        )  # fmt: skip

    train(1, "StepLR", step_size=1, gamma=0.5)
    for scheduler, kwargs, message in (
        ("StepLR", dict(step_size=1, gamma=0.9), "this run has StepLR.gamma=0.9, step_size=1.*'gamma': 0.5"),
        ("ExponentialLR", dict(gamma=0.5), "this run has ExponentialLR.gamma=0.5.*another class"),
        (None, {}, "the checkpoint was written with one, this run has none"),
    ):
        with pytest.raises(CheckpointMismatchError, match=f"learning-rate scheduler: {message}"):
            train(2, scheduler, **kwargs)
    (tmp_path / "run.pt").unlink()
    train(1, None)
    with pytest.raises(
        CheckpointMismatchError, match="learning-rate scheduler: the checkpoint has none, this run StepLR"
    ):
        train(2, "StepLR", step_size=1, gamma=0.5)
    # a checkpoint written before the checksum covered the scheduler resumes with the same settings
    (tmp_path / "run.pt").unlink()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpointed, "scheduler_text", lambda scheduler: "")
        from pykeen_bess.training import hooks

        patch.setattr(hooks, "scheduler_text", lambda scheduler: "")
        first = train(1, "StepLR", step_size=1, gamma=0.5)
    assert len(first + train(2, "StepLR", step_size=1, gamma=0.5)[1:]) == 2


def test_a_checkpoint_with_a_scheduler_resumes_on_another_number_of_shards(tmp_path: pathlib.Path) -> None:
    """The search for the writer's shard count checksummed without the scheduler: resharding failed."""
    from pykeen.datasets import Nations

    from pykeen_bess.training import BessTrainingLoop

    factory = Nations().training

    def run(num_shards: int, num_epochs: int) -> list[float]:
        model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)
        loop = BessTrainingLoop(
            model=model, triples_factory=factory, num_shards=num_shards, num_threads=1, optimizer="adam",
            optimizer_kwargs=dict(lr=0.01), lr_scheduler="StepLR", lr_scheduler_kwargs=dict(step_size=1, gamma=0.5),
        )  # fmt: skip
        return loop.train(
            factory, num_epochs=num_epochs, batch_size=256, use_tqdm=False, checkpoint_name="run.pt",
            checkpoint_directory=tmp_path, checkpoint_frequency=0,
        )  # fmt: skip

    first = run(2, 1)
    assert run(3, 2)[:1] == first


def test_a_checkpoint_of_another_loss_names_the_loss(tmp_path: pathlib.Path) -> None:
    """The loss is in the checksum but not in the checkpoint: the error names it among what may differ."""
    from pykeen.datasets import Nations
    from pykeen.models import TransE
    from pykeen.training.training_loop import CheckpointMismatchError

    from pykeen_bess.training import BessTrainingLoop

    factory = Nations().training

    def train(num_epochs: int, loss: str) -> None:
        model = TransE(triples_factory=factory, embedding_dim=8, random_seed=0, loss=loss)
        loop = BessTrainingLoop(model=model, triples_factory=factory, num_shards=2, num_threads=1)
        loop.train(
            factory, num_epochs=num_epochs, batch_size=256, use_tqdm=False, checkpoint_name="run.pt",
            checkpoint_directory=tmp_path, checkpoint_frequency=0,
        )  # fmt: skip

    train(1, "marginranking")
    with pytest.raises(CheckpointMismatchError, match="the loss and its settings") as error:
        train(2, "softplus")
    assert "a checkpoint file records only a checksum of it" in str(error.value)


@pytest.mark.parametrize("storage", ["device", "host"])
def test_a_one_process_checkpoint_reshards_into_another_number_of_logical_shards(
    tmp_path: pathlib.Path, storage: str
) -> None:
    """Two logical shards' checkpoint resumes with four: every entity's row and Adam moments move with it."""
    from pykeen.datasets import Nations
    from pykeen.models import TransE

    from pykeen_bess.training import BessTrainingLoop

    factory = Nations().training

    def train(num_shards: int, num_epochs: int) -> BessTrainingLoop:
        model = TransE(triples_factory=factory, embedding_dim=8, random_seed=num_shards)
        loop = BessTrainingLoop(
            model=model, triples_factory=factory, num_shards=num_shards, num_negs_per_pos=8, optimizer="adam",
            storage=storage, num_threads=1,
        )  # fmt: skip
        loop.train(
            factory, num_epochs=num_epochs, batch_size=256, use_tqdm=False, checkpoint_name="run.pt",
            checkpoint_directory=tmp_path, checkpoint_frequency=0,
        )  # fmt: skip
        return loop

    def rows(loop: BessTrainingLoop) -> tuple[torch.Tensor, torch.Tensor]:
        """Every entity's row and Adam's second moment, in global entity order."""
        table = loop.tables[0]
        state = dict(loop.optimizer.state.get(table.optimizer_parameter, {}), **table.row_state)
        ids = torch.cat([loop.sharding.shard_entities[shard] for shard in table.local_shards])
        order = torch.argsort(ids)[(ids < 0).sum() :]
        return table.weight.detach()[order].clone(), state["exp_avg_sq"].detach()[order].clone()

    written = train(2, 2)
    expected_rows, expected_moments = rows(written)
    resumed = train(4, 2)  # both epochs done: nothing trains, the model holds the checkpoint's rows
    assert resumed.sharding.n_shard == 4 and resumed._epoch == 2
    assert resumed.losses_per_epochs == written.losses_per_epochs
    actual_rows, actual_moments = rows(resumed)
    torch.testing.assert_close(actual_rows, expected_rows, rtol=0, atol=0)
    torch.testing.assert_close(actual_moments, expected_moments, rtol=0, atol=0)


def test_every_rank_keeps_its_own_best_weights_file(tmp_path: pathlib.Path) -> None:
    """Under a process group each rank saves its own shards' best weights: one given path becomes one per rank."""
    import dataclasses

    from pykeen_bess.training.training_run import own_best_model_path

    @dataclasses.dataclass
    class Ranks:
        rank: int
        world_size: int = 2
        is_distributed: bool = True

    @dataclasses.dataclass
    class Stopper:
        best_model_path: pathlib.Path | None

    paths = []
    for rank in range(2):
        stopper = Stopper(tmp_path / "best.pt")
        own_best_model_path(stopper, Ranks(rank))  # type: ignore[arg-type]
        own_best_model_path(stopper, Ranks(rank))  # type: ignore[arg-type]  # (once)
        paths.append(stopper.best_model_path)
    assert paths == [tmp_path / "best.rank0-of-2.pt", tmp_path / "best.rank1-of-2.pt"]
    one = Stopper(tmp_path / "best.pt")
    own_best_model_path(one, Ranks(0, world_size=1, is_distributed=False))  # type: ignore[arg-type]
    assert one.best_model_path == tmp_path / "best.pt"


def _ended_process() -> int:
    """Return the id of a process that ran on this machine and has ended."""
    import subprocess
    import sys

    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(process.stdout)


def _plant_temporaries(directory: pathlib.Path, names: list[str]) -> None:
    for name in names:
        (directory / name).write_bytes(b"PK\x03\x04 half a checkpoint")


def test_a_new_version_removes_the_temporary_files_of_writers_killed_midway(tmp_path: pathlib.Path) -> None:
    """A process killed while writing leaves ``NAME.tmp-HOST-PID-NS``; the next write removes it if PID has ended.

    Files of running processes, of other machines (a shared directory), of other checkpoints and names this
    module does not write stay.
    """
    import os

    from pykeen_bess.training.checkpoints.files import _host

    import time

    host, dead, alive, now = _host(), _ended_process(), os.getppid(), time.time_ns()
    abandoned = [
        f"run.pt.tmp-{host}-{dead}-1",
        f"run.pt.v3.rank0-of-2.tmp-{host}-{dead}-2",
        f"run.pt.tmp-{host}-{os.getpid()}-6",  # this process's id, taken after a killed writer named the file
    ]
    kept = [
        f"run.pt.tmp-{host}-{alive}-{now}",  # being written by a running process
        f"run.pt.tmp-another{host}-{dead}-4",  # written on another machine
        f"other.pt.tmp-{host}-{dead}-5",  # another checkpoint's
        "run.pt.tmp-123",  # not a name of this module's
    ]
    _plant_temporaries(tmp_path, abandoned + kept)
    (tmp_path / f"run.pt.v3.rank0-of-2.tables-{host}-{dead}-2").mkdir()  # the abandoned file's table copies
    save_distributed_checkpoint(tmp_path / "run.pt", LocalTopology(1), lambda f: torch.save({}, f), epoch=1, seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run.pt", "run.pt.v1.rank0-of-1", *kept])


def test_a_checkpoint_file_write_removes_abandoned_temporary_files(tmp_path: pathlib.Path) -> None:
    """The single checkpoint file of one process: its next write removes what a killed writer left."""
    from pykeen.pipeline import pipeline

    from pykeen_bess.training.checkpoints.files import _host

    abandoned = f"run.pt.tmp-{_host()}-{_ended_process()}-1"
    _plant_temporaries(tmp_path, [abandoned])
    pipeline(
        dataset="nations",
        model="DistMult",
        model_kwargs=dict(embedding_dim=8),
        training_loop="bess",
        training_kwargs=dict(
            num_epochs=1, batch_size=256, checkpoint_name="run.pt", checkpoint_directory=tmp_path, use_tqdm=False
        ),
        evaluator_kwargs=dict(batch_size=256),
        evaluation_kwargs=dict(use_tqdm=False),
        random_seed=0,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pt"]


class _Interrupted(Exception):
    """The kill of a run, raised by a callback after an epoch (before that epoch's checkpoint)."""


def _early_stopped_run(
    tmp_path: pathlib.Path, best_weights: str, die_at: int | None = None, num_shards: int = 2, num_epochs: int = 20
):
    """Nations, DistMult: the stopper's best epoch is 2, it stops at epoch 6 (patience 2, every 2 epochs)."""
    from pykeen.pipeline import pipeline
    from pykeen.training.callbacks import TrainingCallback

    from pykeen_bess import BessTrainingLoop

    class Die(TrainingCallback):
        def post_epoch(self, epoch: int, epoch_loss: float, **kwargs) -> None:
            if epoch == die_at:
                raise _Interrupted(epoch)

    return pipeline(
        dataset="nations",
        model="DistMult",
        model_kwargs=dict(embedding_dim=8),
        random_seed=0,
        training_loop=BessTrainingLoop,
        training_loop_kwargs=dict(num_shards=num_shards),
        training_kwargs=dict(
            num_epochs=num_epochs,
            batch_size=256,
            checkpoint_name="run.pt",
            checkpoint_directory=str(tmp_path / "checkpoints"),
            checkpoint_frequency=0,
            callbacks=Die(),
            use_tqdm=False,
        ),
        stopper="early",
        stopper_kwargs=dict(frequency=2, patience=2, relative_delta=0.5, best_model_path=tmp_path / best_weights),
        evaluation_kwargs=dict(use_tqdm=False),
    )


def test_an_early_stopped_run_resumed_after_its_best_epoch_restores_the_best_weights(tmp_path: pathlib.Path) -> None:
    """A run killed after its best epoch resumes, stops and loads the best epoch's weights, as an uninterrupted run.

    The stopper of the resumed run has a file of its own (PyKEEN's default: a new name per run); before, it
    found no file when it stopped (``FileNotFoundError`` after all the training).
    """
    uninterrupted = _early_stopped_run(tmp_path / "uninterrupted", "best.pt")
    assert uninterrupted.stopper.stopped and uninterrupted.stopper.best_epoch == 2
    with pytest.raises(_Interrupted):  # after epoch 3: the checkpoint of epoch 2 holds best epoch 2
        _early_stopped_run(tmp_path / "killed", "best-of-the-killed-run.pt", die_at=3)
    checkpoints = tmp_path / "killed" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["run.pt", "run.pt.best-weights-epoch2.2-shards.pt"]
    resumed = _early_stopped_run(tmp_path / "killed", "best-of-the-resumed-run.pt")
    assert resumed.stopper.stopped and resumed.stopper.best_epoch == 2
    assert resumed.stopper.results == uninterrupted.stopper.results
    assert resumed.metric_results.to_flat_dict() == uninterrupted.metric_results.to_flat_dict()
    for (name, actual), expected in zip(resumed.model.state_dict().items(), uninterrupted.model.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)
    # the stopped run's last checkpoint holds the best weights: the copy is gone (a stopped run trains no further)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["run.pt"]


def test_a_new_run_never_takes_an_earlier_runs_best_weights_under_the_same_checkpoint_name(
    tmp_path: pathlib.Path,
) -> None:
    """A copy of the same best epoch left by an earlier run (its checkpoint deleted) was taken for the new run's.

    The new run, killed after its best epoch and resumed, then stopped with the earlier run's weights (no error;
    its losses equal, its model not).
    """
    uninterrupted = _early_stopped_run(tmp_path / "uninterrupted", "best.pt")
    checkpoints = tmp_path / "killed" / "checkpoints"
    checkpoints.mkdir(parents=True)
    earlier = {key: torch.zeros_like(value) for key, value in uninterrupted.model.state_dict().items()}
    torch.save(earlier, checkpoints / "run.pt.best-weights-epoch2.2-shards.pt")  # an earlier run's, same epoch
    with pytest.raises(_Interrupted):  # after epoch 3: the checkpoint of epoch 2 holds best epoch 2
        _early_stopped_run(tmp_path / "killed", "best-of-the-killed-run.pt", die_at=3)
    resumed = _early_stopped_run(tmp_path / "killed", "best-of-the-resumed-run.pt")
    assert resumed.stopper.stopped and resumed.stopper.best_epoch == 2
    for (name, actual), expected in zip(resumed.model.state_dict().items(), uninterrupted.model.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("num_shards", [1, 4])
@pytest.mark.parametrize(
    ("legacy_name", "same_path"),
    [(False, False), (True, False), (False, True)],
    ids=["copy", "earlier-versions-copy", "the-killed-runs-stopper-path"],
)
def test_a_run_resumed_on_other_shards_restores_the_best_weights_resharded(
    tmp_path: pathlib.Path, num_shards: int, legacy_name: bool, same_path: bool
) -> None:
    """A checkpoint of 2 logical shards resumed with 1 or 4: the stopper restores the best epoch's rows, resharded.

    Nations has 14 entities, so one and two shards' tables both have 14 rows: the copy of two shards' rows
    loaded as one shard's gave entities each other's rows, silently (the model of the resumed run then
    differed from the best epoch's by up to 1.09). A stopper path the user gives again holds the killed
    run's file, of the other layout: it is replaced (it was loaded as it was: a failure after the training).
    """
    best = _early_stopped_run(tmp_path / "best", "best.pt", num_epochs=2)  # the best epoch's model
    expected = best.model.entity_representations[0](indices=None).detach()
    with pytest.raises(_Interrupted):
        _early_stopped_run(tmp_path / "killed", "best-of-the-killed-run.pt", die_at=3)
    checkpoints = tmp_path / "killed" / "checkpoints"
    if legacy_name:  # as the version before named one process' copy
        (checkpoints / "run.pt.best-weights-epoch2.2-shards.pt").rename(checkpoints / "run.pt.best-weights-epoch2.pt")
    if same_path:
        assert (tmp_path / "killed" / "best-of-the-killed-run.pt").is_file()
    path = "best-of-the-killed-run.pt" if same_path else "best-of-the-resumed-run.pt"
    resumed = _early_stopped_run(tmp_path / "killed", path, num_shards=num_shards)
    assert resumed.stopper.stopped and resumed.stopper.best_epoch == 2
    actual = resumed.model.entity_representations[0](indices=None).detach()
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["run.pt"]  # stopped: every layout's copies go


def test_a_resumed_run_without_the_best_weights_keeps_its_training(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a copy of the best weights for its shards the run ends, warned.

    The model keeps the last epoch's weights (it raised ``FileNotFoundError`` when the stopper stopped,
    after all the training).
    """
    import logging

    with pytest.raises(_Interrupted):
        _early_stopped_run(tmp_path, "best-of-the-killed-run.pt", die_at=3)
    (tmp_path / "checkpoints" / "run.pt.best-weights-epoch2.2-shards.pt").rename(
        tmp_path / "checkpoints" / "run.pt.best-weights-epoch2.shard0-of-2.pt"  # only another layout's copy
    )
    with caplog.at_level(logging.WARNING, logger="pykeen_bess"):
        resumed = _early_stopped_run(tmp_path, "best-of-the-resumed-run.pt")
    assert resumed.stopper.stopped and resumed.stopper.best_epoch == 2 and len(resumed.losses) == 6
    assert "has no copy of its weights for this run's shards beside it (run.pt.best-weights-epoch2.2-shards.pt" in (
        caplog.text
    )
    assert "The early stopper stopped at epoch 6, but the best epoch's (2) weights are not there" in caplog.text


@dataclasses.dataclass
class _Layout:
    """The parts of a process topology the stopper's copies are named by (rank 1 of two ranks, one shard each)."""

    rank: int = 1
    world_size: int = 2
    is_distributed: bool = True
    n_shard: int = 2
    local_shards: tuple[int, ...] = (1,)
    replica: int = 0
    replicas: int = 1


def test_the_stopper_weights_beside_a_checkpoint_follow_its_best_epoch(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One copy per best epoch, named for its shards; others go after the checkpoint; a missing one is warned."""
    import logging

    from pykeen_bess.training.checkpoints.stopper_weights import (
        copy_suffix,
        keep_stopper_weights,
        layout_suffixes,
        prune_stopper_weights,
        restore_stopper_weights,
    )

    @dataclasses.dataclass
    class Stopper:
        best_model_path: pathlib.Path
        best_epoch: int | None = None

    ranks = _Layout()
    checkpoint, suffix, layout = tmp_path / "run.pt", copy_suffix(ranks), layout_suffixes(ranks)
    assert suffix == ".shard1-of-2" and layout == {".shard0-of-2", ".shard1-of-2"}
    assert copy_suffix(_Layout(0, 1, False, 4, (0, 1, 2, 3))) == ".4-shards"
    assert copy_suffix(_Layout(3, 4, True, 2, (1,), 1, 2)) == ".shard1-of-2.replica1-of-2"
    stopper = Stopper(tmp_path / "stopper.pt")
    keep_stopper_weights(checkpoint, stopper, suffix)  # no best epoch yet
    stopper.best_epoch = 2
    keep_stopper_weights(checkpoint, stopper, suffix)  # no file yet
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    torch.save({"w": torch.ones(2)}, stopper.best_model_path)
    keep_stopper_weights(checkpoint, stopper, suffix)
    (tmp_path / "run.pt.best-weights-epoch1.shard0-of-2.pt").write_bytes(b"another rank's")
    (tmp_path / "other.pt.best-weights-epoch1.shard1-of-2.pt").write_bytes(b"another checkpoint's")
    torch.save({"w": torch.full((2,), 4.0)}, stopper.best_model_path)
    stopper.best_epoch = 4
    keep_stopper_weights(checkpoint, stopper, suffix)  # the new best: copied before the checkpoint is written
    assert (tmp_path / "run.pt.best-weights-epoch2.shard1-of-2.pt").is_file()  # the written checkpoint's best
    prune_stopper_weights(checkpoint, stopper, suffix, layout)  # after it was written
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "other.pt.best-weights-epoch1.shard1-of-2.pt",  # another checkpoint's
        "run.pt.best-weights-epoch4.shard1-of-2.pt",
        "stopper.pt",
    ]
    # other layouts' copies (a resharded run's past, earlier versions' names) go too, this layout's of the best
    # epoch stay
    for name in ("2-shards", "shard0-of-3", "rank0-of-2", "shard0-of-2.replica1-of-2"):
        (tmp_path / f"run.pt.best-weights-epoch4.{name}.pt").write_bytes(b"another layout's")
    (tmp_path / "run.pt.best-weights-epoch4.pt").write_bytes(b"another layout's")
    (tmp_path / "run.pt.best-weights-epoch4.shard0-of-2.pt").write_bytes(b"the other rank's")
    prune_stopper_weights(checkpoint, stopper, suffix, layout)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("run")) == [
        "run.pt.best-weights-epoch4.shard0-of-2.pt",
        "run.pt.best-weights-epoch4.shard1-of-2.pt",
    ]
    # a resumed run's stopper: a file of its own, which does not exist; a later best of an attempt killed before
    # its checkpoint was written goes (the resumed run would take it for its own if it reached that epoch again)
    (tmp_path / "run.pt.best-weights-epoch5.shard1-of-2.pt").write_bytes(b"a killed attempt's")
    resumed = Stopper(tmp_path / "new" / "stopper.pt", best_epoch=4)
    restore_stopper_weights(checkpoint, resumed, ranks)
    assert torch.equal(torch.load(resumed.best_model_path)["w"], torch.full((2,), 4.0))
    assert not (tmp_path / "run.pt.best-weights-epoch5.shard1-of-2.pt").exists()
    # the same shard under replicas: any replica's copy
    replica = Stopper(tmp_path / "replica.pt", best_epoch=4)
    restore_stopper_weights(checkpoint, replica, _Layout(3, 4, True, 2, (1,), 1, 2))
    assert torch.equal(torch.load(replica.best_model_path)["w"], torch.full((2,), 4.0))
    # a new run (no best epoch): the copies beside its checkpoint's name are an earlier run's, and go
    restore_stopper_weights(checkpoint, Stopper(tmp_path / "fresh.pt"), ranks)
    assert not (tmp_path / "fresh.pt").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("run")]
    # a stopped run's last checkpoint holds the best weights: its copies go
    (tmp_path / "run.pt.best-weights-epoch4.shard1-of-2.pt").write_bytes(b"this rank's")
    (tmp_path / "run.pt.best-weights-epoch4.shard0-of-2.pt").write_bytes(b"the other rank's")
    stopped = Stopper(tmp_path / "stopped.pt", best_epoch=4)
    stopped.stopped = True  # type: ignore[attr-defined]
    prune_stopper_weights(checkpoint, stopped, suffix, layout)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("run")]
    with caplog.at_level(logging.WARNING):
        restore_stopper_weights(checkpoint, Stopper(tmp_path / "missing.pt", best_epoch=6), ranks)
    assert "best epoch (6)" in caplog.text and "run.pt.best-weights-epoch6.shard1-of-2.pt" in caplog.text
    # a checkpoint read from another layout: never this layout's names, only what resharding builds
    caplog.clear()
    other = Stopper(tmp_path / "other.pt", best_epoch=4)
    with caplog.at_level(logging.WARNING):
        restore_stopper_weights(checkpoint, other, ranks, resharded=lambda target, epoch: False)
    assert not other.best_model_path.exists() and "best epoch (4)" in caplog.text
    restore_stopper_weights(checkpoint, other, ranks, resharded=lambda target, epoch: target.write_bytes(b"built") > 0)
    assert other.best_model_path.read_bytes() == b"built"


@pytest.mark.parametrize(
    ("names", "replicas"),
    [
        ([".shard0-of-2", ".shard1-of-2"], 1),
        ([".rank0-of-2", ".rank1-of-2"], 1),  # as the version before named a rank's copy (rank s holds shard s)
        ([".shard0-of-2.replica1-of-2", ".shard1-of-2.replica0-of-2"], 2),  # any replica's copy of each shard
    ],
    ids=["ranks", "earlier-versions-ranks", "replicas"],
)
@pytest.mark.parametrize(("n_shard", "shards"), [(1, [0]), (4, [3]), (4, [0, 1, 2, 3])])
def test_the_copies_of_ranks_are_resharded_for_other_shards(
    tmp_path: pathlib.Path, names: list[str], replicas: int, n_shard: int, shards: list[int]
) -> None:
    """The copies two ranks kept give one process, or a rank of four shards, the rows of its entities."""
    from pykeen_bess.data.sharding import EntitySharding
    from pykeen_bess.training.checkpoints.resharding import ShardFiles
    from pykeen_bess.training.checkpoints.stopper_weights import reshard_stopper_weights, stopper_weights_file

    old = EntitySharding.create(14, 2, seed=0)
    checkpoint = tmp_path / "run.pt"
    for shard, name in enumerate(names):  # every row holds its entity's id (padding rows: -1)
        rows = old.shard_entities[shard].to(torch.float32).view(-1, 1).expand(-1, 3).clone()
        torch.save(
            {"entity_representations.0.weight": rows, "w": torch.ones(2)}, stopper_weights_file(checkpoint, 2, name)
        )
    files = ShardFiles(checkpoint, 2, {"replicas": replicas, "processes": 2 * replicas})
    new = old.with_shards(n_shard)
    target = tmp_path / "stopper.pt"
    assert reshard_stopper_weights(checkpoint, 2, target, files, new, shards, ["entity_representations.0.weight"])
    state = torch.load(target)
    wanted = torch.cat([new.shard_entities[shard] for shard in shards])
    expected = torch.where(wanted >= 0, wanted, 0).to(torch.float32).view(-1, 1).expand(-1, 3)  # padding: zero
    torch.testing.assert_close(state["entity_representations.0.weight"], expected, rtol=0, atol=0)
    assert torch.equal(state["w"], torch.ones(2))
    # a copy missing: nothing is written
    stopper_weights_file(checkpoint, 2, names[1]).unlink()
    target.unlink()
    assert not reshard_stopper_weights(checkpoint, 2, target, files, new, shards, ["entity_representations.0.weight"])
    assert not target.exists()


def test_a_one_process_checkpoint_removes_the_shard_files_of_the_distributed_one_it_replaces(
    tmp_path: pathlib.Path,
) -> None:
    """One process writing over a distributed checkpoint's pointer leaves none of its shard files (they stayed)."""
    from pykeen.datasets import Nations

    from pykeen_bess.training import BessTrainingLoop

    stale = ["run.pt.v3.rank0-of-2", "run.pt.v3.rank1-of-2", "run.pt.v2.rank0-of-4.replica1-of-2"]
    for name in [*stale, "other.pt.v3.rank0-of-2"]:
        (tmp_path / name).write_bytes(b"a shard file")
    (tmp_path / "run.pt.v3.rank0-of-2.tables-1").mkdir()  # the copies of tables in files beside a shard file
    factory = Nations().training
    model = DistMult(triples_factory=factory, embedding_dim=4, random_seed=0)
    loop = BessTrainingLoop(model=model, triples_factory=factory, num_shards=2, num_threads=1)
    loop.train(
        factory, num_epochs=1, batch_size=256, use_tqdm=False, checkpoint_name="run.pt", checkpoint_directory=tmp_path,
        checkpoint_frequency=0,
    )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.pt.v3.rank0-of-2", "run.pt"]
