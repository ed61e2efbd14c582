"""Checks for chapter 12's exercise 12.3: one block's backward by hand.

:func:`check_block_backward` judges a student's

    block_backward(blk, saved, dh, dres, ln_next, n_head, scale) -> (dh_in, dres_in)

the backward of one :class:`course_utils.gpt.Block` of :class:`course_utils.step.HandStep`'s forward:
``blk`` the block, ``saved`` its :class:`course_utils.step.Saved`, ``dh`` the gradient of the block's
output h (``ln_next``'s output), ``dres`` the gradient of the residual stream s2 it leaves (None for
the last block), ``ln_next`` the LayerNorm that follows the block (the next block's ``ln1``, or
``ln_f``). It writes the ``.grad`` of every parameter of the block and of ``ln_next`` and returns
the gradients of the block's inputs: h1 (``saved.h1``) and the residual stream x it received.

Every call builds a small GPT (fresh random weights, LayerNorm parameters and biases included, and a
fresh batch), runs ``HandStep.forward``, and calls the student's function on each block from the
last to the first, as the step does, with the gradients the student's previous call returned (the
loss's dh times a power-of-two loss scale, which keeps float16's gradients clear of subnormals). Each
block is compared with a float64 reference made of the same saved activations, per op with
torch.autograd in float64 (:func:`reference`); a wrong answer is compared with the float64 answer of
each usual mistake (:data:`FLOW_FAULTS`, then each tensor's own: a transposed or misplaced GEMM, a
bias or dW averaged) to name it; an error torch raised is named by that call's operands (which .grad, which
GEMM's weight the wrong way round), and attention_qkv_bwd's scale by the argument itself. The student's
function must call the course's backward functions (``add_layer_norm_bwd`` twice, ``linear_gelu_bwd``
and ``attention_qkv_bwd`` once) and no autograd, nor :mod:`course_utils.step`'s own backward: those
are refused by reading the code and, while it runs, by watching the calls.
"""

from __future__ import annotations

import inspect
import io
import math
import textwrap
import tokenize
import traceback

import torch

from .. import check, env
from ..faults import block_backward as faults
from ..faults.block_backward import FLOW_FAULTS, GELU_GIVEN_F, ORDER, error, reference, tensor_faults
from .calls import FailedTorchCall, run_watched

NAME = "block backward"
LAYERS, HEADS, WIDTH, SEQ, BATCH = 2, 2, 32, 24, 3
# max |got - ref| / max |ref| per tensor against float64. The course's solution on the CPU, worst of 40 models
# (80 blocks) each: float32 6.6e-7, float16 1.1e-3 (2.3e-3 over 150 more: ln2.weight, a 72-row sum that cancels,
# amplifies dh2's rounding; median 4.8e-4); bfloat16 (a GPU) gets float16's times its 8x wider epsilon.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}
SIGNATURE = "block_backward(blk, saved, dh, dres, ln_next, n_head, scale) -> (dh_in, dres_in)"
HINT = {
    "ln_next": "y, s2 = add_layer_norm(out(f), s1) with ln_next's weight: add_layer_norm_bwd(dh, dres, saved.s2, "
               "ln_next.weight, saved.mean2, saved.rstd2) returns (ds, dw, db)",
    "out": "the out GEMM reads saved.f: dW = ds.T @ f over all B*N rows, db = ds summed over the rows",
    "fc": "linear_gelu_bwd(df, saved.h2, blk.fc.weight, blk.fc.bias, saved.acc) returns (dh2, dw, db)",
    "ln2": "h2, s1 = add_layer_norm(proj(o2), x) with ln2's weight: add_layer_norm_bwd(dh2, ds, saved.s1, "
           "blk.ln2.weight, saved.mean1, saved.rstd1)",
    "proj": "the proj GEMM reads saved.o2: dW = dy.T @ o2, db = dy summed over the rows, with dy the gradient "
            "of s1 (add_layer_norm_bwd's dx)",
    "qkv": "the qkv GEMM reads saved.h1: dW = dqkv.T @ h1, db = dqkv summed over the rows, dqkv from "
           "attention_qkv_bwd(do, saved.qkv, saved.o, saved.lse, n_head, True, scale) with do laid out as saved.o",
    "dh_in": "dh_in = dqkv @ W of the qkv GEMM, shaped as saved.h1",
    "dres_in": "x feeds the add before LayerNorm 2: dres_in is the dx that add_layer_norm_bwd returns for it",
}
GRAD_SHAPES = ("every .grad has its parameter's shape and dtype: dW = dy.T @ x is (out_features, in_features) "
               "(dy and x as (B*N, features) matrices), db = dy summed over all B*N rows is (out_features,)")
# --- refusing the answer key ---------------------------------------------------------------------------

_AUTOGRAD_NAMES = ("autograd", "requires_grad", "requires_grad_", "enable_grad")


def _autograd_in(src: str) -> str | None:
    """The first use of autograd in this code (comments and strings left out), or None."""
    try:
        toks = [t.string for t in tokenize.generate_tokens(io.StringIO(textwrap.dedent(src)).readline)
                if t.type in (tokenize.NAME, tokenize.OP)]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    for i, t in enumerate(toks):
        if t in _AUTOGRAD_NAMES:
            return t
        if t == "backward" and toks[i - 1:i] == ["."] and toks[i + 1:i + 2] == ["("]:
            return ".backward("
    return None


def _forbidden() -> dict:
    from .. import step
    from ..ops import block
    return {"hand-written step (course_utils.step.HandStep)": step.HandStep,
            "hand-written backward (course_utils.step.HandStep.backward)": step.HandStep.backward,
            "block backward (course_utils.ops.block.block_backward)": block.block_backward,
            "one-node block backward (course_utils.ops.block.BlockFunction.backward)": block.BlockFunction.backward,
            "GEMM backward (course_utils.ops.block.linear_backward)": block.linear_backward,
            "gradient comparison (course_utils.step.grads_match)": step.grads_match,
            "torch.autograd.grad": torch.autograd.grad, "torch.autograd.backward": torch.autograd.backward}


def _required() -> dict:
    from ..ops import attn, linear, norms
    return {"add_layer_norm_bwd": norms.add_layer_norm_bwd, "linear_gelu_bwd": linear.linear_gelu_bwd,
            "attention_qkv_bwd": attn.attention_qkv_bwd}


def _refuse_source(fn) -> None:
    """The course's backward and autograd refused by reading the student's code and their helpers'."""
    check.refuse_answer_key(NAME, fn, _forbidden())
    mine = [fn] + [o for _, o in check._referenced(fn) if inspect.isfunction(o) and o.__module__ == fn.__module__]
    for f in mine:
        try:
            src = inspect.getsource(f)
        except (OSError, TypeError):
            continue
        word = _autograd_in(src)
        if word:
            raise check.CheckFailure(f"{NAME}: your code uses autograd ({word!r} in {f.__name__}): the "
                                     "exercise is the backward written without it. Call the course's backward "
                                     "functions and torch.mm in reverse order of the forward.")


class _NoAutograd:
    """torch.autograd.backward/grad and Tensor.backward raise while the student's function runs."""

    def __enter__(self):
        self.saved = (torch.autograd.backward, torch.autograd.grad, torch.Tensor.backward)

        def refuse(*_a, **_k):
            raise check.CheckFailure(f"{NAME}: your function called autograd (backward or torch.autograd.grad) while "
                                     "it ran: the exercise is the backward without it. Call the course's backward "
                                     "functions and torch.mm in reverse order of the forward.")
        torch.autograd.backward = torch.autograd.grad = torch.Tensor.backward = refuse
        return self

    def __exit__(self, *exc):
        torch.autograd.backward, torch.autograd.grad, torch.Tensor.backward = self.saved
        return False


# --- calling and judging --------------------------------------------------------------------------------


def _your_line(e: BaseException) -> str:
    """The last line of the student's own code in the traceback (not torch's, not the course's)."""
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        if "site-packages" not in fr.filename and "course_utils" not in fr.filename and fr.line:
            return f" (at: {fr.line.strip()})"
    return ""


def _gelu_given_f(calls, sv) -> bool:
    """Whether linear_gelu_bwd was given GELU's output saved.f (or a view of it) as its acc. saved.f is (B, N, 4d)
    where acc is (B * N, 4d), so passed as it is it makes linear_gelu_bwd raise in its GEMM before a gradient can
    be compared: the argument itself names the mistake. (Reshaped, it runs, and FLOW_FAULTS names it by value.)"""
    acc = (calls.first("linear_gelu_bwd") or {}).get("acc")
    return (isinstance(acc, torch.Tensor) and sv.f.numel() > 0
            and acc.untyped_storage().data_ptr() == sv.f.untyped_storage().data_ptr())


def _check_scale(case, calls, scale) -> None:
    """attention_qkv_bwd given the forward's scale, judged by the argument itself: this small model's attention is
    near uniform, so a wrong one moves blk.qkv.weight.grad little (float32, measured: 1.0 for 0.25 by 3-5%,
    1/sqrt(d_model) for 1/sqrt(head_dim) by under 1%, inside bfloat16's 4e-2), and by value it was blamed on the
    qkv GEMM, the first tensor after it."""
    got = (calls.first("attention_qkv_bwd") or {}).get("scale")
    if isinstance(got, (int, float)) and not math.isclose(got, scale, rel_tol=1e-6):
        raise check.CheckFailure(f"{case}: {faults.scale_slip(got, scale)}.")


def _call(fn, case, args):
    """fn(*args) under the refusals; the calls of the course's functions it made. A call of the course's
    backward is refused even when the student's function raised after it."""
    watched = {**_required(), **{d: f for d, f in _forbidden().items() if inspect.isfunction(f)}}

    def caught(*a):
        try:
            return fn(*a), None
        except Exception as e:  # noqa: BLE001 (judged below, once the calls are known)
            return None, e

    with _NoAutograd(), FailedTorchCall() as torch_calls:
        (out, error), calls = run_watched(caught, args, watched)
    used = [d for d in _forbidden() if calls.first(d) is not None]
    if used:
        raise check.CheckFailure(f"{case}: while your function ran it called the course's {used[0]}: that is the "
                                 "answer the check compares with. Write the block's backward yourself.")
    if isinstance(error, (NotImplementedError, check.CheckFailure)):
        raise error
    if error is not None and _gelu_given_f(calls, args[1]):
        raise check.CheckFailure(f"{case}: {GELU_GIVEN_F}: {FLOW_FAULTS[GELU_GIVEN_F]}; your function raised "
                                 f"{type(error).__name__}: {str(error)[:200]}{_your_line(error)}.") from error
    blk, ln_next = args[0], args[4]
    weights = {n: getattr(blk, n).weight for n in ("out", "proj", "qkv")}   # the GEMMs whose dx the student writes
    slip = faults.raised_slip(torch_calls.that_raised(error), weights,
                              {_label(n): p for n, p in _params(blk, ln_next).items()}, tuple(args[1].h1.shape))
    if slip is not None:
        raise check.CheckFailure(f"{case}: {slip} (your function raised {type(error).__name__}"
                                 f"{_your_line(error)}).") from error
    if error is not None:
        text = str(error)[:300]
        hint = (GRAD_SHAPES if "assign a gradient" in text else
                "every .grad is None when the block's backward starts (the step zeroes gradients by setting them "
                "to None): assign it, lin.weight.grad = ..., rather than adding into it" if "NoneType" in text else
                f"it is called as {SIGNATURE}, as the step calls it for each block from the last")
        raise check.CheckFailure(f"{case}: your function raised {type(error).__name__}: {text}{_your_line(error)}\n"
                                 f"Hint: {hint}.") from error
    counts = {d: sum(1 for name, _ in calls.seen if name == d) for d in _required()}
    for d, want in (("add_layer_norm_bwd", 2), ("linear_gelu_bwd", 1), ("attention_qkv_bwd", 1)):
        if counts[d] < want:
            raise check.CheckFailure(f"{case}: your function called {d} {counts[d]} time(s), the block's backward "
                                     f"needs it {want}: the exercise builds the backward from the course's backward "
                                     "functions (norms.add_layer_norm_bwd for each fused add + LayerNorm, "
                                     "linear.linear_gelu_bwd for the MLP's first GEMM, attn.attention_qkv_bwd) and "
                                     "torch.mm for the other GEMMs.")
    _check_scale(case, calls, args[6])
    return out


def _params(blk, ln_next) -> dict:
    return {"ln_next.weight": ln_next.weight, "ln_next.bias": ln_next.bias, **{
        f"{lin}.{p}": getattr(getattr(blk, lin), p) for lin in ("out", "fc", "ln2", "proj", "qkv")
        for p in ("weight", "bias")}}


def _collect(case, out, params, like) -> dict:
    """The student's gradients by name, after the return value and every .grad were validated."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        what = f"{len(out)} items" if isinstance(out, (tuple, list)) else type(out).__name__
        raise check.CheckFailure(f"{case}: your function returned {what}: return the pair (dh_in, dres_in), the "
                                 "gradients of saved.h1 and of the block's residual input x, each a tensor shaped "
                                 "like saved.h1.")
    got = {}
    for name, t in zip(("dh_in", "dres_in"), out):
        shape = tuple(like.shape)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != like.dtype \
                or t.device != like.device:
            what = (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor)
                    else type(t).__name__)
            raise check.CheckFailure(f"{case}: {name} is {what}; expected a {shape} tensor of {like.dtype} on "
                                     f"{like.device}, shaped like saved.h1 (B, N, d) in the model's dtype.")
        got[name] = t
    for name, p in params.items():
        g = p.grad
        if g is None:
            kind = "bias" if name.endswith("bias") else "weight"
            raise check.CheckFailure(f"{case}: {_label(name)} was not written (it is None): assign the {kind}'s "
                                     f"gradient to .grad; {HINT[name.split('.')[0]]}.")
        if tuple(g.shape) != tuple(p.shape) or g.dtype != p.dtype:
            raise check.CheckFailure(f"{case}: {_label(name)} is {tuple(g.shape)} {g.dtype}; expected {tuple(p.shape)} "
                                     f"{p.dtype}: {GRAD_SHAPES}.")
        got[name] = g
    return got


def _label(name: str) -> str:
    """How the student's code names a gradient: blk.out.weight.grad, ln_next.bias.grad, dh_in."""
    return name if name in ("dh_in", "dres_in") else f"{'' if name.startswith('ln_next') else 'blk.'}{name}.grad"


def _judge(case, got: dict, ref: dict, fault_refs, sv, tol) -> None:
    bad = next((n for n in ORDER if not error(got[n], ref[n]) <= tol), None)
    if bad is None:
        return
    if error(got["dh_in"], ref["dres_in"]) <= tol and error(got["dres_in"], ref["dh_in"]) <= tol:
        raise check.CheckFailure(f"{case}: dh_in and dres_in returned in each other's place: return (dh_in, "
                                 "dres_in), the gradient of saved.h1 (the qkv GEMM's dx) first, then the residual "
                                 "stream's (add + LayerNorm 2's dx).")
    for fault, why in FLOW_FAULTS.items():
        alt = fault_refs(fault)
        if alt is not None and all(error(got[n], alt[n]) <= tol for n in ORDER):
            raise check.CheckFailure(f"{case}: {fault}: {why}.")
    rows = sv.h1.numel() // sv.h1.shape[-1]
    why = tensor_faults(bad, got[bad], ref, sv, rows, tol)
    if why is not None:
        raise check.CheckFailure(f"{case}: {_label(bad)} is {why}.")
    err = error(got[bad], ref[bad])
    raise check.CheckFailure(f"{case}: {_label(bad)} differs from the float64 reference: max |error| = {err:.3g} "
                             f"of its largest value (allowed {tol:g}); every gradient before it in the backward's "
                             f"order ({', '.join(map(_label, ORDER[:ORDER.index(bad)])) or 'none'}) is right.\n"
                             f"Hint: {HINT[bad.split('.')[0]]}.")


def _model(dtype):
    """A small GPT on the course's ops with fresh random weights, biases and LayerNorm parameters."""
    from .. import gpt
    g = check.generator("cpu")
    cfg = gpt.GPTConfig(n_layer=LAYERS, n_head=HEADS, d_model=WIDTH, seq_len=SEQ)
    m = gpt.GPT(cfg, seed=int(torch.randint(0, 2**31, (1,), generator=g)))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif ".ln" in name or name.startswith("ln_f"):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)
    return m.to(device=env.DEVICE, dtype=dtype).use("course")


def _batch(vocab):
    g = check.generator("cpu")
    x, y = (torch.randint(0, vocab, (BATCH, SEQ), generator=g) for _ in range(2))
    return x.to(env.DEVICE), y.to(env.DEVICE)


def _dtypes():
    # on a GPU the hand step runs without autocast, on 16-bit weights (float32 ones mean autocast)
    return tuple(d for d in env.supported_dtypes() if not (env.on_gpu() and d == torch.float32))


def _one_model(fn, dtype) -> None:
    from .. import step
    m = _model(dtype)
    hand = step.HandStep(m, None)
    _, dh, _, ctx = hand.forward(*_batch(m.cfg.vocab))
    # a loss scale, as float16 training uses: a power of two (exact) that brings the largest |dh| near 1, so
    # that the gradients stay clear of float16's subnormals (below 6e-5) and the comparison sees the math
    dh = dh * 2.0 ** -torch.log2(dh.abs().max().float()).round().item()
    dres = None
    for i in reversed(range(LAYERS)):
        blk, sv = m.blocks[i], ctx["blocks"][i]
        ln_next = m.blocks[i + 1].ln1 if i + 1 < LAYERS else m.ln_f
        case = (f"{NAME} ({str(dtype).removeprefix('torch.')}, block {i} of {LAYERS}, "
                f"{'dres given' if dres is not None else 'the last block: dres=None'})")
        params = _params(blk, ln_next)
        for p in params.values():
            p.grad = None
        before = [t.clone() for t in (dh, dres) if t is not None]
        ref = reference(blk, sv, dh, dres, ln_next, hand.n_head, hand.scale, hand.eps)
        out = _call(fn, case, (blk, sv, dh, dres, ln_next, hand.n_head, hand.scale))
        if not all(torch.equal(a, b) for a, b in zip(before, [t for t in (dh, dres) if t is not None])):
            raise check.CheckFailure(f"{case}: your function changed dh or dres in place: the step keeps them "
                                     "(a GPU step replays them); write new tensors.")
        got = _collect(case, out, params, sv.h1)

        def fault_ref(fault, blk=blk, sv=sv, dh=dh, dres=dres, ln_next=ln_next):
            if fault in ("dres dropped", "dres added twice", "dres added again to dres_in") and dres is None:
                return None
            return reference(blk, sv, dh, dres, ln_next, hand.n_head, hand.scale, hand.eps, fault)
        _judge(case, got, ref, fault_ref, sv, TOL[dtype])
        dh, dres = got["dh_in"], got["dres_in"]


def check_block_backward(fn, name: str = NAME) -> None:
    """Judge ``fn`` (see the module docstring) on a fresh GPT of each dtype the hand step runs."""
    _refuse_source(fn)
    for dtype in _dtypes():
        _one_model(fn, dtype)
    check.verdict(name, "every block's parameter gradients and input gradients match float64 on every dtype "
                        "tried, with and without the residual's gradient from above, from the course's backward "
                        "functions and torch.mm, without autograd")
