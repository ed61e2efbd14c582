"""The float64 answers of exercise 12.3's check (:mod:`course_utils.checkers.hand_step`): one block's
backward, right and with each usual mistake, made of the block's saved activations one op at a time with
torch.autograd in float64.

:func:`reference` is the right answer, or with ``fault`` one of :data:`FLOW_FAULTS` (a gradient that
misses one of its paths through the block's two adds); :func:`tensor_faults` names a mistake that
touches one tensor only (a transposed or misplaced GEMM, a bias or dW averaged, LayerNorm's two swapped);
:func:`raised_slip` names a mistake that makes torch raise (a .grad of the wrong shape, out's or qkv's
dx with W.T) by the operands of the call that raised.

Not a checker itself: nothing here takes a student's function. The one check that uses it,
``checkers.hand_step.check_block_backward``, first refuses the course's answer (``HandStep``'s backward,
``course_utils.step``'s helpers, autograd) by source and at run time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GELU_GIVEN_F = "GELU's backward given f"
LN_NEXT_GIVEN_LN2_WEIGHT = "ln_next's backward given LayerNorm 2's weight"
LN2_GIVEN_LN_NEXT_WEIGHT = "LayerNorm 2's backward given ln_next's weight"
ORDER = ("ln_next.weight", "ln_next.bias", "out.weight", "out.bias", "fc.weight", "fc.bias", "ln2.weight",
         "ln2.bias", "proj.weight", "proj.bias", "qkv.weight", "qkv.bias", "dh_in", "dres_in")
# {mistake: what went wrong and what to do}; reference(..., fault=mistake) gives the gradients it makes
FLOW_FAULTS = {
    "dres dropped": "the residual stream's gradient dres never reached the block: s2 leaves the block as the "
        "next block's residual, so pass dres as ds to the backward of the add + LayerNorm that ends the block: "
        "add_layer_norm_bwd(dh, dres, saved.s2, ...)",
    "ds dropped at LayerNorm 2": "the backward of add + LayerNorm 2 did not get ds: s1 feeds LayerNorm 2 and the "
        "add after the MLP, so its gradient is ds (from above) plus LayerNorm 2's part: "
        "add_layer_norm_bwd(dh2, ds, saved.s1, ...)",
    "MLP branch without dres": "the MLP's output (the out GEMM's dy) got LayerNorm's gradient but not dres: both "
        "inputs of the add s2 = out(f) + s1 get the same ds = dres + dLayerNorm(dh), the dx add_layer_norm_bwd "
        "returns when it is given ds=dres",
    "residual without LayerNorm's part after the MLP": "the residual s1 got only dres from above, not the "
        "gradient through ln_next: both inputs of the add s2 = out(f) + s1 get the same ds, the dx that "
        "add_layer_norm_bwd(dh, dres, ...) returns",
    "attention branch without ds": "the attention's output (the proj GEMM's dy) got LayerNorm 2's gradient but "
        "not ds from above: both inputs of the add s1 = proj(o2) + x get the same gradient, the dx that "
        "add_layer_norm_bwd(dh2, ds, ...) returns",
    "dres_in without the attention branch": "dres_in is the gradient s1 got from above (ds) only: x also feeds "
        "LayerNorm 2 through s1 = proj(o2) + x, so dres_in is the dx that add_layer_norm_bwd(dh2, ds, ...) "
        "returns, the same gradient the proj GEMM gets",
    "dres returned unchanged": "dres_in is the dres the block was given: the residual stream's gradient grows in "
        "each block by what flows through its two LayerNorms; return the dx of add + LayerNorm 2's backward",
    "dres added twice": "ds holds dres twice: add_layer_norm_bwd(dh, dres, ...) already adds the ds it is given "
        "to the gradient through LayerNorm; its dx is the whole gradient of s2, add nothing to it",
    "dres added again to dres_in": "dres_in holds dres once more: the dx of add + LayerNorm 2's backward already "
        "carries it (through ds); return that dx as it is",
    # the GEMM given the LayerNorm's output gradient: the backward of add + LayerNorm stands between them
    "out GEMM given dh": "the out GEMM's dy is dh, the gradient of ln_next's output: the GEMM feeds the sum s2 "
        "that ln_next normalizes, so its dy is the gradient of s2, the ds that add_layer_norm_bwd(dh, dres, "
        "saved.s2, ...) returns",
    "proj GEMM given dh2": "the proj GEMM's dy is dh2, the gradient of LayerNorm 2's output: the GEMM feeds the "
        "sum s1 that LayerNorm 2 normalizes, so its dy is the gradient of s1, the dx that add_layer_norm_bwd(dh2, "
        "ds, saved.s1, ...) returns",
    "ds added twice at LayerNorm 2": "the gradient of s1 holds ds twice: add_layer_norm_bwd(dh2, ds, ...) already "
        "adds the ds it is given to the gradient through LayerNorm 2; its dx is the whole gradient of s1 (for the "
        "proj GEMM and dres_in), add nothing to it",
    "proj's dx with W.T": "the proj GEMM's input gradient used W.T: for y = x @ W.T + b, dx = dy @ W (W as stored, "
        "(out_features, in_features)); proj's W is square, so W.T ran without an error",
    "attention backward not causal": "attention_qkv_bwd was called with causal=False: the forward masked the "
        "future keys (causal), and the backward must too: attention_qkv_bwd(do, saved.qkv, saved.o, saved.lse, "
        "n_head, True, scale)",
    "do not laid out as o": "the attention's gradient do was read in the wrong layout: o2 is o.transpose(1, 2) "
        "reshaped to (B, N, d), so do = do2.view(B, N, n_head, head_dim).transpose(1, 2), laid out as saved.o "
        "(B, H, N, hd); a plain view to (B, H, N, hd) mixes heads and positions",
    GELU_GIVEN_F: "linear_gelu_bwd was given saved.f, GELU's output, as its acc: GELU's derivative is taken at "
        "its input, the pre-activation acc = h2 @ W.T that the forward saved (the bias is added inside), so pass "
        "saved.acc: linear_gelu_bwd(df, saved.h2, blk.fc.weight, blk.fc.bias, saved.acc)",
    # the weight scales only dx, so the LayerNorm's own dw and db are right and the first wrong tensor is the
    # GEMM after it: named here, by all the gradients, rather than as that GEMM's mistake
    LN_NEXT_GIVEN_LN2_WEIGHT: "add_layer_norm_bwd for ln_next was given blk.ln2.weight: its dx is the gradient "
        "through ln_next's own scale, add_layer_norm_bwd(dh, dres, saved.s2, ln_next.weight, saved.mean2, "
        "saved.rstd2)",
    LN2_GIVEN_LN_NEXT_WEIGHT: "add_layer_norm_bwd for LayerNorm 2 was given ln_next.weight: its dx is the "
        "gradient through LayerNorm 2's own scale, add_layer_norm_bwd(dh2, ds, saved.s1, blk.ln2.weight, "
        "saved.mean1, saved.rstd1)",
}


def _f64(t: torch.Tensor, grad: bool = False) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64).requires_grad_(grad)


def _vjp(fn, inputs, dy):
    """The gradients of ``fn(*inputs)`` for each input, given dy, in float64."""
    xs = [_f64(t, True) for t in inputs]
    with torch.enable_grad():
        return torch.autograd.grad(fn(*xs), xs, _f64(dy))


def _layer_norm(s, ln, dy, eps, weight=None):
    """(ds, dw, db) of LayerNorm(s) with ln's weight and bias; ``weight`` in place of ln's makes ds what a
    backward given the wrong LayerNorm's weight returns (dw and db do not read the weight)."""
    w = ln.weight if weight is None else weight
    return _vjp(lambda s, w, b: F.layer_norm(s, (s.shape[-1],), w, b, eps), (s, w, ln.bias), dy)


def _linear(dy, x, weight):
    """(dx, dW, db) of y = x @ W.T + b over the rows of 2-D views."""
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), _f64(x).reshape(-1, x.shape[-1])
    return (dy2 @ _f64(weight)).view(x.shape), dy2.t() @ x2, dy2.sum(0)


def _gelu_pre(df, acc, fc):
    """d(pre-activation) of f = gelu_tanh(a), a = acc + b, given df: what linear_gelu_bwd computes from the acc
    it is given (the right one is h2 @ W.T)."""
    a = _f64(acc).reshape(df.shape) + _f64(fc.bias)
    return _vjp(lambda a: F.gelu(a, approximate="tanh"), (a,), df)[0]


def _attention(do, qkv, n_head, scale):
    """dqkv of causal attention on the packed projection, given do laid out (B, H, N, hd)."""
    def attend(qkv):
        B, N, W = qkv.shape
        q, k, v = qkv.view(B, N, 3, n_head, W // (3 * n_head)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return _vjp(attend, (qkv,), do)[0]


def _attention_unmasked_backward(do, qkv, n_head, scale):
    """dqkv of a flash backward run with causal=False on a causal forward's o and logsumexp: every key's
    p = exp(q.k * scale - lse), the future ones too, and D = rowsum(do * o)."""
    B, N, W = qkv.shape
    q, k, v = _f64(qkv).view(B, N, 3, n_head, W // (3 * n_head)).permute(2, 0, 3, 1, 4)
    s = q @ k.transpose(-1, -2) * scale
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    lse = torch.logsumexp(s.masked_fill(~causal, float("-inf")), -1, keepdim=True)
    o = torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v
    p = torch.exp(s - lse)
    do = _f64(do)
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    dq, dk, dv = ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ do
    return torch.stack((dq, dk, dv), 0).permute(1, 3, 0, 2, 4).reshape(B, N, W)


def reference(blk, sv, dh, dres, ln_next, n_head: int, scale: float, eps: float, fault: str | None = None) -> dict:
    """Every gradient of one block in float64 from its saved activations, as :data:`ORDER` names them, plus
    each GEMM's dy (``"dy.out"`` ...); ``fault`` (a key of :data:`FLOW_FAULTS`) makes that mistake."""
    g, zero = {}, torch.zeros(sv.s2.shape, dtype=torch.float64)
    dres64 = zero if dres is None or fault == "dres dropped" else _f64(dres)
    d_ln, g["ln_next.weight"], g["ln_next.bias"] = _layer_norm(
        sv.s2, ln_next, dh, eps, blk.ln2.weight if fault == LN_NEXT_GIVEN_LN2_WEIGHT else None)
    g["dy.ln_next"] = _f64(dh)
    ds = dres64 + d_ln                                       # s2 = out(f) + s1: both inputs get ds
    if fault == "dres added twice":
        ds = ds + dres64
    d_out = {"MLP branch without dres": d_ln, "out GEMM given dh": _f64(dh)}.get(fault, ds)
    d_s1_above = dres64 if fault == "residual without LayerNorm's part after the MLP" else ds
    df, g["out.weight"], g["out.bias"] = _linear(d_out, sv.f, blk.out.weight)
    acc = sv.f if fault == GELU_GIVEN_F else _f64(sv.h2) @ _f64(blk.fc.weight).t()
    dacc = _gelu_pre(df, acc, blk.fc)
    dh2, g["fc.weight"], g["fc.bias"] = _linear(dacc, sv.h2, blk.fc.weight)
    d_ln2, g["ln2.weight"], g["ln2.bias"] = _layer_norm(
        sv.s1, blk.ln2, dh2, eps, ln_next.weight if fault == LN2_GIVEN_LN_NEXT_WEIGHT else None)
    g["dy.ln2"] = dh2
    ds1 = d_ln2 if fault == "ds dropped at LayerNorm 2" else d_s1_above + d_ln2   # s1 = proj(o2) + x
    if fault == "ds added twice at LayerNorm 2":
        ds1 = ds1 + d_s1_above
    d_proj = {"attention branch without ds": d_ln2, "proj GEMM given dh2": dh2}.get(fault, ds1)
    g["dres_in"] = {"dres_in without the attention branch": d_s1_above, "dres returned unchanged": dres64,
                    "dres added again to dres_in": ds1 + dres64}.get(fault, ds1)
    do2, g["proj.weight"], g["proj.bias"] = _linear(d_proj, sv.o2, blk.proj.weight)
    if fault == "proj's dx with W.T":
        do2 = (d_proj.reshape(-1, d_proj.shape[-1]) @ _f64(blk.proj.weight).t()).view(sv.o2.shape)
    B, H, N, hd = sv.o.shape
    do = do2.view(B, H, N, hd) if fault == "do not laid out as o" else do2.view(B, N, H, hd).transpose(1, 2)
    if fault == "attention backward not causal":
        dqkv = _attention_unmasked_backward(do, sv.qkv, n_head, scale)
    else:
        dqkv = _attention(do, sv.qkv, n_head, scale)
    g["dh_in"], g["qkv.weight"], g["qkv.bias"] = _linear(dqkv, sv.h1, blk.qkv.weight)
    g.update({"dy.out": d_out, "dy.fc": dacc, "dy.proj": d_proj, "dy.qkv": dqkv})
    return g


def error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (inf where got holds a NaN or an infinity)."""
    g = got.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(g).all()):
        return float("inf")
    return float((g - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)


def _ln_weight_grad(dy, s, mean, rstd) -> torch.Tensor:
    """dw of y = x_hat * w + b with x_hat = (s - mean) * rstd, whichever sum and statistics it is given."""
    n = s.shape[-1]
    x_hat = (_f64(s).reshape(-1, n) - _f64(mean).reshape(-1, 1)) * _f64(rstd).reshape(-1, 1)
    return (dy.reshape(-1, n) * x_hat).sum(0)


def tensor_faults(name: str, got: torch.Tensor, ref: dict, sv, rows: int, tol: float) -> str | None:
    """The mistake that makes this one tensor, if it is a usual one."""
    r = ref[name]
    lin, _, kind = name.partition(".")
    cands = {}
    if kind == "weight" and lin in ("out", "fc", "proj", "qkv"):
        dy = ref[f"dy.{lin}"].reshape(-1, r.shape[0])
        if r.shape[0] == r.shape[1]:
            cands["transposed: dW = dy.T @ x is (out_features, in_features), not x.T @ dy"] = r.t()
        cands[f"averaged over the rows: dW = dy.T @ x sums over all {rows} rows, not their mean"] = r / rows
        # the residual sums too: s1 and s2 are the LayerNorms' inputs, which a GEMM after a LayerNorm does not read
        inputs = {"saved.h1": sv.h1, "saved.h2": sv.h2, "saved.o2": sv.o2, "saved.f": sv.f, "saved.acc": sv.acc,
                  "saved.o reshaped without its transpose": sv.o,   # (B, H, N, hd) read as (B * N, d)
                  "saved.s1, the sum before LayerNorm 2": sv.s1, "saved.s2, the sum before ln_next": sv.s2}
        right = {"out": "saved.f", "fc": "saved.h2", "proj": "saved.o2", "qkv": "saved.h1"}[lin]
        for label, x in inputs.items():
            if label != right and x.numel() == rows * r.shape[1]:
                cands[f"taken from {label}: the {lin} GEMM's input is {right} (dW = dy.T @ the GEMM's input)"] = \
                    dy.t() @ _f64(x).reshape(rows, -1)
    if kind == "bias":
        cands[f"averaged over the rows: db is dy summed over all {rows} rows, not their mean"] = r / rows
    if lin in ("ln_next", "ln2"):
        if kind == "weight":   # add_layer_norm_bwd given the other LayerNorm's sum, or its mean and rstd
            own = {"ln2": "1", "ln_next": "2"}[lin]
            theirs = "2" if own == "1" else "1"
            s, mean, rstd = (getattr(sv, f"{t}{own}") for t in ("s", "mean", "rstd"))
            s_other, mean_other, rstd_other = (getattr(sv, f"{t}{theirs}") for t in ("s", "mean", "rstd"))
            dy = ref[f"dy.{lin}"]
            cands[f"computed with the other LayerNorm's statistics: {lin}'s backward normalizes its own sum with "
                  f"its own mean and rstd (saved.mean{own}, saved.rstd{own})"] = \
                _ln_weight_grad(dy, s, mean_other, rstd_other)
            cands[f"computed from the other LayerNorm's sum (saved.s{theirs}): {lin}'s backward reads the sum it "
                  f"normalized, saved.s{own}, with its own saved.mean{own}, saved.rstd{own}"] = \
                _ln_weight_grad(dy, s_other, mean, rstd)
            cands[f"computed with mean and rstd swapped: add_layer_norm_bwd(dy, ds, s, weight, mean, rstd) takes "
                  f"saved.mean{own} before saved.rstd{own}"] = _ln_weight_grad(dy, s, rstd, mean)
        other = f"{lin}.{'bias' if kind == 'weight' else 'weight'}"
        cands[f"{lin}'s weight and bias gradients swapped: add_layer_norm_bwd returns (dx, dw, db)"] = ref[other]
    for why, c in cands.items():
        if error(got, c) <= tol:
            return why
    return None


# --- slips that raise: named by the operands of the torch call that raised (checkers.calls.FailedTorchCall) ---


def _holds(t, w: torch.Tensor) -> bool:
    """Whether ``t`` holds ``w``'s values: ``w`` itself, a view of it or a copy (same shape and dtype)."""
    return isinstance(t, torch.Tensor) and t.shape == w.shape and t.dtype == w.dtype and torch.equal(t, w)


def _runs(func, args, kwargs) -> bool:
    try:
        func(*args, **kwargs)
    except Exception:  # noqa: BLE001 (any error: the changed call does not run either)
        return False
    return True


def dx_weight_slip(func, args, kwargs, weights: dict) -> str | None:
    """``"{lin}'s dx with W.T: ..."`` when the call that raised multiplied by a GEMM's weight the wrong way round
    (``weights``: {GEMM: weight}, those whose dx the student writes): the same call with that operand transposed
    runs. Only a square W (proj) runs transposed, and FLOW_FAULTS names that one by value; out's and qkv's raise."""
    for i, a in enumerate(args):
        for lin, w in weights.items():
            for used_t, used in ((True, w.t()), (False, w)):
                if w.shape[0] == w.shape[1] or not _holds(a, used):
                    continue
                if not _runs(func, (*args[:i], used.t(), *args[i + 1:]), kwargs):
                    continue
                what = (f"{lin}'s dx with W.T: the {lin} GEMM's input gradient multiplied by blk.{lin}.weight.T"
                        if used_t else f"{lin}'s dx with W where W.T belongs: the {lin} GEMM's input gradient took "
                        f"blk.{lin}.weight as stored where its transpose fits (F.linear(dy, W), for one, computes "
                        "dy @ W.T)")
                return (f"{what}; for y = x @ W.T + b, dx = dy @ W with W as stored, (out_features, in_features) = "
                        f"{tuple(w.shape)}: it takes dy's {w.shape[0]} columns to x's {w.shape[1]}")
    return None


def grad_slip(label: str, p: torch.Tensor, value, activation: tuple) -> str:
    """What is wrong with ``value`` assigned to ``p.grad`` (``label``), which torch refused. ``activation``:
    the (B, N, d) shape of the block's input, for a gradient of an activation given to a parameter."""
    if not isinstance(value, torch.Tensor):
        return f"{label} was given a {type(value).__name__}: assign a tensor shaped like the parameter"
    shape, want = tuple(value.shape), tuple(p.shape)
    given = f"{label} was given a {shape} {str(value.dtype).removeprefix('torch.')} tensor"
    if shape == want:
        return (f"{given}; the parameter is {p.dtype}, and a .grad has its parameter's dtype: torch.mm of the "
                "model's own tensors gives it; one computed in float32 (.float()) needs .to(the parameter's dtype)")
    if len(want) == 2 and shape == want[::-1]:
        return f"{given}, the transpose of {want}: dW = dy.T @ x is (out_features, in_features), not x.T @ dy"
    if len(want) == 2 and shape[1:] == want:
        return (f"{given}, one dW per sequence of the batch, not summed: dW = dy.T @ x over all B*N rows, with dy "
                "and x reshaped to (B*N, features) matrices")
    if len(shape) == 3 and shape[:2] == activation[:2]:
        return (f"{given}, an activation's gradient: add_layer_norm_bwd and linear_gelu_bwd return (dx, dw, db) in "
                "that order, so unpack dx first")
    if len(want) == 1 and shape[-1:] == want:
        return (f"{given}: summed over one axis of dy only; db sums dy over all B*N rows, "
                f"dy.reshape(-1, {want[0]}).sum(0), shape {want}")
    if len(want) == 1 and value.numel() == activation[0] * activation[1]:
        return (f"{given}: summed over the features, not over the rows; db sums dy over all B*N rows, "
                f"dy.reshape(-1, {want[0]}).sum(0), shape {want}")
    return f"{given}; the parameter is {want} {p.dtype}, and its .grad must be too"


def raised_slip(raised, weights: dict, grads: dict, activation: tuple) -> str | None:
    """The slip behind the torch call that raised (``checkers.calls.FailedTorchCall.that_raised``), named by its
    operands, or None: a .grad torch refused (``grads``: {label: parameter}), or a GEMM's weight the wrong way
    round (``weights``). Torch's own words give two shapes and the student's line, which in a helper shared by
    the GEMMs does not say which one."""
    if raised is None:
        return None
    func, args, kwargs = raised
    if func == torch.Tensor.grad.__set__ and len(args) == 2:                 # p.grad = value
        label = next((lbl for lbl, p in grads.items() if p is args[0]), None)
        return None if label is None else grad_slip(label, args[0], args[1], activation)
    return dx_weight_slip(func, args, kwargs, weights)


def scale_slip(got: float, scale: float) -> str:
    """attention_qkv_bwd given ``got`` where the forward scaled its scores by ``scale``."""
    return (f"attention backward given scale={got:.6g}: attention_qkv_bwd recomputes the forward's scores "
            f"q.k * scale, so it takes the forward's scale, {scale:.6g} (1/sqrt(head_dim)): pass the scale your "
            "function is given")
