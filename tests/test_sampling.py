"""Tests for the first stages: entity sharding, shardpair partition, balanced sampling."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

from pykeen_bess.data.partition import ShardPairPartition
from pykeen_bess.data.sampling import BessSampler, StepSharedBessSampler, resolve_negatives, slot_offsets
from pykeen_bess.data.sharding import EntitySharding


def random_triples(num_entities: int, num_relations: int, num_triples: int, seed: int = 0) -> torch.Tensor:
    """Random id-based triples (with duplicates)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack(
        [
            torch.randint(num_entities, (num_triples,), generator=generator),
            torch.randint(num_relations, (num_triples,), generator=generator),
            torch.randint(num_entities, (num_triples,), generator=generator),
        ],
        dim=1,
    )


# -- sharding -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_entities", "n_shard"), [(1, 1), (14, 1), (14, 3), (14, 14), (135, 4), (1000, 7)])
def test_sharding_is_a_balanced_bijection(num_entities: int, n_shard: int) -> None:
    sharding = EntitySharding.create(num_entities, n_shard, seed=1)
    assert sharding.shard_size == -(-num_entities // n_shard)
    counts = sharding.shard_counts
    assert int(counts.sum()) == num_entities
    assert int(counts.max() - counts.min()) <= 1
    assert sharding.num_padding == n_shard * sharding.shard_size - num_entities
    # global -> (shard, local) -> global is the identity, and every slot is used at most once
    entities = torch.arange(num_entities)
    shard, local = sharding.to_local(entities)
    assert torch.equal(sharding.to_global(shard, local), entities)
    assert len(set(zip(shard.tolist(), local.tolist()))) == num_entities
    # padding rows come after the real rows of a shard
    mask = sharding.padding_mask()
    assert torch.equal(mask.sum(dim=1), counts)
    assert all(bool(row[: int(count)].all()) for row, count in zip(mask, counts))


def test_sharding_depends_on_seed_only() -> None:
    a = EntitySharding.create(100, 4, seed=3)
    b = EntitySharding.create(100, 4, seed=3)
    c = EntitySharding.create(100, 4, seed=4)
    assert torch.equal(a.shard_entities, b.shard_entities)
    assert not torch.equal(a.shard_entities, c.shard_entities)


@pytest.mark.parametrize(("num_entities", "n_shard"), [(10, 0), (10, -1), (10, 11), (0, 1)])
def test_sharding_rejects_bad_shard_counts(num_entities: int, n_shard: int) -> None:
    with pytest.raises(ValueError):
        EntitySharding.create(num_entities, n_shard)


def test_sharding_refuses_fractions_negative_seeds_and_strategy_names() -> None:
    """2.7 shards became 2 and seed=-1 was taken (the sampler refuses it); a name failed with an AttributeError."""
    with pytest.raises(ValueError, match="num_shards must be an integer, but is 2.7"):
        EntitySharding.create(10, 2.7)
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        EntitySharding.create(10, 2, seed=-1)
    with pytest.raises(TypeError, match="strategy must be a ShardingStrategy.*resolve_sharding"):
        EntitySharding.create(10, 2, strategy="balanced")
    assert EntitySharding.create(10, torch.tensor(2), seed=np.int64(3)).n_shard == 2  # integers of any kind


# -- partition ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_shard", [1, 2, 3, 5])
def test_partition_groups_triples_by_shardpair(n_shard: int) -> None:
    triples = random_triples(50, 4, 600)
    sharding = EntitySharding.create(50, n_shard, seed=0)
    partition = ShardPairPartition.from_triples(triples, sharding)
    assert partition.num_triples == 600
    assert int(partition.pair_counts.sum()) == 600
    # the partition holds exactly the input triples (as a multiset), each in its shardpair
    assert torch.equal(partition.global_triples(), triples[partition.triple_ids])
    assert sorted(partition.triple_ids.tolist()) == list(range(600))
    head_shard, _ = sharding.to_local(triples[partition.triple_ids, 0])
    tail_shard, _ = sharding.to_local(triples[partition.triple_ids, 2])
    for i, j in itertools.product(range(n_shard), repeat=2):
        p = i * n_shard + j
        start, stop = partition.pair_offsets[p], partition.pair_offsets[p + 1]
        assert bool((head_shard[start:stop] == i).all()) and bool((tail_shard[start:stop] == j).all())


def test_partition_rejects_bad_triples() -> None:
    sharding = EntitySharding.create(5, 2)
    with pytest.raises(ValueError, match="outside"):
        ShardPairPartition.from_triples(torch.tensor([[0, 0, 5]]), sharding)
    with pytest.raises(ValueError, match="shape"):
        ShardPairPartition.from_triples(torch.tensor([0, 0, 1]), sharding)


def test_partition_is_vectorised() -> None:
    """Partitioning a million triples takes well under a second per million (no Python loop)."""
    triples = random_triples(100_000, 10, 1_000_000)
    sharding = EntitySharding.create(100_000, 4)
    start = time.perf_counter()
    ShardPairPartition.from_triples(triples, sharding)
    assert time.perf_counter() - start < 5.0


# -- sampler --------------------------------------------------------------------------------------


def make_sampler(
    n_shard: int = 3,
    block_size: int = 4,
    negatives: int = 6,
    corruption: str = "ht",
    num_entities: int = 40,
    num_triples: int = 300,
    seed: int = 0,
) -> BessSampler:
    sharding = EntitySharding.create(num_entities, n_shard, seed=seed)
    partition = ShardPairPartition.from_triples(random_triples(num_entities, 5, num_triples, seed=seed), sharding)
    return BessSampler(partition, block_size=block_size, num_negs_per_pos=negatives, corruption=corruption, seed=seed)


@pytest.mark.parametrize(("n_shard", "block_size"), [(1, 16), (2, 5), (3, 4), (4, 1)])
def test_epoch_presents_every_triple_exactly_once(n_shard: int, block_size: int) -> None:
    sampler = make_sampler(n_shard=n_shard, block_size=block_size, negatives=2 * n_shard)
    partition = sampler.partition
    seen = torch.zeros(partition.num_triples, dtype=torch.long)
    steps = 0
    for batch in sampler.epoch(1):
        steps += 1
        # n^2 equal blocks
        assert batch.heads.shape == batch.tails.shape == batch.valid.shape == (n_shard, n_shard, block_size)
        positions = batch.positions[batch.valid]
        seen.index_add_(0, positions, torch.ones_like(positions))
        # the ids of real slots are those of the triple at that position, in the block's shardpair
        pair = torch.arange(n_shard * n_shard).view(n_shard, n_shard, 1).expand_as(batch.valid)[batch.valid]
        assert bool((partition.pair_offsets[pair] <= positions).all())
        assert bool((positions < partition.pair_offsets[pair + 1]).all())
        assert torch.equal(batch.heads[batch.valid], partition.heads[positions])
        assert torch.equal(batch.relations[batch.valid], partition.relations[positions])
        assert torch.equal(batch.tails[batch.valid], partition.tails[positions])
        assert bool((batch.positions[~batch.valid] == -1).all())
    assert steps == len(sampler)
    assert bool((seen == 1).all())


def test_negatives_are_drawn_equally_from_every_shard_and_never_padding() -> None:
    sampler = make_sampler(n_shard=3, negatives=12, num_entities=40)  # 40 = 14 + 13 + 13: padding in two shards
    counts = sampler.partition.sharding.shard_counts
    for batch in sampler.epoch(1):
        assert batch.negatives.shape == (3, 3, 3, 4)
        assert bool((batch.negatives >= 0).all())
        assert bool((batch.negatives < counts.view(3, 1, 1, 1)).all())
    # uniform over a shard's real rows: every real row shows up over an epoch or two
    drawn = torch.cat([b.negatives[2].reshape(-1) for e in (1, 2) for b in sampler.epoch(e)])
    assert set(drawn.tolist()) == set(range(int(counts[2])))


def test_step_shared_negatives_are_one_set_per_step_drawn_equally_from_every_shard() -> None:
    """negatives="step": every block of a step gets the same m entities of every shard; the positives are unchanged."""
    plain = make_sampler(n_shard=3, negatives=12, num_entities=40)
    shared = StepSharedBessSampler(plain.partition, block_size=4, num_negs_per_pos=12, seed=0)
    counts = plain.partition.sharding.shard_counts
    steps = list(shared.epoch(1))
    assert len(steps) == len(plain)
    for batch, reference in zip(steps, plain.epoch(1)):
        assert torch.equal(batch.positions, reference.positions)
        assert batch.negatives.shape == (3, 3, 3, 4)
        assert bool((batch.negatives == batch.negatives[:, :1, :1]).all())  # one set for all blocks (i, j)
        assert bool((batch.negatives >= 0).all()) and bool((batch.negatives < counts.view(3, 1, 1, 1)).all())
    assert not all(torch.equal(a.negatives, b.negatives) for a, b in zip(steps, steps[1:]))  # a new set per step
    drawn = torch.cat([b.negatives[2, 0, 0] for e in range(1, 8) for b in shared.epoch(e)])
    assert set(drawn.tolist()) == set(range(int(counts[2])))
    assert resolve_negatives("step") is StepSharedBessSampler
    # one shard: the step's only block, as drawn by the per-block sampler
    single = make_sampler(n_shard=1, negatives=5)
    same = StepSharedBessSampler(single.partition, block_size=4, num_negs_per_pos=5, seed=0)
    assert all(torch.equal(a.negatives, b.negatives) for a, b in zip(single.epoch(1), same.epoch(1)))


def test_sampler_is_reproducible_per_epoch() -> None:
    first = [b.positions for b in make_sampler().epoch(2)]
    again = [b.positions for b in make_sampler().epoch(2)]
    other = [b.positions for b in make_sampler().epoch(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    negatives = [b.negatives for b in make_sampler().epoch(2)]
    assert all(torch.equal(a, b) for a, b in zip(negatives, [b.negatives for b in make_sampler().epoch(2)]))


@pytest.mark.parametrize(("corruption", "expected"), [("h", 6), ("t", 0), ("ht", 3)])
def test_corruption_layout(corruption: str, expected: int) -> None:
    batch = next(iter(make_sampler(block_size=6, corruption=corruption).epoch(1)))
    assert batch.num_head_corrupted == expected


@pytest.mark.parametrize("block_size", [6, 7])
def test_a_partly_filled_block_corrupts_both_sides(block_size: int) -> None:
    """With "ht" a block's real triples split about evenly between its head- and tail-corrupted slots.

    Filled in order, a block at most half full corrupted heads only (every step of a batch at least twice
    the training set; the epoch's last steps leaned to heads); a full block keeps its order.
    """
    h = block_size // 2
    real = torch.arange(block_size + 1).view(-1, 1)
    offsets, valid = slot_offsets(real, block_size, h)
    heads, tails = valid[:, :h].sum(dim=1), valid[:, h:].sum(dim=1)
    assert torch.equal(heads + tails, real.view(-1)) and bool(((heads - tails).abs() <= 1).all())
    assert torch.equal(offsets[-1], torch.arange(block_size)) and bool(valid[-1].all())  # full: in order
    for count, (row, held) in enumerate(zip(offsets, valid)):  # every real triple in exactly one slot
        assert sorted(row[held].tolist()) == list(range(count))
    for head_slots in (block_size, 0):  # corruption "h" or "t": in order, as before
        offsets, valid = slot_offsets(real, block_size, head_slots)
        assert torch.equal(valid, torch.arange(block_size).view(1, -1) < real)
    # a sampler whose only step is at most half full: both sides corrupted
    sampler = make_sampler(block_size=64, corruption="ht")
    batch = next(iter(sampler.epoch(1)))
    head_part, tail_part = batch.valid[..., : batch.num_head_corrupted], batch.valid[..., batch.num_head_corrupted :]
    assert int(tail_part.sum()) > 0 and abs(int(head_part.sum()) - int(tail_part.sum())) <= batch.valid.shape[0] ** 2


def test_empty_and_tiny_shardpairs_are_padded_not_oversampled() -> None:
    # entities 0..3: all triples go from shard(0) to shard(0) except one
    sharding = EntitySharding.create(4, 2, seed=0)
    shard_of = sharding.entity_shard
    same = [e for e in range(4) if shard_of[e] == shard_of[0]]
    other = [e for e in range(4) if shard_of[e] != shard_of[0]]
    triples = torch.tensor([[same[0], 0, same[-1]]] * 9 + [[same[0], 0, other[0]]])
    partition = ShardPairPartition.from_triples(triples, sharding)
    counts = partition.pair_counts
    assert int((counts == 0).sum()) == 2  # two empty shardpairs
    sampler = BessSampler(partition, block_size=2, num_negs_per_pos=2, corruption="t", seed=0)
    batches = list(sampler.epoch(1))
    assert len(batches) == 5  # ceil(9 / 2): the largest shardpair sets the epoch length
    seen = torch.cat([b.positions[b.valid] for b in batches])
    assert sorted(seen.tolist()) == list(range(10))  # the tiny shardpair's triple appears once
    assert sampler.padding_fraction == pytest.approx(1 - 10 / (5 * 8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(negatives=7), "multiple of num_shards"),
        (dict(negatives=0), "multiple of num_shards"),
        (dict(block_size=0), "block_size"),
        (dict(corruption="x"), "corruption"),
    ],
)
def test_sampler_rejects_bad_parameters(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_sampler(**kwargs)


def test_random_streams_are_derived_with_seed_sequence() -> None:
    """The epoch order and the negatives come from generators seeded by SeedSequence, not Python's hash()."""
    from pykeen_bess.data.seeds import derive_seed

    sampler = make_sampler()
    for epoch in (1, 2):
        expected = int(np.random.SeedSequence([sampler.seed, epoch, 0]).generate_state(1, np.uint64)[0]) & (2**63 - 1)
        assert derive_seed(sampler.seed, epoch, 0) == expected
        generator = torch.Generator().manual_seed(expected)
        keys = torch.rand(sampler.partition.num_triples, generator=generator, dtype=torch.float64)
        pair = torch.repeat_interleave(torch.arange(sampler.n_shard**2), sampler.partition.pair_counts.view(-1))
        assert torch.equal(sampler._epoch_order(epoch), torch.argsort(pair.to(torch.float64) + keys))


@pytest.mark.parametrize("sampler_class", [BessSampler, StepSharedBessSampler])
def test_an_epoch_drawn_at_once_or_from_device_draws_equals_the_step_by_step_epoch(sampler_class) -> None:
    """``epoch_plan`` (all steps at once) and ``draw_epoch`` + ``remaining_steps`` (a static step's) give ``epoch``."""
    base = make_sampler()
    sampler = sampler_class(base.partition, block_size=4, num_negs_per_pos=6, corruption="ht", seed=0)
    fields = ("heads", "relations", "tails", "valid", "positions", "negatives")
    for epoch in (1, 2):
        reference = list(sampler.epoch(epoch, steps_per_chunk=3))
        plan = sampler.epoch_plan(epoch)
        start = sampler.full_steps
        assert 0 < start < len(reference)
        draws = sampler.draw_epoch(epoch, start)
        order = torch.argsort(sampler.pair_keys() + draws.keys)
        rest = list(sampler.remaining_steps(draws, order.__getitem__, start).batches())
        for step, expected in enumerate(reference):
            batch = plan.batch(step)
            assert batch.step == expected.step == step
            for name in fields:
                assert torch.equal(getattr(batch, name), getattr(expected, name)), name
            if step < start:  # the full steps: no padding, and the negatives the draws hold
                assert bool(expected.valid.all())
                assert torch.equal(draws.negatives[step], expected.negatives)
                assert torch.equal(
                    order[sampler.partition.pair_offsets[:-1] + step * sampler.block_size],
                    expected.positions[..., 0].reshape(-1),
                )
            else:
                assert not bool(expected.valid.all())
                for name in fields:
                    assert torch.equal(getattr(rest[step - start], name), getattr(expected, name)), name


@pytest.mark.parametrize(
    ("block_size", "heads", "warned"), [(1, 0, True), (2, 1, False), (3, 1, True), (57, 28, False)]
)
def test_small_odd_blocks_say_how_few_heads_ht_corrupts(block_size: int, heads: int, warned: bool) -> None:
    """corruption='ht' splits a block's slots b // 2 : b - b // 2; one slot corrupts no head: said, not silent."""
    import warnings

    from pykeen_bess.data.slots import head_slots

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert head_slots(block_size, "ht") == heads
        assert head_slots(block_size, "h") == block_size and head_slots(block_size, "t") == 0
    assert bool([w for w in caught if "corruption='ht'" in str(w.message)]) == warned


@pytest.mark.parametrize("sampler_class", [BessSampler, StepSharedBessSampler])
def test_a_sharding_with_an_empty_shard_is_refused_for_uniform_negatives(sampler_class: type[BessSampler]) -> None:
    """Every shard gives ``m`` of each block's negatives: a shard without entities (PBG partitions of a typed graph)
    gave local id -1 (the eager and the static step then scored different rows, a process of several crashed).
    Typed negatives check every type of every shard themselves (refused as well)."""
    from pykeen_bess.data.sampling import TypedBessSampler
    from pykeen_bess.data.sharding import TypedSharding

    entity_types = torch.zeros(12, dtype=torch.long)
    strategy = TypedSharding(
        entity_types=entity_types, entity_partitions=torch.tensor([0] * 6 + [2] * 6), type_partitions=(3,)
    )
    sharding = EntitySharding.create(12, 3, strategy=strategy)
    assert sharding.shard_counts.tolist() == [6, 0, 6]
    generator = torch.Generator().manual_seed(0)
    triples = torch.stack([torch.randint(12, (40,), generator=generator), torch.zeros(40, dtype=torch.long),
                           torch.randint(12, (40,), generator=generator)], dim=1)  # fmt: skip
    partition = ShardPairPartition.from_triples(triples, sharding)
    with pytest.raises(ValueError, match=r"Shard\(s\) \[1\] of 3 hold no entity"):
        sampler_class(partition, block_size=4, num_negs_per_pos=3)
    with pytest.raises(ValueError, match="shard 1 holds none to draw negatives from"):  # (typed: its own check)
        TypedBessSampler(partition, block_size=4, num_negs_per_pos=3, entity_types=entity_types,
                         relation_sides=torch.zeros(1, 2, dtype=torch.long))  # fmt: skip
