"""Intra-op threads: how many CPU threads the training steps and evaluation blocks use.

Torch runs an operation on several threads when it is large enough, and every parallel region
waits for its slowest thread. When another busy process shares the cores, one of the threads gets
only part of its core: it finishes its static share of the work late, and idle OpenMP workers that
spin while waiting take CPU time from the main thread. A BESS training step is many small kernels
(gathers, ``index_add_`` of gradient rows, optimizer updates of small tables), so on a 2-core
machine with one core busy the steps ran 2-3x *slower* with 2 threads than with 1, and a
filtered evaluation 1.6x slower (``benchmarks/busy_cpu.py``). With the cores idle, 2 threads were
5-60% (training) and 80% (evaluation) faster than 1. No fixed choice is right for both, so
``"auto"`` measures.

The policy is one class per choice, resolved from the ``num_threads`` argument of
:class:`~pykeen_bess.training.BessTrainingLoop` and :class:`~pykeen_bess.evaluation.BessEvaluator`:

* :class:`AdaptiveThreads` (``"auto"`` on the CPU; the default of the loop, the evaluator and the command
  line): the work is cut into *units*
  (training steps, evaluation blocks); after a warm-up, units alternate between 1 thread and the
  threads this process may use (:func:`threads_per_process`) for a few rounds, and the faster
  setting by median unit time wins (more threads only if at least 10% faster). The trial is
  repeated every :attr:`AdaptiveThreads.retrial_units` units, so a neighbour that starts later is
  noticed. A trial is skipped when the unit just before it, run with the most threads, kept them
  all busy (the process' CPU time at least 90% of threads x wall time): then no neighbour holds a
  core, and units at 1 thread would only cost time (an evaluation of a few large blocks spent 3 of
  its 8 blocks at 1 thread). The schedule counts units, not seconds, so the ranks of a process
  group try the same settings on the same steps; which trials are skipped depends on each
  process' own CPU time.
* :class:`FixedThreads` (an integer): that many threads while the loop or evaluator works.
* :class:`KeepThreads` (``None``; also ``"auto"`` on a GPU, and where only one thread is possible):
  torch's setting is left alone.

Every policy restores torch's thread count when the work ends. Threads per process start from
``torch.get_num_threads()`` (``OMP_NUM_THREADS``, which ``torchrun`` sets to 1 with several
processes per node, or ``torch.set_num_threads``) and never exceed the cores the process may run
on (CPU affinity and the cgroup's CPU quota) divided by the processes on this host
(``LOCAL_WORLD_SIZE``).

The thread count changes the order of some floating-point reductions; the counts of the evaluator
are exact either way, but a training run's parameters can differ in the last bits with another
thread count (and ``"auto"`` may choose another count in another run): pass an integer for runs that
must repeat bit for bit (a fixed count does).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

__all__ = [
    "AdaptiveThreads",
    "FixedThreads",
    "KeepThreads",
    "ThreadPolicy",
    "ThreadsHint",
    "one_thread_here",
    "resolve_threads",
    "threads_per_process",
    "usable_cores",
]

logger = logging.getLogger(__name__)

_CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def usable_cores(cpu_max_path: str = _CGROUP_CPU_MAX) -> int:
    """Return the cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        with open(cpu_max_path) as file:
            quota, period = file.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def one_thread_here() -> None:
    """Run the calling thread's torch CPU operations on one thread; the process' other threads keep theirs.

    For a long-lived helper thread (e.g. one that gathers rows while the main thread trains): a thread
    that runs parallel torch operations gets an OpenMP team of its own and keeps it while it lives, and
    GNU OpenMP, managing more threads than there are cores, then makes every parallel region of every
    thread sleep and wake its threads instead of spinning (measured on a 2-core machine: about 130
    context switches per training step, the step several times slower). OpenMP's thread count is a
    per-thread setting; ``torch.set_num_threads`` would change the process-wide default as well. Where
    torch's OpenMP runtime cannot be reached (no OpenMP, or a platform without ``libtorch_cpu.so`` or
    ``.dylib``) the thread keeps its count, which is logged at debug level.
    """
    torch.get_num_threads()  # torch sets a thread's OpenMP thread count on its first use: let it happen first
    setter = _openmp_set_num_threads()
    if setter is not None:
        setter(1)
    if torch.get_num_threads() != 1:
        logger.debug(
            "A helper thread keeps %d intra-op threads: torch's OpenMP runtime was not found.", torch.get_num_threads()
        )


@functools.cache
def _openmp_set_num_threads() -> Callable[[int], Any] | None:
    """Return ``omp_set_num_threads`` of the OpenMP runtime torch's CPU library uses, or None.

    The symbol is looked up through torch's own library (its dependencies are searched), not by a
    library's name: another package may load an OpenMP runtime of its own.
    """
    directory = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            try:
                return ctypes.CDLL(path).omp_set_num_threads
            except (OSError, AttributeError):
                return None
    return None


def threads_per_process() -> int:
    """Return the threads one process may use: torch's setting, at most its share of the usable cores."""
    local_processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(torch.get_num_threads(), usable_cores() // local_processes))


class ThreadPolicy:
    """How many intra-op threads each unit of work runs with (see the module docstring)."""

    #: the value of ``num_threads`` that selects the policy, for messages
    name: ClassVar[str] = "policy"

    def threads_for_unit(self) -> int | None:
        """Return the threads of the next unit (None: leave torch's setting)."""
        return None

    def record(self, threads: int, seconds: float) -> None:
        """Take note of a finished unit's wall time (adaptive policies learn from it)."""

    def describe(self) -> str:
        """Return a short description for the log."""
        return self.name

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run the enclosed work under this policy; torch's thread count is restored afterwards."""
        previous = torch.get_num_threads()
        try:
            yield
        finally:
            if torch.get_num_threads() != previous:
                torch.set_num_threads(previous)

    @contextlib.contextmanager
    def unit(self) -> Iterator[None]:
        """Run one unit of work (a training step, an evaluation block) with the policy's thread count."""
        threads = self.threads_for_unit()
        if threads is None:
            yield
            return
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        yield
        self.record(threads, time.perf_counter() - start)


class KeepThreads(ThreadPolicy):
    """Leave torch's thread count as it is."""

    name = "None"


#: the most intra-op threads a fixed policy accepts
MAX_THREADS = 4096


class FixedThreads(ThreadPolicy):
    """A fixed number of threads while the work runs."""

    name = "fixed"

    def __init__(self, threads: int):
        """:param threads: the intra-op threads, a positive integer"""
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"num_threads must be a positive integer, 'auto' or None, but is {threads!r}.")
        if threads > MAX_THREADS:  # torch's thread pool allocates per thread: far more fails deep inside
            raise ValueError(f"num_threads={threads} is more than {MAX_THREADS} threads; give at most the cores.")
        self.threads = threads

    def threads_for_unit(self) -> int:  # noqa: D102
        return self.threads

    def describe(self) -> str:  # noqa: D102
        return f"{self.threads} thread{'s' if self.threads > 1 else ''}"


class AdaptiveThreads(ThreadPolicy):
    """Measure 1 thread against all threads of the process, unit by unit, and keep the faster.

    Schedule (in units): ``warmup`` units with the most threads, then ``rounds`` pairs alternating
    1 and the most threads, then the winner until ``retrial_units`` units after the trial began,
    then the next trial (without warm-up). A trial is skipped (the most threads kept until the next
    one is due) when the unit just before it ran with the most threads and its CPU time was at
    least ``full_use`` x threads x its wall time: every thread had a core of its own.
    """

    name = "auto"

    def __init__(
        self,
        most: int,
        warmup: int = 2,
        rounds: int = 3,
        retrial_units: int = 500,
        margin: float = 0.1,
        clock: Callable[[], float] = time.perf_counter,
        full_use: float = 0.9,
        cpu_clock: Callable[[], float] = time.process_time,
    ):
        """Prepare the trials.

        :param most: the largest thread count to try (at least 2)
        :param warmup: units before the first trial (their times include one-time costs)
        :param rounds: pairs of trial units (one with 1 thread, one with ``most``)
        :param retrial_units: units from one trial's start to the next's
        :param margin: more threads win only if at least this fraction faster
        :param clock: the time source (tests pass a fake one)
        :param full_use: the share of ``most`` cores a unit's CPU time must reach for the next
            trial to be skipped (above 1: never skip)
        :param cpu_clock: the process' CPU time, all threads (tests pass a fake one)
        """
        if most < 2:
            raise ValueError(f"AdaptiveThreads needs at least 2 threads to choose from, not {most}.")
        self.most = most
        self.warmup = warmup
        self.rounds = rounds
        self.retrial_units = max(retrial_units, 2 * rounds + 1)
        self.margin = margin
        self.clock = clock
        self.full_use = full_use
        self.cpu_clock = cpu_clock
        #: the thread count outside trials (the last winner)
        self.chosen = most
        self._units = 0  # units started
        self._trial_start = warmup  # the unit index of the next trial's first unit
        self._samples: dict[int, list[float]] = {1: [], most: []}
        self._cores_used: float | None = None  # CPU time / wall time of the last unit, if it had the most threads

    def _trial_position(self) -> int | None:
        """Return the position of the next unit in the current trial, or None outside trials."""
        position = self._units - self._trial_start
        return position if 0 <= position < 2 * self.rounds else None

    def threads_for_unit(self) -> int:  # noqa: D102
        position = self._trial_position()
        if position is None:
            return self.chosen
        return 1 if position % 2 == 0 else self.most

    @contextlib.contextmanager
    def unit(self) -> Iterator[None]:  # noqa: D102
        if self._trial_position() == 0 and self._cores_used is not None:
            if self._cores_used >= self.full_use * self.most:  # every thread had its core: skip this trial
                logger.debug("Intra-op threads: %d kept (%.2f cores busy), no trial", self.most, self._cores_used)
                self.chosen = self.most
                self._trial_start += self.retrial_units
        threads = self.threads_for_unit()
        in_trial = self._trial_position() is not None
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        start, cpu_start = self.clock(), self.cpu_clock()
        yield
        seconds = self.clock() - start
        cpu_seconds = self.cpu_clock() - cpu_start
        self._cores_used = cpu_seconds / seconds if threads == self.most and seconds > 0 else None
        self._units += 1
        if in_trial:
            self.record(threads, seconds)
            if self._trial_position() is None:  # the trial is complete
                self._decide()

    def record(self, threads: int, seconds: float) -> None:  # noqa: D102
        self._samples[threads].append(seconds)

    def _decide(self) -> None:
        one, most = (statistics.median(self._samples[t]) for t in (1, self.most))
        previous = self.chosen
        self.chosen = self.most if most < (1.0 - self.margin) * one else 1
        log = logger.info if self.chosen != previous else logger.debug
        log(
            "Intra-op threads: %d (median unit %.2f ms with 1 thread, %.2f ms with %d threads)",
            self.chosen,
            1e3 * one,
            1e3 * most,
            self.most,
        )
        self._samples = {1: [], self.most: []}
        self._trial_start += self.retrial_units

    def describe(self) -> str:  # noqa: D102
        return f"auto (1 or {self.most} threads, measured; now {self.chosen})"


#: what ``num_threads`` accepts: ``"auto"``, a positive integer, None (leave torch's setting) or a policy
ThreadsHint = str | int | ThreadPolicy | None


def resolve_threads(num_threads: ThreadsHint, device: torch.device | str | None) -> ThreadPolicy:
    """Return the thread policy of a ``num_threads`` argument (see the module docstring).

    :param num_threads: ``"auto"``, a positive integer, None (or ``"keep"``, as the command line names it) or a
        policy
    :param device: the device the work runs on (``"auto"`` keeps torch's setting on a GPU)
    :returns: the policy
    :raises ValueError: for any other value
    """
    if isinstance(num_threads, ThreadPolicy):
        return num_threads
    if num_threads is None or num_threads == "keep":
        return KeepThreads()
    if num_threads == "auto":
        if device is not None and torch.device(device).type != "cpu":
            return KeepThreads()
        most = threads_per_process()
        return AdaptiveThreads(most) if most > 1 else KeepThreads()
    if isinstance(num_threads, str):
        raise ValueError(f"num_threads must be 'auto', a positive integer or None ('keep'), but is {num_threads!r}.")
    return FixedThreads(num_threads)
