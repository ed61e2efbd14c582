"""Checks for chapter 7 (FlashAttention forward).

:func:`check_attention` judges a function ``fn(q, k, v, causal=...[, out=...])`` for
(batch, heads, seq, head_dim) tensors against standard attention computed in float64 on the same
(rounded) inputs. Every call draws fresh inputs; sequence lengths are not multiples of any tile;
one case has scores of large magnitude (an ``exp`` without the running max overflows there),
one has a large common offset on the scores, and one moves every score far below zero (a finite stand-in for
-inf, such as -100, outweighs the real keys there); the output is NaN-poisoned inside guard zones when
``fn`` takes ``out``; under the interpreter every load is recorded, and one from the guard zones past
q, k or v (a tile's padded rows or keys loaded without their mask) fails, named by input, though the
numbers may be right; the work must be one launch of the student's own Triton kernel (SDPA, or the
course's kernel, is the answer key, not an answer). When a case fails, the usual faults (the scale, exp2
without log2(e), the causal mask, one built from offsets within the tile, hidden or padded keys scored 0 or a
finite stand-in for -inf, the online update's rescaling, division and running max, tried at every usual key tile)
are recomputed in float64 and the one that fits the output is named; an output NaN everywhere, or NaN in rows
and right elsewhere, names the exponent's slip behind it.
"""

from __future__ import annotations

import inspect
import math

import torch

from .. import check, env
from ..faults.attention import _diagnose
from ..kernels.attention import attention_ref
from . import answer_keys
from .loads import in_guards, stub_message


def _refuse_course(what: str, fn) -> None:
    """The course's attention kernels, launchers and reference are the answer (its tile choice,
    ``attention_configs``, is not: the exercise uses it)."""
    keys = answer_keys.course_answers("course_utils.kernels.attention")
    keys.update(answer_keys.course_answers("course_utils.tuned.attention", only=(
        "flash_attention", "attn_fwd_tuned_kernel", "attn_fwd_tuned_tiles", "load_tile", "_launch_tuned",
        "forward_call", "launch_forward")))
    answer_keys.refuse(what, fn, keys)

# (atol, rtol) for attention outputs: P is rounded to the input dtype before P @ V, and on a GPU a
# float32 tl.dot runs in tf32 unless told otherwise (so float32 is judged on the random cases only;
# fp16/bf16 carry the large-magnitude cases there).
ATTN_TOLERANCES = {
    torch.float32: (5e-3, 5e-3) if env.on_gpu() else (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
}


SHIFTED_DOWN = "scores with a large negative offset"
# How far SHIFTED_DOWN moves every score, per dtype. A kernel that hides keys with a finite fill instead of -inf
# passes wherever the real scores lie far above the fill; here they lie below it and the hidden keys take the
# weight. How far down a right kernel still meets the tolerance is set by float32 itself: a score near -S is held
# to half a float32 ulp of S (2**-10 from 8192 to 16384), and the softmax passes that error on to the output, in
# proportion to v. So each shift sits in the lowest binade below the fill it is after (-120 in [64, 128) against
# -100; -1.2e4 in [8192, 16384) against -1e4, which float32's 1e-4 tolerance cannot tell: a right kernel's worst
# error there was 14-22 times it), and v is a quarter of its usual size. Worst error / tolerance of right
# kernels (the exercise's, the tests' own, the course's exp2 one; interpreter, seq 45, head_dim 16, causal, 150
# draws) with v at full size: float32 at -150 0.54, at -120 0.28; float16 at -1.2e4 0.80. As set here (v / 4):
# float32 0.08, float16 0.25.
# Not measured: bfloat16 (the interpreter's is wrong; its tolerance is 2.5e-2) and the GPU's case (head_dim 64,
# tensor-core accumulation).
SCORE_SHIFT = {torch.float32: -120.0, torch.float16: -1.2e4, torch.bfloat16: -1.2e4}
SHIFTED_V_SCALE = 0.25


def cases(causal: bool):
    """(batch, heads, seq, head_dim, what, q_scale, q_offset) cases; small under the interpreter. SHIFTED_DOWN's
    head_dim makes 1/sqrt(head_dim) a power of two, so the scale adds no rounding to its large scores."""
    if env.on_gpu():
        return [(2, 3, 1000, 64, "random scores", 1.0, 0.0), (1, 2, 1, 64, "one token", 1.0, 0.0),
                (2, 2, 1031, 128, "random scores", 1.0, 0.0), (3, 2, 77, 32, "random scores", 1.0, 0.0),
                (1, 3, 301, 64, "large-magnitude scores", 60.0, 0.0),
                (2, 1, 129, 16, "scores with a large offset", 1.0, 100.0), (1, 2, 203, 64, SHIFTED_DOWN, 1.0, 0.0)]
    return [(2, 3, 70, 32, "random scores", 1.0, 0.0), (1, 2, 1, 16, "one token", 1.0, 0.0),
            (1, 2, 37, 16, "random scores", 1.0, 0.0), (1, 2, 45, 16, "large-magnitude scores", 60.0, 0.0),
            (1, 1, 23, 32, "scores with a large offset", 1.0, 100.0), (1, 2, 45, 16, SHIFTED_DOWN, 1.0, 0.0)]


def _guard_loads(case: str, loads, inputs) -> None:
    """Fail a load from the guard zone around q, k or v (interpreter only): a padded lane read unmasked."""
    for g, which in zip(inputs, ("q", "k", "v")):
        n = in_guards(loads, g)
        if not n:
            continue
        if which == "q":
            fix = ("the query rows of the last tile run past seq: load q with mask=offs_m[:, None] < n "
                   "(other=0.0)")
        else:
            fix = (f"the keys of the last key tile run past seq: load {which} with mask=cols[:, None] < n "
                   "(other=0.0), and keep those keys out of the softmax with s = tl.where(cols[None, :] < n, s, "
                   "float('-inf'))")
        raise check.CheckFailure(
            f"{case}: your kernel loaded {n} element(s) outside input {which}, past its last row: {fix}. The "
            "numbers may still be right (those rows are never stored, or weigh 0), but past the end of a buffer "
            "there may be no memory at all.")


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _inputs(b, h, n, d, dtype, q_scale, q_offset, shift: float = 0.0):
    """Fresh q, k, v in ``dtype``; with ``shift``, every score q_i . k_j / sqrt(d) moved by that much alone: the
    first coordinate of every query and every key is one constant pair whose product, scaled, is ``shift`` (a
    constant added to q, as for ``q_offset``, spreads the scores as far as it moves them), and v is scaled by
    SHIFTED_V_SCALE."""
    gen = check.generator()
    q = check.randn((b, h, n, d), torch.float32, gen=gen) * q_scale
    k = check.randn((b, h, n, d), torch.float32, gen=gen)
    v = check.randn((b, h, n, d), torch.float32, gen=gen)
    if q_offset:
        # every score shifted by about q_offset * sqrt(d) * mean(k): a constant inside the softmax,
        # so the output must not change, but exp() of it overflows without the running max.
        k = k + 1.0
        q = q + q_offset / d ** 0.5
    if shift:
        pair = (abs(shift) * d ** 0.5) ** 0.5
        q[..., 0] = math.copysign(pair, shift)
        k[..., 0] = pair
        v = v * SHIFTED_V_SCALE
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check_attention(fn, name: str = "FlashAttention forward", *, causal: bool = False,
                    dtypes=None, hint: str = "") -> None:
    """Raise :class:`check.CheckFailure` unless ``fn`` computes attention; print the verdict."""
    _refuse_course(name, fn)
    dtypes = tuple(dtypes or env.supported_dtypes())
    with_out = _accepts(fn, "out")
    for dtype in dtypes:
        atol, rtol = ATTN_TOLERANCES[dtype]
        for b, h, n, d, what, q_scale, q_offset in cases(causal):
            if dtype == torch.float32 and env.on_gpu() and what != "random scores":
                continue  # a float32 tl.dot runs in tf32 on a GPU: large scores lose too many digits
            case = (f"{name} ({str(dtype).removeprefix('torch.')}, batch={b}, heads={h}, seq={n}, "
                    f"head_dim={d}, causal={causal}, {what})")
            shift = SCORE_SHIFT[dtype] if what == SHIFTED_DOWN else 0.0
            if shift:
                case = case.replace(what, f"{what} ({shift:g})")
            q, k, v = _inputs(b, h, n, d, dtype, q_scale, q_offset, shift)
            qg, kg, vg = (check.guarded_copy(t) for t in (q, k, v))
            out = check.Guarded((b, h, n, d), dtype) if with_out else None
            try:
                kwargs = {"causal": causal}
                if with_out:
                    kwargs["out"] = out.tensor
                with check.track_loads() as loads:
                    got = fn(qg.tensor, kg.tensor, vg.tensor, **kwargs)
            except NotImplementedError:
                raise
            except check.CheckFailure:
                raise
            except Exception as e:
                stub = stub_message(e)   # the interpreter or the compiler wraps what a kernel raises
                if stub is not None:
                    raise NotImplementedError(stub or f"{name}: not done yet ({e})") from None
                raise check.CheckFailure(f"{case}: your function raised {type(e).__name__}: {e}") from e
            if with_out:
                got = out.tensor if got is None else got
                out.check(case, hint)
            for g, t, which in ((qg, q, "q"), (kg, k, "k"), (vg, v, "v")):
                g.check(f"{case}, input {which}")
                check.require(torch.equal(g.tensor, t), f"{case}: your function changed its input {which}")
            _guard_loads(case, loads, (qg, kg, vg))
            expected = attention_ref(q.double(), k.double(), v.double(), causal=causal)
            extra = hint
            if shift and not extra:
                extra = (f"the other cases pass but this one, every score moved by {shift:g} (the softmax must not "
                         "change), does not: hide keys with float('-inf'), not a finite score, and subtract the "
                         "running max before exp.")
            elif what != "random scores" and not extra:
                extra = ("the random case passes but this one does not: subtract the running max before "
                         "exp, and rescale l and the accumulator by exp(m_old - m_new) when the max grows.")
            if isinstance(got, torch.Tensor) and got.shape == expected.shape and not bool(
                    torch.isclose(got.detach().to("cpu", torch.float64), expected.cpu(), atol=atol, rtol=rtol).all()):
                extra = _diagnose(got, q, k, v, causal, atol, rtol) or extra
            check.compare(case, got, expected, dtype=dtype, atol=atol, rtol=rtol, hint=extra)
            if with_out and got.data_ptr() != out.tensor.data_ptr():   # a new tensor returned: out= holds it too
                check.compare(f"{case}, the out= buffer", out.tensor, expected, dtype=dtype, atol=atol, rtol=rtol,
                              hint="your function returned a new tensor and left the out= buffer it was given "
                                   "without the result: when out is given, the kernel writes into it (and the "
                                   "function returns it)")
    q, k, v = _inputs(1, 2, 33, 16, dtypes[0], 1.0, 0.0)
    kwargs = {"causal": causal, **({"out": torch.empty_like(q)} if with_out else {})}
    check.check_kernel_launches(name, fn, q, k, v, expected=1, **kwargs)
    mask = "with the causal mask, " if causal else ""
    check.verdict(name, f"matches float64 attention {mask}on ragged sequence lengths, large-magnitude and "
                        "offset scores, every dtype tried")   # the notebook's saved output: left as it was
