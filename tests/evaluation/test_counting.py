"""Tests for :mod:`pykeen_bess.evaluation.counting`: band counts, excluded pairs and PyKEEN's own comparisons."""

from __future__ import annotations

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.models import DistMult, TransE

from pykeen_bess.evaluation.counting import (
    band_bounds,
    band_scale,
    count_block,
    count_exactly,
    pykeen_comparisons,
    subtract_excluded,
)


def small_integers(batch_size: int, width: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and true scores of small integers: many exact ties."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (batch_size, width), generator=generator).to(dtype)
    true_scores = torch.randint(-3, 4, (batch_size,), generator=generator).to(dtype)
    return scores, true_scores


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 7, 5000])
def test_count_block_equals_comparisons(dtype: torch.dtype, width: int, chunked: bool):
    """Above / below the band, NaN and infinite scores, chunks of several rows: as plain comparisons in float64."""
    batch_size = 300  # several chunks for the wide block
    scores, true_scores = small_integers(batch_size, width, dtype, seed=width)
    scores[torch.rand(batch_size, width, generator=torch.Generator().manual_seed(1)) < 0.05] = float("nan")
    scores[0, 0] = float("inf")
    lower, upper = true_scores - 1, true_scores + 0.5
    counts = torch.zeros((2, batch_size), dtype=torch.long)
    sums = count_block(scores, lower, upper, counts, chunked=chunked)
    wide = scores.double()
    assert torch.equal(counts[0], (wide > upper.double().unsqueeze(1)).sum(dim=1))
    assert torch.equal(counts[1], (wide < lower.double().unsqueeze(1)).sum(dim=1))
    assert torch.equal(~torch.isfinite(sums), ~torch.isfinite(wide).all(dim=1))


def test_excluded_pairs_equal_masking():
    """Subtracting the excluded pairs' counts equals counting a block whose excluded entries were removed."""
    scores, true_scores = small_integers(50, 30, torch.float32, seed=0)
    lower, upper = band_bounds(true_scores, *band_scale(true_scores, torch.ones(50), 1.0), torch.tensor(1.0))
    generator = torch.Generator().manual_seed(2)
    # pairs of this block (position 1, columns 10..39) and of other blocks, padding included
    rows = torch.randint(50, (200,), generator=generator)
    columns = torch.randint(0, 60, (200,), generator=generator)
    positions = torch.randint(-1, 3, (200,), generator=generator)
    keys = torch.unique((rows * 60 + columns) * 4 + (positions + 1))  # each pair once
    rows, columns, positions = keys // 240, (keys // 4) % 60, keys % 4 - 1
    counts = torch.zeros((2, 50), dtype=torch.long)
    block = scores.clone()
    count_block(block, lower, upper, counts)
    subtract_excluded(block, lower, upper, counts, rows, positions, columns, position=1, start=10)
    masked = scores.clone()
    inside = (positions == 1) & (columns >= 10) & (columns < 40)
    masked[rows[inside], columns[inside] - 10] = float("nan")
    expected = torch.stack([(masked > upper.unsqueeze(1)).sum(1), (masked < lower.unsqueeze(1)).sum(1)])
    assert torch.equal(counts, expected)
    # the pairs of this block per row, for the band's collection
    again = torch.zeros((2, 50), dtype=torch.long)
    in_block = torch.zeros(50, dtype=torch.long)
    subtract_excluded(block, lower, upper, again, rows, positions, columns, position=1, start=10, in_block=in_block)
    values = block[rows[inside], columns[inside] - 10]
    pair_rows = rows[inside]
    above = torch.bincount(pair_rows[values > upper[pair_rows]], minlength=50)
    below = torch.bincount(pair_rows[values < lower[pair_rows]], minlength=50)
    assert torch.equal(again, -torch.stack([above, below]))
    assert torch.equal(in_block, torch.bincount(pair_rows, minlength=50))
    assert in_block.sum() > 0 and above.sum() > 0 and below.sum() > 0


def test_count_exactly():
    """Comparisons outside the band, options and NaN counts as PyKEEN's; the band is returned, not compared."""
    scores = torch.tensor([[3.0, 2.0, 2.0, 1.0, float("nan"), float("inf")], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    true_scores = torch.tensor([2.0, 1.0])
    excluded = torch.zeros(scores.shape, dtype=torch.bool)
    excluded[0, 0] = True
    counts = torch.zeros((4, 2), dtype=torch.long)
    # exact comparisons (empty band)
    band = count_exactly(scores, true_scores, true_scores, true_scores, excluded, counts)
    assert not band.any()
    assert counts.tolist() == [[1, 0], [3, 6], [3, 6], [1, 0]]
    # a band of half width 0.5 around the first query's true score: the two ties and nothing else
    counts.zero_()
    lower, upper = true_scores - torch.tensor([0.5, 0.0]), true_scores + 0.5
    band = count_exactly(scores, true_scores, lower, upper, excluded, counts)
    assert band[0].tolist() == [False, True, True, False, False, False]
    assert band[1].all()  # the second band has width 0.5 too
    assert counts[:, 0].tolist() == [1, 1, 3, 1]


def test_band_of_non_finite_true_scores_is_empty():
    """A NaN or infinite true score gets no band: its comparisons stay exact."""
    true_scores = torch.tensor([float("nan"), float("inf"), float("-inf"), 1.0])
    lower, upper = band_bounds(true_scores, *band_scale(true_scores, torch.ones(4), 16.0), torch.tensor(1.0))
    assert not (upper > lower)[:3].any()
    assert (upper > lower)[3]


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("target", ["head", "tail"])
@pytest.mark.parametrize("model_cls", [DistMult, TransE])
def test_pykeen_comparisons_equal_pykeens_rows(model_cls, target: str, inverse: bool):
    """Candidates compared by PyKEEN's scores of a few pairs: the comparisons of PyKEEN's full score rows.

    Chunks of one query are padded to two (PyKEEN orders its broadcast products by the shapes).
    """
    data = Nations(create_inverse_triples=inverse)
    model = model_cls(triples_factory=data.training, random_seed=0).eval()
    triples = data.testing.mapped_triples[:9]
    generator = torch.Generator().manual_seed(0)
    rows = torch.sort(torch.randint(9, (40,), generator=generator)).values
    entities = torch.randint(data.num_entities, (40,), generator=generator)
    with torch.inference_mode():
        scores = model.predict(triples, target=target)
        column = 2 if target == "tail" else 0
        true_scores = scores[torch.arange(9), triples[:, column]]
        candidate = scores[rows, entities]
        expected_larger = torch.zeros(9, dtype=torch.long).index_add_(0, rows, (candidate > true_scores[rows]).long())
        expected_not_smaller = torch.zeros(9, dtype=torch.long).index_add_(
            0, rows, (candidate >= true_scores[rows]).long()
        )
        for max_queries in (1, 4, 9):
            larger, not_smaller = pykeen_comparisons(model, target, triples, rows, entities, max_queries)
            assert torch.equal(larger, expected_larger)
            assert torch.equal(not_smaller, expected_not_smaller)
