"""Warm-up (every tile choice made before the hot path) and what a call costs the host.

:func:`warmup` runs every op forward and backward once on the shapes of a pre-norm GPT block, so
that each launch plan (the timed choices of chapters 7, 9, 10 and 11 included) is chosen and cached
before a step is timed or captured in a CUDA graph. One eager step of the model does the same:
every first call of a (shape, dtype, device) chooses and caches its plan.

:func:`host_overhead_table` times, per op, the host's cost of one call from Python: the course's
wrapper (its ``autograd.Function`` fast path), the registered ``torch.ops.course`` op (the
dispatcher's Python path, what ``torch.compile`` graphs call) and the aten counterpart, on tiny
shapes whose GPU time is far below the host's, so the wall time of a loop of calls is host time.
Its last two rows are floors: a Python ``autograd.Function`` around one launch each way against aten's ``neg``
(:data:`FLOOR_ROW`: what any op built this way pays, before its own Python), then one launch of a one-element
Triton kernel against one aten ``add_``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import env
from ..tuned.launch import launch


@triton.jit
def touch_kernel(x_ptr):
    """The smallest useful launch (one program adds 1 to one element): the floor of a Triton call."""
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


class _OneLaunchEachWay(torch.autograd.Function):
    """The floor of a course op called through a Python ``autograd.Function``: a forward of one allocation and
    one launch (the course's launch path), a backward of the same. Its values are not used: only its host cost.
    It allocates with ``empty_like``, the cheapest allocation call from Python (``ops/_lib.py`` says why): a floor
    that paid for ``new_empty``'s argument parsing would add that to every op's allowance."""

    @staticmethod
    def forward(ctx, x):
        y = torch.empty_like(x)
        launch(touch_kernel, "floor", (1,), (y,), {})
        return y

    @staticmethod
    def backward(ctx, dy):
        dx = torch.empty_like(dy)
        launch(touch_kernel, "floor", (1,), (dx,), {})
        return dx


#: the last row of :func:`host_overhead_table` but one: what a Python autograd.Function around one launch each
#: way costs against aten's one-kernel op each way (``neg``: one kernel forward, one backward)
FLOOR_ROW = "(autograd floor: one launch each way / aten neg)"


def _device(device):
    return torch.device(device) if device is not None else env.DEVICE


def _block_inputs(batch, seq, d_model, n_head, vocab, dtype, residual_dtype, device, requires_grad=True):
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, dt=dtype, scale=1.0):
        t = (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)
        return t.requires_grad_(requires_grad)

    d, hd = d_model, d_model // n_head
    return dict(
        resid=rand(batch, seq, d, dt=residual_dtype), sub=rand(batch, seq, d), w=rand(d, dt=residual_dtype),
        b=rand(d, dt=residual_dtype, scale=0.1), qkv=rand(batch, seq, 3 * d, scale=0.5),
        fc_in=rand(batch, seq, d), fc_w=rand(4 * d, d, scale=d ** -0.5), fc_b=rand(4 * d, scale=0.1),
        drop_b=rand(d, scale=0.1),
        logits=rand(batch * seq, vocab), targets=torch.randint(0, vocab, (batch * seq,), generator=g).to(device),
        hd=hd, n_head=n_head)


def _block_calls(t, ops, seed):
    """(name, callable) for each op on the block's shapes; each returns a tensor to backpropagate."""
    B, N, _ = t["resid"].shape
    H, hd = t["n_head"], t["hd"]

    def attention():
        q, k, v = t["qkv"].view(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)
        return ops.attention(q, k, v, True, hd ** -0.5)

    return [
        ("layer_norm", lambda: ops.layer_norm(t["resid"], t["w"], t["b"], 1e-5)),
        ("add_layer_norm", lambda: ops.add_layer_norm(t["sub"], t["resid"], t["w"], t["b"], 1e-5)),
        ("linear_gelu", lambda: ops.linear_gelu(t["fc_in"], t["fc_w"], t["fc_b"])),
        ("attention", attention),
        ("cross_entropy", lambda: ops.cross_entropy(t["logits"], t["targets"])),
        ("bias_gelu_dropout", lambda: ops.bias_gelu_dropout(t["fc_in"], t["drop_b"], 0.1, seed)),
    ]


def warmup(batch: int, seq: int, d_model: int, n_head: int, vocab: int, *, dtype: torch.dtype | None = None,
           residual_dtype: torch.dtype = torch.float32, device=None) -> dict[str, int]:
    """Choose and cache every launch plan for a pre-norm GPT block of these sizes (forward and backward);
    returns how many plans each module holds now. ``dtype`` is the activations' (default: bfloat16 on
    a GPU, float16 under the interpreter); the residual stream and the norms' weights are ``residual_dtype``."""
    import course_utils.ops as ops

    from . import attn as A
    from . import linear as L
    from . import loss as C
    from . import norms as Nm
    device = _device(device)
    dtype = dtype or (torch.bfloat16 if env.on_gpu() else torch.float16)
    t = _block_inputs(batch, seq, d_model, n_head, vocab, dtype, residual_dtype, device)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    for _, call in _block_calls(t, ops, seed):
        outs = call()
        outs = outs if isinstance(outs, tuple) else (outs,)
        sum(o.float().sum() for o in outs).backward()
    if env.on_gpu():
        torch.cuda.synchronize()
    return {"norms": len(Nm.PLANS), "linear": len(L.PLANS), "attention": len(A.PLANS), "loss": len(C.PLANS)}


def _torch_add_layer_norm(x, residual, w, b):
    s = x + residual
    return F.layer_norm(s, (s.shape[-1],), w, b, 1e-5), s


def _aten_calls(t):
    B, N, _ = t["resid"].shape
    H, hd = t["n_head"], t["hd"]
    d = t["resid"].shape[-1]

    def attention():
        q, k, v = t["qkv"].view(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {
        "layer_norm": lambda: F.layer_norm(t["resid"], (d,), t["w"], t["b"], 1e-5),
        "add_layer_norm": lambda: _torch_add_layer_norm(t["sub"], t["resid"], t["w"], t["b"]),
        "linear_gelu": lambda: F.gelu(F.linear(t["fc_in"], t["fc_w"], t["fc_b"]), approximate="tanh"),
        "attention": attention,
        "cross_entropy": lambda: F.cross_entropy(t["logits"].float(), t["targets"]),
        "bias_gelu_dropout": lambda: F.dropout(F.gelu(t["fc_in"] + t["drop_b"], approximate="tanh"), 0.1),
    }


class _Dispatcher:
    """The ops called through ``torch.ops.course`` (what a compiled graph calls), same signatures."""

    @staticmethod
    def layer_norm(x, w, b, eps):
        return torch.ops.course.layer_norm(x, w, b, eps)

    @staticmethod
    def add_layer_norm(x, r, w, b, eps):
        return torch.ops.course.add_layer_norm(x, r, w, b, eps)

    @staticmethod
    def linear_gelu(x, w, b):
        return torch.ops.course.linear_gelu(x, w, b)

    @staticmethod
    def attention(q, k, v, causal, scale):
        return torch.ops.course.attention(q, k, v, causal, scale)

    @staticmethod
    def cross_entropy(logits, targets):
        return torch.ops.course.cross_entropy(logits, targets)

    @staticmethod
    def bias_gelu_dropout(x, b, p, seed):
        return torch.ops.course.bias_gelu_dropout(x, b, p, seed)


def _per_call_us(fn, n_calls: int, sync) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(n_calls):
        fn()
    host = time.perf_counter() - start   # the loop's issue time; the GPU may still be running
    sync()
    return host / n_calls * 1e6


#: interleaved rounds of :func:`host_overhead_table`: a lent host's cores slow down and speed up over seconds
#: (chapter 12, section 9), so every op's three calls and the floor's two are timed in turn, round after round,
#: and each keeps its median: a slow spell falls on all of them, not on whichever ran then (an op's bound adds
#: the floor's extra to its aten time, so the two must come from the same spells)
ROUNDS = 5


def _interleaved_us(fns, n_calls: int, sync, rounds: int = ROUNDS) -> list[float]:
    """Per function, the median over ``rounds`` of its host us per call (``n_calls // rounds`` calls a round),
    the functions timed one after another within each round."""
    per = max(1, n_calls // rounds)
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            times[i].append(_per_call_us(fn, per, sync))
    return [statistics.median(t) for t in times]


def _with_backward(fn):
    """``fn`` then the backward of its outputs (gradients of ones, made once): a training step's call."""
    grads = {}

    def call():
        outs = fn()
        outs = outs if isinstance(outs, tuple) else (outs,)
        if not grads:
            grads["g"] = [torch.ones_like(o) for o in outs]
        torch.autograd.backward(outs, grads["g"])
    return call


def _floor_fns(device, grad: bool) -> list:
    """:data:`FLOOR_ROW`'s pair, ``_OneLaunchEachWay`` and ``torch.neg``, forward alone or forward + backward."""
    x = torch.zeros(4, device=device, requires_grad=grad)
    fns = [lambda: _OneLaunchEachWay.apply(x), lambda: torch.neg(x)]
    return [_with_backward(f) for f in fns] if grad else fns


def over_aten_past_the_floor(table):
    """``table`` (a :func:`host_overhead_table`) with ``course_over_aten_floor`` for each op row: the larger over
    forward and forward + backward of course / (aten + the floor's extra), where the floor's extra is what
    :data:`FLOOR_ROW`'s Python ``autograd.Function`` with one launch each way costs past aten's ``neg`` (clamped
    at 0). It asks the course's ops for no more than aten's cost plus what any op made this way pays; NaN for
    every row of a table without the floor row."""
    out = table.copy()
    floor = table[table["op"] == FLOOR_ROW]
    out["course_over_aten_floor"] = float("nan")
    if floor.empty:
        return out
    f = floor.iloc[0]
    extra_fwd = max(float(f["course_us"] - f["aten_us"]), 0.0)
    extra_both = max(float(f["course_fwd_bwd_us"] - f["aten_fwd_bwd_us"]), 0.0)
    ops_rows = ~table["op"].str.startswith("(")
    ratio = (table["course_us"] / (table["aten_us"] + extra_fwd)).combine(
        table["course_fwd_bwd_us"] / (table["aten_fwd_bwd_us"] + extra_both), max)
    out.loc[ops_rows, "course_over_aten_floor"] = ratio[ops_rows]
    return out


def host_overhead_table(n_calls: int = 200, *, batch: int = 1, seq: int = 16, d_model: int = 64, n_head: int = 2,
                        vocab: int = 64, dtype: torch.dtype | None = None, device=None):
    """A ``pandas.DataFrame``, one row per op: host microseconds per call from Python of the course's
    wrapper, of ``torch.ops.course.<op>`` and of the aten counterpart (the same outputs), forward alone
    (``*_us``) and forward + backward through autograd (``*_fwd_bwd_us``), on tiny shapes (launch-bound:
    the loop's time is the host's), all of them and the floor timed in turn over :data:`ROUNDS` rounds, medians
    kept.
    ``course_over_aten`` is the larger of the two ratios. On the interpreter the numbers are the
    interpreter's run time, not launch overhead: run it on a GPU."""
    import pandas as pd

    import course_utils.ops as ops
    device = _device(device)
    dtype = dtype or (torch.bfloat16 if env.on_gpu() else torch.float16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows: dict = {}
    for grad in (False, True):
        t = _block_inputs(batch, seq, d_model, n_head, vocab, dtype, dtype, device, requires_grad=grad)
        seed = torch.zeros(1, dtype=torch.int64, device=device)
        calls = [dict(_block_calls(t, ops, seed)), dict(_block_calls(t, _Dispatcher, seed)), _aten_calls(t)]
        names = list(calls[0])
        # every op's three calls and the floor's two in the same rounds: a slow spell of the host falls on
        # all of them, not on the op timed then (the floor's extra is added to each op's aten time)
        fns = [_with_backward(c[name]) if grad else c[name] for name in names for c in calls]
        with torch.set_grad_enabled(grad):
            us = _interleaved_us(fns + _floor_fns(device, grad), n_calls, sync)
        cols = ("course_fwd_bwd_us", "torch_ops_fwd_bwd_us", "aten_fwd_bwd_us") if grad else \
            ("course_us", "torch_ops_us", "aten_us")
        for i, name in enumerate(names):
            rows.setdefault(name, {"op": name}).update(zip(cols, us[3 * i:3 * i + 3]))
        floor = rows.setdefault(FLOOR_ROW, {"op": FLOOR_ROW, "torch_ops_us": float("nan"),
                                            "torch_ops_fwd_bwd_us": float("nan")})
        floor.update(zip(cols[::2], us[-2:]))
    rows = list(rows.values())   # the ops in order, then the floor
    for r in rows:
        r["course_over_aten"] = max(r["course_us"] / r["aten_us"], r["course_fwd_bwd_us"] / r["aten_fwd_bwd_us"])
    with torch.no_grad():
        one = torch.zeros(1, device=device)
        c, a = _interleaved_us([lambda: touch_kernel[(1,)](one), lambda: one.add_(1.0)], n_calls, sync)
    rows.append({"op": "(one launch: touch_kernel / add_)", "course_us": c, "torch_ops_us": float("nan"),
                 "aten_us": a, "course_over_aten": c / a})
    return pd.DataFrame(rows)
