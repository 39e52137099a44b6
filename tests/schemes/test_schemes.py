"""The BESS step: sharded scores equal unsharded scores, and both exchange schemes agree."""

from __future__ import annotations

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.losses import SoftplusLoss
from pykeen.models import ComplEx, DistMult, PairRE, RotatE, TransE

from pykeen_bess.distributed import LocalTopology
from pykeen_bess.nn.loss import block_loss
from pykeen_bess.nn.models import InterHT
from pykeen_bess.data.partition import ShardPairPartition
from pykeen_bess.tables.representation import ShardedEmbedding
from pykeen_bess.data.sampling import BessSampler, StepSharedBessSampler
from pykeen_bess.schemes import choose_scheme, exchange_cost, resolve_scheme
from pykeen_bess.scoring import get_scorer
from pykeen_bess.data.sharding import EntitySharding
from reference import reference_scores

MODELS = {
    "DistMult": (DistMult, dict(embedding_dim=6)),
    "TransE": (TransE, dict(embedding_dim=6, scoring_fct_norm=2)),
    "ComplEx": (ComplEx, dict(embedding_dim=4)),
    "RotatE": (RotatE, dict(embedding_dim=4)),
    "PairRE": (PairRE, dict(embedding_dim=6, p=2)),
    "InterHT": (InterHT, dict(embedding_dim=5)),  # two entity representations
}


@pytest.fixture(scope="module")
def dataset() -> Nations:
    return Nations()


def make_setup(
    dataset: Nations,
    model_name: str,
    n_shard: int,
    corruption: str = "ht",
    block_size: int = 6,
    step: int = 0,
    sampler_class: type[BessSampler] = BessSampler,
    num_negs_per_pos: int | None = None,
):
    cls, kwargs = MODELS[model_name]
    model = cls(triples_factory=dataset.training, random_seed=0, **kwargs).double()
    model.post_parameter_update()  # re-apply constraints (e.g. RotatE's unit-modulus relations) in float64
    sharding = EntitySharding.create(dataset.num_entities, n_shard, seed=1)
    tables = []
    for embedding in model.entity_representations:
        table = ShardedEmbedding(embedding, sharding, range(n_shard))
        table.copy_from(embedding)
        tables.append(table)
    partition = ShardPairPartition.from_triples(dataset.training.mapped_triples, sharding)
    negatives = num_negs_per_pos or 2 * n_shard
    sampler = sampler_class(partition, block_size=block_size, num_negs_per_pos=negatives, corruption=corruption, seed=2)
    batch = list(sampler.epoch(1))[step]
    return model, sharding, tables, batch


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("n_shard", [1, 2, 3])
@pytest.mark.parametrize("scheme", ["embedding", "score"])
def test_sharded_scores_equal_unsharded_scores(dataset: Nations, model_name: str, n_shard: int, scheme: str) -> None:
    model, sharding, tables, batch = make_setup(dataset, model_name, n_shard)
    step = resolve_scheme(scheme)(model, tables, get_scorer(model.interaction), LocalTopology(n_shard))
    scores = step.scores(batch, step.gather(batch))
    positive, negative = reference_scores(model, sharding, batch)
    valid = batch.valid
    torch.testing.assert_close(scores.positive[valid], positive[valid], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(scores.negative[valid], negative[valid], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_name", ["DistMult", "ComplEx", "TransE"])
@pytest.mark.parametrize("scheme", ["embedding", "score"])
def test_inner_products_score_positives_with_their_queries(dataset: Nations, model_name: str, scheme: str) -> None:
    """Inner-product scorers score the positives from the negatives' queries, and both sides' negatives at once.

    One query per positive instead of two (the positive's and its side's), and one product for the
    negatives of both sides (their candidates are the same); a distance by norm expansion would lose the
    precision of small (positive) distances, so it keeps PyKEEN's interaction for the positives.
    """
    model, sharding, tables, batch = make_setup(dataset, model_name, 2)
    assert 0 < batch.num_head_corrupted < batch.block_size  # both sides in the step
    scorer = get_scorer(model.interaction)
    step = resolve_scheme(scheme)(model, tables, scorer, LocalTopology(2))
    calls = {"score_triples": 0, "query": 0, "negative_scores": 0}

    def counted(owner, name):
        method = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return method(*args, **kwargs)

        setattr(owner, name, wrapper)

    counted(scorer, "score_triples")
    counted(scorer, "query")
    counted(step, "negative_scores")
    scores = step.scores(batch, step.gather(batch))
    positive, negative = reference_scores(model, sharding, batch)
    torch.testing.assert_close(scores.positive[batch.valid], positive[batch.valid], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(scores.negative[batch.valid], negative[batch.valid], rtol=1e-9, atol=1e-9)
    inner = model_name != "TransE"
    assert calls == {"score_triples": 0 if inner else 1, "query": 2, "negative_scores": 1 if inner else 2}


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("n_shard", [2, 3])
@pytest.mark.parametrize("scheme", ["embedding", "score"])
def test_step_shared_negatives_are_scored_once_with_the_per_block_result(
    dataset: Nations, model_name: str, n_shard: int, scheme: str
) -> None:
    """negatives="step": the one-set path gathers each negative row once and gives the per-block path's scores,
    loss and gradients (the same plan scored block by block)."""
    results = []
    for shared in (True, False):
        model, sharding, tables, batch = make_setup(dataset, model_name, n_shard, sampler_class=StepSharedBessSampler)
        assert batch.shared_negatives
        batch.shared_negatives = shared
        step = resolve_scheme(scheme)(model, tables, get_scorer(model.interaction), LocalTopology(n_shard))
        gathered = step.gather(batch)
        assert gathered.negatives.shape == ((n_shard, 1, 1, 2) if shared else (n_shard, n_shard, n_shard, 2))
        scores = step.scores(batch, gathered)
        loss = block_loss(SoftplusLoss(), scores, batch.num_valid).sum()
        loss.backward()
        relation_grads = [p.grad.clone() for p in model.relation_representations.parameters()]
        results.append((scores, loss.detach(), gathered, relation_grads))
    (shared_scores, shared_loss, shared_rows, shared_relations), (scores, loss, rows, relations) = results
    positive, negative = reference_scores(model, sharding, batch)
    valid = batch.valid
    torch.testing.assert_close(shared_scores.negative[valid], negative[valid], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(shared_scores.positive[valid], positive[valid], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(shared_loss, loss)
    torch.testing.assert_close(shared_rows.rows, rows.rows)
    for a, b in zip(
        [leaf.grad for leaf in shared_rows.leaves] + shared_relations, [leaf.grad for leaf in rows.leaves] + relations
    ):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("scheme", ["embedding", "score"])
def test_step_shared_negatives_score_without_gradients(dataset: Nations, scheme: str) -> None:
    """Without gradients (K = 130: scores in rows padded for BLAS) the one-set path scores as the reference."""
    model, sharding, tables, batch = make_setup(
        dataset, "DistMult", 2, sampler_class=StepSharedBessSampler, num_negs_per_pos=130
    )
    step = resolve_scheme(scheme)(model, tables, get_scorer(model.interaction), LocalTopology(2))
    with torch.no_grad():
        scores = step.scores(batch, step.gather(batch))
    _, negative = reference_scores(model, sharding, batch)
    assert scores.negative.shape == (2, 2, 6, 130)
    torch.testing.assert_close(scores.negative[batch.valid], negative[batch.valid], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_name", ["DistMult", "ComplEx", "InterHT"])
@pytest.mark.parametrize("n_shard", [1, 3])
@pytest.mark.parametrize("corruption", ["h", "t", "ht"])
def test_embedding_moving_equals_score_moving(dataset: Nations, model_name: str, n_shard: int, corruption: str) -> None:
    results = {}
    for scheme in ("embedding", "score"):
        model, _, tables, batch = make_setup(dataset, model_name, n_shard, corruption=corruption)
        step = resolve_scheme(scheme)(model, tables, get_scorer(model.interaction), LocalTopology(n_shard))
        gathered = step.gather(batch)
        loss = block_loss(SoftplusLoss(), step.scores(batch, gathered), batch.num_valid).sum()
        loss.backward()
        relation_grads = [p.grad.clone() for p in model.relation_representations.parameters()]
        results[scheme] = (loss.detach(), [leaf.grad.clone() for leaf in gathered.leaves], relation_grads)
    (loss_e, leaves_e, relations_e), (loss_s, leaves_s, relations_s) = results["embedding"], results["score"]
    torch.testing.assert_close(loss_e, loss_s)
    for a, b in zip(leaves_e + relations_e, leaves_s + relations_s):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("n_shard", [1, 2])
def test_slices_add_up_to_the_step(dataset: Nations, n_shard: int) -> None:
    """Sub-batches (slices of the slot axis) give the same loss and gradients as the whole step."""
    outcomes = []
    for slices in ([(0, 6)], [(0, 2), (2, 5), (5, 6)]):
        model, _, tables, batch = make_setup(dataset, "DistMult", n_shard)  # DistMult regularizes relations
        step = resolve_scheme("embedding")(model, tables, get_scorer(model.interaction), LocalTopology(n_shard))
        gathered = step.gather(batch)
        total = 0.0
        for start, stop in slices:
            loss = block_loss(SoftplusLoss(), step.scores(batch, gathered, start, stop), batch.num_valid).sum()
            loss.backward()
            total += loss.item()
        outcomes.append(
            (total, gathered.leaves[0].grad.clone(), model.relation_representations[0]._embeddings.weight.grad.clone())
        )
    assert outcomes[0][0] == pytest.approx(outcomes[1][0], rel=1e-12)
    torch.testing.assert_close(outcomes[0][1], outcomes[1][1])
    torch.testing.assert_close(outcomes[0][2], outcomes[1][2])


def test_padding_slots_get_no_gradient(dataset: Nations) -> None:
    # the last step of an epoch has padding slots (and shardpairs differ in size)
    model, _, tables, batch = make_setup(dataset, "DistMult", 2, block_size=150, step=-1)
    assert not bool(batch.valid.all())
    step = resolve_scheme("embedding")(model, tables, get_scorer(model.interaction), LocalTopology(2))
    gathered = step.gather(batch)
    scores = step.scores(batch, gathered)
    block_loss(SoftplusLoss(), scores, batch.num_valid).sum().backward()
    # rows are exactly the real heads, tails and the negatives of blocks with real slots (plus the dummy row)
    rows = set(gathered.rows.tolist()) - {-1}
    size = tables[0].sharding.shard_size
    expected = set()
    for i in range(2):
        for j in range(2):
            valid = batch.valid[i, j]
            expected.update((i * size + batch.heads[i, j][valid]).tolist())
            expected.update((j * size + batch.tails[i, j][valid]).tolist())
            if bool(valid.any()):
                for k in range(2):
                    expected.update((k * size + batch.negatives[k, i, j]).tolist())
    assert rows == expected


def test_exchange_cost_model_prefers_score_moving_for_many_negatives() -> None:
    kwargs = dict(n_shard=4, block_size=32, entity_width=256, query_width=256)
    assert choose_scheme(num_negs_per_pos=64, **kwargs).get_name() == "embedding"
    assert choose_scheme(num_negs_per_pos=4096, **kwargs).get_name() == "score"
    assert exchange_cost("embedding", num_negs_per_pos=64, **kwargs) == 4 * (3 * 32 * 256 + 3 * 64 * 256)
    assert exchange_cost("score", n_shard=1, block_size=8, num_negs_per_pos=8, entity_width=4, query_width=4) == 0


def test_exchange_cost_model_knows_step_shared_negatives_move_once() -> None:
    """Negatives shared by all blocks: the embedding scheme all-gathers m rows per shard; the score scheme as before."""
    kwargs = dict(n_shard=4, block_size=64, num_negs_per_pos=1024, entity_width=512, query_width=513)
    assert exchange_cost("embedding", shared_negatives=True, **kwargs) == 4 * (3 * 64 * 512 + 3 * 256 * 512)
    assert exchange_cost("score", shared_negatives=True, **kwargs) == exchange_cost("score", **kwargs)
    assert choose_scheme(**kwargs).get_name() == "score"
    assert choose_scheme(shared_negatives=True, **kwargs).get_name() == "embedding"


@pytest.mark.parametrize("model_name", ["DistMult", "ComplEx", "InterHT"])
def test_one_lookup_of_all_roles_equals_a_lookup_per_role(dataset: Nations, model_name: str) -> None:
    """``RowLookup.roles`` returns what ``entities`` returns per role: rows, regularization, gradients."""
    from pykeen.regularizers import LpRegularizer

    from pykeen_bess.schemes.lookup import RowLookup
    from pykeen_bess.schemes.regularization import Accumulator

    model, _, tables, _ = make_setup(dataset, model_name, 2)
    tables[0].regularizer = LpRegularizer(weight=0.5, p=2.0)  # the first table regularized, others not
    lookup = RowLookup(model, tables)
    generator = torch.Generator().manual_seed(0)
    leaves = [torch.randn(9, table.row_width, dtype=torch.float64, generator=generator) for table in tables]
    indices = [torch.randint(9, (2, 1, 3), generator=generator), torch.randint(9, (4,), generator=generator)]
    role_weights = [
        lookup.role_weights(head=torch.tensor([[[1.0, 2.0, 0.0]], [[0.5, 1.0, 1.0]]], dtype=torch.float64)),
        [None] * len(tables),  # a role without regularization
    ]
    results = []
    for fused in (True, False):
        rows = [leaf.clone().requires_grad_() for leaf in leaves]
        normalized = [lookup.normalized_rows(table, leaf) for table, leaf in zip(tables, rows)]
        regularization = Accumulator()
        if fused:
            parts = lookup.roles(normalized, indices, regularization, role_weights)
        else:
            parts = [lookup.entities(normalized, i, regularization, w) for i, w in zip(indices, role_weights)]
        assert [part.shape[:-1] for part in parts] == [index.shape for index in indices]
        total = sum((part * (k + 1)).sum() for k, part in enumerate(parts)) + regularization.value
        total.backward()
        results.append(([part.detach() for part in parts], regularization.value, [row.grad for row in rows]))
    (fused_parts, fused_term, fused_grads), (parts, term, grads) = results
    assert float(term.detach()) > 0
    torch.testing.assert_close(fused_term, term)
    for a, b in zip(fused_parts + fused_grads, parts + grads):
        torch.testing.assert_close(a, b)


def test_split_parts_splits_the_slot_axis() -> None:
    from pykeen_bess.schemes.lookup import split_parts

    x = torch.arange(2 * 1 * 5 * 3).view(2, 1, 5, 3)
    first, second = split_parts(x, [slice(0, 2), slice(2, 5)])
    assert torch.equal(first, x[:, :, :2]) and torch.equal(second, x[:, :, 2:])
    pairs = split_parts((x, x + 1), [slice(0, 4), slice(4, 5)])
    assert torch.equal(pairs[1][1], (x + 1)[:, :, 4:]) and torch.equal(pairs[0][0], x[:, :, :4])
    (whole,) = split_parts(x, [slice(0, 5)])
    assert torch.equal(whole, x)


def test_plain_rows_equal_pykeens_plain_forward(dataset: Nations) -> None:
    """Relation rows of PyKEEN's embeddings (real, complex) equal ``_plain_forward``, gradients included; a
    representation of another class is asked itself."""
    from pykeen.nn.representation import LowRankRepresentation

    from pykeen_bess.schemes.lookup import plain_rows

    indices = torch.randint(0, dataset.training.num_relations, (2, 3, 4))
    for model_cls in (DistMult, ComplEx):
        model = model_cls(triples_factory=dataset.training, embedding_dim=4, random_seed=0)
        representation = model.relation_representations[0]
        weight = representation._embeddings.weight
        rows, expected = plain_rows(representation, indices), representation._plain_forward(indices=indices)
        assert rows.shape == expected.shape and rows.dtype == expected.dtype and torch.equal(rows, expected)
        grad = torch.randn_like(rows)
        (actual_grad,) = torch.autograd.grad(rows, weight, grad)
        (expected_grad,) = torch.autograd.grad(expected, weight, grad)
        assert torch.equal(actual_grad, expected_grad)
    low_rank = LowRankRepresentation(max_id=dataset.training.num_relations, shape=(4,), num_bases=2)
    torch.testing.assert_close(plain_rows(low_rank, indices), low_rank._plain_forward(indices=indices))


@pytest.mark.parametrize("model_name", ["ComplEx", "DistMult"])
@pytest.mark.parametrize("n_shard", [1, 3])
@pytest.mark.parametrize("step", [0, -1])  # the last step has padding slots
def test_l2_regularization_equals_pykeens_per_group(dataset: Nations, model_name: str, n_shard: int, step: int) -> None:
    """ComplEx's and DistMult's default regularizers (L2), computed once per step's row (complex ones on the real
    view): the term and the gradients (float64) of PyKEEN's regularizer run on the rows of every group of
    looked-up rows with one weight."""
    from pykeen_bess.schemes import lookup

    results = []
    for plain in (True, False):
        model, _, tables, batch = make_setup(
            dataset, model_name, n_shard, step=step, sampler_class=StepSharedBessSampler, num_negs_per_pos=2 * n_shard
        )
        model.train()
        scheme = resolve_scheme("embedding")(model, tables, get_scorer(model.interaction), LocalTopology(n_shard))
        with pytest.MonkeyPatch.context() as patch:
            if not plain:
                patch.setattr(lookup, "is_plain_l2", lambda regularizer, rows: False)
            gathered = scheme.gather(batch)
            scores = scheme.scores(batch, gathered)
        parameters = [*gathered.leaves, *model.relation_representations.parameters()]
        term = scores.regularization
        grads = torch.autograd.grad(term.sum(), parameters, retain_graph=True, allow_unused=True)
        loss = block_loss(SoftplusLoss(), scores, batch.num_valid).sum() + term.sum()
        results.append((term.detach(), grads, torch.autograd.grad(loss, parameters)))
    (term, grads, loss_grads), (expected, expected_grads, expected_loss_grads) = results
    assert float(expected.sum()) > 0 and term.shape == expected.shape and term.dtype == expected.dtype
    torch.testing.assert_close(term, expected, rtol=1e-12, atol=0.0)
    for a, b in zip([*grads, *loss_grads], [*expected_grads, *expected_loss_grads]):
        assert (a is None) == (b is None)  # DistMult regularizes its relations only
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("model_name", ["DistMult", "ComplEx"])
@pytest.mark.parametrize("n_shard", [1, 3])
def test_l2_terms_with_deferred_gradients_equal_autograds(dataset: Nations, model_name: str, n_shard: int) -> None:
    """A static step's L2 terms on its leaves and on the relation table: each term's value without an autograd node,
    its gradient added by the step (``add_term_gradients``), equal the terms differentiated by autograd (float64).
    Blocks of 64 slots look up more relations than there are (the relation term is then the table's, per relation).
    """
    import dataclasses

    from pykeen.regularizers import LpRegularizer

    from pykeen_bess.schemes.regularization import add_term_gradients

    model, _, tables, batch = make_setup(dataset, model_name, n_shard, block_size=64)
    for representation in (*tables, *model.relation_representations):  # every table regularized by L2
        representation.regularizer = LpRegularizer(weight=0.25, p=2.0, normalize=model_name == "ComplEx")
    step = resolve_scheme("embedding")(model, tables, get_scorer(model.interaction), LocalTopology(n_shard))
    relation_weight = model.relation_representations[0]._embeddings.weight
    results = []
    for deferred in (False, True):
        gathered = step.gather(batch)
        if deferred:
            gathered = dataclasses.replace(gathered, term_gradients=[])
        scores = step.scores(batch, gathered)
        total = scores.positive.sum() + (scores.negative * 0.5).sum() + scores.regularization.sum()
        targets = [*gathered.leaves, relation_weight]
        grads: list[torch.Tensor | None] = list(torch.autograd.grad(total, targets))
        add_term_gradients(gathered.term_gradients or (), targets, grads)
        assert scores.regularization.requires_grad != deferred
        results.append((scores.regularization.detach(), grads, len(gathered.term_gradients or ())))
    (term, grads, _), (deferred_term, deferred_grads, count) = results
    assert count == len(tables) + 1  # every entity table and the relation table
    assert float(term) > 0
    torch.testing.assert_close(deferred_term, term, rtol=1e-12, atol=0)
    for actual, expected in zip(deferred_grads, grads):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-15)


def test_deferred_l2_gradients_leave_a_gradient_shared_with_another_input_unchanged() -> None:
    """The backward pass may return one tensor as two inputs' gradients (``a + b``): a term's gradient is added to its
    own input's alone (in place only into a gradient no other input shares), equal to autograd's.
    """
    from pykeen.regularizers import LpRegularizer

    from pykeen_bess.schemes.regularization import Accumulator, add_term_gradients

    regularizer = LpRegularizer(weight=0.5, p=2.0)
    a = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(6, dtype=torch.float64)
    accumulator = Accumulator([])
    assert accumulator.add_l2(regularizer, a, weights, a)
    loss = ((a + b) ** 2).sum()
    grads: list[torch.Tensor | None] = list(torch.autograd.grad(loss, [a, b]))
    shared = grads[0] is grads[1] or grads[0].untyped_storage().data_ptr() == grads[1].untyped_storage().data_ptr()
    assert shared  # (torch's AddBackward passes one gradient on to both)
    before = grads[1].clone()
    add_term_gradients(accumulator.gradients, [a, b], grads)

    def term() -> torch.Tensor:
        return regularizer.weight * (a.norm(dim=-1) * weights).sum()

    expected = torch.autograd.grad(((a + b) ** 2).sum() + term(), [a, b])
    torch.testing.assert_close(grads[0], expected[0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grads[1], before, rtol=0, atol=0)
    torch.testing.assert_close(grads[1], expected[1], rtol=1e-12, atol=1e-15)
    # a gradient broadcast from one value (of a sum) is added to out of place
    broadcast: list[torch.Tensor | None] = list(torch.autograd.grad(a.sum(), [a]))
    assert broadcast[0].stride() == (0, 0)
    add_term_gradients(accumulator.gradients, [a], broadcast)
    torch.testing.assert_close(broadcast[0], torch.autograd.grad(a.sum() + term(), [a])[0], rtol=1e-12, atol=1e-15)
    # a gradient of its own is added to in place
    own = [torch.zeros(6, 4, dtype=torch.float64), None]
    memory = own[0].data_ptr()
    add_term_gradients(accumulator.gradients, [a, b], own)
    assert own[0].data_ptr() == memory
    torch.testing.assert_close(own[0], expected[0] - 2 * (a + b).detach(), rtol=1e-12, atol=1e-14)


def test_an_l2_term_is_deferred_only_for_rows_viewing_their_target_whole() -> None:
    """Rows that are not the target's memory in its layout (normalized, a slice), or no list: autograd's path."""
    from pykeen.regularizers import LpRegularizer

    from pykeen_bess.schemes.regularization import Accumulator

    regularizer = LpRegularizer(weight=1.0, p=2.0)
    leaf = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    weights = torch.ones(5, dtype=torch.float64)
    assert not Accumulator().add_l2(regularizer, leaf, weights, leaf)
    for rows in (leaf * 2.0, leaf[:4], leaf.view(5, 4, 2)[..., 0]):
        assert not Accumulator([]).add_l2(regularizer, rows, weights[: rows.shape[0]], leaf)
    complex_rows = torch.view_as_complex(leaf.view(5, 4, 2))
    accumulator = Accumulator([])
    assert accumulator.add_l2(regularizer, complex_rows, weights, leaf)
    (gradient,) = accumulator.gradients
    assert gradient.target is leaf and gradient.values.shape == leaf.shape
    torch.testing.assert_close(accumulator.value, leaf.detach().norm(dim=-1).sum().reshape(1))


def test_a_general_regularizer_sums_float64_rows_in_float64() -> None:
    """A regularizer built under ``torch.set_default_dtype(torch.float64)`` keeps PyKEEN's float32 term buffer:
    its terms on float64 rows were rounded to float32 (gloo ranks and logical shards, grouping their rows
    differently, then differed by 1e-10 in the parameters where float64 rounding is promised)."""
    from pykeen.regularizers import LpRegularizer

    from pykeen_bess.schemes.regularization import Accumulator, regularize

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 7, 5, dtype=torch.float64, generator=generator)
    weights = torch.tensor([[1.0, 1.0, 0.5, 0.5, 0.0, 1.0, 0.25]] * 2, dtype=torch.float64)
    regularizer = LpRegularizer(weight=0.3, p=3.0)  # not plain L2: PyKEEN's own forward per group
    assert regularizer.regularization_term.dtype == torch.float32  # as under a float64 default dtype
    accumulator = Accumulator(None)
    regularize(regularizer, rows, weights, accumulator)
    reference = Accumulator(None)
    regularize(LpRegularizer(weight=0.3, p=3.0).double(), rows, weights, reference)  # .double() converts the buffer
    per_row = torch.linalg.vector_norm(rows, ord=3, dim=-1)  # p = 3: each row's norm
    assert accumulator.value.dtype == torch.float64
    assert torch.equal(accumulator.value, reference.value)
    expected = regularizer.weight.double() * (weights * per_row).sum()  # (the weight buffer: 0.3 in float32 here)
    torch.testing.assert_close(accumulator.value.sum(), expected, rtol=1e-14, atol=0.0)
    assert regularizer.regularization_term.dtype == torch.float64
    bf16 = LpRegularizer(weight=0.3, p=3.0)
    regularize(bf16, rows.to(torch.bfloat16), weights, Accumulator(None))
    assert bf16.regularization_term.dtype == torch.float32  # narrower rows leave the term as it is


def test_an_integer_regularizer_weight_keeps_float64_l2_gradients_in_float64() -> None:
    """RESCAL's default regularizer has ``weight=10`` (an integer buffer): ``weight * scale`` was a float32 tensor,
    so the L2 term's gradient on float64 rows was rounded to float32 (parameters 2e-8 from PyKEEN's after one
    step, 5e-6 after an epoch)."""
    from pykeen.regularizers import LpRegularizer

    from pykeen_bess.schemes.regularization import l2_term

    generator = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, dtype=torch.float64, generator=generator)
    row_weights = torch.rand(6, dtype=torch.float64, generator=generator)
    gradients = []
    for weight in (10, 10.0):
        regularizer = LpRegularizer(weight=weight, p=2.0, normalize=True).double()  # (an integer weight stays one)
        rows = values.clone().requires_grad_(True)
        _, term = l2_term(regularizer, rows, row_weights)
        (grad,) = torch.autograd.grad(term.sum(), rows)
        gradients.append(grad)
    assert gradients[0].dtype == torch.float64
    assert torch.equal(gradients[0], gradients[1])
    # narrower rows keep the float32 weight and term (PyKEEN's term buffer): a bfloat16 weight 0.01 is 0.01001
    regularizer = LpRegularizer(weight=0.01, p=2.0, normalize=True)
    _, term = l2_term(regularizer, values.to(torch.bfloat16), row_weights.to(torch.bfloat16))
    assert term.dtype == torch.float32
