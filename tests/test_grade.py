"""The grading pipeline on a small synthetic course: both directions, and every kind of bad input."""

import functools
import hashlib
import json
import xml.etree.ElementTree as ET

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from course_utils import exercises, grade

pytestmark = pytest.mark.slow


def _check(cid, name, body, out, n):
    c = new_code_cell(f"# Check: {name}\n{body}", id=cid)
    c.metadata["tags"] = [exercises.CHECK_TAG]
    c.execution_count = n
    c.outputs = [new_output("stream", name="stdout", text=out)]
    return c


def toy_solution():
    nb = new_notebook(cells=[
        new_markdown_cell("# A toy chapter", id="intro"),
        new_code_cell("from course_utils.check import verdict, require", id="setup"),
        new_code_cell("# Exercise 1: square\ndef square(x):\n    ### BEGIN SOLUTION\n    return x * x\n"
                      "    ### END SOLUTION", id="ex-square"),
        _check("check-square", "square", 'require(square(3) == 9, "square(3) should be 9")\nverdict("square")',
               "PASS square: passed\n", 1),
        new_code_cell("# Exercise 2: cube\ndef cube(x):\n    ### BEGIN SOLUTION\n    return x ** 3\n"
                      "    ### END SOLUTION", id="ex-cube"),
        _check("check-cube", "cube", 'require(cube(2) == 8, "cube(2) should be 8")\nverdict("cube")',
               "PASS cube: passed\n", 2),
    ])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.fixture()
def course(tmp_path):
    sol_dir = tmp_path / "solutions"
    sol_dir.mkdir()
    sol = toy_solution()
    nbformat.write(sol, sol_dir / "toy.ipynb")
    student_dir = tmp_path / "student"
    student_dir.mkdir()
    return sol, sol_dir, student_dir


def _student(student_dir, nb, name="toy.ipynb"):
    path = student_dir / name
    path.write_text(nbformat.writes(nb))
    return path


def _solve(nb, cell_id, source):
    for c in nb.cells:
        if c.get("id") == cell_id:
            c["source"] = source
    return nb


def test_stub_replaces_solution_and_names_exercise():
    ex = exercises.make_exercise(toy_solution())
    src = ex.cells[2]["source"]
    assert "return x * x" not in src and "BEGIN SOLUTION" not in src
    assert 'raise NotImplementedError("Exercise 1: square' in src
    assert all(not c.get("outputs") for c in ex.cells if c.cell_type == "code")
    assert [c.get("id") for c in ex.cells] == [c.get("id") for c in toy_solution().cells]


def test_unbalanced_markers_are_errors():
    with pytest.raises(ValueError, match="without"):
        exercises.stub_source("### BEGIN SOLUTION\nx = 1\n")
    with pytest.raises(ValueError, match="without"):
        exercises.stub_source("x = 1\n### END SOLUTION\n")


def test_solution_passes_and_untouched_exercise_fails_every_check(course):
    sol, sol_dir, student_dir = course
    good = grade.grade_notebook(_student(student_dir, sol), sol_dir)
    assert good.ok and good.passed == 2, grade.table([good])
    path = _student(student_dir, exercises.make_exercise(sol))
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    bad = grade.grade_notebook(path, sol_dir)
    assert bad.passed == 0 and len(bad.checks) == 2
    assert all("NotImplementedError" in c.reason for c in bad.checks), grade.table([bad])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before, "the grader modified the student's file"


def test_one_exercise_done_one_stub_left(course):
    sol, sol_dir, student_dir = course
    nb = _solve(exercises.make_exercise(sol), "ex-square", "def square(x):\n    return x * x")
    r = grade.grade_notebook(_student(student_dir, nb), sol_dir)
    assert [c.passed for c in r.checks] == [True, False]
    assert "cube" in r.checks[1].reason


def test_wrong_answer_fails_with_the_checkers_message(course):
    sol, sol_dir, student_dir = course
    nb = _solve(exercises.make_exercise(sol), "ex-square", "def square(x):\n    return x + x")
    r = grade.grade_notebook(_student(student_dir, nb), sol_dir)
    assert not r.checks[0].passed
    assert "square(3) should be 9" in r.checks[0].reason


def test_edited_check_cell_is_graded_with_the_original(course):
    sol, sol_dir, student_dir = course
    nb = exercises.make_exercise(sol)
    _solve(nb, "check-square", 'print("PASS square: passed")')  # a student faking the verdict
    r = grade.grade_notebook(_student(student_dir, nb), sol_dir)
    assert not r.checks[0].passed


def test_deleted_check_cell_fails_clearly(course):
    sol, sol_dir, student_dir = course
    nb = sol.copy()
    nb.cells = [c for c in sol.cells if c.get("id") != "check-cube"]
    r = grade.grade_notebook(_student(student_dir, nb), sol_dir)
    assert [c.passed for c in r.checks] == [True, False]
    assert "missing" in r.checks[1].reason


def test_syntax_error_fails_that_exercise_and_grading_goes_on(course):
    sol, sol_dir, student_dir = course
    nb = _solve(toy_solution(), "ex-square", "def square(x)\n    return x * x")
    r = grade.grade_notebook(_student(student_dir, nb), sol_dir)
    assert [c.passed for c in r.checks] == [False, True]
    assert "SyntaxError" in r.checks[0].reason or "NameError" in r.checks[0].reason


def test_cell_that_never_returns_times_out(course):
    sol, sol_dir, student_dir = course
    nb = _solve(toy_solution(), "ex-square", "def square(x):\n    while True:\n        pass")
    r = grade.grade_notebook(_student(student_dir, nb), sol_dir, cell_timeout=20)  # the first cells import torch
    assert not r.checks[0].passed
    assert any(w in r.checks[0].reason for w in ("longer than 20 s", "stopped", "hung")), r.checks[0].reason


@pytest.mark.parametrize("content, name", [
    ("this is not json", "toy.ipynb"),
    ('{"cells": [', "toy.ipynb"),              # a half-written file
    (json.dumps({"nbformat": 4}), "toy.ipynb"),  # JSON, but no cells
    ("print('hello')", "toy.py"),
])
def test_malformed_input_is_a_clear_failure(course, content, name):
    _, sol_dir, student_dir = course
    path = student_dir / name
    path.write_text(content)
    r = grade.grade_notebook(path, sol_dir)
    assert not r.ok and r.error
    assert path.read_text() == content


def test_cli_table_exit_code_and_junit(course, tmp_path, capsys):
    sol, sol_dir, student_dir = course
    _student(student_dir, exercises.make_exercise(sol))
    (student_dir / "broken.ipynb").write_text("{")
    junit = tmp_path / "grades.xml"
    code = grade.main([str(student_dir), "--solutions", str(sol_dir), "--junit", str(junit)])
    out = capsys.readouterr().out
    assert code == 1
    assert "toy.ipynb" in out and "0/2" in out and "broken.ipynb" in out
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    names = [c.get("name") for c in cases]
    assert sorted(names) == ["cube", "integrity", "notebook", "square"], names
    assert all((c.find("failure") is None) == (c.get("name") == "integrity") for c in cases)


def _move(nb, cell_id, to):
    cell = next(c for c in nb.cells if c.get("id") == cell_id)
    nb.cells.remove(cell)
    nb.cells.insert(to if to >= 0 else len(nb.cells), cell)
    return nb


def test_a_kernel_that_dies_inside_a_check_is_said_to_have_died(course):
    sol, sol_dir, student_dir = course
    nb = _solve(toy_solution(), "ex-square", "def square(x):\n    import os\n    os._exit(3)")
    r = grade.grade_notebook(_student(student_dir, nb), sol_dir, cell_timeout=120)
    square, cube = r.checks
    assert "kernel process died while this cell ran: exit code 3" in square.reason, square.reason
    assert "longer than" not in square.reason
    assert cube.reason == ("this check did not run: the kernel process died earlier, while check 'square' ran: "
                           "exit code 3"), cube.reason


def test_a_segfault_in_a_students_cell_is_named(course):
    """The reading of nbval's items (the real crash is test_a_kernel_that_dies_inside_a_check...)."""
    from types import SimpleNamespace

    from course_utils.grade import kernel_watch, match
    sol, _, student_dir = course
    nb = toy_solution()
    nb.cells.insert(3, new_code_cell("import ctypes\nctypes.string_at(0)", id="crash"))
    student = match.read_cells(_student(student_dir, nb))
    merged, checks, integ = grade.merge(sol, student, "toy.ipynb")
    report = grade.Report("toy.ipynb", checks, integrity=integ)
    km = SimpleNamespace(provisioner=SimpleNamespace(process=SimpleNamespace(poll=lambda: -11)))
    died = f"pytest plugin exception: the kernel process died while this cell ran: {kernel_watch.describe(km)}"
    k = next(i for i, c in enumerate(c for c in merged.cells if c.cell_type == "code") if c.get("id") == "student-4")
    cases = {i: (True, "") for i in range(k)} | {k: (False, died)} | {
        i: (False, "pytest plugin exception: Kernel dead on test start") for i in range(k + 1, k + 4)}
    grade._read_cells(report, merged, student, cases, 60, True)
    said = ("this check did not run: the kernel process died earlier, while your cell 4 (starts 'import ctypes') ran: "
            "killed by signal 11 (SIGSEGV)")
    assert [c.reason for c in report.checks] == [said, said]


def _toy_checkout(tmp_path):
    """A checkout like the instructor's: the package, solutions/, exercises/, notebooks/, results/."""
    import shutil
    root = tmp_path / "checkout"
    shutil.copytree(exercises.ROOT / "course_utils", root / "course_utils",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("solutions", "exercises", "notebooks"):
        (root / folder).mkdir()
        nbformat.write(toy_solution() if folder != "exercises" else exercises.make_exercise(toy_solution()),
                       root / folder / "toy.ipynb")
    (root / "results" / "h100").mkdir(parents=True)
    (root / "results" / "h100" / "bench.csv").write_text("op,ms\nadd,1.0\n")
    return root


def _hashes(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


CHEAT = '''import os, pathlib, course_utils
from course_utils import exercises as ex
CHECKOUT = pathlib.Path({root!r})
mine = pathlib.Path(course_utils.__file__).parents[1]
blocked = []
for target in [mine / "solutions/toy.ipynb", ex.ROOT / "exercises/toy.ipynb", CHECKOUT / "solutions/toy.ipynb",
               CHECKOUT / "exercises/toy.ipynb", CHECKOUT / "notebooks/toy.ipynb",
               CHECKOUT / "results/h100/bench.csv", CHECKOUT / "solutions/new.ipynb",
               CHECKOUT / "course_utils/check.py"]:
    try:
        target.write_text("overwritten by a student")
    except OSError:
        blocked.append(str(target))
for action in (lambda: os.rename(CHECKOUT / "solutions", CHECKOUT / "gone"),
               lambda: os.unlink(CHECKOUT / "notebooks/toy.ipynb")):
    try:
        action()
    except OSError:
        blocked.append("rename/unlink")
os.system(f"echo x > {{CHECKOUT}}/results/h100/bench.csv 2>/dev/null")  # a child process
print(len(blocked))'''


def test_a_notebook_writing_into_the_checkout_leaves_it_unchanged(tmp_path):
    """Writes by relative path land in the sandbox's copies (and are reported); writes by absolute
    path into solutions/, exercises/, notebooks/, results/ are refused by the write protection."""
    from course_utils.grade import jail
    root = _toy_checkout(tmp_path)
    before = _hashes(root)
    nb = toy_solution()
    nb.cells.insert(2, new_code_cell(CHEAT.format(root=str(root)), id="cheat"))
    path = tmp_path / "student" / "toy.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, path)
    r = grade.grade_notebook(path, root / "solutions", course_root=root)
    if jail.abi() < 1:  # no Landlock here: the writes happen, and the grader must say so loudly
        assert r.checkout_changed and r.infra and "toy.ipynb" in r.error and "CHECKOUT CHANGED" in r.error, r.error
        pytest.skip("Landlock is not available here: the change was detected, not prevented")
    assert r.protection == "protected"
    assert _hashes(root) == before, "a graded notebook changed the instructor's checkout"
    assert r.checkout_changed == [] and not r.error
    assert r.passed == 2 and not r.integrity.passed, grade.table([r])
    assert "wrote into the course's files (exercises/toy.ipynb, solutions/toy.ipynb)" in r.integrity.reason, \
        r.integrity.reason


def test_a_checkout_that_changes_while_a_notebook_runs_fails_the_run_loudly(tmp_path, monkeypatch, capsys):
    """Where the checkout cannot be write-protected, the hashes before and after name the notebook."""
    from course_utils.grade import jail, runner
    root = _toy_checkout(tmp_path)

    def run_and_write(nb_path, junit, cell_timeout, total, sandbox_root, checkout_root):
        (checkout_root / "solutions" / "toy.ipynb").write_text("rewritten")
        return runner.Run(True, "", "Landlock is not available on this machine", 1)

    monkeypatch.setattr(grade, "run_nbval", run_and_write)
    monkeypatch.setattr(jail, "abi", lambda: 0)
    monkeypatch.setattr(grade, "grade_notebook", functools.partial(grade.grade_notebook, course_root=root))
    students = tmp_path / "student"
    students.mkdir()
    nbformat.write(toy_solution(), students / "a.ipynb")
    nbformat.write(toy_solution(), students / "b.ipynb")
    code = grade.main([str(students), "--solutions", str(root / "solutions"), "--jobs", "1"])
    assert code == 2
    out = capsys.readouterr().out
    assert "THE INSTRUCTOR'S CHECKOUT CHANGED while a.ipynb was graded" in out, out
    assert "solutions/toy.ipynb (changed)" in out
    assert "not graded: the instructor's checkout changed earlier in this run" in out  # b.ipynb
    assert "it was not write-protected" in out
