"""The encoding (column) partition in one process: logical column parts equal the one-shard token run.

The ranks (one column part per process) are tested in ``tests/distributed/test_encoding_ranks.py``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.models import ERModel, model_resolver
from pykeen.nn.modules import interaction_resolver
from pykeen.triples.weights import RelationLossWeighter

from pykeen_bess.distributed import LocalTopology
from pykeen_bess.tables.encoding import (
    INNER_PRODUCT_INTERACTIONS,
    NORM_INTERACTIONS,
    ColumnNorm,
    ColumnRegularizer,
    ColumnSplit,
    SeparableScoring,
    slice_columns,
)
from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.schemes import EmbeddingMovingScheme, EncodingScheme, ScoreMovingScheme, choose_scheme
from pykeen_bess.training import BessTrainingLoop
from test_storage import StepRecorder


@pytest.fixture(scope="module")
def nations() -> Nations:
    return Nations()


def make_model(dataset: Nations, name: str, **kwargs: Any) -> ERModel:
    """A float64 model: a PyKEEN model name, or an interaction name for an ``ERModel``."""
    if name in ("TripleRE", "LineaRE"):
        relations = [dict(shape=6)] * (3 if name == "TripleRE" else 1) + (
            [dict(shape=6)] * 2 if name == "LineaRE" else []
        )
        model = ERModel(
            triples_factory=dataset.training,
            interaction=name,
            entity_representations_kwargs=dict(shape=6),
            relation_representations_kwargs=relations,
            random_seed=0,
        )
    else:
        kwargs = {"embedding_dim": 6, **kwargs}
        model = model_resolver.make(name, triples_factory=dataset.training, random_seed=0, **kwargs)
    return model.double()


def train(
    dataset: Nations,
    name: str,
    num_shards: int,
    partition: str | None,
    epochs: int = 2,
    batch_size: int = 256,
    **kwargs: Any,
):
    """Train a model; return the step losses and the model."""
    model_kwargs = kwargs.pop("model_kwargs", {})
    train_kwargs = dict(
        sub_batch_size=kwargs.pop("sub_batch_size", None),
        gradient_clipping_max_norm=kwargs.pop("gradient_clipping_max_norm", None),
    )
    model = make_model(dataset, name, **model_kwargs)
    loop = BessTrainingLoop(
        model=model,
        triples_factory=dataset.training,
        num_shards=num_shards,
        partition=partition,
        num_negs_per_pos=4,
        seed=3,
        optimizer=kwargs.pop("optimizer", "adam"),
        optimizer_kwargs=dict(lr=0.05),
        automatic_memory_optimization=False,
        **kwargs,
    )
    recorder = StepRecorder()
    loop.train(
        dataset.training, num_epochs=epochs, batch_size=batch_size, use_tqdm=False, callbacks=recorder, **train_kwargs
    )
    return recorder.losses, model, loop


def assert_same_model(model: ERModel, reference: ERModel) -> None:
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


MODELS = [
    ("DistMult", {}),
    ("ComplEx", {}),
    ("TransE", dict(scoring_fct_norm=1)),
    ("TransE", dict(scoring_fct_norm=2)),
    ("RotatE", {}),
    ("PairRE", {}),
    ("TripleRE", {}),
    ("InterHT", {}),
    ("UM", {}),  # no relation representations (an IndexError in the scheme)
]


@pytest.mark.parametrize(
    ("name", "model_kwargs"), MODELS, ids=[f"{n}{k.get('scoring_fct_norm', '')}" for n, k in MODELS]
)
def test_logical_column_parts_equal_the_one_shard_run(nations: Nations, name: str, model_kwargs: dict) -> None:
    """Per-step losses and final parameters, with 2 and 4 parts of 6 coordinates (4 does not divide 6)."""
    reference_losses, reference, _ = train(nations, name, 1, "token", model_kwargs=model_kwargs)
    for parts in (2, 4):
        losses, model, _ = train(nations, name, parts, "encoding", model_kwargs=model_kwargs)
        assert losses == pytest.approx(reference_losses, rel=1e-12, abs=1e-12)
        assert_same_model(model, reference)


@pytest.mark.parametrize("name", ["RESCAL", "DistMult"])
def test_whole_rows_from_logical_column_parts_equal_the_one_shard_run(nations: Nations, name: str) -> None:
    """The encoding lookup (the default for interactions that are not separable) in one process."""
    reference_losses, reference, _ = train(nations, name, 1, "token")
    exchange = None if name == "RESCAL" else "encoding_lookup"
    losses, model, loop = train(nations, name, 3, "encoding", exchange=exchange)
    assert loop.runner.scheme.get_name() == "encoding_lookup"
    assert losses == pytest.approx(reference_losses, rel=1e-12)
    assert_same_model(model, reference)


def test_sub_batches_clipping_and_sgd_equal_the_one_shard_run(nations: Nations) -> None:
    settings = dict(sub_batch_size=50, gradient_clipping_max_norm=0.5, optimizer="sgd")
    reference_losses, reference, _ = train(nations, "DistMult", 1, "token", **settings)
    losses, model, _ = train(nations, "DistMult", 3, "encoding", **settings)
    assert losses == pytest.approx(reference_losses, rel=1e-12)
    assert_same_model(model, reference)


@pytest.mark.parametrize("exchange", ["encoding", "encoding_lookup"])
@pytest.mark.parametrize("loss", ["softplus", "weightednssa"])
def test_loss_weights_in_column_parts_equal_the_one_shard_run(nations: Nations, exchange: str, loss: str) -> None:
    """Loss weights (per relation; Sun et al.'s subsampling, NSSA only) slice with the blocks of the column schemes."""
    weights = torch.linspace(0.2, 2.0, nations.training.num_relations, dtype=torch.float64)
    weighters: list[Any] = [RelationLossWeighter(weights=weights)] + (["subsampling"] if loss == "weightednssa" else [])
    for weighter in weighters:
        settings: dict[str, Any] = dict(loss_weighter=weighter, sub_batch_size=50, model_kwargs=dict(loss=loss))
        reference_losses, reference, _ = train(nations, "DistMult", 1, "token", **settings)
        losses, model, _ = train(nations, "DistMult", 3, "encoding", exchange=exchange, **settings)
        assert losses == pytest.approx(reference_losses, rel=1e-12, abs=1e-12)
        assert_same_model(model, reference)
    unweighted_losses, _, _ = train(nations, "DistMult", 1, "token", model_kwargs=dict(loss=loss))
    assert losses != pytest.approx(unweighted_losses, rel=1e-6)


def test_the_trained_model_is_an_ordinary_model_with_the_same_metrics(nations: Nations) -> None:
    _, reference, _ = train(nations, "DistMult", 1, "token", epochs=1)
    _, model, _ = train(nations, "DistMult", 3, "encoding", epochs=1)
    assert type(model.entity_representations[0]).__name__ == "Embedding"
    metrics = [
        BessEvaluator().evaluate(m, nations.testing.mapped_triples, use_tqdm=False).to_flat_dict()
        for m in (model, reference)
    ]
    assert metrics[0] == pytest.approx(metrics[1], rel=1e-9)


INTERACTIONS = [(cls, {}) for cls in INNER_PRODUCT_INTERACTIONS] + [
    (cls, dict(p=p, power_norm=power)) for cls in NORM_INTERACTIONS for p, power in ((1, False), (2, False), (2, True))
]


@pytest.mark.parametrize(
    ("interaction", "kwargs"),
    INTERACTIONS,
    ids=[f"{c.__name__}{k.get('p', '')}{k.get('power_norm', '')}" for c, k in INTERACTIONS],
)
def test_partial_scores_sum_to_the_interaction(interaction: type, kwargs: dict) -> None:
    """Every separable interaction: parts' partial scores, summed and finished, are its scores (values, gradients)."""
    instance = interaction_resolver.make(interaction, **kwargs)
    generator = torch.Generator().manual_seed(0)
    d = 7
    complex_ = instance.entity_shape == ("d",) and interaction.__name__ in ("ComplExInteraction", "RotatEInteraction")
    dtype = torch.cdouble if complex_ else torch.double

    def draw(shapes: Any, *batch: int) -> Any:
        # every axis of a shape ("d", "kd", ...) has 7 entries; the split runs along the first
        drawn = [
            torch.randn(*batch, *(d for _ in shape), dtype=dtype, generator=generator).requires_grad_()
            for shape in shapes
        ]
        return drawn[0] if len(drawn) == 1 else tuple(drawn)

    def pick(x: Any, indices: Any) -> Any:  # the representations an interaction takes as heads or tails
        x = x if isinstance(x, tuple) else (x,)
        chosen = tuple(x[i] for i in indices)
        return chosen[0] if len(chosen) == 1 else chosen

    heads, tails = draw(instance.entity_shape, 5), draw(instance.entity_shape, 5)
    h, t = pick(heads, instance.head_indices), pick(tails, instance.tail_indices)
    r = draw(instance.relation_shape, 5)
    model = _FakeModel(instance)
    scoring = SeparableScoring(model)  # type: ignore[arg-type]
    split = ColumnSplit(d, 3)

    def cut(x: Any, shapes: Any, part: int) -> Any:
        start, stop = split.bounds(part)
        parts = [slice_columns(y, shape, start, stop) for y, shape in zip(x if isinstance(x, tuple) else (x,), shapes)]
        return parts[0] if len(parts) == 1 else tuple(parts)

    expected = instance(h=h, r=r, t=t)
    relation = instance.relation_shape
    head_shapes = [instance.entity_shape[i] for i in instance.head_indices]
    tail_shapes = [instance.entity_shape[i] for i in instance.tail_indices]
    total = sum(scoring.positive(cut(h, head_shapes, k), cut(r, relation, k), cut(t, tail_shapes, k)) for k in range(3))
    ours = scoring.finish(total)
    torch.testing.assert_close(ours, expected)
    leaves = [x for v in (h, r, t) for x in (v if isinstance(v, tuple) else (v,))]
    expected_grads = torch.autograd.grad(expected.sum(), leaves)
    for got, want in zip(torch.autograd.grad(ours.sum(), leaves), expected_grads):
        torch.testing.assert_close(got, want)


class _FakeModel:
    """What :class:`SeparableScoring` reads of a model."""

    def __init__(self, interaction: Any) -> None:
        self.interaction = interaction
        self.entity_representations: list = []
        self.relation_representations: list = []


def test_column_split_parts_cover_the_coordinates() -> None:
    split = ColumnSplit(10, 4)
    assert split.sizes == [3, 3, 2, 2]
    assert [split.bounds(k) for k in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(ValueError, match="at most 10 parts"):
        ColumnSplit(10, 11)


def test_column_norms_and_regularizers_see_whole_rows() -> None:
    """With all parts in one process the column-aware wrappers equal PyKEEN's functions on whole rows."""
    from pykeen.regularizers import LpRegularizer, PowerSumRegularizer
    from pykeen.utils import clamp_norm

    x = torch.randn(6, 5, dtype=torch.double)
    topology = LocalTopology(1)
    torch.testing.assert_close(
        ColumnNorm(torch.nn.functional.normalize, topology, "constrainer")(x), torch.nn.functional.normalize(x)
    )
    clamp = ColumnNorm(functools.partial(clamp_norm, maxnorm=1.0, p=2, dim=-1), topology, "constrainer")
    torch.testing.assert_close(clamp(x * 3), clamp_norm(x * 3, maxnorm=1.0, p=2, dim=-1))
    with pytest.raises(ValueError, match="supports the constrainers normalize"):
        ColumnNorm(lambda y: y, topology, "constrainer")
    for regularizer in (LpRegularizer(p=2.0, normalize=True), PowerSumRegularizer(p=3.0, normalize=True)):
        torch.testing.assert_close(ColumnRegularizer(regularizer, topology, 5).forward(x), regularizer.forward(x))


def test_a_column_regularizers_weight_is_the_wrapped_regularizers() -> None:
    """A change of the user's regularizer's weight after the loop wrapped it (a callback annealing it), or of the
    wrapper's, counts; the state dict keeps its keys; a maximum norm (p = inf) is refused: the parts are summed.
    """
    from pykeen.regularizers import LpRegularizer

    base = LpRegularizer(weight=0.5, p=1.0)
    wrapper = ColumnRegularizer(base, LocalTopology(1), 4)
    x = torch.ones(2, 4)
    for change, expected in (
        (lambda: base.weight.fill_(5.0), 5.0),
        (lambda: setattr(base, "weight", torch.tensor(2.0)), 2.0),
        (lambda: setattr(wrapper, "weight", torch.tensor(3.0)), 3.0),
        (lambda: wrapper.weight.fill_(0.25), 0.25),
    ):
        change()
        assert float(base.weight) == float(wrapper.weight) == expected
        wrapper.update(x)
        torch.testing.assert_close(wrapper.pop_regularization_term(), torch.tensor([4.0 * expected]))
    state = wrapper.state_dict()
    assert sorted(state) == ["base.regularization_term", "base.weight", "regularization_term", "weight"]
    state["weight"] = state["base.weight"] = torch.tensor(0.75)
    wrapper.load_state_dict(state, strict=True)
    assert float(base.weight) == 0.75
    with pytest.raises(ValueError, match="finite p > 0, not p=inf"):
        ColumnRegularizer(LpRegularizer(p=float("inf")), LocalTopology(1), 4)


def test_costs_and_auto_choice() -> None:
    # B = n^2 b positives, K negatives: 2 (n - 1) / n * B * (1 + K) values in one ring all-reduce
    assert EncodingScheme.cost(4, 32, 256, 256, 256) == 2 * 3 * 4 * 32 * 257 * 4
    assert EncodingScheme.cost(1, 32, 256, 256, 256) == 0
    # wide rows: the encoding scheme sends less than any token scheme, and auto picks it among all
    args = (4, 8, 64, 2048, 2048)
    assert EncodingScheme.cost(*args) < min(EmbeddingMovingScheme.cost(*args), ScoreMovingScheme.cost(*args))
    assert choose_scheme(*args, partitions=("token", "encoding")) is EncodingScheme
    assert choose_scheme(*args) in (EmbeddingMovingScheme, ScoreMovingScheme)  # token partition only
    assert choose_scheme(4, 64, 64, 16, 16, partitions=("token", "encoding")) is EmbeddingMovingScheme


def test_auto_chooses_among_all_schemes_by_bytes(nations: Nations, caplog: pytest.LogCaptureFixture) -> None:
    """Wide rows and small batches: the encoding partition (equal to one shard); narrow rows: a token scheme."""
    wide = dict(model_kwargs=dict(embedding_dim=64), batch_size=16, epochs=1)
    with caplog.at_level(logging.INFO, logger="pykeen_bess.training.setup.assembly"):
        losses, model, loop = train(nations, "DistMult", 2, None, exchange="auto", **wide)
    assert loop.config.partition == "encoding" and loop.topology.n_column == 2
    assert (
        "chose 'encoding'" in caplog.text and "embedding 1536, score 3136, encoding 320" in caplog.text
    )  # one set of negatives per step
    reference_losses, reference, _ = train(nations, "DistMult", 1, "token", **wide)
    assert losses == pytest.approx(reference_losses, rel=1e-12)
    assert_same_model(model, reference)
    # narrow rows, large batches: a token scheme; an explicit partition is never changed
    _, _, loop = train(nations, "DistMult", 2, None, exchange="auto", epochs=1)
    assert loop.config.partition == "token"
    _, _, loop = train(nations, "DistMult", 2, "token", exchange="auto", **wide)
    assert loop.config.partition == "token"
    # not separable: partial scores are no candidate, whole rows assembled from the parts are
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pykeen_bess.training.setup.assembly"):
        _, _, loop = train(nations, "RESCAL", 2, None, exchange="auto", model_kwargs=dict(embedding_dim=8), epochs=1)
    assert loop.config.partition == "token" and "encoding_lookup" in caplog.text and "encoding " not in caplog.text
    # where the encoding partition does not apply, the log says why
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pykeen_bess.training.setup.assembly"):
        _, _, loop = train(nations, "DistMult", 2, None, exchange="auto", model_kwargs=dict(embedding_dim=1), epochs=1)
    assert loop.config.partition == "token"
    assert "encoding not applicable: The encoding partition splits the 1 coordinates" in caplog.text
    # tables in host memory: a candidate too, equal to the one-shard run
    losses, model, loop = train(nations, "DistMult", 2, None, exchange="auto", storage="host", **wide)
    assert loop.config.partition == "encoding"
    assert losses == pytest.approx(reference_losses, rel=1e-12)


def test_pipeline_trains_an_encoding_partition(nations: Nations) -> None:
    from pykeen.pipeline import pipeline

    result = pipeline(
        dataset=nations,
        model="DistMult",
        model_kwargs=dict(embedding_dim=8),
        training_loop="bess",
        training_loop_kwargs=dict(num_shards=3, partition="encoding"),
        negative_sampler_kwargs=dict(num_negs_per_pos=5),  # any number: every part sees all negatives
        training_kwargs=dict(num_epochs=1, batch_size=128),
        evaluator="bess",
        random_seed=0,
    )
    assert 0 < result.get_metric("mrr") <= 1
    assert result.training_loop.config.partition == "encoding"
    assert result.training_loop.topology.n_column == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(model="RESCAL", exchange="encoding"), "column-separable interaction"),
        (dict(model="TransR", exchange="encoding"), "column-separable interaction"),
        # any spelling the scheme resolver accepts is the same scheme (the model's error, not another one)
        (dict(model="MuRE", exchange="Encoding"), "column-separable interaction"),
        (dict(model="MuRE", exchange="EncodingScheme"), "column-separable interaction"),
        (dict(model="SimplE", exchange="encoding"), "ClampedInteraction"),
        (dict(partition="rows"), "Unknown partition"),
        (dict(partition="encoding", exchange="score"), "works on the 'token' partition"),
        (dict(partition="token", exchange="encoding"), "works on the 'encoding' partition"),
        (dict(num_shards=9), "at most 8 parts"),
    ],
)
def test_bad_input_fails_before_training(nations: Nations, kwargs: dict, message: str) -> None:
    name = kwargs.pop("model", "DistMult")
    model = model_resolver.make(name, triples_factory=nations.training, embedding_dim=8, random_seed=0)
    settings = {"num_shards": 2, "partition": "encoding", **kwargs}
    with pytest.raises(ValueError, match=message):
        BessTrainingLoop(model=model, triples_factory=nations.training, **settings)


def test_a_column_part_refuses_to_answer_for_whole_rows(nations: Nations) -> None:
    """While it trains, a table of one column part cannot answer lookups of whole rows (no silent partial rows)."""
    from pykeen.nn.representation import Embedding

    from pykeen_bess.tables.representation import ShardedEmbedding
    from pykeen_bess.data.sharding import EntitySharding

    table = ShardedEmbedding(Embedding(max_id=14, shape=4), EntitySharding.create(14, 1, seed=0), (0,))
    table.column_part = 1  # type: ignore[assignment]  # as ColumnShardTables marks its tables
    with pytest.raises(ValueError, match="one column part of every row"):
        table(indices=torch.tensor([0, 3]))
