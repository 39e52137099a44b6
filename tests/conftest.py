"""Suite-wide set-up: the test helpers on the import path, the ``slow`` marker, and the least number of tests.

* Tests live in folders that mirror the package; the helpers (:mod:`reference`) sit next to this
  file and are importable from every folder.
* ``slow`` marks tests that start other processes (gloo ranks, torchrun, fresh interpreters) or run
  notebooks; ``pytest -m "not slow"`` runs the fast part alone.
* CI fails when fewer tests ran than expected (a broken collection is not a pass).
* torch's optimizers accept ``capturable=True`` on the CPU (:mod:`capturable`): the tests of a GPU's
  static step run the capturable form of the user's optimizer there.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from capturable import allow_capturable_on_the_cpu

allow_capturable_on_the_cpu()

#: environment variable with the least number of tests that must have run and passed (set by .ci/run)
MIN_TESTS_VARIABLE = "PYKEEN_BESS_MIN_TESTS"


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``slow`` marker."""
    config.addinivalue_line("markers", "slow: starts other processes or runs notebooks (deselect with -m 'not slow')")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Turn a run with fewer passed tests than ``PYKEEN_BESS_MIN_TESTS`` into a failure."""
    minimum = os.environ.get(MIN_TESTS_VARIABLE)
    if not minimum:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    passed = len(reporter.stats.get("passed", [])) if reporter is not None else 0
    if passed < int(minimum):
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(
                f"{MIN_TESTS_VARIABLE}={minimum}: only {passed} tests passed (a broken collection or skipped tests?)",
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
