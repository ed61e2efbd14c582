"""course_utils.kernels.layernorm and course_utils.tuned.layernorm(_autograd) against float64.

Small sizes under Triton's interpreter on the CPU; the GPU tests (marked gpu) add long rows, bf16,
the chunked backward and the atomics variant.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import triton

from course_utils import check, env, hardware
from course_utils.kernels import layernorm as L
from course_utils.profile import count_launches
from course_utils.tuned import choice
from course_utils.tuned import layernorm as T
from course_utils.tuned import layernorm_autograd as A

DTYPES = env.supported_dtypes()
TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # relative to max(|ref|, 1)


def _close(what, got, want, dtype):
    err = float((got.double().cpu() - want.cpu()).abs().max() / want.abs().max().clamp_min(1.0))
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]}"
    assert not got.isnan().any(), f"{what}: NaN"


def _inputs(m, n, dtype, offset=0.0, gap=3):
    x = check.randn((m, n + gap), dtype, scale=2.0, offset=offset)[:, :n]  # strided rows
    w = check.randn((n,), dtype, scale=0.5, offset=1.0)
    b = check.randn((n,), dtype)
    dy = check.randn((m, n), dtype)
    return x, w, b, dy


def _ref(x, w, b, dy, rms=False):
    """float64 autograd: (y, dx, dw[, db])."""
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    if rms:
        y = F.rms_norm(xd, x.shape[-1:], wd, 1e-6)
        return (y, *torch.autograd.grad(y, (xd, wd), dy.double()))
    bd = b.double().requires_grad_()
    y = F.layer_norm(xd, x.shape[-1:], wd, bd, 1e-5)
    return (y, *torch.autograd.grad(y, (xd, wd, bd), dy.double()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (37, 300), (5, 1000)])
def test_teaching_forward_and_backward(dtype, shape):
    x, w, b, dy = _inputs(*shape, dtype, offset=50.0)
    y, mean, rstd = L.layer_norm_teaching(x, w, b, return_stats=True)
    ref = _ref(x, w, b, dy)
    _close("y", y, ref[0], dtype)
    dx, dw, db = L.layer_norm_backward_teaching(dy, x, w, mean, rstd)
    for what, got, want in zip(("dx", "dw", "db"), (dx, dw, db), ref[1:]):
        _close(what, got, want, dtype)
    y, rstd = L.rms_norm_teaching(x, w, return_stats=True)
    ref = _ref(x, w, b, dy, rms=True)
    _close("rms y", y, ref[0], dtype)
    dx, dw = L.rms_norm_backward_teaching(dy, x, w, rstd)
    _close("rms dx", dx, ref[1], dtype)
    _close("rms dw", dw, ref[2], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (37, 300), (2, 3, 65)])
def test_autograd_functions_match_float64_autograd(dtype, shape):
    x, w, b, dy = _inputs(shape[0] if len(shape) == 2 else 6, shape[-1], dtype, offset=-20.0)
    x, dy = x.reshape(*shape[:-1], shape[-1]), dy.reshape(*shape[:-1], shape[-1])
    ref = _ref(x, w, b, dy)
    xa, wa, ba = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = A.layer_norm_autograd(xa, wa, ba)
    got = (y, *torch.autograd.grad(y, (xa, wa, ba), dy))
    for what, g, r in zip(("y", "dx", "dw", "db"), got, ref):
        _close(what, g, r, dtype)
    ref = _ref(x, w, b, dy, rms=True)
    y = A.rms_norm_autograd(xa, wa)
    got = (y, *torch.autograd.grad(y, (xa, wa), dy))
    for what, g, r in zip(("rms y", "rms dx", "rms dw"), got, ref):
        _close(what, g, r, dtype)


def test_layer_norm_without_bias_and_names_from_both_shelves():
    x, w, _, dy = _inputs(5, 40, torch.float32)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = A.layer_norm_autograd(xa, wa, None)
    _close("y", y, F.layer_norm(x.double(), (40,), w.double(), None, 1e-5), torch.float32)
    dx, dw = torch.autograd.grad(y, (xa, wa), dy)
    assert dw.shape == w.shape
    for name in ("LayerNormFunction", "rms_norm_autograd", "layer_norm", "rms_norm", "no_such_name"):
        assert not hasattr(L, name), name   # the production names live on the tuned shelf only


@pytest.mark.parametrize("plan", [T.Plan("chunked", 32, 1, 4, 0), T.Plan("tiles", 128, 4, 4, 0),
                                  T.Plan("tiles", 128, 4, 4, 0, stages=3), T.Plan("row", 128, 1, 4, 0),
                                  T.Plan("row", 128, 1, 4, 0, stages=2), T.Plan("mix", 128, 1, 4, 0),
                                  T.Plan("mix", 128, 1, 4, 0, stages=3)])
@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("rms", [False, True])
def test_tuned_backward_every_plan(plan, atomic, rms):
    m, n = 23, 100
    x, w, b, dy = _inputs(m, n, torch.float32, offset=30.0)
    grid, per = T._grid(m, plan.ROWS, 4)
    plan = T.Plan(plan.version, plan.BLOCK_N, plan.ROWS, plan.num_warps, grid, per, plan.stages)
    _, mean, rstd = L.layer_norm_teaching(x, w, b, return_stats=True)
    ref = _ref(x, w, b, dy, rms=rms)
    if rms:
        _, rstd = L.rms_norm_teaching(x, w, return_stats=True)
        got = T.rms_norm_backward(dy, x, w, rstd, atomic=atomic, plan=plan)
    else:
        got = T.layer_norm_backward(dy, x, w, mean, rstd, atomic=atomic, plan=plan)
    for what, g, r in zip(("dx", "dw", "db"), got, ref[1:]):
        _close(what, g, r, torch.float32)


def _nan_empty(monkeypatch):
    """torch.empty and torch.empty_strided give NaN-filled float tensors (dx and the partial rows): an element a
    kernel leaves unwritten shows."""
    for name in ("empty", "empty_strided"):
        real = getattr(torch, name)

        def poisoned(*args, _real=real, **kw):
            t = _real(*args, **kw)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        monkeypatch.setattr(torch, name, poisoned)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, slice_, programs, chunk", [(23, 100, 32, 8, 0), (23, 100, 32, 20, 16),
                                                           (9, 20, 32, 3, 0), (31, 129, 256, 6, 32),
                                                           (31, 129, 64, 6, 128)])
@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("rms", [False, True])
def test_split_backward_matches_float64(monkeypatch, dtype, m, n, slice_, programs, chunk, atomic, rms):
    """The "split" kernel: runs of rows x column slices (the last slice ragged, or one slice wider than the
    row), sums in chunks narrower, as wide or wider than a slice (ragged too), runs of unequal length,
    strided rows, fresh signed inputs far from zero, NaN-poisoned outputs."""
    x, w, b, dy = _inputs(m, n, dtype, offset=-7.0)
    _, mean, rstd = L.layer_norm_teaching(x, w, b, return_stats=True)
    if rms:
        _, rstd = L.rms_norm_teaching(x, w, return_stats=True)
    plan = T.split_plan(m, n, slice_, 4, programs, chunk)
    slices = -(-n // slice_)
    assert plan.grid % slices == 0 and (plan.grid // slices) * plan.rows_per_program >= m
    assert (plan.grid // slices - 1) * plan.rows_per_program < m  # no run without rows
    ref = _ref(x, w, b, dy, rms=rms)
    _nan_empty(monkeypatch)
    if rms:
        got = T.rms_norm_backward(dy, x, w, rstd, atomic=atomic, plan=plan)
    else:
        got = T.layer_norm_backward(dy, x, w, mean, rstd, atomic=atomic, plan=plan)
    for what, g, r in zip(("dx", "dw", "db"), got, ref[1:]):
        _close(f"split {plan} {what}", g, r, dtype)


@pytest.mark.parametrize("version, n", [("row", 77), ("mix", 77), ("mix", 128)])   # mix at 128: no masks (EVEN)
@pytest.mark.parametrize("stages", [0, 2])
@pytest.mark.parametrize("rms", [False, True])
def test_row_backward_with_nan_poisoned_outputs(monkeypatch, version, n, stages, rms):
    """The row kernels (1-D blocks, or torch.compile's (1, N) shape; pipelined or not) write every dx element and
    every partial row they own, the last program's short run of rows included."""
    m = 29
    x, w, b, dy = _inputs(m, n, torch.float32, offset=12.0)
    _, mean, rstd = L.layer_norm_teaching(x, w, b, return_stats=True)
    plan = T.Plan(version, 128, 1, 4, *T._grid(m, 1, 6), stages=stages)
    _nan_empty(monkeypatch)
    if rms:
        rstd = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6).float()
        ref = _ref(x, w, None, dy, rms=True)
        got = T.rms_norm_backward(dy, x, w, rstd, plan=plan)
    else:
        ref = _ref(x, w, b, dy)
        got = T.layer_norm_backward(dy, x, w, mean, rstd, plan=plan)
    for what, g, r in zip(("dx", "dw", "db"), got, ref[1:]):
        _close(f"{version} stages={stages} rms={rms} {what}", g, r, torch.float32)


def test_wide_row_candidates_on_sm90():
    """N 4096-16384 on an H100: the pipelined row plans and the split plans are candidates of the default
    design (timed, kept only where faster), and every split grid is whole runs of slices."""
    info = hardware.DeviceInfo.for_arch(90)
    for n, rows in ((4096, 32768), (8192, 16384), (16384, 8192), (12345, 999)):
        cands = T.backward_candidates(rows, n, 2, info, interpreter=False)
        assert len(cands) == len(set(cands))
        assert any(c.version == "row" and c.stages for c in cands)
        assert any(c.version == "split" for c in cands) == (n >= 8192)
        for c in (c for c in cands if c.version == "split"):
            slices = -(-n // c.BLOCK_N)
            assert c.grid % slices == 0 and (c.grid // slices) * c.rows_per_program >= rows
        course = T.backward_candidates(rows, n, 2, info, interpreter=False, design="course")
        assert not any(c.version in ("row", "split") for c in course)
    for n in (768, 1024, 2048, 32768):
        assert not any(c.version == "split" or (c.version == "row" and c.stages)
                       for c in T.backward_candidates(8192, n, 2, info, interpreter=False))


def test_mix_candidates_sm90_wide_rows_only_and_their_stages_fit():
    """torch.compile's layout joins the timed choice on sm_90 at N = 8192 and 16384 (by BLOCK_N: 12345 too), 16 rows
    a program, and its pipelined plans keep only the stages whose buffers fit (float32 at N=16384: 2 of the 3)."""
    h100 = hardware.DeviceInfo.for_arch(90)
    for n, itemsize in ((8192, 2), (16384, 2), (12345, 2), (8192, 4), (16384, 4)):
        mix = [c for c in T.backward_candidates(32768, n, itemsize, h100, interpreter=False) if c.version == "mix"]
        assert mix and all(c.grid == 32768 // T.MIX_ROWS and c.rows_per_program == T.MIX_ROWS for c in mix)
        fit = T.loop_stages(triton.next_power_of_2(n), 2 * itemsize, h100)
        assert all(c.stages in (0, fit) for c in mix) and fit == (2 if (n, itemsize) == (16384, 4) else 3)
        assert mix == T.mix_plans(32768, n, itemsize, h100)
        assert not any(c.version == "mix" for c in T.backward_candidates(32768, n, itemsize, h100, interpreter=False,
                                                                         design="course"))
    for arch, n in ((80, 16384), (75, 8192), (90, 4096), (90, 768)):
        assert not any(c.version == "mix" for c in T.backward_candidates(
            4096, n, 2, hardware.DeviceInfo.for_arch(arch), interpreter=False))


@pytest.mark.parametrize("arch, n, itemsize, stages", [(90, 768, 2, 3), (90, 8192, 4, 3), (80, 4096, 4, 3),
                                                      (75, 768, 2, 0), (90, 16384, 4, 0)])
def test_pipelined_tile_candidates_fit_the_shared_memory(arch, n, itemsize, stages):
    """The tile backward's pipelined twins: the (stages - 1) buffered tiles of x and dy fit one program's shared
    memory, none before sm_80 (no asynchronous copies) or where no two stages fit (N=16384 in fp32 is chunked)."""
    info = hardware.DeviceInfo.for_arch(arch)
    piped = [c for c in T.backward_candidates(8192, n, itemsize, info, interpreter=False) if c.version == "tiles"
             and c.stages]
    assert {c.stages for c in piped} == ({stages} if stages else set())
    for c in piped:
        assert (c.stages - 1) * c.ROWS * c.BLOCK_N * 2 * itemsize + T.SMEM_SPARE <= info.smem_per_block_bytes
    assert not any(c.stages for c in T.backward_candidates(8192, n, itemsize, info, interpreter=False,
                                                           design="course"))


def test_loop_stages_is_the_most_that_fit():
    h100, t4 = hardware.DeviceInfo.for_arch(90), hardware.DeviceInfo.for_arch(75)
    assert T.loop_stages(4096, 6, h100) == 3 and T.loop_stages(4096, 6, h100, want=4) == 4
    room = h100.smem_per_block_bytes - T.SMEM_SPARE
    assert T.loop_stages(room // 2 + 1, 1, h100) == 2   # one buffered tile of this many bytes fits, two do not
    assert T.loop_stages(room, 1, h100) == 2 and T.loop_stages(room + 1, 1, h100) == 0
    assert T.loop_stages(16, 2, t4) == 0


def test_forward_is_one_launch_and_partials_are_deterministic():
    x, w, b, dy = _inputs(40, 200, torch.float32)
    T.layer_norm(x, w, b)
    assert count_launches(T.layer_norm, x, w, b).total == 1
    assert count_launches(L.layer_norm_teaching, x, w, b).total == 1
    _, mean, rstd = L.layer_norm_teaching(x, w, b, return_stats=True)
    T.layer_norm_backward(dy, x, w, mean, rstd)  # on a GPU the first call times the candidate plans
    assert count_launches(T.layer_norm_backward, dy, x, w, mean, rstd).total == 2  # kernel + both column sums
    first = T.layer_norm_backward(dy, x, w, mean, rstd)
    again = T.layer_norm_backward(dy, x, w, mean, rstd)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("n_partials, n_cols", [(1, 1), (37, 65), (70, 200), (5, 1100)])   # BLOCK_N 16, then 64
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_column_sum_pair_is_the_two_teaching_launches(n_partials, n_cols, dtype):
    """The one-launch reduction of both partial buffers gives the bits of two teaching ``column_sum``s."""
    dw_partial = check.randn((n_partials, n_cols), torch.float32, scale=3.0)
    db_partial = check.randn((n_partials, n_cols), torch.float32)
    dw, db = T.column_sum_pair(dw_partial, db_partial, dtype)
    block_n = T.column_sum_block_n(n_cols, L.REDUCE_BLOCK_N)   # the same tile: on a GPU it sets the bits
    assert torch.equal(dw, L.column_sum(dw_partial, dtype, block_n))
    assert torch.equal(db, L.column_sum(db_partial, dtype, block_n))
    assert dict(count_launches(T.column_sum_pair, dw_partial, db_partial, dtype).triton) == {
        "column_sum_pair_kernel": 1}
    atol, rtol = check.tolerance(dtype)
    for out, partial in ((dw, dw_partial), (db, db_partial)):
        torch.testing.assert_close(out.double(), partial.double().sum(0), atol=atol, rtol=rtol)


def test_outputs_are_fully_written_and_empty_inputs_launch_nothing():
    x, w, b, _ = _inputs(6, 33, torch.float32)
    y = T.layer_norm(x, w, b)
    assert not y.isnan().any()
    empty, none = torch.empty(0, 33, device=env.DEVICE), torch.empty(0, device=env.DEVICE)
    assert T.layer_norm(empty, w, b).shape == (0, 33)
    assert count_launches(T.layer_norm, empty, w, b).total == 0
    assert count_launches(L.layer_norm_teaching, empty, w, b).total == 0
    dx, dw, db = T.layer_norm_backward(empty, empty, w, none, none)
    assert dx.shape == (0, 33) and torch.equal(dw, torch.zeros_like(w))


def test_bad_inputs_get_clear_errors():
    x, w, b, dy = _inputs(4, 16, torch.float32)
    with pytest.raises(ValueError, match="weight must be a contiguous 1-D tensor of 16"):
        T.layer_norm(x, w[:8], b)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        T.rms_norm(x.double(), w)
    with pytest.raises(TypeError, match="torch.Tensor"):
        T.layer_norm([1.0, 2.0], w, b)
    with pytest.raises(ValueError, match="bias must have the shape"):
        T.layer_norm(x, w, b[:3])
    with pytest.raises(ValueError, match="dy must have the shape"):
        T.layer_norm_backward(dy[:2], x, w, torch.zeros(4, device=env.DEVICE), torch.ones(4, device=env.DEVICE))
    with pytest.raises(ValueError, match="at most 65536 columns"):
        T.plan_forward(1, 70000, 4, hardware.DeviceInfo.for_arch(90), interpreter=False)


def test_non_contiguous_columns_are_copied():
    x, w, b, _ = _inputs(8, 24, torch.float32)
    xt = x.t().contiguous().t()  # column-major: stride(-1) != 1
    _close("y", T.layer_norm(xt, w, b), F.layer_norm(x.double(), (24,), w.double(), b.double()), torch.float32)


def test_plans_are_pure_functions_of_shape_and_device():
    for arch in (75, 80, 90):
        info = hardware.DeviceInfo.for_arch(arch)
        for n in (100, 1024, 4096, 16384):
            p = T.plan_forward(4096, n, 2, info, interpreter=False)
            assert p.ROWS * p.BLOCK_N <= max(16384, p.BLOCK_N) and 4 <= p.num_warps <= 32
            cands = T.backward_candidates(4096, n, 2, info, interpreter=False, design="course")
            assert cands and all(c.grid * c.rows_per_program >= 4096 for c in cands)
            assert (n > T.CHUNKED_FROM) == all(c.version == "chunked" for c in cands)
            both = T.backward_candidates(4096, n, 2, info, interpreter=False)  # the default adds the per-SM plan
            assert both == T.backward_candidates(4096, n, 2, info, interpreter=False, design="both")



@pytest.mark.parametrize("rms", [False, True])
def test_per_sm_plan_matches_float64(rms):
    """Liger-Kernel's layout (one program per SM, one row at a time): 5 SMs, 23 rows, runs of 5 (the last 3)."""
    m, n = 23, 100
    x, w, b, dy = _inputs(m, n, torch.float32, offset=30.0)
    plan = T.per_sm_plan(m, n, dataclasses.replace(hardware.DeviceInfo.for_arch(90), sms=5))
    assert (plan.ROWS, plan.grid, plan.rows_per_program) == (1, 5, 5)
    ref = _ref(x, w, b, dy, rms=rms)
    if rms:
        _, rstd = L.rms_norm_teaching(x, w, return_stats=True)
        got = T.rms_norm_backward(dy, x, w, rstd, plan=plan)
    else:
        _, mean, rstd = L.layer_norm_teaching(x, w, b, return_stats=True)
        got = T.layer_norm_backward(dy, x, w, mean, rstd, plan=plan)
    for what, g, r in zip(("dx", "dw", "db"), got, ref[1:]):
        _close(what, g, r, torch.float32)


def test_backward_design_selects_the_candidates_and_autograd_follows():
    info = hardware.DeviceInfo.for_arch(90)
    course = T.backward_candidates(8192, 1024, 2, info, interpreter=False, design="course")
    per_sm = T.per_sm_plan(8192, 1024, info)
    assert per_sm not in course
    with T.backward_design("per-sm"):
        assert T.backward_candidates(8192, 1024, 2, info, interpreter=False) == [per_sm]
        assert all(c.version == "chunked" for c in T.backward_candidates(64, 40000, 2, info, interpreter=False))
        x, w, b, dy = _inputs(9, 70, torch.float32)
        xa, wa, ba = (t.detach().clone().requires_grad_() for t in (x, w, b))
        got = torch.autograd.grad(A.layer_norm_autograd(xa, wa, ba), (xa, wa, ba), dy)
        for what, g, r in zip(("dx", "dw", "db"), got, _ref(x, w, b, dy)[1:]):
            _close(what, g, r, torch.float32)
    with T.backward_design("both"):
        both = T.backward_candidates(8192, 1024, 2, info, interpreter=False)
        piped = [c for c in both if c.version == "tiles" and c.stages]
        assert piped and both == course + piped + [per_sm]
        assert T.per_sm_plan(4096, 4096, info) in T.backward_candidates(4096, 4096, 2, info, interpreter=False)
        rows = [c for c in T.backward_candidates(4096, 16384, 2, info, interpreter=False)
                if c.version == "row" and not c.stages]
        assert [(c.num_warps, c.grid) for c in rows] == [(w, T._grid(4096, 1, info.sms)[0]) for w in T.ROW_WARPS]
    assert not any(c.version == "row" for n in (1024, 16384, 40000)
                   for c in T.backward_candidates(4096, n, 2, info, interpreter=False, design="course"))
    assert T.BACKWARD_DESIGN == "both"  # restored after each block
    with pytest.raises(ValueError, match="backward design must be one of"), T.backward_design("fast"):
        pass


def test_deterministic_mode_pins_the_first_plan_and_refuses_atomics(monkeypatch):
    x, w, b, dy = _inputs(12, 50, torch.float32)
    _, mean, rstd = L.layer_norm_teaching(x, w, b, return_stats=True)
    monkeypatch.setattr(T, "_choose", lambda *a: pytest.fail("timed a choice in deterministic mode"))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _close("dw", T.layer_norm_backward(dy, x, w, mean, rstd)[1], _ref(x, w, b, dy)[2], torch.float32)
        with pytest.raises(RuntimeError, match="use_deterministic_algorithms"):
            T.layer_norm_backward(dy, x, w, mean, rstd, atomic=True)
    finally:
        torch.use_deterministic_algorithms(was)


def test_the_choice_times_the_whole_backward_with_its_column_sum(monkeypatch):
    """A plan with more programs leaves more partial rows to reduce: the timed launch must include it."""
    x, w, b, dy = _inputs(21, 37, torch.float32)
    _, mean, rstd = L.layer_norm_teaching(x, w, b, return_stats=True)
    sums, seen = [], []
    real_pair = T.column_sum_pair   # both partial buffers, one launch
    monkeypatch.setattr(T, "column_sum_pair",
                        lambda dw, db, dt: sums.extend((dw.shape, db.shape)) or real_pair(dw, db, dt))

    def choose(cands, key, launch):
        before = len(sums)
        launch(cands[0])
        seen.append(len(sums) - before)
        return cands[0]
    monkeypatch.setattr(T, "_choose", choose)
    got = T.layer_norm_backward(dy, x, w, mean, rstd)
    assert seen == [2], f"the timed launch reduced {seen} partial buffers, expected 2 (dw and db)"
    for what, g, r in zip(("dx", "dw", "db"), got, _ref(x, w, b, dy)[1:]):
        _close(what, g, r, torch.float32)


def test_a_chosen_plan_is_reused_without_rebuilding_the_candidates(monkeypatch):
    x, w, b, dy = _inputs(17, 40, torch.float32)
    _, mean, rstd = L.layer_norm_teaching(x, w, b, return_stats=True)
    plan = T.Plan("tiles", 64, 2, 4, *T._grid(17, 2, 2))
    key = (17, 40, x.dtype, w.dtype, False, False, str(x.device), T.BACKWARD_DESIGN)
    monkeypatch.setitem(T._BEST, key, plan)
    monkeypatch.setattr(T, "backward_candidates", lambda *a, **k: pytest.fail("rebuilt the candidates"))
    launched = []
    real = T._launch_backward
    monkeypatch.setattr(T, "_launch_backward", lambda p, *a: launched.append(p) or real(p, *a))
    got = T.layer_norm_backward(dy, x, w, mean, rstd)
    assert launched == [plan]
    for what, g, r in zip(("dx", "dw", "db"), got, _ref(x, w, b, dy)[1:]):
        _close(what, g, r, torch.float32)


def test_backward_plan_pins_a_plan_through_autograd(monkeypatch):
    x, w, b, dy = _inputs(19, 45, torch.float32)
    plan = T.Plan("tiles", 64, 2, 4, *T._grid(19, 2, 3))
    launched = []
    real = T._launch_backward
    monkeypatch.setattr(T, "_launch_backward", lambda p, *a: launched.append(p) or real(p, *a))
    monkeypatch.setattr(T, "_choose", lambda *a: pytest.fail("timed a choice under backward_plan"))
    xa, wa, ba = (t.detach().clone().requires_grad_() for t in (x, w, b))
    with T.backward_plan(plan):
        got = torch.autograd.grad(A.layer_norm_autograd(xa, wa, ba), (xa, wa, ba), dy)
    assert launched == [plan] and T._PINNED is None  # pinned inside the block, restored after
    for what, g, r in zip(("dx", "dw", "db"), got, _ref(x, w, b, dy)[1:]):
        _close(what, g, r, torch.float32)
    with pytest.raises(TypeError, match="needs a Plan"), T.backward_plan("tiles"):
        pass


@pytest.mark.parametrize("dtype", DTYPES)
def test_atomics_save_no_launch(dtype):
    """What chapter 10 says of atomics: the reduction kernel goes, but zeroing the float32 sums (and, in 16-bit
    dtypes, converting them) takes more launches (the partial sums: the backward and one column-sum launch)."""
    x, w, b, dy = _inputs(40, 200, dtype)
    _, mean, rstd = L.layer_norm_teaching(x, w, b, return_stats=True)
    for atomic in (False, True):  # the shape's first call times its candidate plans (on a GPU): count a later one
        T.layer_norm_backward(dy, x, w, mean, rstd, atomic=atomic)
    partials = count_launches(T.layer_norm_backward, dy, x, w, mean, rstd)
    atomics = count_launches(lambda: T.layer_norm_backward(dy, x, w, mean, rstd, atomic=True))
    assert partials.total == 2 and atomics.total == (3 if dtype == torch.float32 else 5)

@pytest.mark.gpu
@pytest.mark.skipif(not env.on_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1000, 4096, 8192, 12345, 16384, 40000])
def test_gpu_long_rows_every_backward_candidate(dtype, n):
    m = 300
    x, w, b, dy = _inputs(m, n, dtype, offset=10.0)
    ref = _ref(x, w, b, dy)
    y, mean, rstd = T._forward(x, w, b, 1e-5, False, True, "test")
    _close("y", y, ref[0], dtype)
    info = hardware.device_info()
    per_sm = [T.per_sm_plan(m, n, info)] if n <= T.PER_SM_MAX_BLOCK else []
    seen = set()  # atomics for the first plan of each kernel: every candidate adds compiles to the GPU suite
    for plan in T.backward_candidates(m, n, dtype.itemsize, info) + per_sm:
        for atomic in (False, True) if (plan.version, plan.stages > 0) not in seen else (False,):
            try:
                got = T.layer_norm_backward(dy, x, w, mean, rstd, atomic=atomic, plan=plan)
            except Exception as e:  # a candidate this GPU cannot fit (the timed choice skips it too)
                if not choice.out_of_resources(e):
                    raise
                break
            for what, g, r in zip(("dx", "dw", "db"), got, ref[1:]):
                _close(f"{plan} atomic={atomic} {what}", g, r, dtype)
        seen.add((plan.version, plan.stages > 0))


@pytest.mark.gpu
@pytest.mark.skipif(not env.on_gpu(), reason="needs a GPU")
def test_gpu_int64_offsets():
    m, n = 2**31 // 1024 + 7, 1024  # more than 2^31 elements, bf16: about 4 GiB each
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w, b = torch.ones(n, device="cuda", dtype=torch.bfloat16), torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    y = T.layer_norm(x, w, b)
    tail = F.layer_norm(x[-3:].float(), (n,), w.float(), b.float())
    assert float((y[-3:].float() - tail).abs().max()) < 3e-2


def test_bench_keeps_compile_fallbacks_as_such_and_never_judges_them():
    import pandas as pd

    from benchmarks import layernorm as B
    B.EAGER_RUNS.clear()
    B._flag_eager(lambda x: x + 1, ("ln", "ln_fwd"))(torch.zeros(2))  # run eagerly: counted
    assert B.EAGER_RUNS[("ln", "ln_fwd")] == 1
    rows = [{"op": "copy", "impl": "copy", "ms": 1.0, "gbps": 100.0}]
    for impl, ms, fallback in (("ours", 1.0, False), ("torch", 2.0, False), ("torch.compile", 4.0, True)):
        rows.append({"op": "ln_fwd", "impl": impl, "ms": ms, "gbps": 100.0 / ms, "fallback": fallback})
    df = pd.DataFrame(rows).assign(dtype="float32", n_cols=1024)
    r = B.ratios(df).iloc[0]
    assert r["compile"] == "eager fallback" and r["vs_torch.compile"] != r["vs_torch.compile"]  # NaN, named
    names = [t.row()["target"] for t in B.targets(df)]
    assert any("F.layer_norm" in n for n in names) and not any("torch.compile" in n for n in names)
    df.loc[df.impl == "torch.compile", "fallback"] = False
    assert B.ratios(df).iloc[0]["vs_torch.compile"] == 4.0 and B.ratios(df).iloc[0]["compile"] == "compiled"


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("shape", [(7, 50), (9, 64)])   # masked: a ragged last tile and N below the block; even
def test_the_forward_that_reads_x_twice_matches_float64(monkeypatch, nan_empty, rms, shape):
    """RMS_FWD_RELOAD's form (x read again for y) on every width of the table, forced on small shapes: y and the
    statistics of both norms against float64, every row of a NaN-poisoned output written."""
    m, n = shape
    x, w, b, dy = _inputs(m, n, torch.float32, offset=-7.0)
    real = T.plan_forward

    def forced(*args, **kwargs):
        p = real(*args, **kwargs)
        return dataclasses.replace(p, ROWS=2, grid=-(-args[0] // 2), reload=True)
    monkeypatch.setattr(T, "plan_forward", forced)
    y, mean, rstd = T._forward(x, w, None if rms else b, 1e-6 if rms else 1e-5, rms, True, "forms")
    monkeypatch.undo()
    ref = _ref(x, w, b, dy, rms=rms)[0]
    _close("y", y, ref, torch.float32)
    xd = x.double()
    want_rstd = torch.rsqrt((xd.pow(2) if rms else (xd - xd.mean(-1, keepdim=True)).pow(2)).mean(-1)
                            + (1e-6 if rms else 1e-5))
    _close("rstd", rstd, want_rstd, torch.float32)
    if not rms:
        _close("mean", mean, xd.mean(-1), torch.float32)


def test_reload_plans_are_rmsnorms_on_sm90_only():
    for arch in (80, 90):
        info = hardware.DeviceInfo.for_arch(arch)
        for (block, size) in T.RMS_FWD_RELOAD:
            rows = 2**30 // (block * size)
            assert T.plan_forward(rows, block, size, info, interpreter=False, rms=True).reload == (arch >= 90)
            assert not T.plan_forward(rows, block, size, info, interpreter=False).reload   # LayerNorm: one read
    info = hardware.DeviceInfo.for_arch(90)
    assert not T.plan_forward(4096, 1024, 4, info, interpreter=False, rms=True).reload   # a width not measured
