"""Unit tests of both elementwise shelves: the teaching kernels and launchers of
course_utils.kernels.elementwise and the tuned path of course_utils.tuned.elementwise (interpreter
on CPU; the same tests run on a GPU, plus the 2^31-element ones)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils import check, hardware
from course_utils.kernels import elementwise as ew
from course_utils.profile import count_launches
from course_utils.tuned import elementwise as tuned

DTYPES = cu.env.supported_dtypes()
SIZES = (1, 7, 1000, 4099)
SHAPES = [(1, 1), (7, 13), (3, 4, 33), (1000,)]


def _name(d):
    return str(d).removeprefix("torch.")


def _run(shelf: str, op: str, *args, shape, dtype):
    """Run ``op`` of ``shelf`` into a NaN-poisoned output inside guard zones; return the output.

    tuned: the launcher with ``out=``; teaching: the teaching kernel launched as its launcher does
    (the teaching launchers allocate their own output: they are compared with these below)."""
    g = check.Guarded(shape, dtype)
    out = g.tensor
    if shelf == "tuned":
        got = getattr(tuned, op)(*args, out=out)
        assert got is out
    else:
        x, n = args[0], args[0].numel()
        grid = (triton.cdiv(n, ew.TEACHING_BLOCK),)
        meta = dict(BLOCK_SIZE=ew.TEACHING_BLOCK)
        if op == "add":
            ew.add_kernel[grid](x, args[1], out, n, **meta)
        elif op == "gelu":
            ew.gelu_kernel[grid](x, out, n, APPROXIMATE=args[1] == "tanh", **meta)
        elif op == "bias_gelu_scale":
            ew.bias_gelu_scale_kernel[grid](x, args[1], out, n, x.shape[-1], args[2],
                                            APPROXIMATE=args[3] == "tanh", **meta)
        else:
            ew.bias_gelu_dropout_kernel[grid](x, args[1], out, n, x.shape[-1], args[2], args[3],
                                              APPROXIMATE=args[4] == "tanh", **meta)
    g.check(f"{shelf} {op}")
    return out


SHELVES = ["teaching", "tuned"]


@pytest.mark.parametrize("shelf", SHELVES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_matches_float64_reference(shelf, dtype, approximate):
    for n in SIZES:
        x = check.randn((n,), dtype, outliers=0.05, outlier_scale=200.0)
        got = _run(shelf, "gelu", x, approximate, shape=(n,), dtype=dtype)
        check.compare(f"{shelf} gelu {approximate} n={n}", got, ew.gelu_ref(x.double(), approximate))


def test_gelu_on_the_checkers_odd_sizes():
    for n in check.odd_sizes():
        x = check.randn((n,), outliers=0.01)
        check.compare(f"gelu n={n}", tuned.gelu(x), ew.gelu_ref(x.double()))
        check.compare(f"gelu_teaching n={n}", ew.gelu_teaching(x), ew.gelu_ref(x.double()))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_gelu_agrees_with_torch_gelu(dtype):
    x = check.randn((3, 5, 17), dtype, scale=3.0)
    for approximate in ("tanh", "none"):
        expected = torch.nn.functional.gelu(x.double(), approximate=approximate)
        check.compare("gelu vs F.gelu", tuned.gelu(x, approximate=approximate), expected)
        check.compare("gelu_teaching vs F.gelu", ew.gelu_teaching(x, approximate), expected)


@pytest.mark.parametrize("fn", [tuned.gelu, ew.gelu_teaching], ids=["tuned", "teaching"])
def test_stable_tanh_form_gives_no_nan_and_handles_inf(fn):
    x = torch.tensor([-1e4, -300.0, -60.0, -20.0, -1e-6, 0.0, 1e-6, 20.0, 60.0, 300.0, 1e4], device=cu.DEVICE)
    y = fn(x)
    assert not y.isnan().any()
    check.compare("gelu at large |x|", y, ew.gelu_ref(x.double()))
    # the naive tanh = (e^2a - 1) / (e^2a + 1) in float32 overflows to inf / inf = NaN
    a = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    assert ((torch.exp(2 * a) - 1) / (torch.exp(2 * a) + 1)).isnan().any()
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 1.0], device=cu.DEVICE)
    y = fn(special)
    assert y[0].isnan() and y[1] == float("inf") and torch.isfinite(y[3])
    check.compare("gelu of nan, inf, -inf", y, ew.gelu_ref(special.double()))  # -inf: NaN in both


@pytest.mark.parametrize("shelf", SHELVES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_add(shelf, dtype):
    for n in SIZES:
        x, y = check.randn((n,), dtype), check.randn((n,), dtype, scale=10.0, offset=-3.0)
        check.compare(f"{shelf} add n={n}", _run(shelf, "add", x, y, shape=(n,), dtype=dtype),
                      x.double() + y.double())


@pytest.mark.parametrize("shelf", SHELVES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bias_gelu_scale(shelf, dtype, shape):
    x = check.randn(shape, dtype, outliers=0.05)
    b = check.randn((shape[-1],), dtype)
    scale = float(torch.randn(()).item()) * 3
    for approximate in ("tanh", "none"):
        got = _run(shelf, "bias_gelu_scale", x, b, scale, approximate, shape=shape, dtype=dtype)
        check.compare(f"{shelf} bias_gelu_scale {approximate}", got,
                      ew.bias_gelu_scale_ref(x.double(), b.double(), scale, approximate))


@pytest.mark.parametrize("shelf", SHELVES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_bias_gelu_dropout_matches_the_reference_with_its_mask(shelf, dtype):
    p, seed = 0.3, int(torch.randint(0, 2**40, ()).item())
    x = check.randn((61, 129), dtype, scale=2.0)
    b = check.randn((129,), dtype)
    y = _run(shelf, "bias_gelu_dropout", x, b, p, seed, "tanh", shape=x.shape, dtype=dtype)
    check.compare(f"{shelf} bias_gelu_dropout", y, ew.bias_gelu_dropout_ref(x.double(), b.double(), p, seed))
    assert (y[~tuned.dropout_keep_mask(x.shape, p, seed)] == 0).all()


def test_teaching_launchers_agree_with_the_tuned_path():
    """Same math, same mask: the two shelves differ in speed only."""
    x, b = check.randn((37, 300), outliers=0.05), check.randn((300,))
    check.compare("add", ew.add_teaching(x, x), tuned.add(x, x).double())
    for a in ("tanh", "none"):
        check.compare(f"gelu {a}", ew.gelu_teaching(x, a), tuned.gelu(x, a).double())
        check.compare(f"chain {a}", ew.bias_gelu_scale_teaching(x, b, 0.7, a),
                      tuned.bias_gelu_scale(x, b, 0.7, a).double())
    teach, tune = ew.bias_gelu_dropout_teaching(x, b, 0.4, 99), tuned.bias_gelu_dropout(x, b, 0.4, 99)
    assert torch.equal(teach == 0, tune == 0), "the teaching and tuned kernels draw different masks"
    check.compare("dropout", teach, tune.double())


@pytest.mark.parametrize("n_cols,wraps", [(128, tuned.IN_ROW), (64, tuned.IN_ROW), (100, tuned.ONE_WRAP),
                                          (64, tuned.ONE_WRAP), (37, tuned.ANY_WRAP), (5, tuned.ANY_WRAP)])
@pytest.mark.parametrize("kernel", ["scale", "dropout"])
def test_tuned_bias_columns_when_tiles_straddle_rows(n_cols, wraps, kernel):
    """Tiles of 64 elements over rows of n_cols: a tile starts mid-row and crosses into the next
    row (once when the row is at least a tile long, many times when it is shorter)."""
    rows, block = 23, 64
    x, b = check.randn((rows, n_cols)), check.randn((n_cols,))
    g = check.Guarded(x.shape)
    n, grid = x.numel(), (triton.cdiv(x.numel(), block),)
    meta = dict(BLOCK_SIZE=block, APPROXIMATE=True, INT64=False, WRAPS=wraps)
    if kernel == "scale":
        tuned.bias_gelu_scale_tuned_kernel[grid](x, b, g.tensor, n, n_cols, 0.7, **meta)
        check.compare("bias_gelu_scale", g.tensor, ew.bias_gelu_scale_ref(x.double(), b.double(), 0.7))
    else:
        tuned.bias_gelu_dropout_tuned_kernel[grid](x, b, g.tensor, n, n_cols, 0.0, 1.0, 11, **meta)
        check.compare("bias_gelu_dropout p=0", g.tensor, ew.bias_gelu_scale_ref(x.double(), b.double(), 1.0))
    g.check(kernel)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_dropout_rate_and_reproducibility(dtype):
    p = 0.3
    x, b = check.randn((61, 129), dtype, scale=2.0), check.randn((129,), dtype)
    seed = int(torch.randint(0, 2**40, ()).item())
    keep = tuned.dropout_keep_mask(x.shape, p, seed)
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / keep.numel())
    y = tuned.bias_gelu_dropout(x, b, p, seed)
    assert torch.equal(tuned.bias_gelu_dropout(x, b, p, seed), y)            # same seed, same output
    assert not torch.equal(tuned.dropout_keep_mask(x.shape, p, seed + 1), keep)  # another seed, another mask
    check.compare("p=0", tuned.bias_gelu_dropout(x, b, 0.0, 3), ew.bias_gelu_scale_ref(x.double(), b.double(), 1.0))


@pytest.mark.parametrize("fn", ["gelu", "add", "bias_gelu_scale", "bias_gelu_dropout"])
@pytest.mark.parametrize("shelf", SHELVES)
def test_one_launch_and_empty_input_launches_nothing(fn, shelf):
    b = check.randn((8,))
    suffix = "_teaching" if shelf == "teaching" else ""
    f = getattr(ew if shelf == "teaching" else tuned, fn + suffix)
    calls = {"gelu": lambda t: f(t), "add": lambda t: f(t, t), "bias_gelu_scale": lambda t: f(t, b, 2.0),
             "bias_gelu_dropout": lambda t: f(t, b, 0.5, 1)}
    assert count_launches(calls[fn], check.randn((9, 8))).total == 1
    empty = torch.empty((0, 8), device=cu.DEVICE)
    counts = count_launches(calls[fn], empty)
    assert counts.total == 0, counts
    assert calls[fn](empty).shape == (0, 8)


@pytest.mark.parametrize("shelf", SHELVES)
def test_bad_inputs_raise_clear_errors(shelf):
    s = "_teaching" if shelf == "teaching" else ""
    gelu, add, chain, drop = (getattr(ew if shelf == "teaching" else tuned, n + s)
                              for n in ("gelu", "add", "bias_gelu_scale", "bias_gelu_dropout"))
    x = check.randn((4, 6))
    for bad, err, match in [(x.to(torch.int32), TypeError, "dtype"), (x.double(), TypeError, "dtype"),
                            ([1.0, 2.0], TypeError, "torch.Tensor"),
                            (torch.empty(3, device="meta"), ValueError, "is on meta")]:
        with pytest.raises(err, match=match):
            gelu(bad)
    with pytest.raises(ValueError, match="approximate"):
        gelu(x, approximate="fast")
    with pytest.raises(ValueError, match="same shape|match x"):
        add(x, x[:2])
    with pytest.raises(ValueError, match="bias must be 1-D"):
        chain(x, check.randn((4,)), 1.0)
    with pytest.raises(TypeError, match="same dtype"):
        chain(x, check.randn((6,), torch.float16), 1.0)
    with pytest.raises(ValueError, match="finite"):
        chain(x, check.randn((6,)), float("inf"))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        drop(x, check.randn((6,)), 1.0, 0)
    with pytest.raises(ValueError, match="seed"):
        drop(x, check.randn((6,)), 0.1, -1)


def test_tuned_out_argument_is_checked_on_every_call():
    """The full check runs once per (dtype, device); what can change per call is checked every time."""
    x, b = check.randn((33, 64)), check.randn((64,))
    first = tuned.bias_gelu_scale(x, b, 0.5)
    assert torch.equal(tuned.bias_gelu_scale(x, b, 0.5, out=check.Guarded(x.shape).tensor), first)
    with pytest.raises(ValueError, match="out must"):
        tuned.gelu(x, out=torch.empty(5, device=cu.DEVICE))
    with pytest.raises(ValueError, match="out must"):
        tuned.bias_gelu_scale(x, b, 0.5, out=torch.empty(33, 64, device=cu.DEVICE, dtype=torch.float16))
    strided = check.randn((33, 128))[:, ::2]  # same shape and dtype, strided: copied once (issue 21 item 6)
    check.compare("chain, strided x", tuned.bias_gelu_scale(strided, b, 0.5),
                  ew.bias_gelu_scale_ref(strided.double(), b.double(), 0.5))
    with pytest.raises(ValueError, match="contiguous"):
        tuned.bias_gelu_scale(x, b, 0.5, out=check.randn((33, 128))[:, ::2])  # out is written flat
    shifted = check.randn((33 * 64 + 1,))[1:].view(33, 64)         # not 16-byte aligned: another compilation
    check.compare("chain, misaligned", tuned.bias_gelu_scale(shifted, b, 0.5),
                  ew.bias_gelu_scale_ref(shifted.double(), b.double(), 0.5))


# ---------------------------------------------------------------- the two shelves, no forwards

def test_teaching_shelf_never_imports_the_tuned_shelf_not_even_for_its_dropout_mask():
    """Import, then draw the reference's dropout mask: neither imports course_utils.tuned or .cuda."""
    code = ("import sys; import torch; import course_utils as cu; import course_utils.kernels.elementwise as ew; "
            "x = torch.randn(5, 7, device=cu.DEVICE); b = torch.randn(7, device=cu.DEVICE); "
            "y = ew.bias_gelu_dropout_ref(x, b, 0.5, 3); "
            "bad = [m for m in sys.modules if m.startswith(('course_utils.tuned', 'course_utils.cuda'))]; "
            "assert not bad, bad; assert (y == 0).any() and (y != 0).any(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_production_names_are_not_on_the_teaching_shelf():
    """The production ops live on course_utils.tuned.elementwise and course_utils.cuda.gelu only."""
    from course_utils.cuda import gelu as cuda_gelu
    for name in ("gelu", "bias_gelu_scale", "bias_gelu_dropout", "dropout_keep_mask", "add"):
        assert hasattr(tuned, name) and not hasattr(ew, name), name
    for name in ("CUDA_GELU_SOURCE", "cuda_gelu_unavailable", "gelu_cuda"):
        assert hasattr(cuda_gelu, name) and not hasattr(ew, name), name
    assert not hasattr(ew, "__getattr__") and not hasattr(ew, "_FORWARD")
    assert tuned.keep_mask_kernel is ew.keep_mask_kernel  # the tuned shelf imports the teaching mask kernel
    with pytest.raises(AttributeError, match="no attribute 'FAST_LAUNCH'"):
        ew.FAST_LAUNCH  # noqa: B018  (the lean C-launcher path is gone)
    assert not hasattr(tuned, "LAUNCHES") and not hasattr(tuned, "_lean_launch")


def test_teaching_shelf_stays_short_and_free_of_triton_internals():
    import inspect
    for module, limit in ((ew, 260), (tuned, 320)):
        src = inspect.getsource(module)
        assert len(src.splitlines()) <= limit, module.__name__
        for bad in ("triton.runtime", "triton.backends", "triton.compiler", "from triton._", "triton._C"):
            assert bad not in src, (module.__name__, bad)


# ---------------------------------------------------------------- launch configuration

@pytest.mark.parametrize("arch", [75, 80, 86, 89, 90])
def test_launch_config_is_a_pure_function_of_the_device(arch):
    info = hardware.DeviceInfo.for_arch(arch)
    for dtype in tuned.input_dtypes(info):
        itemsize = torch.empty((), dtype=dtype).element_size()
        for n in (1, 1000, 2**20 + 3, 2**28, tuned.INT64_THRESHOLD - 1, 2**31 + 7):
            cfg = tuned.launch_config(n, dtype, info)
            assert cfg == tuned.launch_config(n, dtype, info)
            assert triton.next_power_of_2(cfg.BLOCK_SIZE) == cfg.BLOCK_SIZE <= tuned.MAX_BLOCK_SIZE
            assert cfg.grid[0] * cfg.BLOCK_SIZE >= n > (cfg.grid[0] - 1) * cfg.BLOCK_SIZE
            assert cfg.BLOCK_SIZE * itemsize // (32 * cfg.num_warps) >= 16, "each thread moves >= 16 bytes"
            assert cfg.int64 == (n >= tuned.INT64_THRESHOLD)
            if not cfg.int64:  # the largest offset any lane computes must fit in int32
                assert cfg.grid[0] * cfg.BLOCK_SIZE - 1 < 2**31
    if not info.has_bf16:
        with pytest.raises(TypeError, match="bfloat16|sm_75"):
            tuned.launch_config(100, torch.bfloat16, info)


def test_launch_config_fills_large_gpus_and_rejects_nonsense():
    h100 = hardware.DeviceInfo.for_arch(90)
    assert tuned.launch_config(2**28, torch.bfloat16, h100).grid[0] >= 8 * h100.sms
    assert tuned.launch_config(2**18, torch.float32, h100).grid[0] >= h100.sms
    with pytest.raises(ValueError):
        tuned.launch_config(-1, torch.float32, hardware.INTERPRETER_DEVICE)


# ---------------------------------------------------------------- offsets past 2^31 elements

@triton.jit
def _offset_probe(out_ptr, pid, BLOCK_SIZE: tl.constexpr, INT64: tl.constexpr, TEACHING: tl.constexpr):
    if TEACHING:  # the teaching kernels' first line, verbatim
        start = pid.to(tl.int64) * BLOCK_SIZE
    else:
        start = tuned.tile_start(pid, BLOCK_SIZE, INT64)
    tl.store(out_ptr, start.to(tl.int64) + BLOCK_SIZE - 1)  # the tile's last offset


def test_offset_arithmetic_past_2_31_elements():
    """The last tile of a 2^31 + x element tensor: int32 wraps, int64 (tuned INT64, teaching) does not."""
    n = 2**31 + 12345
    cfg = tuned.launch_config(n, torch.bfloat16, hardware.DeviceInfo.for_arch(90))
    assert cfg.int64
    out = torch.zeros(1, dtype=torch.int64, device=cu.DEVICE)
    for block, pid, int64, teaching in [(cfg.BLOCK_SIZE, cfg.grid[0] - 1, True, False),
                                        (ew.TEACHING_BLOCK, triton.cdiv(n, ew.TEACHING_BLOCK) - 1, False, True)]:
        _offset_probe[(1,)](out, pid, BLOCK_SIZE=block, INT64=int64, TEACHING=teaching)
        assert out.item() == (pid + 1) * block - 1 >= n - 1
    _offset_probe[(1,)](out, cfg.grid[0] - 1, BLOCK_SIZE=cfg.BLOCK_SIZE, INT64=False, TEACHING=False)
    assert out.item() < 0, "int32 arithmetic should have wrapped"
    # every teaching kernel starts from that int64 line
    import inspect
    for k in (ew.add_kernel, ew.gelu_kernel, ew.bias_gelu_scale_kernel, ew.bias_gelu_dropout_kernel):
        assert "offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)" in inspect.getsource(k.fn)


def test_keep_mask_with_int64_offsets_is_the_int32_mask():
    """Philox takes the offset's high word as a second counter: 0 below 2^32, so the teaching mask kernel
    (int64 offsets) draws the mask the tuned dropout kernel draws with int32 offsets, whatever the tile."""
    rows, n_cols, p, seed = 7, 571, 0.4, int(torch.randint(0, 2**40, ()).item())
    x, b = check.randn((rows, n_cols)).abs() + 1.0, check.randn((n_cols,)).abs()  # gelu > 0: zero means dropped
    n = x.numel()
    keep = ew.dropout_keep_mask_teaching((rows, n_cols), p, seed)
    assert keep.dtype == torch.bool and keep.shape == (rows, n_cols)
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(tuned.dropout_keep_mask((rows, n_cols), p, seed), keep)
    assert not torch.equal(ew.dropout_keep_mask_teaching((rows, n_cols), p, seed + 1), keep)
    for int64, block in ((False, 256), (True, 512)):
        g = check.Guarded(x.shape)
        tuned.bias_gelu_dropout_tuned_kernel[(triton.cdiv(n, block),)](
            x, b, g.tensor, n, n_cols, p, 1.0 / (1.0 - p), seed, BLOCK_SIZE=block, APPROXIMATE=True, INT64=int64,
            WRAPS=tuned.bias_wraps(block, n_cols))
        g.check(f"dropout INT64={int64}")
        assert torch.equal(g.tensor != 0, keep), f"INT64={int64}: the tuned kernel drew another mask"
    assert ew.dropout_keep_mask_teaching((0, 5), p, seed).shape == (0, 5)
    assert not count_launches(ew.dropout_keep_mask_teaching, (0, 5), p, seed).triton  # no kernel launched
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        ew.dropout_keep_mask_teaching((3,), 1.0, seed)
    with pytest.raises(ValueError, match="seed"):
        ew.dropout_keep_mask_teaching((3,), p, -1)


BIG = (2**21 + 3, 1024)  # 2^31 + 3072 elements in 1024-column rows: 4 GiB per float16 tensor


def _tail_and_head(got, expected_fn, x_parts, m=1 << 20):
    """Compare the first and the last m elements (a float64 reference of the whole is 16 GiB)."""
    flat = got.view(-1)
    for sl in (slice(0, m), slice(flat.numel() - m, flat.numel())):
        expected = expected_fn(*(p.reshape(-1)[sl] for p in x_parts), sl)
        check.compare(f"elements {sl.start}..{sl.stop}", flat[sl], expected)


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="needs a CUDA GPU with 20 GB free")
@pytest.mark.parametrize("op", ["gelu", "add", "bias_gelu_scale", "bias_gelu_dropout"])
@pytest.mark.parametrize("shelf", SHELVES)
def test_past_2_31_elements_on_the_gpu(op, shelf):
    torch.cuda.empty_cache()
    if torch.cuda.mem_get_info()[0] < 20 * 2**30:
        pytest.skip("less than 20 GB of GPU memory free")
    dt = torch.float16
    x = torch.randn(BIG, device="cuda", dtype=dt)
    b = torch.randn(BIG[1], device="cuda", dtype=dt)
    f = getattr(ew, op + "_teaching") if shelf == "teaching" else getattr(tuned, op)
    cols = lambda sl: torch.arange(sl.start, sl.stop, device="cuda") % BIG[1]  # noqa: E731
    if op == "gelu":
        y = f(x)
        _tail_and_head(y, lambda xs, sl: ew.gelu_ref(xs.double()), [x])
    elif op == "add":
        y = f(x, x)
        _tail_and_head(y, lambda xs, sl: 2 * xs.double(), [x])
    elif op == "bias_gelu_scale":
        y = f(x, b, 0.5)
        _tail_and_head(y, lambda xs, sl: ew.bias_gelu_scale_ref(xs.double(), b.double()[cols(sl)], 0.5), [x])
    else:
        y = f(x, b, 0.2, 1234)
        keep = tuned.dropout_keep_mask(BIG, 0.2, 1234)
        _tail_and_head(y, lambda xs, ks, sl: torch.nn.functional.gelu(xs.double() + b.double()[cols(sl)],
                                                                      approximate="tanh") * ks / 0.8, [x, keep])
        assert abs(keep.view(-1)[-(1 << 24):].float().mean().item() - 0.8) < 1e-3
    assert y.shape == x.shape and y.dtype == dt


def test_cuda_cpp_version_says_why_it_is_unavailable():
    from course_utils.cuda import gelu as cuda_gelu
    assert cuda_gelu.SOURCE_PATH.is_file() and "__global__" in cuda_gelu.CUDA_GELU_SOURCE
    reason = cuda_gelu.cuda_gelu_unavailable()
    if not cu.on_gpu():
        assert "GPU" in reason
        with pytest.raises(RuntimeError, match="GPU"):
            cuda_gelu.gelu_cuda(check.randn((4,)))
    elif reason is None:  # pragma: no cover - GPU with nvcc
        x = check.randn((1001,))
        check.compare("gelu_cuda", cuda_gelu.gelu_cuda(x), ew.gelu_ref(x.double()))


_PTX_PROBE = """
import os
import triton, triton.language  # Triton's own library decorated with the interpreter off
import torch
import course_utils
os.environ.pop("TRITON_INTERPRET", None)  # import course_utils switched it on (no GPU)
from course_utils import triton_internals as ti
from course_utils.kernels import elementwise as ew
t = ti.gpu_target(90)
x = torch.empty(4096)
src, opt = ti.bind(ew.gelu_kernel, (x, x, 4096), dict(BLOCK_SIZE=1024, APPROXIMATE=True), t)
ptx = ti.compile_for(src, t, opt).asm["ptx"]
print("div.full.f32" in ptx, "div.rn.f32" in ptx)
"""


@pytest.mark.slow
def test_gelu_math_division_compiles_as_its_docstring_says():
    """gelu_math's docstring: on sm_90 ``/`` is div.full.f32 (approximate), not the correctly rounded
    div.rn.f32 (issue 18 item 2). Compiled ahead of time, no GPU needed."""
    from course_utils.aot import subprocess_env
    out = subprocess.run([sys.executable, "-c", _PTX_PROBE], capture_output=True, text=True, timeout=300,
                         env=subprocess_env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["True", "False"], out.stdout
