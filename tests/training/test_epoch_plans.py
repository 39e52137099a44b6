"""Tests for :class:`pykeen_bess.training.epoch_steps.EpochPlans`: epoch plans drawn ahead on threads that end."""

from __future__ import annotations

import threading
from typing import Any

import torch

from pykeen_bess.training.epoch_steps import EpochPlans


class _Sampler:
    """Draws an epoch's "plan" with a parallel torch operation (as the real draw does on large epochs)."""

    def __init__(self) -> None:
        self.drawn: list[int] = []

    def draw_epoch(self, epoch: int, num_steps: int) -> Any:
        self.drawn.append(epoch)
        keys = torch.randn(2**18, generator=torch.Generator().manual_seed(epoch))
        return epoch, torch.argsort(keys * 2.0)[:num_steps]


class _Static:
    num_steps = 4

    def host_plan(self, draws: Any) -> dict[str, torch.Tensor]:
        return {"order": draws[1]}


def _plan_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("bess-plan")]


def test_plans_are_drawn_ahead_on_threads_that_end():
    """Every epoch's plan is the one drawn for it; no drawing thread outlives its draw (an idle one would keep an
    OpenMP team, which slows every parallel region of the training step)."""
    sampler = _Sampler()
    plans = EpochPlans(sampler, _Static(), first=1, last=3)  # type: ignore[arg-type]
    try:
        for epoch in (1, 2, 3):
            draws, host = plans.get(epoch)
            assert draws[0] == epoch
            expected = torch.argsort(torch.randn(2**18, generator=torch.Generator().manual_seed(epoch)) * 2.0)[:4]
            assert torch.equal(host["order"], expected)
            for future in list(plans._pending.values()):
                future.result()  # the next epoch's draw has finished ...
            for thread in _plan_threads():
                thread.join(timeout=10)  # ... and its thread ends
            assert not _plan_threads()
    finally:
        plans.close()
    assert sampler.drawn == [1, 2, 3]  # each epoch once, none beyond the last


def test_close_waits_for_a_running_draw():
    """Closing while the next epoch is drawn waits for that draw (no thread is left behind)."""
    sampler = _Sampler()
    plans = EpochPlans(sampler, _Static(), first=1, last=5)  # type: ignore[arg-type]
    plans.get(1)  # the draw of epoch 2 starts
    plans.close()
    for thread in _plan_threads():
        thread.join(timeout=10)
    assert not _plan_threads()
    assert sampler.drawn[0] == 1 and set(sampler.drawn) <= {1, 2}
