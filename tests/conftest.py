"""Makes tests/amsp_testlib.py importable however pytest is run (with or without __init__.py),
and keeps the tests that start processes on one pytest-xdist worker.

The suite runs on pytest-xdist workers (``-n auto --dist loadgroup`` in pyproject.toml). The
tests that launch several processes (torchrun ranks, network namespaces: the ``multiprocess``
marker, and everything under tests/runtime/) already use every core between them and are timed
against process-group timeouts, so they share one group and run one at a time, on one worker,
while the single-process tests (solver, cost model, CLI) fill the others.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROCESSES = "processes"
RUNTIME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime")


def pytest_configure(config):
    # an xdist worker's environment says COLUMNS=80; the CLI's tables are tested as a pipe
    # or file gets them (no width limit unless the user sets COLUMNS)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.pop("COLUMNS", None)
        os.environ.pop("LINES", None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("multiprocess") or str(item.path).startswith(RUNTIME):
            item.add_marker(pytest.mark.xdist_group(PROCESSES))
