"""The add_layer_norm backward at chapter 12's shape: how far from the copy ceiling, and which launch gets closer.

On the H100 and the H200 alike the course's ``add_layer_norm_bwd_kernel`` took about 105 us a call at GPT-2
small's B=16 (16384 rows x 768, bf16; results/*/training_kernels.csv): about 100 MB a call, a quarter of either
GPU's copy bandwidth, so the kernel waits on something other than memory. This script times, in interleaved
rounds (course_utils.timing.time_rounds, the benchmark's protocol):

- ``op default``: ``course_utils.ops.norms.add_layer_norm_bwd``, the launch the step makes (its column sums too);
- ``<programs>p r<rows> w<warps>``: the same kernel launched by chapter 10's plain launcher
  (``add_layer_norm_backward_teaching``) with that many programs (a multiple of the SMs), rows a tile and warps;
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

import course_utils as cu
from course_utils import env, hardware, timing
from course_utils.kernels import add_layernorm as A
from course_utils.ops import norms

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


def candidates(sms: int, smoke: bool) -> list[tuple[int, int, int]]:
    """(programs, rows a tile, warps): the op's choice is 2 x SMs programs, 4 rows, 8 warps at 768 columns."""
    if smoke:
        return [(4, 1, 4), (4, 4, 4), (8, 2, 4)]
    return [(k * sms, rows, warps) for k in (1, 2, 4, 8) for rows in (1, 2, 4, 8) for warps in (4, 8)]


def name(c) -> str:
    return f"{c[0]}p r{c[1]} w{c[2]}"


def impls_for(m, dtype, device, sms, smoke):
    dy, ds, s, w, mean, rstd = inputs(m, COLS, dtype, device)
    out = {"op default": lambda: norms.add_layer_norm_bwd(dy, ds, s, w, mean, rstd)}
    for c in candidates(sms, smoke):
        out[name(c)] = lambda c=c: A.add_layer_norm_backward_teaching(dy, ds, s, w, mean, rstd, programs=c[0],
                                                                      rows=c[1], num_warps=c[2])
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
            runs[name(c)] = lambda c=c: A.add_layer_norm_backward_teaching(dy, ds, s, w, mean, rstd,
                                                                           programs=c[0], rows=c[1], num_warps=c[2])
        for k, run in runs.items():
            got = run()
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
        got = timing.time_rounds(impls, ROUNDS, errors=errors, warmup=3, rep=20)
        for k, e in errors.items():
            print(f"  {k} failed: {e[:200]}")
        rows += [(m, k, t.median * 1e3, moved / (t.median * 1e-3) / 1e9) for k, t in got.items()]
        torch.cuda.empty_cache()
    print(f"\n{'rows':>6}  {'what':<24} {'us':>8} {'GB/s':>7}   (bf16, {COLS} columns; s, dy, ds read, dx written)")
    for m, k, us, gbps in sorted(rows, key=lambda r: (r[0], r[2])):
        print(f"{m:>6}  {k:<24} {us:8.1f} {gbps:7.0f}")
    print(f"done in {time.time() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
