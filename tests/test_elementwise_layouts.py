"""Issue 21 item 6: the GELU launchers of both shelves take non-contiguous inputs (transposed,
permuted, sliced, broadcast). The tuned ``gelu`` reads a layout dense in memory in place (the output
gets x's strides) and rows one stride apart with its row kernel; every other case is copied once.
Issue 30: every elementwise op (GELU, bias + GELU (+ dropout), their backwards, the registered op and
its fakes) returns its output in a dense input's layout, as PyTorch's ops do (``torch.empty_like``),
the dropout mask still the logical index's; a slice with gaps is copied and gives a contiguous output.
Results against float64, outputs NaN-poisoned inside guards."""

from __future__ import annotations

import pytest
import torch

import course_utils as cu
from course_utils import check
from course_utils.kernels import elementwise as ew
from course_utils.profile import count_launches
from course_utils.tuned import elementwise as tuned
from course_utils.tuned.elementwise_config import dense_in_memory, rows_of

DTYPES = cu.env.supported_dtypes()

# name -> (base shape, view of the base, how the tuned gelu reads it)
LAYOUTS = {
    "transposed": ((37, 13), lambda b: b.t(), "dense"),
    "permuted 3-D": ((5, 7, 33), lambda b: b.permute(2, 0, 1), "dense"),
    "sliced columns": ((13, 71), lambda b: b[:, 3:40], "rows"),
    "every other row": ((26, 40), lambda b: b[::2], "rows"),
    "broadcast row": ((1, 37), lambda b: b.expand(9, 37), "rows"),
    "every other column": ((13, 80), lambda b: b[:, ::2], "copy"),
    "transposed slice": ((40, 16), lambda b: b[:, :13].t(), "copy"),
}


def _input(name, dtype):
    shape, view, path = LAYOUTS[name]
    x = view(check.randn(shape, dtype, scale=3.0))
    assert not x.is_contiguous()
    return x, path


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_helpers_say_which_path(name):
    x, path = _input(name, torch.float32)
    assert dense_in_memory(x) == (path == "dense")
    assert (not dense_in_memory(x) and rows_of(x) is not None) == (path == "rows")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", LAYOUTS)
def test_tuned_gelu_any_layout_into_a_poisoned_output(name, dtype):
    x, path = _input(name, dtype)
    before = x.clone()
    strides = torch.empty_like(x, device="meta").stride() if path == "dense" else None
    g = check.Guarded((x.numel(),), dtype)
    out = g.tensor.as_strided(x.shape, strides) if strides else g.tensor.view(x.shape)
    for approximate in ("tanh", "none"):
        got = tuned.gelu(x, approximate, out=out)
        assert got is out
        g.check(f"gelu, {name}")
        check.compare(f"tuned gelu {approximate}, {name}, {dtype}", got, ew.gelu_ref(x.double(), approximate))
    assert torch.equal(x, before)
    fresh = tuned.gelu(x, "none")  # the last one written into out
    assert fresh.stride() == (x.stride() if path == "dense" else fresh.contiguous().stride())
    assert torch.equal(fresh, out)


@pytest.mark.parametrize("name", ["transposed", "sliced columns", "every other column"])
def test_tuned_gelu_copies_only_where_it_says(name):
    x, path = _input(name, torch.float32)
    counts = count_launches(tuned.gelu, x)
    kernel = {"dense": "gelu_tuned_kernel", "rows": "gelu_rows_kernel", "copy": "gelu_tuned_kernel"}[path]
    assert dict(counts.triton) == {kernel: 1}, counts
    assert dict(counts.torch) == ({"clone": 1} if path == "copy" else {}), counts  # the one copy, or none


def test_tuned_gelu_out_with_other_strides_is_refused():
    x, _ = _input("transposed", torch.float32)
    with pytest.raises(ValueError, match="strides"):
        tuned.gelu(x, out=torch.empty(x.shape, device=cu.DEVICE))
    with pytest.raises(ValueError, match="out must"):
        tuned.gelu(x, out=torch.empty(x.shape, device=cu.DEVICE, dtype=torch.float16).t().t())


@pytest.mark.parametrize("shelf", ["teaching", "tuned"])
@pytest.mark.parametrize("name", ["transposed", "sliced columns", "every other column"])
def test_every_gelu_launcher_takes_a_strided_x(shelf, name):
    s = "_teaching" if shelf == "teaching" else ""
    gelu, chain, drop = (getattr(ew if shelf == "teaching" else tuned, n + s)
                         for n in ("gelu", "bias_gelu_scale", "bias_gelu_dropout"))
    for dtype in DTYPES:
        x, _ = _input(name, dtype)
        b = check.randn((x.shape[-1],), dtype)
        check.compare(f"{shelf} gelu, {name}", gelu(x), ew.gelu_ref(x.double()))
        check.compare(f"{shelf} bias_gelu_scale, {name}", chain(x, b, 0.5),
                      ew.bias_gelu_scale_ref(x.double(), b.double(), 0.5))
        # the mask is drawn by the element's logical index: a strided x gets the contiguous x's mask
        assert torch.equal(drop(x, b, 0.3, 11), drop(x.contiguous(), b, 0.3, 11))
        check.compare(f"{shelf} bias_gelu_dropout, {name}", drop(x, b, 0.3, 11),
                      ew.bias_gelu_dropout_ref(x.double(), b.double(), 0.3, 11))


@pytest.mark.parametrize("shelf", ["teaching", "tuned"])
def test_add_still_refuses_a_strided_input_clearly(shelf):
    add = ew.add_teaching if shelf == "teaching" else tuned.add
    x = check.randn((4, 6)).t()
    with pytest.raises(ValueError, match="contiguous"):
        add(x, x)


# ---------------------------------------------------------------------------------------------------
# Issue 30: outputs keep the input's layout (torch.empty_like semantics), forward and backward, for
# every elementwise op with a bias or a dropout mask too. A dense x of any strides is read in place;
# the mask stays the one drawn by logical index (x.contiguous()'s), the values right against float64.
# ---------------------------------------------------------------------------------------------------
import itertools  # noqa: E402

import course_utils.ops as ops  # noqa: E402
from course_utils.autograd import elementwise as autograd_ew  # noqa: E402
from course_utils.kernels import gelu_backward as gb  # noqa: E402
from course_utils.kernels import layouts  # noqa: E402
from course_utils.tuned import bias_gelu_dropout as seeded  # noqa: E402


def _dense(name, dtype=torch.float32):
    """Dense, non-contiguous inputs of odd sizes (the last dim is the bias's)."""
    make = {
        "transposed": lambda: check.randn((37, 13), dtype, scale=3.0).t(),
        "permuted 3-D": lambda: check.randn((5, 7, 33), dtype, scale=3.0).permute(2, 0, 1),
        "channels_last": lambda: check.randn((3, 5, 7, 9), dtype, scale=3.0).to(memory_format=torch.channels_last),
        "channels_last_3d": lambda: check.randn((2, 3, 5, 4, 7), dtype, scale=3.0).to(
            memory_format=torch.channels_last_3d),
        "last dim strided": lambda: check.randn((3, 11, 6, 5), dtype, scale=3.0).permute(0, 2, 3, 1),
        "size-1 dims": lambda: check.randn((1, 9, 1, 17), dtype, scale=3.0).permute(3, 1, 2, 0),
    }[name]
    x = make()
    assert layouts.is_dense(x) and not x.is_contiguous() and layouts.in_place(x), name
    return x


DENSE = ["transposed", "permuted 3-D", "channels_last", "channels_last_3d", "last dim strided", "size-1 dims"]


def _same_layout(got, x, what):
    assert got.stride() == torch.empty_like(x).stride() == x.stride(), \
        f"{what}: output strides {got.stride()}, input strides {x.stride()}"


def _forward_ops(shelf):
    if shelf == "teaching":
        return ew.gelu_teaching, ew.bias_gelu_scale_teaching, ew.bias_gelu_dropout_teaching
    return tuned.gelu, tuned.bias_gelu_scale, tuned.bias_gelu_dropout


@pytest.mark.parametrize("shelf", ["teaching", "tuned"])
@pytest.mark.parametrize("name", DENSE)
def test_forward_outputs_keep_a_dense_layout(shelf, name):
    gelu, chain, drop = _forward_ops(shelf)
    for dtype in DTYPES:
        x = _dense(name, dtype)
        b = check.randn((x.shape[-1],), dtype)
        for what, got, ref in (
                ("gelu", gelu(x), ew.gelu_ref(x.double())),
                ("bias_gelu_scale", chain(x, b, 0.5), ew.bias_gelu_scale_ref(x.double(), b.double(), 0.5)),
                ("bias_gelu_dropout", drop(x, b, 0.3, 11), ew.bias_gelu_dropout_ref(x.double(), b.double(), 0.3, 11))):
            _same_layout(got, x, f"{shelf} {what}, {name}, {dtype}")
            check.compare(f"{shelf} {what}, {name}, {dtype}", got, ref)
        assert torch.equal(drop(x, b, 0.3, 11), drop(x.contiguous(), b, 0.3, 11)), "the mask is by logical index"


@pytest.mark.parametrize("name", ["transposed", "channels_last"])
def test_tuned_bias_ops_write_a_poisoned_out_in_place_without_a_copy(name):
    x = _dense(name)
    b = check.randn((x.shape[-1],))
    for what, fn, ref in (("bias_gelu_scale", lambda o: tuned.bias_gelu_scale(x, b, 0.5, out=o),
                           ew.bias_gelu_scale_ref(x.double(), b.double(), 0.5)),
                          ("bias_gelu_dropout", lambda o: tuned.bias_gelu_dropout(x, b, 0.2, 5, out=o),
                           ew.bias_gelu_dropout_ref(x.double(), b.double(), 0.2, 5))):
        g = check.Guarded((x.numel(),), x.dtype)
        out = g.tensor.as_strided(x.shape, x.stride())
        assert fn(out) is out
        g.check(f"{what}, {name}")
        check.compare(f"{what} into out, {name}", out, ref)
        counts = count_launches(fn, torch.empty_like(x))
        assert dict(counts.triton) == {"bias_gelu_strided_kernel": 1} and not counts.torch, counts   # no copy


@pytest.mark.parametrize("name", ["every other column", "transposed slice"])
def test_a_slice_with_gaps_is_copied_once_and_the_output_is_contiguous(name):
    x, _ = _input(name, torch.float32)
    b = check.randn((x.shape[-1],))
    assert not layouts.in_place(x)
    for shelf in ("teaching", "tuned"):
        _, chain, drop = _forward_ops(shelf)
        y = drop(x, b, 0.3, 11)
        assert y.is_contiguous(), (shelf, y.stride())
        check.compare(f"{shelf} dropout, {name}", y, ew.bias_gelu_dropout_ref(x.double(), b.double(), 0.3, 11))
        check.compare(f"{shelf} scale, {name}", chain(x, b, 0.5), ew.bias_gelu_scale_ref(x.double(), b.double(), 0.5))


def _seed(s=1234):
    return torch.tensor([s], dtype=torch.int64, device=cu.DEVICE)


@pytest.mark.parametrize("name", DENSE)
def test_backwards_keep_a_dense_layout(name):
    for dtype in DTYPES:
        x = _dense(name, dtype)
        b = check.randn((x.shape[-1],), dtype)
        dy = torch.empty_like(x).copy_(check.randn(x.shape, dtype))       # dy in x's layout, as autograd gives it
        keep = ew.dropout_keep_mask_teaching(x.shape, 0.25, 1234)
        rx, rb = gb.bias_gelu_backward_ref(dy.double(), x.double(), b.double(), keep=keep, p=0.25)
        for what, (dx, db) in (("teaching backward", gb.bias_gelu_backward_teaching(dy, x, b, p=0.25, seed=1234)),
                               ("seeded backward", seeded.bias_gelu_dropout_backward(dy, x, b, 0.25, _seed()))):
            _same_layout(dx, x, f"{what}, {name}, {dtype}")
            check.compare(f"{what} dx, {name}, {dtype}", dx, rx)
            check.compare(f"{what} db, {name}, {dtype}", db, rb, atol=1e-3 if dtype == torch.float32 else 5e-2)
        # dy in another layout (contiguous) is read at the same logical elements
        dx, _ = seeded.bias_gelu_dropout_backward(dy.contiguous(), x, b, 0.25, _seed())
        _same_layout(dx, x, f"seeded backward, contiguous dy, {name}")
        check.compare(f"seeded backward, contiguous dy, {name}, {dtype}", dx, rx)


@pytest.mark.parametrize("path", ["registered op", "chapter 11's autograd Function"])
@pytest.mark.parametrize("name", ["transposed", "channels_last", "last dim strided"])
def test_autograd_keeps_the_layout_both_ways(path, name):
    x0 = _dense(name)
    b0 = check.randn((x0.shape[-1],))
    x, b = x0.clone().requires_grad_(True), b0.clone().requires_grad_(True)   # clone keeps a dense layout
    assert x.stride() == x0.stride()
    if path == "registered op":
        y = torch.ops.course.bias_gelu_dropout(x, b, 0.25, _seed())
        assert torch.equal(y, ops.bias_gelu_dropout(x, b, 0.25, _seed()))        # the eager fast path: the same
    else:
        y = autograd_ew.bias_gelu_dropout(x, b, 0.25, 1234)
    _same_layout(y, x0, f"{path} forward, {name}")
    check.compare(f"{path} forward, {name}", y, ew.bias_gelu_dropout_ref(x0.double(), b0.double(), 0.25, 1234))
    dy = check.randn(x0.shape)
    dx, db = torch.autograd.grad(y, (x, b), dy)
    _same_layout(dx, x0, f"{path} dx, {name}")
    keep = ew.dropout_keep_mask_teaching(x0.shape, 0.25, 1234)
    rx, rb = gb.bias_gelu_backward_ref(dy.double(), x0.double(), b0.double(), keep=keep, p=0.25)
    check.compare(f"{path} dx, {name}", dx, rx)
    check.compare(f"{path} db, {name}", db, rb, atol=1e-3)


@pytest.mark.parametrize("name", DENSE + ["every other column"])
def test_the_registered_ops_fakes_have_the_real_strides(name):
    x = _dense(name) if name in DENSE else _input(name, torch.float32)[0]
    b, seed = check.randn((x.shape[-1],)), _seed()
    real = torch.ops.course.bias_gelu_dropout(x, b, 0.1, seed)
    real_dx, _ = torch.ops.course.bias_gelu_dropout_bwd(real, x, b, 0.1, seed)
    meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (x, b, seed)]
    fake = ops._dropout._fake_fwd(meta[0], meta[1], 0.1, meta[2])
    fake_dx, fake_db = ops._dropout._fake_bwd(fake, meta[0], meta[1], 0.1, meta[2])
    assert fake.stride() == real.stride() and fake_dx.stride() == real_dx.stride(), name
    assert real.stride() == (x.stride() if name in DENSE else x.contiguous().stride())


# Modelled on PyTorch's own dropout tests (test/nn/test_dropout.py: _test_dropout_stride_mean_preserve,
# _test_dropout_discontiguous), for the course's dropout ops: every permutation of a 4-D input keeps its
# strides, the mean is preserved, and discontiguous inputs of each memory format come out right.
DROPOUT_OPS = {
    "teaching": lambda x, b, p, s: ew.bias_gelu_dropout_teaching(x, b, p, s),
    "tuned": lambda x, b, p, s: tuned.bias_gelu_dropout(x, b, p, s),
    "registered op": lambda x, b, p, s: torch.ops.course.bias_gelu_dropout(x, b, p, _seed(s)),
}


@pytest.mark.parametrize("op", DROPOUT_OPS)
def test_dropout_stride_and_mean_preserved_for_every_permutation(op):
    fn = DROPOUT_OPS[op]
    expect = float(ew.gelu_ref(torch.tensor(1.0, dtype=torch.float64)))   # gelu(1 + 0): the mean to preserve
    for perm in itertools.permutations(range(4)):
        inp = torch.ones(4, 5, 6, 7, device=cu.DEVICE).permute(*perm)     # dense, each of the 24 stride orders
        b = torch.zeros(inp.shape[-1], device=cu.DEVICE)
        for p in (0.0, 0.5):
            out = fn(inp, b, p, 17)
            assert out.stride() == inp.stride(), (op, perm, p, out.stride(), inp.stride())
            mean = float(out.double().mean())
            assert abs(mean / expect - 1) < (1e-6 if p == 0 else 0.12), (op, perm, p, mean, expect)
            assert torch.equal(out, fn(inp.contiguous(), b, p, 17)), (op, perm, p)   # the mask is by logical index


@pytest.mark.parametrize("op", DROPOUT_OPS)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=str)
def test_dropout_discontiguous_inputs(op, memory_format):
    fn = DROPOUT_OPS[op]
    b = check.randn((3,))
    for p in (0.0, 1e-10):   # (almost) nothing dropped: the output is gelu(x + b), whatever the layout
        inp = check.randn((2, 3, 3, 3))
        disc = torch.empty(2, 3, 3, 6, device=cu.DEVICE, memory_format=memory_format)[..., ::2]
        disc.copy_(inp)
        out = fn(disc, b, p, 3)
        assert out.layout == disc.layout
        check.compare(f"{op} discontiguous {memory_format} p={p}", out, ew.bias_gelu_scale_ref(
            disc.double(), b.double(), 1.0 / (1.0 - p)))


def test_lead_layout_walks_the_leading_dims_smallest_stride_innermost():
    x = _dense("channels_last")                       # (3, 5, 7, 9), strides (315, 1, 45, 5)
    n1, n2, s0, s1, s2, r0, r1, r2, col_stride = layouts.lead_layout(x)
    assert (s2, r2, n2) == (1, 7, 5) and col_stride == 5   # C innermost: neighbouring tile rows are neighbours
    rows = torch.arange(3 * 5 * 7)
    i2, i1, i0 = rows % n2, rows // n2 % n1, rows // n2 // n1
    logical = i0 * r0 + i1 * r1 + i2 * r2
    assert sorted(logical.tolist()) == list(range(3 * 5 * 7))   # every logical row once
    flat = x.reshape(-1, 9)   # a copy in logical order: row k of it is logical row k of x
    for t, k in enumerate(logical.tolist()):
        off = int(i0[t]) * s0 + int(i1[t]) * s1 + int(i2[t]) * s2
        got = x.as_strided((9,), (col_stride,), x.storage_offset() + off)
        assert torch.equal(got, flat[k]), (t, k)
    assert layouts.lead_layout(check.randn((2, 3, 4, 5, 6)).permute(0, 2, 4, 1, 3)) is None   # 4 leading dims
