"""Unit tests of course_utils.kernels.elementwise (interpreter on CPU; the same tests run on a GPU)."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils import check, hardware
from course_utils.kernels import elementwise as ew
from course_utils.profile import count_launches

DTYPES = cu.env.supported_dtypes()
SIZES = (1, 7, 1000, 4099)


def _name(d):
    return str(d).removeprefix("torch.")


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=cu.DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_matches_float64_reference(dtype, approximate):
    for n in SIZES:
        x = check.randn((n,), dtype, outliers=0.05, outlier_scale=200.0)
        out = _poisoned((n,), dtype)
        got = ew.gelu(x, approximate=approximate, out=out)
        assert got is out
        check.compare(f"gelu {approximate} n={n}", got, ew.gelu_ref(x.double(), approximate))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_gelu_agrees_with_torch_gelu(dtype):
    x = check.randn((3, 5, 17), dtype, scale=3.0)
    for approximate in ("tanh", "none"):
        expected = torch.nn.functional.gelu(x.double(), approximate=approximate)
        check.compare("gelu vs F.gelu", ew.gelu(x, approximate=approximate), expected)


def test_stable_tanh_gives_no_nan_where_the_naive_exp_form_does():
    x = torch.tensor([-1e4, -300.0, -60.0, -20.0, -1e-6, 0.0, 1e-6, 20.0, 60.0, 300.0, 1e4],
                     device=cu.DEVICE)
    y = ew.gelu(x)
    assert not y.isnan().any()
    check.compare("gelu at large |x|", y, ew.gelu_ref(x.double()))
    # the naive tanh = (e^2a - 1) / (e^2a + 1) in float32 overflows to inf / inf = NaN
    a = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    naive = (torch.exp(2 * a) - 1) / (torch.exp(2 * a) + 1)
    assert naive.isnan().any()


def test_gelu_propagates_nan_and_handles_inf():
    x = torch.tensor([float("nan"), float("inf"), 1.0], device=cu.DEVICE)
    y = ew.gelu(x)
    assert y[0].isnan() and y[1] == float("inf") and torch.isfinite(y[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_add(dtype):
    for n in SIZES:
        x, y = check.randn((n,), dtype), check.randn((n,), dtype, scale=10.0)
        out = _poisoned((n,), dtype)
        check.compare(f"add n={n}", ew.add(x, y, out=out), x.double() + y.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (3, 4, 33), (1000,)])
def test_bias_gelu_scale(dtype, shape):
    x = check.randn(shape, dtype, outliers=0.05)
    b = check.randn((shape[-1],), dtype)
    scale = float(torch.randn(()).item()) * 3
    got = ew.bias_gelu_scale(x, b, scale, out=_poisoned(shape, dtype))
    check.compare("bias_gelu_scale", got, ew.bias_gelu_scale_ref(x.double(), b.double(), scale))
    got = ew.bias_gelu_scale(x, b, scale, approximate="none")
    check.compare("bias_gelu_scale erf", got,
                  ew.bias_gelu_scale_ref(x.double(), b.double(), scale, approximate="none"))


@pytest.mark.parametrize("n_cols,wraps", [(128, ew.IN_ROW), (64, ew.IN_ROW), (100, ew.ONE_WRAP), (64, ew.ONE_WRAP),
                                          (37, ew.ANY_WRAP), (5, ew.ANY_WRAP)])
@pytest.mark.parametrize("kernel", ["scale", "dropout"])
def test_bias_columns_when_tiles_straddle_rows(n_cols, wraps, kernel):
    """Tiles of 64 elements over rows of n_cols: a tile starts mid-row and crosses into the next
    row (once when the row is at least a tile long, many times when it is shorter)."""
    rows, block = 23, 64
    x = check.randn((rows, n_cols))
    b = check.randn((n_cols,))
    y = _poisoned(x.shape, x.dtype)
    n = x.numel()
    grid = (triton.cdiv(n, block),)
    if kernel == "scale":
        ew._bias_gelu_scale_kernel[grid](x, b, y, n, n_cols, 0.7, BLOCK_SIZE=block, APPROXIMATE=True,
                                         INT64=False, WRAPS=wraps)
        check.compare("bias_gelu_scale", y, ew.bias_gelu_scale_ref(x.double(), b.double(), 0.7))
    else:
        ew._bias_gelu_dropout_kernel[grid](x, b, y, n, n_cols, 0.0, 1.0, 11, BLOCK_SIZE=block, APPROXIMATE=True,
                                           INT64=False, WRAPS=wraps)
        check.compare("bias_gelu_dropout p=0", y, ew.bias_gelu_scale_ref(x.double(), b.double(), 1.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_bias_gelu_dropout_values_rate_and_reproducibility(dtype):
    p = 0.3
    x = check.randn((61, 129), dtype, scale=2.0)
    b = check.randn((129,), dtype)
    seed = int(torch.randint(0, 2**40, ()).item())
    y = ew.bias_gelu_dropout(x, b, p, seed, out=_poisoned(x.shape, dtype))
    check.compare("bias_gelu_dropout", y, ew.bias_gelu_dropout_ref(x.double(), b.double(), p, seed))
    keep = ew.dropout_keep_mask(x.shape, p, seed)
    n = keep.numel()
    rate = keep.float().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    # dropped elements are exactly zero, kept ones are scaled by 1 / (1 - p)
    assert (y[~keep] == 0).all()
    # same seed, same output; another seed, another mask
    assert torch.equal(ew.bias_gelu_dropout(x, b, p, seed), y)
    assert not torch.equal(ew.dropout_keep_mask(x.shape, p, seed + 1), keep)
    # the mask depends on (seed, index) only: not on the dtype
    assert torch.equal(ew.dropout_keep_mask(x.shape, p, seed), keep)


def test_dropout_p_zero_is_the_chain_without_dropout():
    x = check.randn((5, 40))
    b = check.randn((40,))
    check.compare("p=0", ew.bias_gelu_dropout(x, b, 0.0, 3), ew.bias_gelu_scale_ref(x.double(), b.double(), 1.0))


@pytest.mark.parametrize("fn", ["gelu", "add", "bias_gelu_scale", "bias_gelu_dropout"])
def test_one_launch_and_empty_input_launches_nothing(fn):
    x = check.randn((9, 8))
    b = check.randn((8,))
    calls = {"gelu": lambda t: ew.gelu(t), "add": lambda t: ew.add(t, t),
             "bias_gelu_scale": lambda t: ew.bias_gelu_scale(t, b, 2.0),
             "bias_gelu_dropout": lambda t: ew.bias_gelu_dropout(t, b, 0.5, 1)}
    assert count_launches(calls[fn], x).total == 1
    empty = torch.empty((0, 8), device=cu.DEVICE)
    counts = count_launches(calls[fn], empty)
    assert counts.total == 0, counts
    assert calls[fn](empty).shape == (0, 8)


def test_bad_inputs_raise_clear_errors():
    x = check.randn((4, 6))
    with pytest.raises(TypeError, match="dtype"):
        ew.gelu(x.to(torch.int32))
    with pytest.raises(TypeError, match="dtype"):
        ew.gelu(x.double())
    with pytest.raises(ValueError, match="contiguous"):
        ew.gelu(x.t())
    with pytest.raises(ValueError, match="is on meta"):
        ew.gelu(torch.empty(3, device="meta"))
    with pytest.raises(TypeError, match="torch.Tensor"):
        ew.gelu([1.0, 2.0])
    with pytest.raises(ValueError, match="approximate"):
        ew.gelu(x, approximate="fast")
    with pytest.raises(ValueError, match="same shape"):
        ew.add(x, x[:2])
    with pytest.raises(ValueError, match="out must"):
        ew.gelu(x, out=torch.empty(5, device=cu.DEVICE))
    with pytest.raises(ValueError, match="bias must be 1-D"):
        ew.bias_gelu_scale(x, check.randn((4,)), 1.0)
    with pytest.raises(TypeError, match="same dtype"):
        ew.bias_gelu_scale(x, check.randn((6,), torch.float16), 1.0)
    with pytest.raises(ValueError, match="finite"):
        ew.bias_gelu_scale(x, check.randn((6,)), float("inf"))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        ew.bias_gelu_dropout(x, check.randn((6,)), 1.0, 0)
    with pytest.raises(ValueError, match="seed"):
        ew.bias_gelu_dropout(x, check.randn((6,)), 0.1, -1)


# ---------------------------------------------------------------- launch configuration

@pytest.mark.parametrize("arch", [75, 80, 86, 89, 90])
def test_launch_config_is_a_pure_function_of_the_device(arch):
    info = hardware.DeviceInfo.for_arch(arch)
    for dtype in ew.input_dtypes(info):
        itemsize = torch.empty((), dtype=dtype).element_size()
        for n in (1, 1000, 2**20 + 3, 2**28, 2**31 + 7):
            cfg = ew.launch_config(n, dtype, info)
            assert cfg == ew.launch_config(n, dtype, info)
            assert triton.next_power_of_2(cfg.BLOCK_SIZE) == cfg.BLOCK_SIZE <= ew.MAX_BLOCK_SIZE
            assert cfg.grid[0] * cfg.BLOCK_SIZE >= n > (cfg.grid[0] - 1) * cfg.BLOCK_SIZE
            assert cfg.BLOCK_SIZE * itemsize // (32 * cfg.num_warps) >= 16, "each thread moves >= 16 bytes"
            assert cfg.int64 == (n >= ew.INT64_THRESHOLD)
    if not info.has_bf16:
        with pytest.raises(TypeError, match="bfloat16|sm_75"):
            ew.launch_config(100, torch.bfloat16, info)


def test_launch_config_fills_large_gpus_and_keeps_big_tiles_for_big_tensors():
    h100 = hardware.DeviceInfo.for_arch(90)
    big = ew.launch_config(2**28, torch.bfloat16, h100)
    assert big.grid[0] >= 8 * h100.sms
    small = ew.launch_config(2**18, torch.float32, h100)
    assert small.grid[0] >= h100.sms


def test_launch_config_rejects_nonsense():
    with pytest.raises(ValueError):
        ew.launch_config(-1, torch.float32, hardware.INTERPRETER_DEVICE)


@triton.jit
def _tile_start_probe(out_ptr, pid, BLOCK_SIZE: tl.constexpr, INT64: tl.constexpr):
    tl.store(out_ptr, ew.tile_start(pid, BLOCK_SIZE, INT64).to(tl.int64))


def test_int64_offsets_past_2_31_elements():
    """pid * BLOCK_SIZE for the last tile of a 2^31 + x element tensor: int32 wraps, int64 does not."""
    n = 2**31 + 12345
    info = hardware.DeviceInfo.for_arch(90)
    cfg = ew.launch_config(n, torch.bfloat16, info)
    assert cfg.int64
    last_pid = cfg.grid[0] - 1
    out = torch.zeros(1, dtype=torch.int64, device=cu.DEVICE)
    _tile_start_probe[(1,)](out, last_pid, BLOCK_SIZE=cfg.BLOCK_SIZE, INT64=True)
    assert out.item() == last_pid * cfg.BLOCK_SIZE >= 2**31 - cfg.BLOCK_SIZE
    _tile_start_probe[(1,)](out, last_pid, BLOCK_SIZE=cfg.BLOCK_SIZE, INT64=False)
    assert out.item() != last_pid * cfg.BLOCK_SIZE, "int32 arithmetic should have wrapped"
    # below the threshold int32 is exact and cheaper
    assert not ew.launch_config(2**30, torch.bfloat16, info).int64


def test_keep_mask_with_int64_offsets_keeps_the_right_fraction():
    """Past 2^31 elements the Philox counter is 64-bit: its mask must still keep 1 - p."""
    n, p = 4000, 0.4
    for int64 in (False, True):
        keep = torch.empty(n, dtype=torch.int8, device=cu.DEVICE)
        ew._keep_mask_kernel[(triton.cdiv(n, 1024),)](keep, n, p, 99, BLOCK_SIZE=1024, INT64=int64)
        rate = keep.float().mean().item()
        assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), (int64, rate)


def test_cuda_cpp_version_says_why_it_is_unavailable():
    reason = ew.cuda_gelu_unavailable()
    if not cu.on_gpu():
        assert "GPU" in reason
        with pytest.raises(RuntimeError, match="GPU"):
            ew.gelu_cuda(check.randn((4,)))
    elif reason is None:  # pragma: no cover - GPU with nvcc
        x = check.randn((1001,))
        check.compare("gelu_cuda", ew.gelu_cuda(x), ew.gelu_ref(x.double()))


def test_lean_launch_path_sees_empty_triton_hook_chains_as_no_hook():
    from triton import knobs
    assert ew._no_hook(None)
    assert ew._no_hook(knobs.runtime.launch_enter_hook) == (not getattr(knobs.runtime.launch_enter_hook, "calls", []))
    # under the interpreter the lean path is never taken (there is no compiled kernel to call)
    if not cu.on_gpu():
        assert not ew._fast_ok()


def test_lean_launch_cache_key_separates_what_triton_specializes_on():
    """A compiled kernel is reused only for arguments Triton would compile the same way."""
    a32 = torch.zeros(64, device=cu.DEVICE)
    a16 = torch.zeros(64, device=cu.DEVICE, dtype=torch.float16)

    def key(tensors, scalars=(64,), meta=(1024, False)):
        return ew._cache_key(ew._gelu_kernel, 4, meta, 0, tensors, [t.data_ptr() for t in tensors], scalars)
    assert key((a32, a32)) == key((a32, a32.clone()))          # the same compilation: reused
    assert key((a32, a32)) != key((a16, a16))                  # dtype
    assert key((a32, a32)) != key((a32, a32[1:]))              # 16-byte alignment of any pointer
    assert key((a32,), (16,)) != key((a32,), (17,)) != key((a32,), (1,))  # divisibility by 16, == 1
    assert key((a32,), (2**31,)) != key((a32,), (2**31 - 16,))  # int32 vs int64
    assert key((a32,), (16, 0.5)) == key((a32,), (16, 0.25))   # floats are not specialized
    assert key((a32,), meta=(1024, True)) != key((a32,))       # constexprs


def test_repeated_calls_keep_every_check():
    """A call like an earlier one takes the lean path on a GPU (no checks beyond dtype, shape,
    contiguity, device and alignment); anything unlike it must still meet the full path's errors."""
    x = check.randn((33, 64))
    b = check.randn((64,))
    y = _poisoned(x.shape, x.dtype)
    first = ew.bias_gelu_scale(x, b, 0.5)
    assert torch.equal(ew.bias_gelu_scale(x, b, 0.5, out=y), first)
    assert torch.equal(ew.bias_gelu_scale(x, b, 0.5), first)
    with pytest.raises(ValueError, match="bias"):
        ew.bias_gelu_scale(x, check.randn((63,)), 0.5)
    with pytest.raises(ValueError, match="out"):
        ew.bias_gelu_scale(x, b, 0.5, out=torch.empty(33, 63, device=cu.DEVICE))
    with pytest.raises((TypeError, ValueError)):
        ew.bias_gelu_scale(x, b, 0.5, out=torch.empty(33, 64, device=cu.DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="finite"):
        ew.bias_gelu_scale(x, b, float("nan"))
    with pytest.raises(ValueError, match="contiguous"):
        ew.bias_gelu_scale(check.randn((33, 128))[:, ::2], b, 0.5)  # same shape and dtype, strided
    shifted = check.randn((33 * 64 + 1,))[1:].view(33, 64)   # misaligned by one element: full path
    check.compare("chain, misaligned", ew.bias_gelu_scale(shifted, b, 0.5),
                  ew.bias_gelu_scale_ref(shifted.double(), b.double(), 0.5))
    for _ in range(2):
        check.compare("gelu, repeated", ew.gelu(x), ew.gelu_ref(x.double()))
        check.compare("add, repeated", ew.add(x, x), 2 * x.double())
    with pytest.raises(ValueError, match="same shape"):
        ew.add(x, check.randn((33, 63)))
