"""RMSNorm's backward at wide rows, three designs side by side: the course's row kernel as it ships, the same row
kernel with w loaded inside the row loop, and torch.compile's "mix order reduction" kernel written out by hand.

Why: at bfloat16 N=16384 the course's RMSNorm forward + backward runs at 0.917 of torch.compile's speed on an
H200 (results/h200/targets.md), and no plan of the row kernel closed the gap (results/h200/rms_bwd_gap_s20.log,
which also holds Inductor's generated kernel). What ptxas says of them for sm_90a differs (``--registers``, no
GPU needed): the shipped kernel keeps w in registers for the whole loop and spills 100-336 bytes a thread at
8-32 warps; with w loaded inside the loop (from L1/L2: 32 KiB) it spills 56-228; Inductor's kernel 8-108. A
spill is a local-memory load and store on every row. Only a GPU can say what that costs: on a GPU this times
each variant's backward (dx, and dw through its column sum) in interleaved rounds against torch.compile's
RMSNorm backward, after checking dx and dw against float64.

    python tools/gpu_checks/rms_bwd_variants.py --registers          # any machine with the Linux Triton wheel
    python tools/gpu_checks/rms_bwd_variants.py [--n 16384] [--dtype bfloat16]   # a GPU, about a minute
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import course_utils as cu  # noqa: E402  (may set TRITON_INTERPRET)

if "--registers" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)   # compiled for sm_90, never run

import torch  # noqa: E402

from course_utils.tuned import layernorm_kernels as LK  # noqa: E402

ROWS_PER_PROGRAM = 16   # Inductor's RSPLIT_SIZE at this shape: 2048 programs for 32768 rows
GIB = 2**30


@triton.jit
def row_w_in_loop_kernel(dx_ptr, dy_ptr, x_ptr, w_ptr, rstd_ptr, dw_ptr, n_rows, n_cols, row_stride,
                         rows_per_program, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr):
    """The shipped ``norm_bwd_row_kernel`` (RMS) with w reloaded on every row (evict_last: it stays in L2) instead of
    held in registers; EVEN (n_cols == BLOCK_N): no column mask. Each program stores its dw partial row."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    for row in tl.range(first, end, num_stages=STAGES):
        r64 = first.to(tl.int64) + (row - first)
        if EVEN:
            x = tl.load(x_ptr + r64 * row_stride + cols).to(tl.float32)
            dy = tl.load(dy_ptr + r64 * row_stride + cols).to(tl.float32)
            w = tl.load(w_ptr + cols, eviction_policy="evict_last").to(tl.float32)
        else:
            x = tl.load(x_ptr + r64 * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + r64 * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        g = dy * w
        # dx = rstd * (g - x_hat * mean(g * x_hat))
        dx = (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols)) * rstd
        if EVEN:
            tl.store(dx_ptr + r64 * row_stride + cols, dx.to(dx_ptr.dtype.element_ty))
        else:
            tl.store(dx_ptr + r64 * row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(dw_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


@triton.jit
def inductor_mix_kernel(x_ptr, rstd_ptr, dy_ptr, w_ptr, dx_ptr, ws_ptr, n_rows, N: tl.constexpr,
                        RSPLIT: tl.constexpr, STAGES: tl.constexpr):
    """torch.compile's kernel for this backward (rms_bwd_gap_s20.log) as it generated it, with N for its 16384 and
    1 / N for its 6.103515625e-05: one row at a time as a (1, N) block with no masks (N a power of two, RSPLIT
    dividing the rows, int32 offsets: at most 2**31 elements), the row loop pipelined, the rows' dw summed in
    registers and stored once into a float32 workspace row per program."""
    start = tl.program_id(0) * RSPLIT
    rows = start + tl.arange(0, 1)[:, None]
    cols = tl.arange(0, N)[None, :]
    acc = tl.full([N], 0, tl.float32)[None, :]
    for _ in tl.range(0, tl.minimum(RSPLIT, n_rows - start), 1, num_stages=STAGES):
        row = rows
        rows += 1
        x = tl.load(x_ptr + (cols + N * row), None).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, None, eviction_policy="evict_last")
        dy = tl.load(dy_ptr + (cols + N * row), None).to(tl.float32)
        w = tl.load(w_ptr + cols, None, eviction_policy="evict_last").to(tl.float32)
        x_hat = x * rstd
        g = dy * w
        s = tl.sum(x_hat * g, 1)[:, None]
        # dx = rstd * (g - x_hat * mean(g * x_hat)), in Inductor's order of operations
        tl.store(dx_ptr + (cols + N * row), ((g - x_hat * (1.0 / N) * s) * rstd).to(dx_ptr.dtype.element_ty), None)
        acc = acc + tl.sum(dy * x_hat, 0)
    tl.store(ws_ptr + tl.program_id(0) * N + cols, acc)


def variants(x, dy, w, rstd, warps_list=(8, 16, 32)):
    """name -> (kernel, args, meta) of each backward variant for these tensors (dx and the dw workspace made
    here): the shipped row kernel, w in the loop (masked and not), Inductor's, at 8/16/32 warps."""
    m, n = x.shape
    block = triton.next_power_of_2(n)
    grid = triton.cdiv(m, ROWS_PER_PROGRAM)
    dx = torch.empty_like(x)
    ws = torch.empty((grid, n), device=x.device, dtype=torch.float32)
    out = {}
    for warps in warps_list:
        for stages in (None, 2):
            out[f"shipped row w{warps} s{stages}"] = (LK.norm_bwd_row_kernel, grid, (
                dx, dy, x, w, rstd, rstd, ws, ws, m, n, n, n, n, ROWS_PER_PROGRAM),
                dict(BLOCK_N=block, RMS=True, ATOMIC=False, STAGES=stages, num_warps=warps))
            for even in ((False, True) if n == block else (False,)):
                out[f"w in loop{' even' if even else ''} w{warps} s{stages}"] = (row_w_in_loop_kernel, grid, (
                    dx, dy, x, w, rstd, ws, m, n, n, ROWS_PER_PROGRAM),
                    dict(BLOCK_N=block, EVEN=even, STAGES=stages, num_warps=warps))
        if n == block and m % ROWS_PER_PROGRAM == 0:
            for stages in (1, 2, 3):
                out[f"inductor w{warps} s{stages}"] = (inductor_mix_kernel, grid, (x, rstd, dy, w, dx, ws, m),
                                                       dict(N=n, RSPLIT=ROWS_PER_PROGRAM, STAGES=stages,
                                                            num_warps=warps))
    return out, dx, ws


def registers(n: int, dtype: torch.dtype) -> int:
    """Registers and spills of each variant for sm_90a (the Linux wheel's ptxas), without a GPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from candidate_registers import ptxas_report

    from course_utils import triton_internals as internals
    from course_utils.aot import empty
    m = 2048 * ROWS_PER_PROGRAM
    x, dy, w, rstd = empty(m, n, dtype=dtype), empty(m, n, dtype=dtype), empty(n, dtype=dtype), empty(m)
    target = internals.gpu_target(90)
    table, _, _ = variants(x, dy, w, rstd)
    for name, (kernel, _, args, meta) in table.items():
        src, options = internals.bind(kernel, args, meta, target)
        regs, stores, loads = ptxas_report(internals.compile_for(src, target, options).asm["ptx"])
        print(f"{name:32s} {regs:4d} registers, spills {stores:4d} B stored / {loads:4d} B loaded a thread")
    return 0


def errors(run, dx, x, dy, w, rstd, rows: slice = slice(0, 64)) -> tuple[float, float]:
    """(dx's largest error on ``rows``, dw's largest error relative to its largest element) of one variant's
    ``run()`` (which returns dw) against float64; dx starts as NaN, so a row it never wrote shows."""
    xd, dyd, wd, rd = x[rows].double(), dy[rows].double(), w.double(), rstd[rows].double()[:, None]
    g = dyd * wd
    want_dx = (g - xd * rd * (g * xd * rd).mean(-1, keepdim=True)) * rd
    want_dw = (dy.double() * x.double() * rstd.double()[:, None]).sum(0)
    dx.fill_(float("nan"))
    dw = run()
    bad_dx = (dx[rows].double() - want_dx).abs().max().item()
    return bad_dx, ((dw.double() - want_dw).abs().max() / want_dw.abs().max()).item()


def runs(table, ws) -> dict:
    """name -> a call that launches the variant and returns dw (the workspace's column sum, as Inductor's)."""
    def make(kernel, grid, args, meta):
        def run():
            kernel[(grid,)](*args, **meta)
            return ws.sum(0)
        return run
    return {name: make(*entry) for name, entry in table.items()}


def timed(n: int, dtype: torch.dtype, warps_list=(8, 16, 32)) -> int:
    from course_utils import timing
    from course_utils.tuned import choice
    m = GIB // (n * dtype.itemsize)
    m -= m % ROWS_PER_PROGRAM
    torch.manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    w = torch.randn(n, device="cuda", dtype=dtype)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    table, dx, ws = variants(x, dy, w, rstd, warps_list)
    impls = {}
    for name, run in runs(table, ws).items():
        try:
            bad_dx, bad_dw = errors(run, dx, x, dy, w, rstd)
        except Exception as e:  # a variant whose stages do not fit this GPU's shared memory
            if not choice.out_of_resources(e):
                raise
            print(f"  {name}: does not fit ({type(e).__name__}): not timed")
            continue
        if bad_dx < 0.05 and bad_dw < 1e-3:
            impls[name] = run
        else:
            print(f"  {name}: WRONG (dx max error {bad_dx:.3g}, dw relative {bad_dw:.3g}): not timed")
        print(f"  checked {name}", flush=True)
    ref = torch.compile(lambda x, w: torch.nn.functional.rms_norm(x, (n,), w, 1e-6), dynamic=False)
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = ref(xg, wg)
    impls["torch.compile (backward)"] = lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)
    got = timing.time_rounds(impls, rounds=3, warmup=3, rep=20)
    base = got["torch.compile (backward)"].median
    print(f"{torch.cuda.get_device_name()}: RMSNorm backward {dtype} {m} x {n}, ms (median round), "
          "torch.compile's time over each one's")
    for name, t in sorted(got.items(), key=lambda kv: kv[1].median):
        print(f"  {name:32s} {t.median:7.3f} ms  {base / t.median:6.3f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--registers", action="store_true", help="ptxas's registers and spills for sm_90a, no GPU")
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--warps", default="8,16,32", help="the num_warps to try, comma-separated")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    if a.registers:
        return registers(a.n, dtype)
    if not cu.on_gpu():
        print("rms_bwd_variants.py times kernels on a CUDA GPU (--registers needs none)", file=sys.stderr)
        return 2
    return timed(a.n, dtype, tuple(int(w) for w in a.warps.split(",")))


if __name__ == "__main__":
    sys.exit(main())
