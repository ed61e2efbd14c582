"""Checks for chapter 12 (the whole training step).

:func:`check_ce_backward_kernel` launches a student's cross-entropy backward kernel as the course's
operator launches its own::

    kernel[(n_rows,)](dlogits_ptr, logits_ptr, targets_ptr, lse_ptr, dloss_ptr, n_cols,
                      row_stride, d_row_stride, inv_n_rows, BLOCK_SIZE=...)

and compares ``dlogits = (exp(logits - lse) - onehot(target)) * dloss * inv_n_rows`` with float64.
Every call draws fresh inputs: rows around a large offset (``exp(logits)`` without ``lse``
overflows), targets in the first tile, in later tiles and in the last column, rows read through a
row stride wider than the row (its gap holds huge values), an output with its own row stride, a
BLOCK_SIZE much shorter than the row (the row takes several tiles), outputs poisoned with NaN inside
guard zones. The kernel must use the lse it is given: one case passes an lse that is not the rows'
own logsumexp, and under the interpreter each logit may be read once (a kernel that recomputes the
row's max and sum reads it three times). A last case puts the third row 2**31 elements into the
logits, where ``pid * row_stride`` in int32 wraps. A wrong answer is matched against the usual faults,
each named.

:func:`check_ce_backward_launcher` calls ``fn(dloss, logits, targets, lse)`` on contiguous logits and on
a column slice of wider ones (rows ``logits.stride(0)`` apart), with rows longer than the 4096 the
launcher's BLOCK_SIZE is capped at.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .. import check, env
from ..checker_texts.cross_entropy_backward import FAULTS, FLOAT32_EXP_MAX, HINT, RECOMPUTED  # noqa: F401
from ..faults.cross_entropy_backward import _candidates, _diagnose
from ..profile import triton_launch_hook
from . import offsets64
from .loads import LOADS_SEEN, reads_per_element

OFFSET = 60.0          # exp(60) and up overflow float16 and, summed over a row with outliers, float32
GAP = 5                # extra columns between rows of the logits (and 3 between rows of dlogits)
BLOCK_CAP = 4096       # the largest BLOCK_SIZE exercise 12.2 lets its launcher pick


def _block() -> int:
    return env.pick(gpu=128, cpu=32)


def _shapes():
    return env.pick(gpu=((1, 1), (7, 100), (33, 1000), (5, 5003)), cpu=((1, 1), (3, 37), (4, 101)))


def _inputs(n_rows, n_cols, dtype, strided: bool):
    """logits (n_rows, n_cols) in a guarded buffer (row stride n_cols + GAP when strided), targets that
    visit the first column, the last one and later tiles, the float32 logsumexp, dloss."""
    stride = n_cols + (GAP if strided else 0)
    full = check.randn((n_rows, stride), dtype, scale=3.0, offset=OFFSET, outliers=0.05, outlier_scale=200.0)
    targets = torch.randint(0, n_cols, (n_rows,), generator=check.generator(), device=full.device)
    targets[0] = n_cols - 1
    if n_rows > 1:
        targets[1] = 0
    # every target's logit stays ordinary: an outlier there makes the row's softmax one-hot at its target, its
    # gradient ~0, and a row of zeros is "right" under any scale: a wrong inv_n_rows was named a short launch when
    # row 0's was; a launch of one program went unnamed when a later row's was and its unwritten memory held zeros
    rows = torch.arange(n_rows, device=full.device)
    full[rows, targets] = check.randn((n_rows,), dtype, scale=3.0, offset=OFFSET, device=full.device)
    if strided:
        full[:, n_cols:] = torch.where(torch.rand(n_rows, GAP, device=full.device) < 0.5, 3e4, -3e4).to(dtype)
    g = check.guarded_copy(full)
    logits = g.tensor[:, :n_cols]
    lse = torch.logsumexp(logits.double(), dim=-1).float()
    # the upstream gradient, in [1.25, 1.75): never near 1, where a kernel that forgets dloss would pass and a
    # missing inv_n_rows would look like a missing dloss * inv_n_rows
    dloss = 1.25 + 0.5 * torch.rand((1,), generator=check.generator(logits.device), device=logits.device)
    return g, logits, targets, lse, dloss


def _launch(kernel, dlogits, logits, targets, lse, dloss, block, case):
    try:
        kernel[(logits.shape[0],)](dlogits, logits, targets, lse, dloss, logits.shape[1], logits.stride(0),
                                   dlogits.stride(0), 1.0 / logits.shape[0], BLOCK_SIZE=block)
    except (NotImplementedError, check.CheckFailure):
        raise
    except Exception as e:
        raise check.CheckFailure(f"{case}: your kernel raised {type(e).__name__}: {str(e)[:400]}\nIt is launched "
                                 "as kernel[(n_rows,)](dlogits_ptr, logits_ptr, targets_ptr, lse_ptr, dloss_ptr, "
                                 "n_cols, row_stride, d_row_stride, inv_n_rows, BLOCK_SIZE=...).") from e


def _refuse(kernel, what):
    from ..kernels import cross_entropy as K
    forbidden = {"cross-entropy backward kernel": K.cross_entropy_bwd_kernel,
                 "cross-entropy backward launcher": K.cross_entropy_backward_teaching}
    for fn in (kernel, getattr(kernel, "fn", None)):  # the kernel, and the body of a @triton.jit one
        check.refuse_answer_key(what, fn, forbidden)
    module = getattr(getattr(kernel, "fn", None), "__module__", "") or ""
    if module.startswith("course_utils"):
        raise check.CheckFailure(f"{what}: this is the course's own kernel ({module}): write yours.")


def _reads(case, loads, logits) -> tuple[str, float, int]:
    """(case, how many times the kernel read each logit, n_cols): 0 reads where nothing was recorded (a GPU)."""
    return case, (reads_per_element(loads, logits) if loads.active else 0.0), logits.shape[1]


def _check_reads(reads: list[tuple[str, float, int]]) -> None:
    """Each logit read once (and the target's once more, for a kernel that treats that column apart), judged
    after every value was right: a wrong value says more."""
    for case, r, n_cols in reads:
        if r > 1.0 + 1.0 / n_cols:
            raise check.CheckFailure(f"{case}: {RECOMPUTED}. Your kernel read each logit {r:.2g} times.")


def _one_case(kernel, name, dtype, n_rows, n_cols, strided, block, shift_lse=False):
    case = (f"{name} ({str(dtype).removeprefix('torch.')}, {n_rows} rows x {n_cols} cols, BLOCK_SIZE={block}"
            f"{', rows ' + str(n_cols + GAP) + ' apart' if strided else ''}"
            f"{', an lse that is not the rows own logsumexp' if shift_lse else ''})")
    g, logits, targets, lse, dloss = _inputs(n_rows, n_cols, dtype, strided)
    own_lse = None
    if shift_lse:  # dlogits = exp(logits - lse) with the lse given, whatever it is
        own_lse, lse = lse, lse + torch.rand(lse.shape, generator=check.generator(), device=lse.device) + 0.5
    before = logits.clone()
    d_gap = 3 if strided else 0
    out = check.Guarded((n_rows, n_cols + d_gap), dtype)
    gap_before = out.tensor[:, n_cols:].clone()
    dlogits = out.tensor[:, :n_cols]
    with check.track_loads() as loads:
        _launch(kernel, dlogits, logits, targets, lse, dloss, block, case)
    try:
        check.check_loads_inside(case, loads, [logits, targets, lse, dloss])
    except check.CheckFailure as e:
        raise check.CheckFailure(f"{e}\nHere a tile's mask is cols < n_cols with cols = start + tl.arange(0, "
                                 "BLOCK_SIZE): a mask on the lanes alone (offsets < n_cols) is true on every lane of "
                                 "every tile once the row is longer than BLOCK_SIZE.") from None
    if not torch.equal(out.tensor[:, n_cols:].isnan(), gap_before.isnan()) or \
            not torch.equal(out.tensor[:, n_cols:].nan_to_num(), gap_before.nan_to_num()):
        raise check.CheckFailure(f"{case}: your kernel wrote between the rows of dlogits: row pid starts at "
                                 "dlogits_ptr + pid * d_row_stride (not row_stride, not n_cols), and every "
                                 "tl.store needs mask=cols < n_cols.")
    out.check(case, HINT)
    g.check(f"{case}, the logits' buffer")
    if not torch.equal(logits, before):
        raise check.CheckFailure(f"{case}: your kernel changed the logits; it must only write dlogits")
    scale = float(dloss) / n_rows
    cands = _candidates(logits, targets, lse, block, own_lse, scale)
    got = dlogits.detach().double().cpu() / scale
    atol, rtol = check.tolerance(dtype)
    if not bool(torch.isclose(got, cands["right"], atol=atol, rtol=rtol, equal_nan=False).all()):
        _diagnose(case, dlogits, cands, scale, n_cols, block, dtype)
        hint = HINT + (" Rows are row_stride apart in memory here, not n_cols." if strided else "")
        check.compare(f"{case}, dlogits / (dloss * inv_n_rows)", got, cands["right"], dtype=dtype, hint=hint)
    return _reads(case, loads, logits)


def _check_past_2_31(kernel, name, block) -> None:
    """float16, 3 rows of logits 2**30 + 4099 elements apart after 2**31 elements of padding, dlogits
    interleaved with them (the same row stride, N + 8 columns on): the third row starts past 2**31 elements,
    where pid * row_stride in int32 wraps about 2**32 back, into the padding. 8 GiB (a few pages interpreted)."""
    n_rows, n_cols, stride, start = 3, 3 * block + 5, 2**30 + 4099, 2**31
    case = (f"{name} (float16, {n_rows} rows x {n_cols} cols {stride} elements apart: the last row starts "
            f"{(n_rows - 1) * stride} elements in, past 2**31)")
    _, small, targets, lse, dloss = _inputs(n_rows, n_cols, torch.float16, False)
    with offsets64.wide_buffer(start + (n_rows - 1) * stride + 2 * n_cols + 8, torch.float16) as buf:
        if buf is None:
            return
        logits = buf.as_strided((n_rows, n_cols), (stride, 1), start)
        dlogits = buf.as_strided((n_rows, n_cols), (stride, 1), start + n_cols + 8)
        logits.copy_(small)
        dlogits.fill_(float("nan"))
        _launch(kernel, dlogits, logits, targets, lse, dloss, block, case)
        got = dlogits.detach().double().cpu() / (float(dloss) / n_rows)
        del logits, dlogits, buf  # the memory goes back to the card as the block ends
    right = _candidates(small, targets, lse, block)["right"]
    hint = offsets64.HINT.format(what="row_stride (and d_row_stride)")
    if bool(got[n_rows - 1].isnan().all()) and not bool(got[0].isnan().any()):
        raise check.CheckFailure(f"{case}: your kernel never wrote the last row: {hint}.")
    check.compare(f"{case}, dlogits / (dloss * inv_n_rows)", got, right, dtype=torch.float16, hint=hint)


def check_ce_backward_kernel(kernel, name: str = "cross-entropy backward kernel") -> None:
    """Judge a student's ``kernel`` (see the module docstring) on fresh inputs of every supported dtype."""
    _refuse(kernel, name)
    block = _block()
    reads = []
    for dtype in env.supported_dtypes():
        for strided in (False, True):
            for n_rows, n_cols in _shapes():
                reads.append(_one_case(kernel, name, dtype, n_rows, n_cols, strided, block))
        reads.append(_one_case(kernel, name, dtype, *_shapes()[-1], True, block, shift_lse=True))
    _check_reads(reads)
    _check_past_2_31(kernel, name, block)
    g, logits, targets, lse, dloss = _inputs(3, 2 * block + 5, torch.float32, False)
    dlogits = torch.empty_like(logits)
    check.check_kernel_launches(name, lambda: kernel[(3,)](dlogits, logits, targets, lse, dloss, logits.shape[1],
                                                           logits.stride(0), dlogits.stride(0), 1 / 3,
                                                           BLOCK_SIZE=block), expected=1)
    # the same words on CPU and GPU (the check cell's output is compared): no BLOCK_SIZE, no dtype list
    check.verdict(name, "matches float64 (softmax - onehot) * dloss / n_rows on every dtype tried, rows of "
                        "several BLOCK_SIZE-wide tiles, targets in every tile, strided rows in and out, the lse it "
                        "is given, rows past 2**31 elements, no reads or writes outside the tensors "
                        + LOADS_SEEN)


def _block_sizes(fn, *args) -> tuple[object, list[int]]:
    """``fn(*args)`` and the BLOCK_SIZE of each Triton launch it made."""
    blocks: list[int] = []

    def record(original, kernel, a, kw):
        names = list(getattr(kernel, "arg_names", []))
        if "BLOCK_SIZE" in kw:
            blocks.append(kw["BLOCK_SIZE"])
        elif "BLOCK_SIZE" in names and names.index("BLOCK_SIZE") < len(a):
            blocks.append(a[names.index("BLOCK_SIZE")])

    with triton_launch_hook(record, SimpleNamespace(paused=0)):
        return fn(*args), blocks


def _launcher_case(fn, name, dtype, n_rows, n_cols, strided):
    case = (f"{name} ({str(dtype).removeprefix('torch.')}, {n_rows} rows x {n_cols} cols"
            f"{', a column slice: rows ' + str(n_cols + GAP) + ' apart' if strided else ''})")
    _, logits, targets, lse, dloss = _inputs(n_rows, n_cols, dtype, strided)
    before = logits.clone()
    try:
        with check.track_loads() as loads:
            got, blocks = _block_sizes(fn, dloss, logits, targets, lse)
    except (NotImplementedError, check.CheckFailure):
        raise
    except Exception as e:
        raise check.CheckFailure(f"{case}: your launcher raised {type(e).__name__}: {str(e)[:300]}") from e
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(logits.shape) or got.dtype != dtype:
        raise check.CheckFailure(f"{case}: expected a {tuple(logits.shape)} tensor of {dtype} (the logits' "
                                 f"dtype), got {getattr(got, 'dtype', type(got).__name__)} of shape "
                                 f"{tuple(getattr(got, 'shape', ()))}")
    if got.data_ptr() == logits.data_ptr() or not torch.equal(logits, before):
        raise check.CheckFailure(f"{case}: your launcher wrote into the logits: allocate dlogits as a new "
                                 "tensor (torch.empty of the logits' shape and dtype); an operator must "
                                 "not write into its input.")
    too_big = [b for b in blocks if isinstance(b, int) and b > BLOCK_CAP]
    if too_big:
        raise check.CheckFailure(f"{case}: your launcher passed BLOCK_SIZE={too_big[0]} for rows of {n_cols}: the "
                                 f"exercise caps it at {BLOCK_CAP}, min({BLOCK_CAP}, triton.next_power_of_2(n_cols)), "
                                 "so that a long row is several tiles rather than one huge one (its registers "
                                 "would spill).")
    x = before.double().requires_grad_(True)
    ref, = torch.autograd.grad(torch.nn.functional.cross_entropy(x, targets) * float(dloss), x)
    atol, rtol = check.tolerance(dtype)
    too_large = torch.isclose(got.double(), ref * n_rows, atol=atol * abs(float(dloss)), rtol=rtol)
    if n_rows > 1 and bool(too_large.all()):
        raise check.CheckFailure(f"{case}: your gradient is {n_rows} (n_rows) times too large: the loss is "
                                 "the mean over rows, pass inv_n_rows = 1.0 / n_rows.")
    close = torch.isclose(got.double(), ref, atol=atol * abs(float(dloss)) / n_rows, rtol=rtol)
    rows_right = close.all(-1)
    if not strided and n_rows > 1 and bool(rows_right[0]) and not bool(rows_right.all()):
        k = int(rows_right.long().cumprod(0).sum())
        if not bool(rows_right[k:].any()):
            raise check.CheckFailure(f"{case}: rows 0 to {k - 1} are right, rows {k} to {n_rows - 1} are not: your "
                                     f"launch covers {k} row(s). Launch one program per row: "
                                     "ce_backward_kernel[(n_rows,)](...).")
    flat_ref, flat_got = ref.flatten(), got.double().flatten()
    factor = float(flat_got @ flat_ref) / max(float(flat_ref @ flat_ref), 1e-300)
    if abs(factor - 1.0) > 1e-2 and bool(torch.isclose(got.double(), ref * factor, atol=atol * abs(float(dloss)) /
                                                       n_rows, rtol=rtol * 4).all()):
        if abs(factor - float(dloss)) < 1e-3 * float(dloss) or factor == 0.0:
            raise check.CheckFailure(f"{case}: your gradient is {factor:.4g} times the right one: " + (
                "dloss applied twice, the kernel reads it from dloss_ptr: inv_n_rows = 1.0 / n_rows alone."
                if factor else "inv_n_rows is 0: 1 // n_rows is integer division; pass 1.0 / n_rows."))
        raise check.CheckFailure(f"{case}: your gradient is {factor:.4g} times the right one: the scale you pass is "
                                 "wrong. The kernel multiplies by dloss (read from its pointer) and inv_n_rows, and "
                                 "inv_n_rows = 1.0 / n_rows: the loss is the mean over rows (n_rows = "
                                 f"{n_rows}), not over the vocabulary (n_cols = {n_cols}).")
    hint = ("launch one program per row with a BLOCK_SIZE that tiles the vocabulary "
            f"(min({BLOCK_CAP}, triton.next_power_of_2(n_cols))), pass 1.0 / n_rows")
    if strided:  # the contiguous cases of this dtype passed
        hint = ("right on contiguous logits, wrong on this column slice: its rows are logits.stride(0) elements "
                "apart, not n_cols. Pass logits.stride(0) as row_stride (and dlogits.stride(0) as d_row_stride).")
    check.compare(case, got, ref, dtype=dtype, atol=atol * abs(float(dloss)) / n_rows, hint=hint)
    return _reads(case, loads, logits)


def check_ce_backward_launcher(fn, name: str = "cross-entropy backward launcher") -> None:
    """Judge ``fn(dloss, logits, targets, lse) -> dlogits``: a new (rows, vocab) tensor of the logits'
    dtype holding the gradient of the mean loss, in one launch of the student's own kernel, for
    contiguous logits and a column slice of wider ones."""
    from ..kernels import cross_entropy as K
    check.refuse_answer_key(name, fn, {"cross-entropy backward launcher": K.cross_entropy_backward_teaching,
                                       "cross-entropy backward kernel": K.cross_entropy_bwd_kernel})
    shapes = env.pick(gpu=((3, 50257), (64, 1000)), cpu=((3, 300), (5, 17), (2, BLOCK_CAP + 907)))
    reads = [_launcher_case(fn, name, dtype, n_rows, n_cols, strided)
             for dtype in env.supported_dtypes() for strided in (False, True) for n_rows, n_cols in shapes]
    _check_reads(reads)
    for strided in (False, True):
        _, logits, targets, lse, dloss = _inputs(4, 300, torch.float32, strided)
        check.check_kernel_launches(name, fn, dloss, logits, targets, lse, expected=1)
    check.verdict(name, "the gradient of the mean cross-entropy on every dtype tried, contiguous logits and a "
                        "column slice, rows longer than the BLOCK_SIZE cap, in one launch of your kernel")
