"""make test-gpu's order (tests/conftest.py): the longest GPU tests each open a worker's share."""

from __future__ import annotations

import types

import pytest

from tests import conftest as C

pytestmark = pytest.mark.machinery   # left out of the newest-Triton run (pyproject.toml says why)


def _items(names):
    return [types.SimpleNamespace(nodeid=n) for n in names]


def _worksteal_first_shares(n_items, workers):
    """What pytest-xdist's worksteal scheduler itself sends each worker first (fake workers)."""
    from xdist.scheduler.worksteal import WorkStealingScheduling

    config = types.SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"] if name == "tx" else None)
    sched = WorkStealingScheduling(config)
    sent = {}
    nodes = []
    class Worker:  # what the scheduler touches of a worker
        def __init__(self, w):
            self.w, self.shutting_down, self.gateway = w, False, types.SimpleNamespace(id=f"gw{w}")

        def send_runtest_some(self, indices):
            sent.setdefault(self.w, list(indices))

        def shutdown(self):
            self.shutting_down = True

    for w in range(workers):
        nodes.append(Worker(w))
        sched.add_node(nodes[-1])
    for node in nodes:
        sched.add_node_collection(node, [f"t{i}" for i in range(n_items)])
    sched.schedule()
    return [sent.get(w, []) for w in range(workers)]


@pytest.mark.parametrize("n_items, workers", [(1772, 16), (1709, 16), (40, 16), (7, 3), (100, 1)])
def test_shares_are_the_ones_worksteal_sends_first(n_items, workers):
    shares = _worksteal_first_shares(n_items, workers)
    assert [len(s) for s in shares] == C.worksteal_shares(n_items, workers)
    assert [i for s in shares for i in s] == list(range(n_items))  # contiguous, in order


def test_each_heavy_group_opens_its_own_share_and_nothing_is_lost():
    names = [f"tests/test_a.py::test_{i}" for i in range(200)]
    heavy = ((names[150],), (names[3], names[120]), ("tests/test_gone.py::test_not_collected",), (names[199],))
    items = _items(names)
    out = C.heavy_first(items, 4, heavy)
    assert sorted(id(i) for i in out) == sorted(id(i) for i in items)       # a permutation
    starts = [0]
    for size in C.worksteal_shares(len(items), 4)[:-1]:
        starts.append(starts[-1] + size)
    ids = [i.nodeid for i in out]
    assert ids[starts[0]] == names[150]
    assert ids[starts[1]:starts[1] + 2] == [names[3], names[120]]            # a group stays together, in order
    assert ids[starts[2]] == names[199]                                       # an absent test leaves no hole
    light = [n for n in ids if n not in {names[150], names[3], names[120], names[199]}]
    assert light == [n for n in names if n in light]                          # the rest keep their order


def test_more_groups_than_workers_and_tiny_runs():
    names = [f"t::{i}" for i in range(5)]
    heavy = tuple((n,) for n in reversed(names))
    out = [i.nodeid for i in C.heavy_first(_items(names), 2, heavy)]
    assert sorted(out) == sorted(names) and out[0] == "t::4"
    assert [i.nodeid for i in C.heavy_first(_items(names[:1]), 16, heavy)] == names[:1]


def test_later_rounds_of_groups_go_back_the_other_way():
    names = [f"tests/test_a.py::test_{i}" for i in range(400)]
    heavy = tuple((names[300 + k],) for k in range(7))     # longest first: 4 open the shares, 3 more follow
    ids = [i.nodeid for i in C.heavy_first(_items(names), 4, heavy)]
    starts = [0]
    for size in C.worksteal_shares(len(names), 4)[:-1]:
        starts.append(starts[-1] + size)
    want = [[names[300]], [names[301], names[306]], [names[302], names[305]], [names[303], names[304]]]
    assert [ids[s:s + len(w)] for s, w in zip(starts, want)] == want
    assert ids[starts[0] + 1] not in {n for w in want for n in w}          # the first share has one group


def test_every_named_heavy_test_exists():
    """A renamed test would silently drop out of the order: the names must be collected ones."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *sorted({n.split("::")[0] for group in C.GPU_HEAVY for n in group})],
                         capture_output=True, text=True, cwd=C.__file__.rsplit("/tests/", 1)[0], timeout=600)
    collected = set(out.stdout.splitlines())
    missing = [n for group in C.GPU_HEAVY for n in group if n not in collected]
    assert not missing, missing


def test_only_xdist_workers_on_a_gpu_reorder(monkeypatch):
    names = [f"tests/test_a.py::test_{i}" for i in range(50)]
    monkeypatch.setattr(C, "GPU_HEAVY", ((names[40],),))
    monkeypatch.setattr(C.heavy_first, "__defaults__", (C.GPU_HEAVY,))
    worker = types.SimpleNamespace(workerinput={"workercount": 4})
    for config, gpu, moved in ((worker, True, True), (worker, False, False), (types.SimpleNamespace(), True, False)):
        monkeypatch.setattr(C.course_utils.env, "on_gpu", lambda gpu=gpu: gpu)
        items = _items(names)
        C.pytest_collection_modifyitems(config, items)
        assert (items[0].nodeid == names[40]) is moved and sorted(i.nodeid for i in items) == sorted(names)


def test_param_sample_keeps_every_function_its_first_every_kth_and_last():
    keys = ["a"] * 7 + ["b"] + ["c"] * 2 + ["a"]   # a's eighth item comes after the others
    keep = C.sample_params(keys, 3)
    kept = [(k, i) for i, (k, kept) in enumerate(zip(keys, keep)) if kept]
    assert kept == [("a", 0), ("a", 3), ("a", 6), ("b", 7), ("c", 8), ("c", 9), ("a", 10)]
    assert all(C.sample_params(keys, 1))
    with pytest.raises(ValueError, match=">= 1"):
        C.sample_params(keys, 0)


def test_param_sample_runs_through_pytest(pytester_free_run):
    out = pytester_free_run
    assert "4 passed, 4 deselected" in out, out   # test_p[0], [3], [6] and test_plain


@pytest.fixture
def pytester_free_run(tmp_path):
    """A child pytest over a file of one 7-way parametrized test and one plain test, with this conftest's
    hook and COURSE_PARAM_SAMPLE=3: 0, 3, 6 and the plain one run."""
    import os
    import shutil
    import subprocess
    import sys
    (tmp_path / "tests").mkdir()
    shutil.copy(C.__file__, tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(7))\ndef test_p(i):\n    pass\n\n\n"
        "def test_plain():\n    pass\n")
    root = os.path.dirname(os.path.dirname(C.__file__))
    env = {**os.environ, "COURSE_PARAM_SAMPLE": "3", "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(tmp_path / "tests")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr
