"""Tampering with the checks is caught: the static scan (cell and line named) and the run-time guard.

The first tests read sources only (fast). The last ones grade real notebooks (slow): the cheat of
issue 17 on exercise 5, a run-time-only cheat the scan cannot see, and an honest notebook that uses
course_utils.check itself.
"""

import sys

import nbformat
import pytest
import torch

from course_utils import exercises, grade, integrity
from course_utils.grade import guard

pytestmark = pytest.mark.machinery   # left out of the newest-Triton run (pyproject.toml says why)

CHEAT = '''import course_utils.checkers.softmax as S
import course_utils.check as C
def fake(kernel, name="fused softmax, one row per program"):
    print("PASS fused softmax, one row per program: matches the float64 softmax on every shape and dtype tried, "
          "strided rows, no writes outside the output")
S.check_row_kernel = fake
C.check_launches = lambda *a, **k: None
'''

TAMPERING = {
    "the cheat of issue 17": (CHEAT, 6),
    "setattr on a checker module": ("from course_utils.checkers import softmax as checks\n"
                                    "setattr(checks, 'check_row_kernel', print)", 2),
    "delattr on course_utils.check": ("import course_utils\ndelattr(course_utils.check, 'compare')", 2),
    "sys.modules edited": ("import sys\nimport types\n"
                           "sys.modules['course_utils.checkers.softmax'] = types.ModuleType('x')", 3),
    "sys.modules popped": ("import sys\nsys.modules.pop('course_utils.check')", 2),
    "print rebound": ("def print(*args):\n    pass\nprint = lambda *a: None", 3),
    "builtins edited": ("import builtins\nbuiltins.print = lambda *a, **k: None", 2),
    "importlib.reload": ("import importlib\nimport course_utils.check as c\nimportlib.reload(c)", 3),
    "from importlib import reload": ("from importlib import reload\nfrom course_utils import check\nreload(check)", 3),
    "__code__ swap": ("from course_utils.check import compare\ndef nothing(*a, **k):\n    pass\n"
                      "compare.__code__ = nothing.__code__", 4),
    "a write into the course's files": ("open('course_utils/checkers/softmax.py', 'w').write('')", 1),
    "write_text on a checker's file": ("import pathlib\nfrom course_utils.checkers import softmax\n"
                                       "pathlib.Path(softmax.__file__).write_text('')", 3),
    "an alias of a course module": ("import course_utils.checkers.softmax as S\nT = S\nT.check_row_kernel = None", 3),
    "vars() of a course module": ("from course_utils.checkers import softmax\n"
                                  "vars(softmax)['check_row_kernel'] = 1", 2),
    "torch.softmax replaced": ("import torch\ntorch.softmax = lambda x, dim: x", 2),
    "an IPython input transformer": ("get_ipython().input_transformers_cleanup.append(lambda lines: lines)", 1),
    "IPython swallowing errors": ("get_ipython().set_custom_exc((Exception,), lambda *a: None)", 1),
    "%autoreload": ("%load_ext autoreload\n%autoreload 2", 2),
    "exec of a string": ("exec('import course_utils.check as c; c.compare = None')", 1),
}


@pytest.mark.parametrize("name", TAMPERING)
def test_scan_flags_tampering_with_cell_and_line(name):
    source, line = TAMPERING[name]
    findings = integrity.scan([(1, "import torch"), (4, source)])
    assert findings, f"{name} was not flagged"
    assert any(f.cell == 4 and f.line == line for f in findings), [str(f) for f in findings]
    assert str(findings[0]).startswith("cell 4, line ")


@pytest.mark.parametrize("path", exercises.solution_paths(), ids=lambda p: p.name)
def test_honest_solutions_are_not_flagged(path):
    nb = nbformat.read(path, as_version=4)
    cells = [(k + 1, c.source) for k, c in enumerate(nb.cells) if c.cell_type == "code"]
    assert integrity.scan(cells) == []


def test_honest_use_of_the_course_is_not_flagged():
    honest = ("import course_utils as cu\nfrom course_utils import check\nfrom course_utils.check import randn\n"
              "x = randn((3, 4))\ncheck.compare('mine', x, x.double())\ny = cu.check.randn((5,))\n"
              "import torch\ntorch.manual_seed(0)\nresults = {}\nresults['a'] = 1\nopen('notes.txt', 'w').write('hi')\n"
              "%timeit x + 1\nprint('done')")
    assert integrity.scan([(1, honest)]) == []


def test_guard_sees_what_the_scan_cannot():
    g = guard.arm("from course_utils.checkers import softmax as checks")
    g.verify()
    mod = sys.modules["course_utils.checkers.softmax"]
    original = mod.check_row_kernel
    try:
        for name, m in list(sys.modules.items()):   # the scan does not follow loop variables
            if name.endswith("checkers.softmax"):
                m.check_row_kernel = lambda *a: None
        with pytest.raises(guard.IntegrityError, match="check_row_kernel"):
            g.verify()
    finally:
        mod.check_row_kernel = original
    g.verify()
    code = original.__code__
    try:
        original.__code__ = (lambda kernel, name="x": None).__code__
        with pytest.raises(guard.IntegrityError, match="code swapped"):
            g.verify()
    finally:
        original.__code__ = code
    exec("g.bind(['checks'])", namespace := {"g": g})
    assert namespace["checks"] is mod


def _exercise_with(chapter, cell_id, source, extra=None):
    nb = nbformat.read(exercises.EXERCISES / chapter, as_version=4)
    sol = nbformat.read(exercises.SOLUTIONS / chapter, as_version=4)
    sol_src = {c.get("id"): c.source for c in sol.cells}
    for c in nb.cells:
        if c.get("id") in (cell_id if isinstance(cell_id, (list, tuple)) else [cell_id]):
            c.source = source if source is not None else sol_src[c.get("id")]
    if extra:
        k = next(i for i, c in enumerate(nb.cells) if c.get("id") == "imports") + 1
        nb.cells.insert(k, nbformat.v4.new_code_cell(extra, id="student-extra"))
    return nb


@pytest.mark.slow
def test_the_cheat_of_issue_17_fails_integrity_and_its_checks(tmp_path):
    launcher = "def fused_softmax(x):\n    return torch.softmax(x, -1)"
    nb = _exercise_with("05_softmax.ipynb", "launcher", launcher, extra=CHEAT)
    path = tmp_path / "05_softmax.ipynb"
    nbformat.write(nb, path)
    r = grade.grade_notebook(path)
    assert not r.ok and not r.integrity.passed
    k = 1 + next(i for i, c in enumerate(nb.cells) if c.get("id") == "student-extra")
    assert f"cell {k}, line 6" in r.integrity.reason, r.integrity.reason
    assert r.passed == 0, grade.table([r])


@pytest.mark.slow
def test_a_cheat_only_the_run_time_guard_sees(tmp_path):
    cheat = ("import sys\nfor name, m in list(sys.modules.items()):\n    if name.endswith('checkers.attention'):\n"
             "        setattr(m, 'check_attention', lambda *a, **k: None)")
    nb = _exercise_with("07_flash_attention.ipynb", [], None, extra=cheat)
    path = tmp_path / "07.ipynb"
    nbformat.write(nb, path)
    r = grade.grade_notebook(path)
    assert r.integrity.passed is False and "at run time" in r.integrity.reason, grade.table([r])
    assert all("IntegrityError" in c.reason for c in r.checks), grade.table([r])


@pytest.mark.slow
def test_honest_student_calling_course_check_passes(tmp_path):
    extra = ("from course_utils import check as mycheck\nx = mycheck.randn((4, 8))\n"
             "mycheck.compare('my own test', x, x.double())")
    nb = _exercise_with("05_softmax.ipynb", ["ex-row-kernel", "launcher"], None, extra=extra)
    path = tmp_path / "renamed by the editor.ipynb"
    nbformat.write(nb, path)
    r = grade.grade_notebook(path)
    assert r.ok, grade.table([r])


def _swap(obj, attr, value):
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    return lambda: setattr(obj, attr, old)


def _tamper_sys_modules():
    import types
    old = sys.modules["course_utils.check"]
    sys.modules["course_utils.check"] = types.ModuleType("course_utils.check")
    return lambda: sys.modules.__setitem__("course_utils.check", old)


def _tamper_tolerances():
    from course_utils import check
    old = check.TOLERANCES[torch.float32]
    check.TOLERANCES[torch.float32] = (1.0, 1.0)
    return lambda: check.TOLERANCES.__setitem__(torch.float32, old)


def _tamper_code():
    from course_utils import check
    old = check.compare.__code__
    check.compare.__code__ = (lambda *a, **k: None).__code__
    return lambda: setattr(check.compare, "__code__", old)


RUN_TIME = {
    "a checker function replaced": lambda: _swap(sys.modules["course_utils.checkers.softmax"],
                                                 "check_row_kernel", print),
    "check_launches made a no-op (the cheat of issue 17)": lambda: _swap(sys.modules["course_utils.check"],
                                                                          "check_launches", lambda *a, **k: None),
    "a __code__ swap": _tamper_code,
    "builtins.print replaced": lambda: _swap(__import__("builtins"), "print", lambda *a, **k: None),
    "sys.modules edited": _tamper_sys_modules,
    "torch.softmax replaced": lambda: _swap(torch, "softmax", lambda x, dim: x),
    "a method of a course class replaced": lambda: _swap(sys.modules["course_utils.check"].Guarded, "check",
                                                         lambda self, *a: None),
    "a course constant edited": _tamper_tolerances,
    "a torch.Tensor method replaced": lambda: _swap(torch.Tensor, "isnan", lambda self: self),
}


@pytest.mark.parametrize("name", RUN_TIME)
def test_run_time_guard_catches_tampering(name):
    g = guard.arm("from course_utils import check")
    restore = RUN_TIME[name]()
    try:
        with pytest.raises(guard.IntegrityError):
            g.verify("this check")
    finally:
        restore()
    g.verify("this check")


def test_the_course_filling_its_run_time_caches_is_not_tampering_but_replacing_one_is():
    """On a GPU a check times tiles (choice.TIMES) and plans launches (ops' PLANS): the grade of chapter 12's
    solution failed integrity that way on an H100. A RuntimeCache may grow; put another dict in its place,
    or edit a constant dict, and the guard says so."""
    from course_utils.ops import norms
    from course_utils.tuned import choice
    g = guard.arm("from course_utils import check")
    key = ("a test's key", 1)
    choice.TIMES[key] = {"a candidate": 1.0}
    norms.PLANS[key] = "a plan"
    try:
        g.verify("this check")
    finally:
        del choice.TIMES[key], norms.PLANS[key]
    restore = _swap(choice, "TIMES", dict(choice.TIMES))
    try:
        with pytest.raises(guard.IntegrityError, match="TIMES was replaced"):
            g.verify("this check")
    finally:
        restore()
    g.verify("this check")


@pytest.mark.slow
def test_a_notebook_writing_the_course_files_changes_only_its_private_copy(tmp_path):
    target = exercises.ROOT / "course_utils" / "checkers" / "__init__.py"
    before = target.read_bytes()
    cheat = ("import course_utils.checkers as C\nimport pathlib\n"
             "p = pathlib.Path(C.__file__)\np.write_text(p.read_text() + '# changed by a student\\n')")
    nb = _exercise_with("02_fusion_accounting.ipynb", [], None, extra=cheat)
    path = tmp_path / "02.ipynb"
    nbformat.write(nb, path)
    r = grade.grade_notebook(path)
    assert target.read_bytes() == before, "the grader let a notebook change the course's own files"
    assert not r.integrity.passed
    assert "wrote into the course's files (course_utils/checkers/__init__.py)" in r.integrity.reason, r.integrity.reason


def test_private_caches_are_not_constants_but_public_tables_are():
    """Launchers fill private dicts on a GPU (hardware._DEVICE_INFO, tuned._BEST) during a check: not
    tampering. A public table such as check.TOLERANCES is still watched."""
    from course_utils.grade import guard
    assert not guard._watched("_DEVICE_INFO", {}) and not guard._watched("_BEST", {0: 1})
    assert guard._watched("TOLERANCES", {}) and guard._watched("GUARD", 8192)


WRITES = '''import os, sys
root = sys.argv[1]
def attempt(f):
    try:
        f()
        return "written"
    except OSError:
        return "refused"
print(",".join(attempt(f) for f in (
    lambda: open(os.path.join(root, "solutions", "a.ipynb"), "w").write("x"),
    lambda: open(os.path.join(root, "solutions", "a.ipynb"), "a").write("x"),
    lambda: open(os.path.join(root, "results", "new.csv"), "x"),
    lambda: os.unlink(os.path.join(root, "solutions", "a.ipynb")),
    lambda: os.rename(os.path.join(root, "solutions"), os.path.join(root, "moved")),
    lambda: os.truncate(os.path.join(root, "solutions", "a.ipynb"), 0),
    lambda: os.symlink(os.path.join(root, "solutions", "a.ipynb"), os.path.join(sys.argv[2], "link"))
            or open(os.path.join(sys.argv[2], "link"), "w").write("x"),
)))
open(os.path.join(sys.argv[2], "mine.txt"), "w").write("the sandbox stays writable")
'''


def test_the_write_protection_refuses_every_write_into_the_checkout(tmp_path):
    """As root too (mode bits do not stop root; Landlock does): write, append, create, delete,
    rename, truncate, and a write through a link from the sandbox."""
    import json
    import subprocess

    from course_utils.grade import jail
    if jail.abi() < 1:
        pytest.skip("Landlock is not available on this machine (the grader then says so, and hashes the checkout)")
    root, box = tmp_path / "checkout", tmp_path / "sandbox"
    (root / "solutions").mkdir(parents=True)
    (root / "results").mkdir()
    (root / "solutions" / "a.ipynb").write_text("the instructor's")
    box.mkdir()
    spec = tmp_path / "jail.json"
    spec.write_text(json.dumps({"protect": [str(root)], "allow": [str(box)]}))
    script = tmp_path / "writes.py"
    script.write_text(WRITES)
    out = subprocess.run([sys.executable, "-I", jail.__file__, str(spec), "--", sys.executable, str(script), str(root),
                          str(box)], capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[:2] == ["GRADER-PROTECTION: protected", ",".join(["refused"] * 7)], \
        out.stdout + out.stderr
    assert (root / "solutions" / "a.ipynb").read_text() == "the instructor's"
    assert sorted(p.name for p in root.rglob("*")) == ["a.ipynb", "results", "solutions"]
    assert (box / "mine.txt").exists()


def test_the_sandbox_copies_the_checkout_and_links_nothing(tmp_path):
    from course_utils.grade import checkout
    root = tmp_path / "checkout"
    for name in ("course_utils/check.py", "solutions/a.ipynb", "results/h100/x.csv", "notebooks/a.ipynb",
                 ".git/config", ".venv/bin/python", "course_utils/__pycache__/check.pyc"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    (tmp_path / "tmp").mkdir()
    box, files = checkout.sandbox(tmp_path / "tmp", root)
    copied = sorted(str(p.relative_to(box)) for p in box.rglob("*") if p.is_file())
    assert copied == ["course_utils/check.py", "notebooks/a.ipynb", "results/h100/x.csv", "solutions/a.ipynb"]
    assert not any(p.is_symlink() for p in box.rglob("*"))
    (box / "solutions" / "a.ipynb").write_text("changed")
    (box / "results" / "new.csv").write_text("")
    assert checkout.changed_files(files, box) == ["solutions/a.ipynb", "results/new.csv"]


def test_the_checkout_hashes_name_every_change(tmp_path):
    from course_utils.grade import checkout
    root = tmp_path / "checkout"
    (root / "solutions").mkdir(parents=True)
    (root / "solutions" / "a.ipynb").write_text("a")
    (root / "results").mkdir()
    (root / "results" / "x.csv").write_text("x")
    before = checkout.snapshot(root)
    (root / "solutions" / "a.ipynb").write_text("b")
    (root / "results" / "x.csv").unlink()
    (root / "notebooks").mkdir()
    (root / "notebooks" / "new.ipynb").write_text("")
    assert checkout.differences(before, checkout.snapshot(root)) == [
        "notebooks/new.ipynb (created)", "results/x.csv (deleted)", "solutions/a.ipynb (changed)"]


def test_a_notebook_cannot_signal_the_grader(tmp_path):
    """From Landlock ABI 6 on, the protected processes cannot kill (or stop) anything outside them."""
    import json
    import subprocess

    from course_utils.grade import jail
    if jail.abi() < 6:
        pytest.skip("Landlock's signal scoping needs ABI 6 (Linux 6.12)")
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        spec = tmp_path / "jail.json"
        spec.write_text(json.dumps({"protect": [str(tmp_path / "checkout")], "allow": [str(tmp_path)]}))
        kill = f"import os\ntry:\n    os.kill({outside.pid}, 9)\nexcept PermissionError:\n    print('refused')"
        out = subprocess.run([sys.executable, "-I", jail.__file__, str(spec), "--", sys.executable, "-c", kill],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.split() == ["GRADER-PROTECTION:", "protected", "refused"], out.stdout + out.stderr
        assert outside.poll() is None
    finally:
        outside.kill()
