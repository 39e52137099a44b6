"""Tests for :mod:`pykeen_bess.runtime.allocator`: the policies, their resolution, effect and use in the work."""

from __future__ import annotations

import logging
import platform
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.models import DistMult

from pykeen_bess.runtime.allocator import (
    HostAllocator,
    KeepAllocator,
    RetainFreedMemory,
    resolve_allocator,
    user_chose_allocator,
)
from pykeen_bess.evaluation import BessEvaluator
from pykeen_bess.training import BessTrainingLoop

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


class FakeLibc:
    """Records ``mallopt`` calls and answers them (1: accepted, 0: refused)."""

    def __init__(self, answer: int = 1):
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, parameter, value) -> int:
        self.calls.append((parameter.value, value.value))
        return self.answer


class RecordingAllocator(HostAllocator):
    """Counts how often the work applied it."""

    name = "recording"

    def __init__(self) -> None:
        self.applications = 0

    def apply(self) -> None:
        self.applications += 1


@pytest.fixture
def fresh_process_flag(monkeypatch):
    """Let a RetainFreedMemory apply again (the flag says whether this process was configured)."""
    monkeypatch.setattr(RetainFreedMemory, "applied", False)


def test_retain_freed_memory_sets_both_thresholds_once(fresh_process_flag):
    libc = FakeLibc()
    policy = RetainFreedMemory(mmap_threshold=8 * 2**20, trim_threshold=64 * 2**20, libc=libc)
    policy.apply()
    policy.apply()
    RetainFreedMemory(libc=libc).apply()  # mallopt is process-wide: a second policy changes nothing
    assert libc.calls == [(-3, 8 * 2**20), (-1, 64 * 2**20)]


def test_a_refused_setting_is_logged(fresh_process_flag, caplog):
    with caplog.at_level(logging.WARNING, logger="pykeen_bess.runtime.allocator"):
        RetainFreedMemory(libc=FakeLibc(answer=0)).apply()
    assert "refused mallopt(M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)" in caplog.text


@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"MALLOC_TOP_PAD_": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
        {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
        {"LD_PRELOAD": "libtcmalloc_minimal.so.4"},
    ],
)
def test_the_users_own_allocator_settings_are_left_alone(environ, monkeypatch):
    assert user_chose_allocator(environ)
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert isinstance(resolve_allocator("auto", "cpu"), KeepAllocator)


def test_resolve_allocator(monkeypatch):
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    assert not user_chose_allocator({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX"})
    assert isinstance(resolve_allocator(None, "cpu"), KeepAllocator)
    assert isinstance(resolve_allocator("keep", "cpu"), KeepAllocator)  # the command line's name, in a configuration
    assert isinstance(resolve_allocator("auto", "cuda:0"), KeepAllocator)  # the GPU's memory is torch's own
    policy = RecordingAllocator()
    assert resolve_allocator(policy, "cpu") is policy
    expected = RetainFreedMemory if GLIBC else KeepAllocator
    assert isinstance(resolve_allocator("auto", "cpu"), expected)
    assert isinstance(resolve_allocator("auto", None), expected)
    with pytest.raises(ValueError, match="host_allocator must be"):
        resolve_allocator("jemalloc", "cpu")


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator")
def test_freed_blocks_are_reused_without_page_faults():
    """The effect itself, in a fresh process: steps that free MiB-sized tensors stop faulting their pages in again."""
    script = textwrap.dedent(
        """
        import resource, torch
        from pykeen_bess.runtime.allocator import RetainFreedMemory

        def faults():
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(20):  # a "step": four 3 MiB tensors written, then freed
                blocks = [torch.empty(3 * 2**20 // 4).fill_(1.0) for _ in range(4)]
                del blocks
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

        faults()
        before = faults()
        RetainFreedMemory().apply()
        faults()
        print(before, faults())
        """
    )
    # glibc's initial mmap threshold (128 KiB), fixed: its dynamic adjustment after the first free depends on the
    # address-space layout (in about 1 of 4 fresh processes the blocks stayed on the heap without faults)
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 2**10)}
    output = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=environment
    ).stdout
    before, after = map(int, output.split())
    # every 3 MiB block is mapped and faulted in again every step (768 pages each)
    assert before > 20 * 1000
    assert after < 100


def test_the_loop_and_the_evaluator_apply_their_policy():
    dataset = Nations()
    model = DistMult(triples_factory=dataset.training, embedding_dim=8, random_seed=0)
    policy = RecordingAllocator()
    loop = BessTrainingLoop(
        model=model, triples_factory=dataset.training, num_shards=2, num_negs_per_pos=4, host_allocator=policy
    )
    assert loop.host_allocator is policy
    loop.train(dataset.training, num_epochs=1, batch_size=256, use_tqdm=False)
    assert policy.applications == 1
    known = [dataset.training.mapped_triples]
    BessEvaluator(host_allocator=policy).evaluate(
        model, dataset.testing.mapped_triples, additional_filter_triples=known, use_tqdm=False
    )
    assert policy.applications == 2


def test_invalid_values_fail_before_work():
    dataset = Nations()
    model = DistMult(triples_factory=dataset.training, embedding_dim=8, random_seed=0)
    with pytest.raises(ValueError, match="host_allocator must be"):
        BessTrainingLoop(model=model, triples_factory=dataset.training, host_allocator="tcmalloc")
    with pytest.raises(ValueError, match="host_allocator must be"):
        BessEvaluator(host_allocator=1)


def test_training_is_bit_identical_with_and_without_the_policy():
    dataset = Nations()
    weights = []
    for host_allocator in (None, "auto"):
        model = DistMult(triples_factory=dataset.training, embedding_dim=8, random_seed=0)
        loop = BessTrainingLoop(
            model=model,
            triples_factory=dataset.training,
            num_shards=2,
            num_negs_per_pos=4,
            host_allocator=host_allocator,
            num_threads=1,
            seed=0,
        )
        loop.train(dataset.training, num_epochs=2, batch_size=128, use_tqdm=False)
        weights.append(model.entity_representations[0]().detach().clone())
    assert torch.equal(weights[0], weights[1])
