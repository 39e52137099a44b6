"""Storage tiers (device, host memory, files): the same training bitwise, exact traffic, checkpoints, bad input."""

from __future__ import annotations

import contextlib
import logging
import math
import pathlib
import re
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
from capturable import default_dtype
from pykeen.datasets import Nations
from pykeen.models import DistMult
from pykeen.nn import Embedding
from pykeen.training import TrainingCallback
from pykeen.triples import CoreTriplesFactory

from pykeen_bess.storage import base as storage_base
from pykeen_bess.storage import files as storage_files
from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.tables.representation import ShardedEmbedding
from pykeen_bess.storage import MmapStorage, make_storage
from pykeen_bess.training import BessTrainingLoop

TIERS = ["device", "host", "mmap"]


@pytest.fixture(scope="module")
def nations() -> Nations:
    return Nations()


def factory_of(dataset: Nations, num_triples: int = 400) -> CoreTriplesFactory:
    return CoreTriplesFactory.create(
        mapped_triples=dataset.training.mapped_triples[:num_triples],
        num_entities=dataset.num_entities,
        num_relations=dataset.num_relations,
    )


class StepRecorder(TrainingCallback):
    """Every step's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_batch(self, epoch: int, batch: Any, batch_loss: float, **kwargs: Any) -> None:
        self.losses.append(batch_loss)


def make_loop(
    factory: CoreTriplesFactory,
    tier: str,
    path: pathlib.Path,
    num_shards: int = 3,
    optimizer: str = "adam",
    exchange: str = "embedding",
    model_cls: type = DistMult,
    overwrite: bool = True,
    **kwargs: Any,
) -> BessTrainingLoop:
    model = model_cls(triples_factory=factory, embedding_dim=8, random_seed=0)
    storage_kwargs = dict(storage_path=path, storage_kwargs=dict(overwrite=overwrite)) if tier == "mmap" else {}
    return BessTrainingLoop(
        model=model,
        triples_factory=factory,
        num_shards=num_shards,
        num_negs_per_pos=6,
        exchange=exchange,
        seed=3,
        optimizer=optimizer,
        optimizer_kwargs=dict(lr=0.05),
        automatic_memory_optimization=False,
        storage=tier,
        **storage_kwargs,
        **kwargs,
    )


def train(loop: BessTrainingLoop, factory: CoreTriplesFactory, **kwargs: Any) -> list[float]:
    recorder = StepRecorder()
    loop.train(factory, num_epochs=2, batch_size=72, use_tqdm=False, callbacks=recorder, **kwargs)
    return recorder.losses


def table_state(loop: BessTrainingLoop) -> dict[str, torch.Tensor]:
    """The shard table and its row state, wherever the tier keeps them."""
    table = loop.tables[0]
    state = {**loop.optimizer.state.get(table.optimizer_parameter, {}), **table.row_state}
    result = {"weight": table.weight.detach().clone()}
    result.update({f"state.{k}": v.detach().clone() for k, v in state.items() if torch.is_tensor(v) and v.ndim >= 1})
    return result


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("exchange", ["embedding", "score"])
@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "sgd", "rowwise_adagrad"])
def test_tiers_train_bitwise_alike(nations, tmp_path, num_shards, exchange, optimizer) -> None:
    factory = factory_of(nations)
    results = {}
    for tier in TIERS:
        loop = make_loop(factory, tier, tmp_path, num_shards=num_shards, optimizer=optimizer, exchange=exchange)
        losses = train(loop, factory)
        results[tier] = (losses, table_state(loop), loop.model.relation_representations[0]._embeddings.weight.detach())
    device_losses, device_state, device_relations = results["device"]
    assert len(device_losses) > 4
    for tier in ("host", "mmap"):
        losses, state, relations = results[tier]
        assert losses == device_losses, tier  # bitwise
        assert state.keys() == device_state.keys()
        for key, value in device_state.items():
            assert torch.equal(state[key], value), (tier, key)
        assert torch.equal(relations, device_relations)


def test_a_model_whose_only_parameters_are_stored_tables_trains_on_every_tier(nations, tmp_path) -> None:
    """UM (no relation representations) with tables in host memory or files had neither parameters nor buffers:
    PyKEEN's ``train()`` failed to infer its device (``DeviceResolutionError``), and so did its evaluation."""
    from pykeen.models import UM
    from pykeen.utils import get_preferred_device

    factory = factory_of(nations)
    results = {}
    for tier in TIERS:
        loop = make_loop(factory, tier, tmp_path, model_cls=UM)
        results[tier] = (train(loop, factory), table_state(loop)["weight"])
        assert get_preferred_device(loop.model) == torch.device("cpu")
        assert "device_anchor" not in loop.model.state_dict()
    for tier in ("host", "mmap"):
        assert results[tier][0] == results["device"][0], tier  # bitwise
        assert torch.equal(results[tier][1], results["device"][1]), tier


def test_stored_tables_are_not_reachable_from_the_model_or_the_optimizer(nations, tmp_path) -> None:
    factory = factory_of(nations)
    for tier in ("host", "mmap"):
        loop = make_loop(factory, tier, tmp_path, num_shards=1)
        train(loop, factory)
        rows = loop.tables[0].weight.shape[0]
        assert rows == nations.num_entities
        tensors = [*loop.model.parameters(), *loop.model.buffers()]
        for state in loop.optimizer.state.values():
            tensors += [value for value in state.values() if torch.is_tensor(value)]
        assert tensors
        assert all(t.ndim == 0 or t.shape[0] != rows for t in tensors), [tuple(t.shape) for t in tensors]
        # model.to() leaves the tables in their tier
        table = loop.tables[0]
        before = table.weight
        loop.model.to("cpu")
        assert table.weight is before and not isinstance(table.weight, torch.nn.Parameter)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd"])
def test_traffic_per_step_is_unique_rows_times_row_and_state_bytes(nations, tmp_path, tier, optimizer) -> None:
    """The eager step moves every distinct row once each way (and the dummy row of padding slots in)."""
    factory = factory_of(nations)
    loop = make_loop(factory, tier, tmp_path, optimizer=optimizer, static_step=False)
    storage = loop.tables.storage
    steps: list[dict[str, int]] = []

    class Traffic(TrainingCallback):
        """Records each step's traffic from one step's start to the next one's (after its update)."""

        def finish(self) -> None:
            if steps and "read" not in steps[-1]:
                steps[-1].update(read=storage.traffic.bytes_read, written=storage.traffic.bytes_written)
            storage.traffic.reset()

        def pre_batch(self, **kwargs: Any) -> None:
            self.finish()

        def on_batch(self, epoch: int, batch: Any, batch_loss: float, **kwargs: Any) -> None:
            rows = self.training_loop.runner.rows
            steps.append(dict(gathered=rows.rows.numel(), real=rows.real_rows.numel()))

        def post_train(self, **kwargs: Any) -> None:
            self.finish()

    loop.train(factory, num_epochs=1, batch_size=72, use_tqdm=False, callbacks=Traffic())
    width, size = 8, 4
    state_width = {"adam": 2 * width, "rowwise_adagrad": 1, "sgd": 0}[optimizer]
    assert len(steps) > 3
    for step in steps:
        # the step reads its gathered rows (with the dummy row of padding slots, if any) and the state of the
        # updated rows, and writes back the updated rows and their state
        assert step["read"] == (step["gathered"] * width + step["real"] * state_width) * size, step
        assert step["written"] == step["real"] * (width + state_width) * size, step
    # so a step without padding moves unique rows x (width + state width) each way
    assert any(step["gathered"] == step["real"] for step in steps)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd"])
@pytest.mark.parametrize("host_rules", [False, True], ids=["device-updates", "cpu-updates"])
def test_static_step_traffic_is_every_looked_up_row(
    nations, tmp_path, tier, optimizer, host_rules, monkeypatch
) -> None:
    """The static step (fixed shapes) reads every row it looks up, duplicates included.

    A GPU's updates (fixed shapes) then move every looked-up row and its state once each way; the CPU's
    updates read the state of the step's distinct rows (their values are the looked-up ones) and write
    rows and state back once each.
    """
    from pykeen_bess.training.steps.static_update import StaticUpdate

    monkeypatch.setattr(StaticUpdate, "host_rules", host_rules)
    factory = factory_of(nations)
    loop = make_loop(factory, tier, tmp_path, optimizer=optimizer, static_step=True)
    storage = loop.tables.storage
    steps: list[dict[str, int]] = []

    class Traffic(TrainingCallback):
        """Records each step's traffic (a per-step hook: the static step runs one step between them)."""

        def pre_batch(self, **kwargs: Any) -> None:
            storage.traffic.reset()

        def on_batch(self, epoch: int, batch: Any, batch_loss: float, **kwargs: Any) -> None:
            steps.append(dict(read=storage.traffic.bytes_read, written=storage.traffic.bytes_written))

    loop.train(factory, num_epochs=1, batch_size=72, use_tqdm=False, callbacks=Traffic())
    assert loop.static is not None and len(steps) > 3
    looked_up = sum(index.numel() for index in loop.static.role_index)  # heads, tails, negatives
    width, size = 8, 4
    state_width = {"adam": 2 * width, "rowwise_adagrad": 1, "sgd": 0}[optimizer]
    for step in steps:
        if not host_rules:
            assert step == dict(
                read=looked_up * (width + state_width) * size, written=looked_up * (width + state_width) * size
            )
            continue
        real, remainder = divmod(step["written"], (width + state_width) * size)  # distinct rows a slot updates
        assert remainder == 0 and 0 < real < looked_up, step
        # the looked-up rows and the updated rows' state (the rows' values are taken from the looked-up ones)
        assert step["read"] == (looked_up * width + real * state_width) * size, step


def test_evaluation_and_prediction_read_rows_from_every_tier(nations, tmp_path) -> None:
    from pykeen_bess import predict_top_k

    factory = factory_of(nations)
    results = {}
    for tier in TIERS:
        loop = make_loop(factory, tier, tmp_path)
        train(loop, factory)
        model = loop.model
        if tier != "device":  # the tables stay in their tier and in the model
            assert isinstance(model.entity_representations[0], ShardedEmbedding)
            assert model.entity_representations[0].weight is loop.tables[0].weight
        metrics = BessEvaluator(batch_size=16).evaluate(
            model,
            nations.testing.mapped_triples,
            additional_filter_triples=[nations.training.mapped_triples],
            use_tqdm=False,
        )
        top = predict_top_k(model, nations.testing.mapped_triples[:5, :2], k=3)
        scores = model.score_hrt(nations.testing.mapped_triples[:5])
        results[tier] = (metrics.to_flat_dict(), top[["tail_id", "score"]].to_numpy(), scores.detach())
    for tier in ("host", "mmap"):
        assert results[tier][0] == results["device"][0]
        np.testing.assert_array_equal(results[tier][1], results["device"][1])
        assert torch.equal(results[tier][2], results["device"][2])


def test_continued_training_keeps_the_stored_tables(nations, tmp_path) -> None:
    factory = factory_of(nations)
    losses = {}
    for tier in ("device", "host"):
        loop = make_loop(factory, tier, tmp_path)
        first = train(loop, factory)
        second = train(loop, factory, continue_training=True)
        losses[tier] = first + second
    assert losses["host"] == losses["device"]


def test_another_loop_cannot_reset_or_train_a_stored_table(nations, tmp_path) -> None:
    """PyKEEN's loop would re-initialise a table outside the model and never update it: refused, the rows kept."""
    from pykeen.training import SLCWATrainingLoop

    factory = factory_of(nations)
    loop = make_loop(factory, "host", tmp_path)
    train(loop, factory)
    table = loop.tables[0]
    before = table.weight.clone()
    relations = loop.model.relation_representations[0]().detach().clone()
    other = SLCWATrainingLoop(model=loop.model, triples_factory=factory, optimizer="adam")
    with pytest.raises(RuntimeError, match=r"cannot re-initialise .* storage tier host, outside the model"):
        other.train(factory, num_epochs=1, batch_size=72, use_tqdm=False)
    # refused before anything is re-initialised (PyKEEN resets the deeper relation embedding first)
    assert torch.equal(loop.model.relation_representations[0]().detach(), relations)
    with pytest.raises(ValueError, match="without being trained once"):  # PyKEEN's own refusal
        other.train(factory, num_epochs=1, batch_size=72, use_tqdm=False, continue_training=True)
    assert torch.equal(table.weight, before)
    loop.model.score_hrt(factory.mapped_triples[:5])  # scoring reads the rows, in any mode
    loop.train(factory, num_epochs=3, batch_size=72, use_tqdm=False, continue_training=True)  # BESS's loop continues
    assert not torch.equal(loop.tables[0].weight, before)


@pytest.mark.parametrize("tier", ["host", "mmap"])
def test_unshard_model_makes_an_ordinary_pykeen_model_that_any_loop_trains(nations, tmp_path, tier) -> None:
    """A new BESS loop refused the model of a host or file table ("not a plain pykeen.nn.Embedding"), as did PyKEEN's
    loops, whose message sent the user to it; its state dict was not PyKEEN's and its pickle held the tier."""
    import io

    from pykeen.training import SLCWATrainingLoop

    from pykeen_bess import unshard_model

    factory = factory_of(nations)
    loop = make_loop(factory, tier, tmp_path)
    train(loop, factory)
    model = loop.model
    triples = factory.mapped_triples[:20]
    scores = model.score_hrt(triples).detach()
    with pytest.raises(RuntimeError, match=r"pykeen_bess\.unshard_model\(model\)"):
        SLCWATrainingLoop(model=model, triples_factory=factory).train(factory, num_epochs=1, use_tqdm=False)
    plain = DistMult(triples_factory=factory, embedding_dim=8, random_seed=1)
    assert unshard_model(model) is model
    assert type(model.entity_representations[0]) is Embedding and "reset_parameters_" not in vars(model)
    torch.testing.assert_close(model.score_hrt(triples).detach(), scores, rtol=0, atol=0)
    plain.load_state_dict(model.state_dict())  # PyKEEN's keys
    torch.testing.assert_close(plain.score_hrt(triples).detach(), scores, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert buffer.tell() < 3 * sum(p.numel() * p.element_size() for p in model.parameters()) + 40_000
    assert unshard_model(model) is model  # nothing to do
    # PyKEEN's loop trains it, and so does a new BESS loop (given the model of a stored table, it unshards first)
    SLCWATrainingLoop(model=model, triples_factory=factory).train(factory, num_epochs=1, use_tqdm=False)
    (tmp_path / "second").mkdir()  # (the first loop still maps its files: it may go on training them)
    stored = make_loop(factory, tier, tmp_path / "second")
    train(stored, factory)
    fresh = BessTrainingLoop(
        model=stored.model, triples_factory=factory, num_shards=2, automatic_memory_optimization=False
    )
    assert type(stored.model.entity_representations[0]) is Embedding
    assert len(fresh.train(factory, num_epochs=1, batch_size=72, use_tqdm=False)) == 1


@pytest.mark.parametrize("tier", ["host", "mmap"])
def test_the_pipeline_result_saves_stored_tables_as_an_ordinary_model(nations, tmp_path, tier) -> None:
    """save_to_directory pickled the tier: the optimizer state and the sharding's triples (17x the weights)."""
    from pykeen.pipeline import pipeline

    storage = dict(storage=tier, storage_path=tmp_path / "tables") if tier == "mmap" else dict(storage=tier)
    (tmp_path / "tables").mkdir()
    result = pipeline(
        dataset=nations,
        model="DistMult",
        model_kwargs=dict(embedding_dim=8),
        training_loop="bess",
        training_loop_kwargs=dict(num_shards=2, **storage),
        training_kwargs=dict(num_epochs=1, batch_size=128, use_tqdm=False),
        evaluation_kwargs=dict(use_tqdm=False),
        random_seed=0,
    )
    triples = nations.testing.mapped_triples[:10]
    scores = result.model.score_hrt(triples).detach()
    result.save_to_directory(tmp_path / "out")
    file = tmp_path / "out" / "trained_model.pkl"
    weights = sum(p.numel() * p.element_size() for p in result.model.parameters()) + 14 * 8 * 4
    assert file.stat().st_size < weights + 12_000
    loaded = torch.load(file, weights_only=False)
    assert type(loaded.entity_representations[0]) is Embedding and "reset_parameters_" not in vars(loaded)
    torch.testing.assert_close(loaded.score_hrt(triples).detach(), scores, rtol=0, atol=0)
    # the result's model keeps its tables (and their guard)
    assert isinstance(result.model.entity_representations[0], ShardedEmbedding)
    assert "reset_parameters_" in vars(result.model)


def test_a_copied_or_unpickled_model_of_files_gives_its_state_dict(nations, tmp_path) -> None:
    """A model trained with tables in files (also copied or pickled): its state dict holds values, not the live files.

    A snapshot of the state dict of the model named the live files: restoring it after more training silently gave
    the relations of the snapshot and the entities of today.
    """
    import copy
    import io

    factory = factory_of(nations)
    loop = make_loop(factory, "mmap", tmp_path)
    train(loop, factory)
    expected = loop.tables[0].weight.detach().clone()
    buffer = io.BytesIO()
    torch.save(loop.model, buffer)
    buffer.seek(0)
    for model in (copy.deepcopy(loop.model), torch.load(buffer, weights_only=False)):
        (key,) = [key for key in model.state_dict() if key.endswith("stored_table")]
        entry = model.state_dict()[key]
        assert entry["tier"] == "mmap" and torch.equal(entry["tensors"]["weight"], expected)
        copy.deepcopy(loop.model).load_state_dict(model.state_dict())  # and loads into a copy
    # the trained model's own state dict holds values too: a snapshot of it restores them after more training
    snapshot = copy.deepcopy(loop.model.state_dict())
    scores = loop.model.score_hrt(factory.mapped_triples[:20]).detach()
    loop.train(factory, num_epochs=4, batch_size=72, use_tqdm=False, continue_training=True)
    assert not torch.equal(loop.model.score_hrt(factory.mapped_triples[:20]).detach(), scores)
    loop.model.load_state_dict(snapshot)
    assert torch.equal(loop.model.score_hrt(factory.mapped_triples[:20]).detach(), scores)
    device = make_loop(factory, "device", tmp_path)
    train(device, factory)
    assert "reset_parameters_" not in vars(device.model)  # an ordinary PyKEEN model (no guard of the plugin's)


def train_with_checkpoints(
    loop: BessTrainingLoop, factory: CoreTriplesFactory, epochs: int, path: pathlib.Path, name: str = "run.pt"
) -> list[float]:
    recorder = StepRecorder()
    loop.train(
        factory,
        num_epochs=epochs,
        batch_size=72,
        use_tqdm=False,
        callbacks=recorder,
        checkpoint_directory=path,
        checkpoint_name=name,
        checkpoint_frequency=0,
    )
    return recorder.losses


@pytest.fixture(params=[False, True], ids=["direct", "staged"])
def staged(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[bool, list[bool]]:
    """Run the static step's rows directly from the tiers, or staged around every step (what a GPU does).

    :returns: whether staging is asked for, and for every static step made outside the device tier whether it
        stages
    """
    made: list[bool] = []
    if request.param:
        from pykeen_bess.training.steps import static_step

        forced = static_step.row_access

        def stage_outside_the_device(tables, topology, optimizer, most, _, tensors, budget=None):
            outside = tables.storage.captured_step_obstacle() is not None  # the device tier is read directly
            access = forced(tables, topology, optimizer, most, True if outside else None, tensors, budget)
            if outside:
                made.append(access.staged)
            return access

        monkeypatch.setattr(static_step, "row_access", stage_outside_the_device)
    return request.param, made


def table_files(directory: pathlib.Path) -> list[str]:
    """The names of the table files in a storage directory (not the marks naming the checkpoint of their run)."""
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(".checkpoint"))


@pytest.mark.parametrize("tier", TIERS)
def test_checkpoints_resume_identically(nations, tmp_path, tier, staged) -> None:
    """A run checkpointed after an epoch and resumed equals the run in one go (also with staged rows)."""
    factory = factory_of(nations)
    (tmp_path / "a").mkdir()
    full = train(make_loop(factory, tier, tmp_path / "a"), factory)
    path, storage_dir = tmp_path / "ck", tmp_path / "b"
    path.mkdir()
    storage_dir.mkdir()
    first = train_with_checkpoints(make_loop(factory, tier, storage_dir), factory, 1, path)
    if tier == "mmap":  # the checkpoint holds copies of the files, not pickled tables, in a directory named for it
        (copies,) = [p for p in path.iterdir() if p.name.startswith("run.pt.tables-")]
        assert not [p for p in path.iterdir() if ".tmp-" in p.name]  # nothing looks disposable
        assert sorted(p.name for p in copies.iterdir()) == table_files(storage_dir)
        entry = torch.load(path / "run.pt", weights_only=False)["model_state_dict"][
            "entity_representations.0.stored_table"
        ]
        assert "tensors" not in entry and entry["directory"] == copies.name
        assert sorted(entry["files"].values()) == sorted(p.name for p in copies.iterdir())
    rest = train_with_checkpoints(make_loop(factory, tier, storage_dir), factory, 2, path)
    assert first + rest == full
    wanted, made = staged
    assert made == ([True] * 3 if wanted and tier != "device" else [])
    if tier == "mmap":  # one version of the copies is kept
        assert len([p for p in path.iterdir() if p.name.startswith("run.pt.tables-")]) == 1


def test_mmap_files_of_a_resumed_checkpoint_are_reused_without_overwrite(nations, tmp_path) -> None:
    """The same command again resumes its checkpoint; without a checkpoint the earlier files stay refused."""
    factory = factory_of(nations)
    (tmp_path / "a").mkdir()
    full = train(make_loop(factory, "mmap", tmp_path / "a"), factory)
    path, storage_dir = tmp_path / "ck", tmp_path / "b"
    path.mkdir()
    storage_dir.mkdir()

    def mmap_loop() -> BessTrainingLoop:  # no overwrite=True
        model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)
        return BessTrainingLoop(
            model=model,
            triples_factory=factory,
            num_shards=3,
            num_negs_per_pos=6,
            seed=3,
            optimizer="adam",
            optimizer_kwargs=dict(lr=0.05),
            automatic_memory_optimization=False,
            storage="mmap",
            storage_path=storage_dir,
        )

    first = train_with_checkpoints(mmap_loop(), factory, 1, path)
    rest = train_with_checkpoints(mmap_loop(), factory, 2, path)
    assert first + rest == full
    assert table_files(storage_dir) == table_files(tmp_path / "a")
    # no checkpoint to resume: the earlier run's files are refused, and left as they were
    before = {p.name: p.read_bytes() for p in storage_dir.iterdir()}
    with pytest.raises(FileExistsError, match="overwrite=True.*No checkpoint is being resumed"):
        train(mmap_loop(), factory)
    assert {p.name: p.read_bytes() for p in storage_dir.iterdir()} == before


class _Crash(Exception):
    """A crash of a run, raised by a callback after an epoch."""


def test_a_checkpointed_run_killed_before_its_first_checkpoint_runs_again(nations, tmp_path) -> None:
    """The same command again takes over the files of its crashed run, which wrote no checkpoint yet.

    The files of a run of another checkpoint, or of none, stay refused.
    """
    from pykeen.training.callbacks import TrainingCallback

    factory = factory_of(nations)
    (tmp_path / "a").mkdir()
    full = train(make_loop(factory, "mmap", tmp_path / "a"), factory)
    storage_dir, checkpoints = tmp_path / "b", tmp_path / "ck"
    storage_dir.mkdir()

    class Crash(TrainingCallback):
        def post_epoch(self, epoch: int, epoch_loss: float, **kwargs: Any) -> None:
            raise _Crash(epoch)

    def run(name: str | None, crash: bool = False) -> list[float]:
        model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)
        loop = BessTrainingLoop(
            model=model, triples_factory=factory, num_shards=3, num_negs_per_pos=6, seed=3, optimizer="adam",
            optimizer_kwargs=dict(lr=0.05), automatic_memory_optimization=False, storage="mmap",
            storage_path=storage_dir,
        )  # fmt: skip
        recorder = StepRecorder()
        named = dict(checkpoint_name=name, checkpoint_directory=checkpoints) if name else {}
        callbacks = [recorder, Crash()] if crash else [recorder]
        loop.train(factory, num_epochs=2, batch_size=72, use_tqdm=False, callbacks=callbacks, **named)
        return recorder.losses

    with pytest.raises(_Crash):  # after epoch 1; PyKEEN's checkpoint_frequency (30 minutes): no checkpoint yet
        run("run.pt", crash=True)
    assert not (checkpoints / "run.pt").exists()
    assert run("run.pt") == full  # the same command again
    assert table_files(storage_dir) == table_files(tmp_path / "a")
    before = {p.name: p.read_bytes() for p in storage_dir.iterdir()}
    for name in ("other.pt", None):  # another checkpoint's run, a run without one: refused, the files kept
        with pytest.raises(FileExistsError, match="overwrite=True"):
            run(name)
        assert {p.name: p.read_bytes() for p in storage_dir.iterdir()} == before


def test_a_relative_storage_path_stays_where_the_loop_was_built(nations, tmp_path, monkeypatch) -> None:
    """A relative storage_path is the directory the loop was built in, whatever the working directory later is.

    The optimizer state, placed when training starts, went under the new working directory (replacing and
    marking another run's files there), and the checkpoint copied those instead of the run's tables.
    """
    factory = factory_of(nations)
    for name in ("a/tables", "b/tables"):
        (tmp_path / name).mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a")
    loop = make_loop(factory, "mmap", pathlib.Path("tables"), overwrite=False)
    monkeypatch.chdir(tmp_path / "b")
    train_with_checkpoints(loop, factory, 1, tmp_path / "ck")
    assert list((tmp_path / "b/tables").iterdir()) == []
    (copies,) = [path for path in (tmp_path / "ck").iterdir() if path.is_dir()]
    ours = tmp_path / "a/tables"
    assert table_files(ours) == table_files(copies)
    assert all((ours / name).read_bytes() == (copies / name).read_bytes() for name in table_files(ours))


def test_a_loop_that_fails_to_build_leaves_no_files(nations, tmp_path) -> None:
    """A configuration refused by the constructor after the tables were placed left their files, refused then as
    an earlier run's when the corrected command ran."""
    factory = factory_of(nations)
    with pytest.raises(ValueError, match="needs row-sparse updates"):
        make_loop(factory, "mmap", tmp_path, overwrite=False, sparse_updates=False)
    assert list(tmp_path.iterdir()) == []
    train(make_loop(factory, "mmap", tmp_path, overwrite=False), factory)


def test_table_files_reserve_their_blocks(tmp_path, monkeypatch) -> None:
    """A table file owns its disk blocks when placed: a disk filled later (checkpoint copies) is an error there,
    not a SIGBUS of the process writing a new page of a sparse file; a full disk is a MemoryError now (naming the
    table, and letting go of the lock of the existing file it was placed beside); a filesystem without
    preallocation keeps the file sparse (posix_fallocate would write every block)."""
    import ctypes
    import errno
    import gc

    from pykeen_bess.storage import MmapStorage
    from pykeen_bess.storage import disk, files

    tensor = MmapStorage(tmp_path).place("t", (1024, 64), torch.float32)
    if disk._fallocate is not None and (tmp_path / "t.npy").stat().st_blocks * 512 < tensor.numel() * 4:
        pytest.skip("this filesystem has no preallocation")  # (the file stays sparse: checked below)
    calls = []

    def failing(code: int):
        def fallocate(descriptor: int, mode: int, offset: int, length: int) -> int:
            calls.append(length)
            ctypes.set_errno(code)
            return -1

        return fallocate

    MmapStorage(tmp_path, overwrite=True).place("u", (4, 2), torch.float32)  # an earlier run's file
    storage = MmapStorage(tmp_path)
    storage.defer_existing_files()
    monkeypatch.setattr(disk, "_fallocate", failing(errno.ENOSPC))
    with pytest.raises(MemoryError, match="no room for u.npy"):
        storage.place("u", (1024, 64), torch.float32)  # beside the earlier run's u.npy
    assert [p.name for p in tmp_path.glob("u.npy*")] == ["u.npy"]  # (no new file beside it)
    gc.collect()
    assert str(tmp_path / "u.npy") not in files._HELD  # (no array maps it: another process may take it)
    monkeypatch.setattr(disk, "_fallocate", failing(errno.EOPNOTSUPP))
    sparse = MmapStorage(tmp_path).place("v", (1024, 64), torch.float32)
    size = (tmp_path / "v.npy").stat().st_size
    assert calls[-1] == size and (tmp_path / "v.npy").stat().st_blocks * 512 < size // 4  # (the header's block)
    assert sparse.shape == (1024, 64)


def test_a_storage_handed_to_a_second_loop_keeps_the_first_loops_files(nations, tmp_path) -> None:
    """A failed build (or a refusal) removes the files placed for its own loop, not those of an earlier loop
    of the same storage object."""
    from pykeen_bess.storage import MmapStorage

    factory = factory_of(nations)
    storage = MmapStorage(tmp_path)
    first = make_loop(factory, storage, None)
    train(first, factory)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="needs row-sparse updates"):
        make_loop(factory, storage, None, sparse_updates=False)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    first.train(factory, num_epochs=1, batch_size=72, use_tqdm=False, continue_training=True)  # not blocked


def test_a_loop_whose_files_were_refused_does_not_train_again(nations, tmp_path) -> None:
    """A refused run removes the files it placed: its tables map no file under storage_path any more.

    Trained again (the error caught), it trained on unlinked memory maps: nothing of it reached the files,
    and the earlier run's files (the ones refused) looked like its result. Now refused again, clearly.
    """
    factory = factory_of(nations)
    train(make_loop(factory, "mmap", tmp_path), factory)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    loop = make_loop(factory, "mmap", tmp_path, overwrite=False)
    with pytest.raises(FileExistsError, match="No checkpoint is being resumed"):
        train(loop, factory)
    for kwargs in ({}, dict(continue_training=True)):
        with pytest.raises(FileExistsError, match="refused by an earlier train\\(\\) call"):
            train(loop, factory, **kwargs)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_processes_refuse_their_files_together(tmp_path) -> None:
    """Where another process refuses its files, this one refuses too: its earlier files stay as they were.

    Each process decided alone: one resumed (replacing its run's files) and trained into the first collective
    while another raised.
    """
    from pykeen_bess.storage import MmapStorage

    run = MmapStorage(tmp_path)
    run.place("t", (4, 2), torch.float32).fill_(1.0)
    run.claim_existing(resuming=False, checkpoint=tmp_path / "run.pt")
    run.flush()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    votes: list[bool] = []

    def another_refuses(ok: bool) -> bool:
        votes.append(ok)
        return False

    storage = MmapStorage(tmp_path)
    storage.defer_existing_files()
    storage.place("t", (4, 2), torch.float32)
    storage.place("state", (4,), torch.float32)  # a name no file had: removed as well
    with pytest.raises(FileExistsError, match="Another process refused its table files"):
        storage.claim_existing(resuming=True, checkpoint=tmp_path / "run.pt", agree=another_refuses)
    assert votes == [True]  # this process alone would have resumed
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # every process agreeing: resumed as before
    storage = MmapStorage(tmp_path)
    storage.defer_existing_files()
    storage.place("t", (4, 2), torch.float32)
    storage.claim_existing(resuming=True, checkpoint=tmp_path / "run.pt", agree=lambda ok: ok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npy", "t.npy.checkpoint"]


def test_resuming_a_checkpoint_into_another_runs_files_is_refused(nations, tmp_path) -> None:
    """Resuming checkpoint Y with the storage_path of run X (a slip) replaced X's files, its only copy.

    X trained without a checkpoint; a fresh run into its directory was refused, but resuming another run's
    checkpoint there replaced X's files with Y's. Now refused, X's files kept (and none of Y's left beside them:
    X's SGD keeps no state, Y's Adam does); Y resumes from its own files.
    """
    factory = factory_of(nations)
    ours, theirs, checkpoints = tmp_path / "x", tmp_path / "y", tmp_path / "ck"
    for directory in (ours, theirs, checkpoints):
        directory.mkdir()
    train(make_loop(factory, "mmap", ours, optimizer="sgd", overwrite=False), factory)  # run X: no checkpoint
    before = {p.name: p.read_bytes() for p in ours.iterdir()}
    train_with_checkpoints(make_loop(factory, "mmap", theirs, overwrite=False), factory, 1, checkpoints)  # run Y
    with pytest.raises(FileExistsError, match="not of the run of the resumed checkpoint.*overwrite=True"):
        train_with_checkpoints(make_loop(factory, "mmap", ours, overwrite=False), factory, 2, checkpoints)
    assert {p.name: p.read_bytes() for p in ours.iterdir()} == before
    # X's files of a run with a checkpoint of another name: refused as well
    train_with_checkpoints(make_loop(factory, "mmap", ours, overwrite=True), factory, 1, tmp_path, name="x.pt")
    before = {p.name: p.read_bytes() for p in ours.iterdir()}
    with pytest.raises(FileExistsError, match="is of a run of checkpoint\\(s\\) .*x.pt, not of the run"):
        train_with_checkpoints(make_loop(factory, "mmap", ours, overwrite=False), factory, 2, checkpoints)
    assert {p.name: p.read_bytes() for p in ours.iterdir()} == before
    train_with_checkpoints(make_loop(factory, "mmap", theirs, overwrite=False), factory, 2, checkpoints)


@pytest.mark.parametrize("named", [False, True])
def test_a_failure_checkpoint_resumes_with_its_runs_files(nations, tmp_path, named) -> None:
    """A failure checkpoint (of a run with or without a checkpoint of its own) takes its run's files over.

    Its run's files are marked with it as it is written: a run without checkpoints has no other mark.
    """
    from pykeen.training.callbacks import TrainingCallback

    factory = factory_of(nations)
    storage_dir, checkpoints = tmp_path / "s", tmp_path / "ck"
    storage_dir.mkdir()
    checkpoints.mkdir()

    class Fail(TrainingCallback):
        def post_batch(self, epoch: int, batch: Any, **kwargs: Any) -> None:
            if epoch == 2:
                raise RuntimeError("a failure in epoch 2")

    named_kwargs = dict(checkpoint_name="run.pt", checkpoint_frequency=30) if named else {}  # (none written)
    with pytest.raises(RuntimeError, match="a failure in epoch 2"):
        make_loop(factory, "mmap", storage_dir, overwrite=False).train(
            factory, num_epochs=2, batch_size=72, use_tqdm=False, callbacks=[Fail()], checkpoint_on_failure=True,
            checkpoint_directory=checkpoints, **named_kwargs,
        )  # fmt: skip
    (failure,) = checkpoints.glob("PyKEEN_just_saved_my_day*.pt")
    losses = make_loop(factory, "mmap", storage_dir, overwrite=False).train(
        factory, num_epochs=2, batch_size=72, use_tqdm=False, checkpoint_directory=checkpoints,
        checkpoint_name=failure.name,
    )  # fmt: skip
    assert losses and all(math.isfinite(loss) for loss in losses)


def test_resuming_with_another_storage_is_refused(nations, tmp_path) -> None:
    factory = factory_of(nations)
    train_with_checkpoints(make_loop(factory, "host", tmp_path), factory, 1, tmp_path)
    with pytest.raises(ValueError, match="storage='host'; resume it with the same storage"):
        train_with_checkpoints(make_loop(factory, "device", tmp_path), factory, 2, tmp_path)


def killed_run(dying: str) -> str:
    """Return a script that trains the mmap tier 2 epochs with checkpoints, after ``dying``'s patch kills it.

    The script's ``{tests}``, ``{storage}``, ``{checkpoints}`` (and ``dying``'s own fields) are filled by
    ``str.format``; ``dying`` replaces a method so that the process exits with ``os._exit(9)`` part way.
    """
    head = """
    import os, sys, pathlib
    sys.path.insert(0, {tests!r})
    from training.test_storage import factory_of, make_loop
    from pykeen.datasets import Nations
    from pykeen_bess.storage import MmapStorage
    """
    tail = """
    factory = factory_of(Nations())
    loop = make_loop(factory, "mmap", pathlib.Path({storage!r}))
    loop.train(factory, num_epochs=2, batch_size=72, use_tqdm=False, checkpoint_directory={checkpoints!r},
               checkpoint_name="run.pt", checkpoint_frequency=0)
    """
    return textwrap.dedent(head) + textwrap.dedent(dying) + textwrap.dedent(tail)


KILLED_CHECKPOINT = killed_run(
    """
    snapshot = MmapStorage.snapshot
    calls = []
    def dying_snapshot(self, tensor, directory):
        calls.append(1)
        if len(calls) > 3:  # in the second checkpoint, after copying its first file
            os._exit(9)
        return snapshot(self, tensor, directory)
    MmapStorage.snapshot = dying_snapshot
    """
)


@pytest.mark.slow
def test_a_kill_during_a_checkpoint_keeps_the_previous_one_loadable(nations, tmp_path) -> None:
    factory = factory_of(nations)
    (tmp_path / "full").mkdir()
    full = train(make_loop(factory, "mmap", tmp_path / "full"), factory)
    storage, checkpoints = tmp_path / "storage", tmp_path / "checkpoints"
    storage.mkdir()
    checkpoints.mkdir()
    script = KILLED_CHECKPOINT.format(
        tests=str(pathlib.Path(__file__).parents[1]), storage=str(storage), checkpoints=str(checkpoints)
    )
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert process.returncode == 9, process.stderr[-3000:]
    # the epoch-1 checkpoint is intact (the interrupted copy is not referenced by it); resuming continues identically
    loop = make_loop(factory, "mmap", storage)
    rest = train_with_checkpoints(loop, factory, 2, checkpoints)
    assert loop._epoch == 2
    assert len(rest) == len(full) // 2
    assert rest == full[len(full) - len(rest) :]


KILLED_WRITE_BACK = killed_run(
    """
    from pykeen_bess.training.steps import static_step
    from pykeen_bess.training.steps.static_update import StaticUpdate
    from capturable import allow_capturable_on_the_cpu

    forced = static_step.row_access
    static_step.row_access = lambda *args: forced(*args[:4], True, args[5])
    StaticUpdate.host_rules = False
    allow_capturable_on_the_cpu()
    write = MmapStorage.write
    calls = []
    def dying_write(self, tensor, rows, values):
        calls.append(1)
        if len(calls) > {writes}:  # a write-back of the second epoch, on the worker thread
            os._exit(9)
        return write(self, tensor, rows, values)
    MmapStorage.write = dying_write
    """
)


@pytest.mark.slow
def test_a_kill_during_a_staged_write_back_loses_nothing(nations, tmp_path, monkeypatch) -> None:
    """Staged rows (as on a GPU) written back to files by the worker: a kill -9 in the middle of an epoch's
    write-backs leaves the last checkpoint whole, and resuming from it trains as the run that was not killed."""
    from pykeen_bess.training.steps import static_step
    from pykeen_bess.training.steps.static_update import StaticUpdate

    forced = static_step.row_access
    monkeypatch.setattr(static_step, "row_access", lambda *args: forced(*args[:4], True, args[5]))
    monkeypatch.setattr(StaticUpdate, "host_rules", False)
    factory = factory_of(nations)
    (tmp_path / "full").mkdir()
    full = train(make_loop(factory, "mmap", tmp_path / "full"), factory)
    steps = len(full) // 2  # per epoch; a step writes the weights and Adam's two moments
    storage, checkpoints = tmp_path / "storage", tmp_path / "checkpoints"
    storage.mkdir()
    checkpoints.mkdir()
    script = KILLED_WRITE_BACK.format(
        tests=str(pathlib.Path(__file__).parents[1]),
        storage=str(storage),
        checkpoints=str(checkpoints),
        writes=3 * steps + 3 * (steps // 2),  # half way through the second epoch
    )
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert process.returncode == 9, process.stderr[-3000:]
    loop = make_loop(factory, "mmap", storage)
    rest = train_with_checkpoints(loop, factory, 2, checkpoints)
    assert loop._epoch == 2 and loop.static is not None and loop.static.rows_io.staged
    assert rest == full[len(full) - len(rest) :]


class _Usage:
    def __init__(self, free: int) -> None:
        self.free = free


def test_bad_storage_settings_fail_before_training(nations, tmp_path, monkeypatch) -> None:
    factory = factory_of(nations)
    with pytest.raises(ValueError, match="Unknown storage='disk'"):
        make_loop(factory, "disk", tmp_path)
    with pytest.raises(ValueError, match="pass storage_path"):
        make_storage("mmap")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        make_storage("mmap", tmp_path / "missing")
    with pytest.raises(ValueError, match="keeps no files"):
        make_storage("host", tmp_path)
    with pytest.raises(ValueError, match="needs row-sparse updates"):
        make_loop(factory, "host", tmp_path, sparse_updates=False)
    # files of an earlier run are not overwritten silently
    MmapStorage(tmp_path).place("table", (3, 2), torch.float32)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        MmapStorage(tmp_path).place("table", (3, 2), torch.float32)
    with pytest.raises(ValueError, match="overwrite must be True or False, not 'no'"):  # "no" overwrote
        MmapStorage(tmp_path, overwrite="no")
    with pytest.raises(TypeError, match="supports"):
        MmapStorage(tmp_path).place("other", (3, 2), torch.bfloat16)
    # not writable (os.access, which root always passes: its answer is simulated)
    monkeypatch.setattr(storage_files.os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match="not writable"):
        make_storage("mmap", tmp_path)
    monkeypatch.undo()
    # not enough disk, not enough host memory: refused with advice, before a table file exists
    monkeypatch.setattr(storage_files.shutil, "disk_usage", lambda path: _Usage(100))
    with pytest.raises(MemoryError, match="of disk.*rowwise_adagrad") as error:
        make_loop(factory, "mmap", tmp_path, overwrite=False)
    # small tables in a unit that shows them (not "0.00 GiB")
    assert re.search(r"need \d+\.\d\d KiB of disk .* has 100 B free", str(error.value)), str(error.value)
    # the files of an earlier run take room until training decides whether it resumes them: said so
    assert "of .npy files already there stay until training decides" in str(error.value)
    monkeypatch.setattr(storage_base, "available_host_memory", lambda: 1000)
    with pytest.raises(MemoryError, match="host memory.*storage='mmap'") as error:
        make_loop(factory, "host", tmp_path)
    assert "1000 B are available" in str(error.value) and "0.00 GiB" not in str(error.value)
    assert not list(tmp_path.glob("table0*"))


def test_byte_counts_are_shown_in_a_unit_they_fill() -> None:
    from pykeen_bess.storage import format_bytes

    assert format_bytes(100) == "100 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(5 * 2**30) == "5.00 GiB"


def test_memory_plan_states_bytes_per_entity(nations, tmp_path) -> None:
    factory = factory_of(nations)
    adam = make_loop(factory, "host", tmp_path, optimizer="adam").memory_plan
    rowwise = make_loop(factory, "host", tmp_path, optimizer="rowwise_adagrad").memory_plan
    assert (adam.row_bytes, adam.state_row_bytes) == (32, 64)
    assert (rowwise.row_bytes, rowwise.state_row_bytes) == (32, 4)
    assert rowwise.table_bytes == 15 * 32 and rowwise.bytes_per_entity == 36


RSS_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from pykeen.models import DistMult
    from pykeen.triples import CoreTriplesFactory
    from pykeen_bess.training import BessTrainingLoop

    num_entities, dimension = 300_000, int(sys.argv[1])
    generator = torch.Generator().manual_seed(0)
    triples = torch.stack([torch.randint(num_entities, (2000,), generator=generator),
                           torch.randint(5, (2000,), generator=generator),
                           torch.randint(num_entities, (2000,), generator=generator)], dim=1)
    factory = CoreTriplesFactory.create(triples, num_entities=num_entities, num_relations=5)
    model = DistMult(triples_factory=factory, embedding_dim=dimension, random_seed=0, regularizer=None)
    loop = BessTrainingLoop(model=model, triples_factory=factory, num_shards=2, storage="mmap",
                            storage_path=sys.argv[2], optimizer="rowwise_adagrad", automatic_memory_optimization=False)
    loop.train(factory, num_epochs=1, batch_size=500, use_tqdm=False)
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            print(int(line.split()[1]) * 1024)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_mmap_anonymous_memory_does_not_grow_with_the_table(tmp_path) -> None:
    """Tables 10x apart (300k entities, 32 or 320 dimensions): the anonymous memory after training is the same.

    (What does grow with the number of entities are the sharding's index tensors, a few int64 per entity.)
    """
    from forked_programs import run_chains

    anonymous = {}
    dimensions = (32, 320)
    for dimension in dimensions:
        (tmp_path / str(dimension)).mkdir()
    # two processes alike but for the table (children of one interpreter that has imported PyKEEN), side by side
    chains = [[dict(code=RSS_SCRIPT, argv=[str(d), str(tmp_path / str(d))])] for d in dimensions]
    for dimension, (outcome,) in zip(dimensions, run_chains(chains, preload="plugin")):
        assert outcome["status"] == 0, outcome["stderr"][-3000:]
        anonymous[dimension] = int(outcome["stdout"].split()[-1])
    table_growth = 300_000 * (320 - 32) * 4  # 346 MB more table
    # a table in anonymous memory would add all of it; two processes alike differ by up to ~20 MB on a busy machine
    assert anonymous[320] - anonymous[32] < 0.25 * table_growth, anonymous


def test_large_stored_tables_are_initialised_chunk_by_chunk(nations, tmp_path, monkeypatch) -> None:
    """Above the full-draw limit host and file tables are drawn per chunk of rows: deterministic, tiers alike."""
    import pykeen_bess.tables.representation as representation

    monkeypatch.setattr(representation, "FULL_DRAW_BYTES", 0)
    monkeypatch.setattr(representation, "INITIALIZATION_CHUNK_ROWS", 2)
    factory = factory_of(nations)
    tables = {}
    for tier in ("host", "mmap"):
        loop = make_loop(factory, tier, tmp_path, num_shards=3)
        table = loop.tables[0]
        drawn: list[tuple[int, ...]] = []

        def initializer(x: torch.Tensor, drawn: list = drawn) -> torch.Tensor:
            drawn.append(tuple(x.shape))
            return x.normal_()

        monkeypatch.setattr(table, "initializer", initializer)
        table.reset_parameters()
        assert drawn == [(2, 8), (2, 8), (1, 8)] * 3  # 3 shards of 5 rows in chunks of 2: never the full table
        tables[tier] = table.weight.clone()
        padding = table.sharding.shard_entities.view(-1) < 0
        assert bool((tables[tier][padding] == 0).all()) and bool((tables[tier][~padding] != 0).all())
        # the same values again (seeded by the run's seed, the table, the shard and the chunk)
        table.reset_parameters()
        assert torch.equal(table.weight, tables[tier])
    assert torch.equal(tables["host"], tables["mmap"])


def test_a_model_built_on_the_meta_device_trains_with_stored_tables(nations, tmp_path) -> None:
    """PyKEEN's constructor allocates no full table on the meta device; host and file tiers allocate the shards."""
    from pykeen.models import ERModel, model_resolver
    from pykeen.nn.representation import LowRankRepresentation

    from pykeen_bess.training import UnsupportedModelError

    factory = factory_of(nations)
    losses = {}
    for tier in TIERS:
        with torch.device("meta"):
            model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0, regularizer=None)
        storage = dict(storage_path=tmp_path, storage_kwargs=dict(overwrite=True)) if tier == "mmap" else {}
        if tier == "device":
            with pytest.raises(ValueError, match="storage='host' or storage='mmap'"):
                BessTrainingLoop(model=model, triples_factory=factory, storage=tier)
            continue
        loop = BessTrainingLoop(
            model=model,
            triples_factory=factory,
            storage=tier,
            device="cpu",  # where the parameters but the entity tables are materialised (default: the CPU)
            num_shards=3,
            num_negs_per_pos=6,
            seed=3,
            sharding="random",  # with negatives="block": the plan whose first and last step losses are compared
            negatives="block",
            **storage,
        )
        assert loop.tables[0].weight.shape[0] == 15  # the shard tables
        assert model.entity_representations[0]._embeddings.weight.shape[0] == 0  # no full table
        initial = loop.tables[0].weight.detach().clone()
        losses[tier] = train(loop, factory)
        assert all(not p.is_meta for p in model.parameters())
        # every row some step touched has moved (the tables were trained, not only allocated)
        moved = (loop.tables[0].weight != initial).any(dim=1)
        assert int(moved.sum()) >= factory.num_entities - 3  # all but (at most) one padding row per shard
    assert losses["host"] == losses["mmap"] and all(math.isfinite(x) for x in losses["host"])
    assert losses["host"][-1] < losses["host"][0]
    with torch.device("meta"):
        model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)  # a regularizer with a weight
    with pytest.raises(ValueError, match="buffers"):
        BessTrainingLoop(model=model, triples_factory=factory, storage="host")
    with torch.device("meta"):  # CrossE's bias is set by its constructor only: it would train from garbage
        model = model_resolver.make("CrossE", triples_factory=factory, embedding_dim=8, random_seed=0)
    with pytest.raises(ValueError, match=r"reset does not initialise \['interaction.bias'\]"):
        BessTrainingLoop(model=model, triples_factory=factory, storage="host")
    with torch.device("meta"):  # an entity representation BESS cannot shard: refused as such (not as uninitialised)
        model = ERModel(
            triples_factory=factory, interaction="DistMult", entity_representations=LowRankRepresentation,
            entity_representations_kwargs=dict(shape=4, num_bases=3), relation_representations_kwargs=dict(shape=4),
        )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="LowRankRepresentation is not a plain"):
        BessTrainingLoop(model=model, triples_factory=factory, storage="host")
    built = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)  # on the CPU: computes there
    with pytest.raises(ValueError, match="meta device"):
        BessTrainingLoop(model=built, triples_factory=factory, storage="host", device="cuda")
    assert BessTrainingLoop(model=built, triples_factory=factory, storage="host", device="cpu").model is built


def test_the_memory_search_runs_with_stored_tables(nations, tmp_path) -> None:
    factory = factory_of(nations)
    loop = make_loop(factory, "mmap", tmp_path, memory_budget=2**30)
    loop.automatic_memory_optimization = True
    losses = loop.train(factory, num_epochs=2, batch_size=None, use_tqdm=False)
    assert len(losses) == 2 and all(loss > 0 for loss in losses)


def test_pickles_of_earlier_module_paths_still_load() -> None:
    """A model saved with tables in host memory names its state-dict hooks and tier by module: older names load."""
    import pickle

    from pykeen_bess.storage import HostStorage
    from pykeen_bess.storage.state_dict import add_stored_table, load_stored_table

    for obj, old in [
        (add_stored_table, b"pykeen_bess.stored_tables"),
        (load_stored_table, b"pykeen_bess.stored_tables"),
        (HostStorage, b"pykeen_bess.storage"),
    ]:
        data = pickle.dumps(obj, protocol=2)
        module = obj.__module__.encode()
        assert module in data
        assert pickle.loads(data.replace(module + b"\n", old + b"\n")) is obj


def test_a_tier_restores_a_tensor_from_a_checkpoints_file(tmp_path) -> None:
    """Every tier fills a tensor from a ``.npy`` copy chunk by chunk, after checking its shape and dtype."""
    import numpy as np

    from pykeen_bess.storage import HostStorage

    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save(tmp_path / "rows.npy", values)
    tier = HostStorage()
    tensor = tier.place("t", (4, 3), torch.float32)
    tier.restore(tensor, tmp_path / "rows.npy")
    assert torch.equal(tensor, torch.from_numpy(values))
    with pytest.raises(ValueError, match="expected"):
        tier.restore(tier.place("u", (3, 3), torch.float32), tmp_path / "rows.npy")
    with pytest.raises(FileNotFoundError):
        tier.restore(tensor, tmp_path / "missing.npy")


@pytest.mark.parametrize("tier", ["host", "mmap"])
def test_early_stopping_restores_the_best_epoch_of_every_tier(nations, tmp_path, tier, staged) -> None:
    """PyKEEN's stopper keeps the best epoch's state dict: tables in files go in by value, not as the live files.

    Also with the rows staged around every step: the tiers hold every step's rows when the stopper evaluates
    (staged, the replicated parameters run torch's capturable Adam, equal to the plain one to rounding: float64).
    """
    from pykeen.stoppers import EarlyStopper

    factory = factory_of(nations)
    models = {}
    with default_dtype(torch.float64 if staged[0] else torch.get_default_dtype()):
        for name in ("device", tier):
            loop = make_loop(factory, name, tmp_path, num_shards=1)
            stopper = EarlyStopper(
                model=loop.model,
                evaluator=BessEvaluator(),
                training_triples_factory=factory,
                evaluation_triples_factory=nations.validation,
                frequency=1,
                patience=1,
                metric="inverse_harmonic_mean_rank",
                use_tqdm=False,
            )
            loop.train(factory, num_epochs=12, batch_size=72, use_tqdm=False, stopper=stopper)
            assert stopper.stopped and stopper.best_epoch < len(stopper.results)  # an earlier epoch is restored
            models[name] = loop.model.entity_representations[0](torch.arange(factory.num_entities)).detach().clone()
    torch.testing.assert_close(models[tier], models["device"], rtol=1e-6, atol=1e-7)
    wanted, made = staged
    assert made == ([True] if wanted else [])
    # the stopper's temporary copies are no checkpoints of the run: its files stay unmarked
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".checkpoint")]


@pytest.mark.parametrize("tier", ["device", "host", "mmap"])
def test_a_read_into_a_buffer_equals_a_fresh_read(tier: str, tmp_path: pathlib.Path) -> None:
    """``read(out=...)`` (the static step's reused buffers on the CPU) reads the same rows and counts the same bytes."""
    storage = make_storage(tier, tmp_path if tier == "mmap" else None)
    table = storage.place("table", (10, 3), torch.float32)
    table.copy_(torch.arange(30, dtype=torch.float32).view(10, 3))
    rows = torch.tensor([7, 2, 2, 9])
    fresh = storage.read(table, rows)
    read_bytes = storage.traffic.bytes_read
    buffer = torch.full((6, 3), -1.0)
    values = storage.read(table, rows, out=buffer[:4])
    assert torch.equal(values, fresh) and torch.equal(buffer[:4], fresh)
    assert values.data_ptr() == buffer.data_ptr()  # into the buffer, no new tensor
    assert torch.equal(buffer[4:], torch.full((2, 3), -1.0))
    assert storage.traffic.bytes_read == 2 * read_bytes


def _random_graph(num_entities: int, num_triples: int) -> CoreTriplesFactory:
    generator = torch.Generator().manual_seed(0)
    heads, tails = (torch.randint(num_entities, (num_triples,), generator=generator) for _ in range(2))
    relations = torch.randint(4, (num_triples,), generator=generator)
    triples = torch.stack([heads, relations, tails], dim=1)
    return CoreTriplesFactory.create(mapped_triples=triples, num_entities=num_entities, num_relations=4)


@pytest.mark.parametrize("tier", ["host", "mmap"])
def test_staged_tables_larger_than_the_memory_budget_train(tmp_path, tier, monkeypatch, caplog) -> None:
    """Tables (with Adam's state) twice the memory budget train staged, the device holding less than the budget.

    The budget decides the staging depth: two device buffer sets where they fit with room for the forwarded
    rows, one where only that fits, and an error before any step where not even that does.
    """
    from pykeen_bess.training.steps import static_step
    from pykeen_bess.training.setup.sizes import resident_bytes
    from pykeen_bess.training.steps.static_update import StaticUpdate

    forced = static_step.row_access
    monkeypatch.setattr(static_step, "row_access", lambda *args: forced(*args[:4], True, *args[5:]))
    monkeypatch.setattr(StaticUpdate, "host_rules", False)
    factory = _random_graph(20_000, 3_000)
    table_bytes = 3 * 20_000 * 8 * 4  # the weights and Adam's two moments (float32, d=8)
    depths = {}
    for name, budget in {"two sets": table_bytes // 2, "one set": None, "none": 1_000}.items():
        if budget is None:  # room for the buffer set and the forwarded rows only
            budget = 2 * depths["set_bytes"] + 3 * depths["resident"] + 64
        (tmp_path / name).mkdir()
        loop = make_loop(factory, tier, tmp_path / name, num_shards=2, memory_budget=budget)
        if name == "none":
            with pytest.raises(MemoryError, match="Staging a step's rows takes"):
                loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
            continue
        with caplog.at_level(logging.INFO, logger="pykeen_bess"):
            loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
        staged = loop.static.rows_io
        assert f"({staged.depth} set(s) of" in caplog.text  # the log's memory plan states the depth
        assert staged.staged and budget < table_bytes
        resident = resident_bytes(loop.model, torch.device("cpu")) // 3
        on_device = [*staged._device, *staged._incoming, staged.slots, staged._incoming_indices]
        held = sum(tensor.numel() * tensor.element_size() for tensor in on_device)
        assert held <= staged.buffer_bytes()[0] and held + 3 * resident <= budget
        depths[name] = staged.depth
        depths["set_bytes"], depths["resident"] = staged.set_bytes(), resident
    assert depths["two sets"] == 2 and depths["one set"] == 1


class _Event:
    """A stand-in for ``torch.cuda.Event``: it must be recorded before anything waits for it."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.recorded = log, False

    def record(self, stream: Any = None) -> None:
        self.recorded = True
        self.log.append(f"record on {getattr(stream, 'name', 'the current stream')}")

    def synchronize(self) -> None:
        assert self.recorded, "a thread waits for an event never recorded"
        self.log.append("host waits")


class _Stream:
    """A stand-in for ``torch.cuda.Stream``."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: _Event) -> None:
        assert event.recorded, "a stream waits for an event never recorded"
        self.log.append(f"{self.name} waits")


@pytest.mark.parametrize("free", [8 * 2**30, 300 * 2**10], ids=["two-sets", "one-set"])
def test_the_staging_of_a_gpu_runs_with_its_streams_and_events(nations, tmp_path, monkeypatch, free: int) -> None:
    """The CUDA-only part of staging (pinned buffers, side stream, events), its CUDA calls replaced by stand-ins.

    The copies are synchronous on the CPU, so this checks the calls' order (every wait after its record) and
    that the staged run equals the device tier's, at both depths (the free memory decides).
    """
    from pykeen_bess.storage import staging
    from pykeen_bess.training.steps import static_step
    from pykeen_bess.training.steps.static_update import StaticUpdate

    log: list[str] = []
    main = _Stream(log, "the main stream")
    monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(log))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream(log, "the side stream"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 16 * 2**30))
    empty = torch.empty
    monkeypatch.setattr(staging.torch, "empty", lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs))
    made = staging.StagedRows.__init__

    def as_on_a_gpu(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self._cuda = True  # pinned buffers, the side stream and events, as on CUDA

    monkeypatch.setattr(staging.StagedRows, "__init__", as_on_a_gpu)
    forced = static_step.row_access
    monkeypatch.setattr(static_step, "row_access", lambda *args: forced(*args[:4], None, *args[5:]))
    monkeypatch.setattr(StaticUpdate, "host_rules", False)
    factory = factory_of(nations)
    with default_dtype(torch.float64):
        device_losses = train(make_loop(factory, "device", tmp_path), factory)
        monkeypatch.setattr(static_step, "row_access", lambda *args: forced(*args[:4], True, *args[5:]))
        loop = make_loop(factory, "host", tmp_path)
        losses = train(loop, factory)
    staged = loop.static.rows_io
    assert staged.staged and staged.depth == (2 if free > 2**20 else 1)
    assert losses == pytest.approx(device_losses, rel=1e-12)
    side = [entry for entry in log if "side stream" in entry]
    assert bool(side) == (staged.depth == 2)  # the incoming copies run on the side stream at depth 2 only
    assert "host waits" in log


def test_a_second_process_cannot_take_the_table_files_of_a_running_one(tmp_path: pathlib.Path) -> None:
    """The same checkpointed mmap command started twice: the second is refused before touching the files.

    Resuming would move its new files over the names the running process maps and snapshots into its
    checkpoints (they then held the second process's tables, with matching digests).
    """
    import subprocess
    import sys

    from pykeen_bess.storage import MmapStorage

    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, torch; from pykeen_bess.storage import MmapStorage; "
            f"table = MmapStorage({str(tmp_path)!r}).place('table0', (4, 2), torch.float32); "
            "print('ready', flush=True); "
            "sys.stdin.read()"
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(RuntimeError, match=r"table0\.npy is in use by another process"):
            MmapStorage(tmp_path, overwrite=True).place("table0", (4, 2), torch.float32)
        MmapStorage(tmp_path).place("table1", (4, 2), torch.float32)  # other tables are free
    finally:
        holder.kill()
        holder.wait()
    MmapStorage(tmp_path, overwrite=True).place("table0", (4, 2), torch.float32)  # the lock went with the process


def test_a_second_model_in_this_process_cannot_take_the_table_files_of_a_live_one(nations, tmp_path) -> None:
    """Two runs with one storage_path in a notebook: the second rewrote the first model's rows (or shrank its files,
    which killed the process with SIGBUS); only another process was refused. Unreachable models do not count."""
    import gc

    factory = factory_of(nations)
    first = make_loop(factory, "mmap", tmp_path)
    train(first, factory)
    rows = first.model.entity_representations[0](indices=None).detach().clone()
    with pytest.raises(RuntimeError, match="in use by another model's tables in this process"):
        make_loop(factory, "mmap", tmp_path)  # (the loop places the tables)
    torch.testing.assert_close(first.model.entity_representations[0](indices=None).detach(), rows, rtol=0, atol=0)
    del first
    gc.collect()
    train(make_loop(factory, "mmap", tmp_path), factory)  # the first model is gone: its files are free


def test_table_files_are_let_go_with_their_model(tmp_path) -> None:
    """Every table file kept an open descriptor to the end of the process: removed files kept their disk blocks."""
    import gc
    import os

    from pykeen_bess.storage import MmapStorage
    from pykeen_bess.storage import files

    def descriptors_of_removed_files() -> list[str]:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # (the listing's own descriptor)
                pass
        return [link for link in links if str(tmp_path) in link and link.endswith("(deleted)")]

    storage = MmapStorage(tmp_path)
    tables = [storage.place(f"table{i}", (4, 2), torch.float32) for i in range(2)]
    view = tables[0][1:]  # a view keeps its file mapped
    del storage, tables
    gc.collect()
    assert [key for key in files._HELD if str(tmp_path) in key] == [str(tmp_path / "table0.npy")]
    del view
    gc.collect()
    assert not [key for key in files._HELD if str(tmp_path) in key]
    for file in tmp_path.iterdir():
        file.unlink()
    if pathlib.Path("/proc/self/fd").is_dir():
        assert descriptors_of_removed_files() == []
    MmapStorage(tmp_path).place("table0", (4, 2), torch.float32)  # placed anew


def test_a_resumed_file_is_locked_while_its_own_arrays_map_it(tmp_path) -> None:
    """A resumed run's new file took over the lock record with the replaced file's arrays: its lock outlived every
    array mapping it, and a later overwrite=True run was refused as if it rewrote the first model's rows."""
    import gc

    from pykeen_bess.storage import MmapStorage
    from pykeen_bess.storage import files

    run = MmapStorage(tmp_path)
    first = run.place("t", (4, 2), torch.float32)  # kept: it maps the replaced file
    run.claim_existing(resuming=False, checkpoint=tmp_path / "run.pt")  # a run of that checkpoint
    storage = MmapStorage(tmp_path)
    storage.defer_existing_files()
    second = storage.place("t", (4, 2), torch.float32)
    storage.claim_existing(resuming=True, checkpoint=tmp_path / "run.pt")  # its file under the name
    assert len(files._HELD[str(tmp_path / "t.npy")].arrays) == 1
    del second, storage
    gc.collect()
    assert str(tmp_path / "t.npy") not in files._HELD
    MmapStorage(tmp_path, overwrite=True).place("t", (4, 2), torch.float32)
    assert first.shape == (4, 2)
