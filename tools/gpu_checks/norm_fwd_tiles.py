"""The LayerNorm/RMSNorm forward's tiles on this GPU: every (rows a program, num_warps) candidate of the shipped
kernel's body, with and without eviction hints, against torch.compile's kernel and aten's copy, on 1 GiB inputs.

Phase 1 times every candidate once (``time_ms``); phase 2 times copy, torch.compile, the shipped plan
(``plan_forward``'s tile) and the three fastest candidates, each with and without eviction hints (x ``evict_first``,
w and b ``evict_last``, as Inductor's kernels load them), in three interleaved rounds. Prints one line per (norm,
dtype, N): torch.compile's time over each one's (above 1: faster than torch.compile) and, for N=4096 and 16384,
the load lines of Inductor's LayerNorm kernel. ``FWD_TILES`` in ``course_utils/tuned/layernorm_plans.py`` is
read from its output (results/h200/layernorm_fwd_tiles_s19.log). Run from the repository root on a GPU, about
80 s per dtype:

    python tools/gpu_checks/norm_fwd_tiles.py float32 bfloat16 [1024 4096 ...]
"""
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from course_utils import hardware
from course_utils.timing import time_ms, time_rounds
from course_utils.tuned import layernorm as T

EPS = 1e-5
NBYTES = 2**30


@triton.jit
def fwd_v(y_ptr, x_ptr, w_ptr, b_ptr, n_rows, n_cols, x_row_stride, y_row_stride, eps,
          BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr, EVICT: tl.constexpr):
    """The shipped norm_fwd_kernel without statistics, but w loaded before the row's sums (chapter 10, section 3:
    that order matters at some tiles); EVICT: with Inductor's eviction hints."""
    eps = tl.cast(eps, tl.float32)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    if EVICT:
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    else:
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / n_cols
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    y = xc * rstd[:, None] * w[None, :]
    if not RMS:
        if EVICT:
            y += tl.load(b_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
        else:
            y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64 * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def variant(x, w, b, y, rows, warps, rms, evict):
    m, n = x.shape
    grid = (triton.cdiv(m, rows),)
    return lambda: fwd_v[grid](y, x, w, b, m, n, n, n, EPS, BLOCK_N=n, ROWS=rows, RMS=rms, EVICT=evict,
                               num_warps=warps)


def candidates(n):
    out = []
    for rows in (1, 2, 4, 8):
        for warps in (4, 8, 16, 32):
            ept = rows * n // (32 * warps)
            if 4 <= ept <= 64 and rows * n <= 32768:
                out.append((rows, warps))
    return out


def dump_inductor(x, w, b):
    from torch._inductor.utils import run_and_get_code
    f = torch.compile(lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS), dynamic=False)
    _, codes = run_and_get_code(f, x, w, b)
    for code in codes:
        for line in code.splitlines():
            s = line.strip()
            if any(k in s for k in ("@triton_heuristics", "size_hints", "tl.load", "num_warps", "R0_BLOCK :",
                                    "XBLOCK :", "reduction_hint", "def triton_")):
                print("   |", s[:200])


def _norm(rms: bool):
    if rms:
        return lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, EPS)
    return lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS)


def one_norm(x, w, b, rms: bool, info) -> str:
    """One (norm, dtype, N): phase 1 over every candidate, phase 2 in interleaved rounds; the table's line."""
    (m, n), dtype = x.shape, x.dtype
    y, out = torch.empty_like(x), torch.empty_like(x)
    ref = _norm(rms)(x, w, b)
    comp = torch.compile(_norm(rms), dynamic=False)
    comp(x, w, b)
    p = T.plan_forward(m, n, dtype.itemsize, info, rms=rms)
    ph1 = {}
    for rows, warps in candidates(n):
        fn = variant(x, w, b, y, rows, warps, rms, False)
        fn()
        err = (y.float() - ref.float()).abs().max().item()
        if err > (1e-3 if dtype == torch.float32 else 0.05):
            print("  BAD", rows, warps, err)
            continue
        ph1[(rows, warps)] = time_ms(fn, warmup=3, rep=10).median
    impls = {"copy": lambda: out.copy_(x), "compile": lambda: comp(x, w, b),
             "shipped": (lambda: T.rms_norm(x, w, EPS)) if rms else (lambda: T.layer_norm(x, w, b, EPS))}
    for rows, warps in sorted(ph1, key=ph1.get)[:3]:
        for ev in (0, 1):
            impls[(rows, warps, ev)] = variant(x, w, b, y, rows, warps, rms, ev)
            impls[(rows, warps, ev)]()
    ts = time_rounds(impls, 3, warmup=3, rep=20)
    base = ts["compile"].median
    name = f"{'rms' if rms else 'ln'} {str(dtype)[6:]} N={n}"
    return (f"{name:24s} shipped(r{p.ROWS} w{p.num_warps}) {base / ts['shipped'].median:.3f} | " +
            " ".join(f"r{k[0]}w{k[1]}e{k[2]} {base / t.median:.3f}" for k, t in ts.items() if isinstance(k, tuple)) +
            f" | compile/copy {ts['copy'].median / base:.3f}"
            " | ph1 " + " ".join(f"r{r}w{w_}:{ph1[(r, w_)]:.3f}" for r, w_ in sorted(ph1)))


def main():
    info = hardware.device_info()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, "sms", info.sms, flush=True)
    only = sys.argv[1:]
    dts = [d for d in (torch.float32, torch.bfloat16) if str(d)[6:] in only] or [torch.float32, torch.bfloat16]
    ns = [n for n in (1024, 2048, 4096, 8192, 16384) if str(n) in only] or [1024, 2048, 4096, 8192, 16384]
    table = []
    for dtype in dts:
        for n in ns:
            m = NBYTES // (n * dtype.itemsize)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
            b = (0.1 * torch.randn(n, device="cuda")).to(dtype)
            if n in (4096, 16384):
                print(f"== inductor code {dtype} N={n}")
                dump_inductor(x[:4096], w, b)
            torch.compiler.reset()
            for rms in (False, True):
                t0 = time.time()
                table.append(one_norm(x, w, b, rms, info))
                print(table[-1], f"({time.time() - t0:.0f}s)", flush=True)
            torch.cuda.empty_cache()
    print("\n== TABLE (ratio = torch.compile time / ours; >1 ours faster)")
    for line in table:
        print(line)


if __name__ == "__main__":
    main()
