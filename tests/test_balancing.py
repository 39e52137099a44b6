"""Balanced sharding: equal shard sizes, equal shardpairs, reproducible, the loop's default, checkpoint guard."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.models import DistMult
from pykeen.training.training_loop import CheckpointMismatchError
from pykeen.triples import CoreTriplesFactory

from pykeen_bess.data.balancing import balance_shards, pair_counts
from pykeen_bess.data.sharding import BalancedSharding, EntitySharding, RandomSharding
from pykeen_bess.training import BessTrainingLoop


def hub_graph(num_entities: int = 3000, num_triples: int = 20000, seed: int = 0) -> torch.Tensor:
    """Triples whose ends follow a skewed (Zipf-like) law: a few hubs hold many triples, some self-loops."""
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, num_entities + 1, dtype=torch.float64) ** 0.9
    heads = torch.multinomial(weights, num_triples, replacement=True, generator=generator)
    tails = torch.multinomial(weights, num_triples, replacement=True, generator=generator)
    relations = torch.zeros(num_triples, dtype=torch.long)
    return torch.stack([heads, relations, tails], dim=1)


def random_assignment(num_entities: int, n: int, seed: int) -> torch.Tensor:
    permutation = torch.randperm(num_entities, generator=torch.Generator().manual_seed(seed))
    shard = torch.empty(num_entities, dtype=torch.long)
    shard[permutation] = torch.arange(num_entities) % n
    return shard


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_balancing_keeps_shard_sizes_and_evens_the_shardpairs(n: int) -> None:
    triples = hub_graph()
    heads, tails = triples[:, 0], triples[:, 2]
    start = random_assignment(3000, n, seed=1)
    before = pair_counts(start, heads, tails, n)
    balanced = balance_shards(start, heads, tails, n, torch.Generator().manual_seed(1), tolerance=0.0)
    after = pair_counts(balanced, heads, tails, n)
    assert torch.equal(torch.bincount(balanced, minlength=n), torch.bincount(start, minlength=n))
    assert int(after.sum()) == triples.shape[0]
    mean = triples.shape[0] / n**2
    assert int(before.max()) > 1.03 * mean  # the hubs unbalance a random assignment
    assert int(after.max()) < int(before.max())
    assert int(after.max()) <= 1.01 * mean


def test_balancing_is_reproducible_and_stops_at_the_tolerance() -> None:
    triples = hub_graph(seed=2)
    heads, tails = triples[:, 0], triples[:, 2]
    start = random_assignment(3000, 4, seed=0)
    first = balance_shards(start, heads, tails, 4, torch.Generator().manual_seed(5))
    again = balance_shards(start, heads, tails, 4, torch.Generator().manual_seed(5))
    assert torch.equal(first, again)
    # a tolerance the start already meets: nothing moves
    loose = balance_shards(start, heads, tails, 4, torch.Generator().manual_seed(5), tolerance=10.0)
    assert torch.equal(loose, start)
    # one shard, or no triples: nothing to balance
    one = torch.zeros(3000, dtype=torch.long)
    assert torch.equal(balance_shards(one, heads, tails, 1, torch.Generator()), one)
    empty = torch.zeros(0, dtype=torch.long)
    assert torch.equal(balance_shards(start, empty, empty, 4, torch.Generator()), start)


def test_balanced_sharding_deals_every_entity_once_in_equal_shards() -> None:
    triples = hub_graph()
    strategy = BalancedSharding.from_triples(triples)
    balanced = EntitySharding.create(3000, 7, seed=3, strategy=strategy)
    random = EntitySharding.create(3000, 7, seed=3, strategy=RandomSharding())
    assert torch.equal(balanced.shard_counts, random.shard_counts)
    real = balanced.shard_entities[balanced.shard_entities >= 0]
    assert torch.equal(real.sort().values, torch.arange(3000))
    assert torch.equal(balanced.to_global(balanced.entity_shard, balanced.entity_local), torch.arange(3000))
    heads, tails = triples[:, 0], triples[:, 2]
    block = 4  # slots per block: the epoch's steps follow the largest shardpair
    steps_random = math.ceil(int(pair_counts(random.entity_shard, heads, tails, 7).max()) / block)
    steps_balanced = math.ceil(int(pair_counts(balanced.entity_shard, heads, tails, 7).max()) / block)
    assert steps_balanced < steps_random
    assert steps_balanced <= 1.01 * math.ceil(triples.shape[0] / (49 * block)) + 1
    assert "balanced shardpairs" in balanced.describe()
    assert balanced.fingerprint != random.fingerprint
    # the same triples and seed give the same sharding (every process of a run computes its own)
    again = EntitySharding.create(3000, 7, seed=3, strategy=strategy)
    assert torch.equal(again.shard_entities, balanced.shard_entities)
    assert torch.equal(balanced.with_shards(7).shard_entities, balanced.shard_entities)


def test_balanced_sharding_rejects_triples_of_other_entities() -> None:
    with pytest.raises(ValueError, match="name entity id 10, but the model has 10 entities"):
        EntitySharding.create(10, 2, strategy=BalancedSharding.from_triples(torch.tensor([[0, 0, 10]])))


@pytest.fixture(scope="module")
def nations() -> Nations:
    return Nations()


def make_loop(factory: CoreTriplesFactory, **kwargs) -> BessTrainingLoop:
    model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)
    return BessTrainingLoop(model=model, triples_factory=factory, num_shards=2, optimizer="adam", **kwargs)


def test_the_loop_balances_by_default_and_takes_random(nations: Nations) -> None:
    factory = nations.training
    default = make_loop(factory)
    assert isinstance(default.sharding.strategy, BalancedSharding)
    assert isinstance(make_loop(factory, sharding="random").sharding.strategy, RandomSharding)
    with pytest.raises(ValueError, match="Unknown sharding='rows'"):
        make_loop(factory, sharding="rows")


def test_a_checkpoint_resumes_only_into_its_own_sharding(nations: Nations, tmp_path: pathlib.Path) -> None:
    factory = nations.training
    kwargs = dict(num_epochs=1, batch_size=256, use_tqdm=False, checkpoint_directory=tmp_path, checkpoint_frequency=0)
    make_loop(factory, sharding="random").train(factory, checkpoint_name="random.pt", **kwargs)
    # resuming with the default (balanced) sharding would read every row into another entity's place
    # the error names the checkpoint's sharding (found by its checksum) and how to resume with it
    with pytest.raises(
        CheckpointMismatchError, match=r"checkpoint's is shards=2, seed=0, assignment=\w+ \(random\)"
    ) as error:
        make_loop(factory).train(factory, checkpoint_name="random.pt", **{**kwargs, "num_epochs": 2})
    assert "dict(sharding='random')" in str(error.value) and "balanced shardpairs" in str(error.value)
    losses = make_loop(factory, sharding="random").train(
        factory, checkpoint_name="random.pt", **{**kwargs, "num_epochs": 2}
    )
    assert len(losses) == 2


def test_a_checkpoint_from_before_the_sharding_check_resumes_with_the_random_sharding(
    nations: Nations, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pykeen_bess.tables.representation import ShardedEmbedding

    factory = nations.training
    kwargs = dict(batch_size=256, use_tqdm=False, checkpoint_directory=tmp_path, checkpoint_frequency=0)
    # the uninterrupted run, and a checkpoint as versions before the check wrote it (the repr named no sharding)
    full = make_loop(factory, sharding="random").train(factory, num_epochs=3, **kwargs, checkpoint_name="full.pt")
    with monkeypatch.context() as patch:
        patch.setattr(ShardedEmbedding, "extra_repr", lambda self: "")
        make_loop(factory, sharding="random").train(factory, num_epochs=2, **kwargs, checkpoint_name="old.pt")
    with pytest.raises(CheckpointMismatchError, match="sharding='random'"):
        make_loop(factory).train(factory, num_epochs=3, **kwargs, checkpoint_name="old.pt")
    resumed = make_loop(factory, sharding="random").train(factory, num_epochs=3, **kwargs, checkpoint_name="old.pt")
    assert resumed == pytest.approx(full, rel=1e-9)


def test_resharding_checks_the_sharding_the_files_were_written_with(tmp_path: pathlib.Path) -> None:
    from pykeen_bess.training.checkpoints.stores import check_pointer_sharding

    triples = hub_graph(num_entities=300, num_triples=2000)
    balanced = EntitySharding.create(300, 4, seed=1, strategy=BalancedSharding.from_triples(triples))
    random = EntitySharding.create(300, 4, seed=1)
    path = tmp_path / "run.pt"
    written = dict(world_size=2, sharding=balanced.with_shards(2).fingerprint)
    check_pointer_sharding(path, written, balanced)  # the same triples and seed re-derive it
    with pytest.raises(ValueError, match="written with another sharding"):
        check_pointer_sharding(path, written, random)
    other = EntitySharding.create(300, 4, seed=1, strategy=BalancedSharding.from_triples(triples[:1000]))
    with pytest.raises(ValueError, match="training triples it was written with"):
        check_pointer_sharding(path, written, other)
    # pointers written before the sharding was recorded: the sharding was random
    check_pointer_sharding(path, dict(world_size=2), random)
    with pytest.raises(ValueError, match="random; not recorded"):
        check_pointer_sharding(path, dict(world_size=2), balanced)
