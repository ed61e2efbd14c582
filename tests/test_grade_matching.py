"""What students' editors do to notebooks: graded correctly, or said clearly what could not be matched."""

import json

import nbformat
import pytest
from test_grade import toy_solution

from course_utils import exercises, grade
from course_utils.grade import match


def _solved_raw():
    nb = json.loads(nbformat.writes(toy_solution()))
    for c in nb["cells"]:
        c.pop("outputs", None) if "nbval-check-output" not in c.get("metadata", {}).get("tags", []) else None
    return nb


def _merge(raw, tmp_path):
    path = tmp_path / "toy.ipynb"
    path.write_text(json.dumps(raw))
    cells = match.read_cells(path)
    return grade.merge(toy_solution(), cells, "toy.ipynb")


def _sources(merged):
    return [c["source"] for c in merged.cells if c["cell_type"] == "code"]


def test_nbformat_44_without_ids_matches_by_content(tmp_path):
    raw = _solved_raw()
    raw["nbformat_minor"] = 4
    for c in raw["cells"]:
        c.pop("id")
    merged, checks, integ = _merge(raw, tmp_path)
    assert [c.reason for c in checks] == ["", ""] and integ.passed
    assert any("return x * x" in s for s in _sources(merged))


def test_regenerated_ids_match_by_content(tmp_path):
    raw = _solved_raw()
    for k, c in enumerate(raw["cells"]):
        c["id"] = f"f00d{k:04d}"
    merged, checks, _ = _merge(raw, tmp_path)
    assert [c.reason for c in checks] == ["", ""]
    assert any("return x ** 3" in s for s in _sources(merged))
    assert not any("NotImplementedError" in s for s in _sources(merged))


def test_answer_in_a_new_cell_after_deleting_the_stub(tmp_path):
    raw = json.loads(nbformat.writes(exercises.make_exercise(toy_solution())))
    k = next(i for i, c in enumerate(raw["cells"]) if c["id"] == "ex-square")
    raw["cells"][k] = {"cell_type": "code", "id": "mine", "metadata": {}, "outputs": [], "execution_count": None,
                       "source": "# my answer\nsquare = lambda x: x * x"}
    merged, checks, _ = _merge(raw, tmp_path)
    srcs = _sources(merged)
    mine = srcs.index("# my answer\nsquare = lambda x: x * x")
    assert mine < next(i for i, s in enumerate(srcs) if "square(3)" in s)
    assert not any("Exercise 1: square: replace" in s for s in srcs), "the deleted stub came back"
    assert checks[0].reason == ""


@pytest.mark.parametrize("damage", ["metadata is a string", "id is a list", "tags is a number",
                                    "source is a number", "cell is a list", "no cell_type"])
def test_malformed_cells_never_crash(tmp_path, damage):
    raw = _solved_raw()
    c = raw["cells"][2]
    if damage == "metadata is a string":
        c["metadata"] = "oops"
    elif damage == "id is a list":
        c["id"] = ["ex-square"]
    elif damage == "tags is a number":
        raw["cells"][3]["metadata"]["tags"] = 7
    elif damage == "source is a number":
        c["source"] = 42
    elif damage == "cell is a list":
        raw["cells"].append(["not", "a", "cell"])
    else:
        c.pop("cell_type")
    merged, checks, integ = _merge(raw, tmp_path)
    assert len(checks) == 2
    for ch in checks:
        assert ch.reason == "" or "missing" in ch.reason


def test_the_report_names_the_cell_to_look_at(tmp_path):
    raw = json.loads(nbformat.writes(exercises.make_exercise(toy_solution())))
    _, checks, _ = _merge(raw, tmp_path)
    assert "your cell 3" in checks[0].look_at and "square" in checks[0].look_at


def test_exercise_footer_is_ignored_and_notebook_identified_by_content(tmp_path):
    sol_dir = tmp_path / "solutions"
    sol_dir.mkdir()
    nbformat.write(toy_solution(), sol_dir / "toy.ipynb")
    cells = match.read_cells(_write(tmp_path / "alice - final (2).ipynb", _solved_raw()))
    assert grade.identify(cells, sol_dir) == sol_dir / "toy.ipynb"
    other = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "id": "x", "metadata": {}, "source": "print(1)", "outputs": [], "execution_count": None}]}
    assert grade.identify(match.read_cells(_write(tmp_path / "bob.ipynb", other)), sol_dir) is None


def _write(path, raw):
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.slow
def test_nbformat_44_notebook_passes_end_to_end(tmp_path):
    raw = _solved_raw()
    raw["nbformat_minor"] = 4
    for c in raw["cells"]:
        c.pop("id")
        c["metadata"] = "saved by an old editor" if c["cell_type"] == "markdown" else c["metadata"]
    sol_dir = tmp_path / "solutions"
    sol_dir.mkdir()
    nbformat.write(toy_solution(), sol_dir / "toy.ipynb")
    r = grade.grade_notebook(_write(tmp_path / "toy.ipynb", raw), sol_dir)
    assert r.ok and r.passed == 2, grade.table([r])


def test_an_edited_given_cell_without_ids_is_the_students(tmp_path):
    """Chapter 5's launcher is given code: a student's torch.softmax in its place must be what runs."""
    sol = nbformat.read(exercises.SOLUTIONS / "05_softmax.ipynb", as_version=4)
    raw = json.loads(nbformat.writes(exercises.make_exercise(sol)))
    for c in raw["cells"]:
        if c.get("id") == "launcher":
            c["source"] = "def fused_softmax(x):\n    return torch.softmax(x, -1)"
        c.pop("id")
    path = tmp_path / "mine.ipynb"
    path.write_text(json.dumps(raw))
    merged, checks, _ = grade.merge(sol, match.read_cells(path), "mine.ipynb")
    srcs = _sources(merged)
    assert "def fused_softmax(x):\n    return torch.softmax(x, -1)" in srcs
    assert not any("softmax_row_kernel[(x.shape[0]" in s for s in srcs), "the given launcher came back"
    assert "def fused_softmax" in checks[1].look_at


@pytest.mark.slow
def test_a_chapter_saved_under_another_chapters_name_is_graded_as_itself(tmp_path):
    sol = nbformat.read(exercises.SOLUTIONS / "02_fusion_accounting.ipynb", as_version=4)
    path = tmp_path / "05_softmax.ipynb"
    nbformat.write(sol, path)
    r = grade.grade_notebook(path)
    assert r.exercise == "02_fusion_accounting" and r.ok, grade.table([r])


def test_a_moved_check_cell_is_found_not_missing(tmp_path):
    raw = _solved_raw()
    k = next(i for i, c in enumerate(raw["cells"]) if c["id"] == "check-cube")
    raw["cells"].insert(1, raw["cells"].pop(k))  # the last check cell moved to the top
    raw["cells"][1]["id"] = "renamed-by-an-editor"
    merged, checks, integ = _merge(raw, tmp_path)
    assert [c.reason for c in checks] == ["", ""] and integ.passed
    assert [c.moved_from for c in checks] == [0, 2]
    srcs = _sources(merged)
    assert sum("cube(2) == 8" in s for s in srcs) == 1, "the moved check also ran as a student cell"
    assert "cube(2) == 8" in srcs[-1], "the moved check is graded after the exercise it checks"


def test_an_edited_and_moved_check_cell_is_still_missing(tmp_path):
    raw = _solved_raw()
    k = next(i for i, c in enumerate(raw["cells"]) if c["id"] == "check-cube")
    cell = raw["cells"].pop(k)
    cell["id"], cell["source"] = "mine", 'print("PASS cube: passed")'
    raw["cells"].insert(1, cell)
    _, checks, _ = _merge(raw, tmp_path)
    assert "missing" in checks[1].reason
