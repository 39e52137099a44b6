"""Tests for :mod:`pykeen_bess.evaluation.filtering`: the filter index against a Python-set reference."""

from __future__ import annotations

import pytest
import torch

from pykeen_bess.evaluation.filtering import BYTES_PER_TRIPLE, FilterIndex


def random_graph(seed: int, num_entities: int, num_relations: int, num_triples: int) -> torch.Tensor:
    """Random triples over few entities/relations, with many duplicates, shape ``[T, 3]``."""
    generator = torch.Generator().manual_seed(seed)
    triples = torch.stack(
        [
            torch.randint(num_entities, (num_triples,), generator=generator),
            torch.randint(num_relations, (num_triples,), generator=generator),
            torch.randint(num_entities, (num_triples,), generator=generator),
        ],
        dim=1,
    )
    # duplicate a third of the triples explicitly
    return torch.cat([triples, triples[: num_triples // 3]])


def reference_pairs(
    triples: torch.Tensor, side: str, known: torch.Tensor, relations: torch.Tensor
) -> set[tuple[int, int]]:
    """The ``(query index, entity)`` pairs by Python sets."""
    known_set = {tuple(t) for t in triples.tolist()}
    entities = {e for h, _, t in known_set for e in (h, t)}
    pairs = set()
    for i, (e, r) in enumerate(zip(known.tolist(), relations.tolist())):
        for candidate in entities:
            triple = (e, r, candidate) if side == "tail" else (candidate, r, e)
            if triple in known_set:
                pairs.add((i, candidate))
    return pairs


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("side", ["head", "tail"])
@pytest.mark.parametrize("declared_entities", [30, 2**40])
def test_matches_set_reference(seed: int, side: str, declared_entities: int):
    """Every answer of every query, once, with query indices ascending, as a set lookup finds them.

    With 2^40 declared entities the combined sort key would overflow int64: the two-sort build runs.
    """
    num_entities, num_relations = 30, 4
    triples = random_graph(seed, num_entities, num_relations, num_triples=400)
    index = FilterIndex.from_triples(triples, num_entities=declared_entities, num_relations=num_relations)
    generator = torch.Generator().manual_seed(100 + seed)
    # queries: half taken from the triples (non-empty answers), half random (possibly empty)
    batch = torch.cat(
        [
            triples[torch.randperm(len(triples), generator=generator)[:40]],
            random_graph(seed + 50, num_entities, num_relations, 40)[:40],
        ]
    )
    known, relations = (batch[:, 0], batch[:, 1]) if side == "tail" else (batch[:, 2], batch[:, 1])
    query_index, entities = index.filtered(side, known, relations)
    got = list(zip(query_index.tolist(), entities.tolist()))
    assert len(got) == len(set(got)), "pairs must be unique"
    assert set(got) == reference_pairs(triples, side, known, relations)
    assert bool((query_index[1:] >= query_index[:-1]).all())
    assert query_index.dtype == entities.dtype == torch.long


def test_memory_formula():
    """The index takes exactly BYTES_PER_TRIPLE bytes per distinct triple."""
    triples = random_graph(0, 50, 5, 1000)
    index = FilterIndex.from_triples(triples)
    distinct = len({tuple(t) for t in triples.tolist()})
    assert index.num_triples == distinct < len(triples)
    assert index.nbytes == BYTES_PER_TRIPLE[torch.int32] * distinct


def test_several_tensors_and_inference():
    """A list of triple tensors is concatenated; sizes are inferred from the ids."""
    triples = random_graph(1, 20, 3, 100)
    index = FilterIndex.from_triples([triples[:50], triples[50:]])
    assert (index.num_entities, index.num_relations) == (
        int(triples[:, [0, 2]].max()) + 1,
        int(triples[:, 1].max()) + 1,
    )
    reference = FilterIndex.from_triples(triples)
    for side in ("head", "tail"):
        assert torch.equal(getattr(index, side).keys, getattr(reference, side).keys)
        assert torch.equal(getattr(index, side).entities, getattr(reference, side).entities)


def test_empty_index_answers_nothing():
    """An index without triples returns no pairs."""
    index = FilterIndex.from_triples(torch.empty(0, 3, dtype=torch.long), num_entities=5, num_relations=2)
    query_index, entities = index.filtered("tail", torch.tensor([0, 4]), torch.tensor([1, 0]))
    assert query_index.numel() == entities.numel() == 0


@pytest.mark.parametrize(
    ("triples", "kwargs", "match"),
    [
        (torch.tensor([[0, 0, 5]]), {"num_entities": 5, "num_relations": 1}, "outside"),
        (torch.tensor([[0, 3, 1]]), {"num_entities": 5, "num_relations": 3}, "outside"),
        (torch.tensor([[-1, 0, 1]]), {"num_entities": 5, "num_relations": 1}, "outside"),
        (torch.tensor([[0, 1]]), {}, r"\[T, 3\]"),
        ([], {}, r"\[T, 3\]"),
    ],
)
def test_invalid_triples(triples, kwargs, match):
    """Malformed triples and ids outside the given sizes are rejected."""
    with pytest.raises(ValueError, match=match):
        FilterIndex.from_triples(triples, **kwargs)


def test_invalid_side():
    """Only head and tail filtering exist."""
    index = FilterIndex.from_triples(torch.tensor([[0, 0, 1]]))
    with pytest.raises(ValueError, match="side"):
        index.filtered("relation", torch.tensor([0]), torch.tensor([0]))


def test_a_repeated_evaluation_reuses_the_filter_index_until_the_triples_change() -> None:
    """Early stopping evaluates the same validation triples again: the second evaluation builds nothing.

    Neither the filter index nor the excluded pairs of either target; other known triples, other
    evaluation triples or another sharding build them again.
    """
    from unittest import mock

    from pykeen.datasets import Nations
    from pykeen.models import DistMult

    from pykeen_bess.evaluation import BessEvaluator
    from pykeen_bess.evaluation.excluded import ExcludedPairs
    from pykeen_bess.evaluation.filtering import FilterIndex

    data = Nations()
    model = DistMult(triples_factory=data.training, embedding_dim=8, random_seed=0)
    evaluator = BessEvaluator(num_shards=2)
    training = data.training.mapped_triples.clone()
    kwargs = dict(additional_filter_triples=[training], use_tqdm=False)
    with (
        mock.patch.object(FilterIndex, "from_triples", wraps=FilterIndex.from_triples) as built,
        mock.patch.object(ExcludedPairs, "build", wraps=ExcludedPairs.build) as pairs,
    ):
        first = evaluator.evaluate(model, data.validation.mapped_triples, **kwargs).to_flat_dict()
        assert (built.call_count, pairs.call_count) == (1, 2)
        second = evaluator.evaluate(model, data.validation.mapped_triples, **kwargs).to_flat_dict()
        assert (built.call_count, pairs.call_count) == (1, 2) and first == second
        training[0, 2] = (training[0, 2] + 1) % data.num_entities  # changed in place: another filter
        evaluator.evaluate(model, data.validation.mapped_triples, **kwargs)
        assert (built.call_count, pairs.call_count) == (2, 4)
        evaluator.evaluate(model, data.testing.mapped_triples, **kwargs)  # other evaluation triples (filtered too)
        assert (built.call_count, pairs.call_count) == (3, 6)
        evaluator.num_shards = 3  # another sharding: the same filter index, other candidate columns
        evaluator.evaluate(model, data.testing.mapped_triples, **kwargs)
        assert (built.call_count, pairs.call_count) == (3, 8)


def _same_crc32_other_heads(triples: torch.Tensor, column: int = 0) -> torch.Tensor:
    """Return ``triples`` with bit 0 of some ids of ``column`` flipped such that their CRC-32 is unchanged.

    CRC-32 is affine over GF(2): the changes of flipping one bit each are combined by Gaussian elimination.
    """
    import zlib

    def crc(tensor: torch.Tensor) -> int:
        return zlib.crc32(tensor.contiguous().numpy().view("uint8").data)

    base = crc(triples)
    basis: dict[int, tuple[int, set[int]]] = {}
    for row in range(triples.shape[0]):
        flipped = triples.clone()
        flipped[row, column] ^= 1
        delta, rows = crc(flipped) ^ base, {row}
        for bit in range(31, -1, -1):
            if not (delta >> bit) & 1:
                continue
            if bit not in basis:
                basis[bit] = (delta, rows)
                break
            delta, rows = delta ^ basis[bit][0], rows ^ basis[bit][1]
        if delta == 0:
            other = triples.clone()
            other[sorted(rows), column] ^= 1
            assert crc(other) == base and not torch.equal(other, triples)
            return other
    raise AssertionError("no combination found")


@pytest.mark.parametrize("changed", ["filter", "evaluation"])
def test_other_triples_of_the_same_crc32_build_their_own_filter_index_and_pairs(changed: str) -> None:
    """The caches were keyed on a CRC-32 of the triples: other triples of the same CRC-32 (easy to make, it is
    linear) got the earlier triples' filter index or excluded pairs, and other metrics than PyKEEN's."""
    from pykeen.datasets import Nations
    from pykeen.evaluation import RankBasedEvaluator
    from pykeen.models import DistMult

    from pykeen_bess.evaluation import BessEvaluator

    data = Nations()
    model = DistMult(triples_factory=data.training, embedding_dim=8, random_seed=0)
    training, testing = data.training.mapped_triples, data.testing.mapped_triples
    evaluator = BessEvaluator()
    evaluator.evaluate(model, testing, additional_filter_triples=[training], use_tqdm=False)
    if changed == "filter":
        training = _same_crc32_other_heads(training)
    else:
        testing = _same_crc32_other_heads(testing, column=2)
    again = evaluator.evaluate(model, testing, additional_filter_triples=[training], use_tqdm=False)
    expected = RankBasedEvaluator().evaluate(model, testing, additional_filter_triples=[training], use_tqdm=False)
    assert again.to_flat_dict() == expected.to_flat_dict()


@pytest.mark.parametrize("num_shards", [1, 3])
def test_excluded_pairs_are_laid_out_in_block_order(num_shards: int):
    """Each batch's pairs: padding first, then by shard position and column; a block's pairs are one key range.

    The table holds the same pairs as the flat arrays (sorted by query), and ``PairsByBlock`` cuts
    exactly the pairs of every block (shard position, ``start:stop``) from a batch's.
    """
    from pykeen.datasets import Nations
    from pykeen.models import DistMult

    from pykeen_bess.evaluation.excluded import ExcludedPairs, PairsByBlock
    from pykeen_bess.evaluation.sharded import ShardedScoring

    data = Nations()
    model = DistMult(triples_factory=data.training, embedding_dim=8, random_seed=0)
    scoring = ShardedScoring.for_model(model, num_shards=num_shards)
    triples = data.testing.mapped_triples
    index = FilterIndex.from_triples([data.training.mapped_triples, triples], data.num_entities, data.num_relations)
    heads, relations, tails = triples.unbind(dim=1)
    batch_size = 50
    pairs = ExcludedPairs.build(scoring, index, "tail", heads, relations, tails, batch_size=batch_size)
    num_columns = max(scoring.candidate_counts)
    table, flat = set(), set()
    for number in range(pairs.rows.shape[0]):
        rows, positions, columns = pairs.rows[number], pairs.positions[number], pairs.columns[number]
        key = ExcludedPairs.block_key(positions, columns, num_columns)
        by_block = PairsByBlock((rows, positions, columns), scoring.candidate_counts, 4)
        assert torch.equal(key, key.sort().values)
        real = pairs.query[(pairs.query // batch_size) == number].shape[0]
        assert (positions[: positions.shape[0] - real] == -1).all()  # the padding comes first
        for row, position, column in zip(rows.tolist(), positions.tolist(), columns.tolist()):
            if position >= 0:
                table.add((number * batch_size + row, position, column))
        for position in range(len(scoring.local_shards)):
            count = scoring.candidate_counts[position]
            for start in range(0, count, 4):
                stop = min(start + 4, count)
                block_rows, block_positions, block_columns = by_block.of_block(position, start)
                inside = (positions == position) & (columns >= start) & (columns < stop)
                assert (block_positions == position).all() and ((block_columns >= start) & (block_columns < stop)).all()
                assert torch.equal(block_rows, rows[inside]) and torch.equal(block_columns, columns[inside])
    local = pairs.position >= 0
    flat = set(zip(pairs.query[local].tolist(), pairs.position[local].tolist(), pairs.column[local].tolist()))
    assert table == flat and len(flat) > 0
