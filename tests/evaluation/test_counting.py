"""Tests for :mod:`pykeen_bess.evaluation.counting`: the sign counting equals element-wise comparisons."""

from __future__ import annotations

import pytest
import torch

from pykeen_bess.evaluation.counting import RankCounts, count_block, subtraction_keeps_order


def counted(scores: torch.Tensor, true_scores: torch.Tensor, num_masked: torch.Tensor, exact: bool) -> torch.Tensor:
    """The ``[4, B]`` counts of one block."""
    counts = RankCounts.zeros(scores.shape[0], device=scores.device)
    count_block(scores, true_scores, num_masked, counts, exact=exact)
    return counts.stack()


def reference(scores: torch.Tensor, true_scores: torch.Tensor) -> torch.Tensor:
    """Larger, not smaller, finite and NaN counts by plain comparisons in float64 (masked entries NaN)."""
    scores, true_scores = scores.double(), true_scores.double().unsqueeze(1)
    return torch.stack(
        [
            (scores > true_scores).sum(dim=1),
            (scores >= true_scores).sum(dim=1),
            torch.isfinite(scores).sum(dim=1),
            torch.zeros(scores.shape[0], dtype=torch.long),
        ]
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 7, 5000])
def test_sign_counting_equals_comparisons(dtype: torch.dtype, width: int):
    """Ties, masked entries and chunks of several rows: the fast path counts exactly as the comparisons."""
    generator = torch.Generator().manual_seed(width)
    batch_size = 300  # several chunks for the wide block
    # small integers: many exact ties with the true score
    scores = torch.randint(-3, 4, (batch_size, width), generator=generator).to(dtype)
    true_scores = torch.randint(-3, 4, (batch_size,), generator=generator).to(dtype)
    mask = torch.rand(batch_size, width, generator=generator) < 0.2
    scores[mask] = float("nan")
    num_masked = mask.sum(dim=1)
    expected = reference(scores, true_scores)
    assert torch.equal(counted(scores, true_scores, num_masked, exact=False), expected)
    assert torch.equal(counted(scores, true_scores, num_masked, exact=True), expected)


def test_sign_counting_of_tiny_distinct_scores():
    """Scores differing only below the smallest normal number are ordered, not tied."""
    tiny = torch.finfo(torch.float32).tiny
    scores = torch.tensor([[1.5 * tiny, tiny, 0.5 * tiny, 2.0 * tiny]])
    true_scores = torch.tensor([tiny])
    assert subtraction_keeps_order(torch.device("cpu"), torch.float32)
    got = counted(scores, true_scores, torch.zeros(1, dtype=torch.long), exact=False)
    assert got[:2, 0].tolist() == [2, 3]


def test_flushed_subnormals_are_detected():
    """With subnormal results flushed to zero the evaluator must fall back to comparisons."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        assert not subtraction_keeps_order(torch.device("cpu"), torch.float32)
    finally:
        torch.set_flush_denormal(False)
    assert subtraction_keeps_order(torch.device("cpu"), torch.float32)
