"""The LM head fused with its cross-entropy (chapter 12): the fused classifier kernel
(course_utils/kernels/fused_classifier.py: loss and in-place gradient), the chunked head + loss
(course_utils/tuned/linear_cross_entropy.py) and ``course::linear_cross_entropy`` (course_utils/ops/linear_ce.py).

Against float64 on odd sizes, chunks that do not divide the rows, strided inputs, NaN-poisoned outputs,
ignored and out-of-range targets, a loss scaled before backward, bad inputs, opcheck and a compile trace.
"""

import pytest
import torch
import torch.nn.functional as F

import course_utils as cu
from course_utils import check
from course_utils.kernels import fused_classifier as K
from course_utils.ops import linear_ce as L
from course_utils.tuned import linear_cross_entropy as T

D = cu.DEVICE


def _targets(rows, vocab, dtype=torch.int64):
    return torch.randint(0, vocab, (rows,), device=D, dtype=dtype)


def _scaled_tol(dtype, ref):
    """(atol, rtol) for a gradient whose entries are about |ref|.max() in size."""
    atol, rtol = check.tolerance(dtype)
    return dict(atol=atol * max(float(ref.abs().max()), 1e-3), rtol=rtol)


def _lse_rounding(lse_max: float, scale: float) -> float:
    """atol for a gradient (p - onehot) * scale whose float32 lse is up to ``lse_max``: the lse is stored in float32,
    off by up to half a unit in its last place (7.6e-6 from 128 to 256), so every p = exp(x - lse) is off by that much,
    relative. A target that holds nearly all of its row's weight has p - 1 near 0, where a relative tolerance takes
    none of it: a fixed atol of 1e-6 failed logits of scale 50 about one run in a thousand."""
    return torch.finfo(torch.float32).eps * lse_max * scale


# --------------------------------------------------------------------------- the fused classifier kernel


@pytest.mark.parametrize("rows,vocab,dtype,block,scale", [
    (1, 1, torch.float32, None, None),
    (7, 100, torch.float32, 32, "tensor"),      # four tiles, the last one ragged
    (13, 1001, torch.float16, 256, 0.37),
    (5, 129, torch.float16, None, None),
], ids=str)
def test_fused_classifier_matches_float64(nan_empty, rows, vocab, dtype, block, scale):
    logits = check.randn((rows, vocab), dtype, scale=3.0, outliers=0.05, outlier_scale=30.0)
    targets = _targets(rows, vocab, torch.int32 if dtype == torch.float16 else torch.int64)
    if scale == "tensor":
        scale = check.randn((), torch.float32) + 2.0
    want_loss, want_grad = K.fused_classifier_ref(logits, targets, scale)
    g = logits.clone()
    losses = K.fused_classifier_teaching(g, targets, scale, block=block)
    assert losses.dtype == torch.float32 and losses.shape == (rows,) and g.dtype == dtype
    check.compare("losses", losses, want_loss, atol=1e-4, rtol=1e-5)
    check.compare("gradient written over the logits", g, want_grad, **_scaled_tol(dtype, want_grad))
    if scale is None:    # the mean: F.cross_entropy's loss and gradient
        x = logits.double().requires_grad_(True)
        loss = F.cross_entropy(x, targets.long())
        loss.backward()
        check.compare("mean loss", losses.sum() * K.mean_scale(targets), loss.detach(), atol=1e-5, rtol=1e-5)
        check.compare("mean gradient", g, x.grad, **_scaled_tol(dtype, x.grad))


def test_fused_classifier_strided_rows_touch_nothing_outside_the_view():
    base = check.randn((6, 90), scale=50.0)     # |logits| up to ~200: exp would overflow without the max
    before = base.clone()
    logits = base[:, 3:70]                      # row stride 90, 67 columns
    logits[:, 10] = float("-inf")               # a masked-out vocabulary entry
    targets = torch.randint(11, 67, (6,), device=D)
    want_loss, want_grad = K.fused_classifier_ref(logits, targets)
    lse_max = float(torch.logsumexp(logits.double(), dim=1).abs().max())
    losses = K.fused_classifier_teaching(logits, targets, block=16)
    check.compare("losses", losses, want_loss, atol=1e-4, rtol=1e-5)
    check.compare("gradient", logits, want_grad, atol=_lse_rounding(lse_max, 1 / 6), rtol=1e-5)
    assert torch.equal(base[:, :3], before[:, :3]) and torch.equal(base[:, 70:], before[:, 70:])


def test_fused_classifier_ignored_rows_and_bad_targets():
    logits = check.randn((6, 40), scale=2.0)
    targets = torch.tensor([3, -100, 39, 40, -100, -1], device=D)   # ignored, ignored; 40 and -1 are bad
    g = logits.clone()
    losses = K.fused_classifier_teaching(g, targets)
    assert losses[1] == 0 and losses[4] == 0 and (g[1] == 0).all() and (g[4] == 0).all()
    assert torch.isnan(losses[3]) and torch.isnan(losses[5])
    assert torch.isnan(g[3]).all() and torch.isnan(g[5]).all()
    good = [0, 2]   # the valid rows: F.cross_entropy's mean over the 4 rows not ignored is 1/4 per row
    x = logits[good].double().requires_grad_(True)
    (F.cross_entropy(x, targets[good], reduction="sum") / 4).backward()
    check.compare("valid rows' losses", losses[good], F.cross_entropy(logits[good].double(), targets[good],
                                                                      reduction="none"), atol=1e-5, rtol=1e-5)
    check.compare("valid rows' gradient (scale 1/4 rows not ignored)", g[good], x.grad, atol=1e-7, rtol=1e-5)


def test_fused_classifier_mean_over_rows_not_ignored_matches_f_cross_entropy():
    logits = check.randn((9, 50), scale=2.0)
    targets = _targets(9, 50)
    targets[[0, 4, 5]] = -100
    x = logits.double().requires_grad_(True)
    want = F.cross_entropy(x, targets)      # ignore_index=-100 by default
    want.backward()
    g = logits.clone()
    losses = K.fused_classifier_teaching(g, targets)
    check.compare("mean loss", losses.sum() * K.mean_scale(targets), want.detach(), atol=1e-5, rtol=1e-5)
    check.compare("gradient", g, x.grad, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("call,error,text", [
    (lambda: K.fused_classifier_teaching(torch.randn(3, 4, 5, device=D), _targets(3, 4)), ValueError, "2-D"),
    (lambda: K.fused_classifier_teaching(torch.randn(3, 4, device=D, dtype=torch.float64), _targets(3, 4)),
     TypeError, "float32, float16 or bfloat16"),
    (lambda: K.fused_classifier_teaching(torch.randn(3, 4, device=D), torch.zeros(3, device=D)), ValueError,
     "int64 or int32"),
    (lambda: K.fused_classifier_teaching(torch.randn(3, 4, device=D), _targets(2, 4)), ValueError, "shape (3,)"),
    (lambda: K.fused_classifier_teaching(torch.randn(3, 0, device=D), _targets(3, 1)), ValueError, "empty"),
    (lambda: K.fused_classifier_teaching(torch.randn(4, 3, device=D).t(), _targets(3, 4)), ValueError,
     "unit stride"),
    (lambda: K.fused_classifier_teaching(torch.randn(3, 4, device=D), _targets(3, 4), torch.ones(2, device=D)),
     ValueError, "one floating element"),
    (lambda: K.fused_classifier_teaching(torch.randn(3, 4, device=D), _targets(3, 4), losses=torch.empty(2)),
     ValueError, "losses must be"),
], ids=range(8))
def test_fused_classifier_bad_inputs_raise_clear_errors(call, error, text):
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        call()


# --------------------------------------------------------------------------- the chunked head + loss


def _ref64(h, weight, targets, grad_output=1.0, ignore_index=-100):
    """(loss, dh, dweight) in float64. The logits are rounded to h's dtype on the way (the contract: the
    head's GEMM writes them in h's dtype, as eager's does), with the rounding invisible to autograd."""
    h64 = h.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    logits = h64 @ w64.T
    logits = logits + (logits.detach().to(h.dtype).double() - logits.detach())
    loss = F.cross_entropy(logits, targets.long(), ignore_index=ignore_index)
    (loss * grad_output).backward()
    return loss.detach(), h64.grad, w64.grad


def _leaves(rows, vocab, d, dtype):
    h = check.randn((rows, d), torch.float32, scale=1.0).to(dtype).requires_grad_(True)
    w = check.randn((vocab, d), torch.float32, scale=d ** -0.5 * 4).to(dtype).requires_grad_(True)
    return h, w


def _compare_all(what, dtype, loss, gh, gw, want):
    wl, wh, ww = want
    atol, rtol = check.tolerance(dtype)
    check.compare(f"{what} loss", loss, wl, atol=atol, rtol=rtol)
    check.compare(f"{what} dh", gh, wh, **_scaled_tol(dtype, wh))
    check.compare(f"{what} dweight", gw, ww, **_scaled_tol(dtype, ww))


@pytest.mark.parametrize("rows,vocab,d,chunk,dtype", [
    (1, 1, 8, None, torch.float32),
    (1, 100, 40, None, torch.float16),
    (7, 100, 8, 3, torch.float32),          # 3 + 3 + 1
    (7, 1001, 40, None, torch.float16),
    (333, 1001, 8, 100, torch.float32),     # 100 x 3 + 33
    (333, 100, 40, 64, torch.float16),
    (333, 1, 8, 1000, torch.float32),       # one chunk larger than the rows
], ids=str)
def test_linear_cross_entropy_matches_float64(nan_empty, rows, vocab, d, chunk, dtype):
    h, w = _leaves(rows, vocab, d, dtype)
    targets = _targets(rows, vocab)
    loss = T.linear_cross_entropy(h, w, targets, chunk_rows=chunk)
    assert loss.dtype == torch.float32 and loss.shape == ()
    (loss * 3.0).backward()                 # grad_output 3: the backward scales on the device
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    _compare_all(f"{rows}x{vocab}x{d} chunk {chunk}", dtype, loss, h.grad, w.grad, _ref64(h, w, targets, 3.0))


@pytest.mark.parametrize("chunk", [1, 5, 16, 49, 50])
def test_every_chunk_size_gives_the_same_result(nan_empty, chunk):
    h, w = _leaves(49, 37, 8, torch.float32)
    targets = _targets(49, 37)
    loss, dh, dw = T.linear_cross_entropy_forward(h.detach(), w.detach(), targets, chunk_rows=chunk)
    _compare_all(f"chunk {chunk}", torch.float32, loss, dh, dw, _ref64(h, w, targets))


def test_strided_h_and_weight(nan_empty):
    wide = check.randn((21, 60)).requires_grad_(True)
    h = wide[:, 5:45:2]                                 # (21, 20), row stride 60, column stride 2
    wt = (check.randn((20, 33)) * 0.5).requires_grad_(True)
    w = wt.t()                                          # (33, 20), column-major
    targets = _targets(21, 33)
    loss = T.linear_cross_entropy(h, w, targets, chunk_rows=8)
    loss.backward()
    want = _ref64(h, w, targets)
    _compare_all("strided", torch.float32, loss, wide.grad[:, 5:45:2], wt.grad.t(), want)
    assert (wide.grad[:, :5] == 0).all() and (wide.grad[:, 6:45:2] == 0).all()


def test_ignored_rows_are_left_out_of_the_mean():
    h, w = _leaves(17, 30, 8, torch.float32)
    targets = _targets(17, 30)
    targets[[0, 6, 7, 16]] = -100
    for f in (T.linear_cross_entropy, L.linear_cross_entropy, torch.ops.course.linear_cross_entropy):
        h.grad = w.grad = None
        loss = f(h, w, targets) if f is not T.linear_cross_entropy else f(h, w, targets, chunk_rows=5)
        loss.backward()
        _compare_all(getattr(f, "__name__", str(f)), torch.float32, loss, h.grad, w.grad, _ref64(h, w, targets))
        assert (h.grad[[0, 6, 7, 16]] == 0).all()


def test_an_ignore_index_inside_the_vocabulary(nan_empty):
    h, w = _leaves(23, 30, 8, torch.float32)
    targets = _targets(23, 30)
    targets[[1, 2, 9]] = 5
    loss, dh, dw = T.linear_cross_entropy_forward(h.detach(), w.detach(), targets, ignore_index=5, chunk_rows=10)
    _compare_all("ignore_index 5", torch.float32, loss, dh, dw, _ref64(h, w, targets, ignore_index=5))
    loss = torch.ops.course.linear_cross_entropy(h, w, targets, 5)
    check.compare("op, ignore_index 5", loss, _ref64(h, w, targets, ignore_index=5)[0], atol=1e-5, rtol=1e-5)


def test_every_row_ignored_gives_nan_loss_and_zero_gradients():
    h, w = _leaves(5, 30, 8, torch.float32)
    targets = torch.full((5,), -100, device=D)
    assert torch.isnan(F.cross_entropy(h @ w.T, targets))      # what the course matches
    loss, dh, dw = T.linear_cross_entropy_forward(h.detach(), w.detach(), targets)
    assert torch.isnan(loss) and (dh == 0).all() and (dw == 0).all()


def test_a_target_outside_the_vocabulary_gives_nan():
    h, w = _leaves(6, 30, 8, torch.float32)
    for bad in (30, -1, -101):
        targets = _targets(6, 30)
        targets[2] = bad
        loss, dh, _ = T.linear_cross_entropy_forward(h.detach(), w.detach(), targets, chunk_rows=4)
        assert torch.isnan(loss) and torch.isnan(dh[2]).all(), bad
        assert torch.isnan(L.linear_cross_entropy(h, w, targets)), bad


def test_no_rows_gives_nan_loss_like_f_cross_entropy():
    h = torch.empty(0, 8, device=D)
    w = check.randn((30, 8))
    loss, dh, dw = T.linear_cross_entropy_forward(h, w, torch.empty(0, dtype=torch.int64, device=D))
    assert torch.isnan(loss) and dh.shape == (0, 8) and (dw == 0).all() and dw.shape == (30, 8)


def test_chunk_rows_for_gpt2_small():
    for rows in (8192, 16384, 1000, 64, 1):
        c = T.chunk_rows_for(rows, 50304, 2)
        n = -(-rows // c)
        assert 1 <= c <= rows and c * 50304 * 2 <= T.CHUNK_BYTES
        assert n == -(-rows // (T.CHUNK_BYTES // (50304 * 2) // T.ROW_MULTIPLE * T.ROW_MULTIPLE)), rows
    assert T.chunk_rows_for(8192, 50304, 2) == 4096      # 2 chunks of 412 MB of bf16 logits
    assert T.chunk_rows_for(16384, 50304, 2) == 4096     # 4 chunks
    assert T.chunk_rows_for(100, 256, 4) == 100          # a small problem is one chunk


@pytest.mark.parametrize("call,error,text", [
    (lambda: T.linear_cross_entropy(torch.randn(2, 3, 4, device=D), torch.randn(5, 4, device=D), _targets(2, 5)),
     ValueError, "h must be"),
    (lambda: T.linear_cross_entropy(torch.randn(3, 4, device=D), torch.randn(5, 6, device=D), _targets(3, 5)),
     ValueError, "4 features"),
    (lambda: T.linear_cross_entropy(torch.randn(3, 4, device=D), torch.randn(5, 4, device=D).half(),
                                    _targets(3, 5)), TypeError, "both be"),
    (lambda: T.linear_cross_entropy(torch.randn(3, 4, device=D).double(), torch.randn(5, 4, device=D).double(),
                                    _targets(3, 5)), TypeError, "both be"),
    (lambda: T.linear_cross_entropy(torch.randn(3, 4, device=D), torch.randn(5, 4, device=D),
                                    torch.zeros(3, device=D)), ValueError, "int64 or int32"),
    (lambda: T.linear_cross_entropy(torch.randn(3, 4, device=D), torch.randn(5, 4, device=D), _targets(4, 5)),
     ValueError, "shape"),
    (lambda: T.linear_cross_entropy(torch.randn(3, 4, device=D), torch.randn(0, 4, device=D), _targets(3, 1)),
     ValueError, "must not be empty"),
    (lambda: T.linear_cross_entropy(torch.randn(3, 4, device=D), torch.randn(5, 4, device=D), _targets(3, 5),
                                    chunk_rows=-2), ValueError, "chunk_rows"),
    (lambda: L.linear_cross_entropy(torch.randn(3, 4, device=D), torch.randn(5, 6, device=D), _targets(3, 5)),
     ValueError, "4 features"),
], ids=range(9))
def test_linear_cross_entropy_bad_inputs_raise_clear_errors(call, error, text):
    with pytest.raises(error, match=text):
        call()


# --------------------------------------------------------------------------- the op


def test_op_paths_match_float64_and_agree_exactly(nan_empty):
    h, w = _leaves(29, 47, 8, torch.float32)
    targets = _targets(29, 47)
    want = _ref64(h, w, targets, 3.0)
    results = []
    for f in (L.linear_cross_entropy, torch.ops.course.linear_cross_entropy):
        h.grad = w.grad = None
        loss = f(h, w, targets)
        (3 * loss).backward()
        _compare_all(str(f), torch.float32, loss, h.grad, w.grad, want)
        results.append((loss, h.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_opcheck():
    h, w = _leaves(13, 37, 8, torch.float32)
    targets = _targets(13, 37)
    c = torch.ops.course
    torch.library.opcheck(c.linear_cross_entropy.default, (h, w, targets))
    torch.library.opcheck(c.linear_cross_entropy.default, (h, w, targets, 5))
    torch.library.opcheck(c.linear_cross_entropy_fwd.default, (h, w, targets, -100))
    _, dh, dw = c.linear_cross_entropy_fwd(h.detach(), w.detach(), targets, -100)
    torch.library.opcheck(c.linear_cross_entropy_bwd.default, (torch.tensor(1.5, device=D), dh, dw),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_traces_the_op_fullgraph():
    h, w = _leaves(11, 23, 8, torch.float32)
    targets = _targets(11, 23)

    def f(h, w, t):
        return L.linear_cross_entropy(torch.tanh(h), w, t) * 2.0

    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(h, w, targets)
    loss.backward()
    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    want = T.linear_cross_entropy_ref(torch.tanh(h64), w64, targets) * 2.0
    want.backward()
    _compare_all("compiled", torch.float32, loss, h.grad, w.grad, (want.detach(), h64.grad, w64.grad))


@pytest.mark.parametrize("rows,chunk", [(7, 3), (6, 3), (0, 3)], ids=str)
def test_the_traced_path_per_chunk_buffers_agree_exactly(monkeypatch, rows, chunk):
    # while torch.compile traces, each chunk's logits and losses are tensors of their own (Inductor misreads a
    # kernel that writes slices of one buffer); the numbers must be the eager path's, bit for bit
    h, w = check.randn((rows, 24), torch.float32), check.randn((41, 24), torch.float32)
    targets = _targets(rows, 41)
    eager = T.linear_cross_entropy_forward(h, w, targets, chunk_rows=chunk)
    monkeypatch.setattr(T, "traced", lambda t: True)
    per_chunk = T.linear_cross_entropy_forward(h, w, targets, chunk_rows=chunk)
    for name, got, want in zip(("loss", "dh", "dweight"), per_chunk, eager):
        assert torch.equal(got, want) or (got.isnan().all() and want.isnan().all()), name
