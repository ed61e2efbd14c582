"""Chapter 12's checker passes a right cross-entropy backward kernel, refuses the course's own, and
fails each usual wrong one with a message naming the fault."""

import pytest
import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils import check
from course_utils.checkers import training as checks
from course_utils.kernels import cross_entropy as K


@triton.jit
def _ce_bwd(dlogits_ptr, logits_ptr, targets_ptr, lse_ptr, dloss_ptr, n_cols, row_stride, d_row_stride, inv_n_rows,
            BLOCK_SIZE: tl.constexpr, FAULT: tl.constexpr):
    pid = tl.program_id(0)
    in_stride = row_stride
    if FAULT == "rows n_cols apart":
        in_stride = n_cols
    out_stride = d_row_stride
    if FAULT == "one stride":
        out_stride = row_stride
    if FAULT == "int32 row offsets":  # wrap past 2**31 elements
        row = logits_ptr + pid * in_stride
        d_row = dlogits_ptr + pid * out_stride
    else:
        row = logits_ptr + pid.to(tl.int64) * in_stride
        d_row = dlogits_ptr + pid.to(tl.int64) * out_stride
    offsets = tl.arange(0, BLOCK_SIZE)
    lse = tl.load(lse_ptr + pid)
    if FAULT == "lse of row 0":  # the row's offset forgotten for lse_ptr
        lse = tl.load(lse_ptr)
    if FAULT == "lse recomputed" or FAULT == "lse recomputed without the max":  # the saved lse ignored
        m = tl.full((BLOCK_SIZE,), -float("inf"), tl.float32)
        if FAULT == "lse recomputed":
            for start in tl.range(0, n_cols, BLOCK_SIZE):
                cols = start + offsets
                m = tl.maximum(m, tl.load(row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32))
        row_max = tl.maximum(tl.max(m, axis=0), 0.0)  # 0 without the max
        total = tl.zeros((BLOCK_SIZE,), tl.float32)
        for start in tl.range(0, n_cols, BLOCK_SIZE):
            cols = start + offsets
            x = tl.load(row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
            total += tl.exp(x - row_max)
        lse = row_max + tl.log(tl.sum(total, axis=0))
    if FAULT == "max not lse":
        m = tl.full((BLOCK_SIZE,), -float("inf"), tl.float32)
        for start in tl.range(0, n_cols, BLOCK_SIZE):
            cols = start + offsets
            m = tl.maximum(m, tl.load(row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32))
        lse = tl.max(m, axis=0)
    target = tl.load(targets_ptr + pid)
    if FAULT == "target of row 0":  # the row's offset forgotten for targets_ptr
        target = tl.load(targets_ptr)
    dloss = tl.load(dloss_ptr)
    if FAULT == "no dloss":
        dloss = dloss * 0.0 + 1.0
    scale = dloss * inv_n_rows
    if FAULT == "no inv_n_rows":
        scale = dloss
    if FAULT == "inv_n_rows twice":  # the mean taken again: inv_n_rows * inv_n_rows
        scale = scale * inv_n_rows
    if FAULT == "dloss twice":  # dloss * dloss * inv_n_rows
        scale = scale * dloss
    n_tiles = tl.cdiv(n_cols, BLOCK_SIZE)
    if FAULT == "one tile":
        n_tiles = 1
    for tile in tl.range(0, n_tiles):
        cols = tile * BLOCK_SIZE + offsets
        mask = cols < n_cols
        if FAULT == "mask on offsets":  # the tile's lanes compared with n_cols, not its columns
            mask = offsets < n_cols
        if FAULT == "no load mask":
            x = tl.load(row + cols).to(tl.float32)
        else:
            x = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
        hit = cols == target
        if FAULT == "offsets not cols":
            hit = offsets == target
        if FAULT == "target - 1":   # 1-based thinking
            hit = cols == target - 1
        if FAULT == "target + 1":
            hit = cols == target + 1
        if FAULT == "flat target":  # the target taken as a flat index into the (rows x vocab) matrix
            hit = pid * n_cols + cols == target
        onehot = tl.where(hit, 1.0, 0.0)
        if FAULT == "no onehot":
            onehot = onehot * 0.0
        if FAULT == "plus onehot":
            onehot = -onehot
        d = (tl.exp(x - lse) - onehot) * scale
        if FAULT == "log-softmax":  # the exp forgotten: x - lse is log p
            d = (x - lse - onehot) * scale
        if FAULT == "exp2":  # exp2 without the log2(e) factor
            d = (tl.exp2(x - lse) - onehot) * scale
        if FAULT == "exp over exp":  # softmax as exp(x) / exp(lse): both overflow float32 past 88.7
            d = (tl.exp(x) / tl.exp(lse) - onehot) * scale
        if FAULT == "onehot after the scale":
            d = tl.exp(x - lse) * scale - onehot
        if FAULT == "target apart":  # a right variant: the target's column rewritten after the loop
            d = tl.exp(x - lse) * scale
        if FAULT == "no store mask":
            tl.store(d_row + cols, d.to(dlogits_ptr.dtype.element_ty))
        elif FAULT == "target apart":   # the target's column left to the store below: two stores to one
            # address from a program's different threads have no order on a GPU (an H200 kept the loop's 0)
            tl.store(d_row + cols, d.to(dlogits_ptr.dtype.element_ty), mask=mask & (cols != target))
        else:
            tl.store(d_row + cols, d.to(dlogits_ptr.dtype.element_ty), mask=mask)
    if FAULT == "target apart":  # reads one logit of the row twice: still one pass over the row
        x_t = tl.load(row + target).to(tl.float32)
        tl.store(d_row + target, ((tl.exp(x_t - lse) - 1.0) * scale).to(dlogits_ptr.dtype.element_ty))


def bound(fault: str):
    """``kernel[grid](...)`` with this fault baked in, as the checker launches a student's kernel."""
    class Bound:
        def __getitem__(self, grid):
            return lambda *args, **kw: _ce_bwd[grid](*args, FAULT=fault, **kw)
    return Bound()


@pytest.mark.parametrize("variant", ["none", "target apart"])
def test_right_kernel_passes(variant, capsys):
    checks.check_ce_backward_kernel(bound(variant))
    assert capsys.readouterr().out.startswith("PASS cross-entropy backward kernel")


@pytest.mark.parametrize("fault, words", [
    ("no onehot", "no one-hot"),
    ("plus onehot", "added instead of subtracted"),
    ("onehot after the scale", "one-hot subtracted after the scaling"),
    ("offsets not cols", "only in the first tile"),
    ("target - 1", r"one-hot at target - 1"),
    ("target + 1", r"one-hot at target \+ 1"),
    ("max not lse", "not normalized by lse"),
    ("no dloss", "missing the factor dloss"),
    ("no inv_n_rows", "missing the factor inv_n_rows"),
    ("one tile", r"only the first \d+ columns"),   # the launcher's BLOCK_SIZE is 32 interpreted, 128 on a GPU
    pytest.param("no load mask", "outside its inputs",
                 marks=pytest.mark.skipif(cu.on_gpu(), reason="loads are inspected under the interpreter only")),
    ("no store mask", "wrote"),
    ("inv_n_rows twice", r"the factor inv_n_rows twice \(the mean over rows taken twice\)"),
    ("dloss twice", "the factor dloss twice"),
    ("exp over exp", r"softmax as exp\(x\) / exp\(lse\): .*inf / inf = NaN"),
    ("flat target", r"target compared with a flat index: .*compare cols == target"),
    # a GPU records no loads: there the unmasked stores of the last tile are what fails
    ("mask on offsets", "wrote" if cu.on_gpu() else r"outside its inputs(.|\n)*a mask on the lanes alone "
                                                      r"\(offsets < n_cols\) is true on every lane"),
    ("rows n_cols apart", "row_stride apart"),
    ("one stride", "between the rows of dlogits"),
    pytest.param("int32 row offsets", r"never wrote the last row(.|\n)*pid.to\(tl.int64\) \* row_stride",
                 marks=pytest.mark.bigmem),  # 8 GiB on a GPU: make test-gpu's serial bigmem run
    ("lse recomputed", "recomputes the row's logsumexp"),
    ("lse recomputed without the max", "without subtracting the row's max(.|\n)*overflows"),
    ("log-softmax", r"log-softmax, not softmax: .*tl.exp\(x - lse\)"),
    ("exp2", r"exp2 without the factor log2\(e\): .*2\*\*\(x - lse\), not e\*\*\(x - lse\)"),
    ("lse of row 0", r"the first row's lse in every row: .*tl.load\(lse_ptr \+ pid\)"),
    ("target of row 0", r"the first row's target in every row: .*tl.load\(targets_ptr \+ pid\)"),
])
def test_wrong_kernels_fail_naming_the_fault(fault, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_ce_backward_kernel(bound(fault))


def test_the_courses_kernel_is_refused():
    with pytest.raises(check.CheckFailure, match="course's own"):
        checks.check_ce_backward_kernel(K.cross_entropy_bwd_kernel)


@triton.jit
def _calls_the_courses(dlogits_ptr, logits_ptr, targets_ptr, lse_ptr, dloss_ptr, n_cols, row_stride, d_row_stride,
                       inv_n_rows, BLOCK_SIZE: tl.constexpr):
    K.cross_entropy_bwd_kernel(dlogits_ptr, logits_ptr, targets_ptr, lse_ptr, dloss_ptr, n_cols, row_stride,
                               d_row_stride, inv_n_rows, BLOCK_SIZE, 1)


def test_a_kernel_that_calls_the_courses_inside_is_refused():
    with pytest.raises(check.CheckFailure, match="K.cross_entropy_bwd_kernel, the course's cross-entropy backward"):
        checks.check_ce_backward_kernel(_calls_the_courses)


def test_an_untouched_stub_fails():
    class Stub:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                raise NotImplementedError("Exercise 12.1: replace this line with your code")
            return launch
    with pytest.raises(NotImplementedError):
        checks.check_ce_backward_kernel(Stub())


def _launcher(fault: str = "none", inv=None, dtype=None, row_stride=None, cap=4096, grid=None):
    def ce_backward(dloss, logits, targets, lse):
        n_rows, n_cols = logits.shape
        dlogits = torch.empty(logits.shape, dtype=dtype or logits.dtype, device=logits.device)
        stride = logits.stride(0) if row_stride is None else row_stride(logits)
        launch = _ce_bwd[(n_rows,) if grid is None else grid(logits)]
        launch(dlogits, logits, targets, lse, dloss, n_cols, stride, dlogits.stride(0),
               1.0 / n_rows if inv is None else inv(logits) if callable(inv) else inv,
               BLOCK_SIZE=min(cap, triton.next_power_of_2(n_cols)), FAULT=fault)
        return dlogits
    return ce_backward


def test_right_launcher_passes(capsys):
    checks.check_ce_backward_launcher(_launcher())
    assert capsys.readouterr().out.startswith("PASS cross-entropy backward launcher")


def test_launcher_faults_are_named():
    with pytest.raises(check.CheckFailure, match=r"n_rows\) times too large"):
        checks.check_ce_backward_launcher(_launcher(inv=1.0))            # the mean's 1 / n_rows forgotten
    with pytest.raises(check.CheckFailure, match=r"1.5 times the right one"):
        checks.check_ce_backward_launcher(_launcher(inv=0.5))            # some other wrong scale (3 rows)
    # n_rows / n_cols of the first shape tried: 3 / 300 on the CPU, 3 / 50257 on a GPU
    with pytest.raises(check.CheckFailure, match=r"(0.01|5.969e-05) times the right one(.|\n)*not over the vocabulary"):
        checks.check_ce_backward_launcher(_launcher(inv=lambda logits: 1.0 / logits.shape[1]))   # 1 / n_cols
    with pytest.raises(check.CheckFailure, match=r"rows 0 to 0 are right(.|\n)*one program per row"):
        checks.check_ce_backward_launcher(_launcher(grid=lambda logits: (1,)))       # one program, not n_rows
    with pytest.raises(check.CheckFailure, match=r"inv_n_rows is 0: 1 // n_rows is integer division"):
        checks.check_ce_backward_launcher(_launcher(inv=lambda logits: 1 // logits.shape[0]))

    def dloss_in_the_scale_too(dloss, logits, targets, lse):   # the kernel multiplies by dloss already
        return _launcher(inv=float(dloss) / logits.shape[0])(dloss, logits, targets, lse)
    with pytest.raises(check.CheckFailure, match=r"times the right one: dloss applied twice"):
        checks.check_ce_backward_launcher(dloss_in_the_scale_too)
    with pytest.raises(check.CheckFailure, match="the logits' dtype"):
        checks.check_ce_backward_launcher(_launcher(dtype=torch.float64))

    with pytest.raises(check.CheckFailure, match="column slice(.|\n)*logits.stride\\(0\\)"):
        checks.check_ce_backward_launcher(_launcher(row_stride=lambda logits: logits.shape[1]))  # contiguous assumed
    # the tile of the widest row tried: 8192 on the CPU's shapes, 65536 on the GPU's (a vocabulary of 50257)
    with pytest.raises(check.CheckFailure, match="BLOCK_SIZE=(8192|65536) .* caps it at 4096"):
        checks.check_ce_backward_launcher(_launcher(cap=1 << 30))                   # the stated cap dropped
    if not cu.on_gpu():  # loads are inspected under the interpreter only
        with pytest.raises(check.CheckFailure, match="recomputes the row's logsumexp"):
            checks.check_ce_backward_launcher(_launcher("lse recomputed"))

    def in_torch(dloss, logits, targets, lse):
        p = torch.softmax(logits.float(), -1)
        p[torch.arange(len(targets)), targets] -= 1
        return (p * dloss / len(targets)).to(logits.dtype)
    with pytest.raises(check.CheckFailure, match="ran in torch"):
        checks.check_ce_backward_launcher(in_torch)

    def the_courses(dloss, logits, targets, lse):
        return K.cross_entropy_backward_teaching(dloss, logits, targets, lse)
    with pytest.raises(check.CheckFailure, match="course's cross-entropy backward launcher"):
        checks.check_ce_backward_launcher(the_courses)


def test_a_launcher_that_writes_into_the_logits_is_named():
    def in_place(dloss, logits, targets, lse):
        n_rows, n_cols = logits.shape
        _ce_bwd[(n_rows,)](logits, logits, targets, lse, dloss, n_cols, logits.stride(0), logits.stride(0),
                           1.0 / n_rows, BLOCK_SIZE=triton.next_power_of_2(n_cols), FAULT="none")
        return logits
    with pytest.raises(check.CheckFailure, match="wrote into the logits"):
        checks.check_ce_backward_launcher(in_place)


def test_every_row_has_a_gradient_to_judge():
    # an outlier at a row's target made its gradient ~0, right under any scale: at row 0 a wrong scale passed it and
    # was named a short launch; at a later row a short launch's unwritten zeros passed it, and went unnamed. 64 rows
    # a draw: an outlier lands at some row's target and outweighs the row in about one draw in five without the fix
    for _ in range(50):
        _, logits, targets, lse, _ = checks._inputs(64, 300, torch.float32, False)
        p = torch.softmax(logits.double(), dim=-1)
        right = p[torch.arange(64), targets]
        assert bool((1.0 - right > 0.5).all()), (targets, right)
