"""Run the selected tests many times in one process, to measure how often a fresh random draw fails them.

The checkers draw new inputs on every call (a student must not be able to hard-code an answer), so a test that
asserts a checker's verdict or named fault can fail on a rare draw, and a CI run fails on it. One run says
little; fifty say how rare. A pytest plugin, loaded with ``-p``::

    TRITON_INTERPRET=1 COURSE_MODE=interpreter PYTHONPATH=. python -m pytest -q -p no:cacheprovider \\
        -p tools.stress --stress=50 tests/test_training_checkers.py -k launcher_faults

Each selected test runs ``--stress`` times (parametrized, like pytest-repeat); the summary ends with each test
that failed at least once and its failure rate. Keep the selection narrow: interpreted kernels are slow.
"""

from __future__ import annotations

import collections

import pytest

_failed: collections.Counter = collections.Counter()
_ran: collections.Counter = collections.Counter()


def pytest_addoption(parser):
    parser.addoption("--stress", type=int, default=1, help="run each selected test this many times")


@pytest.fixture
def _stress_round(request):
    return request.param


def pytest_generate_tests(metafunc):
    rounds = metafunc.config.getoption("stress")
    if rounds > 1:
        metafunc.fixturenames.append("_stress_round")
        metafunc.parametrize("_stress_round", range(rounds), indirect=True, ids=lambda i: f"round{i}")


def _test_of(nodeid: str) -> str:
    """The node id without its round: ``t[x-round3]`` and ``t[round3]`` -> ``t[x]`` and ``t``."""
    base, _, params = nodeid.partition("[")
    params = "-".join(p for p in params.rstrip("]").split("-") if not p.startswith("round"))
    return f"{base}[{params}]" if params else base


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.failed):
        _ran[_test_of(report.nodeid)] += 1
        if report.failed:
            _failed[_test_of(report.nodeid)] += 1


def pytest_terminal_summary(terminalreporter, config):
    if config.getoption("stress") <= 1:
        return
    terminalreporter.section("stress")
    for test, runs in sorted(_ran.items()):
        if _failed[test]:
            terminalreporter.write_line(f"{_failed[test]} of {runs} runs failed: {test}")
    terminalreporter.write_line(f"{len(_ran)} test(s), {sum(_ran.values())} runs, {sum(_failed.values())} failed")
