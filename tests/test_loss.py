"""The loss of a BESS step equals PyKEEN's sLCWA loss on the same batch, regularizers included.

With shared negatives, "the same batch" is PyKEEN's batch in which every positive's ``K``
negative triples are its block's shared negatives (the slot's side corrupted). PyKEEN's own
:meth:`~pykeen.training.SLCWATrainingLoop._process_batch_static` computes the reference on a
copy of the model holding the same weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.losses import (
    BCEWithLogitsLoss,
    Loss,
    MarginRankingLoss,
    NSSALoss,
    PointwiseHingeLoss,
    SoftplusLoss,
    SoftPointwiseHingeLoss,
    loss_resolver,
)
from pykeen.models import ERModel, model_resolver
from pykeen.training import SLCWATrainingLoop, TrainingCallback
from pykeen.triples import CoreTriplesFactory
from pykeen.triples.weights import LossWeighter, RelationLossWeighter

from typed_graphs import typed_graph

from pykeen_bess.data.batch import BlockScores
from pykeen_bess.nn.loss import (
    SubsamplingLossWeighter,
    WeightedNSSALoss,
    block_loss,
    delta_pointwise_loss,
    partition_weights,
)
from pykeen_bess.data.partition import ShardPairPartition
from pykeen_bess.data.sampling import BessBatch
from pykeen_bess.data.sharding import EntitySharding
from pykeen_bess.training import BessTrainingLoop


@pytest.fixture(scope="module")
def factory() -> CoreTriplesFactory:
    dataset = Nations()
    return CoreTriplesFactory.create(
        mapped_triples=dataset.training.mapped_triples[:300],
        num_entities=dataset.num_entities,
        num_relations=dataset.num_relations,
    )


def make_model(name: str, factory: CoreTriplesFactory) -> ERModel:
    """Models with regularized entity and relation representations (float64)."""
    if name == "CP":  # separate head and tail tables, each regularized
        model = ERModel(
            triples_factory=factory,
            interaction="CP",
            entity_representations_kwargs=[
                dict(shape=(2, 4), regularizer="lp", regularizer_kwargs=dict(weight=0.3)),
                dict(shape=(2, 4), regularizer="lp", regularizer_kwargs=dict(weight=0.7, p=1.0)),
            ],
            relation_representations_kwargs=dict(shape=(2, 4), regularizer="lp", regularizer_kwargs=dict(weight=0.2)),
            loss="crossentropy",
            random_seed=0,
        )
    elif name == "DistMult":  # PyKEEN's relation regularizer, plus an entity regularizer
        model = model_resolver.make(
            "DistMult",
            triples_factory=factory,
            embedding_dim=6,
            loss="softplus",
            entity_constrainer=None,
            regularizer="lp",
            regularizer_kwargs=dict(weight=0.5),
            random_seed=0,
        )
        model.entity_representations[0].regularizer = (
            model_resolver.make("ComplEx", triples_factory=factory, embedding_dim=2)
            .entity_representations[0]
            .regularizer
        )
        model.entity_representations[0].regularizer.weight.fill_(0.4)
    else:  # ComplEx: PyKEEN's default regularizers on entities and relations
        model = model_resolver.make(name, triples_factory=factory, embedding_dim=4, loss="crossentropy", random_seed=0)
    return model.double()


class Record(TrainingCallback):
    """Keeps each step's plan and loss, and the parameters before the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[BessBatch, float]] = []
        self.initial: dict[str, torch.Tensor] | None = None

    def pre_batch(self, **kwargs: Any) -> None:
        if self.initial is None:
            loop = self.training_loop
            self.initial = {f"entity{i}": table.full_table().clone() for i, table in enumerate(loop.tables)}
            self.initial.update(
                {
                    name: value.detach().clone()
                    for name, value in self.model.state_dict().items()
                    if name.startswith("relation_representations")
                }
            )

    def on_batch(self, epoch: int, batch: BessBatch, batch_loss: float, **kwargs: Any) -> None:
        self.steps.append((batch, batch_loss))


def slcwa_batch(
    batch: BessBatch, sharding: EntitySharding, weighter: LossWeighter | None = None
) -> dict[str, torch.Tensor]:
    """PyKEEN's positives ``[V, 3]`` and negatives ``[V, K, 3]`` (each positive gets its block's negatives).

    With a loss weighter, also PyKEEN's ``pos_weights`` ``[V]`` and ``neg_weights`` ``[V, K]`` (the weighter's
    values for the positive and the negative triples, as :class:`~pykeen.triples.instances.SLCWAInstances`
    computes them).
    """
    n, b = batch.n_shard, batch.block_size
    shard_i = torch.arange(n).view(n, 1, 1).expand(n, n, b)
    shard_j = torch.arange(n).view(1, n, 1).expand(n, n, b)
    heads = sharding.to_global(shard_i, batch.heads)
    tails = sharding.to_global(shard_j, batch.tails)
    owner = torch.arange(n).view(n, 1, 1, 1).expand_as(batch.negatives)
    # [k, i, j, T * m] -> [i, j, T, K]: every candidate type's negatives, shard k major
    types = batch.num_candidate_types
    negatives = sharding.to_global(owner, batch.negatives).view(n, n, n, types, -1).permute(1, 2, 3, 0, 4)
    negatives = negatives.reshape(n, n, types, -1)
    if batch.candidate_types is None:
        negatives = negatives.expand(n, n, b, negatives.shape[-1])
    else:  # typed negatives: each slot gets its corrupted side's type's
        negatives = torch.stack([negatives[i, j, batch.candidate_types[i, j]] for i in range(n) for j in range(n)])
        negatives = negatives.view(n, n, b, -1)
    positives = torch.stack([heads, batch.relations, tails], dim=-1)
    corrupted = positives.unsqueeze(-2).repeat(1, 1, 1, negatives.shape[-1], 1)
    head_corrupted = torch.arange(b) < batch.num_head_corrupted
    corrupted[:, :, head_corrupted, :, 0] = negatives[:, :, head_corrupted]
    corrupted[:, :, ~head_corrupted, :, 2] = negatives[:, :, ~head_corrupted]
    result = {"positives": positives[batch.valid], "negatives": corrupted[batch.valid]}
    if weighter is not None:
        result["pos_weights"] = weighter.weight_triples(result["positives"])
        result["neg_weights"] = weighter.weight_triples(result["negatives"])
    return result


@pytest.mark.parametrize("model_name", ["ComplEx", "DistMult", "CP"])
@pytest.mark.parametrize(
    ("n_shard", "exchange", "corruption", "sub_batch_size"),
    [(1, "embedding", "ht", None), (3, "embedding", "ht", None), (3, "score", "ht", 18), (2, "embedding", "h", 4)],
)
def test_step_loss_equals_pykeen_slcwa_with_the_shared_negatives(
    factory: CoreTriplesFactory, model_name: str, n_shard: int, exchange: str, corruption: str, sub_batch_size
) -> None:
    check_step_losses(factory, model_name, n_shard, exchange, corruption, sub_batch_size)


@pytest.mark.parametrize("model_name", ["ComplEx", "DistMult", "CP"])
@pytest.mark.parametrize(
    ("n_shard", "exchange", "corruption", "sub_batch_size"),
    [(1, "embedding", "ht", None), (3, "embedding", "ht", None), (3, "score", "ht", 18), (2, "score", "t", 4)],
)
def test_typed_negatives_step_loss_equals_pykeen_slcwa(
    model_name: str, n_shard: int, exchange: str, corruption: str, sub_batch_size
) -> None:
    """Typed negatives: each positive's K negatives (its corrupted side's type) as PyKEEN's sLCWA negatives."""
    graph = typed_graph(num_partitions=3 if n_shard == 3 else 1, seed=2)
    check_step_losses(graph.training, model_name, n_shard, exchange, corruption, sub_batch_size, negatives="typed")


@pytest.mark.parametrize("model_name", ["ComplEx", "DistMult"])
@pytest.mark.parametrize(
    ("n_shard", "exchange", "sub_batch_size"), [(3, "embedding", None), (3, "score", 18), (2, "embedding", 4)]
)
def test_step_shared_typed_negatives_step_loss_equals_pykeen_slcwa(
    model_name: str, n_shard: int, exchange: str, sub_batch_size
) -> None:
    """negatives="typed_step": every positive of a step against the step's one set of its corrupted side's type."""
    graph = typed_graph(num_partitions=3 if n_shard == 3 else 1, seed=2)
    check_step_losses(graph.training, model_name, n_shard, exchange, "ht", sub_batch_size, negatives="typed_step")


def check_step_losses(
    factory: CoreTriplesFactory,
    model_name: str,
    n_shard: int,
    exchange: str,
    corruption: str,
    sub_batch_size: int | None,
    loss: str | None = None,
    reference_weighter: LossWeighter | None = None,
    **loop_kwargs: Any,
) -> None:
    """Every step's BESS loss equals PyKEEN's sLCWA loss on the batch with the step's negatives (float64).

    :param loss: replaces the model's loss (in both models)
    :param reference_weighter: the loss weighter PyKEEN's reference weighs the positives with (the loop's
        ``loss_weighter`` is in ``loop_kwargs``)
    """
    model = make_model(model_name, factory)
    if loss is not None:
        model.loss = loss_resolver.make(loss)
    loop = BessTrainingLoop(
        model=model,
        triples_factory=factory,
        num_shards=n_shard,
        exchange=exchange,
        corruption=corruption,
        num_negs_per_pos=2 * n_shard,
        seed=5,
        optimizer="sgd",
        optimizer_kwargs=dict(lr=0.0),  # the weights stay those of the first step
        automatic_memory_optimization=False,
        **loop_kwargs,
    )
    record = Record()
    loop.train(
        factory,
        num_epochs=1,
        batch_size=7 * n_shard**2,
        sub_batch_size=sub_batch_size,
        callbacks=record,
        use_tqdm=False,
    )
    assert len(record.steps) > 1 and any(not bool(batch.valid.all()) for batch, _ in record.steps)  # padding, too

    reference = make_model(model_name, factory)
    if loss is not None:
        reference.loss = loss_resolver.make(loss)
    state = reference.state_dict()
    for index in range(len(reference.entity_representations)):
        state[f"entity_representations.{index}._embeddings.weight"] = record.initial[f"entity{index}"]
    state.update({k: v for k, v in record.initial.items() if k.startswith("relation_representations")})
    reference.load_state_dict(state)
    reference.collect_regularization_term()
    reference.train()  # PyKEEN's regularizers only act in training mode, with gradients enabled
    for batch, bess_loss in record.steps:
        expected = SLCWATrainingLoop._process_batch_static(
            model=reference,
            loss=reference.loss,
            mode=None,
            batch=slcwa_batch(batch, loop.sharding, reference_weighter),
            start=None,
            stop=None,
        )
        assert bess_loss == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize(
    ("loss", "weighter"),
    [
        ("bcewithlogits", "relation"),  # weighted mean over the number of scores
        ("softplus", "relation"),  # ... over the weights' sum
        ("focal", "relation"),  # ... over the weights' sum (found by measuring, not by class)
        ("weightednssa", "relation"),
        ("weightednssa", "subsampling"),
    ],
)
@pytest.mark.parametrize(
    ("n_shard", "exchange", "sub_batch_size"), [(1, "embedding", None), (3, "embedding", None), (3, "score", 18)]
)
def test_weighted_step_loss_equals_pykeen_slcwa(
    factory: CoreTriplesFactory, loss: str, n_shard: int, exchange: str, sub_batch_size, weighter: str
) -> None:
    """With a loss weighter every step's loss equals PyKEEN's sLCWA loss with its ``pos_weights`` and ``neg_weights``.

    ``loss_weighter="subsampling"`` (a name, fitted by the loop on its training triples) against a
    weighter fitted on the same triples; PyKEEN's relation weighter as an instance.
    """
    if weighter == "subsampling":
        reference: LossWeighter = SubsamplingLossWeighter(mapped_triples=factory.mapped_triples)
        loop_weighter: Any = "subsampling"
    else:
        generator = torch.Generator().manual_seed(1)
        reference = loop_weighter = RelationLossWeighter(
            weights=torch.rand(factory.num_relations, generator=generator, dtype=torch.float64) + 0.5
        )
    check_step_losses(
        factory,
        "DistMult",
        n_shard,
        exchange,
        "ht",
        sub_batch_size,
        loss=loss,
        reference_weighter=reference,
        loss_weighter=loop_weighter,
    )


@pytest.mark.parametrize("model_name", ["ComplEx", "DistMult", "CP"])
@pytest.mark.parametrize(
    ("n_shard", "exchange", "sub_batch_size"), [(3, "embedding", None), (3, "score", 18), (2, "score", 4)]
)
def test_step_shared_negatives_step_loss_equals_pykeen_slcwa(
    factory: CoreTriplesFactory, model_name: str, n_shard: int, exchange: str, sub_batch_size: int | None
) -> None:
    """negatives="step": every positive of a step is scored against the step's one set of negatives
    (each negative row regularized with its weight summed over the blocks)."""
    check_step_losses(factory, model_name, n_shard, exchange, "ht", sub_batch_size, negatives="step")


def test_weighted_typed_negatives_step_loss_equals_pykeen_slcwa() -> None:
    """Loss weights with typed negatives (a typed graph in 3 partitions)."""
    graph = typed_graph(num_partitions=3, seed=2)
    check_step_losses(
        graph.training,
        "DistMult",
        3,
        "score",
        "ht",
        18,
        loss="weightednssa",
        reference_weighter=SubsamplingLossWeighter(mapped_triples=graph.training.mapped_triples),
        loss_weighter="subsampling",
        negatives="typed",
    )


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        (NSSALoss(), "does not support loss weights.*weightednssa"),  # PyKEEN's NSSA refuses weights
        # PyKEEN would weigh each negative triple by its own (entity-dependent) subsampling weight
        (SoftplusLoss(), "negative entity.*weightednssa.? only"),
    ],
)
def test_unsupported_loss_weights_are_refused_before_training(
    factory: CoreTriplesFactory, loss: Loss, message: str
) -> None:
    """The loop says so before the first step."""
    model = make_model("DistMult", factory)
    model.loss = loss
    loop = BessTrainingLoop(
        model=model, triples_factory=factory, num_shards=2, loss_weighter="subsampling", seed=0, num_negs_per_pos=2
    )
    record = Record()
    with pytest.raises(ValueError, match=message):
        loop.train(factory, num_epochs=1, batch_size=16, use_tqdm=False, callbacks=record)
    assert not record.steps


def test_partition_weights_refuses_bad_weights_and_stale_relation_ids(factory: CoreTriplesFactory) -> None:
    """All-zero weights, and weighters fitted or given without the inverse relations the loop trains with."""
    triples = factory.mapped_triples
    sharding = EntitySharding.create(factory.num_entities, 2)
    partition = ShardPairPartition.from_triples(triples, sharding)
    zero = RelationLossWeighter(weights=torch.zeros(factory.num_relations))
    with pytest.raises(ValueError, match="not all 0"):
        partition_weights(zero, SoftplusLoss(), partition)
    inverse = torch.cat([triples, triples[:, [2, 1, 0]] + torch.tensor([0, factory.num_relations, 0])])
    inverse_partition = ShardPairPartition.from_triples(inverse, sharding)
    with pytest.raises(ValueError, match="inverse triples"):
        partition_weights(SubsamplingLossWeighter(triples), WeightedNSSALoss(), inverse_partition)
    # unfitted: fitted on the partition's triples (all relation ids)
    weights = partition_weights(SubsamplingLossWeighter(), WeightedNSSALoss(), inverse_partition)
    assert weights is not None and weights.shape == (inverse.shape[0],) and bool((weights > 0).all())
    # one relation weight per relation id of the trained triples (a raw IndexError before)
    short = RelationLossWeighter(weights=torch.ones(factory.num_relations))
    assert partition_weights(short, SoftplusLoss(), partition) is not None
    with pytest.raises(ValueError, match=f"has {factory.num_relations} weights, but the loop trains with relation ids"):
        partition_weights(short, SoftplusLoss(), inverse_partition)


def test_a_step_whose_positives_weigh_nothing_has_loss_zero() -> None:
    """PyKEEN's weighted mean clamps the weights' sum; BESS's share of a step of zero weights is 0, not NaN."""
    scores = BlockScores(
        positive=torch.randn(1, 1, 3),
        negative=torch.randn(1, 1, 3, 4),
        valid_index=None,
        regularization=0.0,
        weights=torch.zeros(1, 1, 3),
    )
    value = block_loss(SoftplusLoss(), scores, num_valid_step=3, weight_step=0.0)
    assert float(value) == 0.0


def test_memory_search_computes_the_weights_once(factory: CoreTriplesFactory) -> None:
    """batch_size=None probes many samplers; the loss weights are computed for the first only."""

    class Counting(RelationLossWeighter):
        calls = 0

        def weight_triples(self, mapped_triples):
            Counting.calls += 1
            return super().weight_triples(mapped_triples)

    model = make_model("DistMult", factory)
    loop = BessTrainingLoop(
        model=model,
        triples_factory=factory,
        num_shards=2,
        seed=0,
        num_negs_per_pos=2,
        loss_weighter=Counting(weights=torch.ones(factory.num_relations)),
    )
    loop.train(factory, num_epochs=1, batch_size=None, use_tqdm=False)
    assert Counting.calls == 1


def test_weighted_nssa_refuses_lcwa_weights_with_the_reason() -> None:
    """PyKEEN's LCWA loop passes a weight per label: refused, saying the loss weighs sLCWA positives."""
    from pykeen.losses import NoSampleWeightSupportError

    loss = WeightedNSSALoss()
    predictions, labels = torch.randn(3, 5), torch.zeros(3, 5)
    labels[:, 0] = 1
    with pytest.raises(NoSampleWeightSupportError, match="weighs the positives of sLCWA training"):
        loss.process_lcwa_scores(predictions, labels, weights=torch.ones(3, 5))
    torch.testing.assert_close(
        loss.process_lcwa_scores(predictions, labels), NSSALoss().process_lcwa_scores(predictions, labels)
    )


def test_weighted_nssa_equals_nssa_without_weights_and_weighs_each_positive_term() -> None:
    """WeightedNSSA: PyKEEN's NSSA without weights; with weights, each positive's whole term scaled."""
    generator = torch.Generator().manual_seed(0)
    positive = 3 * torch.randn(6, 1, generator=generator, dtype=torch.float64)
    negative = 3 * torch.randn(6, 5, generator=generator, dtype=torch.float64)
    weights = torch.rand(6, generator=generator, dtype=torch.float64) + 0.1
    for reduction in ("mean", "sum"):
        ours, pykeen = WeightedNSSALoss(margin=2.0, reduction=reduction), NSSALoss(margin=2.0, reduction=reduction)
        torch.testing.assert_close(
            ours.process_slcwa_scores(positive, negative), pykeen.process_slcwa_scores(positive, negative)
        )
        # one positive at a time: the weighted value is the weighted sum (or mean) of the single-positive values
        single = torch.stack([pykeen.process_slcwa_scores(positive[i : i + 1], negative[i : i + 1]) for i in range(6)])
        expected = (weights * single).sum() / (6 if reduction == "mean" else 1)
        torch.testing.assert_close(ours.process_slcwa_scores(positive, negative, pos_weights=weights), expected)
        # PyKEEN's sLCWA loop also passes the negative triples' own weights: the negatives share their positive's
        other = torch.rand(6, 5, generator=generator, dtype=torch.float64)
        torch.testing.assert_close(
            ours.process_slcwa_scores(positive, negative, pos_weights=weights, neg_weights=other), expected
        )


def test_subsampling_weights_follow_sun_et_al() -> None:
    """``1 / sqrt(#(h, r) + #(t, r) + 6)`` (counts of Sun et al.'s ``count_frequency``), mean 1 when normalized."""
    triples = torch.tensor([[0, 0, 1], [0, 0, 2], [3, 0, 1], [1, 1, 0], [2, 0, 1]])
    raw = SubsamplingLossWeighter(triples, normalize=False)
    # Sun et al.: count starts at 4 on a pair's first occurrence, +1 for each further one
    counts: dict[tuple[int, int], int] = {}
    for h, r, t in triples.tolist():
        counts[(h, r)] = counts.get((h, r), 3) + 1
        counts[(t, -r - 1)] = counts.get((t, -r - 1), 3) + 1
    expected = torch.tensor([(counts[(h, r)] + counts[(t, -r - 1)]) ** -0.5 for h, r, t in triples.tolist()])
    torch.testing.assert_close(raw.weight_triples(triples), expected.to(torch.get_default_dtype()))
    normalized = SubsamplingLossWeighter(triples)
    assert float(normalized.weight_triples(triples).double().mean()) == pytest.approx(1.0)
    # unseen pairs count 0
    unseen = raw(h=torch.tensor([4, 0]), r=torch.tensor([0, 1]), t=torch.tensor([4, 4]))
    torch.testing.assert_close(unseen, torch.full((2,), 6**-0.5))
    # a relation id beyond the fitted ones (inverse triples: another relation's counts) is refused
    with pytest.raises(ValueError, match="fitted on relation ids below 2, but weighs relation id 5"):
        raw(h=torch.tensor([4, 0]), r=torch.tensor([0, 5]), t=torch.tensor([4, 0]))
    with pytest.raises(ValueError, match="not fitted"):
        SubsamplingLossWeighter()(h=triples[:, 0], r=triples[:, 1], t=triples[:, 2])


@pytest.mark.parametrize("loss_cls", [SoftplusLoss, PointwiseHingeLoss, SoftPointwiseHingeLoss])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_delta_pointwise_loss_equals_pykeen(loss_cls: type[Loss], reduction: str) -> None:
    """The direct margin-activation formula has PyKEEN's value and gradients."""
    loss = loss_cls(reduction=reduction)
    if loss_cls is not SoftplusLoss:
        loss.margin = 0.7
    generator = torch.Generator().manual_seed(0)
    positive = (3 * torch.randn(11, 1, generator=generator, dtype=torch.float64)).requires_grad_()
    negative = (3 * torch.randn(11, 5, generator=generator, dtype=torch.float64)).requires_grad_()
    ours = delta_pointwise_loss(loss, positive, negative)
    assert ours is not None
    expected = loss.process_slcwa_scores(positive_scores=positive, negative_scores=negative)
    torch.testing.assert_close(ours, expected)
    for a, b in zip(
        torch.autograd.grad(ours, (positive, negative)), torch.autograd.grad(expected, (positive, negative))
    ):
        torch.testing.assert_close(a, b)


def test_delta_pointwise_loss_leaves_other_losses_to_pykeen() -> None:
    """Other losses and subclasses with their own forward use PyKEEN's processing."""

    class Scaled(SoftplusLoss):
        def forward(self, x, target, weight=None):
            return 2 * super().forward(x, target, weight)

    positive, negative = torch.zeros(3, 1), torch.zeros(3, 4)
    for loss in (BCEWithLogitsLoss(), MarginRankingLoss(), Scaled()):
        assert delta_pointwise_loss(loss, positive, negative) is None


@pytest.mark.parametrize("start", [0, -1, 2.9, True, "4"])
def test_subsampling_start_below_one_is_refused(factory: CoreTriplesFactory, start) -> None:
    """start=0 weighed pairs seen once c / 0 (NaN after normalizing); 2.9 was cut to 2."""
    with pytest.raises(ValueError, match="start must be an integer >= 1"):
        SubsamplingLossWeighter(factory.mapped_triples, start=start)
    weights = SubsamplingLossWeighter(factory.mapped_triples, start=1).weight_triples(factory.mapped_triples)
    assert bool(torch.isfinite(weights).all())


@pytest.mark.parametrize(
    ("loss", "setting", "value"),
    [
        (MarginRankingLoss(margin=1.0), "margin", 5.0),
        (NSSALoss(margin=9.0), "margin", 1.0),
        (NSSALoss(), "inverse_softmax_temperature", 5.0),
    ],
)
def test_a_loss_setting_changed_between_steps_counts(loss: Loss, setting: str, value: float) -> None:
    """The summing copy was made once per loss: a margin a callback changed after the first step was ignored."""
    from pykeen_bess.nn.loss import summed_loss

    generator = torch.Generator().manual_seed(0)
    positive = torch.randn(4, 1, generator=generator, dtype=torch.float64)
    negative = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    before = summed_loss(loss, positive, negative)
    setattr(loss, setting, value)
    summed = summed_loss(loss, positive, negative)
    assert before is not None and summed is not None
    total, per_positive = summed
    expected = loss.process_slcwa_scores(positive_scores=positive, negative_scores=negative)
    torch.testing.assert_close(total / (4 * per_positive), expected)
    assert not torch.allclose(before[0], total)


def test_the_weight_convention_depends_on_the_reduction() -> None:
    """A weighted run with reduction="sum" cached "count" for the class: a later "mean" run divided wrongly."""
    from pykeen_bess.nn import loss as bess_loss

    bess_loss._CONVENTIONS.clear()
    assert bess_loss.weight_convention(SoftplusLoss(reduction="sum")) == "count"
    assert bess_loss.weight_convention(SoftplusLoss(reduction="mean")) == "sum"
    assert bess_loss.weight_convention(BCEWithLogitsLoss(reduction="mean")) == "count"


def test_a_relation_weighter_subclass_weighing_by_entity_is_refused(factory: CoreTriplesFactory) -> None:
    """Only RelationLossWeighter's own __call__ gives a negative its positive's weight."""

    class ByTail(RelationLossWeighter):
        def __call__(self, h, r, t):
            return super().__call__(h, r, t) * (1.0 + (t % 3))

    partition = ShardPairPartition.from_triples(factory.mapped_triples, EntitySharding.create(factory.num_entities, 2))
    weights = torch.ones(factory.num_relations)
    with pytest.raises(ValueError, match="ByTail depends on the negative entity"):
        partition_weights(ByTail(weights), SoftplusLoss(), partition)
    assert partition_weights(RelationLossWeighter(weights), SoftplusLoss(), partition) is not None
    assert partition_weights(ByTail(weights), WeightedNSSALoss(), partition) is not None


def test_a_loss_whose_count_cannot_be_measured_does_not_decide_for_its_class() -> None:
    """A first run with MarginRankingLoss(margin=-10) (a zero mean on the probe) cached "no count" for the class:
    every later run of the class in the process scaled the mean instead of summing (other rounding)."""
    from pykeen.losses import MarginRankingLoss

    from pykeen_bess.nn import loss as bess_loss
    from pykeen_bess.nn.loss import summed_loss

    bess_loss._PER_POSITIVE.clear()
    positive, negative = torch.zeros(4, 1, dtype=torch.float64), torch.ones(4, 3, dtype=torch.float64)
    assert summed_loss(MarginRankingLoss(margin=-10.0), positive, negative) is None
    summed = summed_loss(MarginRankingLoss(margin=1.0), positive, negative)
    assert summed is not None and summed[1] == 3
    assert summed_loss(MarginRankingLoss(margin=-10.0), positive, negative) is not None  # the class's count
