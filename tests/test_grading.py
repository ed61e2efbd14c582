"""The grading round trip on the real chapters: every solution passes, every untouched exercise
fails every one of its checks, and exercises/ is exactly what `make exercises` writes."""

import nbformat
import pytest

from course_utils import exercises, grade

SOLUTIONS = exercises.solution_paths()
pytestmark = pytest.mark.slow


def test_there_are_chapters_to_grade():
    assert SOLUTIONS, "no solution notebooks in solutions/"


def test_exercises_are_generated_from_solutions():
    assert exercises.write(check_only=True) == 0, "exercises/ is stale: run make exercises"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_stored_outputs_follow_the_convention(path):
    nb = nbformat.read(path, as_version=4)
    checks = [c for c in nb.cells if exercises.is_check_cell(c)]
    assert checks, f"{path.name} has no check cell"
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        if exercises.is_check_cell(c):
            assert c.outputs and c.execution_count, f"{path.name}: check cell {c.get('id')} has no saved output"
            text = "".join(o.get("text", "") for o in c.outputs)
            assert "Error" not in text and "Traceback" not in text
        else:
            assert not c.outputs, f"{path.name}: cell {c.get('id')} keeps outputs that should be stripped"
    lecture = exercises.ROOT / "notebooks" / path.name
    if lecture.exists():
        assert all(not c.get("outputs") for c in nbformat.read(lecture, as_version=4).cells)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_passes_every_check(path):
    report = grade.grade_notebook(path)
    assert report.ok, grade.table([report])


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_untouched_exercise_fails_every_check(path):
    report = grade.grade_notebook(exercises.EXERCISES / path.name)
    assert report.checks and report.passed == 0, grade.table([report])
