"""The add_layer_norm backward at chapter 12's shape: how far from the copy ceiling, and which launch gets closer.

On the H100 and the H200 alike the course's ``add_layer_norm_bwd_kernel`` took about 105 us a call at GPT-2
small's B=16 (16384 rows x 768, bf16; results/*/training_kernels.csv): about 100 MB a call, a quarter of either
GPU's copy bandwidth, so the kernel waits on something other than memory. This script times, in interleaved
rounds (course_utils.timing.time_rounds, the benchmark's protocol):

- ``op default``: ``course_utils.ops.norms.add_layer_norm_bwd``, the launch the step makes (its column sums too);
- ``<programs>p r<rows> w<warps> [s<stages>]``: the op's two launches (the kernel, then the column sums) with
  that many programs (a multiple of the SMs), rows a tile, warps and pipeline stages of the row loop;
- ``torch.compile formula``: the backward's formula in torch ops, compiled by Inductor (its fused reduction);
- ``copy``: ``dst.copy_(src)`` of the same bytes as the backward moves (s, dy, ds read, dx written), the ceiling.

Every candidate is first checked against float64 autograd on an odd shape. Run from the repository root on a
GPU (about a minute):

    python tools/gpu_checks/add_layernorm_bwd.py          # --smoke: tiny shapes, a few candidates, no timing
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
import triton

import course_utils as cu
from course_utils import env, hardware, timing
from course_utils.kernels import add_layernorm as A
from course_utils.ops import norms
from course_utils.tuned.layernorm import column_sum_pair

ROWS_OF_STEP = (8192, 16384)   # GPT-2 small, N=1024 tokens: B=8 and B=16
COLS = 768
ROUNDS = 3
EPS = 1e-5
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def inputs(m, n, dtype, device, seed=0):
    """(dy, ds, s, w, mean, rstd): signed random gradients, s and its saved statistics as the forward keeps them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    s, dy, ds = (torch.randn(m, n, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(device=device, dtype=dtype)
    mean = s.float().mean(-1)
    rstd = torch.rsqrt(s.float().var(-1, unbiased=False) + EPS)
    return dy, ds, s, w, mean, rstd


def reference(dy, ds, s, w):
    """(dx, dw, db) in float64 by autograd: dx = ds + dLayerNorm(dy)."""
    s64 = s.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    b64 = torch.zeros_like(w64, requires_grad=True)
    F.layer_norm(s64, (s.shape[-1],), w64, b64, EPS).backward(dy.double())
    return s64.grad + ds.double(), w64.grad, b64.grad


def formula(dy, ds, s, w, mean, rstd):
    """The backward in torch ops (what Inductor fuses): dx = ds + rstd (g - s_hat mean(g s_hat) - mean(g))."""
    s_hat = (s.float() - mean[:, None]) * rstd[:, None]
    g = dy.float() * w.float()
    dx = (g - s_hat * (g * s_hat).mean(-1, keepdim=True) - g.mean(-1, keepdim=True)) * rstd[:, None] + ds.float()
    return dx.to(s.dtype), (dy.float() * s_hat).sum(0).to(w.dtype), dy.float().sum(0).to(w.dtype)


def candidates(sms: int, smoke: bool) -> list[tuple[int, int, int, int | None]]:
    """(programs, rows a tile, warps, pipeline stages of the row loop; None: not pipelined). The op's choice
    is 2 x SMs programs, 4 rows, 8 warps, no stages at 768 columns. The first H200 run (2026-11-28) put the
    unpipelined launches at 72-260 us (16384 rows; the copy 29 us), three stages at 42 us (timed from Python,
    where the host's launches, about 100 us, hid the GPU's time at 8192 rows: the timings now replay a graph)."""
    if smoke:
        return [(4, 1, 4, None), (4, 4, 4, None), (8, 2, 4, 2)]
    return [(k * sms, rows, warps, stages) for k in (1, 2, 3, 4) for rows in (2, 4, 8) for warps in (4, 8)
            for stages in (None, 2, 3, 4)]


def name(c) -> str:
    return f"{c[0]}p r{c[1]} w{c[2]}" + (f" s{c[3]}" if c[3] else "")


def launch(dy, ds, s, w, mean, rstd, c):
    """The op's two launches with candidate ``c``: the row kernel, then the op's one-launch column sums."""
    programs, rows, warps, stages = c
    m, n = s.shape
    per_program = triton.cdiv(triton.cdiv(m, programs), rows) * rows
    grid = triton.cdiv(m, per_program)
    dx = torch.empty_like(s)
    dw = torch.empty((grid, n), dtype=torch.float32, device=s.device)
    db = torch.empty_like(dw)
    A.add_layer_norm_bwd_kernel[(grid,)](dx, dx, dy, ds, s, w, mean, rstd, dw, db, m, n, n, n, per_program,
                                         BLOCK_N=triton.next_power_of_2(n), ROWS=rows, HAS_DS=True,
                                         STAGES=stages, num_warps=warps)
    return (dx, *column_sum_pair(dw, db, w.dtype))


def impls_for(m, dtype, device, sms, smoke):
    dy, ds, s, w, mean, rstd = inputs(m, COLS, dtype, device)
    out = {"op default": lambda: norms.add_layer_norm_bwd(dy, ds, s, w, mean, rstd)}
    for c in candidates(sms, smoke):
        out[name(c)] = lambda c=c: launch(dy, ds, s, w, mean, rstd, c)
    if not smoke:   # Inductor on a GPU (the CPU interpreter has no Triton backend for it)
        compiled = torch.compile(formula, dynamic=False)
        out["torch.compile formula"] = lambda: compiled(dy, ds, s, w, mean, rstd)
        moved = 3 * s.numel() * s.element_size() + s.numel() * s.element_size()   # read s, dy, ds; write dx
        src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        out["copy"] = lambda: dst.copy_(src)
    return out, 4 * s.numel() * s.element_size()


def check(device, sms, smoke):
    """Every candidate, the op and the formula against float64 on an odd shape; returns the failures."""
    failures = []
    for dtype in (torch.bfloat16, torch.float32):
        m = 37 if smoke else 1003
        dy, ds, s, w, mean, rstd = inputs(m, COLS if not smoke else 96, dtype, device, seed=1)
        want = reference(dy, ds, s, w)
        runs = {"op default": lambda: norms.add_layer_norm_bwd(dy, ds, s, w, mean, rstd),
                "formula": lambda: formula(dy, ds, s, w, mean, rstd)}
        for c in candidates(sms, smoke):
            runs[name(c)] = lambda c=c: launch(dy, ds, s, w, mean, rstd, c)
        for k, run in runs.items():
            try:
                got = run()
            except triton.runtime.errors.OutOfResources as e:   # stages x tile over the shared memory
                print(f"  {k} {dtype}: no fit ({str(e)[:80]})")
                continue
            err = max(float(((g.double() - r) / (1 + r.abs())).abs().max()) for g, r in zip(got, want))
            if not err <= TOL[dtype]:   # NaN fails too
                failures.append(f"{k} {dtype}: relative error {err:.2e} > {TOL[dtype]:.0e}")
    return failures


def main(argv):
    smoke = "--smoke" in argv
    if not smoke and not cu.on_gpu():
        print("add_layernorm_bwd.py needs a CUDA GPU (or --smoke under the interpreter)", file=sys.stderr)
        return 2
    device, t0 = env.DEVICE, time.time()
    sms = hardware.device_info().sms
    if not smoke:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {sms} SMs")
    failures = check(device, sms, smoke)
    print("check against float64:", "every candidate right" if not failures else "FAILED\n  " + "\n  ".join(failures))
    rows = []
    for m in ((64,) if smoke else ROWS_OF_STEP):
        impls, moved = impls_for(m, torch.bfloat16, device, sms, smoke)
        if smoke:   # every callable runs once: the script works, nothing is timed
            for f in impls.values():
                f()
            rows += [(m, k, float("nan"), float("nan")) for k in impls]
            continue
        errors: dict = {}
        got = timing.time_rounds(impls, ROUNDS, errors=errors, warmup=3, rep=10, cuda_graph=True, graph_calls=10)
        for k, e in errors.items():
            print(f"  {k} failed: {e[:200]}")
        rows += [(m, k, t.median * 1e3, moved / (t.median * 1e-3) / 1e9) for k, t in got.items()]
        torch.cuda.empty_cache()
    print(f"\n{'rows':>6}  {'what':<24} {'us':>8} {'GB/s':>7}   (bf16, {COLS} columns; s, dy, ds read, dx written;"
          " GPU time: 10 calls a CUDA graph)")
    for m, k, us, gbps in sorted(rows, key=lambda r: (r[0], r[2])):
        print(f"{m:>6}  {k:<24} {us:8.1f} {gbps:7.0f}")
    print(f"done in {time.time() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
