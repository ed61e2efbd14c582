"""The one-shot all-reduce and its fused residual + RMSNorm epilogue (course_utils/kernels/allreduce.py),
on simulated ranks: against a float64 sum on odd sizes, 1, 2 and 4 ranks, many calls back to back with
new data and NaN-poisoned outputs, the checker's adversarial schedule (a reduce launched before any
rank published), and the barrier-less sketch, which that schedule must catch."""

import pytest
import torch
import triton
import triton.language as tl

from course_utils import check, env
from course_utils import symmetric as S
from course_utils.checkers import allreduce as checks
from course_utils.kernels import allreduce as K

SHAPES = [(1, 1), (7, 37), (13, 100), (3, 5, 129)]
DTYPES = list(env.supported_dtypes())   # fp32, fp16; bf16 too on a GPU (its arithmetic is wrong under the interpreter)


def _ranks(world, dtype, capacity=2000):
    return S.SimulatedRanks(world, capacity, dtype, device=env.DEVICE)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_matches_float64_back_to_back(nan_empty, world, dtype):
    ranks = _ranks(world, dtype)
    for shape in SHAPES + SHAPES[::-1]:          # every shape twice: both halves of the buffers
        xs = [check.randn(shape, dtype, scale=2.0) for _ in range(world)]
        outs = K.one_shot_all_reduce_teaching(xs, ranks)
        ref = K.all_reduce_ref(xs)
        for out in outs:
            assert out.shape == xs[0].shape and out.dtype == dtype
            check.compare(f"all-reduce {shape}", out, ref)
        assert all(torch.equal(out, outs[0]) for out in outs)   # the same sum order on every rank
        assert not any(bool(p.any()) for p in ranks.pads)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_matches_float64(nan_empty, world, dtype):
    ranks = _ranks(world, dtype)
    for shape in SHAPES:
        xs = [check.randn(shape, dtype, scale=2.0) for _ in range(world)]
        residual = check.randn(shape, dtype)
        weight = check.randn(shape[-1:], dtype, offset=1.0, scale=0.5)
        got = K.all_reduce_add_rms_norm_teaching(xs, [residual] * world, weight, ranks, eps=1e-6)
        y64, s64 = K.all_reduce_add_rms_norm_ref(xs, residual, weight, 1e-6, dtype=dtype)
        for y, s in got:
            check.compare(f"s {shape}", s, s64)
            check.compare(f"y {shape}", y, y64)


def test_teaching_kernels_survive_the_adversarial_schedule():
    checks.stress(K.one_shot_all_reduce_kernel, "teaching all-reduce")
    checks.stress(K.all_reduce_add_rms_norm_kernel, "teaching fused all-reduce", fused=True)


@triton.jit
def _sketch_kernel(out_ptr, x_ptr, buf_table_ptr, pad_table_ptr, rank, n_rows, n_cols, buf_offset, max_spins,
                   WORLD: tl.constexpr, BLOCK_N: tl.constexpr, PUBLISH: tl.constexpr, REDUCE: tl.constexpr,
                   PHASES: tl.constexpr):
    """The sketch: copy x into this rank's buffer, read every rank's buffer, sum. No barrier. With PHASES
    False it ignores the halves and does both whatever it is asked (one launch per rank, as on a GPU)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    for row in tl.range(pid, n_rows, tl.num_programs(0)):
        offsets = tl.cast(row, tl.int64) * n_cols + cols
        if PUBLISH or not PHASES:
            mine = tl.load(buf_table_ptr + rank).to(tl.pointer_type(dtype)) + buf_offset
            tl.store(mine + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
        if REDUCE or not PHASES:
            acc = tl.zeros((BLOCK_N,), tl.float32)
            for r in tl.static_range(WORLD):
                buf = tl.load(buf_table_ptr + r).to(tl.pointer_type(dtype)) + buf_offset
                acc += tl.load(buf + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


@pytest.mark.parametrize("phases", [True, False])
def test_the_barrier_less_sketch_fails(phases):
    class Sketch:
        def __getitem__(self, grid):
            return lambda *a, **kw: _sketch_kernel[grid](*a, PHASES=phases, **kw)
    with pytest.raises(check.CheckFailure, match="no barrier"):
        checks.stress(Sketch(), "sketch")


def test_a_reduce_before_any_publish_writes_nothing():
    ranks = _ranks(2, torch.float32)
    x = check.randn((5, 33))
    out = torch.full_like(x, float("nan"))
    K.one_shot_all_reduce_kernel[(3,)](out, x, ranks.buf_table, ranks.pad_table, 0, 5, 33, 0, ranks.max_spins,
                                       WORLD=2, BLOCK_N=64, PUBLISH=False, REDUCE=True)
    assert bool(out.isnan().all()) and not any(bool(p.any()) for p in ranks.pads)


def test_empty_input_returns_empty_without_launching():
    ranks = _ranks(2, torch.float32)
    outs = K.one_shot_all_reduce_teaching([torch.empty(0, 8, device=env.DEVICE)] * 2, ranks)
    assert [tuple(o.shape) for o in outs] == [(0, 8)] * 2 and ranks.calls == 0


@pytest.mark.parametrize("xs, words", [
    (lambda d: torch.zeros(4, 8, device=d), "list of 2 tensors"),
    (lambda d: [torch.zeros(4, 8, device=d)], "list of 2 tensors"),
    (lambda d: [torch.zeros(4, 8, device=d, dtype=torch.float16)] * 2, "float32"),
    (lambda d: [torch.zeros(4, 8, device=d), torch.zeros(4, 9, device=d)], "same shape"),
    (lambda d: [torch.zeros(100, 100, device=d)] * 2, "do not fit"),
    (lambda d: [torch.zeros(1, 20000, device=d)] * 2, "at most 16384 columns"),
    (lambda d: [1.0, 2.0], "torch.Tensor"),
    (lambda d: [torch.zeros(4, 8, device=d, dtype=torch.int32)] * 2, "float32, float16 or bfloat16"),
])
def test_bad_inputs_get_clear_errors(xs, words):
    ranks = _ranks(2, torch.float32, capacity=4000)
    with pytest.raises((TypeError, ValueError), match=words):
        K.one_shot_all_reduce_teaching(xs(env.DEVICE), ranks)


def test_bad_fused_inputs_get_clear_errors():
    ranks = _ranks(2, torch.float32)
    xs = [torch.zeros(4, 8, device=env.DEVICE)] * 2
    with pytest.raises(ValueError, match="weight must be a tensor of shape"):
        K.all_reduce_add_rms_norm_teaching(xs, xs, torch.ones(9, device=env.DEVICE), ranks)
    with pytest.raises(ValueError, match="residuals"):
        K.all_reduce_add_rms_norm_teaching(xs, [torch.zeros(4, 8, device=env.DEVICE)], torch.ones(8), ranks)
    with pytest.raises(TypeError, match="ranks must be"):
        K.one_shot_all_reduce_teaching(xs, None)


def test_symmetric_ranks_address_the_tensor_inside_each_peers_allocation(monkeypatch):
    """torch's memory pool may place the tensor at an offset inside the symmetric allocation whose base
    ``buffer_ptrs`` names: the table must hold base + offset for every rank, and refuse offsets that differ."""
    import torch.distributed as dist

    class Handle:
        buffer_ptrs = [1000, 5000, 9000]

    class Tensor:
        def data_ptr(self):
            return 5000 + 256          # rank 1's tensor, 256 bytes into its allocation

    ranks = S.SymmetricRanks.__new__(S.SymmetricRanks)   # no GPU: only the address arithmetic
    ranks.local_ranks, ranks.world_size = [1], 3
    def gathered(offsets):
        return lambda out, obj, group=None: out.__setitem__(slice(None), offsets(obj))
    monkeypatch.setattr(dist, "all_gather_object", gathered(lambda obj: [obj] * 3))
    assert ranks._peer_ptrs(Handle(), Tensor(), None) == [1256, 5256, 9256]
    monkeypatch.setattr(dist, "all_gather_object", gathered(lambda obj: [0, obj, 0]))
    with pytest.raises(RuntimeError, match="different offsets"):
        ranks._peer_ptrs(Handle(), Tensor(), None)


def test_a_peer_that_never_signals_gives_nan_rows_not_stale_memory():
    """One launch per rank (a GPU's way): rank 0 alone runs, its wait for rank 1 gives up after max_spins,
    and its output is NaN, never whatever the output's memory held."""
    class Alone(S.SimulatedRanks):
        def schedule(self):
            return [(0, True, True)]   # rank 1 never publishes

    ranks = Alone(2, 64, dtype=torch.float32, device=env.DEVICE, max_programs=2)
    xs = [check.randn((3, 7)), check.randn((3, 7))]
    out = K.one_shot_all_reduce_teaching(xs, ranks)[0]
    assert torch.isnan(out).all()
    y, s = K.all_reduce_add_rms_norm_teaching(xs, [check.randn((3, 7))] * 2, check.randn((7,)), ranks)[0]
    assert torch.isnan(y).all() and torch.isnan(s).all()
