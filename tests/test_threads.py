"""Tests for :mod:`pykeen_bess.runtime.threads`: the thread policies, their schedule and use by loop and evaluator."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.models import DistMult

from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.runtime.threads import (
    AdaptiveThreads,
    FixedThreads,
    KeepThreads,
    ThreadPolicy,
    resolve_threads,
    threads_per_process,
    usable_cores,
)
from pykeen_bess.training import BessTrainingLoop


class FakeClock:
    """A clock that each unit advances by the time the test assigns to its thread count."""

    def __init__(self, seconds_per_threads: dict[int, float]):
        self.seconds_per_threads = seconds_per_threads
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self) -> None:
        self.now += self.seconds_per_threads[torch.get_num_threads()]


def run_units(policy: ThreadPolicy, clock: FakeClock, count: int) -> list[int]:
    """Run ``count`` units; return the thread count of each."""
    used = []
    for _ in range(count):
        with policy.unit():
            used.append(torch.get_num_threads())
            clock.advance()
    return used


@pytest.fixture
def restore_threads():
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize(("one", "two", "winner"), [(1.0, 3.0, 1), (1.0, 0.5, 2), (1.0, 0.95, 1)])
def test_adaptive_threads_keep_the_faster(restore_threads, one: float, two: float, winner: int):
    """Warm-up with the most threads, three alternating trial pairs, then the winner (more threads need a 10% gain)."""
    clock = FakeClock({1: one, 2: two})
    policy = AdaptiveThreads(2, warmup=2, rounds=3, retrial_units=20, clock=clock)
    used = run_units(policy, clock, 20)
    assert used[:8] == [2, 2, 1, 2, 1, 2, 1, 2]
    assert used[8:] == [winner] * 12
    assert policy.chosen == winner


def test_adaptive_threads_notice_a_later_neighbour(restore_threads):
    """The trial repeats every ``retrial_units`` units: a change of speed changes the choice."""
    clock = FakeClock({1: 1.0, 2: 0.5})  # idle: two threads are faster
    policy = AdaptiveThreads(2, warmup=1, rounds=2, retrial_units=10, clock=clock)
    used = run_units(policy, clock, 11)
    assert policy.chosen == 2 and used[5:11] == [2] * 6
    clock.seconds_per_threads = {1: 1.0, 2: 2.5}  # a busy neighbour: two threads are slower
    used = run_units(policy, clock, 10)
    assert used[:4] == [1, 2, 1, 2]  # the second trial (units 11-14)
    assert policy.chosen == 1 and used[4:] == [1] * 6


class FakeCpuClock:
    """The process' CPU time: a fake wall clock's advance times the cores each thread count keeps busy."""

    def __init__(self, clock: FakeClock, cores_busy: dict[int, float]):
        self.clock = clock
        self.cores_busy = cores_busy
        self.cpu = 0.0
        self.last_wall = clock.now

    def __call__(self) -> float:
        self.cpu += (self.clock.now - self.last_wall) * self.cores_busy[torch.get_num_threads()]
        self.last_wall = self.clock.now
        return self.cpu


def test_adaptive_threads_skip_trials_while_the_cores_are_free(restore_threads):
    """Units that keep all threads busy skip the trial; once a neighbour takes a core, the next trial runs."""
    clock = FakeClock({1: 1.0, 2: 0.6})
    cpu_clock = FakeCpuClock(clock, {1: 1.0, 2: 1.95})  # idle cores: both threads run all the time
    policy = AdaptiveThreads(2, warmup=2, rounds=3, retrial_units=10, clock=clock, cpu_clock=cpu_clock)
    assert run_units(policy, clock, 20) == [2] * 20
    # a neighbour: two threads get 1.3 cores and are slower than one
    clock.seconds_per_threads = {1: 1.0, 2: 1.5}
    cpu_clock.cores_busy = {1: 1.0, 2: 1.3}
    used = run_units(policy, clock, 12)  # trials are due at units 2, 12, 22, ...
    assert used[:8] == [2, 2, 1, 2, 1, 2, 1, 2]
    assert used[8:] == [1] * 4 and policy.chosen == 1


def test_adaptive_threads_trial_when_the_cores_are_shared(restore_threads):
    """Threads that do not get a core each (CPU time under 90% of 2 x wall) do not skip the trial."""
    clock = FakeClock({1: 1.0, 2: 0.95})
    cpu_clock = FakeCpuClock(clock, {1: 1.0, 2: 1.7})
    policy = AdaptiveThreads(2, warmup=2, rounds=3, retrial_units=20, clock=clock, cpu_clock=cpu_clock)
    used = run_units(policy, clock, 10)
    assert used == [2, 2, 1, 2, 1, 2, 1, 2, 1, 1]


def test_policies_restore_torch_threads(restore_threads):
    """Every policy leaves torch's thread count as it found it."""
    torch.set_num_threads(2)
    for policy in (FixedThreads(1), AdaptiveThreads(2, warmup=0), KeepThreads()):
        with policy.applied():
            with policy.unit():
                pass
        assert torch.get_num_threads() == 2


def test_resolve_threads(monkeypatch):
    """``"auto"`` measures on a CPU with several threads; GPUs, one thread and None keep torch's setting."""
    monkeypatch.setattr("pykeen_bess.runtime.threads.threads_per_process", lambda: 2)
    assert isinstance(resolve_threads("auto", "cpu"), AdaptiveThreads)
    assert isinstance(resolve_threads("auto", None), AdaptiveThreads)
    assert isinstance(resolve_threads("auto", "cuda"), KeepThreads)
    assert isinstance(resolve_threads(None, "cpu"), KeepThreads)
    assert isinstance(resolve_threads("keep", "cpu"), KeepThreads)  # the command line's name, in a configuration
    assert resolve_threads(3, "cpu").threads_for_unit() == 3
    monkeypatch.setattr("pykeen_bess.runtime.threads.threads_per_process", lambda: 1)
    assert isinstance(resolve_threads("auto", "cpu"), KeepThreads)
    for bad in ("many", 0, -1, True, 1.5):
        with pytest.raises(ValueError, match="num_threads"):
            resolve_threads(bad, "cpu")  # type: ignore[arg-type]


def test_pipeline_measures_the_threads_by_default(monkeypatch, restore_threads):
    """``pipeline()`` with the loop and the evaluator gets ``"auto"``: a busy neighbour on a shared CPU is noticed."""
    from pykeen.pipeline import pipeline

    monkeypatch.setattr("pykeen_bess.runtime.threads.threads_per_process", lambda: 2)
    before = torch.get_num_threads()
    result = pipeline(
        dataset="nations",
        model="DistMult",
        model_kwargs=dict(embedding_dim=8),
        training_loop="bess",
        evaluator="bess",
        training_kwargs=dict(num_epochs=1, batch_size=256, use_tqdm=False),
        evaluation_kwargs=dict(use_tqdm=False),
        random_seed=0,
    )
    assert isinstance(result.training_loop.thread_policy, AdaptiveThreads)
    assert BessEvaluator().num_threads == "auto"
    assert torch.get_num_threads() == before  # restored when the work ended


def test_usable_cores_respect_the_cgroup_quota(tmp_path, monkeypatch):
    """A CPU quota of 1.5 cores allows 2 threads; no quota leaves the affinity; LOCAL_WORLD_SIZE shares the cores."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")
    assert usable_cores(str(quota)) == 2
    quota.write_text("max 100000\n")
    assert usable_cores(str(quota)) == 8
    assert usable_cores(str(tmp_path / "missing")) == 8
    monkeypatch.setattr("pykeen_bess.runtime.threads.usable_cores", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert threads_per_process() == 2


@pytest.mark.parametrize("num_threads", [1, "auto", None])
def test_training_and_evaluation_equal_across_thread_settings(restore_threads, num_threads):
    """The thread setting changes no result: the loop and evaluator equal the run with torch's own setting."""
    dataset = Nations()
    results = []
    for setting in (None, num_threads):
        model = DistMult(triples_factory=dataset.training, embedding_dim=8, random_seed=0)
        loop = BessTrainingLoop(
            model=model, triples_factory=dataset.training, num_shards=2, num_threads=setting, optimizer="adam"
        )
        before = torch.get_num_threads()
        losses = loop.train(dataset.training, num_epochs=2, batch_size=256, use_tqdm=False)
        assert torch.get_num_threads() == before
        metrics = (
            BessEvaluator(num_threads=setting)
            .evaluate(
                model,
                dataset.testing.mapped_triples,
                additional_filter_triples=[dataset.training.mapped_triples],
                use_tqdm=False,
            )
            .to_flat_dict()
        )
        results.append((losses, [p.detach().clone() for p in model.parameters()], metrics))
    (losses, parameters, metrics), (other_losses, other_parameters, other_metrics) = results
    assert losses == pytest.approx(other_losses, rel=1e-6)
    for a, b in zip(parameters, other_parameters):
        torch.testing.assert_close(a, b)
    assert metrics == pytest.approx(other_metrics, rel=1e-6, nan_ok=True)


@pytest.mark.skipif(
    "OpenMP" not in torch.__config__.parallel_info() or not hasattr(os, "sched_getaffinity"),
    reason="torch without OpenMP, or not Linux",
)
def test_one_thread_here_leaves_the_other_threads_alone(restore_threads):
    """A helper thread's torch operations run on one thread; the process' default and the caller's count stay."""
    from pykeen_bess.runtime.threads import one_thread_here

    torch.set_num_threads(2)
    seen: dict[str, int] = {}

    def helper() -> None:
        one_thread_here()
        seen["helper"] = torch.get_num_threads()
        seen["sum"] = int(torch.ones(2**20).sum())  # a parallel region's size: runs, on one thread

    def other() -> None:
        seen["other"] = torch.get_num_threads()

    for target in (helper, other):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert seen == {"helper": 1, "sum": 2**20, "other": 2}
    assert torch.get_num_threads() == 2
