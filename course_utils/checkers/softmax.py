"""Checks for chapters 5 and 6 (fused softmax, online softmax).

- :func:`check_row_kernel` launches a student's one-row-per-program kernel
  ``kernel[(n_rows,)](y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE=...)``.
- :func:`check_online_update` folds a student's ``update(m, s, tile) -> (m, s)`` over random tiles.
- :func:`check_long_row_kernel` launches a student's long-row kernel (same signature) with a
  BLOCK_SIZE much shorter than the row, so the row takes many tiles.

Every call draws fresh inputs: signed values around a large offset on even rows (an ``exp`` without
the max subtracted overflows) and around -5 on odd rows (a padding of 0 would win the max), a last row
around -300 (``exp(x - 0)`` underflows to 0 in every element: a running max started at 0 divides 0 by 0),
magnitude outliers, row lengths that are not powers of two, rows read
through a row stride wider than the row (the gap holds huge values, so a read past the row's end
or a wrong stride changes the answer), outputs poisoned with NaN inside guard zones.
"""

from __future__ import annotations

import numpy as np
import torch
import triton

from .. import check, env
from ..faults.softmax import name_row_fault, name_update_fault, row_faults
from . import answer_keys
from .loads import reads_per_element, span

OFFSET = 100.0      # exp(100) overflows fp16 and exp(100 + outliers) overflows fp32
OUTLIER = 1000.0
DEEP = -300.0       # exp(-300 + a few) underflows to 0 in float32: only x - max keeps the row's sum positive


def _dtypes():
    return env.supported_dtypes()


def _refuse_course(what: str, answer) -> None:
    """The course's softmax kernels, launchers and reference (both shelves), and the loop forms of
    exercise 6.2 compiled in ``course_utils.ptx_facts``, are the answer."""
    keys = answer_keys.course_answers("course_utils.kernels.softmax", "course_utils.ptx_facts")
    keys.update(answer_keys.course_answers("course_utils.tuned.softmax", only=(
        "softmax", "launch", "tile_rows", "softmax_persistent_kernel", "softmax_two_block_kernel",
        "softmax_split_kernel")))
    answer_keys.refuse(what, answer, keys)


def _strided_input(n_rows: int, n_cols: int, dtype, gap: int, **randn_kw):
    """x of shape (n_rows, n_cols) inside a guarded (n_rows, n_cols + gap) buffer: row stride > n_cols.

    The gap columns hold +/-3e4 (finite in fp16 too), so reading them corrupts max or sum."""
    stride = n_cols + gap
    full = check.randn((n_rows, stride), dtype, **randn_kw)
    if gap:
        junk = torch.where(torch.rand(n_rows, gap, device=full.device) < 0.5, 3e4, -3e4)
        full[:, n_cols:] = junk.to(dtype)
    g = check.guarded_copy(full)
    return g, g.tensor[:, :n_cols]


def _ref(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.to(torch.float64), dim=-1)


def _case(what, dtype, n_rows, n_cols) -> str:
    return f"{what} ({str(dtype).removeprefix('torch.')}, {n_rows} rows x {n_cols} cols)"


def _launch_checked(what, kernel, x, y, block, case, hint):
    try:
        kernel[(x.shape[0],)](y, x, x.shape[1], x.stride(0), y.stride(0), BLOCK_SIZE=block)
    except NotImplementedError:
        raise
    except check.CheckFailure:
        raise
    except Exception as e:  # a crash in the student's kernel: say where
        raise check.CheckFailure(f"{case}: your kernel raised {type(e).__name__}: {str(e)[:400]}\n"
                                 "It is launched as kernel[(n_rows,)](y_ptr, x_ptr, n_cols, x_row_stride, "
                                 "y_row_stride, BLOCK_SIZE=...)." + (f"\nHint: {hint}" if hint else "")) from e


def _rounded_once(dtype) -> tuple[float, float]:
    """(atol, rtol) of a result computed in float32 and rounded once to ``dtype``: half a unit in the
    last place, plus float32's own error. Computing in fp16 or bf16 rounds several times and fails."""
    if dtype == torch.float16:
        return 2.0**-25, 2.0**-11 + 1e-5
    if dtype == torch.bfloat16:
        return 1e-30, 2.0**-8 + 1e-5
    return check.tolerance(dtype)


def _loads_inside(loads, t: torch.Tensor) -> int:
    """How many masked-in lanes of the recorded loads read the bytes of ``t``."""
    addr = loads.flat()
    lo, hi = span(t)
    return int(((addr >= lo) & (addr < hi)).sum())


def _loads_off_rows(loads, x: torch.Tensor) -> int:
    """How many masked-in lanes read no element of the 2-D row-strided ``x``: the gap after a row's last column,
    before its first row or past its last (the loads of another tensor are counted too)."""
    addr = loads.flat().astype(np.int64) - x.data_ptr()
    size = x.element_size()
    idx = addr // size
    rows, cols = idx // x.stride(0), idx % x.stride(0)
    inside = (addr >= 0) & (addr % size == 0) & (rows < x.shape[0]) & (cols < x.shape[1])
    return int((~inside).sum())


def _judge_rows(what, kernel, shapes, block_of, dtypes, hint, extra_rows=None, passes=None):
    for dtype in dtypes:
        for n_rows, n_cols in shapes:
            case = _case(what, dtype, n_rows, n_cols)
            xg, x = _strided_input(n_rows, n_cols, dtype, gap=5, offset=OFFSET, scale=3.0, outliers=0.02,
                                   outlier_scale=OUTLIER)
            # Odd rows sit around -5 instead: there a padding of 0 instead of -inf would win the max.
            x[1::2] -= OFFSET + 5.0
            # Every even row holds a value >= OFFSET, so exp without the max overflows float32 whatever the draw
            # (a 1x1 case drawn below 88.7, exp's limit, once passed an unstable kernel to a later case's hint).
            x[0::2, -1] = x[0::2, -1].clamp(min=OFFSET)
            deep = n_rows - 1 if n_rows >= 2 else None
            if deep is not None:  # all far below 0, no outliers: log-probabilities, scores after a mask
                x[deep] = check.randn((n_cols,), torch.float32, scale=3.0, offset=DEEP).to(dtype)
            if extra_rows is not None:
                extra_rows(x)
            before = x.clone()
            flat_rows = xg.tensor.reshape(-1)[: n_rows * n_cols].view(n_rows, n_cols).clone()  # rows n_cols apart
            # y has its own row stride, neither n_cols nor x's: a kernel that ignores y_row_stride
            # writes rows in the wrong place (and the gap columns between them must stay untouched)
            y_gap = 3
            yg = check.Guarded((n_rows, n_cols + y_gap), dtype)
            gap_before = yg.tensor[:, n_cols:].clone()
            y = yg.tensor[:, :n_cols]
            block = block_of(n_cols)
            with check.track_loads() as loads:
                _launch_checked(what, kernel, x, y, block, case, hint)
            if not torch.equal(yg.tensor[:, n_cols:].isnan(), gap_before.isnan()):
                raise check.CheckFailure(f"{case}: your kernel wrote outside the rows of y, into the gap between "
                                         "them: mask tl.store with offsets < n_cols, and find row pid at y_ptr + "
                                         "pid * y_row_stride (y's rows are not n_cols apart here).")
            yg.check(case, hint)
            read_back = _loads_inside(loads, yg.buffer) if loads.active else 0
            if read_back:
                raise check.CheckFailure(
                    f"{case}: your kernel loaded {read_back} element(s) of y, its output: y is written once, "
                    "from x and the row's max and sum, and never read back." + (
                        " Writing exp(x - m) into y in one loop and dividing it by s in another loop over y is one "
                        "more pass over memory (with a max loop before it, three): keep the running max and sum "
                        "in one loop over x (rescale s by exp(m - m_new) when the max grows), then write "
                        "exp(x - m) / s." if passes is not None else ""))
            off_rows = _loads_off_rows(loads, x) if loads.active else 0
            if off_rows:
                raise check.CheckFailure(
                    f"{case}: your kernel loaded {off_rows} element(s) outside the rows of x (past a row's last "
                    "column, into the gap before the next row, or past the buffer): pass mask=cols < n_cols to "
                    "every tl.load, the one of a loop that only writes too (a masked tl.store does not make an "
                    "unmasked load safe: past the end of a buffer there may be no memory at all), and find row "
                    "pid at x_ptr + pid * x_row_stride (x's rows are not n_cols apart here).")
            if loads.widths and max(loads.widths) > block:
                raise check.CheckFailure(f"{case}: your kernel loads {max(loads.widths)} lanes at once but was "
                                         f"launched with BLOCK_SIZE={block}: tile the row with "
                                         "tl.arange(0, BLOCK_SIZE), so any row length works.")
            if passes is not None and loads.active:
                reads = reads_per_element(loads, x)
                if reads > passes + 0.01:
                    raise check.CheckFailure(
                        f"{case}: your kernel read each element of x {reads:.2g} times; the online softmax "
                        f"reads it {passes} times: one loop keeps the running max and sum together "
                        "(rescaling the sum when the max grows), a second one writes. Separate max and sum "
                        "loops are the three-pass softmax this chapter replaces.")
            ref = _ref(before)
            undivided = torch.exp(before.double() - before.double().amax(-1, keepdim=True))
            atol_d, rtol_d = check.tolerance(dtype)
            if not torch.allclose(undivided, ref, atol=atol_d, rtol=rtol_d) and \
                    torch.allclose(y.double(), undivided, atol=atol_d, rtol=rtol_d):
                raise check.CheckFailure(f"{case}: your kernel wrote exp(x - max) without dividing it by the row's "
                                         "sum of exp(x - max): softmax is exp(x - m) / s.")
            _name_fault(case, y, ref, row_faults(before, block, flat_rows, online=passes is not None), dtype)
            if deep is not None:
                # The other rows first, with the exercise's hint: a fault every row shows (a running sum not
                # rescaled) is named for what it is, not by the deep row's hint on the draws where it shows there
                # first. A fault only the deep row shows (a max started at 0) still gets the deep row's hint.
                y_other = y.clone()
                y_other[deep] = ref[deep].to(dtype)
                check.compare(case, y_other, ref, dtype=dtype, hint=hint)
                deep_hint = (f"every value of row {deep} is near {DEEP:g}, so exp(x) underflows to 0 there: only the "
                             "row's own max, subtracted before tl.exp, keeps the sum positive. A max that starts at 0 "
                             "instead of -inf (m = 0.0 before the loop), a padding of 0 that wins the max, or no max "
                             "at all, gives exp(x - 0) = 0 everywhere and 0 / 0 = NaN.")
                check.compare(f"{case}, row {deep} (values around {DEEP:g})", y[deep], _ref(before)[deep],
                              dtype=dtype, hint=deep_hint)
            check.compare(case, y, _ref(before), dtype=dtype, hint=hint)
            atol, rtol = _rounded_once(dtype)
            if dtype != torch.float32:
                check.compare(case, y, _ref(before), dtype=dtype, atol=atol, rtol=rtol,
                              hint="a result computed in float32 and rounded once is within half a unit in the "
                                   "last place: load, then x.to(tl.float32), and round only at the store "
                                   "(y.to(y_ptr.dtype.element_ty)); computing in the input dtype rounds at "
                                   "every step")
            xg.check(f"{case}, the input buffer")
            if not torch.equal(x, before):
                raise check.CheckFailure(f"{case}: your kernel changed its input; it must only write y")


def _name_fault(case, y, ref, candidates, dtype) -> None:
    """If ``y`` is not the softmax but one of the usual slips' outputs, raise naming it (the comparison's first
    line kept; a NaN named for its cause, not the poisoned output's 'does the grid cover every element')."""
    try:
        check.compare(case, y, ref, dtype=dtype)
    except check.CheckFailure as e:
        fault = name_row_fault(y, ref, candidates, *check.tolerance(dtype))
        if fault:
            raise check.CheckFailure(f"{str(e).splitlines()[0]}\nLikely cause: {fault}.") from None


def check_row_kernel(kernel, name: str = "fused softmax, one row per program") -> None:
    """Judge a one-row-per-program softmax kernel launched with BLOCK_SIZE = next_power_of_2(n_cols)."""
    _refuse_course(name, kernel)
    shapes = env.pick(gpu=((1, 1), (7, 13), (37, 1000), (5, 4097), (3, 12345)),
                      cpu=((1, 1), (7, 13), (37, 300), (5, 1000)))
    hint = ("load the row with mask=offsets < n_cols and other=-float('inf'), subtract the row's max "
            "before tl.exp, and use row_stride to find the row (rows here are not contiguous).")
    _judge_rows(name, kernel, shapes, triton.next_power_of_2, _dtypes(), hint)
    check.verdict(name, "matches the float64 softmax on every shape and dtype tried, strided rows, "
                        "no writes outside the output")


def check_launcher(fused_softmax, name: str = "fused_softmax") -> None:
    """Judge a launcher ``fused_softmax(x)``: the softmax of rows, in one launch of the student's kernel."""
    _refuse_course(name, fused_softmax)
    for shape in ((9, 777), (4, 1)):
        x = check.randn(shape, offset=50.0)
        try:
            got = fused_softmax(x)
        except (NotImplementedError, check.CheckFailure):
            raise
        except Exception as e:
            raise check.CheckFailure(f"{name}{shape}: your launcher raised {type(e).__name__}: {e}") from e
        check.compare(f"{name}{shape}", got, torch.softmax(x.double(), -1), dtype=x.dtype)
    check.check_kernel_launches(name, fused_softmax, x, expected=1)
    check.verdict(name, "matches torch.softmax in one kernel launch")


def check_long_row_kernel(kernel, name: str = "online softmax, long rows", block_size: int = 128) -> None:
    """Judge a long-row kernel launched with a fixed BLOCK_SIZE much shorter than the rows."""
    _refuse_course(name, kernel)
    # the last shape's rows are a whole number of tiles: a loop over the full tiles that stops one tile short
    # (start < n_cols - BLOCK_SIZE), with a masked tail after it, is right on every other length
    shapes = env.pick(gpu=((1, 1), (3, 127), (7, 1000), (5, 20000), (2, 100003), (3, 64 * block_size)),
                      cpu=((1, 1), (3, 127), (7, 1000), (2, 3001), (1, 4500),   # 4500: longer than one 4096 tile
                           (2, 4 * block_size)))
    hint = ("keep a running max m and sum s over the tiles: when the max grows from m to m_new, rescale "
            "s by exp(m - m_new) before adding the tile's exp(x - m_new); a second loop writes "
            "exp(x - m) / s. Lanes or tiles that have seen only -inf must not turn into NaN.")

    def leading_minus_inf(x):
        # Row 0 starts with more than a whole tile of -inf (as a causal mask makes): the running
        # statistics see nothing finite at first.
        if x.shape[1] > block_size + 2:
            x[0, : block_size + 2] = float("-inf")

    _judge_rows(name, kernel, shapes, lambda n: block_size, _dtypes(), hint, extra_rows=leading_minus_inf, passes=2)
    check.verdict(name, f"matches the float64 softmax with BLOCK_SIZE={block_size} on every shape and dtype "
                        "tried, rows that start with -inf, strided rows, no writes outside the output")


def _stats_ref(x64: torch.Tensor):
    m = x64.amax(dim=-1)
    s = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp(x64 - m[:, None]).sum(-1))
    return m, s


def check_online_update(update, name: str = "online softmax update") -> None:
    """Fold ``update(m, s, tile) -> (m_new, s_new)`` over the tiles of random rows, from
    m = -inf and s = 0, and compare with (max, sum of exp(x - max)) in float64."""
    _refuse_course(name, update)
    gen = check.generator(torch.device("cpu"))
    cases = [(4, 1, 1), (5, 37, 8), (3, 1000, 64), (6, 999, 100)]
    for rows, cols, tile in cases:
        x = check.randn((rows, cols), torch.float64, device="cpu", scale=5.0, offset=OFFSET * 5, outliers=0.05,
                        outlier_scale=OUTLIER, gen=gen)
        if cols > tile:  # a row whose first tile is all -inf, one whose max sits in the last tile, one in the first
            x[0, :tile] = float("-inf")
            x[1, -1] = x[1].max() + 50.0
            x[2, 0] = x[2].max() + 50.0   # a max only the running m remembers: a tile's own max alone is wrong
        case = f"{name} ({rows} rows x {cols} cols, tiles of {tile})"
        m = torch.full((rows,), float("-inf"), dtype=torch.float64)
        s = torch.zeros(rows, dtype=torch.float64)
        for start in range(0, cols, tile):
            try:
                out = update(m.clone(), s.clone(), x[:, start:start + tile].clone())
            except NotImplementedError:
                raise
            except Exception as e:
                raise check.CheckFailure(f"{case}: update raised {type(e).__name__}: {e}") from e
            if not (isinstance(out, tuple) and len(out) == 2):
                raise check.CheckFailure(f"{case}: update must return a tuple (m_new, s_new), got {type(out).__name__}")
            m, s = out
            for t, what in ((m, "m_new"), (s, "s_new")):
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != (rows,):
                    raise check.CheckFailure(f"{case}: {what} must be a tensor of shape ({rows},), "
                                             f"got {getattr(t, 'shape', type(t).__name__)}")
            m, s = m.to(torch.float64), s.to(torch.float64)
        m_ref, s_ref = _stats_ref(x)
        hint = ("m_new = max(m, tile.amax(-1)); s_new = s * exp(m - m_new) + exp(tile - m_new).sum(-1). "
                "While a row has seen only -inf, m_new is -inf and exp(-inf - -inf) is NaN: keep s = 0 there.")
        f64 = torch.allclose(m, m_ref, atol=1e-10, rtol=1e-10) and torch.allclose(s, s_ref, atol=1e-10, rtol=1e-9)
        f32 = torch.allclose(m, m_ref, atol=1e-5, rtol=1e-5) and torch.allclose(s, s_ref, atol=1e-5, rtol=1e-5)
        if f32 and not f64:  # right to float32's 7 digits only: m matches or not depending on the draw, s rarely
            raise check.CheckFailure(f"{case}: m and s are right to about 7 digits only, float32's precision: "
                                     "compute in the dtype of m, s and tile (float64 here), with no .float() "
                                     "or float32 tensor on the way.")
        try:
            check.compare(f"{case}: running max m", m, m_ref, dtype=torch.float64, hint=hint)
            check.compare(f"{case}: running sum s", s, s_ref, dtype=torch.float64, rtol=1e-9, hint=hint)
        except check.CheckFailure as e:
            fault = name_update_fault(update)
            if fault:
                raise check.CheckFailure(f"{str(e).splitlines()[0]}\nLikely cause: {fault}.") from None
            raise
        y = torch.exp(x - m[:, None]) / s[:, None]
        check.compare(f"{case}: exp(x - m) / s", y, torch.softmax(x, -1), dtype=torch.float64, rtol=1e-9, hint=hint)
    check.verdict(name, "the folded statistics give the exact softmax on every row tried, "
                        "including rows that start with -inf and huge values")
