"""The checker toolkit must pass a right kernel and fail the usual wrong ones, saying where to look."""

import pytest
import torch
import triton
import triton.language as tl

from course_utils import check
from course_utils.faults.fits import FaultFits


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                SKIP_LAST: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    if SKIP_LAST:  # a grid bug: the last tile is never written
        mask = mask & (offsets < (n // BLOCK_SIZE) * BLOCK_SIZE)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    y = tl.load(y_ptr + offsets, mask=offsets < n, other=0.0)
    if MASKED:
        tl.store(out_ptr + offsets, x + y, mask=mask)
    else:
        tl.store(out_ptr + offsets, x + y)


def make_add(masked=True, skip_last=False):
    def add(x, y, out):
        n = x.numel()
        _add_kernel[(triton.cdiv(n, 128),)](x, y, out, n, BLOCK_SIZE=128, MASKED=masked, SKIP_LAST=skip_last)
        return out
    return add


SIZES = (1, 7, 1000, 3001)
DTYPES = (torch.float32, torch.float16)


def test_right_kernel_passes(capsys):
    check.check_elementwise("add", make_add(), torch.add, n_inputs=2, sizes=SIZES, dtypes=DTYPES, launches=1)
    out = capsys.readouterr().out
    assert out.startswith("PASS add:") and "1 kernel launch" in out
    assert "nan" not in out.lower() and "e-" not in out  # the verdict prints no floats


def test_missing_mask_is_caught_by_the_guards():
    with pytest.raises(check.CheckFailure, match="outside its buffer.*mask"):
        check.check_elementwise("add", make_add(masked=False), torch.add, n_inputs=2, sizes=(1000,),
                                dtypes=(torch.float32,))


def test_unwritten_elements_are_caught_by_the_poison():
    with pytest.raises(check.CheckFailure, match="poisoned|NaN") as e:
        check.check_elementwise("add", make_add(skip_last=True), torch.add, n_inputs=2, sizes=(1000,),
                                dtypes=(torch.float32,))
    assert "index 896" in str(e.value)  # the first element of the last tile of 128


def test_wrong_values_report_first_bad_index():
    def sub(x, y, out):
        out.copy_(x - y)
        return out
    with pytest.raises(check.CheckFailure, match=r"First at index \d+: got .*expected"):
        check.check_elementwise("add", sub, torch.add, n_inputs=2, sizes=(7,), dtypes=(torch.float32,))


def test_unfused_version_fails_the_launch_count():
    def two_launches(x, y):
        return (x + y) * 1.0
    with pytest.raises(check.CheckFailure, match="ran in torch .aten.add, aten.mul"):
        check.check_elementwise("add", two_launches, torch.add, n_inputs=2, sizes=(7,),
                                dtypes=(torch.float32,), launches=1)


def test_a_torch_op_is_one_launch_but_not_a_kernel():
    """Issue 17: "one launch" must count the student's Triton kernel, not any aten kernel."""
    with pytest.raises(check.CheckFailure, match="not in a Triton kernel of yours"):
        check.check_kernel_launches("add", torch.add, torch.ones(3), torch.ones(3), expected=1)


def test_refuse_answer_key_sees_aliases_helpers_and_closures():
    from course_utils import traffic as T
    from course_utils.traffic import softmax as renamed
    forbidden = {"calculator": T.softmax}

    def direct(r, c, b):
        return T.softmax(r, c, "fp32")

    def helper(r, c, b):
        return direct(r, c, b)

    def aliased(r, c, b):
        return renamed(r, c, "fp32")

    def outer():
        f = T.softmax
        return lambda r, c, b: f(r, c, "fp32")
    for fn in (direct, helper, aliased, outer(), T.softmax):
        with pytest.raises(check.CheckFailure, match="calculator"):
            check.refuse_answer_key("softmax_bytes", fn, forbidden)
    check.refuse_answer_key("softmax_bytes", lambda r, c, b: (8 * r * c * b, 2 * r * c * b), forbidden)


def test_writing_the_input_is_caught():
    def add_in_place(x, y):
        return x.add_(y)
    with pytest.raises(check.CheckFailure):
        check.check_elementwise("add", add_in_place, torch.add, n_inputs=2, sizes=(7,), dtypes=(torch.float32,))


def test_a_crash_is_reported_not_propagated_raw():
    def crash(x):
        raise IndexError("boom")
    with pytest.raises(check.CheckFailure, match="raised IndexError: boom"):
        check.check_elementwise("id", crash, lambda x: x, sizes=(7,), dtypes=(torch.float32,))


def test_not_implemented_passes_through():
    def stub(x):
        raise NotImplementedError("Exercise 1")
    with pytest.raises(NotImplementedError):
        check.check_elementwise("id", stub, lambda x: x, sizes=(7,), dtypes=(torch.float32,))


def test_fresh_inputs_every_call():
    assert not torch.equal(check.randn((64,)), check.randn((64,)))


def test_randn_outliers_and_signs():
    x = check.randn((10_000,), outliers=0.01, outlier_scale=100.0)
    assert (x < 0).any() and (x > 0).any()
    assert x.abs().max() > 20


def test_compare_nan_and_inf_rules():
    e = torch.tensor([1.0, float("inf"), float("nan")], dtype=torch.float64)
    check.compare("ok", e.float(), e)
    with pytest.raises(check.CheckFailure, match="still holds the NaN"):
        check.compare("bad", torch.tensor([float("nan"), float("inf"), float("nan")]), e)
    with pytest.raises(check.CheckFailure, match="shape"):
        check.compare("bad", torch.zeros(2), e)


def test_tolerance_is_per_dtype_and_rejects_unknown():
    assert check.tolerance(torch.float16)[1] > check.tolerance(torch.float32)[1]
    with pytest.raises(ValueError, match="expected one of"):
        check.tolerance(torch.int32)


def test_guards_detect_writes_before_the_start():
    g = check.Guarded((10,), torch.float32)
    g.buffer[check.GUARD - 1] = 0.0
    with pytest.raises(check.CheckFailure, match="before the start"):
        g.check("x")


def test_fault_fits_names_the_closest_of_two_candidates_inside_the_tolerance():
    """Two GELU forms 0.02 apart both sit inside a float32 GEMM's tolerance (0.045 at K=512): the fault is
    the closer one, whatever the order of the candidates (a TF32 GEMM on an H100 named the farther one)."""
    from course_utils.faults import gemm as FG
    x = torch.linspace(-4, 4, 4001, dtype=torch.float64)
    noise = 0.004 * torch.sin(x * 37.0)   # rounding-sized, far below the two forms' distance
    got = FG.gelu_no_cubic(x) + noise
    fits = FaultFits(got, atol=0.045, rtol=0.005, right=FG.gelu_tanh(x))
    assert fits.add("sigmoid", FG.gelu_sigmoid(x)) and fits.add("no cubic", FG.gelu_no_cubic(x))
    assert fits.best() == "no cubic"


def test_fault_fits_takes_a_near_fit_only_far_closer_than_the_right_answer():
    g = torch.zeros(10_000, dtype=torch.float64)
    right = torch.ones_like(g)                    # the right answer misses everywhere
    near = g.clone()
    near[:50] = 1.0                               # 0.5% of the elements off: a near fit
    fits = FaultFits(g, atol=1e-3, rtol=0.0, right=right)
    assert not fits.add("near", near) and fits.best() == "near"
    # a candidate that misses as much as the right answer does, or 2% of the elements, names nothing
    far = g.clone()
    far[:200] = 1.0
    fits = FaultFits(g, atol=1e-3, rtol=0.0, right=right)
    assert not fits.add("far", far) and fits.best() == ""
    almost_right = right.clone()
    almost_right[:9_990] = 0.0                    # the right answer itself misses 0.1%: no near fit is believable
    fits = FaultFits(g, atol=1e-3, rtol=0.0, right=almost_right)
    assert not fits.add("near", near) and fits.best() == ""


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32's 10 mantissa bits (round half up on the bits), as an H100's tl.dot reads it."""
    bits = t.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def test_unscaled_scores_are_named_through_tf32_rounding():
    """Chapter 7's fault "the scores are not scaled" on a GPU: float32 inputs, both dot products in TF32; the
    unscaled softmax is sharp enough that the rounding leaves a few elements outside the tolerance of the
    unscaled float64 candidate (seen on an H100): the near fit still names it."""
    from course_utils.checkers import attention as ca
    from course_utils.faults import attention as af
    # on the CPU wherever the session runs: the emulated rounding, not the device's float32 matmul, is the case
    q, k, v = (t.cpu() for t in ca._inputs(2, 3, 1000, 64, torch.float32, 1.0, 0.0))
    p = torch.softmax(_tf32(q) @ _tf32(k).transpose(-1, -2), dim=-1)
    got = _tf32(p) @ _tf32(v)
    atol, rtol = 5e-3, 5e-3   # ATTN_TOLERANCES' float32 on a GPU (the CPU's are tighter: no TF32 there)
    unscaled = af._attention64(q, k, v, 1.0, af._every)
    off = ~torch.isclose(got.double(), unscaled, atol=atol, rtol=rtol)
    assert 0 < int(off.sum()) <= 0.01 * got.numel()   # the case this test is for: an exact fit fails
    assert "scores are not scaled" in ca._diagnose(got, q, k, v, False, atol, rtol)
