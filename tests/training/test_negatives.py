"""The default negatives keep n shards' updates like one shard's: what keeps quality at n > 1 equal to n = 1.

Row-sparse Adam moves every row a step touches by about its learning rate, whatever the row's
gradient. With one set of negatives per block a step at ``n`` shards touches up to ``n ** 2`` times
as many negative rows as one shard's step, each for fewer positives, and filtered MRR at four
shards fell 0.01-0.03 below one shard's (``benchmarks/parity.py``). The default, one set per step,
touches as many as one shard does.
"""

from __future__ import annotations

import pytest
import torch
from pykeen.models import DistMult
from pykeen.training import TrainingCallback
from pykeen.triples import CoreTriplesFactory

from pykeen_bess.data.sampling import DEFAULT_NEGATIVES, NEGATIVES, StepSharedBessSampler
from pykeen_bess.training import BessTrainingLoop

NUM_ENTITIES = 20_000
NUM_TRIPLES = 1_024


@pytest.fixture(scope="module")
def factory() -> CoreTriplesFactory:
    """A sparse random graph: a batch of all its triples touches a small part of the entity table."""
    generator = torch.Generator().manual_seed(0)
    heads, tails = torch.randint(NUM_ENTITIES, (2, NUM_TRIPLES), generator=generator)
    relations = torch.randint(4, (NUM_TRIPLES,), generator=generator)
    mapped = torch.stack([heads, relations, tails], dim=1)
    return CoreTriplesFactory.create(mapped_triples=mapped, num_entities=NUM_ENTITIES, num_relations=4)


class InitialTable(TrainingCallback):
    """Keeps the entity table as the first step finds it (training resets the parameters first)."""

    table: torch.Tensor | None = None

    def pre_batch(self, **kwargs) -> None:
        if self.table is None:
            self.table = self.training_loop.tables[0].full_table().clone()


def rows_moved(factory: CoreTriplesFactory, num_shards: int, **loop_kwargs) -> int:
    """The entity rows one epoch of row-sparse Adam (PyKEEN's default optimizer) changes."""
    model = DistMult(triples_factory=factory, embedding_dim=8, regularizer=None, random_seed=0)
    loop = BessTrainingLoop(model=model, triples_factory=factory, num_shards=num_shards, **loop_kwargs)
    initial = InitialTable()
    loop.train(triples_factory=factory, num_epochs=1, batch_size=NUM_TRIPLES, use_tqdm=False, callbacks=initial)
    assert initial.table is not None
    return int((loop.tables[0].full_table() != initial.table).any(dim=1).sum())


def test_the_default_draws_one_set_per_step() -> None:
    assert NEGATIVES[DEFAULT_NEGATIVES] is StepSharedBessSampler
    assert NEGATIVES["uniform"] is NEGATIVES["block"]  # the earlier name of per-block negatives


def test_four_shards_move_as_many_rows_as_one(factory: CoreTriplesFactory) -> None:
    """With the defaults, an epoch at n = 4 moves about the rows n = 1 moves; per-block negatives move far more."""
    one = rows_moved(factory, 1)
    four = rows_moved(factory, 4)
    per_block = rows_moved(factory, 4, negatives="block")
    assert 0.9 * one <= four <= 1.15 * one, (one, four)
    assert per_block >= 1.3 * one, (one, per_block)  # what the default avoids
