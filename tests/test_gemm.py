"""Chapter 9's kernels: the teaching matmul with its epilogue and the tuned (TMA, persistent) one."""

from __future__ import annotations

import pytest
import torch

import course_utils as cu
from course_utils import check, hardware
from course_utils.kernels import gemm as G
from course_utils.tuned import gemm as T

DEV = cu.DEVICE
TOL = {torch.float32: (2e-2, 5e-3) if cu.on_gpu() else (1e-4, 1e-5), torch.float16: (2e-2, 4e-3),
       torch.bfloat16: (0.1, 2e-2)}
SHAPES = [(1, 7, 9), (37, 45, 53), (64, 48, 40)] if not cu.on_gpu() else [(1, 16384, 4096), (1000, 1001, 999),
                                                                          (2048, 4096, 1024), (77, 520, 264)]


def _ops(m, n, k, dtype, w_t=False, x_t=False):
    x = check.randn((m, k), dtype)
    w = check.randn((k, n), torch.float32)
    w = (w / k ** 0.5).to(dtype)
    b = check.randn((n,), dtype)
    if x_t:
        x = x.T.contiguous().T
    if w_t:
        w = w.T.contiguous().T
    return x, w, b


def _ref(x, w, b, **kw):
    return G.linear_gelu_ref(x.double(), w.double(), None if b is None else b.double(), **kw)


def _close(got, exp, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.double(), exp, atol=atol, rtol=rtol)


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("dtype", cu.env.supported_dtypes())
def test_teaching_and_tuned_match_reference(m, n, k, dtype):
    x, w, b = _ops(m, n, k, dtype)
    exp = _ref(x, w, b)
    if m * n * k < 2**28:
        _close(G.linear_gelu_teaching(x, w, b), exp, dtype)
    _close(T.linear_gelu(x, w, b), exp, dtype)
    _close(T.matmul(x, w), _ref(x, w, None, gelu=False), dtype)


@pytest.mark.parametrize("x_t, w_t", [(False, True), (True, False), (True, True)])
def test_transposed_operands(x_t, w_t):
    dtype = torch.float16
    x, w, b = _ops(33, 40, 48, dtype, w_t=w_t, x_t=x_t)
    exp = _ref(x, w, b)
    _close(G.linear_gelu_teaching(x, w, b), exp, dtype)
    _close(T.linear_gelu(x, w, b), exp, dtype)


@pytest.mark.parametrize("cfg", [T.TileConfig(16, 16, 16, 1, 1, group_m=2, tma=True),
                                 T.TileConfig(16, 32, 16, 1, 1, group_m=2, tma=True, subtile=True, per_sm=2)])
@pytest.mark.parametrize("x_t, w_t", [(False, False), (True, True)])
def test_descriptor_kernel(cfg, x_t, w_t):
    """The sm_90 kernel (tensor descriptors, persistent loop): under the interpreter on the CPU too."""
    dtype = torch.float16
    x, w, b = _ops(37, 48, 56, dtype, x_t=x_t, w_t=w_t)
    _close(T.linear_gelu(x, w, b, config=cfg, p=0.25, seed=7), _ref(x, w, b, p=0.25, seed=7), dtype)


def test_dropout_mask_is_chapter_4s():
    x, w, b = _ops(20, 24, 16, torch.float32)
    y = G.linear_gelu_teaching(x, w, b, p=0.5, seed=123)
    from course_utils.tuned.elementwise import dropout_keep_mask
    keep = dropout_keep_mask((20, 24), 0.5, 123, device=x.device)
    assert bool((y[~keep] == 0).all())
    assert 0.3 < keep.float().mean().item() < 0.7
    _close(y, _ref(x, w, b, p=0.5, seed=123), torch.float32)
    assert not torch.equal(y, G.linear_gelu_teaching(x, w, b, p=0.5, seed=124))


def test_group_order_changes_nothing_but_the_order():
    x, w, b = _ops(70, 90, 20, torch.float32)
    a = G.matmul_teaching(x, w, block_m=16, block_n=16, group_m=1)
    c = G.matmul_teaching(x, w, block_m=16, block_n=16, group_m=3)
    assert torch.equal(a, c)


def test_one_launch():
    from course_utils.profile import count_launches
    x, w, b = _ops(20, 24, 16, torch.float32)
    assert sum(count_launches(G.linear_gelu_teaching, x, w, b, p=0.1, seed=1).triton.values()) == 1
    assert sum(count_launches(T.linear_gelu, x, w, b).triton.values()) == 1


def test_empty_inputs_launch_nothing():
    from course_utils.profile import count_launches
    x, w, b = _ops(0, 8, 16, torch.float32)
    assert G.linear_gelu_teaching(x, w, b).shape == (0, 8)
    assert sum(count_launches(T.linear_gelu, x, w, b).triton.values()) == 0
    x, w, b = _ops(5, 8, 0, torch.float32)
    y = T.linear_gelu(x, w, b)            # an empty sum: gelu(bias) on every row
    torch.testing.assert_close(y, torch.nn.functional.gelu(b, approximate="tanh").expand(5, 8))
    assert G.matmul_teaching(*_ops(5, 0, 3, torch.float32)[:2]).shape == (5, 0)


def test_bad_inputs_raise_clear_errors():
    x, w, b = _ops(8, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="must have 8 rows"):
        T.linear_gelu(x, w[:4], b)
    with pytest.raises(TypeError, match="share one dtype"):
        T.linear_gelu(x, w.half(), b)
    with pytest.raises(ValueError, match="one value per output column"):
        G.linear_gelu_teaching(x, w, b[:3])
    with pytest.raises(TypeError, match="bias must be"):
        T.linear_gelu(x, w, b.half())
    with pytest.raises(ValueError, match="2-D"):
        T.matmul(x[0], w)
    with pytest.raises(TypeError, match="dtype must be"):
        T.matmul(x.to(torch.int32), w.to(torch.int32))
    with pytest.raises(ValueError, match="dropout p"):
        T.linear_gelu(x, w, b, p=1.0)
    with pytest.raises(ValueError, match="seed"):
        T.linear_gelu(x, w, b, p=0.1, seed=-1)
    other = torch.device("meta")
    with pytest.raises(ValueError, match="device"):
        T.matmul(x.to(other), w.to(other))
    if not cu.on_gpu():
        with pytest.raises(TypeError, match="bfloat16"):
            T.matmul(x.bfloat16(), w.bfloat16())


def test_configs_per_device():
    for arch in (75, 80, 90):
        info = hardware.DeviceInfo.for_arch(arch)
        for m in (1, 64, 4096):
            for dtype in (torch.float16, torch.float32):
                for cfg in T.gemm_configs(info, m, 16384, 4096, dtype):
                    assert cfg.smem_bytes(dtype.itemsize) <= info.smem_per_block_bytes
                    assert not cfg.tma or (arch >= 90 and dtype.itemsize == 2)
    assert T.gemm_configs(hardware.INTERPRETER_DEVICE, 4096, 4096, 4096, torch.float16) == [T.INTERPRETER_TILES]


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m, n, k", [(4096, 16384, 4096), (1, 16384, 4096), (64, 16384, 4096), (333, 520, 264)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_every_candidate(dtype, m, n, k):
    """Every tile the launcher may choose at this shape (one test a shape: make test-gpu runs them side by side)."""
    info = hardware.device_info()
    x, w, b = _ops(m, n, k, dtype)
    exp = _ref(x, w, b)
    for cfg in T.gemm_configs(info, m, n, k, dtype):
        _close(T.linear_gelu(x, w, b, config=cfg), exp, dtype)
    xw = _ops(m, n, k, dtype, w_t=True)
    _close(T.linear_gelu(*xw, p=0.1, seed=3), _ref(*xw, p=0.1, seed=3), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="needs a CUDA GPU with 12 GB free")
def test_gpu_more_than_2_31_elements():
    """x of 2^20 + 1 rows x 2048 (2^31 + 2048 elements, fp16): the last rows are right."""
    x = torch.randn(2**20 + 1, 2048, device="cuda", dtype=torch.float16)
    w = torch.randn(2048, 64, device="cuda", dtype=torch.float16) / 45
    b = torch.randn(64, device="cuda", dtype=torch.float16)
    tail = slice(2**20 - 7, None)
    exp = _ref(x[tail], w, b)
    _close(T.linear_gelu(x, w, b)[tail], exp, torch.float16)
    _close(G.linear_gelu_teaching(x, w, b, block_m=64, block_n=64)[tail], exp, torch.float16)


def test_tile_order_is_the_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def order_kernel(out_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        pid_m, pid_n = G.grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        tl.store(out_ptr + 2 * pid, pid_m)
        tl.store(out_ptr + 2 * pid + 1, pid_n)

    for tiles_m, tiles_n, group in ((5, 3, 2), (4, 4, 1), (7, 2, 3), (1, 5, 8)):
        out = torch.empty(2 * tiles_m * tiles_n, dtype=torch.int32, device=DEV)
        order_kernel[(tiles_m * tiles_n,)](out, tiles_m * 16 - 3, tiles_n * 16, BLOCK_M=16, BLOCK_N=16, GROUP_M=group)
        got = [tuple(p) for p in out.view(-1, 2).tolist()]
        assert got == G.tile_order(tiles_m, tiles_n, group)
        assert sorted(got) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]


def test_bench_targets_from_the_recorded_run():
    import math

    from benchmarks import gemm as gemm_bench
    from course_utils import bench
    targets = gemm_bench.targets(bench.recorded("gemm"))
    assert len(targets) == 6 and all(t.issue == 14 and math.isfinite(t.measured) for t in targets)


# ---- split-K (a plan asked for by config only; the default never proposes it) ----
SPLIT_TILES = (16, 16, 16, 1, 1) if not cu.on_gpu() else (16, 64, 128, 4, 3)


@pytest.mark.parametrize("m, n, k, split", [(1, 37, 100, 4), (19, 33, 70, 3), (5, 40, 20, 8), (3, 24, 16, 2)]
                         if not cu.on_gpu() else [(1, 16384, 4096, 4), (16, 4000, 4099, 3), (64, 1000, 100, 8)])
@pytest.mark.parametrize("dtype", cu.env.supported_dtypes())
def test_split_k_matches_the_reference(m, n, k, split, dtype):
    """Slices that end past K, more slices asked for than K has tiles (5 x 40 x 20, split 8), one slice."""
    x, w, b = _ops(m, n, k, dtype, w_t=split == 3)
    cfg = T.TileConfig(*SPLIT_TILES, split_k=split)
    _close(T.linear_gelu(x, w, b, config=cfg), _ref(x, w, b), dtype)
    _close(T.matmul(x, w, config=cfg), _ref(x, w, None, gelu=False), dtype)


def test_split_k_with_dropout_is_the_one_kernel_mask_and_deterministic():
    from course_utils import profile
    x, w, b = _ops(21, 40, 64, torch.float16)
    cfg = T.TileConfig(*SPLIT_TILES, split_k=4)
    y = T.linear_gelu(x, w, b, p=0.3, seed=11, config=cfg)
    one = T.linear_gelu(x, w, b, p=0.3, seed=11, config=T.INTERPRETER_TILES if not cu.on_gpu() else None)
    assert torch.equal(y == 0, one == 0)            # the same Philox mask as the one-kernel path
    _close(y, _ref(x, w, b, p=0.3, seed=11), torch.float16)
    assert torch.equal(y, T.linear_gelu(x, w, b, p=0.3, seed=11, config=cfg))   # partials added in a fixed order
    assert profile.count_launches(T.linear_gelu, x, w, b, config=cfg).total == 2


def test_no_default_plan_is_split_k():
    for arch in (75, 80, 90):
        info = hardware.DeviceInfo.for_arch(arch)
        for m in (1, 16, 64, 4096):
            assert all(c.split_k == 1 for c in T.gemm_configs(info, m, 16384, 4096, torch.float16))
