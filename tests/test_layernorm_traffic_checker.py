"""Exercise 10.4's checker: the right count of LayerNorm's backward bytes passes, the course's traffic
functions are refused as the answer, and each usual mistake fails with a message naming it."""

from __future__ import annotations

import pytest

from course_utils import check, traffic
from course_utils.checkers import layernorm_traffic as checks


def _student(mistake: str = ""):
    """A student's count written out by hand, with one mistake (or none)."""
    def count(n_rows, n_cols, itemsize, rows_per_program):
        m, n, b = n_rows, n_cols, itemsize
        runs = m // rows_per_program if mistake == "floor" else -(-m // rows_per_program)
        if mistake == "divide":
            runs = m / rows_per_program
        stats = 0 if mistake == "stats" else 2 * m * (2 if mistake == "stat16" else 4)
        partial = (1 if mistake == "dw only" else 2) * runs * n * (2 if mistake == "partial16" else 4)
        moves = 1 if mistake == "partials once" else 2
        weight = 0 if mistake == "weight" else n * b
        out = 0 if mistake == "outputs" else 2 * n * (4 if mistake == "outputs32" else b)
        once = (2 if mistake == "no dx" else 3) * m * n * b + weight + stats + out
        ours = once + (0 if mistake == "no partials" else moves * partial)
        reread = 2 * m * n * b + (0 if mistake == "no stats reread" else stats)
        theirs = once if mistake == "no reread" else once + reread
        if mistake == "swapped":
            return theirs, ours
        unit = {"MB": 1e6, "GiB": 2**30}.get(mistake, 1)
        return (ours / unit, theirs / unit) if unit != 1 else (ours, theirs)
    return count


def test_right_count_passes(capsys):
    checks.check_backward_bytes(_student())
    assert "PASS" in capsys.readouterr().out


def test_the_reference_is_the_traffic_model():
    for shape in checks.SHAPES:
        assert checks.reference(*shape) == checks.backward_bytes(*shape) == _student()(*shape)


@pytest.mark.parametrize("fn", [traffic.backward.layernorm_backward, checks.reference, checks.backward_bytes])
def test_the_answer_key_is_refused(fn):
    with pytest.raises(check.CheckFailure, match="course's own"):
        checks.check_backward_bytes(fn)


def test_a_function_that_calls_the_traffic_model_is_refused():
    def count(n_rows, n_cols, itemsize, rows_per_program):
        c = traffic.backward.layernorm_backward(n_rows, n_cols, "bfloat16", block_m=rows_per_program)
        return c.fused.total_bytes, c.unfused.total_bytes

    with pytest.raises(check.CheckFailure, match="calls traffic.backward.layernorm_backward"):
        checks.check_backward_bytes(count)


@pytest.mark.parametrize("mistake, words", [
    ("no partials", "partial rows are missing"),
    ("partials once", "moves twice"),
    ("partial16", "partial sums are float32"),
    ("floor", "cdiv"),
    ("dw only", "one for dw and one for db"),
    ("stats", "statistics are missing"),
    ("stat16", "mean and rstd are float32"),
    ("weight", "reads the weight"),
    ("outputs", "dw and db are written too"),
    ("no reread", "GammaBeta kernel reads x and dy again"),
    ("no dx", "dx is written"),
    ("no stats reread", "reads mean and rstd again too"),
    ("divide", "counts a fraction of a row"),
    ("outputs32", "not as float32"),
    ("swapped", "the two counts are swapped"),
    ("MB", "in MB \\(1e6 bytes\\)"),
    ("GiB", "in GiB \\(2\\*\\*30 bytes\\)"),
])
def test_each_mistake_fails_naming_it(mistake, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_backward_bytes(_student(mistake))


def test_wrong_return_fails():
    with pytest.raises(check.CheckFailure, match="return"):
        checks.check_backward_bytes(lambda m, n, b, r: 3 * m * n * b)


def test_an_unrecognized_count_says_what_to_count():
    with pytest.raises(check.CheckFailure, match="kernel by kernel"):
        checks.check_backward_bytes(lambda m, n, b, r: (3 * m * n * b + 1, 5 * m * n * b + 1))


def test_untouched_exercise_raises_not_implemented():
    def count(n_rows, n_cols, itemsize, rows_per_program):
        raise NotImplementedError("Exercise 10.4")

    with pytest.raises(NotImplementedError):
        checks.check_backward_bytes(count)


def test_the_traffic_model_reached_through_importlib_is_refused():
    """The refusal is by behaviour: the module found by importlib and the function by getattr are caught
    when the function object is called, whatever name reached it."""
    def count(n_rows, n_cols, itemsize, rows_per_program):
        import importlib
        module = importlib.import_module("course_utils." + "traffic.backward")
        c = getattr(module, "layernorm_" + "backward")(n_rows, n_cols, {2: "bfloat16", 4: "float32"}[itemsize],
                                                      block_m=rows_per_program)
        return c.fused.total_bytes, c.unfused.total_bytes

    with pytest.raises(check.CheckFailure, match="called traffic.backward.layernorm_backward"):
        checks.check_backward_bytes(count)


def test_the_checkers_own_count_reached_through_importlib_is_refused():
    def count(n_rows, n_cols, itemsize, rows_per_program):
        import importlib
        return getattr(importlib.import_module("course_utils.checkers.layernorm_traffic"), "refer" + "ence")(
            n_rows, n_cols, itemsize, rows_per_program)

    with pytest.raises(check.CheckFailure, match="called checkers.layernorm_traffic.reference"):
        checks.check_backward_bytes(count)
