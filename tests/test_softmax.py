"""Unit tests for softmax: the teaching shelf (course_utils.kernels.softmax) and the tuned one
(course_utils.tuned.softmax, reached through the old path too). Run under Triton's interpreter on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from course_utils import check, env, hardware
from course_utils.kernels import softmax as sm
from course_utils.profile import count_launches
from course_utils.tuned import softmax as tuned

DTYPES = (torch.float32, torch.float16)
CPU_VERSIONS = ("fused", "persistent", "online", None)


def _ref(x, dim=-1):
    return torch.softmax(x.double(), dim=dim)


def _close(got, x, dim=-1):
    check.compare("softmax", got, _ref(x, dim), dtype=got.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("version", CPU_VERSIONS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (3, 1000), (2, 1537)])
def test_matches_float64_on_random_signed_rows(dtype, version, shape):
    x = check.randn(shape, dtype, scale=4.0, offset=-30.0, outliers=0.02, outlier_scale=500.0)
    y = tuned.softmax(x, version=version)
    assert y.shape == x.shape and y.dtype == dtype
    _close(y, x)


@pytest.mark.parametrize("version", CPU_VERSIONS)
def test_out_is_fully_written_after_nan_poisoning(version):
    x = check.randn((5, 333), scale=3.0)
    out = check.Guarded((5, 333), torch.float32)
    got = tuned.softmax(x, version=version, out=out.tensor)
    assert got is out.tensor
    out.check("softmax out=")
    assert not out.tensor.isnan().any()
    _close(out.tensor, x)


def test_leading_dims_and_other_dims():
    x = check.randn((2, 3, 4, 129))
    _close(tuned.softmax(x), x)
    _close(tuned.softmax(x, dim=1), x, dim=1)
    _close(tuned.softmax(x, dim=-3), x, dim=-3)
    v = check.randn((77,))
    _close(tuned.softmax(v), v)


def test_strided_rows_are_read_in_place():
    base = check.randn((6, 300))
    x = base[:, 5:250]
    assert x.stride(0) == 300
    _close(tuned.softmax(x), x)
    xt = check.randn((40, 9)).t()     # last dim not contiguous: copied, still right
    _close(tuned.softmax(xt), xt)


def test_edge_rows_follow_torch():
    x = torch.full((3, 5000), -math.inf, device=env.DEVICE)
    x[1, 4321] = 2.0
    x[2] = torch.randn(5000, device=env.DEVICE) * 1e4 + 3e4
    for version in ("persistent", "online"):
        y, ref = tuned.softmax(x, version=version), torch.softmax(x, -1)
        assert y[0].isnan().all() and ref[0].isnan().all()
        assert y[1, 4321] == 1 and y[1].sum() == 1
        torch.testing.assert_close(y[2], ref[2], atol=1e-6, rtol=1e-5)


def test_online_kernel_with_leading_minus_inf_tiles():
    x = check.randn((4, 2000), scale=5.0)
    x[0, :700] = -math.inf
    x[1, 1500:] = -math.inf
    y = torch.empty_like(x)
    sm.softmax_online_kernel[(4,)](y, x, 2000, x.stride(0), y.stride(0), BLOCK_SIZE=128)
    _close(y, x)


def test_split_kernel_single_chunk_runs_under_interpreter():
    x = check.randn((3, 5000), scale=3.0)
    _close(tuned.softmax(x, version="split"), x)


@pytest.mark.skipif(not env.on_gpu(), reason="programs of one row wait for each other: GPU only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_cols", [8193, 20000, 65536, 100_003])
def test_split_kernel_on_gpu(dtype, n_cols):
    x = check.randn((37, n_cols), dtype, scale=4.0, offset=50.0, outliers=0.01, outlier_scale=500.0)
    x[0, : n_cols // 2] = -math.inf
    out = check.Guarded((37, n_cols), dtype)
    tuned.softmax(x, version="split", out=out.tensor)
    out.check("split softmax")
    _close(out.tensor, x)


def test_empty_input_returns_empty_without_launch():
    x = torch.empty(0, 17, device=env.DEVICE)
    y = tuned.softmax(x)
    assert y.shape == (0, 17)
    assert count_launches(tuned.softmax, x).total == 0
    assert tuned.softmax(torch.empty(4, 0, device=env.DEVICE)).shape == (4, 0)


def test_one_launch_and_reference_five():
    x = check.randn((8, 100))
    tuned.softmax(x)
    assert count_launches(tuned.softmax, x).total == 1
    assert count_launches(sm.softmax_ref, x).total == 5
    _close(sm.softmax_ref(x), x)


@pytest.mark.parametrize("bad, err", [
    (torch.ones(3, 4, dtype=torch.int32), TypeError),
    (torch.ones(3, 4, dtype=torch.float64), TypeError),
    ([1.0, 2.0], TypeError),
    (torch.tensor(1.0), ValueError),
    (torch.ones(3, 4, device="meta"), ValueError),
])
def test_bad_inputs_raise_clear_errors(bad, err):
    with pytest.raises(err):
        tuned.softmax(bad)


def test_bad_arguments():
    x = check.randn((3, 4))
    with pytest.raises(ValueError, match="out of range"):
        tuned.softmax(x, dim=2)
    with pytest.raises(ValueError, match="unknown softmax version"):
        tuned.softmax(x, version="magic")
    with pytest.raises(ValueError, match="out must have"):
        tuned.softmax(x, out=torch.empty(3, 5))
    if not env.on_gpu():
        with pytest.raises(ValueError, match="needs a GPU"):
            tuned.softmax(check.randn((2, 20000)), version="split")
    with pytest.raises(ValueError):
        tuned.plan(0, 10, hardware.INTERPRETER_DEVICE)


@pytest.mark.parametrize("arch", [75, 80, 90])
def test_plan_is_a_pure_function_of_the_device(arch):
    info = hardware.DeviceInfo.for_arch(arch)
    for n in (1, 100, 1000, 4096, 16384):
        p = tuned.plan(4096, n, info, 4, interpreter=False)
        assert p.version == "persistent" and p.BLOCK_SIZE >= n and 4 <= p.num_warps <= 16
        assert p.ROWS * p.BLOCK_SIZE >= min(tuned.TILE_ELEMENTS, p.BLOCK_SIZE)
        assert p.grid == -(-4096 // p.ROWS)
    long = tuned.plan(64, 100_000, info, 4, interpreter=False)
    assert long.version == "split" and long.ROWS == -(-100_000 // tuned.SPLIT_BLOCK) <= info.sms
    assert long.grid == 64 * long.ROWS
    row16 = tuned.plan(64, 30_000, info, 2, interpreter=False)  # 16-bit rows filling 32768 lanes: one program each
    assert row16.version == "fused" and row16.BLOCK_SIZE == 32768 and row16.num_warps == tuned.MAX_WARPS
    assert row16.grid == 64 and tuned.plan(64, 40_000, info, 2, interpreter=False).version == "split"
    for n, itemsize, version in ((16_385, 4, "two_block"), (24_576, 4, "two_block"), (24_577, 4, "split"),
                                 (20_480, 2, "two_block"), (20_481, 2, "split"), (24_000, 2, "split")):
        p = tuned.plan(64, n, info, itemsize, interpreter=False)
        assert p.version == version, (n, itemsize, p)
        if version == "two_block":  # 16384 lanes and the rest's next power of two: few lanes idle
            assert p.BLOCK_SIZE == tuned.MAX_FUSED_BLOCK and p.BLOCK_SIZE < n <= p.BLOCK_SIZE + p.tail < 2 * n
    huge = tuned.plan(4, 50_000_000, info, 2, interpreter=False)
    assert huge.version == "online"   # chunks of one row would not all fit on the GPU at once
    assert tuned.plan(64, 100_000, info, interpreter=True).version == "online"
    assert tuned.plan(64, 100, info, interpreter=True).grid <= 8
    assert tuned.estimate_programs_per_sm(16384, 16, info) >= 1


def test_ladder_is_documented():
    doc = sm.__doc__
    for name in ("v1 ``softmax_ref``", "v2 ``softmax_row_kernel`` / ``softmax_teaching``",
                 "v3 ``softmax_online_kernel`` / ``softmax_online_teaching``",
                 "v4 ``course_utils.tuned.softmax.softmax``"):
        assert name in doc
    for version in ("persistent", "two_block", "fused", "split", "online"):
        assert f"``{version}``" in tuned.__doc__


def test_benchmark_targets_from_a_synthetic_sweep():
    import pandas as pd

    from benchmarks import softmax as bs
    rows = []
    for n in bs.SHORT_N + bs.LONG_N + (1000,):
        for impl, gbps in (("ours", 3000.0), ("torch.softmax", 2000.0), ("copy", 4000.0)):
            rows.append({"dtype": "float32", "n_cols": n, "impl": impl, "gbps": gbps})
    targets = bs.targets(pd.DataFrame(rows))
    by = {t.claim: t for t in targets}
    assert by["softmax float32 N=1024 vs copy bandwidth"].measured == pytest.approx(0.75)
    assert not by["softmax float32 N=1024 vs copy bandwidth"].passed
    assert by["softmax float32 N=32768 (long rows) vs torch.softmax"].passed      # 1.5 >= 1.3
    assert by["softmax float32 N=1000 (in between) vs torch.softmax"].required == 0.95
    assert bs.rows_for(256, torch.bfloat16) * 256 * 2 == 256 * 2**20


@pytest.mark.parametrize("n", [16_385, 17_000, 20_480])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_two_block_rows(n, dtype):
    """Rows just over 16K columns as 16384 lanes plus a tail block: signed, offset values, a row of
    -inf (NaN, as torch), strided rows, written into an output poisoned with NaN."""
    x = (check.randn((4, n + 5), torch.float32, scale=4.0) + 30).to(dtype)[:, :n]
    x[1] = float("-inf")
    out = torch.full((4, n), float("nan"), dtype=dtype, device=x.device)
    tuned.softmax(x, version="two_block", out=out)
    ref = torch.softmax(x.double(), -1)
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()
    check.compare("two_block softmax", out[[0, 2, 3]], ref[[0, 2, 3]])
    with pytest.raises(ValueError, match="two_block"):
        tuned.softmax(check.randn((2, 100)), version="two_block")


# ------------------------------------------------------------------------- the teaching shelf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (3, 1000), (2, 3, 1537)])
def test_teaching_launchers_match_float64(dtype, shape):
    x = check.randn(shape, dtype, scale=4.0, offset=-30.0, outliers=0.02, outlier_scale=500.0)
    for fn in (sm.softmax_teaching, sm.softmax_online_teaching):
        y = fn(x)
        assert y.shape == x.shape and y.dtype == dtype
        _close(y, x)
    _close(sm.softmax_online_teaching(x, BLOCK_SIZE=64), x)  # several tiles per row


def test_teaching_launchers_one_launch_edges_and_errors():
    x = check.randn((5, 300))[:, 7:250]  # strided rows, read in place
    assert count_launches(sm.softmax_teaching, x).total == 1
    assert count_launches(sm.softmax_online_teaching, x).total == 1
    _close(sm.softmax_teaching(x), x)
    e = torch.empty(0, 9, device=env.DEVICE)
    assert count_launches(sm.softmax_teaching, e).total == 0 and sm.softmax_teaching(e).shape == (0, 9)
    with pytest.raises(ValueError, match="softmax_online_teaching"):
        sm.softmax_teaching(torch.empty(2, sm.MAX_TEACHING_BLOCK + 1, device=env.DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        sm.softmax_online_teaching(x, BLOCK_SIZE=100)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        sm.softmax_teaching(torch.ones(2, 3, dtype=torch.int32))


def test_the_teaching_module_forwards_nothing_to_the_tuned_shelf():
    """softmax, plan, Plan, occupancy... live on course_utils.tuned.softmax only; the old names of the
    two teaching kernels stay."""
    assert hasattr(tuned, "softmax") and hasattr(tuned, "plan")
    assert sm._softmax_row_kernel is sm.softmax_row_kernel and sm._softmax_online_kernel is sm.softmax_online_kernel
    for name in ("softmax", "plan", "Plan", "_softmax_persistent_kernel", "occupancy", "compile_cases_of_someone_else"):
        assert not hasattr(sm, name), name
    assert not hasattr(sm, "__getattr__") and not hasattr(sm, "_FORWARD")


# ------------------------------------------------------------------------- past 2^31 elements


def test_tile_rows_are_int64_where_tile_times_rows_passes_2_31():
    """A (2_200_000_000, 1) input has 537_110 tiles of 4096 rows: 537_110 * 4096 > 2^31. Under the
    interpreter int32 arithmetic wraps as on the GPU, so the unsafe form is caught here too."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe_kernel(out_ptr, tile, ROWS: tl.constexpr, SAFE: tl.constexpr):
        if SAFE:
            rows = tuned.tile_rows(tile, ROWS)
        else:
            rows = tile * ROWS + tl.arange(0, ROWS)
        tl.store(out_ptr + tl.arange(0, ROWS), rows)

    tile, n = 537_109, 4096
    want = torch.arange(tile * n, (tile + 1) * n, dtype=torch.int64)
    out = torch.zeros(n, dtype=torch.int64, device=env.DEVICE)
    probe_kernel[(1,)](out, tile, ROWS=n, SAFE=True)
    assert torch.equal(out.cpu(), want)
    probe_kernel[(1,)](out, tile, ROWS=n, SAFE=False)  # the form that crashed on an H100
    assert not torch.equal(out.cpu(), want)


def test_the_tuned_kernels_use_int64_row_offsets():
    import inspect
    assert "tile_rows(tile, ROWS)" in inspect.getsource(tuned.softmax_persistent_kernel.fn)
    for kernel in (tuned.softmax_two_block_kernel, tuned.softmax_split_kernel, sm.softmax_row_kernel,
                   sm.softmax_online_kernel):
        assert ".to(tl.int64) *" in inspect.getsource(kernel.fn), kernel


@pytest.mark.gpu
@pytest.mark.skipif(not env.on_gpu(), reason="needs a GPU with about 20 GiB free")
@pytest.mark.parametrize("shape, dtype", [((2_200_000_000, 1), torch.float32), ((1_100_003, 2000), torch.float32),
                                          ((2**21 + 3, 1024), torch.bfloat16)], ids=str)
def test_past_2_31_elements_on_gpu(shape, dtype):
    """The issue's crash: (2_200_000_000, 1) float32 (row offsets past 2^31) and two 2-D shapes."""
    torch.cuda.empty_cache()
    x = torch.randn(shape, device="cuda", dtype=dtype)
    x[-1, 0] = float("-inf")
    y = tuned.softmax(x)
    torch.cuda.synchronize()
    if shape[1] == 1:
        assert bool((y[:-1] == 1).all()) and bool(y[-1].isnan().all())
    else:
        for rows in (slice(0, 3), slice(shape[0] // 2, shape[0] // 2 + 3), slice(shape[0] - 3, shape[0])):
            check.compare("softmax past 2^31", y[rows], torch.softmax(x[rows].double(), -1))
        if shape[1] <= sm.MAX_TEACHING_BLOCK:
            t = sm.softmax_teaching(x)
            check.compare("softmax_teaching past 2^31", t[-3:], torch.softmax(x[-3:].double(), -1))
    del x, y


# ------------------------------------------------------------------------- vector loads


@pytest.mark.parametrize("n_cols, strides, align", [(1000, (1000, 1000), 8), (1024, (1024, 1024), 16),
                                                    (13, (13, 13), 1), (245, (300, 245), 1), (20, (20, 20), 4),
                                                    (64, (96, 64), 16), (1000, (1004, 1000), 4)])
def test_alignment_is_the_largest_power_of_two_dividing_all(n_cols, strides, align):
    assert tuned.alignment(n_cols, *strides) == align


@pytest.mark.parametrize("shape, cut", [((6, 1000), 1000), ((5, 48), 40), ((9, 20), 20), ((4, 4100), 4100)])
def test_aligned_units_give_the_same_result(shape, cut):
    """n_cols and strides passed in units of ALIGN and multiplied back inside: same numbers as ALIGN=1."""
    x = check.randn(shape, scale=3.0)[:, :cut]
    y_hint = tuned.softmax(x)
    saved, tuned.VECTOR_HINT = tuned.VECTOR_HINT, False
    try:
        y_plain = tuned.softmax(x)
    finally:
        tuned.VECTOR_HINT = saved
    _close(y_hint, x)
    _close(y_plain, x)
    # Same arithmetic; on a GPU wider loads give each thread other lanes, so the reductions may add in
    # another order: 1-2 ulp apart (H100: at most 2.4e-7 relative). The interpreter gives equal bits.
    torch.testing.assert_close(y_hint, y_plain, rtol=5e-7 if env.on_gpu() else 0, atol=0)
