"""The chapter 3-4 checkers pass right kernels and fail the usual wrong ones (under the interpreter too)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils.check import CheckFailure
from course_utils.checkers import elementwise as chk
from course_utils.kernels import elementwise as ew
from course_utils.tuned import elementwise as TE

BLOCK = 1024  # smaller than check.GUARD: an unmasked store lands in a guard zone, not in foreign memory


@triton.jit
def _gelu_tanh(x):
    """The tests' own tanh-GELU (sigmoid form): a student's helper, not the course's gelu_math."""
    a = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x / (1.0 + tl.exp(-2.0 * a))


# --------------------------------------------------------------------------- vector add

@triton.jit
def _add_variant(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    if MODE == 1:    # no mask on the store
        tl.store(out_ptr + offsets, x + y)
    elif MODE == 2:  # subtracts
        tl.store(out_ptr + offsets, x - y, mask=mask)
    else:
        tl.store(out_ptr + offsets, x + y, mask=mask)


def _add_launcher(mode, floor_grid=False):
    def add(x, y, out=None):
        out = torch.empty_like(x) if out is None else out
        n = x.numel()
        grid = (n // BLOCK,) if floor_grid else (triton.cdiv(n, BLOCK),)
        if grid[0] > 0:
            _add_variant[grid](x, y, out, n, BLOCK_SIZE=BLOCK, MODE=mode)
        return out
    return add


def test_vector_add_checker_passes_the_right_kernel(capsys):
    chk.check_vector_add(_add_launcher(0))
    assert capsys.readouterr().out.startswith("PASS vector add")


@triton.jit
def _add_no_load_mask(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) + tl.load(y_ptr + offsets), mask=mask)


def _launch_no_load_mask(x, y, out=None):
    out = torch.empty_like(x) if out is None else out
    _add_no_load_mask[(triton.cdiv(x.numel(), BLOCK),)](x, y, out, x.numel(), BLOCK_SIZE=BLOCK)
    return out


@pytest.mark.skipif(cu.on_gpu(), reason="loads are inspected under the interpreter only")
def test_vector_add_checker_fails_a_missing_load_mask():
    with pytest.raises(CheckFailure, match="outside its inputs"):
        chk.check_vector_add(_launch_no_load_mask)


@pytest.mark.parametrize("answer, words", [
    (lambda x, y, out=None: torch.add(x, y, out=out), "ran in torch .aten.add"),
    (lambda x, y, out=None: TE.add(x, y), "the course's"),
])
def test_vector_add_checker_fails_the_answer_key(answer, words):
    with pytest.raises(CheckFailure, match=words):
        chk.check_vector_add(answer)


@pytest.mark.parametrize("mode, floor_grid, words", [(1, False, "outside its buffer"), (2, False, "differ"),
                                                      (0, True, "NaN")])
def test_vector_add_checker_fails_wrong_kernels(mode, floor_grid, words):
    with pytest.raises(CheckFailure, match=words):
        chk.check_vector_add(_add_launcher(mode, floor_grid))


def test_vector_add_checker_fails_the_untouched_stub():
    def add(x, y, out=None):
        raise NotImplementedError("Exercise 3.1")
    with pytest.raises(NotImplementedError):
        chk.check_vector_add(add)


def test_n_programs_checker():
    chk.check_n_programs(lambda n, b: triton.cdiv(n, b))
    with pytest.raises(CheckFailure, match="drops the partial last tile"):
        chk.check_n_programs(lambda n, b: n // b)
    with pytest.raises(CheckFailure, match="int"):
        chk.check_n_programs(lambda n, b: n / b)
    with pytest.raises(CheckFailure, match="one program too many when n_elements is a multiple"):
        chk.check_n_programs(lambda n, b: n // b + 1)
    with pytest.raises(CheckFailure, match="one program too many when n_elements is a multiple"):
        chk.check_n_programs(lambda n, b: (n + b) // b)


@pytest.mark.parametrize("wrong, words", [
    (lambda n, b: (triton.cdiv(n, b),), "the launch wraps it in the grid tuple"),
    (lambda n, b: max(1, triton.cdiv(n, b)), "no elements no program is needed"),
    (lambda n, b: torch.tensor(triton.cdiv(n, b)), "count is right but a Tensor: return a Python int"),
])
def test_n_programs_checker_names_the_fault(wrong, words):
    with pytest.raises(CheckFailure, match=words):
        chk.check_n_programs(wrong)


@triton.jit
def _add_stub(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    raise NotImplementedError("Exercise 3.2: masked vector add: replace this line with your code")


def test_vector_add_checker_says_the_untouched_kernel_stub_is_not_done():
    def add(x, y, out=None):  # the exercise's own launcher around the kernel's untouched stub
        out = torch.empty_like(x) if out is None else out
        _add_stub[(triton.cdiv(x.numel(), BLOCK),)](x, y, out, x.numel(), BLOCK_SIZE=BLOCK)
        return out
    with pytest.raises(NotImplementedError, match="add_kernel still raises NotImplementedError"):
        chk.check_vector_add(add)


# --------------------------------------------------------------------------- GELU

@triton.jit
def _gelu_variant(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    a = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    if MODE == 6:    # the cubic term outside the sqrt(2/pi) factor
        a = 0.7978845608028654 * x + 0.044715 * x * x * x
    if MODE == 1:    # the naive tanh: e^(2a) overflows to inf, inf / inf = NaN
        e = tl.exp(2.0 * a)
        t = (e - 1.0) / (e + 1.0)
    elif MODE == 2:  # exact erf GELU where the tanh approximation was asked for
        t = tl.math.erf(x * 0.7071067811865476)
    elif MODE == 5:  # tanh(|a|): the sign of a lost
        w = tl.exp(-2.0 * tl.abs(a))
        t = (1.0 - w) / (1.0 + w)
    else:
        w = tl.exp(-2.0 * tl.abs(a))  # the stable tanh a student writes: exp of a non-positive number
        t = tl.where(a < 0, -1.0, 1.0) * (1.0 - w) / (1.0 + w)
    y = 0.5 * x * (1.0 + t)
    if MODE == 4:    # the factors cast back to the input dtype before the product: a second rounding
        y = x.to(x_ptr.dtype.element_ty) * (0.5 * (1.0 + t)).to(x_ptr.dtype.element_ty)
    if MODE == 3:    # no mask on the store
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty))
    else:
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def _gelu_launcher(mode, extra_op=False):
    def gelu(x, out=None):
        out = torch.empty_like(x) if out is None else out
        _gelu_variant[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), BLOCK_SIZE=BLOCK, MODE=mode)
        if extra_op:
            out.mul_(1.0)  # numerically harmless, but a second kernel
        return out
    return gelu


@triton.jit
def _gelu_forms(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr, SIGMOID: tl.constexpr, LOAD_MASK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    if LOAD_MASK:
        x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    else:
        x = tl.load(x_ptr + offsets).to(tl.float32)
    a = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    if SIGMOID:  # x * sigmoid(2a): the same function, accurate where GELU is tiny
        y = x / (1.0 + tl.exp(-2.0 * tl.minimum(tl.maximum(a, -40.0), 40.0)))
    else:
        t = tl.exp(-2.0 * tl.abs(a))
        th = (1.0 - t) / (1.0 + t)
        y = 0.5 * x * (1.0 + tl.where(a < 0, -th, th))
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def _gelu_form(sigmoid, load_mask=True):
    def gelu(x, out=None):
        out = torch.empty_like(x) if out is None else out
        _gelu_forms[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), BLOCK_SIZE=BLOCK, SIGMOID=sigmoid,
                                                      LOAD_MASK=load_mask)
        return out
    return gelu


def test_gelu_checker_passes_the_right_kernel(capsys):
    chk.check_gelu(_gelu_launcher(0))
    chk.check_gelu(_gelu_form(sigmoid=True))   # issue 18 item 17: the sigmoid form is allowed
    chk.check_gelu(_gelu_form(sigmoid=False))
    assert "PASS fused GELU" in capsys.readouterr().out


@pytest.mark.skipif(cu.on_gpu(), reason="loads are inspected under the interpreter only")
def test_gelu_checker_fails_a_missing_load_mask():
    with pytest.raises(CheckFailure, match="outside its inputs"):
        chk.check_gelu(_gelu_form(sigmoid=True, load_mask=False))


@pytest.mark.parametrize("answer, words", [
    (lambda x, out=None: torch.nn.functional.gelu(x, approximate="tanh"), "ran in torch .aten.gelu"),
    (lambda x, out=None: TE.gelu(x), "the course's"),
])
def test_gelu_checker_fails_the_answer_key(answer, words):
    with pytest.raises(CheckFailure, match=words):
        chk.check_gelu(answer)


@pytest.mark.parametrize("mode, extra_op, words", [
    (1, False, "NaN exactly where .a. is large(.|\n)*exp\\(2a\\) is inf in float32"),
    (2, False, "exact GELU, x . Phi.x. with erf"),
    (3, False, "outside its buffer"),
    (0, True, "ran in torch"),
    (4, False, "rounded once"),
    (5, False, "tanh\\(.a.\\): the sign of a is lost"),
    (6, False, "cubic term sits outside the sqrt\\(2/pi\\) factor"),
])
def test_gelu_checker_fails_wrong_kernels(mode, extra_op, words):
    with pytest.raises(CheckFailure, match=words) as e:
        chk.check_gelu(_gelu_launcher(mode, extra_op))
    assert "does the grid cover every element" not in str(e.value)   # the overflow is named, not a grid fault


def test_gelu_checker_fails_eager_gelu():
    with pytest.raises(CheckFailure):
        chk.check_gelu(lambda x: ew.gelu_ref(x.float()).to(x.dtype))


# --------------------------------------------------------------------------- the chain

@triton.jit
def _chain_variant(x_ptr, b_ptr, y_ptr, n_elements, n_cols, scale, BLOCK_SIZE: tl.constexpr,
                   MODE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    if MODE == 3:    # wrong stride: the row index instead of the column index
        cols = (offsets // n_cols) % n_cols
    else:
        cols = offsets % n_cols
    x = tl.load(x_ptr + offsets, mask=mask)
    b = tl.load(b_ptr + cols, mask=mask)
    if MODE == 4:    # x + bias added in the input dtype, then float32: rounded twice in fp16
        z = (x + b).to(tl.float32)
    else:
        z = x.to(tl.float32) + b.to(tl.float32)
    if MODE == 1:    # bias after the GELU
        y = (_gelu_tanh(x.to(tl.float32)) + b.to(tl.float32)) * scale
    elif MODE == 2:  # forgot the scale
        y = _gelu_tanh(z)
    elif MODE == 5:  # the GELU stored in the input dtype before the scale
        y = _gelu_tanh(z).to(y_ptr.dtype.element_ty) * scale
    else:
        y = _gelu_tanh(z) * scale
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def _chain_launcher(mode, kernel=None):
    kernel = kernel or _chain_variant

    def chain(x, bias, scale, out=None):
        out = torch.empty_like(x) if out is None else out
        n = x.numel()
        kernel[(triton.cdiv(n, BLOCK),)](x, bias, out, n, x.shape[-1], scale, BLOCK_SIZE=BLOCK, MODE=mode)
        return out
    return chain


def test_chain_checker_passes_the_right_kernel(capsys):
    chk.check_bias_gelu_scale(_chain_launcher(0))
    assert "PASS bias + GELU + scale" in capsys.readouterr().out


@pytest.mark.parametrize("mode, words", [(1, "bias is added after the GELU"), (2, "scale is missing"),
                                         (3, "bias is indexed by the row"),
                                         (4, "rounded once"), (5, "rounded once")])
def test_chain_checker_fails_wrong_kernels(mode, words):
    with pytest.raises(CheckFailure, match=words):
        chk.check_bias_gelu_scale(_chain_launcher(mode))


def test_chain_checker_fails_the_eager_chain():
    def eager(x, b, s):  # right numbers (up to rounding between ops), three kernels
        return torch.nn.functional.gelu(x + b, approximate="tanh") * s
    with pytest.raises(CheckFailure, match="ran in torch|differ"):
        chk.check_bias_gelu_scale(eager)


# --------------------------------------------------------------------------- dropout

@triton.jit
def _dropout_variant(x_ptr, b_ptr, y_ptr, n_elements, n_cols, p, seed, BLOCK_SIZE: tl.constexpr,
                     MODE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    b = tl.load(b_ptr + offsets % n_cols, mask=mask)
    if MODE == 6:    # x + bias added in the input dtype: rounded twice in fp16
        y = _gelu_tanh((x + b).to(tl.float32))
    else:
        y = _gelu_tanh(x.to(tl.float32) + b.to(tl.float32))
    if MODE == 3:    # one random number per program
        r = tl.rand(seed, pid + tl.zeros([BLOCK_SIZE], dtype=tl.int32))
    elif MODE == 4:  # ignores the seed
        r = tl.rand(12345, offsets)
    elif MODE == 5:  # the same numbers in every tile (issue 18 item 13)
        r = tl.rand(seed, tl.arange(0, BLOCK_SIZE))
    else:
        r = tl.rand(seed, offsets)
    if MODE == 1:    # no rescaling of the kept elements
        y = tl.where(r >= p, y, 0.0)
    elif MODE == 2:  # keeps with probability p instead of 1 - p
        y = tl.where(r < p, y / (1.0 - p), 0.0)
    else:
        y = tl.where(r >= p, y / (1.0 - p), 0.0)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def _dropout_launcher(mode, kernel=None):
    kernel = kernel or _dropout_variant

    def dropout(x, bias, p, seed, out=None):
        out = torch.empty_like(x) if out is None else out
        n = x.numel()
        kernel[(triton.cdiv(n, BLOCK),)](x, bias, out, n, x.shape[-1], p, seed, BLOCK_SIZE=BLOCK, MODE=mode)
        return out
    return dropout


def test_dropout_checker_passes_the_right_kernel(capsys):
    chk.check_bias_gelu_dropout(_dropout_launcher(0))
    assert "PASS bias + GELU + dropout" in capsys.readouterr().out


@pytest.mark.parametrize("mode, words", [(1, "unscaled"), (2, "kept"), (3, "neighbouring"), (4, "seeds"),
                                         (5, "repeats every 1024 elements"), (6, "rounded once")])
def test_dropout_checker_fails_wrong_kernels(mode, words):
    with pytest.raises(CheckFailure, match=words):
        chk.check_bias_gelu_dropout(_dropout_launcher(mode))


def test_dropout_checker_fails_torch_dropout():
    """torch's dropout is right in distribution, but it is not a function of the seed passed in."""
    def eager(x, b, p, seed):
        return torch.nn.functional.dropout(torch.nn.functional.gelu(x + b, approximate="tanh"), p)
    with pytest.raises(CheckFailure):
        chk.check_bias_gelu_dropout(eager)


def test_course_kernels_are_the_answer_key_not_an_answer():
    with pytest.raises(CheckFailure, match="the course's"):
        chk.check_bias_gelu_dropout(lambda x, b, p, seed, out=None: TE.bias_gelu_dropout(x, b, p, seed))


def test_the_interpreter_load_hook_is_as_assumed():
    from course_utils.checkers import loads
    assert loads.problem() == "", loads.problem()


def test_checkers_work_in_this_mode():
    assert cu.MODE in ("cuda", "interpreter")


# --------------------------------------------------------------------------- the answer-key rule

@triton.jit
def _gelu_with_the_course_math(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(y_ptr + offsets, ew.gelu_math(x, True).to(y_ptr.dtype.element_ty), mask=mask)  # the answer


def _gelu_launcher_calling_gelu_math(x):
    y = torch.empty_like(x)
    _gelu_with_the_course_math[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), BLOCK_SIZE=BLOCK)
    return y


@pytest.mark.parametrize("checker,answer", [
    (chk.check_vector_add, ew.add_teaching), (chk.check_vector_add, ew.add_ref),
    (chk.check_gelu, ew.gelu_teaching), (chk.check_gelu, ew.gelu_ref),
    (chk.check_gelu, _gelu_launcher_calling_gelu_math),          # the course's gelu_math inside your kernel
    (chk.check_bias_gelu_scale, ew.bias_gelu_scale_teaching),
    (chk.check_bias_gelu_dropout, ew.bias_gelu_dropout_teaching),
], ids=["add_teaching", "add_ref", "gelu_teaching", "gelu_ref", "gelu_math", "bias_gelu_scale", "dropout"])
def test_the_course_answer_is_refused(checker, answer):
    with pytest.raises(CheckFailure, match="course"):
        checker(answer)


def test_the_tuned_shelf_is_refused_too():
    from course_utils.tuned import elementwise as tuned
    with pytest.raises(CheckFailure, match="tuned.elementwise.gelu"):
        chk.check_gelu(lambda x: tuned.gelu(x))


# --------------------------------------------------------------------------- more usual mistakes, each named

@triton.jit
def _add_more(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr):
    if MODE == 1:    # forgot pid * BLOCK_SIZE: every program adds the first tile
        offsets = tl.arange(0, BLOCK_SIZE)
    else:
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets <= n_elements if MODE == 2 else offsets < n_elements    # 2: off by one
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store((x_ptr if MODE == 3 else out_ptr) + offsets, x + y, mask=mask)  # 3: into x


def _add_more_launcher(mode):
    def add(x, y, out=None):
        out = torch.empty_like(x) if out is None else out
        _add_more[(triton.cdiv(x.numel(), BLOCK),)](x, y, out, x.numel(), BLOCK_SIZE=BLOCK, MODE=mode)
        return x if mode == 3 else out
    return add


@pytest.mark.parametrize("mode, words", [
    (1, "NaN"),
    (2, "outside its inputs" if not cu.on_gpu() else None),
    (3, "changed its input"),
])
def test_vector_add_checker_fails_more_wrong_kernels(mode, words):
    if words is None:
        pytest.skip("loads are inspected under the interpreter only")
    with pytest.raises(CheckFailure, match=words):
        chk.check_vector_add(_add_more_launcher(mode))


@pytest.mark.parametrize("wrong, words", [
    (lambda n, b: round(n / b), "drops the partial last tile"),
    (lambda n, b: __import__("numpy").ceil(n / b), "return an int"),
])
def test_n_programs_checker_names_more_faults(wrong, words):
    with pytest.raises(CheckFailure, match=words):
        chk.check_n_programs(wrong)


@triton.jit
def _gelu_more(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    if MODE != 4:    # 4: the math in the input dtype
        x = x.to(tl.float32)
    if MODE == 3:    # x^2 where the cubic term is
        a = 0.7978845608028654 * (x + 0.044715 * x * x)
    else:
        a = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    a = tl.minimum(tl.maximum(a, -40.0), 40.0)
    if MODE == 1:    # the tanh form's 0.5 kept in the sigmoid form
        y = 0.5 * x / (1.0 + tl.exp(-2.0 * a))
    elif MODE == 2:  # x * sigmoid(a) instead of x * sigmoid(2a)
        y = x / (1.0 + tl.exp(-a))
    else:   # exp in float32 (newer Tritons refuse it in fp16), rounded back to a's dtype
        y = x / (1.0 + tl.exp((-2.0 * a).to(tl.float32)).to(a.dtype))
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def _gelu_more_launcher(mode):
    def gelu(x, out=None):
        out = torch.empty_like(x) if out is None else out
        _gelu_more[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), BLOCK_SIZE=BLOCK, MODE=mode)
        return out
    return gelu


@pytest.mark.parametrize("mode, words", [(1, "half of GELU"), (2, "that is x . sigmoid.a."),
                                         (3, "0.044715 x.3, not x.2"), (4, "rounded once")])
def test_gelu_checker_names_more_wrong_kernels(mode, words):
    with pytest.raises(CheckFailure, match=words):
        chk.check_gelu(_gelu_more_launcher(mode))


@triton.jit
def _quick_gelu(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = x / (1.0 + tl.exp(-1.702 * x))   # x * sigmoid(1.702 x), not the tanh form
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def test_gelu_checker_names_the_quick_gelu():
    """Refused before with no hint: x * sigmoid(1.702 x) is another approximation, not the tanh form asked for."""
    def gelu(x, out=None):
        out = torch.empty_like(x) if out is None else out
        _quick_gelu[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), BLOCK_SIZE=BLOCK)
        return out
    with pytest.raises(CheckFailure, match="sigmoid approximation x . sigmoid.1.702 x."):
        chk.check_gelu(gelu)


@triton.jit
def _chain_more(x_ptr, b_ptr, y_ptr, n_elements, n_cols, scale, BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    if MODE == 1:    # the bias indexed by the flat offset, its load masked
        b = tl.load(b_ptr + offsets, mask=mask).to(tl.float32)
    elif MODE == 4:  # right: offsets % n_cols is always inside the bias, a mask is not needed
        b = tl.load(b_ptr + offsets % n_cols).to(tl.float32)
    else:
        b = tl.load(b_ptr + offsets % n_cols, mask=mask).to(tl.float32)
    if MODE == 2:    # the scale inside the GELU
        y = _gelu_tanh((x + b) * scale)
    elif MODE == 3:  # divides by the scale
        y = _gelu_tanh(x + b) / scale
    else:
        y = _gelu_tanh(x + b) * scale
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def _chain_more_launcher(mode):
    return _chain_launcher(mode, _chain_more)


@pytest.mark.parametrize("mode, words", [(1, "past the end of bias" if not cu.on_gpu() else None),
                                         (2, "scale is applied before the GELU"), (3, "divided by scale")])
def test_chain_checker_names_more_wrong_kernels(mode, words):
    if words is None:
        pytest.skip("loads are inspected under the interpreter only")
    with pytest.raises(CheckFailure, match=words):
        chk.check_bias_gelu_scale(_chain_more_launcher(mode))


def test_chain_checker_passes_an_unmasked_bias_load_that_stays_inside(capsys):
    chk.check_bias_gelu_scale(_chain_more_launcher(4))
    assert "PASS bias + GELU + scale" in capsys.readouterr().out


@triton.jit
def _dropout_more(x_ptr, b_ptr, y_ptr, n_elements, n_cols, p, seed, BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offsets % n_cols, mask=mask).to(tl.float32)
    y = _gelu_tanh(x + b)
    if MODE == 3:    # a seed per program and the tile's own lanes: random enough, not the mask asked for
        r = tl.rand(seed + pid, tl.arange(0, BLOCK_SIZE))
    else:
        r = tl.rand(seed, offsets)
    if MODE == 1:    # divides the kept elements by p
        y = tl.where(r >= p, y / p, 0.0)
    elif MODE == 2:  # multiplies them by 1 - p
        y = tl.where(r >= p, y * (1.0 - p), 0.0)
    else:
        y = tl.where(r >= p, y / (1.0 - p), 0.0)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def _dropout_more_launcher(mode):
    return _dropout_launcher(mode, _dropout_more)


@pytest.mark.parametrize("mode, words", [(1, "divided it by p"), (2, "multiplied it by .1 - p."),
                                         (3, "tl.rand.seed, offsets. >= p")])
def test_dropout_checker_names_more_wrong_kernels(mode, words):
    with pytest.raises(CheckFailure, match=words):
        chk.check_bias_gelu_dropout(_dropout_more_launcher(mode))
