"""The static step (one fixed-shape function per step, captured as a CUDA graph on a GPU) against the eager step.

Every test here runs on the CPU: the static step runs uncaptured there (the default wherever it
applies), and it is the same function a CUDA graph captures. What a GPU adds (the capture itself) is
checked by ``benchmarks/gpu.py``, which compares the captured step's losses with the eager step's.
Process groups and replicas on the static step are compared with one process in
``tests/distributed``; their steps' operators are counted there too.
"""

from __future__ import annotations

import logging
import pathlib

import pytest
import torch
from capturable import default_dtype
from host_reads import DeviceOps, static_step_sources
from typed_graphs import typed_graph
from pykeen.datasets import Nations
from pykeen.models import ComplEx, DistMult, ERModel, RotatE, TransE
from pykeen.training import TrainingCallback
from pykeen.training.training_loop import NonFiniteLossError
from pykeen.triples.weights import RelationLossWeighter
from pykeen.triples import CoreTriplesFactory

from pykeen_bess.training import BessTrainingLoop
from pykeen_bess.training.steps.static_step import StaticStep
from pykeen_bess.training.steps.static_rules import occurrence_groups
from pykeen_bess.training.steps.static_update import Clipping, StaticUpdate


@pytest.fixture(scope="module")
def factory() -> CoreTriplesFactory:
    return Nations().training


def dropout_model(triples_factory: CoreTriplesFactory, embedding_dim: int, random_seed: int, **kwargs) -> ERModel:
    """DistMult with dropout on its entity rows (PyKEEN's Embedding option)."""
    return ERModel(
        triples_factory=triples_factory,
        interaction="distmult",
        entity_representations_kwargs=dict(shape=embedding_dim, dropout=0.2),
        relation_representations_kwargs=dict(shape=embedding_dim),
        random_seed=random_seed,
        **kwargs,
    )


def make_loop(factory: CoreTriplesFactory, model_cls=DistMult, static_step=True, model_kwargs=None, **kwargs):
    model_kwargs = dict(embedding_dim=8, **(model_kwargs or {}))
    if "loss" in kwargs:  # a model's argument
        model_kwargs["loss"] = kwargs.pop("loss")
    model = model_cls(triples_factory=factory, random_seed=0, **model_kwargs).double()
    kwargs.setdefault("automatic_memory_optimization", False)
    kwargs.setdefault("num_negs_per_pos", 8)
    return BessTrainingLoop(model=model, triples_factory=factory, static_step=static_step, **kwargs)


class StepLosses(TrainingCallback):
    """A per-step callback: records every step's loss (and the step it came from)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.steps: list[tuple[int, int]] = []
        self.calls: list[str] = []

    def pre_batch(self, **kwargs) -> None:
        self.calls.append("pre_batch")

    def on_batch(self, epoch: int, batch, batch_loss: float, **kwargs) -> None:
        self.losses.append(batch_loss)
        self.steps.append((epoch, batch.step))
        self.calls.append("on_batch")

    def post_batch(self, epoch: int, batch, **kwargs) -> None:
        self.calls.append("post_batch")


def train(factory: CoreTriplesFactory, static_step: bool, epochs: int = 3, train_kwargs=None, batch_size=64, **kwargs):
    loop = make_loop(factory, static_step=static_step, **kwargs)
    torch.manual_seed(1)  # dropout draws from the global generator
    losses = loop.train(factory, num_epochs=epochs, batch_size=batch_size, use_tqdm=False, **(train_kwargs or {}))
    parameters = [p.detach().clone() for p in loop.model.parameters()]
    return loop, losses, parameters


CASES = [
    dict(num_shards=1),
    dict(num_shards=2),
    dict(num_shards=4),
    dict(num_shards=2, exchange="score"),
    dict(num_shards=4, negatives="step"),
    dict(num_shards=4, negatives="block", exchange="score"),
    dict(num_shards=2, optimizer="adagrad", optimizer_kwargs=dict(lr=0.1, lr_decay=0.01)),
    dict(num_shards=2, optimizer="sgd", optimizer_kwargs=dict(lr=0.5)),
    dict(num_shards=2, optimizer="rowwise_adagrad"),
    dict(num_shards=2, model_kwargs=dict(regularizer=None)),
    dict(num_shards=2, model_cls=TransE),
    dict(num_shards=2, model_cls=RotatE),
    dict(num_shards=2, model_cls=ComplEx, loss="crossentropy"),
    dict(num_shards=2, loss="nssa"),
    dict(num_shards=2, loss="marginranking"),
    dict(num_shards=2, loss="bcewithlogits", train_kwargs=dict(label_smoothing=0.1)),
    # every step of an epoch full (1592 triples, 8 per step): no padded step kind
    dict(num_shards=1, batch_size=8, epochs=1),
    # what the static step used to leave to the eager step
    dict(num_shards=2, train_kwargs=dict(sub_batch_size=16)),
    dict(num_shards=2, model_cls=ComplEx, train_kwargs=dict(sub_batch_size=8)),
    dict(num_shards=2, train_kwargs=dict(gradient_clipping_max_norm=0.05)),
    dict(num_shards=4, train_kwargs=dict(gradient_clipping_max_norm=0.01, gradient_clipping_norm_type=float("inf"))),
    dict(num_shards=2, train_kwargs=dict(gradient_clipping_max_abs_value=0.001)),
    dict(num_shards=4, negatives="block", model_cls=TransE, train_kwargs=dict(sub_batch_size=16)),
    dict(num_shards=2, model_cls=dropout_model),
    dict(num_shards=2, loss="weightednssa", loss_weighter="subsampling"),
    dict(num_shards=2, loss="softplus", loss_weighter="relation"),
    dict(num_shards=2, train_kwargs=dict(callbacks="per_step")),
    dict(num_shards=2, storage="host"),
    # the encoding partition (column parts, partial scores summed)
    dict(num_shards=2, exchange="encoding"),
    dict(num_shards=4, exchange="encoding", model_cls=ComplEx, train_kwargs=dict(sub_batch_size=16)),
    dict(num_shards=2, exchange="encoding", model_cls=TransE, optimizer="rowwise_adagrad"),
    dict(num_shards=4, storage="host", optimizer="rowwise_adagrad", train_kwargs=dict(sub_batch_size=16)),
    # dense updates: the user's optimizer itself updates the tables (any class, any option)
    dict(num_shards=2, sparse_updates=False),
    dict(num_shards=4, model_cls=TransE, optimizer="sgd", optimizer_kwargs=dict(momentum=0.9), sparse_updates=False),
    dict(num_shards=2, optimizer="adamw", sparse_updates=False, train_kwargs=dict(gradient_clipping_max_norm=0.05)),
    dict(num_shards=2, exchange="encoding", optimizer="rowwise_adagrad", sparse_updates=False),
    # whole rows looked up (in one process the rows are whole already)
    dict(num_shards=2, exchange="encoding_lookup", model_cls=TransE),
]


def _case_id(case: dict) -> str:
    return ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in case.items())


@pytest.mark.parametrize("case", [*CASES, "mmap"], ids=lambda case: "mmap" if case == "mmap" else _case_id(case))
def test_static_step_equals_the_eager_step(factory: CoreTriplesFactory, case: dict | str, tmp_path) -> None:
    """Losses (of every epoch, and of every step where a callback asks) and parameters equal the eager loop's."""
    if case == "mmap":  # tables and row state in memory-mapped files, one directory per run
        case = dict(num_shards=2, storage="mmap", storage_kwargs=dict(overwrite=True))
    case = dict(case)
    train_kwargs = dict(case.pop("train_kwargs", {}))
    epochs, batch_size = case.pop("epochs", 3), case.pop("batch_size", 64)
    if case.get("loss_weighter") == "relation":  # PyKEEN's RelationLossWeighter: one weight per relation
        case["loss_weighter"] = RelationLossWeighter(weights=torch.linspace(0.5, 2.0, factory.num_relations))
    results = []
    for static_step in (False, True):
        if case.get("storage") == "mmap":
            case["storage_path"] = tmp_path / f"static-{static_step}"
            case["storage_path"].mkdir()
        kwargs = dict(train_kwargs)
        if kwargs.get("callbacks") == "per_step":
            kwargs["callbacks"] = StepLosses()
        loop, losses, parameters = train(
            factory, static_step=static_step, train_kwargs=kwargs, epochs=epochs, batch_size=batch_size, **case
        )
        assert (loop.static is not None) == static_step
        results.append((losses, parameters, kwargs.get("callbacks")))
    (eager, eager_parameters, eager_steps), (static, static_parameters, static_steps) = results
    assert static == pytest.approx(eager, rel=1e-9)
    for actual, expected in zip(static_parameters, eager_parameters):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-9)
    if static_steps is not None:  # the per-step callback saw every step's loss, in order
        assert static_steps.losses == pytest.approx(eager_steps.losses, rel=1e-9)
        assert static_steps.steps == eager_steps.steps
        assert static_steps.calls == eager_steps.calls


#: cases also run with the device path on the CPU (what a GPU runs: sums per occurrence, device-tensor rules, gates)
DEVICE_PATH_CASES = [
    dict(num_shards=2),
    dict(num_shards=4, negatives="block", exchange="score"),
    dict(num_shards=2, optimizer="adagrad", optimizer_kwargs=dict(lr=0.1, lr_decay=0.01)),
    dict(num_shards=2, optimizer="sgd", optimizer_kwargs=dict(lr=0.5)),
    dict(num_shards=2, optimizer="rowwise_adagrad"),
    dict(num_shards=2, model_cls=TransE),
    dict(num_shards=2, model_cls=ComplEx, train_kwargs=dict(sub_batch_size=8)),
    dict(num_shards=4, train_kwargs=dict(gradient_clipping_max_norm=0.01, gradient_clipping_norm_type=float("inf"))),
    dict(num_shards=2, train_kwargs=dict(gradient_clipping_max_abs_value=0.001)),
    dict(num_shards=2, storage="host"),
    dict(num_shards=2, exchange="encoding"),
    dict(num_shards=4, model_cls=TransE, sparse_updates=False),
    dict(num_shards=2, optimizer="adam", optimizer_kwargs=dict(amsgrad=True, weight_decay=0.01), sparse_updates=False),
    dict(num_shards=2, optimizer="adamw", sparse_updates=False, train_kwargs=dict(gradient_clipping_max_norm=0.05)),
    # no capturable form: the user's optimizer after a host read (a GPU runs it uncaptured)
    dict(num_shards=2, optimizer="sgd", optimizer_kwargs=dict(momentum=0.9), sparse_updates=False),
]


@pytest.mark.parametrize("case", DEVICE_PATH_CASES, ids=_case_id)
def test_the_device_path_equals_the_eager_step(
    factory: CoreTriplesFactory, case: dict, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """The updates a GPU runs (every occurrence with its row's sum, device-tensor rules, gates), forced on the CPU.

    The replicated parameters of Adam (and the tables updated densely by Adam) run torch's capturable Adam
    there, whose bias correction is computed in the step count's dtype (the plain form's in Python floats):
    in float64 the two agree to its rounding.
    """
    monkeypatch.setattr(StaticUpdate, "host_rules", False)
    capturable = case.get("optimizer", "adam") in ("adam", "adamw")
    with default_dtype(torch.float64 if capturable else torch.get_default_dtype()):
        test_static_step_equals_the_eager_step(factory, case, tmp_path)


#: typed negatives (PyTorch-BigGraph's data model) with PyKEEN's default regularizers (DistMult: L2 of the
#: relations; ComplEx: of both) and one that groups its rows by weight (L3)
TYPED_CASES = [
    dict(num_shards=2, negatives="typed"),
    dict(num_shards=2, negatives="typed_step", exchange="score"),
    dict(num_shards=1, negatives="typed_step", model_cls=ComplEx),
    dict(num_shards=2, negatives="typed_step", model_kwargs=dict(regularizer="lp", regularizer_kwargs=dict(p=3.0))),
]


@pytest.mark.parametrize("host_rules", [True, False], ids=["cpu-updates", "device-updates"])
@pytest.mark.parametrize("case", TYPED_CASES, ids=str)
def test_typed_negatives_with_a_regularizer_equal_the_eager_step(
    case: dict, host_rules: bool, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """Every step weighs its rows by its own candidate types (computed on the device), as the eager step does.

    A GPU's updates run torch's capturable Adam, equal to the plain one to rounding: compared in float64.
    """
    monkeypatch.setattr(StaticUpdate, "host_rules", host_rules)
    with default_dtype(torch.float64 if not host_rules else torch.get_default_dtype()):
        test_static_step_equals_the_eager_step(typed_graph().training, case, tmp_path)


def test_typed_negatives_with_a_grouping_regularizer_run_uncaptured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only L2 keeps a typed step's weights on the device; another regularizer groups them on the host."""
    monkeypatch.setattr(StaticUpdate, "host_rules", False)  # a GPU's updates
    graph = typed_graph().training
    obstacles = []
    for regularizer_kwargs in (dict(p=2.0), dict(p=3.0)):
        model_kwargs = dict(regularizer="lp", regularizer_kwargs=regularizer_kwargs)
        loop = make_loop(graph, num_shards=2, negatives="typed_step", static_step=None, model_kwargs=model_kwargs)
        loop.train(graph, num_epochs=1, batch_size=32, use_tqdm=False)
        obstacles.append(loop.static.capture_obstacle)
    assert obstacles[0] is None  # L2: the weights stay on the device
    assert obstacles[1] is not None and "regularizer other than L2" in obstacles[1]


def test_every_step_runs_as_the_static_step(factory: CoreTriplesFactory, caplog: pytest.LogCaptureFixture) -> None:
    """The padded steps at the end of an epoch are step kinds of their own, not eager steps."""
    loop = make_loop(factory, num_shards=2, static_step=None)
    sampler = loop.make_sampler(loop.partition(factory), 16)
    assert 0 < sampler.full_steps < len(sampler)
    with caplog.at_level(logging.INFO, logger="pykeen_bess"):
        loop.train(factory, num_epochs=2, batch_size=64, use_tqdm=False)
    padded = len(sampler) - sampler.full_steps
    assert f"the static step trains all {len(sampler)} steps per epoch ({padded} with padding" in caplog.text
    assert loop.static is not None and len(loop.static.plan.kinds) == 1 + padded
    runs = loop.static.executor.runs
    assert [runs[kind.index] for kind in loop.static.plan.kinds] == [2 * sampler.full_steps] + [2] * padded


def test_occurrence_groups_number_the_distinct_rows() -> None:
    rows = torch.tensor([7, 3, 7, 0, 3, 3, 9])
    group, first = occurrence_groups(rows)
    assert group.tolist() == [2, 1, 2, 0, 1, 1, 3]
    assert first.tolist() == [True, True, False, True, False, False, True]


def test_static_step_resumes_from_a_checkpoint_identically(factory: CoreTriplesFactory, tmp_path: pathlib.Path) -> None:
    """The optimizer's step counts are handed back to its state, so a checkpoint resumes the same run."""

    def run(num_epochs: int, name: str):
        loop = make_loop(factory, num_shards=2)
        losses = loop.train(
            factory,
            num_epochs=num_epochs,
            batch_size=64,
            use_tqdm=False,
            checkpoint_directory=tmp_path,
            checkpoint_name=name,
            checkpoint_frequency=0,
        )
        return losses, loop.model.entity_representations[0]._embeddings.weight.detach().clone()

    uninterrupted, weights = run(4, "full.pt")
    run(2, "resumed.pt")
    resumed, resumed_weights = run(4, "resumed.pt")
    assert resumed == pytest.approx(uninterrupted, rel=1e-12)
    torch.testing.assert_close(resumed_weights, weights)
    loop = make_loop(factory, num_shards=2)
    steps_per_epoch = len(loop.make_sampler(loop.partition(factory), 16))
    state = torch.load(tmp_path / "full.pt", weights_only=False)["optimizer_state_dict"]["state"]
    assert {float(entry["step"]) for entry in state.values()} == {4.0 * steps_per_epoch}


def _static_step(loop: BessTrainingLoop, factory: CoreTriplesFactory, block_size: int, **kwargs) -> StaticStep:
    """A static step of a trained loop (its tables installed by the caller)."""
    sampler = loop.make_sampler(loop.partition(factory), block_size)
    return StaticStep(loop.runner, loop.tables, loop.optimizer, loop.model, sampler, 0.0, capture=False, **kwargs)


def test_the_cpu_updates_reuse_their_buffers(factory: CoreTriplesFactory) -> None:
    """The CPU's updates of the distinct rows read into the same buffers every step (no fresh pages to map)."""
    loop = make_loop(factory, num_shards=2)
    loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
    with loop.tables.installed(copy_weights=True):
        static = _static_step(loop, factory, 16)
        assert static.update.on_the_host
        static.load_epoch(2)
        static.run(1)
        buffers = static.update.host_rows._buffers
        # the summed gradients, the rows' values and Adam's two moments of the one trainable table
        assert set(buffers) == {("summed", 0), ("old", 0), ("exp_avg", 0), ("exp_avg_sq", 0)}
        pointers = {key: buffer.data_ptr() for key, buffer in buffers.items()}
        static.run(4)
        assert {key: buffer.data_ptr() for key, buffer in buffers.items()} == pointers


@pytest.mark.parametrize(
    ("host_rules", "sparse_updates"),
    [(True, True), (False, True), (False, False)],
    ids=["cpu-updates", "device-updates", "device-dense-updates"],
)
def test_a_non_finite_loss_applies_no_step(
    factory: CoreTriplesFactory, host_rules: bool, sparse_updates: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step with a non-finite loss and the later steps of its epoch write nothing; the epoch then raises.

    On a GPU's updates without a host read: the gated row rules, and Adam's capturable form updating the
    table densely (its table and state copied before the step and kept).
    """
    monkeypatch.setattr(StaticUpdate, "host_rules", host_rules)
    loop = make_loop(factory, num_shards=2, model_kwargs=dict(regularizer=None), sparse_updates=sparse_updates)
    loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
    with loop.tables.installed(copy_weights=True):
        static = _static_step(loop, factory, 16)
        static.load_epoch(2)
        static.run(2)
        relation = loop.model.relation_representations[0]._embeddings.weight
        with torch.no_grad():
            relation[:] = float("inf")
        before = [p.detach().clone() for p in loop.model.parameters()]
        state_before = {k: v.clone() for k, v in loop.optimizer.state[loop.tables[0].weight].items()}
        static.run(3)
        loss_sum, applied = static.finish_epoch()
        assert applied == 2
        for actual, expected in zip(loop.model.parameters(), before):
            torch.testing.assert_close(actual.detach(), expected, equal_nan=True)
        for name, value in loop.optimizer.state[loop.tables[0].weight].items():
            if name != "step":
                torch.testing.assert_close(value, state_before[name])
        # the two steps before the poisoned one are counted, the poisoned one and the later ones are not (the
        # row rules' counts reach the state at the end of the epoch; Adam's capturable form counts in it)
        counted = 0 if not sparse_updates else 2
        assert float(loop.optimizer.state[loop.tables[0].weight]["step"]) == float(state_before["step"]) + counted


class _Poison(TrainingCallback):
    def post_epoch(self, epoch: int, epoch_loss: float, **kwargs) -> None:
        with torch.no_grad():
            self.model.relation_representations[0]._embeddings.weight.fill_(float("nan"))


@pytest.mark.parametrize("per_step", [False, True])
def test_a_non_finite_loss_raises_through_the_loop(factory: CoreTriplesFactory, per_step: bool) -> None:
    """At the epoch's end, or at the step itself when a callback reads every step's loss."""
    loop = make_loop(factory, num_shards=2)
    callbacks = [_Poison(), StepLosses()] if per_step else [_Poison()]
    with pytest.raises(NonFiniteLossError, match=r"epoch 2, step 1/"):
        loop.train(factory, num_epochs=3, batch_size=64, use_tqdm=False, callbacks=callbacks)
    if per_step:  # the callback saw epoch 1, nothing of the poisoned step
        assert all(epoch == 1 for epoch, _ in callbacks[1].steps)


class _OwnBatchLoss(BessTrainingLoop):
    def _process_batch(self, batch, start, stop, label_smoothing=0.0, slice_size=None):
        return super()._process_batch(batch, start, stop, label_smoothing, slice_size)


@pytest.mark.parametrize("static_step", [True, None])
def test_a_configuration_the_static_step_cannot_train_says_why(
    factory: CoreTriplesFactory, static_step: bool | None, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """static_step=True raises with the reason; the default trains eagerly and logs it (on the CPU every
    configuration runs on the static step; a GPU refuses a few, see ``static_step_obstacle``)."""
    from pykeen_bess.training import epoch_steps

    monkeypatch.setattr(epoch_steps, "static_step_obstacle", lambda *args: "its tables are elsewhere")
    loop = make_loop(factory, num_shards=2, static_step=static_step)
    if static_step:
        with pytest.raises(ValueError, match="static step cannot train this configuration: its tables are elsewhere"):
            loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
        return
    with caplog.at_level(logging.INFO, logger="pykeen_bess"):
        loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
    assert "the eager step trains this configuration; the static step cannot, as its tables are" in caplog.text
    assert loop.static is None


@pytest.mark.parametrize("host_rules", [True, False], ids=["cpu-updates", "device-updates"])
def test_the_users_optimizer_updates_what_no_device_rule_reproduces(
    factory: CoreTriplesFactory, host_rules: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dense table updates without a capturable form, and options without a device rule, run the user's optimizer.

    (A GPU runs those uncaptured.) Adam's capturable form updates tables densely too, on the device.
    """
    monkeypatch.setattr(StaticUpdate, "host_rules", host_rules)
    updates = {}
    for name, kwargs in {
        "rules": dict(optimizer="adam"),
        "dense": dict(optimizer="adam", sparse_updates=False),
        "options": dict(optimizer="adam", optimizer_kwargs=dict(amsgrad=True), sparse_updates=False),
        "momentum": dict(optimizer="sgd", optimizer_kwargs=dict(momentum=0.9), sparse_updates=False),
    }.items():
        loop = make_loop(factory, num_shards=2, **kwargs)
        loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
        updates[name] = loop.static.update.dense
    rules, dense, options, momentum = (updates[name] for name in ("rules", "dense", "options", "momentum"))
    assert rules.rule_obstacle is None and not rules.tables
    # the CPU's updates: the user's optimizer for the dense groups; a GPU's: its capturable form
    for update in (rules, dense, options):
        assert update.capturable and update.rule_obstacle is None
        assert update.by_the_optimizer == host_rules
    assert len(dense.tables) == 1
    assert momentum.rule_obstacle == "dense table updates by SGD" and momentum.by_the_optimizer
    table = dense.tables[0].optimizer_parameter  # its gradient comes from the rows' sums, not from autograd
    assert dense.parameters and all(p is not table for p in dense.parameters)


def test_dense_tables_too_large_to_copy_keep_the_host_read(
    factory: CoreTriplesFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A captured dense update copies the tables and their state every step: not where that would crowd the GPU."""
    from pykeen_bess.training.steps import dense_update

    monkeypatch.setattr(StaticUpdate, "host_rules", False)  # a GPU's updates
    monkeypatch.setattr(dense_update, "available_memory", lambda device: 1000)  # bytes
    loop = make_loop(factory, num_shards=2, static_step=None, sparse_updates=False)
    loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
    dense = loop.static.update.dense
    assert not dense.capturable and dense.by_the_optimizer
    assert "their copies to undo a non-finite step" in dense.rule_obstacle
    assert "the user's optimizer" in loop.static.capture_obstacle


def test_what_a_cuda_graph_cannot_capture_runs_uncaptured(
    factory: CoreTriplesFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows crossing from host memory, and the user's optimizer after a host read: the same step, uncaptured."""
    monkeypatch.setattr(StaticUpdate, "host_rules", False)  # a GPU's updates
    obstacles = {}
    for name, kwargs in {
        "device": {},
        "host": dict(storage="host"),
        "dense": dict(sparse_updates=False),
        "dense-momentum": dict(sparse_updates=False, optimizer="sgd", optimizer_kwargs=dict(momentum=0.9)),
    }.items():
        loop = make_loop(factory, num_shards=2, static_step=None, **kwargs)
        loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
        obstacles[name] = loop.static.capture_obstacle
    assert obstacles["device"] is None
    assert obstacles["dense"] is None  # Adam's capturable form updates the table on the device
    assert "storage='host'" in obstacles["host"]
    assert "the user's optimizer" in obstacles["dense-momentum"]
    assert "dense table updates by SGD" in obstacles["dense-momentum"]


def test_a_subclass_overriding_process_batch_trains_eagerly(factory: CoreTriplesFactory) -> None:
    model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)
    with pytest.raises(ValueError, match="overrides _process_batch"):  # by the constructor, before training
        _OwnBatchLoss(model=model, triples_factory=factory, static_step=True, automatic_memory_optimization=False)
    loop = _OwnBatchLoss(model=model, triples_factory=factory, automatic_memory_optimization=False)
    loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
    assert loop.static is None


def test_automatic_mode_trains_with_the_static_step_on_the_cpu(
    factory: CoreTriplesFactory, caplog: pytest.LogCaptureFixture
) -> None:
    loop = make_loop(factory, num_shards=2, static_step=None)
    with caplog.at_level(logging.INFO, logger="pykeen_bess"):
        loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False, gradient_clipping_max_norm=1.0)
    assert "the static step trains all" in caplog.text and "captured" not in caplog.text
    assert loop.static is not None
    with pytest.raises(ValueError, match="static_step must be"):
        make_loop(factory, static_step="yes")


#: operators of one static step (forward, backward, row and dense updates, bookkeeping) at most, per
#: configuration. The eager step ran about 800 (and 7 host synchronisations) for DistMult on a GPU.
#: Measured: 270 without and 355 with PyKEEN's default relation regularizer at one sub-batch, for any
#: number of shards (the score-moving scheme's gathered queries add about 40); a padded step kind adds
#: its masks (about 25), every further sub-batch about 190, clipping 5-25; ComplEx (both tables
#: regularized) 516; a table updated densely by Adam's capturable form 320 (296 for TransE, with its
#: constraint). These are a GPU's steps; the CPU sums per local shard (``sums_per_shard``: 519 at n = 4).
OPERATOR_MATRIX = {
    "n1": (dict(num_shards=1, model_kwargs=dict(regularizer=None)), {}, 290),
    "n4": (dict(num_shards=4, model_kwargs=dict(regularizer=None)), {}, 290),
    "n4-lp": (dict(num_shards=4), {}, 370),
    "n4-score": (dict(num_shards=4, exchange="score", model_kwargs=dict(regularizer=None)), {}, 330),
    "n4-score-lp": (dict(num_shards=4, exchange="score"), {}, 420),
    "padded": (dict(num_shards=2), dict(padded=True), 390),
    "sub-batches": (dict(num_shards=2), dict(sub_block_size=4), 1000),
    "clip-norm": (dict(num_shards=2), dict(clipping=Clipping(max_norm=1.0)), 400),
    "clip-inf": (dict(num_shards=2), dict(clipping=Clipping(max_norm=1.0, norm_type=float("inf"))), 400),
    "clip-value": (dict(num_shards=2), dict(clipping=Clipping(max_abs_value=0.1)), 380),
    "weights": (dict(num_shards=2, loss="weightednssa", loss_weighter="subsampling"), {}, 400),
    "dropout": (dict(num_shards=2, model_cls=dropout_model), {}, 320),
    "rowwise-adagrad": (dict(num_shards=2, optimizer="rowwise_adagrad"), {}, 380),
    "transe": (dict(num_shards=2, model_cls=TransE), {}, 330),
    "complex": (dict(num_shards=2, model_cls=ComplEx), {}, 560),
    "encoding": (dict(num_shards=2, exchange="encoding"), {}, 480),
    # the CPU's sums per local shard (a GPU sums over all local shards at once)
    "n4-per-shard": (dict(num_shards=4, model_kwargs=dict(regularizer=None)), dict(per_shard=True), 550),
    # typed negatives weigh the regularized rows by every step's candidate types, on the device
    "typed-lp": (dict(num_shards=2, negatives="typed_step"), dict(typed=True), 420),
    # a table updated densely by Adam's capturable form: its gradient, copies for the gate, no constraint
    "dense-adam": (dict(num_shards=2, sparse_updates=False), {}, 350),
    # and with TransE's unit-norm constraint on the step's real rows (fixed shapes)
    "dense-adam-transe": (dict(num_shards=2, model_cls=TransE, sparse_updates=False), {}, 330),
}


@pytest.mark.parametrize("name", sorted(OPERATOR_MATRIX))
def test_a_static_step_reads_nothing_on_the_host_and_stays_within_its_operator_budget(
    factory: CoreTriplesFactory, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every configuration the static step trains runs without a synchronising operator (a CUDA graph captures it)."""
    loop_kwargs, step_kwargs, budget = OPERATOR_MATRIX[name]
    monkeypatch.setattr(StaticUpdate, "host_rules", False)  # what a GPU runs (the CPU's host-side unique would sync)
    step_kwargs = dict(step_kwargs)
    if step_kwargs.pop("typed", False):
        factory = typed_graph().training
    loop = make_loop(factory, **loop_kwargs)
    num_shards = loop_kwargs["num_shards"]
    loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
    padded = step_kwargs.pop("padded", False)
    # as on a GPU, unless the entry counts the CPU's sums per local shard
    loop.runner.scheme.sums_per_shard = step_kwargs.pop("per_shard", False)
    with loop.tables.installed(copy_weights=True):
        static = _static_step(loop, factory, 64 // num_shards**2, **step_kwargs)
        kind = static.plan.kinds[-1 if padded else 0]
        assert kind.padded == padded
        static.load_epoch(2)
        static.run(1)  # the first run creates the cached device indices and the step counts
        static.step(kind)  # and those of the kind
        with DeviceOps(static_step_sources(static)) as ops:
            static.step(kind)
    assert ops.synchronising == []
    assert 0 < ops.total <= budget, ops.ops.most_common(10)


def test_compiled_updates_equal_the_eager_step(factory: CoreTriplesFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused update torch.compile builds on a GPU (forced here on the CPU) trains as the eager step does.

    TransE: a row constraint (unit norm) inside the fused row update, and Adam's capturable dense update (float64:
    it equals the plain one to rounding).
    """
    case = dict(num_shards=2, model_cls=TransE)
    from pykeen_bess.training.steps import static_rules

    with default_dtype(torch.float64):
        _, eager, eager_parameters = train(factory, static_step=False, epochs=2, **case)
        monkeypatch.setattr(static_rules.FusedRule, "everywhere", True)
        loop, static, static_parameters = train(factory, static_step=True, epochs=2, **case)
    fused = loop.static.update.fused
    assert not fused.failed and fused.compiled is not None
    # a copy of the function with a code object of its own, where torch.compile keeps this step's variants
    own = fused.compiled.__wrapped__.__code__
    assert own is not static_rules.gated_rule.__code__ and own == static_rules.gated_rule.__code__
    assert static == pytest.approx(eager, rel=1e-9)
    for actual, expected in zip(static_parameters, eager_parameters):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("storage", ["host", "mmap"])
def test_a_staged_step_reads_no_host_memory(
    factory: CoreTriplesFactory, storage: str, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """Tables in host memory or files with staged rows: the step reads only device buffers (a CUDA graph captures it).

    The step's rows are staged into fixed buffers before it and written back after it; inside the step no
    operator reads a tensor of the tier, none synchronises, nothing is copied from the host.
    """
    monkeypatch.setattr(StaticUpdate, "host_rules", False)  # what a GPU runs
    options = dict(storage_path=str(tmp_path)) if storage == "mmap" else {}
    loop = make_loop(factory, num_shards=2, storage=storage, **options)
    loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
    with loop.tables.installed(copy_weights=False):
        static = _static_step(loop, factory, 16, stage_rows=True)
        assert static.rows_io.staged and static.capture_obstacle is None
        host = [tensor for _, tensor, _ in static._staged_tensors()]
        host_memory = {tensor.untyped_storage().data_ptr() for tensor in host}
        kind = static.plan.kinds[0]
        static.load_epoch(2)
        static.run(1)  # the first run creates the cached device indices and the step counts
        static.rows_io.stage(1, static._rows_of_steps, static.num_steps)
        sources = [t for t in static_step_sources(static) if t.untyped_storage().data_ptr() not in host_memory]
        with DeviceOps([*sources, *static.rows_io._device, static.rows_io.slots], host=host) as ops:
            static.step(kind)
        static.rows_io.write_back()
    assert ops.synchronising == [], "\n".join(ops.synchronising)
    assert 0 < ops.total <= 420, ops.ops.most_common(10)


@pytest.mark.parametrize(
    "case",
    [
        dict(num_shards=1),
        dict(num_shards=4, negatives="block"),
        dict(num_shards=2, optimizer="adagrad", optimizer_kwargs=dict(lr=0.1, lr_decay=0.01)),
        dict(num_shards=2, optimizer="rowwise_adagrad"),
        dict(num_shards=2, model_cls=TransE),
        dict(num_shards=2, train_kwargs=dict(sub_batch_size=16)),
        # a per-step callback: the tiers are written before it runs (no read of a next step ahead)
        dict(num_shards=2, train_kwargs=dict(callbacks=StepLosses())),
    ],
)
@pytest.mark.parametrize("storage", ["host", "mmap"])
def test_staged_rows_train_as_the_device_tier(
    factory: CoreTriplesFactory, storage: str, case: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """Tables in host memory or files, their rows staged around every step (as on a GPU): the device tier's run.

    Both run the device form of the row rules (as a GPU does); float64, so the losses and tables are equal
    to rounding, and the staged run's tier holds the final tables. Nations' steps all share rows: the next
    step's rows, read from the tier while a step runs, must get that step's writes (without forwarding
    them every case here fails).
    """
    from pykeen_bess.training.steps import static_step

    monkeypatch.setattr(StaticUpdate, "host_rules", False)
    device_loop, device_losses, _ = train(factory, static_step=True, **case)
    forced = static_step.row_access
    monkeypatch.setattr(static_step, "row_access", lambda *args: forced(*args[:4], True, args[5]))
    options = dict(storage=storage) | (dict(storage_path=str(tmp_path)) if storage == "mmap" else {})
    loop, staged_losses, _ = train(factory, static_step=True, **case, **options)
    assert loop.static is not None and loop.static.rows_io.staged
    assert staged_losses == pytest.approx(device_losses, rel=1e-12)
    torch.testing.assert_close(loop.tables[0].full_table(), device_loop.tables[0].full_table(), rtol=1e-12, atol=1e-14)
    relations = [model.relation_representations[0]._embeddings.weight for model in (loop.model, device_loop.model)]
    torch.testing.assert_close(*relations, rtol=1e-12, atol=1e-14)


def test_staged_host_buffers_wait_for_slow_writes(factory: CoreTriplesFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier slower than the steps: the steps wait for it, and train as with the device tier.

    The written rows of every other step share host buffers: a step reuses them only after the worker read its
    own rows, which it does after writing those of the step two before (the worker runs in order).
    """
    import time

    from pykeen_bess.storage.host import HostStorage
    from pykeen_bess.training.steps import static_step

    monkeypatch.setattr(StaticUpdate, "host_rules", False)
    _, device_losses, device_parameters = train(factory, static_step=True, num_shards=2, epochs=2)
    forced = static_step.row_access
    monkeypatch.setattr(static_step, "row_access", lambda *args: forced(*args[:4], True, args[5]))
    written = HostStorage.write

    def slow(self, tensor, rows, values):
        time.sleep(0.002)
        written(self, tensor, rows, values)

    monkeypatch.setattr(HostStorage, "write", slow)
    loop, losses, _ = train(factory, static_step=True, num_shards=2, epochs=2, storage="host")
    assert loop.static is not None and loop.static.rows_io.staged
    assert losses == pytest.approx(device_losses, rel=1e-12)


def test_staging_what_cannot_be_staged_is_refused(factory: CoreTriplesFactory) -> None:
    """Rows in the device tier (or replicated, or column parts) are not staged; asking for it says why."""
    loop = make_loop(factory, num_shards=2)
    loop.train(factory, num_epochs=1, batch_size=64, use_tqdm=False)
    with loop.tables.installed(copy_weights=False):
        assert not _static_step(loop, factory, 16).rows_io.staged  # automatic: the CPU reads its tiers directly
        with pytest.raises(ValueError, match="device tier"):
            _static_step(loop, factory, 16, stage_rows=True)


def test_a_failing_write_to_the_tier_fails_the_training(
    factory: CoreTriplesFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write of staged rows to the tier that raises on the worker thread fails the training with its error."""
    from pykeen_bess.storage.host import HostStorage
    from pykeen_bess.training.steps import static_step

    forced = static_step.row_access
    monkeypatch.setattr(static_step, "row_access", lambda *args: forced(*args[:4], True, args[5]))
    monkeypatch.setattr(StaticUpdate, "host_rules", False)
    written = HostStorage.write
    calls = []

    def failing(self, tensor, rows, values):
        calls.append(rows.numel())
        if len(calls) > 7:  # after a few steps (a step writes the weights and each row state tensor)
            raise OSError("the tier's disk is gone")
        written(self, tensor, rows, values)

    monkeypatch.setattr(HostStorage, "write", failing)
    loop = make_loop(factory, num_shards=2, storage="host")
    with pytest.raises(OSError, match="disk is gone"):
        loop.train(factory, num_epochs=2, batch_size=64, use_tqdm=False)


def test_staged_device_memory_does_not_grow_with_the_tables() -> None:
    """What staging keeps on the device (buffers and slots) depends on the step's rows, not on the tables' size."""
    from pykeen_bess.storage.host import HostStorage
    from pykeen_bess.storage.staging import StagedRows

    storage = HostStorage()
    held = {}
    for num_rows in (100, 100_000):
        weight, state = torch.randn(num_rows, 8), torch.zeros(num_rows, 8)
        staged = StagedRows(lambda w=weight, s=state: [(storage, w, True), (storage, s, True)], 64, torch.device("cpu"))
        occurrences = torch.randint(num_rows, (64,), generator=torch.Generator().manual_seed(0))
        staged.stage(0, lambda start, stop, o=occurrences: o.expand(stop - start, -1), 1)
        torch.testing.assert_close(staged.read(storage, weight, occurrences), weight[occurrences])
        staged.write_back()
        staged.flush()
        device = [*staged._device, *staged._incoming, staged.slots, staged._incoming_indices]
        held[num_rows] = sum(tensor.numel() * tensor.element_size() for tensor in device)
        assert staged.depth == 2 and held[num_rows] <= staged.buffer_bytes()[0]
    # two sets of 64 rows of two tensors of width 8 (float32), the occurrences' slots, the incoming indices
    assert held[100] == held[100_000] == 2 * 64 * (2 * 8 * 4) + 64 * 8 + 3 * 64 * 8
