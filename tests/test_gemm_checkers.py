"""The chapter 9 checkers pass correct kernels and fail the usual wrong ones, naming the fault."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import course_utils as cu
from course_utils import check
from course_utils.checkers import gemm as cg
from course_utils.kernels import gemm as G
from course_utils.kernels.elementwise import gelu_math
from course_utils.kernels.gemm import tile_matmul
from course_utils.tuned import gemm as tuned_gemm

# tl.constexpr, so the compiled (GPU) kernel may read them as globals
(OK, NO_K_MASK, FP16_ACC, BIAS_ROWS, GELU_FIRST, NO_STRIDES, K_MASK_A_ONLY, K_MASK_B_ONLY, NO_ROW_MASK,
 NO_COL_MASK, BIAS_NO_MASK, ERF_GELU, RES_NO_STRIDE, RES_BEFORE_GELU, RES_NO_MASK, SIGMOID_GELU, NO_CUBIC_GELU,
 BIAS_MASK_M, RES_MASK_SWAP, BIAS_BROADCAST_ROWS) = (tl.constexpr(i) for i in range(20))
# 32 on the CPU too (the interpreter's cost grows with the programs and K steps it runs): the checker's
# cases still span several tiles with ragged edges in M, N and K, and each wrong kernel fails for its own reason
BLOCK = 32


@triton.jit
def _buggy_linear(a_ptr, b_ptr, c_ptr, bias_ptr, r_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  stride_rm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EPILOGUE: tl.constexpr, RESIDUAL: tl.constexpr, BUG: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if BUG == NO_STRIDES:   # assumes row-major operands
        stride_ak = 1
        stride_bn = 1
        stride_am = K
        stride_bk = N
    if BUG == FP16_ACC:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float16)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        if BUG == NO_K_MASK:
            mask_k = k >= 0
        mask_ka = mask_k
        mask_kb = mask_k
        if BUG == K_MASK_B_ONLY:   # the K mask on one operand only: 0 * (what lies past K) is not always 0
            mask_ka = k >= 0
        if BUG == K_MASK_A_ONLY:
            mask_kb = k >= 0
        mask_m = offs_m < M
        mask_n = offs_n < N
        if BUG == NO_ROW_MASK:
            mask_m = offs_m >= 0
        if BUG == NO_COL_MASK:
            mask_n = offs_n >= 0
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_ka[None, :], other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=mask_kb[:, None] & mask_n[None, :], other=0.0)
        if BUG == FP16_ACC:
            acc = (acc + tl.dot(a, b)).to(tl.float16)
        else:
            acc = tl.dot(a, b, acc)
    acc = acc.to(tl.float32)
    if EPILOGUE:
        if BUG == BIAS_ROWS:
            bias = tl.load(bias_ptr + offs_m, mask=offs_m < M, other=0.0).to(tl.float32)
            acc = gelu_math(acc + bias[:, None], True)
        elif BUG == GELU_FIRST:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = gelu_math(acc, True) + bias[None, :]
        elif BUG == BIAS_NO_MASK:
            bias = tl.load(bias_ptr + offs_n).to(tl.float32)
            acc = gelu_math(acc + bias[None, :], True)
        elif BUG == ERF_GELU:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = gelu_math(acc + bias[None, :], False)
        elif BUG == SIGMOID_GELU:
            x = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            acc = x * tl.sigmoid(1.702 * x)
        elif BUG == NO_CUBIC_GELU:   # 0.5 x (1 + tanh(sqrt(2/pi) x)) = x / (1 + exp(-2 sqrt(2/pi) x))
            x = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            acc = x / (1.0 + tl.exp(-2.0 * 0.7978845608028654 * x))
        elif BUG == BIAS_BROADCAST_ROWS:   # the column offsets' bias, broadcast down the rows
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = gelu_math(acc + bias[:, None], True)
        elif BUG == BIAS_MASK_M:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < M, other=0.0).to(tl.float32)
            acc = gelu_math(acc + bias[None, :], True)
        else:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
            if BUG != RES_BEFORE_GELU:   # RES_BEFORE_GELU applies GELU after adding the residual, below
                acc = gelu_math(acc, True)
    if RESIDUAL:
        rows = offs_m[:, None]
        cols = offs_n[None, :]
        mask_r = (rows < M) & (cols < N)
        if BUG == RES_NO_STRIDE:
            stride_rm = N
        if BUG == RES_NO_MASK:
            mask_r = (rows >= 0) & (cols >= 0)
        if BUG == RES_MASK_SWAP:
            mask_r = (rows < N) & (cols < M)
        r = tl.load(r_ptr + rows * stride_rm + cols, mask=mask_r, other=0.0).to(tl.float32)
        acc = acc + r
        if BUG == RES_BEFORE_GELU:
            acc = gelu_math(acc, True)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _launcher(bug, epilogue, launches=1, residual=False):
    def run(a, b, bias=None, r=None):
        M, K = a.shape
        N = b.shape[1]
        c = torch.empty((M, N), dtype=a.dtype, device=a.device)
        grid = (triton.cdiv(M, BLOCK), triton.cdiv(N, BLOCK))
        for _ in range(launches):
            _buggy_linear[grid](a, b, c, bias if bias is not None else c, r if r is not None else c, M, N, K,
                                a.stride(0), a.stride(1), b.stride(0), b.stride(1), N if r is None else r.stride(0),
                                BLOCK_M=BLOCK, BLOCK_N=BLOCK, BLOCK_K=BLOCK, EPILOGUE=epilogue,
                                RESIDUAL=residual, BUG=bug)
        return c

    if residual:
        return lambda x, w, b, r: run(x, w, b, r)
    if epilogue:
        return lambda x, w, b: run(x, w, b)
    return lambda a, b: run(a, b)


FP = (torch.float32,)


def test_correct_kernels_pass(capsys):
    cg.check_matmul(_launcher(OK, False))
    cg.check_linear_gelu(_launcher(OK, True), dtypes=FP)   # float16: the residual check of the solution notebook
    cg.check_linear_gelu_residual(_launcher(OK, True, residual=True), dtypes=FP)
    out = capsys.readouterr().out
    assert out.count("PASS") == 3


def test_the_courses_own_kernels_are_refused_as_the_answer_key():
    from course_utils.kernels import gemm as G
    # reached through getattr, out of sight of the scan of the code: the launch of the course's kernel tells
    for check_fn, fn in ((cg.check_matmul, lambda a, b: getattr(G, "matmul_" + "teaching")(a, b)),
                         (cg.check_linear_gelu, lambda x, w, b: getattr(G, "linear_gelu_" + "teaching")(x, w, b))):
        with pytest.raises(check.CheckFailure, match="course's own kernel"):
            check_fn(fn, dtypes=FP)   # refused by its launches, whatever the dtype


def test_every_exercise_check_refuses_the_course_answers():
    """Exercise 9.1's split-K slice check and 9.2's residual epilogue check refuse the course's launchers
    and tuned ops, reached directly or through a student's function (the fault catalogue in
    faults/gemm.py is only consulted after that)."""
    from course_utils.kernels import gemm as G
    from course_utils.tuned import gemm as T
    with pytest.raises(check.CheckFailure, match="course's own kernel"):
        cg.check_matmul(lambda a, b: getattr(G, "matmul_" + "teaching")(a, b), dtypes=FP, k_slices=SPLITS)
    with pytest.raises(check.CheckFailure, match="tile_matmul"):
        cg.check_matmul(G.tile_matmul, dtypes=FP, k_slices=SPLITS)
    with pytest.raises(check.CheckFailure, match="tuned linear_gelu"):
        cg.check_linear_gelu_residual(lambda x, w, b, r: T.linear_gelu(x, w, b) + r, dtypes=FP)
    with pytest.raises(check.CheckFailure, match="course's own kernel"):
        cg.check_linear_gelu_residual(lambda x, w, b, r: getattr(G, "linear_gelu_" + "teaching")(x, w, b) + r,
                                      dtypes=FP)


@pytest.mark.parametrize("bug, epilogue, dtypes, words", [
    (NO_K_MASK, False, FP, ["K mask"]),
    (NO_K_MASK, True, FP, ["K mask"]),
    (FP16_ACC, False, (torch.float16,), ["overflowed", "float32", "ccumulate"]),   # every run: the overflow case first
    (BIAS_ROWS, True, FP, ["wrong axis"]),
    (GELU_FIRST, True, FP, ["GELU is applied before the bias"]),
    (NO_STRIDES, False, FP, ["transposed", "strides"]),
    (K_MASK_A_ONLY, False, FP, ["K mask", "of b"]),
    (K_MASK_B_ONLY, False, FP, ["K mask", "of a"]),
    (K_MASK_B_ONLY, False, (torch.float16,), ["K mask"]),
    (ERF_GELU, True, FP, ["erf"]),
    (RES_NO_STRIDE, "res", FP, ["row stride"]),
    (RES_BEFORE_GELU, "res", FP, ["residual is added before GELU"]),
    (ERF_GELU, "res", FP, ["erf"]),
    (SIGMOID_GELU, True, FP, ["sigmoid approximation"]),
    (NO_CUBIC_GELU, "res", FP, ["cubic term"]),
    (BIAS_MASK_M, True, FP, ["offs_n < M", "offs_n < N"]),
    (RES_MASK_SWAP, "res", FP, ["swaps M and N"]),
    (BIAS_BROADCAST_ROWS, True, FP, ["bias[:, None]", "fits 32 x 32 tiles"]),
])
def test_wrong_kernels_fail_naming_the_fault(bug, epilogue, dtypes, words):
    fn = _launcher(bug, bool(epilogue), residual=epilogue == "res")
    checker = {"res": cg.check_linear_gelu_residual, True: cg.check_linear_gelu}.get(epilogue, cg.check_matmul)
    with pytest.raises(check.CheckFailure) as e:
        checker(fn, dtypes=dtypes)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_two_launches_fail():
    with pytest.raises(check.CheckFailure, match="expected 1 launch\\(es\\) of your Triton kernel, counted 2"):
        cg.check_matmul(_launcher(OK, False, launches=2), dtypes=FP)


def test_unfinished_exercise_raises_not_implemented():
    def stub(a, b):
        raise NotImplementedError("Exercise 9.1: the tile loop")
    with pytest.raises(NotImplementedError, match="9.1"):
        cg.check_matmul(stub)


def test_wrong_shape_and_written_input_fail():
    with pytest.raises(check.CheckFailure, match="expected a"):
        cg.check_matmul(lambda a, b: torch.zeros(1, 1, device=a.device), dtypes=FP)

    def scribbles(a, b):
        c = _launcher(OK, False)(a, b)
        a.zero_()
        return c
    with pytest.raises(check.CheckFailure, match="changed its input"):
        cg.check_matmul(scribbles, dtypes=FP)


@pytest.mark.parametrize("bug, epilogue, words", [
    (NO_ROW_MASK, False, ["a's load", "offs_m < M"]),
    (NO_COL_MASK, False, ["b's load", "offs_n < N"]),
    (BIAS_NO_MASK, True, ["bias load", "offs_n < N"]),
    (RES_NO_MASK, "res", ["residual load"]),
])
def test_loads_outside_the_operands_fail_naming_the_operand(bug, epilogue, words):
    """Harmless to the answer (the store is masked), so only the recorded loads can tell: interpreter only."""
    if cu.on_gpu():
        pytest.skip("loads are recorded under the interpreter only")
    fn = _launcher(bug, bool(epilogue), residual=epilogue == "res")
    checker = {"res": cg.check_linear_gelu_residual, True: cg.check_linear_gelu}.get(epilogue, cg.check_matmul)
    with pytest.raises(check.CheckFailure, match="outside its operands") as e:
        checker(fn, dtypes=FP)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("bug", [K_MASK_A_ONLY, K_MASK_B_ONLY])
def test_a_k_mask_on_one_operand_fails_every_time_from_the_output_alone(bug, monkeypatch):
    """With the load records switched off (as on a GPU), the NaN guard zones still fail it, every run."""
    import contextlib

    from course_utils.checkers import loads
    monkeypatch.setattr(check, "track_loads", lambda: contextlib.nullcontext(loads.Loads()))
    for _ in range(2):
        with pytest.raises(check.CheckFailure, match="K mask"):
            cg.check_matmul(_launcher(bug, False), dtypes=FP)


@triton.jit
def _tile_loop_calling_the_course(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bk,
                                  stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    return tile_matmul(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                       BLOCK_M, BLOCK_N, BLOCK_K, None)


@triton.jit
def _exercise_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tile_loop_calling_the_course(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bk,
                                        stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _exercise_launcher(a, b):
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    _exercise_kernel[(triton.cdiv(M, BLOCK), triton.cdiv(N, BLOCK))](
        a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        BLOCK_M=BLOCK, BLOCK_N=BLOCK, BLOCK_K=BLOCK)
    return c


def test_exercise_9_1_answered_with_the_lectures_tile_matmul_is_refused():
    """The student's own kernel launches, so only the code it calls shows the course's K loop."""
    with pytest.raises(check.CheckFailure, match="tile_matmul"):
        cg.check_matmul(_exercise_launcher, dtypes=FP)


@pytest.mark.parametrize("fn, name", [
    (lambda a, b: torch.mm(a, b), "torch.mm"),
    (lambda a, b: torch.matmul(a, b), "torch.matmul"),
    (lambda a, b: F.linear(a, b.T), "F.linear"),
    (lambda x, w, b: torch.addmm(b, x, w), "torch.addmm"),
    (lambda x, w, b: G.linear_gelu_teaching(x, w, b), "linear_gelu_teaching"),
    (lambda x, w, b: tuned_gemm.linear_gelu(x, w, b), "linear_gelu"),
    (lambda x, w, b, r: G.linear_gelu_teaching(x, w, b) + r, "linear_gelu_teaching"),
    (lambda x, w, b, r: torch._addmm_activation(b, x, w, use_gelu=True) + r, "_addmm_activation"),
])
def test_torch_and_course_answers_are_refused_by_name(fn, name):
    checker = {2: cg.check_matmul, 3: cg.check_linear_gelu, 4: cg.check_linear_gelu_residual}[fn.__code__.co_argcount]
    with pytest.raises(check.CheckFailure, match=name):
        checker(fn, dtypes=FP)


# ---- the modelling exercises (no kernels: cheap) ----
def _student_prediction(mistake=None):
    """A student's own prediction, written with the traffic model's public functions."""
    from course_utils import bench, traffic
    mistake = mistake or {}

    def predict(m, n, k):
        ops = [traffic.Op("add bias", ("col",)), traffic.Op("gelu") if mistake.get("gelu_1_flop")
               else traffic.Op("gelu", (), 9)]
        if not mistake.get("no_residual"):
            ops.insert(1 if mistake.get("residual_first") else 2,
                       traffic.Op("add residual", (mistake.get("kind", "full"),)))
        comp = traffic.gemm_epilogue(m, n, k, ops, "bfloat16", trailing=mistake.get("trailing", "addmm"))
        if mistake.get("datasheet"):
            mach = traffic.machine("h100-sxm", "bfloat16", launch_us=0.0)
        else:
            ceil = bench.Ceilings.from_frame(bench.recorded("ceilings", gpu="h100-80gb-hbm3"))
            mach = traffic.machine_from_ceilings(ceil, launch_us=None if mistake.get("launches") else 0.0)
        slow = traffic.estimate_time(comp.unfused, mach, "bfloat16").us
        fast = traffic.estimate_time(comp.fused, mach, "bfloat16").us
        saved = comp.unfused.total_bytes - comp.fused.total_bytes
        if mistake.get("sign"):
            saved = comp.fused.total_bytes - comp.unfused.total_bytes
        speedup = {"inverse": fast / slow, "minus1": slow / fast - 1, "percent": (slow / fast - 1) * 100}.get(
            mistake.get("speedup"), slow / fast)
        return saved / mistake.get("unit", 1), speedup
    return predict


def _student_group_m(mistake=None):
    mistake = mistake or {}

    def choose(m, n, k, block_m, block_n, programs):
        best = None
        tiles = (lambda x, b: x // b) if mistake.get("floor") else (lambda x, b: -(-x // b))
        for g in mistake.get("groups", (1, 2, 4, 8, 16, 32, 64)):
            order = G.tile_order(tiles(m, block_m), tiles(n, block_n), g)
            nbytes = 0
            step = len(order) if mistake.get("whole_grid") else programs
            for start in range(0, programs if mistake.get("first_only") else len(order), step):
                wave = order[start:start + step]
                rows = len({pm for pm, _ in wave}) * block_m
                cols = len({pn for _, pn in wave}) * block_n
                nbytes += ((0 if mistake.get("only_b") else rows) + cols) * (1 if mistake.get("no_k") else k) * \
                    mistake.get("itemsize", 2)
            if best is None or nbytes < best[1] or (mistake.get("largest") and nbytes == best[1]):
                best = (g, nbytes)
        if mistake.get("swap"):
            return best[1], best[0]
        return best[0], best[1] / mistake.get("unit", 1)
    return choose
    return choose


def test_modelling_exercises_pass_a_correct_answer(capsys):
    from course_utils.checkers import gemm_model as cm
    cm.check_residual_prediction(_student_prediction())
    cm.check_group_m(_student_group_m())
    assert capsys.readouterr().out.count("PASS") == 2


@pytest.mark.parametrize("mistake, words", [
    ({"trailing": "eager"}, "addmm"), ({"no_residual": True}, "residual is missing"),
    ({"kind": "col"}, "'full'"), ({"datasheet": True}, "measured"), ({"launches": True}, "launch_us=0.0"),
    ({"residual_first": True}, "residual is placed before GELU"), ({"gelu_1_flop": True}, "counts 1 FLOP"),
    ({"trailing": "fused"}, "not one fused elementwise kernel"), ({"speedup": "inverse"}, "not the inverse"),
    ({"sign": True}, "opposite sign"), ({"unit": 1e6}, "not megabytes"), ({"unit": 2**20}, "not MiB"),
    ({"speedup": "minus1"}, "not the fraction of time saved"), ({"speedup": "percent"}, "not a percentage"),
])
def test_prediction_mistakes_are_named(mistake, words):
    from course_utils.checkers import gemm_model as cm
    with pytest.raises(check.CheckFailure, match=words):
        cm.check_residual_prediction(_student_prediction(mistake))


@pytest.mark.parametrize("mistake, words", [
    ({"only_b": True}, "count both operands"), ({"no_k": True}, "multiply by K"), ({"largest": True}, "smallest"),
    ({"first_only": True}, "count every wave"), ({"whole_grid": True}, "shared within a wave"),
    ({"groups": (2, 4, 8, 16, 32, 64)}, "GROUP_M = 1 is a candidate too"),
    ({"groups": (1, 2, 4, 8, 16, 32)}, "go up to GROUP_M = 64"),
    ({"itemsize": 4}, "2 bytes an element"), ({"floor": True}, "ceiling division"), ({"swap": True}, "swapped"),
    ({"unit": 1e6}, "not megabytes"),
])
def test_group_m_mistakes_are_named(mistake, words):
    from course_utils.checkers import gemm_model as cm
    with pytest.raises(check.CheckFailure, match=words):
        cm.check_group_m(_student_group_m(mistake))


def test_modelling_answer_keys_are_refused():
    from course_utils.checkers import gemm_model as cm
    with pytest.raises(check.CheckFailure, match="residual_prediction"):
        cm.check_residual_prediction(lambda m, n, k: cm.residual_prediction(m, n, k))
    with pytest.raises(check.CheckFailure, match="group_choice"):
        cm.check_group_m(lambda m, n, k, bm, bn, p: cm.group_choice(m, n, k, bm, bn, p))


def test_modelling_answer_keys_reached_through_importlib_are_refused():
    """By behaviour: the function object is caught when it is called, whatever name reached it."""
    from course_utils.checkers import gemm_model as cm

    def key(name):
        import importlib
        return getattr(importlib.import_module("course_utils.checkers." + "gemm_model"), name)

    with pytest.raises(check.CheckFailure, match="called reference prediction"):
        cm.check_residual_prediction(lambda m, n, k: key("residual_" + "prediction")(m, n, k))
    with pytest.raises(check.CheckFailure, match="called reference choice"):
        cm.check_group_m(lambda m, n, k, bm, bn, p: key("group_" + "choice")(m, n, k, bm, bn, p))


def test_gelu_flops_are_stated_where_the_student_finds_them():
    from course_utils.checkers import gemm_model as cm
    from course_utils.traffic.matmul import DEFAULT_EPILOGUE
    gelu = [o for o in DEFAULT_EPILOGUE if o.name == "gelu"]
    assert gelu and gelu[0].flops == cm.GELU_FLOPS


# ---- exercise 9.1: the K loop of one split-K slice ----
(SLICE_OK, SLICE_FROM_ZERO, SLICE_PAST_STOP, SLICE_NO_K_MASK, SLICE_REWALK, SLICE_DROP_TAIL, SLICE_ALIGNED,
 SLICE_REWALK_A_MASK, SLICE_REWALK_WHERE, SLICE_NO_K_START, SLICE_MASK_LE, SLICE_A_STRIDES_SWAPPED,
 SLICE_B_STRIDES_SWAPPED, SLICE_ONE_TILE_SHORT) = (tl.constexpr(i) for i in range(14))
SPLITS = 2


@triton.jit
def _slice_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
                  BUG: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_per_split = tl.cdiv(K, SPLITS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        k_start = s * k_per_split
        k_stop = tl.minimum(k_start + k_per_split, K)
        k_first = k_start
        k_end = k_stop
        if BUG == SLICE_FROM_ZERO:
            k_start = 0
            k_first = 0
        if BUG == SLICE_REWALK or BUG == SLICE_REWALK_A_MASK or BUG == SLICE_REWALK_WHERE:
            k_first = 0   # the K tiles before k_start walked again, their terms zeroed: right sums, no work split
        if BUG == SLICE_ALIGNED:   # right: the tiles aligned to BLOCK_K, the first one masked below k_start
            k_first = k_start // BLOCK_K * BLOCK_K
        if BUG == SLICE_DROP_TAIL:   # whole tiles only
            k_end = k_stop - BLOCK_K + 1
        if BUG == SLICE_ONE_TILE_SHORT:   # tl.cdiv(k_stop - k_start, BLOCK_K) - 1 tiles
            k_end = k_start + (tl.cdiv(k_stop - k_start, BLOCK_K) - 1) * BLOCK_K
        if BUG == SLICE_NO_K_START:   # a loop over the slice's length, k_start never added to k
            k_first = 0
            k_end = k_stop - k_start
        for k0 in range(k_first, k_end, BLOCK_K):
            k = k0 + offs_k
            mask_k = (k >= k_start) & (k < k_stop)
            if BUG == SLICE_NO_K_START:
                mask_k = k < k_end
            if BUG == SLICE_MASK_LE:   # off by one: the element at k_stop too
                mask_k = (k >= k_start) & (k <= k_stop)
            if BUG == SLICE_PAST_STOP:
                mask_k = k < K
            if BUG == SLICE_NO_K_MASK:
                mask_k = k >= 0
            mask_a, mask_b = mask_k, mask_k
            if BUG == SLICE_REWALK_A_MASK:   # k >= k_start on a's load only: b's earlier rows loaded, times zeros
                mask_b = k < k_stop
            if BUG == SLICE_REWALK_WHERE:    # both loads masked by k < k_stop alone, a zeroed below k_start after
                mask_a, mask_b = k < k_stop, k < k_stop
            s_am, s_ak = stride_am, stride_ak
            if BUG == SLICE_A_STRIDES_SWAPPED:
                s_am, s_ak = stride_ak, stride_am
            a = tl.load(a_ptr + offs_m[:, None] * s_am + k[None, :] * s_ak,
                        mask=(offs_m[:, None] < M) & mask_a[None, :], other=0.0)
            if BUG == SLICE_REWALK_WHERE:
                a = tl.where((k >= k_start)[None, :], a, 0.0)
            s_bk, s_bn = stride_bk, stride_bn
            if BUG == SLICE_B_STRIDES_SWAPPED:   # B read as if stored transposed
                s_bk, s_bn = stride_bn, stride_bk
            b = tl.load(b_ptr + k[:, None] * s_bk + offs_n[None, :] * s_bn,
                        mask=mask_b[:, None] & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _slice_launcher(bug):
    def run(a, b):
        M, K = a.shape
        N = b.shape[1]
        c = torch.empty((M, N), dtype=a.dtype, device=a.device)
        _slice_kernel[(triton.cdiv(M, BLOCK), triton.cdiv(N, BLOCK))](
            a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            BLOCK_M=BLOCK, BLOCK_N=BLOCK, BLOCK_K=BLOCK, SPLITS=SPLITS, BUG=bug)
        return c
    return run


@pytest.mark.parametrize("variant", [SLICE_OK, SLICE_ALIGNED])
def test_a_correct_slice_loop_passes(variant, capsys):
    cg.check_matmul(_slice_launcher(variant), dtypes=FP, k_slices=SPLITS)
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("bug, words", [
    (SLICE_FROM_ZERO, ["starts at k_start"]),
    (SLICE_PAST_STOP, ["ends at k_stop", "counted twice"]),
    (SLICE_NO_K_MASK, ["k < k_stop"]),
    (SLICE_DROP_TAIL, ["last, partial K tile", "never summed"]),
    pytest.param(SLICE_REWALK, ["every lane masked off", "range(k_start, k_stop, BLOCK_K)"],
                 marks=pytest.mark.skipif(cu.on_gpu(), reason="seen in the loads: interpreter only")),
    # the same re-walk with real loads: the earlier slices' elements are read more often than the last one's
    pytest.param(SLICE_REWALK_A_MASK, ["elements of b in K indices 0 to", "mask on one operand only",
                                       "range(k_start, k_stop, BLOCK_K)"],
                 marks=pytest.mark.skipif(cu.on_gpu(), reason="seen in the loads: interpreter only")),
    pytest.param(SLICE_REWALK_WHERE, ["elements of a in K indices 0 to", "tl.where after the load",
                                      "range(k_start, k_stop, BLOCK_K)"],
                 marks=pytest.mark.skipif(cu.on_gpu(), reason="seen in the loads: interpreter only")),
    (SLICE_NO_K_START, ["K indices start at k_start", "k = k_start + k0 + offs_k"]),
    pytest.param(SLICE_MASK_LE, ["lets k = K through", "k < k_stop, not k <= k_stop"],
                 marks=pytest.mark.skipif(cu.on_gpu(), reason="seen in the loads: interpreter only")),
    pytest.param(SLICE_A_STRIDES_SWAPPED, ["a's two strides are swapped", "offs_m[:, None] * stride_am"],
                 marks=pytest.mark.skipif(cu.on_gpu(), reason="seen in the loads: interpreter only")),
    # named from the output (the first case's b, K x N with N < K, keeps every transposed address inside it)
    (SLICE_B_STRIDES_SWAPPED, ["b's two strides are swapped", "k[:, None] * stride_bk"]),
    (SLICE_ONE_TILE_SHORT, ["one K tile too few", "no - 1"]),
])
def test_slice_loop_faults_are_named(bug, words):
    with pytest.raises(check.CheckFailure) as e:
        cg.check_matmul(_slice_launcher(bug), dtypes=FP, k_slices=SPLITS)
    for w in words:
        assert w in str(e.value), str(e.value)


# ---- exercise 9.2's epilogue on its own: its load masks, judged on a GPU as under the interpreter ----
(EPI_OK, EPI_NO_ROW_MASK, EPI_NO_COL_MASK, EPI_BIAS_NO_MASK, EPI_NO_OTHER, EPI_NO_RESIDUAL, EPI_NO_BIAS,
 EPI_NO_GELU, EPI_RES_TRANSPOSED, EPI_GELU_ROUNDED, EPI_SUM_ROUNDED) = (tl.constexpr(i) for i in range(11))


@triton.jit
def _epilogue_body(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm, BUG: tl.constexpr):
    bias_mask = offs_n < N
    if BUG == EPI_BIAS_NO_MASK:
        bias_mask = offs_n >= 0
    bias = tl.load(bias_ptr + offs_n, mask=bias_mask, other=0.0).to(tl.float32)
    if BUG == EPI_NO_BIAS:
        y = gelu_math(acc, True)
    elif BUG == EPI_NO_GELU:
        y = acc + bias[None, :]
    else:
        y = gelu_math(acc + bias[None, :], True)
    rows = offs_m[:, None] < M
    cols = offs_n[None, :] < N
    if BUG == EPI_NO_ROW_MASK:
        rows = offs_m[:, None] >= 0
    if BUG == EPI_NO_COL_MASK:
        cols = offs_n[None, :] >= 0
    if BUG == EPI_NO_OTHER:   # right: masked lanes left undefined (the store drops them)
        r = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=rows & cols).to(tl.float32)
    elif BUG == EPI_RES_TRANSPOSED:   # the row stride on the columns
        r = tl.load(r_ptr + offs_m[:, None] + offs_n[None, :] * stride_rm, mask=rows & cols, other=0.0).to(tl.float32)
    else:
        r = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=rows & cols,
                    other=0.0).to(tl.float32)
    if BUG == EPI_NO_RESIDUAL:
        return y
    if BUG == EPI_GELU_ROUNDED:   # GELU's output in the residual's dtype, then added: two roundings (every return
        # of a Triton function has one type: back to float32 after the 16-bit sum)
        return (y.to(r_ptr.dtype.element_ty) + r.to(r_ptr.dtype.element_ty)).to(tl.float32)
    if BUG == EPI_SUM_ROUNDED:    # acc + bias rounded to the bias's dtype before GELU
        x = (acc.to(bias_ptr.dtype.element_ty) + bias.to(bias_ptr.dtype.element_ty)[None, :]).to(tl.float32)
        return gelu_math(x, True) + r
    return y + r


@triton.jit
def _epi_ok(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm):
    return _epilogue_body(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm, EPI_OK)


@triton.jit
def _epi_no_other(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm):
    return _epilogue_body(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm, EPI_NO_OTHER)


@triton.jit
def _epi_no_row_mask(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm):
    return _epilogue_body(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm, EPI_NO_ROW_MASK)


@triton.jit
def _epi_no_col_mask(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm):
    return _epilogue_body(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm, EPI_NO_COL_MASK)


@triton.jit
def _epi_bias_no_mask(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm):
    return _epilogue_body(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm, EPI_BIAS_NO_MASK)


@triton.jit
def _epi_no_residual(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm):
    return _epilogue_body(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm, EPI_NO_RESIDUAL)


@triton.jit
def _epi_no_bias(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm):
    return _epilogue_body(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm, EPI_NO_BIAS)


@triton.jit
def _epi_no_gelu(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm):
    return _epilogue_body(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm, EPI_NO_GELU)


@triton.jit
def _epi_res_transposed(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm):
    return _epilogue_body(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm, EPI_RES_TRANSPOSED)


@triton.jit
def _epi_gelu_rounded(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm):
    return _epilogue_body(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm, EPI_GELU_ROUNDED)


@triton.jit
def _epi_sum_rounded(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm):
    return _epilogue_body(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm, EPI_SUM_ROUNDED)


def _epilogue(bug):
    return {EPI_OK: _epi_ok, EPI_NO_OTHER: _epi_no_other, EPI_NO_ROW_MASK: _epi_no_row_mask,
            EPI_NO_COL_MASK: _epi_no_col_mask, EPI_BIAS_NO_MASK: _epi_bias_no_mask,
            EPI_NO_RESIDUAL: _epi_no_residual, EPI_NO_BIAS: _epi_no_bias, EPI_NO_GELU: _epi_no_gelu,
            EPI_RES_TRANSPOSED: _epi_res_transposed, EPI_GELU_ROUNDED: _epi_gelu_rounded,
            EPI_SUM_ROUNDED: _epi_sum_rounded}[bug]


@triton.jit
def _epilogue_kernel(a_ptr, b_ptr, bias_ptr, r_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                     stride_rm, EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tile_matmul(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                      BLOCK_M, BLOCK_N, BLOCK_K, None)
    acc = EPILOGUE(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _epilogue_launcher(epilogue):
    def run(x, w, b, r):
        M, K = x.shape
        N = w.shape[1]
        c = torch.empty((M, N), dtype=x.dtype, device=x.device)
        _epilogue_kernel[(triton.cdiv(M, BLOCK), triton.cdiv(N, BLOCK))](
            x, w, b, r, c, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), r.stride(0),
            EPILOGUE=epilogue, BLOCK_M=BLOCK, BLOCK_N=BLOCK, BLOCK_K=BLOCK)
        return c
    return run


@pytest.mark.parametrize("variant", [EPI_OK, EPI_NO_OTHER])
def test_a_correct_epilogue_passes_its_mask_probe(variant, capsys):
    cg.check_epilogue_masks("epilogue", _epilogue(variant))
    epi = _epilogue(variant)
    cg.check_linear_gelu_residual(_epilogue_launcher(epi), dtypes=FP, epilogue=epi)
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("bug, words", [
    (EPI_NO_ROW_MASK, "residual load is not masked by rows"),
    (EPI_NO_COL_MASK, "residual load is not masked by columns"),
    (EPI_BIAS_NO_MASK, "bias load is not masked by columns"),
])
def test_the_epilogue_probe_names_a_missing_load_mask(bug, words):
    """The probe alone: what a GPU check sees (no loads recorded there), run here under the interpreter too."""
    with pytest.raises(check.CheckFailure, match=words):
        cg.check_epilogue_masks("epilogue", _epilogue(bug))


def test_a_residual_load_without_its_row_mask_fails_the_residual_check():
    """Under the interpreter the loads name it first; on a GPU the probe does."""
    epi = _epilogue(EPI_NO_ROW_MASK)
    with pytest.raises(check.CheckFailure, match="residual load"):
        cg.check_linear_gelu_residual(_epilogue_launcher(epi), dtypes=FP, epilogue=epi)


@pytest.mark.parametrize("bug, words", [
    (EPI_NO_RESIDUAL, ["residual is missing"]),
    (EPI_NO_BIAS, ["bias is missing"]),
    (EPI_NO_GELU, ["GELU is missing"]),
    pytest.param(EPI_RES_TRANSPOSED, ["residual's two strides are swapped", "offs_m[:, None] * stride_rm"],
                 marks=pytest.mark.skipif(cu.on_gpu(), reason="seen in the loads: interpreter only")),
])
def test_epilogue_mistakes_are_named(bug, words):
    """Exercise 9.2's epilogue as a student writes it, in the exercise's kernel: each slip named."""
    epi = _epilogue(bug)
    with pytest.raises(check.CheckFailure) as e:
        cg.check_linear_gelu_residual(_epilogue_launcher(epi), dtypes=FP, epilogue=epi)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("bug", [EPI_GELU_ROUNDED, EPI_SUM_ROUNDED])
def test_an_epilogue_that_rounds_to_16_bits_on_the_way_is_named(bug):
    """In float16 the dtype's tolerance lets one more rounding through: the exact-accumulator case holds the output
    to float32 math rounded once, at the store (the right one passes it in solutions/09's float16 check)."""
    epi = _epilogue(bug)
    with pytest.raises(check.CheckFailure, match="rounded once to float16 .*: part of the epilogue ran in float16"):
        cg.check_linear_gelu_residual(_epilogue_launcher(epi), dtypes=(torch.float16,), epilogue=epi)
