"""Chapter 11's checkers pass a right kernel and fail each usual wrong one with a message naming the fault."""

import pytest
import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils import check
from course_utils.checkers import backward as checks
from course_utils.kernels import attention_backward as AB
from course_utils.kernels.gelu_backward import gelu_grad


@triton.jit
def _delta(o_ptr, do_ptr, delta_ptr, head_dim, o_row_stride, do_row_stride, BLOCK_D: tl.constexpr,
           FAULT: tl.constexpr):
    pid = tl.program_id(0) if FAULT == "int32 row offsets" else tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_D)
    mask = offsets < head_dim
    if FAULT == "no mask":
        mask = offsets < BLOCK_D
    do_stride = o_row_stride if FAULT == "one stride" else do_row_stride
    o_stride = do_row_stride if FAULT == "O at dO's stride" else o_row_stride
    if FAULT == "rows head_dim apart":  # the rows taken as contiguous
        o_stride, do_stride = head_dim, head_dim
    o = tl.load(o_ptr + pid * o_stride + offsets, mask=mask, other=0.0)
    do = tl.load(do_ptr + pid * do_stride + offsets, mask=mask, other=0.0)
    if FAULT != "16-bit products" and FAULT != "16-bit products, float32 sum":
        o, do = o.to(tl.float32), do.to(tl.float32)
    if FAULT == "16-bit products, float32 sum":   # each product rounded to float16, then summed in float32
        tl.store(delta_ptr + pid, tl.sum((o * do).to(tl.float32), axis=0))
    elif FAULT == "mean not sum":
        tl.store(delta_ptr + pid, tl.sum(o * do, axis=0) / head_dim)
    elif FAULT == "O times O":
        tl.store(delta_ptr + pid, tl.sum(o * o, axis=0))
    else:
        tl.store(delta_ptr + pid, tl.sum(o * do, axis=0).to(tl.float32))


def bound(kernel, fault: str):
    """``kernel[grid](...)`` with this fault baked in, as the checkers launch a student's kernel."""
    class Bound:
        def __getitem__(self, grid):
            return lambda *args, **kw: kernel[grid](*args, FAULT=fault, **kw)
    return Bound()


def test_delta_checker_passes_the_right_kernel(capsys):
    checks.check_delta_kernel(bound(_delta, "none"))
    assert capsys.readouterr().out.startswith("PASS ")


@pytest.mark.parametrize("fault, words", [
    ("one stride", "dO read with O's row stride"),
    ("no mask", "differ" if cu.on_gpu() else "outside its inputs"),
    ("16-bit products", "in 16 bits"),
    ("mean not sum", "divided by head_dim"),
    ("O times O", "rowsum\\(O \\* O\\)"),
    ("O at dO's stride", "differ" if cu.on_gpu() else "rows of o 47 elements apart, the value of do_row_stride"),
    ("rows head_dim apart", "rows head_dim elements apart"),
])
def test_delta_checker_fails_wrong_kernels(fault, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_delta_kernel(bound(_delta, fault))


def test_delta_products_rounded_to_16_bits_are_named():
    """16-bit products summed in float32: the 1-element row misses float16's tolerance (named by the diagnosis), the
    longer rows mostly stay inside it and are held to float32's rounding of the sum (next test)."""
    words = "products O \\* dO \\(or their sum\\) were computed in 16 bits, rounded to float16"
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_delta_kernel(bound(_delta, "16-bit products, float32 sum"))


def test_delta_products_rounded_to_16_bits_fail_inside_the_dtypes_tolerance():
    """Rows of 40 to 96 float16 products rounded to float16 mostly pass the dtype's tolerance; the check of the rows'
    rounding refuses them, and passes float32 products of the same numbers summed in float32."""
    from course_utils.checkers.backward import _check_delta_rounding
    for n_rows, head_dim in ((7, 40), (33, 80), (65, 96)):
        o, do = (check.randn((n_rows, head_dim), torch.float16, scale=2.0) for _ in range(2))
        _check_delta_rounding("right", (o.float() * do.float()).sum(-1), o, do)
        with pytest.raises(check.CheckFailure, match="row\\(s\\) of delta are further from the float64 sum than "
                                                     "float32 products and a float32 sum can be"):
            _check_delta_rounding("products rounded", (o * do).float().sum(-1), o, do)


SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _gelu(z):
    a = SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)
    return z / (1.0 + tl.exp(-2.0 * a))


@triton.jit
def _sigmoid_2a(z):  # GELU's tanh form is z * s with s = sigmoid(2a), a = sqrt(2/pi) (z + 0.044715 z^3)
    a = SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)
    return 1.0 / (1.0 + tl.exp(-2.0 * a))


@triton.jit
def _gelu_grad_cubic_slip(z):  # d/dz of 0.044715 z^3 taken as 0.044715 z^2: the factor 3 forgotten
    a = SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)
    s = 1.0 / (1.0 + tl.exp(-2.0 * a))
    return s + z * 2.0 * s * (1.0 - s) * SQRT_2_OVER_PI * (1.0 + 0.044715 * z * z)


@triton.jit
def _gelu_grad_slip(z, FAULT: tl.constexpr):  # s' without the 2 of sigmoid(2a), or s = sigmoid(a)
    a = SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)
    s = 1.0 / (1.0 + tl.exp(-a if FAULT == "sigmoid(a)" else -2.0 * a))
    two = 1.0 if FAULT == "s' without its 2" else 2.0
    rest = 1.0 + s if FAULT == "s' with 1 + s" else 1.0 - s   # the logistic's derivative misremembered
    return s + z * two * s * rest * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * z * z)


@triton.jit
def _gelu_grad_unclamped(z, Z3: tl.constexpr):  # the exercise's formula without its clamp to [-20, 20]
    if Z3:  # z^3 computed once and reused: z * (1 + 3 * 0.044715 z^2) written z + 3 * 0.044715 z^3
        z3 = z * z * z
        a = SQRT_2_OVER_PI * (z + 0.044715 * z3)
        s = 1.0 / (1.0 + tl.exp(-2.0 * a))
        return s + 2.0 * s * (1.0 - s) * SQRT_2_OVER_PI * (z + 3.0 * 0.044715 * z3)
    a = SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)
    s = 1.0 / (1.0 + tl.exp(-2.0 * a))
    return s + z * 2.0 * s * (1.0 - s) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * z * z)


@triton.jit
def _gelu_backward(dy_ptr, x_ptr, bias_ptr, dx_ptr, n_elements, n_cols, p, seed, BLOCK_SIZE: tl.constexpr,
                   FAULT: tl.constexpr):
    pid = tl.program_id(0)
    if FAULT == "int32 offsets":  # wrap past 2**31 elements
        offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    else:
        offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    if FAULT == "bias by row":
        b = tl.load(bias_ptr + offsets // n_cols, mask=mask)
    else:
        b = tl.load(bias_ptr + offsets % n_cols, mask=mask)
    dy = tl.load(dy_ptr + offsets, mask=mask).to(tl.float32)
    if FAULT == "z in 16 bits":  # x + b added in the input dtype, then float32
        x, b = (x + b).to(tl.float32), 0.0
    else:
        x, b = x.to(tl.float32), b.to(tl.float32)
    if FAULT == "no bias":
        b = 0.0 * b
    if FAULT == "sigmoid(a)" or FAULT == "s' without its 2" or FAULT == "s' with 1 + s":
        g = _gelu_grad_slip(tl.minimum(tl.maximum(x + b, -20.0), 20.0), FAULT)
    elif FAULT == "gelu not its derivative":
        g = _gelu(x + b)
    elif FAULT == "erf derivative":
        g = gelu_grad(x + b, False)
    elif FAULT == "s only":  # the product rule's second term, z * s', left out
        g = _sigmoid_2a(x + b)
    elif FAULT == "no clamp" or FAULT == "no clamp, z^3 reused":
        g = _gelu_grad_unclamped(x + b, FAULT == "no clamp, z^3 reused")
    elif FAULT == "cubic without its 3":
        g = _gelu_grad_cubic_slip(tl.minimum(tl.maximum(x + b, -20.0), 20.0))
    else:
        g = gelu_grad(x + b, True)
    if FAULT == "mask repeats every tile":
        r = tl.rand(seed, tl.arange(0, BLOCK_SIZE))
    else:
        r = tl.rand(seed, offsets)
    scale = 1.0 if FAULT == "no rescale" else 1.0 / (1.0 - p)
    if FAULT == "times 1 - p":
        scale = 1.0 - p
    dx = dy * g * scale
    if FAULT == "mask inverted":
        dx = tl.where(r < p, dx, 0.0)
    elif FAULT != "no mask":
        dx = tl.where(r >= p, dx, 0.0)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def make_gelu_backward(fault: str):
    return bound(_gelu_backward, fault)


def test_gelu_backward_checker_passes_the_right_kernel(capsys):
    checks.check_gelu_backward_kernel(make_gelu_backward("none"))
    assert capsys.readouterr().out.startswith("PASS ")


@pytest.mark.parametrize("fault, words", [
    ("gelu not its derivative", "derivative"),
    ("no rescale", "1 / \\(1 - p\\)"),
    ("no mask", "regenerate the forward's mask"),
    ("mask repeats every tile", "same \\(seed, flat offset\\)"),
    ("no bias", "without the bias"),
    ("erf derivative", "erf form"),
    ("s only", "product rule"),
    ("mask inverted", "mask is inverted"),
    ("times 1 - p", "multiplied by 1 - p"),
    ("cubic without its 3", "3 \\* 0.044715"),
    ("bias by row", "bias\\[row\\]"),
    ("sigmoid(a)", "s is sigmoid\\(a\\), not sigmoid\\(2a\\)"),
    ("s' without its 2", "s' lost its factor 2"),
    # a slip no named cause matches: the hint derives gelu' from the forward the exercise gives (it prints no gelu')
    ("s' with 1 + s", "check your gelu'\\(z\\) term by term(.|\n)*product rule(.|\n)*chain rule"),
    ("no clamp", "\\|z\\| up to 1e30(.|\n)*no clamp on z: (.|\n)*z \\* z \\* z is inf"),  # NaN past |z| = 1.84e19
    ("no clamp, z^3 reused", "\\|z\\| up to 1e30(.|\n)*no clamp on z"),  # NaN past |z| = 7e12
    ("z in 16 bits", "float32 math rounded once to float16(.|\n)*the math ran in 16 bits"),
    # 8 GiB on a GPU: run where nothing else holds the card (make test-gpu's serial bigmem run)
    pytest.param("int32 offsets", "past 2\\*\\*31(.|\n)*pid.to\\(tl.int64\\) \\* BLOCK_SIZE", marks=pytest.mark.bigmem),
])
def test_gelu_backward_checker_names_each_fault(fault, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_gelu_backward_kernel(make_gelu_backward(fault))


@triton.jit
def _delta_calls_the_course(o_ptr, do_ptr, delta_ptr, head_dim, o_row_stride, do_row_stride, BLOCK_D: tl.constexpr):
    # the course's preprocess kernel as one head of 2**30 query rows, one row a program: right numbers
    AB.attn_bwd_preprocess_kernel(o_ptr, do_ptr, delta_ptr, 0, 0, o_row_stride, 1, 0, 0, do_row_stride, 1,
                                  1, 2**30, head_dim, 1, BLOCK_D)


@pytest.mark.parametrize("kernel, words", [
    (AB.attn_bwd_preprocess_kernel, "course's own delta kernel"),
    (AB.row_delta, "course's own row_delta"),
    (_delta_calls_the_course, "calls AB.attn_bwd_preprocess_kernel"),
], ids=["kernel", "row_delta", "calls-kernel"])
def test_delta_checker_refuses_the_answer_key(kernel, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_delta_kernel(kernel)


@pytest.mark.skipif(cu.on_gpu(), reason="loads are inspected under the interpreter only")
def test_delta_checker_fails_an_unmasked_load():
    # the row's padded lanes read past the last row (into the guard zone) and are summed with weight 0:
    # right numbers, a load outside the inputs
    with pytest.raises(check.CheckFailure, match="outside its inputs"):
        checks.check_delta_kernel(bound(_delta_unmasked, "none"))


@triton.jit
def _delta_unmasked(o_ptr, do_ptr, delta_ptr, head_dim, o_row_stride, do_row_stride, BLOCK_D: tl.constexpr,
                    FAULT: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_D)
    o = tl.load(o_ptr + pid * o_row_stride + offsets).to(tl.float32)
    do = tl.load(do_ptr + pid * do_row_stride + offsets).to(tl.float32)
    tl.store(delta_ptr + pid, tl.sum(tl.where(offsets < head_dim, o * do, 0.0), axis=0))


# ---- exercise 11.3: the FlashAttention backward, one right pair of kernels with a FAULT each ---------------
@triton.jit
def _scores(q, k, lse, rows, cols, n_q, n_kv, causal_offset, sm_scale, CAUSAL: tl.constexpr, FAULT: tl.constexpr,
            PREC: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if FAULT != "S unscaled":
        s = s * sm_scale
    keep = (rows[:, None] < n_q) & (cols[None, :] < n_kv)
    if CAUSAL:
        if FAULT == "top-left":
            keep = keep & (cols[None, :] <= rows[:, None])
        elif FAULT == "diagonal hidden":
            keep = keep & (cols[None, :] < rows[:, None] + causal_offset)
        elif FAULT == "offset clamped at 0" or FAULT == "offset clamped, lse -inf kept":
            keep = keep & (cols[None, :] <= rows[:, None] + tl.maximum(causal_offset, 0))
        else:
            keep = keep & (cols[None, :] <= rows[:, None] + causal_offset)
    if FAULT != "offset clamped, lse -inf kept":
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
    if FAULT == "exp2 of a natural lse":
        p = tl.math.exp2(s - lse[:, None])
    elif FAULT == "P without lse":
        p = tl.exp(s)
    else:
        p = tl.exp(s - lse[:, None])
    return tl.where(keep, p, 0.0)


@triton.jit
def _grad_scale(sm_scale, FAULT: tl.constexpr):
    if FAULT == "no scale":
        return 1.0
    elif FAULT == "scale twice":
        return sm_scale * sm_scale
    return sm_scale


@triton.jit
def _dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, n_heads, group, n_q, n_kv, head_dim,
          causal_offset, sm_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
          CAUSAL: tl.constexpr, FAULT: tl.constexpr, PREC: tl.constexpr):
    pid_n, pid_bkv = tl.program_id(0), tl.program_id(1)
    n_kv_heads = n_heads // group
    b, h_kv = pid_bkv // n_kv_heads, pid_bkv % n_kv_heads
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    kv_mask = (cols[:, None] < n_kv) & (offs_d[None, :] < head_dim)
    kv_offs = pid_bkv.to(tl.int64) * n_kv * head_dim + cols[:, None] * head_dim + offs_d[None, :]
    k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    n_group = 1 if FAULT == "one q head of the group" else group
    for g in range(n_group):
        h = h_kv * group + g
        stat_head = b * n_heads + (h_kv if FAULT == "lse of the k/v head" else h)
        row0 = (b * n_heads + h).to(tl.int64) * n_q
        for start_m in range(0, n_q, BLOCK_M):
            rows = start_m + offs_m
            mask = (rows[:, None] < n_q) & (offs_d[None, :] < head_dim)
            offs = (row0 + rows[:, None]) * head_dim + offs_d[None, :]
            q = tl.load(q_ptr + offs, mask=mask, other=0.0)
            do = tl.load(do_ptr + offs, mask=mask, other=0.0)
            if FAULT == "lse unmasked in the dK/dV pass":  # padded rows read past lse: P is 0 there all the same
                lse = tl.load(lse_ptr + stat_head.to(tl.int64) * n_q + rows)
            else:
                lse = tl.load(lse_ptr + stat_head.to(tl.int64) * n_q + rows, mask=rows < n_q, other=0.0)
            delta = tl.load(delta_ptr + stat_head.to(tl.int64) * n_q + rows, mask=rows < n_q, other=0.0)
            p = _scores(q, k, lse, rows, cols, n_q, n_kv, causal_offset, sm_scale,
                        CAUSAL and FAULT != "no causal mask in the dK/dV pass", FAULT, PREC)
            if FAULT == "16-bit P":  # P rounded through float16 on its way to the products
                p = p.to(tl.float16).to(tl.float32)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * dp if FAULT == "no delta" else p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
    dk = dk * _grad_scale(sm_scale, FAULT)
    if FAULT == "dK and dV swapped":
        dk, dv = dv, dk
    tl.store(dk_ptr + kv_offs, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, n_heads, group, n_q, n_kv, head_dim,
        causal_offset, sm_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        CAUSAL: tl.constexpr, FAULT: tl.constexpr, PREC: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // n_heads, pid_bh % n_heads
    h_kv = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_q) & (offs_d[None, :] < head_dim)
    offs = pid_bh.to(tl.int64) * n_q * head_dim + rows[:, None] * head_dim + offs_d[None, :]
    if FAULT == "dQ pass rows unmasked":  # padded rows read past q and do: never stored all the same
        q = tl.load(q_ptr + offs)
        do = tl.load(do_ptr + offs)
    else:
        q = tl.load(q_ptr + offs, mask=mask, other=0.0)
        do = tl.load(do_ptr + offs, mask=mask, other=0.0)
    stat_head = b * n_heads + (h_kv if FAULT == "lse of the k/v head" else h)
    lse = tl.load(lse_ptr + stat_head.to(tl.int64) * n_q + rows, mask=rows < n_q, other=0.0)
    delta = tl.load(delta_ptr + stat_head.to(tl.int64) * n_q + rows, mask=rows < n_q, other=0.0)
    kv_head = (b * (n_heads // group) + (h if FAULT == "dQ reads k/v head h" else h_kv)).to(tl.int64) * n_kv * head_dim
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if FAULT == "dQ accumulated in the inputs' dtype":
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=dq_ptr.dtype.element_ty)
    end_n = n_kv  # the key tiles a causal query tile sees: keys < (pid_m + 1) * BLOCK_M + causal_offset
    if CAUSAL and FAULT == "causal tile skip":
        end_n = tl.minimum(n_kv, (pid_m + 1) * BLOCK_M + causal_offset)
    if CAUSAL and FAULT == "causal tile skip off by one":
        end_n = tl.minimum(n_kv, (pid_m + 1) * BLOCK_M + causal_offset - 1)
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < n_kv) & (offs_d[None, :] < head_dim)
        k = tl.load(k_ptr + kv_head + cols[:, None] * head_dim + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_head + cols[:, None] * head_dim + offs_d[None, :], mask=kv_mask, other=0.0)
        if FAULT == "top-left in the dQ pass":   # the dK/dV pass right, the dQ pass's mask top-left
            p = _scores(q, k, lse, rows, cols, n_q, n_kv, causal_offset, sm_scale, CAUSAL, "top-left", PREC)
        elif FAULT == "no causal mask in the dQ pass":
            p = _scores(q, k, lse, rows, cols, n_q, n_kv, causal_offset, sm_scale, False, FAULT, PREC)
        else:
            p = _scores(q, k, lse, rows, cols, n_q, n_kv, causal_offset, sm_scale, CAUSAL, FAULT, PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * dp if FAULT == "no delta" else p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC).to(dq.dtype)
    dq = dq * _grad_scale(sm_scale, FAULT)
    if FAULT == "rows with no key not written":
        mask = mask & (rows[:, None] + causal_offset >= 0)
    tl.store(dq_ptr + offs, dq.to(dq_ptr.dtype.element_ty), mask=mask)


def make_flash_backward(fault: str):
    """A student's launcher: 11.1's delta kernel, then the dK/dV and the dQ pass, with ``fault`` baked in."""
    def flash_backward(q, k, v, o, lse, do, causal=False, sm_scale=None, dq=None, dk=None, dv=None):
        B, H, N, D = q.shape
        H_kv, N_kv = k.shape[1], k.shape[2]
        scale = D ** -0.5 if sm_scale is None else sm_scale
        dq, dk, dv = (torch.empty_like(t) if out is None else out for t, out in ((q, dq), (k, dk), (v, dv)))
        delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
        block_d = max(16, triton.next_power_of_2(D))
        _delta[(B * H * N,)](o, do, delta, D, D, D, BLOCK_D=block_d, FAULT="none")
        args = (H, H // H_kv, N, N_kv, D, N_kv - N, scale)
        meta = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=block_d, CAUSAL=causal, FAULT=fault,
                    PREC="tf32" if fault == "TF32 dots" else "ieee")
        _dkdv[(triton.cdiv(N_kv, 16), B * H_kv)](q, k, v, do, lse, delta, dk, dv, *args, **meta)
        _dq[(triton.cdiv(N, 16), B * H)](q, k, v, do, lse, delta, dq, *args, **meta)
        return dq, dk, dv
    return flash_backward


@pytest.mark.parametrize("variant", ["none", "causal tile skip"])
def test_flash_backward_checker_passes_the_right_kernels(variant, capsys):
    checks.check_flash_backward(make_flash_backward(variant))
    assert capsys.readouterr().out.startswith("PASS ")


@pytest.mark.parametrize("fault, words", [
    ("no delta", "dS without the D term"),
    ("no scale", "misses the softmax scale"),
    ("scale twice", "softmax scale twice"),
    ("S unscaled", "no softmax scale in S"),
    ("one q head of the group", "one q head's share"),
    ("top-left", "top-left causal mask"),
    # right when n_kv >= n_q, top-left when n_q > n_kv: caught on the case with more queries than keys
    ("offset clamped at 0", f"x {checks.ATTN_CASES[3][4]} keys(.|\n)*top-left causal mask"),
    ("offset clamped, lse -inf kept", "see no key"),
    ("rows with no key not written", "never stored"),  # their dQ is 0, and must be stored: the outputs start as NaN
    ("exp2 of a natural lse", "wrong base"),
    ("lse of the k/v head", "wrong row"),
    ("16-bit P", "precision loss"),
    ("dK and dV swapped", "dK and dV are swapped"),
    # wrong when n_kv - n_q = 1 (mod BLOCK_N): the last key a query tile sees starts a tile
    ("causal tile skip off by one", f"q 1x2x{checks.ATTN_CASES[4][3]}x(.|\n)*key loop stops one tile early"),
    ("dQ accumulated in the inputs' dtype", "dQ's sum over the key tiles lost precision"),
    ("no causal mask in the dK/dV pass", "matches P recomputed with no causal mask"),
    ("diagonal hidden", "hides the diagonal"),
    ("P without lse", "without subtracting lse"),
    pytest.param("dQ reads k/v head h", "q head h reads k/v head h // group", marks=pytest.mark.skipif(
        cu.on_gpu(), reason="loads are inspected under the interpreter only")),
    pytest.param("dQ pass rows unmasked", "loaded .* outside q",
                 marks=pytest.mark.skipif(cu.on_gpu(), reason="loads are inspected under the interpreter only")),
    pytest.param("lse unmasked in the dK/dV pass", "loaded .* outside lse",
                 marks=pytest.mark.skipif(cu.on_gpu(), reason="loads are inspected under the interpreter only")),
])
def test_flash_backward_checker_names_each_fault(fault, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_flash_backward(make_flash_backward(fault))


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="TF32 exists on a GPU only")
def test_flash_backward_checker_names_tf32_dots():
    # float32 inputs through tl.dot's GPU default (TF32): close, not float32-accurate
    with pytest.raises(check.CheckFailure, match="precision loss(.|\n)*input_precision=DOT_PRECISION"):
        checks.check_flash_backward(make_flash_backward("TF32 dots"))


@triton.jit
def _dq_borrowing(q_ptr, k_ptr, lse_ptr, n_q, n_kv, sm_scale, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    q = tl.load(q_ptr + offs[:, None] * BLOCK + offs[None, :])
    k = tl.load(k_ptr + offs[:, None] * BLOCK + offs[None, :])
    lse = tl.load(lse_ptr + offs)
    p = AB.recompute_p(q, k, lse, offs, offs, n_q, n_kv, 0, sm_scale, False, "ieee")
    tl.store(q_ptr + offs[:, None] * BLOCK + offs[None, :], p)


def _calls_the_course(q, k, v, o, lse, do, causal=False, sm_scale=None):
    return AB.flash_attention_backward_teaching(q, k, v, o, lse, do, causal=causal, sm_scale=sm_scale)


def _autograd_through_torch(q, k, v, o, lse, do, causal=False, sm_scale=None):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    with torch.enable_grad():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=sm_scale)
        return torch.autograd.grad(out, (q, k, v), do)


def _borrows_recompute_p(q, k, v, o, lse, do, causal=False, sm_scale=None):
    _dq_borrowing[(1,)](q, k, lse, q.shape[2], k.shape[2], 1.0, BLOCK=16)
    return q, k, v


def _math_in_torch(q, k, v, o, lse, do, causal=False, sm_scale=None):
    from course_utils.checkers.backward import attention_grads64 as grads
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return tuple(t.to(q.dtype) for t in grads(q, k, v, do, causal, scale)[2:5])


@pytest.mark.parametrize("fn, words", [
    (_calls_the_course, "course's FlashAttention backward"),
    (_autograd_through_torch, "torch.autograd.grad"),
    (_borrows_recompute_p, "P recomputation"),
    (_math_in_torch, "ran in torch"),
], ids=["course backward", "torch.autograd", "course P in a kernel", "torch math"])
def test_flash_backward_checker_refuses_answers_it_did_not_write(fn, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_flash_backward(fn)


@triton.jit
def _own_gelu_grad(z):
    z = tl.minimum(tl.maximum(z, -20.0), 20.0)
    a = SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)
    s = 1.0 / (1.0 + tl.exp(-2.0 * a))
    return s + z * 2.0 * s * (1.0 - s) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * z * z)


@triton.jit
def _gelu_backward_unmasked_loads(dy_ptr, x_ptr, bias_ptr, dx_ptr, n_elements, n_cols, p, seed,
                                  BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    z = tl.load(x_ptr + offsets).to(tl.float32) + tl.load(bias_ptr + offsets % n_cols).to(tl.float32)
    dy = tl.load(dy_ptr + offsets).to(tl.float32)
    dx = tl.where(tl.rand(seed, offsets) >= p, dy * _own_gelu_grad(z) / (1.0 - p), 0.0)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)  # masked store only


@triton.jit
def _gelu_backward_borrowing(dy_ptr, x_ptr, bias_ptr, dx_ptr, n_elements, n_cols, p, seed, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    z = tl.load(x_ptr + offsets, mask=mask, other=0.0) + tl.load(bias_ptr + offsets % n_cols, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0)
    dx = tl.where(tl.rand(seed, offsets) >= p, dy * gelu_grad(z.to(tl.float32), True) / (1.0 - p), 0.0)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def test_gelu_backward_checker_refuses_the_course_derivative():
    # exercise 11.2 is the derivative: a kernel that calls the course's gelu_grad did not write it
    with pytest.raises(check.CheckFailure, match="calls gelu_grad, the course's GELU derivative"):
        checks.check_gelu_backward_kernel(_gelu_backward_borrowing)


def test_gelu_backward_huge_z_has_a_finite_answer_the_course_kernel_gives():
    # the 11.2 check's huge case: float32 cubes overflow from the third value on, the first two do not; the
    # float64 answer there is exactly 1 or 0 (finite), and the course's clamped kernel gives exactly dy or 0
    from course_utils.checkers.gelu_backward import HUGE_Z, _gelu_grad64
    from course_utils.kernels.gelu_backward import bias_gelu_backward_teaching
    z32 = torch.tensor(HUGE_Z, dtype=torch.float32, device=cu.DEVICE)
    assert torch.isfinite(z32[:2] ** 3).all() and torch.isinf(z32[2:] * z32[2:] * z32[2:]).all()
    assert torch.isinf(z32[-3:] * z32[-3:]).all()   # z * z overflows too at the last three
    x = torch.cat([z32, -z32]).reshape(2, -1)
    grad = _gelu_grad64(x)
    assert torch.equal(grad, torch.tensor([1.0, 0.0], dtype=torch.float64, device=cu.DEVICE)[:, None].expand_as(x))
    dy = check.randn(x.shape)
    dx, _ = bias_gelu_backward_teaching(dy, x, torch.zeros(x.shape[1], device=cu.DEVICE))
    assert torch.equal(dx.double(), dy.double() * grad)


@pytest.mark.skipif(cu.on_gpu(), reason="loads are inspected under the interpreter only")
def test_gelu_backward_checker_fails_unmasked_loads():
    with pytest.raises(check.CheckFailure, match="outside its inputs"):
        checks.check_gelu_backward_kernel(_gelu_backward_unmasked_loads)


def test_the_checkers_float64_reference_is_autograds():
    # the checker's textbook formulas against torch autograd through the course's reference attention
    g = check.generator()
    q, do = (torch.randn(2, 4, 9, 16, generator=g, dtype=torch.float64, device=cu.DEVICE) for _ in range(2))
    k, v = (torch.randn(2, 2, 14, 16, generator=g, dtype=torch.float64, device=cu.DEVICE) for _ in range(2))
    for causal in (False, True):
        got = checks.attention_grads64(q, k, v, do, causal, 0.3)[2:5]
        want = AB.attention_backward_ref(q, k, v, do, causal=causal, sm_scale=0.3)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)



@triton.jit
def _program_ids(out_ptr, first):
    pid = tl.program_id(0)
    tl.store(out_ptr + 2 * (pid - first), pid)
    tl.store(out_ptr + 2 * (pid - first) + 1, tl.num_programs(0))


@pytest.mark.skipif(cu.on_gpu(), reason="the interpreter runs a grid's last programs only")
def test_the_last_programs_of_a_long_grid_run_with_their_own_ids():
    # the 2**31 case of 11.2 runs the last 3 of millions of programs: each sees its own id and the whole grid
    from course_utils.checkers import offsets64
    n = 9_000_000
    out = torch.full((6,), -1, dtype=torch.int32)
    assert offsets64.launch_last_programs(_program_ids, n, 3, (out, n - 3), {})
    assert out.tolist() == [n - 3, n, n - 2, n, n - 1, n]


def test_the_wide_case_refuses_the_course_kernel_itself():
    """offsets64 launches whatever kernel it is given: the course's own is refused there too."""
    from course_utils import check as C
    from course_utils.checkers import offsets64
    from course_utils.kernels import gelu_backward
    with pytest.raises(C.CheckFailure):
        offsets64.launch_last_programs(gelu_backward.bias_gelu_backward_kernel, 4, 1, (), {})


def test_delta_int32_row_offsets_fail_past_2_31_elements():
    """The case 11.1's check ends with, on its own (the right kernel passes it in the whole check above)."""
    from course_utils.checkers.backward import _delta_past_2_31
    with pytest.raises(check.CheckFailure, match="past 2\\*\\*31(.|\n)*pid.to\\(tl.int64\\) \\* o_row_stride"):
        _delta_past_2_31(bound(_delta, "int32 row offsets"), "delta", "")


@pytest.mark.parametrize("fault, words", [
    ("top-left in the dQ pass", "dK and dV are right, and matches P recomputed with a top-left causal mask(.|\n)*"
                                "in the dQ pass only"),
    ("no causal mask in the dQ pass", "matches P recomputed with no causal mask(.|\n)*in the dQ pass only"),
])
def test_a_mask_wrong_in_the_dq_pass_alone_is_named(fault, words, monkeypatch):
    """The dK/dV pass right, the dQ pass's P masked wrong: named as the dQ pass's P (was "P is right"). The check's
    causal cases only (the first of them fails), to keep the test short."""
    from course_utils.checkers import flash_backward as fb
    monkeypatch.setattr(fb, "ATTN_CASES", tuple(c for c in fb.ATTN_CASES if c[6]))
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_flash_backward(make_flash_backward(fault))
