"""The class-grading recipe (docs/ci/grade_class.sh) on a synthetic class: honest, wrong, broken and
tampered submissions under any file names; the CSV says who passed what, and why."""

import csv
import json
import os
import subprocess
import sys
import time

import nbformat
import pytest

from course_utils import exercises

pytestmark = pytest.mark.slow
SCRIPT = exercises.ROOT / "docs" / "ci" / "grade_class.sh"


def _nb(chapter, kind):
    nb = nbformat.read((exercises.SOLUTIONS if kind == "solution" else exercises.EXERCISES) / chapter, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code" and kind == "solution" and not exercises.is_check_cell(c):
            c.outputs, c.execution_count = [], None
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("class")
    sub = root / "submissions"
    (sub / "bob").mkdir(parents=True)
    nbformat.write(_nb("03_triton_model.ipynb", "solution"), sub / "alice.ipynb")          # honest
    raw = json.loads(nbformat.writes(_nb("02_fusion_accounting.ipynb", "solution")))        # honest, nbformat 4.4
    raw["nbformat_minor"] = 4
    for c in raw["cells"]:
        c.pop("id", None)
    (sub / "bob" / "my work (final).ipynb").write_text(json.dumps(raw))
    wrong = _nb("03_triton_model.ipynb", "solution")                                         # torch.add, no kernel
    for c in wrong.cells:
        if c.get("id") == "ex-vector-add":
            c.source = c.source.split("def add(")[0] + ("def add(x, y, out=None):\n"
                                                        "    return torch.add(x, y, out=out)")
    nbformat.write(wrong, sub / "carol.ipynb")
    (sub / "dave.ipynb").write_text('{"cells": [')                                           # broken
    cheat = _nb("02_fusion_accounting.ipynb", "exercise")                                    # tampered
    cheat.cells.insert(4, nbformat.v4.new_code_cell(
        "import course_utils.checkers.traffic as CT2\n\ndef ok(fn):\n    print('PASS')\n\nCT2.check_chain_bytes = ok"))
    nbformat.write(cheat, sub / "eve.ipynb")
    env = dict(os.environ, SKIP_SETUP="1", PY=sys.executable)
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(SCRIPT), str(sub), str(root / "grades")], cwd=exercises.ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    rows = list(csv.DictReader(open(root / "grades" / "grades.csv", encoding="utf-8")))
    return proc, rows, root / "grades", seconds


def _rows(rows, student):
    return [r for r in rows if r["student"] == student]


def test_recipe_exits_zero_and_writes_csv_junit_report(graded):
    proc, rows, out, seconds = graded
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "grades.xml").exists() and (out / "report.txt").exists()
    assert set(rows[0]) == {"student", "exercise", "check", "result", "reason"}
    assert {r["student"] for r in rows} == {"alice", "bob", "carol", "dave", "eve"}
    assert seconds < 300, f"the synthetic class took {seconds:.0f} s"


def test_honest_students_pass_everything(graded):
    _, rows, _, _ = graded
    for student, exercise in (("alice", "03_triton_model"), ("bob", "02_fusion_accounting")):
        mine = _rows(rows, student)
        assert mine and all(r["result"] == "pass" and r["exercise"] == exercise for r in mine), mine
        assert mine[0]["check"] == "integrity"


def test_wrong_broken_and_tampered_fail_with_reasons(graded):
    _, rows, _, _ = graded
    carol = {r["check"]: r for r in _rows(rows, "carol")}
    assert carol["launch grid"]["result"] == "pass"
    assert carol["vector add"]["result"] == "fail" and "ran in torch" in carol["vector add"]["reason"]
    dave = _rows(rows, "dave")
    assert len(dave) == 1 and dave[0]["result"] == "fail" and "JSON" in dave[0]["reason"]
    eve = {r["check"]: r for r in _rows(rows, "eve")}
    assert eve["integrity"]["result"] == "fail"
    assert "cell 5, line 6" in eve["integrity"]["reason"], eve["integrity"]["reason"]
    assert eve["chain_bytes"]["result"] == "fail"
