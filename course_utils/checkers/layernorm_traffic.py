"""Check for chapter 10's modelling exercise: the bytes of LayerNorm's backward, counted by the student
for the course's tuned backward and for PyTorch's (:func:`check_backward_bytes`).

The answer key is ``traffic.backward.layernorm_backward`` (logical traffic, the course's conventions): a
function that calls it, or this module's own count, is refused, by name in its code and by behaviour (a
call of the function object while the student's function runs, whatever route reached it:
:func:`course_utils.checkers.calls.run_watched`). When the student's count differs, the
usual mistakes are recounted (:func:`backward_bytes` with a fault's keywords) and the one that matches
is named. Pure arithmetic on Python integers: no tensors, no kernels.
"""

from __future__ import annotations

from .. import check

# (n_rows, n_cols, itemsize, rows_per_program): the recorded bf16 and fp32 shapes (256 MiB of x) with
# the tuned plan's runs, and odd shapes whose last run is short (n_rows not a multiple of the run)
SHAPES = ((32768, 4096, 2, 125), (16384, 4096, 4, 64), (131072, 1024, 2, 250), (1000, 333, 4, 7),
          (77, 1, 2, 16), (5, 4097, 2, 2), (300, 700, 4, 300))
STAT_BYTES = 4      # mean and rstd are float32, whatever x's dtype
PARTIAL_BYTES = 4   # so are the partial sums of dw and db


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def backward_bytes(n_rows, n_cols, itemsize, rows_per_program, *, partials=True, partial_reads=True,
                   partial_bytes=PARTIAL_BYTES, floor_runs=False, divide_runs=False, db=True, stats=True,
                   stat_bytes=STAT_BYTES, weight=True, outputs=True, output_bytes=None, reread=True, dx=True,
                   reread_stats=True):
    """(ours, PyTorch's) bytes of LayerNorm's backward, x, dy, dx, w, dw and db of ``itemsize`` bytes each.
    Ours: one kernel reads x, dy, w, mean and rstd, writes dx and two float32 partial rows (dw, db) per run
    of ``rows_per_program`` rows; the column sums read the partial rows and write dw and db. PyTorch's:
    a dx kernel (x, dy, w, mean, rstd -> dx), then a GammaBeta kernel that reads x, dy, mean and rstd again
    (-> dw, db). The keywords make the usual mistakes (the defaults are right)."""
    m, n, b = n_rows, n_cols, itemsize
    runs = n_rows // rows_per_program if floor_runs else _cdiv(n_rows, rows_per_program)
    if divide_runs:
        runs = n_rows / rows_per_program
    st = 2 * m * stat_bytes if stats else 0
    part = (2 if db else 1) * runs * n * partial_bytes if partials else 0
    w = n * b if weight else 0
    out = 2 * n * (output_bytes or b) if outputs else 0
    big = (3 if dx else 2) * m * n * b   # x and dy read, dx written
    ours = big + w + st + part * (2 if partial_reads else 1) + out
    theirs = big + w + st + out + ((2 * m * n * b + (st if reread_stats else 0)) if reread else 0)
    return ours, theirs


FAULTS = (
    ("the partial rows are missing: each run of rows_per_program rows leaves one float32 row of n_cols sums "
     "for dw and one for db, which the column-sum kernels read back", {"partials": False}),
    ("each partial row moves twice: the backward kernel writes it and the column sums read it back",
     {"partial_reads": False}),
    ("the partial sums are float32 (4 bytes) whatever x's dtype", {"partial_bytes": 2}),
    ("the number of partial rows is cdiv(n_rows, rows_per_program): the last run is shorter, but it still "
     "writes its rows", {"floor_runs": True}),
    ("the number of partial rows is a whole number, cdiv(n_rows, rows_per_program): n_rows / rows_per_program "
     "counts a fraction of a row for the last, shorter run, which writes a whole row all the same",
     {"divide_runs": True}),
    ("there are two partial buffers, one for dw and one for db", {"db": False}),
    ("the statistics are missing: each kernel that recomputes x_hat reads mean and rstd, 8 bytes a row",
     {"stats": False}),
    ("mean and rstd are float32 (4 bytes each) whatever x's dtype", {"stat_bytes": 2}),
    ("g = dy * w: the dx kernel reads the weight (n_cols values)", {"weight": False}),
    ("dw and db are written too: n_cols values each, in the weight's dtype", {"outputs": False}),
    ("dw and db are written in the weight's dtype (itemsize bytes each), not as float32: the column sums add in "
     "float32 and store in w's dtype", {"output_bytes": 4}),
    ("PyTorch's GammaBeta kernel reads x and dy again (with mean and rstd) to sum dw and db: that second read "
     "is the difference between the two designs", {"reread": False}),
    ("dx is written: n_rows x n_cols values in x's dtype, by ours and by PyTorch's dx kernel", {"dx": False}),
    ("PyTorch's GammaBeta kernel reads mean and rstd again too (8 bytes a row), with x and dy",
     {"reread_stats": False}),
)


def reference(n_rows, n_cols, itemsize, rows_per_program) -> tuple[int, int]:
    """The course's count: ``traffic.backward.layernorm_backward``, fused (ours) and eager (PyTorch's)."""
    from .. import traffic
    dtype = {2: "bfloat16", 4: "float32"}[itemsize]
    c = traffic.backward.layernorm_backward(n_rows, n_cols, dtype, block_m=rows_per_program)
    return c.fused.total_bytes, c.unfused.total_bytes


def answers() -> dict:
    from .. import traffic
    return {"traffic.backward.layernorm_backward (the answer key)": traffic.backward.layernorm_backward,
            "traffic.layernorm (the forward's count)": traffic.layernorm,
            "checkers.layernorm_traffic.reference (the answer key)": reference,
            "checkers.layernorm_traffic.backward_bytes (the answer key)": backward_bytes}


def _as_int(v):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return int(f) if f == int(f) else f


UNITS = {"kB (1e3 bytes)": 1e3, "KiB (2**10 bytes)": 2**10, "MB (1e6 bytes)": 1e6, "MiB (2**20 bytes)": 2**20,
         "GB (1e9 bytes)": 1e9, "GiB (2**30 bytes)": 2**30}


def _units_or_order(got, want) -> str:
    """'' unless ``got`` is the right pair in other units, or in the other order."""
    if None in got:
        return ""
    if got == (want[1], want[0]):
        return ("the two counts are swapped: return (ours, PyTorch's), the course's backward first; PyTorch's, "
                "which reads x and dy a second time, is the larger.")
    for unit, size in UNITS.items():
        if all(abs(g * size - w) <= 1e-3 * w for g, w in zip(got, want)):   # rounded to a few digits too
            return f"your counts are in {unit}: return bytes (a count of bytes, not converted to any unit)."
    return ""


def check_backward_bytes(fn, name: str = "bytes of LayerNorm's backward") -> None:
    """``fn(n_rows, n_cols, itemsize, rows_per_program) -> (ours_bytes, pytorch_bytes)``: logical traffic."""
    from .calls import refuse_calls, run_watched

    check.refuse_answer_key(name, fn, answers())
    for m, n, b, rpp in SHAPES:
        case = f"{name} ({m} rows x {n} cols, {b}-byte elements, rows_per_program={rpp})"
        got, calls = run_watched(fn, (m, n, b, rpp), answers())
        refuse_calls(name, calls)
        check.require(isinstance(got, (tuple, list)) and len(got) == 2,
                      f"{case}: return (ours_bytes, pytorch_bytes), got {type(got).__name__}")
        got = tuple(_as_int(g) for g in got)
        want = reference(m, n, b, rpp)
        if got == want:
            continue
        fault = _units_or_order(got, want)
        if fault:
            raise check.CheckFailure(f"{case}: {fault}")
        off = "; ".join(f"{who} is {abs(g - w)} bytes {'more' if g > w else 'fewer'}"
                        for who, g, w in (("ours", got[0], want[0]), ("PyTorch's", got[1], want[1])) if g != w)
        hints = list(dict.fromkeys(h for h, kw in FAULTS for i in (0, 1) if got[i] != want[i]
                                   and got[i] == backward_bytes(m, n, b, rpp, **kw)[i]))
        if len(hints) == 1:
            hint = hints[0]
        elif hints:
            hint = "one of these: " + " / or: ".join(f"({k + 1}) {h}" for k, h in enumerate(hints))
        else:
            hint = ("count each tensor a kernel reads once and each it writes once (elements x bytes), kernel by "
                    "kernel: x, dy, w, mean, rstd in; dx and the float32 partial rows out; then the column sums.")
        raise check.CheckFailure(f"{case}: your count differs from the traffic model's: {off}.\nHint: {hint}")
    check.verdict(name, f"ours and PyTorch's bytes match the traffic model at {len(SHAPES)} shapes, recorded and odd")
