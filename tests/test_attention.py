"""FlashAttention forward: the teaching and tuned kernels share one suite (CPU sizes are tiny)."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils import check, hardware, profile
from course_utils.kernels import attention as A
from course_utils.tuned import attention as TA

DEV = cu.DEVICE
# both kernels multiply float32 in IEEE precision (tl.dot's GPU default, TF32, would miss 1e-4)
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
LSE_TOL = 2e-2 if cu.on_gpu() else 1e-3
DTYPES = list(cu.env.supported_dtypes())

KERNELS = {"teaching": A.flash_attention_teaching, "tuned": TA.flash_attention}
_FORCED = {"tuned-64x32": TA.TileConfig(64, 32, 4, 1), "tuned-tma-device": TA.TileConfig(32, 16, 4, 1, 1),
           "tuned-tma-host": TA.TileConfig(32, 16, 4, 1, 2)}
for _name, _cfg in _FORCED.items():  # every code path of the tuned kernel, on CPU and GPU
    KERNELS[_name] = lambda *a, _cfg=_cfg, **kw: TA.flash_attention(*a, config=_cfg, **kw)


def _qkv(b, h, n, d, dtype, scale=1.0, n_kv=None):
    g = check.generator()
    n_kv = n if n_kv is None else n_kv
    q = (torch.randn(b, h, n, d, generator=g, device=DEV) * scale).to(dtype)
    k = torch.randn(b, h, n_kv, d, generator=g, device=DEV).to(dtype)
    v = torch.randn(b, h, n_kv, d, generator=g, device=DEV).to(dtype)
    return q, k, v


def _close(got, expected, dtype):
    check.compare("attention", got, expected, dtype=dtype, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kernel", ["teaching", "tuned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d", [(1, 16), (17, 32), (70, 16)])
def test_matches_float64(kernel, dtype, causal, n, d):
    _matches(kernel, dtype, causal, n, d)


@pytest.mark.parametrize("kernel", list(_FORCED))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_every_code_path_matches_float64(kernel, dtype, causal):
    _matches(kernel, dtype, causal, 70, 16)


def _matches(kernel, dtype, causal, n, d):
    q, k, v = _qkv(2, 3, n, d, dtype)
    o, lse = KERNELS[kernel](q, k, v, causal=causal, return_lse=True)
    ref, lse_ref = A.attention_ref(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
    assert o.dtype == dtype and o.shape == q.shape and lse.shape == q.shape[:3]
    _close(o, ref, dtype)
    check.compare("lse", lse, lse_ref, atol=LSE_TOL, rtol=1e-4)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_large_magnitude_scores_are_stable(kernel):
    dtype = torch.float16 if cu.on_gpu() else torch.float32  # tf32 would blur scores this large
    q, k, v = _qkv(1, 2, 45, 16, dtype, scale=80.0)  # scores far past exp's range
    o = KERNELS[kernel](q, k, v)
    assert torch.isfinite(o).all()
    _close(o, A.attention_ref(q.double(), k.double(), v.double()), dtype)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("causal", [False, True])
def test_scores_growing_along_the_keys(kernel, causal):
    """Each key tile raises the row max past the last one: the rescaling of the running sum and
    accumulator runs on every tile, in the unmasked and the masked stage."""
    dtype = torch.float16 if cu.on_gpu() else torch.float32
    q, k, v = _qkv(1, 2, 150, 16, dtype)
    ramp = torch.linspace(0.2, 8.0, 150, device=DEV).to(dtype)[None, None, :, None]
    o = KERNELS[kernel](q.abs(), k.abs() * ramp, v, causal=causal)
    _close(o, A.attention_ref(q.abs().double(), (k.abs() * ramp).double(), v.double(), causal=causal), dtype)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_cross_attention_lengths_and_scale(kernel):
    q, k, v = _qkv(1, 2, 9, 32, torch.float32, n_kv=41)
    o = KERNELS[kernel](q, k, v, sm_scale=0.3)
    _close(o, A.attention_ref(q.double(), k.double(), v.double(), sm_scale=0.3), torch.float32)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_strided_inputs(kernel):
    # (batch, seq, heads, d) memory viewed as (batch, heads, seq, d): no copy needed
    g = check.generator()
    base = [torch.randn(2, 33, 3, 16, generator=g, device=DEV) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in base)
    assert not q.is_contiguous()
    o = KERNELS[kernel](q, k, v, causal=True)
    _close(o, A.attention_ref(q.double(), k.double(), v.double(), causal=True), torch.float32)


def test_versions_agree_and_rows_sum():
    q, k, v = _qkv(1, 1, 50, 32, torch.float32)
    ones = torch.ones_like(v)
    # with v = 1 every output row is the sum of the softmax weights: exactly 1 up to rounding
    assert torch.allclose(TA.flash_attention(q, k, ones, causal=True), ones, atol=1e-5)
    assert torch.allclose(TA.flash_attention(q, k, v), A.flash_attention_teaching(q, k, v), atol=TOL[torch.float32])


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_empty_returns_empty(kernel):
    q, k, v = _qkv(0, 2, 5, 16, torch.float32)
    assert KERNELS[kernel](q, k, v).shape == (0, 2, 5, 16)
    q, k, v = _qkv(1, 2, 0, 16, torch.float32)
    o, lse = KERNELS[kernel](q, k, v, return_lse=True)
    assert o.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_bad_inputs(kernel):
    fn = KERNELS[kernel]
    q, k, v = _qkv(1, 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        fn(*_qkv(1, 2, 8, 264, torch.float32))
    with pytest.raises(ValueError, match="4-D"):
        fn(q[0], k[0], v[0])
    with pytest.raises(TypeError, match="one dtype"):
        fn(q, k.half(), v)
    with pytest.raises(TypeError, match="float16"):
        fn(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match="Tensor"):
        fn(q.tolist(), k, v)
    with pytest.raises(ValueError, match="same shape"):
        fn(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="does not match"):
        fn(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        fn(torch.cat([q, q[:, :1]], 1), k, v)
    with pytest.raises(ValueError, match="no keys"):
        fn(q, k[:, :, :0], v[:, :, :0])
    other = "meta"
    with pytest.raises(ValueError, match="device"):
        fn(q.to(other), k.to(other), v.to(other))
    if not cu.on_gpu():
        with pytest.raises(TypeError, match="interpreter"):
            fn(q.bfloat16(), k.bfloat16(), v.bfloat16())


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = _qkv(1, 1, 12, 32, torch.float32)
    a = TA.flash_attention(q, k, v)
    b = TA.flash_attention(q, k, v, sm_scale=1 / math.sqrt(32))
    assert torch.equal(a, b)


# ---- tile choice: a pure function of the device --------------------------------------------------
@pytest.mark.parametrize("arch", [75, 80, 86, 89, 90])
@pytest.mark.parametrize("d", A.HEAD_DIMS + (40, 96, 256))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_configs_fit_every_device(arch, d, dtype, causal):
    info = hardware.DeviceInfo.for_arch(arch)
    cfgs = TA.attention_configs(info, d, dtype, causal)
    assert 1 <= len(cfgs) <= 4
    for c in cfgs:
        assert c.smem_bytes(d, dtype.itemsize) <= info.smem_per_block_bytes
        assert c.block_m >= 16 and c.block_n >= 16
        assert not c.use_tma or arch >= 90


def test_configs_per_architecture():
    t4 = TA.attention_configs(hardware.DeviceInfo.for_arch(75), 128, torch.float16)
    h100 = TA.attention_configs(hardware.DeviceInfo.for_arch(90), 128, torch.float16)
    a100 = TA.attention_configs(hardware.DeviceInfo.for_arch(80), 128, torch.float16)
    assert max(c.smem_bytes(128, 2) for c in t4) <= 64 * 1024
    assert any(c.use_tma for c in h100) and not any(c.use_tma for c in a100)
    assert TA.attention_configs(hardware.INTERPRETER_DEVICE, 64, torch.float16) == [TA.INTERPRETER_TILES]
    with pytest.raises(ValueError, match="head_dim"):
        TA.attention_configs(hardware.DeviceInfo.for_arch(90), 320, torch.float16)


def test_reference_is_three_steps_and_causal():
    q, k, v = _qkv(1, 1, 5, 16, torch.float64)
    o = A.attention_ref(q, k, v, causal=True)
    # the first query sees only the first key: its output is v[0]
    assert torch.allclose(o[0, 0, 0], v[0, 0, 0])
    q, k, v = _qkv(2, 4, 33, 16, torch.float16)
    plain = profile.count_launches(A.attention_ref, q, k, v)
    assert plain.total == 3 and set(plain.torch) == {"baddbmm", "_softmax", "bmm"}, str(plain)
    # causal: the mask (ones, triu) built once, applied in place over S
    assert profile.count_launches(A.attention_ref, q, k, v, causal=True).total == 6
    # grouped-query heads share k/v by a view: still three
    assert profile.count_launches(A.attention_ref, q, k[:, :2].contiguous(), v[:, :2].contiguous()).total == 3


def _attend(q, k, v, causal):  # float64, by definition: every q head, its k/v head, the bottom-right mask
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n, n_kv = q.shape[2], k.shape[2]
        i, j = torch.arange(n)[:, None], torch.arange(n_kv)[None, :]
        s = s.masked_fill(j.to(s.device) > (i + n_kv - n).to(s.device), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,n_kv", [(13, 13), (9, 30), (30, 9)])
def test_reference_grouped_and_bottom_right(causal, n, n_kv):
    g = check.generator()
    q = torch.randn(2, 6, n, 16, generator=g, dtype=torch.float64, device=DEV)
    k, v = (torch.randn(2, 2, n_kv, 16, generator=g, dtype=torch.float64, device=DEV) for _ in range(2))
    o = A.attention_ref(q, k, v, causal=causal)
    assert torch.allclose(o, _attend(q, k, v, causal), atol=1e-12)
    if causal and n > n_kv:  # the first n - n_kv queries see no key: 0
        assert (o[:, :, : n - n_kv] == 0).all()


# ---- what real models use: head dims that are not powers of two, grouped-query, causal n_q != n_kv ----
@pytest.mark.parametrize("kernel", ["teaching", "tuned", "tuned-tma-device", "tuned-tma-host"])
@pytest.mark.parametrize("heads,kv_heads,n,n_kv,d,causal", [
    (2, 2, 37, 37, 40, True), (4, 2, 20, 33, 24, True), (3, 1, 33, 20, 80, True),
    (2, 1, 9, 41, 96, False), (2, 2, 19, 19, 1, False), (2, 2, 17, 17, 200, True)])
def test_real_model_shapes(kernel, heads, kv_heads, n, n_kv, d, causal):
    dtype = torch.float16 if cu.on_gpu() else torch.float32
    g = check.generator()
    q = torch.randn(2, heads, n, d, generator=g, device=DEV).to(dtype)
    k, v = (torch.randn(2, kv_heads, n_kv, d, generator=g, device=DEV).to(dtype) for _ in range(2))
    o, lse = KERNELS[kernel](q, k, v, causal=causal, return_lse=True)
    _close(o, _attend(q.double(), k.double(), v.double(), causal), dtype)
    _, lse_ref = A.attention_ref(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
    seen = torch.isfinite(lse_ref)
    assert (lse[~seen] == float("-inf")).all()
    check.compare("lse", lse[seen], lse_ref[seen], atol=LSE_TOL, rtol=1e-4)


_head_offset, _tile_offsets = A.head_offset, A.tile_offsets


@triton.jit
def _offsets_probe(out_ptr, b, h, stride_b, stride_h, row0, row_stride, col_stride, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    offs = _head_offset(b, h, stride_b, stride_h) + _tile_offsets(row0 + i, i, row_stride, col_stride)
    tl.store(out_ptr + i[:, None] * BLOCK + i[None, :], offs)


@pytest.mark.parametrize("args", [
    (3, 5, 2**29, 2**27, 2**20, 4096, 1),              # head start and row offset each past 2^31
    (2, 7, 123_456_789, 3_000_001, 70_000, 40_000, 9),  # odd strides (a (batch, seq, heads, d) view)
    (0, 0, 0, 0, 2**31 - 20, 1, 2**24)])               # a column stride that overflows on its own
def test_offsets_past_2_31_are_exact(args):
    """The int64 offset helpers every attention kernel uses, at values past 2^31 (CPU: no allocation)."""
    b, h, sb, sh, row0, rs, cs = args
    out = torch.empty(16, 16, dtype=torch.int64, device=DEV)
    _offsets_probe[(1,)](out, b, h, sb, sh, row0, rs, cs, BLOCK=16)
    i = torch.arange(16, dtype=torch.int64)
    expected = b * sb + h * sh + (row0 + i)[:, None] * rs + i[None, :] * cs
    assert torch.equal(out.cpu(), expected)
    assert expected.max() > 2**31


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="needs a CUDA GPU with 20 GB free")
def test_gpu_more_than_2_31_elements():
    """q, k, v, o of 2^31 + 2^20 elements each (fp16): 131 200 heads of 64 x 256."""
    heads, n, d = 2**17 + 64, 64, 256
    q, k, v = (torch.randn(1, heads, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    assert q.numel() > 2**31
    for fn in (TA.flash_attention, A.flash_attention_teaching):
        o = fn(q, k, v, causal=True)
        for hh in (0, heads // 2, heads - 1):  # the last heads live past 2^31
            sl = slice(hh, hh + 1)
            _close(o[:, sl], A.attention_ref(q[:, sl].double(), k[:, sl].double(), v[:, sl].double(),
                                             causal=True), torch.float16)
        del o



@pytest.mark.parametrize("dtype,expected", [(torch.float32, "ieee"), (torch.float16, None)], ids=str)
def test_teaching_launch_asks_ieee_dots_for_float32(monkeypatch, dtype, expected):
    """The launcher passes DOT_PRECISION: "ieee" for float32 (a GPU's default is TF32), the default for 16-bit."""
    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(kwargs)

    monkeypatch.setattr(A, "attn_fwd_kernel", Recorder())
    A.flash_attention_teaching(*_qkv(1, 1, 5, 16, dtype))
    assert seen["DOT_PRECISION"] == expected
    assert A.dot_precision(dtype) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="needs a CUDA GPU (TF32 exists only there)")
@pytest.mark.parametrize("kernel", ["teaching", "tuned"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_float32_is_float32(monkeypatch, kernel, causal):
    """float32 in, float32 precision out: against float64 at a float32 tolerance; and the test can
    fail: the teaching kernel launched with tl.dot's TF32 default misses that tolerance (sm_80+)."""
    q, k, v = _qkv(2, 3, 197, 64, torch.float32, scale=2.0, n_kv=213)  # scores of std 2: TF32's error shows
    o, lse = KERNELS[kernel](q, k, v, causal=causal, return_lse=True)
    ref, lse_ref = A.attention_ref(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
    check.compare("float32 attention", o, ref, atol=1e-4, rtol=1e-4)
    check.compare("float32 lse", lse, lse_ref, atol=1e-4, rtol=1e-4)
    if kernel == "teaching" and torch.cuda.get_device_capability() >= (8, 0):
        monkeypatch.setattr(A, "dot_precision", lambda dtype: "tf32")
        with pytest.raises(check.CheckFailure):
            check.compare("tf32", A.flash_attention_teaching(q, k, v, causal=causal), ref, atol=1e-4, rtol=1e-4)

def test_peak_bytes_linear_vs_quadratic():
    q, k, v = _qkv(1, 2, 96, 16, torch.float32)
    out_bytes = q.numel() * 4
    TA.flash_attention(q, k, v)  # tiles chosen (timed on a GPU) before measuring
    slack = 64 * 1024 if cu.on_gpu() else 0  # allocator rounding, descriptor scratch
    # the output only: S and P never exist
    assert out_bytes <= A.peak_bytes(TA.flash_attention, q, k, v) <= out_bytes + slack
    s_bytes = 2 * 96 * 96 * 4
    assert A.peak_bytes(A.attention_ref, q, k, v) >= 2 * s_bytes  # scores and probabilities at once
    q2, k2, v2 = _qkv(1, 2, 192, 16, torch.float32)
    assert A.peak_bytes(A.attention_ref, q2, k2, v2) >= 3.5 * A.peak_bytes(A.attention_ref, q, k, v)
