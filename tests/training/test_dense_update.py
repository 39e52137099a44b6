"""The replicated parameters' update in a static step: the user's optimizer in its capturable form (a GPU's).

On a GPU, :class:`~pykeen_bess.training.steps.dense_update.DenseUpdate` runs the user's ``torch.optim`` optimizer
with ``capturable=True`` and the learning rate as a device tensor, and keeps the old values where the step's
loss was not finite. These tests run that form on the CPU (``tests/capturable.py``) in float64.
"""

from __future__ import annotations

import pytest
import torch

from pykeen_bess.distributed import LocalTopology
from pykeen_bess.tables.optim import BessOptimizer, RowwiseAdagrad
from pykeen_bess.training.steps.dense_update import DenseUpdate
from pykeen_bess.training.steps.static_rules import FusedRule, StepCounts, StepRows


@pytest.fixture(autouse=True)
def _float64_step_counts():
    """torch's optimizers count steps in the default dtype: the capturable form's bias correction uses it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


#: a step without table rows (only replicated parameters here)
NO_ROWS = StepRows(
    rows=torch.zeros(0, dtype=torch.long), first=torch.zeros(0, dtype=torch.bool), real=None, old=[], summed=[], most=0
)


def _update(optimizer_cls, parameters, lr: float, **options) -> tuple[DenseUpdate, BessOptimizer, torch.Tensor]:
    optimizer = BessOptimizer(optimizer_cls, parameters, [], dict(lr=lr, **options))
    learning_rate = torch.tensor(lr, dtype=torch.float64)
    dense = DenseUpdate(
        optimizer,
        [],
        LocalTopology(1),
        StepCounts(torch.device("cpu")),
        [learning_rate],
        on_the_host=lambda: False,  # a GPU's update
        fused=FusedRule(),
    )
    return dense, optimizer, learning_rate


@pytest.mark.parametrize(
    ("optimizer_cls", "options"),
    [
        (torch.optim.Adam, {}),
        (torch.optim.Adam, dict(amsgrad=True, weight_decay=0.1)),
        (torch.optim.AdamW, dict(weight_decay=0.1)),
        (torch.optim.RMSprop, dict(momentum=0.5)),
    ],
    ids=["Adam", "Adam-amsgrad", "AdamW", "RMSprop"],
)
def test_the_capturable_form_is_the_users_optimizer_and_a_non_finite_step_writes_nothing(
    optimizer_cls, options: dict
) -> None:
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(5, 3, dtype=torch.float64, generator=generator), torch.randn(4, dtype=torch.float64)]
    parameters = [torch.nn.Parameter(value.clone()) for value in values]
    reference = [torch.nn.Parameter(value.clone()) for value in values]
    reference_optimizer = optimizer_cls(reference, lr=0.05, **options)
    dense, optimizer, learning_rate = _update(optimizer_cls, parameters, 0.05, **options)
    assert dense.capturable and not dense.by_the_optimizer and dense.rule_obstacle is None
    for step, ok in enumerate([True, True, False, True, True]):
        grads = [torch.randn(value.shape, dtype=torch.float64, generator=generator) for value in values]
        if step == 3:  # a scheduler sets a new learning rate: the step reads the device tensor, refreshed later
            for group in optimizer.param_groups:
                group["lr"] = 0.02
        if step == 4:  # (the static step refreshes it when it loads an epoch)
            for group in reference_optimizer.param_groups:
                group["lr"] = 0.02
            learning_rate.fill_(0.02)
        before = (
            [p.detach().clone() for p in parameters],
            {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in parameters if optimizer.state[p]},
        )
        dense.apply([g.clone() for g in grads], None, torch.tensor(ok), NO_ROWS)
        if ok:
            for p, g in zip(reference, grads):
                p.grad = g
            reference_optimizer.step()
            for actual, expected in zip(parameters, reference):
                torch.testing.assert_close(actual.detach(), expected.detach(), rtol=1e-12, atol=1e-12)
        else:  # nothing written: parameters, moments and step counts as before
            for actual, old in zip(parameters, before[0]):
                assert torch.equal(actual.detach(), old)
            for p in parameters:
                for name, value in optimizer.state[p].items():
                    assert torch.equal(value, before[1][id(p)][name]), name
        assert all(p.grad is None for p in parameters)
    for group in optimizer.param_groups:  # the group's options are the user's again after every call
        assert group["capturable"] is False and group["lr"] == 0.02
    steps = [float(optimizer.state[p]["step"]) for p in parameters]
    assert steps == [4.0, 4.0]


def test_a_first_step_with_a_non_finite_loss_creates_no_state() -> None:
    parameter = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    dense, optimizer, _ = _update(torch.optim.Adam, [parameter], 0.1)
    dense.apply([torch.ones(3, dtype=torch.float64)], None, torch.tensor(False), NO_ROWS)
    assert not optimizer.state[parameter] and torch.equal(parameter.detach(), torch.ones(3, dtype=torch.float64))
    dense.apply([torch.ones(3, dtype=torch.float64)], None, torch.tensor(True), NO_ROWS)
    assert float(optimizer.state[parameter]["step"]) == 1.0
    assert torch.all(parameter.detach() < 1.0)


@pytest.mark.parametrize("optimizer_cls", [torch.optim.Adagrad, torch.optim.SGD, RowwiseAdagrad])
def test_optimizers_without_a_capturable_form_use_their_device_rule(optimizer_cls) -> None:
    parameter = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    dense, _, _ = _update(optimizer_cls, [parameter], 0.1)
    assert not dense.capturable and dense.rule_obstacle is None and not dense.by_the_optimizer


@pytest.mark.parametrize("chunk_bytes", [1 << 21, 3 * 8 * 8], ids=["runs", "chunks-of-3-rows"])
def test_every_entity_row_is_constrained_in_place_and_the_padding_left(monkeypatch, chunk_bytes: int) -> None:
    """After a dense update every entity's row is constrained (run by run of consecutive rows, in chunks on the CPU):
    equal to constraining the entities' rows selected one by one; the padding rows keep their values; a table whose
    rows' index is replaced (a reset) finds its runs again.
    """
    from pykeen.models import DistMult
    from pykeen.triples import CoreTriplesFactory

    from pykeen_bess.data.sharding import EntitySharding
    from pykeen_bess.tables import representation

    monkeypatch.setattr(representation, "CONSTRAINT_CHUNK_BYTES", chunk_bytes)
    factory = CoreTriplesFactory.create(mapped_triples=torch.tensor([[0, 0, 1]]), num_entities=22, num_relations=1)
    model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)
    sharding = EntitySharding.create(22, 3, seed=1)  # 8 rows per shard: shards 1 and 2 end with a padding row
    table = representation.ShardedEmbedding(model.entity_representations[0], sharding, [1, 2])  # two shards here
    table.copy_from(model.entity_representations[0])
    real = table.real_rows()
    padding = torch.ones(table.weight.shape[0], dtype=torch.bool)
    padding[real] = False
    assert padding.tolist() == [False] * 7 + [True] + [False] * 7 + [True]  # two runs of rows
    for scale in (3.0, 0.5):
        with torch.no_grad():
            table.weight.mul_(scale)  # rows off the unit sphere
            table.weight[padding] = 7.0
        expected = table.weight.detach().clone()
        expected[real] = table.constrain_values(expected[real])
        table.constrain_entity_rows()
        torch.testing.assert_close(table.weight.detach(), expected, rtol=0, atol=1e-15)
        assert bool((table.weight.detach()[padding] == 7.0).all())
        table.entity_rows = table.entity_rows.clone()  # a new index: its runs are found again


def test_column_parts_of_other_widths_constrain_the_same_chunks(monkeypatch) -> None:
    """A column part's constraint is a collective of all parts (whole rows' norms): parts of different widths
    (7 coordinates: 4 and 3) must run it on the same chunks of rows, or the processes would wait for each other;
    their runs stay whole (one collective per run, not per chunk of a large table).
    """
    from pykeen.models import DistMult
    from pykeen.triples import CoreTriplesFactory

    from pykeen_bess.data.sharding import EntitySharding
    from pykeen_bess.tables import representation

    monkeypatch.setattr(representation, "CONSTRAINT_CHUNK_BYTES", 3 * 7 * 8)  # 3 whole rows of float64
    factory = CoreTriplesFactory.create(mapped_triples=torch.tensor([[0, 0, 1]]), num_entities=22, num_relations=1)
    chunks = []
    for part, width in enumerate((4, 3)):
        model = DistMult(triples_factory=factory, embedding_dim=width, random_seed=0)
        table = representation.ShardedEmbedding(
            model.entity_representations[0], EntitySharding.create(22, 3, seed=1), [0, 1, 2]
        )
        table.hold_column_part(part, model.entity_representations[0], whole_width=7)
        chunks.append(representation.entity_row_chunks(table))
    assert chunks[0] == chunks[1] == [(0, 15), (16, 23)]  # shards 1 and 2 end with a padding row: two runs


def test_a_table_holding_no_entity_has_no_chunks_to_constrain() -> None:
    """A process may hold only empty shards (typed sharding of PyTorch-BigGraph's partitions): nothing to constrain."""
    from pykeen.models import DistMult
    from pykeen.triples import CoreTriplesFactory

    from pykeen_bess.data.sharding import EntitySharding
    from pykeen_bess.tables import representation

    factory = CoreTriplesFactory.create(mapped_triples=torch.tensor([[0, 0, 1]]), num_entities=4, num_relations=1)
    model = DistMult(triples_factory=factory, embedding_dim=3, random_seed=0)
    table = representation.ShardedEmbedding(model.entity_representations[0], EntitySharding.create(4, 2, seed=1), [0])
    table.entity_rows = torch.full_like(table.entity_rows, -1)  # (as a shard without entities)
    before = table.weight.detach().clone()
    assert representation.entity_row_chunks(table) == []
    table.constrain_entity_rows()
    torch.testing.assert_close(table.weight.detach(), before, rtol=0, atol=0)
