"""Why torch.compile's RMSNorm/LayerNorm forward runs 2-4% ahead of ours where both are at the copy's speed: the
shipped forward's body in the forms torch.compile's kernel differs by, one at a time, on 1 GiB inputs.

torch.compile (Inductor, ``dynamic=False``) writes the row count and N into its kernel as constants, so it has no
row mask and a column mask the compiler folds away; it addresses in 32-bit ints (the sizes fit); and it reads x
twice, once for the row's sums (``evict_last``) and again for the output (``evict_first``, from the cache), where
ours keeps x in registers between the two. The forms here, each a constexpr of one kernel:

- ``MASKED`` (the shipped kernel: masks on rows and columns) or not (only where N == BLOCK_N and ROWS divides M);
- ``I64`` (the shipped kernel: 64-bit row offsets) or 32-bit offsets (only where M * N < 2**31);
- ``TWO_PASS``: x loaded again for the output, with Inductor's eviction hints.

Each form is checked against float64 first, then timed with the shipped tile (``plan_forward``) and Inductor's
(1 or 2 rows, 16 warps: what its autotuner kept on an H200, results/h200/inductor_rms_fwd_s22.log) in three
interleaved rounds beside torch.compile and aten's copy. Prints torch.compile's time over each form's (above 1:
faster than torch.compile). Run from the repository root on a GPU:

    python tools/gpu_checks/norm_fwd_forms.py [float32 bfloat16] [2048 4096 ...] [rms ln]
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from course_utils import hardware
from course_utils.timing import time_rounds
from course_utils.tuned import layernorm as T

EPS = 1e-5
NBYTES = 2**30
INDUCTOR_WARPS = 16


@triton.jit
def fwd_form(y_ptr, x_ptr, w_ptr, b_ptr, n_rows, n_cols, eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
             RMS: tl.constexpr, MASKED: tl.constexpr, I64: tl.constexpr, TWO_PASS: tl.constexpr):
    """The shipped norm_fwd_kernel's body (no statistics, contiguous rows) in the forms above."""
    eps = tl.cast(eps, tl.float32)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    if I64:
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    else:
        offs = rows[:, None] * n_cols + cols[None, :]
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    if MASKED:
        if TWO_PASS:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    else:
        if TWO_PASS:
            x = tl.load(x_ptr + offs, eviction_policy="evict_last").to(tl.float32)
        else:
            x = tl.load(x_ptr + offs).to(tl.float32)
        w = tl.load(w_ptr + cols).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / n_cols
        xc = x - mean[:, None]
        if MASKED:
            xc = tl.where(mask, xc, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    if TWO_PASS:
        if MASKED:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        else:
            x = tl.load(x_ptr + offs, eviction_policy="evict_first").to(tl.float32)
        if RMS:
            xc = x
        else:
            xc = x - mean[:, None]
    y = xc * rstd[:, None] * w[None, :]
    if not RMS:
        if MASKED:
            y += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        else:
            y += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    if MASKED:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty))


def forms(m: int, n: int, rows: int):
    """(masked, i64, two_pass) forms that are valid at this shape and tile."""
    out = []
    for masked, i64, two in itertools.product((True, False), (True, False), (False, True)):
        if not masked and (triton.next_power_of_2(n) != n or m % rows):
            continue
        if not i64 and m * n >= 2**31:
            continue
        out.append((masked, i64, two))
    return out


def _reference(x, w, b, rms):
    xd, wd = x.double(), w.double()
    if rms:
        return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * wd
    return F.layer_norm(xd, x.shape[-1:], wd, b.double(), EPS)


def one(dtype, n, rms, info) -> str:
    m = NBYTES // (n * dtype.itemsize)
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
    b = (0.1 * torch.randn(n, device="cuda")).to(dtype)
    y = torch.empty_like(x)
    shipped = T.plan_forward(m, n, dtype.itemsize, info, rms=rms)
    tiles = {"shipped": (shipped.ROWS, shipped.num_warps), "inductor": (max(1, 4096 // n), INDUCTOR_WARPS)}
    impls = {}
    check = x[:3 * 64 + 6]   # a ragged slice: every form's masks or its lack of them on a small odd grid
    ref = _reference(check, w, b, rms)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for (tile, (rows, warps)), form in itertools.product(tiles.items(), forms(m, n, max(rows for rows, _ in
                                                                                        tiles.values()))):
        def run(t=x, out=y, rows=rows, warps=warps, form=form):
            fwd_form[(triton.cdiv(t.shape[0], rows),)](out, t, w, b, t.shape[0], n, EPS, BLOCK_N=n, ROWS=rows,
                                                       RMS=rms, MASKED=form[0], I64=form[1], TWO_PASS=form[2],
                                                       num_warps=warps)
        if form[0]:   # only a masked form may run on the ragged slice
            small = torch.full_like(check, float("nan"))
            run(t=check, out=small)
            err = (small.double() - ref).abs().max().item()
            assert err < tol * (1 + ref.abs().max().item()), (tile, form, err)
        impls[f"{tile} r{rows}w{warps} " + "".join(k for k, on in zip(("mask ", "i64 ", "2pass"), form) if on)] = run
    full = _reference(x[:8192], w, b, rms)
    for name, run in impls.items():
        y.fill_(float("nan"))
        run()
        err = (y[:8192].double() - full).abs().max().item()
        assert err < tol * (1 + full.abs().max().item()), (name, err)
    comp = torch.compile((lambda x, w, b: F.rms_norm(x, (n,), w, EPS)) if rms else
                         (lambda x, w, b: F.layer_norm(x, (n,), w, b, EPS)), dynamic=False)
    comp(x, w, b)
    impls["compile"] = lambda: comp(x, w, b)
    impls["copy"] = lambda: y.copy_(x)
    ts = time_rounds(impls, 3, warmup=3, rep=20)
    base = ts["compile"].median
    head = f"{'rms' if rms else 'ln'} {str(dtype)[6:]} N={n}: compile {base:.3f} ms, compile/copy " \
           f"{ts['copy'].median / base:.3f}"
    body = "\n".join(f"  {k:38s} {t.median:.3f} ms  {base / t.median:.3f}" for k, t in
                     sorted(ts.items(), key=lambda kv: kv[1].median) if k not in ("compile", "copy"))
    return f"{head}\n{body}"


def main(argv) -> int:
    if not torch.cuda.is_available():
        print("norm_fwd_forms.py needs a CUDA GPU", file=sys.stderr)
        return 2
    info = hardware.device_info()
    dts = [d for d in (torch.float32, torch.bfloat16) if str(d)[6:] in argv] or [torch.float32, torch.bfloat16]
    ns = [int(a) for a in argv if a.isdigit()] or [2048, 4096, 8192, 16384]
    norms = [k == "rms" for k in ("rms", "ln") if k in argv] or [True, False]
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for dtype, n, rms in itertools.product(dts, ns, norms):
        print(one(dtype, n, rms, info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
