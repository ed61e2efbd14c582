"""Unit tests for course_utils.kernels.softmax (run under Triton's interpreter on the CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from course_utils import check, env, hardware
from course_utils.kernels import softmax as sm
from course_utils.profile import count_launches

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
    y = sm.softmax(x, version=version)
    assert y.shape == x.shape and y.dtype == dtype
    _close(y, x)


@pytest.mark.parametrize("version", CPU_VERSIONS)
def test_out_is_fully_written_after_nan_poisoning(version):
    x = check.randn((5, 333), scale=3.0)
    out = check.Guarded((5, 333), torch.float32)
    got = sm.softmax(x, version=version, out=out.tensor)
    assert got is out.tensor
    out.check("softmax out=")
    assert not out.tensor.isnan().any()
    _close(out.tensor, x)


def test_leading_dims_and_other_dims():
    x = check.randn((2, 3, 4, 129))
    _close(sm.softmax(x), x)
    _close(sm.softmax(x, dim=1), x, dim=1)
    _close(sm.softmax(x, dim=-3), x, dim=-3)
    v = check.randn((77,))
    _close(sm.softmax(v), v)


def test_strided_rows_are_read_in_place():
    base = check.randn((6, 300))
    x = base[:, 5:250]
    assert x.stride(0) == 300
    _close(sm.softmax(x), x)
    xt = check.randn((40, 9)).t()     # last dim not contiguous: copied, still right
    _close(sm.softmax(xt), xt)


def test_edge_rows_follow_torch():
    x = torch.full((3, 5000), -math.inf, device=env.DEVICE)
    x[1, 4321] = 2.0
    x[2] = torch.randn(5000, device=env.DEVICE) * 1e4 + 3e4
    for version in ("persistent", "online"):
        y, ref = sm.softmax(x, version=version), torch.softmax(x, -1)
        assert y[0].isnan().all() and ref[0].isnan().all()
        assert y[1, 4321] == 1 and y[1].sum() == 1
        torch.testing.assert_close(y[2], ref[2], atol=1e-6, rtol=1e-5)


def test_online_kernel_with_leading_minus_inf_tiles():
    x = check.randn((4, 2000), scale=5.0)
    x[0, :700] = -math.inf
    x[1, 1500:] = -math.inf
    y = torch.empty_like(x)
    sm._softmax_online_kernel[(4,)](y, x, 2000, x.stride(0), y.stride(0), BLOCK_SIZE=128)
    _close(y, x)


def test_split_kernel_single_chunk_runs_under_interpreter():
    x = check.randn((3, 5000), scale=3.0)
    _close(sm.softmax(x, version="split"), x)


@pytest.mark.skipif(not env.on_gpu(), reason="programs of one row wait for each other: GPU only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_cols", [8193, 20000, 65536, 100_003])
def test_split_kernel_on_gpu(dtype, n_cols):
    x = check.randn((37, n_cols), dtype, scale=4.0, offset=50.0, outliers=0.01, outlier_scale=500.0)
    x[0, : n_cols // 2] = -math.inf
    out = check.Guarded((37, n_cols), dtype)
    sm.softmax(x, version="split", out=out.tensor)
    out.check("split softmax")
    _close(out.tensor, x)


def test_empty_input_returns_empty_without_launch():
    x = torch.empty(0, 17, device=env.DEVICE)
    y = sm.softmax(x)
    assert y.shape == (0, 17)
    assert count_launches(sm.softmax, x).total == 0
    assert sm.softmax(torch.empty(4, 0, device=env.DEVICE)).shape == (4, 0)


def test_one_launch_and_reference_five():
    x = check.randn((8, 100))
    sm.softmax(x)
    assert count_launches(sm.softmax, x).total == 1
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
        sm.softmax(bad)


def test_bad_arguments():
    x = check.randn((3, 4))
    with pytest.raises(ValueError, match="out of range"):
        sm.softmax(x, dim=2)
    with pytest.raises(ValueError, match="unknown softmax version"):
        sm.softmax(x, version="magic")
    with pytest.raises(ValueError, match="out must have"):
        sm.softmax(x, out=torch.empty(3, 5))
    if not env.on_gpu():
        with pytest.raises(ValueError, match="needs a GPU"):
            sm.softmax(check.randn((2, 20000)), version="split")
    with pytest.raises(ValueError):
        sm.plan(0, 10, hardware.INTERPRETER_DEVICE)


@pytest.mark.parametrize("arch", [75, 80, 90])
def test_plan_is_a_pure_function_of_the_device(arch):
    info = hardware.DeviceInfo.for_arch(arch)
    for n in (1, 100, 1000, 4096, 16384):
        p = sm.plan(4096, n, info, 4, interpreter=False)
        assert p.version == "persistent" and p.BLOCK_SIZE >= n and 4 <= p.num_warps <= 16
        assert p.ROWS * p.BLOCK_SIZE >= min(sm.TILE_ELEMENTS, p.BLOCK_SIZE)
        assert p.grid == -(-4096 // p.ROWS)
    long = sm.plan(64, 100_000, info, 4, interpreter=False)
    assert long.version == "split" and long.ROWS == -(-100_000 // sm.SPLIT_BLOCK) <= info.sms
    assert long.grid == 64 * long.ROWS
    row16 = sm.plan(64, 30_000, info, 2, interpreter=False)  # 16-bit rows filling 32768 lanes: one program each
    assert row16.version == "fused" and row16.BLOCK_SIZE == 32768 and row16.num_warps == sm.MAX_WARPS
    assert row16.grid == 64 and sm.plan(64, 40_000, info, 2, interpreter=False).version == "split"
    for n, itemsize, version in ((16_385, 4, "two_block"), (24_576, 4, "two_block"), (24_577, 4, "split"),
                                 (20_480, 2, "two_block"), (20_481, 2, "split"), (24_000, 2, "split")):
        p = sm.plan(64, n, info, itemsize, interpreter=False)
        assert p.version == version, (n, itemsize, p)
        if version == "two_block":  # 16384 lanes and the rest's next power of two: few lanes idle
            assert p.BLOCK_SIZE == sm.MAX_FUSED_BLOCK and p.BLOCK_SIZE < n <= p.BLOCK_SIZE + p.tail < 2 * n
    huge = sm.plan(4, 50_000_000, info, 2, interpreter=False)
    assert huge.version == "online"   # chunks of one row would not all fit on the GPU at once
    assert sm.plan(64, 100_000, info, interpreter=True).version == "online"
    assert sm.plan(64, 100, info, interpreter=True).grid <= 8
    assert sm.estimate_programs_per_sm(16384, 16, info) >= 1


def test_ladder_is_documented():
    doc = sm.__doc__
    for name in ("softmax_ref", "_softmax_row_kernel", "_softmax_persistent_kernel", "_softmax_online_kernel",
                 "_softmax_split_kernel"):
        assert name in doc


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
    sm.softmax(x, version="two_block", out=out)
    ref = torch.softmax(x.double(), -1)
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()
    check.compare("two_block softmax", out[[0, 2, 3]], ref[[0, 2, 3]])
    with pytest.raises(ValueError, match="two_block"):
        sm.softmax(check.randn((2, 100)), version="two_block")
