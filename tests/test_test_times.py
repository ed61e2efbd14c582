"""tools/test_times.py: the per-test lines that COURSE_TEST_TIMES makes the suite write, summed right."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.machinery   # left out of the newest-Triton run (pyproject.toml says why)

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("test_times", ROOT / "tools" / "test_times.py")
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)


def test_phases_sum_per_test_and_tests_per_file(tmp_path):
    log = tmp_path / "times.tsv"
    log.write_text("0.5\tsetup\ttests/a.py::t1\n2.0\tcall\ttests/a.py::t1\n3.0\tcall\ttests/b.py::t2[x]\n"
                   "garbage line\n1.0\tcall\ttests/a.py::t3\n")
    tests = tt.read(str(log))
    assert tests == {"tests/a.py::t1": 2.5, "tests/b.py::t2[x]": 3.0, "tests/a.py::t3": 1.0}
    assert tt.by_file(tests) == {"tests/a.py": (3.5, 2), "tests/b.py": (3.0, 1)}
    assert tt.balanced_wall(tests, 2) == 3.25 and tt.balanced_wall(tests, 4) == 3.0   # the longest test bounds it
    assert tt.failed(str(log)) == []   # lines without an outcome (older files) fail nothing


def test_failed_tests_are_named_once_in_order(tmp_path):
    log = tmp_path / "times.tsv"
    log.write_text("0.1\tsetup\ttests/a.py::t1\tpassed\n1.0\tcall\ttests/a.py::t1\tfailed\n"
                   "0.1\tteardown\ttests/a.py::t1\tfailed\n0.2\tcall\ttests/b.py::t2\tpassed\n"
                   "0.3\tsetup\ttests/c.py::t3\tfailed\n")
    assert tt.failed(str(log)) == ["tests/a.py::t1", "tests/c.py::t3"]
    assert tt.read(str(log))["tests/a.py::t1"] == pytest.approx(1.2)


@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["one process", "xdist"])
def test_the_suite_writes_a_line_a_phase_when_asked(tmp_path, workers):
    """A real pytest run with COURSE_TEST_TIMES set: every phase of the one test it runs is written, once
    (under xdist the controller sees each worker's report again)."""
    log = tmp_path / "times.tsv"
    env = {**os.environ, "COURSE_TEST_TIMES": str(log)}
    one = str(ROOT / "tests" / "test_test_times.py::test_phases_sum_per_test_and_tests_per_file")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, one],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert [p[1] for p in lines] == ["setup", "call", "teardown"]
    assert [p[3] for p in lines] == ["passed"] * 3
