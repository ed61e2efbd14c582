"""Where LayerNorm forward + backward spends its time on a GPU: the gap between fwd + bwd alone and autograd.

For bf16 and fp32 at N = 1024, 4096, 16384, with ``make bench``'s rows (x is 256 MiB), this prints:

- ``fwd`` (the benchmark's ln_fwd: no statistics) and ``fwd+stats`` (what autograd's forward launches);
- ``bwd <plan>``: ``layer_norm_backward`` alone with each candidate plan of the default design ("both"),
  column_sum included, and ``bwd default`` (the plan the timed choice kept); ``bwd w32 register`` at
  N = 16384 is an extra plan, not a candidate (a whole row in registers with 32 warps);
- the timed choice itself: each candidate's best time as the choice saw it (``choice.TIMES``) and its pick;
- ``fwd+bwd default``: autograd, exactly as benchmarks/layernorm.py times "ours"; ``fwd+bwd <plan>``: the
  same with that plan pinned (``backward_plan``); ``fwd+bwd liger`` and ``fwd+bwd torch`` (F.layer_norm);
- ``fwd then bwd, no autograd``: the same two launches called directly (autograd's engine and thread left
  out: if this is near fwd+stats + bwd default and autograd is not, the time is on the autograd path);
- ``fwd+bwd default (graph)``: the default replayed from a CUDA graph (no host in the way), and
  ``host us/call``: wall-clock microseconds the host spends per autograd fwd+bwd call without waiting for
  the GPU (a host slower than the GPU leaves the GPU idle, and the events count that idle time).

Every time is the median of ROUNDS interleaved rounds of ``course_utils.timing.time_ms`` (L2 flushed,
warmup 3, rep 20: the benchmark's protocol). Outputs are checked against float64 on a small odd shape
first. Run from the repository root on an H100 (about a minute):

    python tools/gpu_checks/layernorm_gap.py            # --smoke: tiny shapes, no timing (CPU interpreter)
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import course_utils as cu
from course_utils import env, hardware, timing
from course_utils.tuned import choice
from course_utils.tuned import layernorm as T
from course_utils.tuned import layernorm_autograd as A

NS = (1024, 4096, 16384)
DTYPES = (torch.bfloat16, torch.float32)
INPUT_BYTES = 256 * 2**20   # benchmarks/layernorm.py: M = INPUT_BYTES // (N * itemsize)
ROUNDS = 3
EPS = 1e-5
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


def liger():
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except Exception as e:  # noqa: BLE001 - a missing peer is a skipped row
        print(f"liger rows skipped: liger_kernel does not import ({type(e).__name__}: {str(e)[:100]})")
        return None
    return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)


def inputs(m, n, dtype, device):
    x = torch.randn(m, n, device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(n, device=device)).to(dtype)
    b = (0.1 * torch.randn(n, device=device)).to(dtype)
    return x, w, b, torch.randn_like(x)


def name(p: T.Plan) -> str:
    return f"{p.version} B={p.BLOCK_N} R={p.ROWS} w={p.num_warps} g={p.grid}"


def fwd_bwd(fn, args, dy):
    return lambda: torch.autograd.grad(fn(*args), args, dy)


def pinned(run, plan):
    def timed():
        with T.backward_plan(plan):
            return run()
    return timed


def host_us(fn, calls=10):
    """Host wall-clock per call, the GPU left to run behind (a sync before and none inside)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def check(device):
    """Every candidate plan and the pinned autograd path against float64, on an odd shape, before any timing."""
    for dtype, (m, n) in ((d, s) for d in DTYPES for s in ((333, 1000), (301, 16384))):
        x, w, b, dy = inputs(m, n, dtype, device)
        ref = [t.double().requires_grad_() for t in (x, w, b)]
        want = torch.autograd.grad(F.layer_norm(ref[0], (n,), ref[1], ref[2], EPS), ref, dy.double())
        info = hardware.device_info()
        for p in T.backward_candidates(m, n, dtype.itemsize, info) + [None]:
            args = [t.detach().clone().requires_grad_() for t in (x, w, b)]
            ctx = T.backward_plan(p) if p is not None else T.backward_design(T.BACKWARD_DESIGN)
            try:
                with ctx:
                    got = torch.autograd.grad(A.layer_norm_autograd(*args, EPS), args, dy)
            except Exception as e:  # a plan this GPU cannot fit (the timed choice skips it): not checked
                if not choice.out_of_resources(e):
                    raise
                print(f"check: {name(p)} does not fit this GPU ({dtype}, N={n})")
                continue
            for what, g, r in zip(("dx", "dw", "db"), got, want):
                err = float((g.double() - r).abs().max() / r.abs().max().clamp_min(1))
                if not err <= TOL[dtype]:
                    raise SystemExit(f"BAD {dtype} {what} plan {p}: relative error {err:.2e}")
    print("check: every candidate plan and the default match float64 (333x1000, 301x16384; bf16 and fp32)")


def case(n, dtype, lg, device, smoke):
    m = 64 if smoke else INPUT_BYTES // (n * dtype.itemsize)
    x, w, b, dy = inputs(m, n, dtype, device)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    for t in (x, w, b):  # the benchmark's fwd+bwd asks autograd for all three gradients
        t.requires_grad_(True)
    info = hardware.device_info()
    _, mean, rstd = T._forward(xd, wd, bd, EPS, False, True, "gap")
    cands = T.backward_candidates(m, n, dtype.itemsize, info)
    extra = [T.Plan("tiles", n, 1, 32, *T._grid(m, 1, info.sms))] if n == 16384 else []
    key = (m, n, dtype, dtype, False, False, str(x.device), T.BACKWARD_DESIGN)
    T._BEST.pop(key, None)
    T.layer_norm_backward(dy, xd, wd, mean, rstd)  # the timed choice, as the first autograd call makes it
    chosen = T._BEST.get(key, cands[0])
    seen = choice.TIMES.get(key, {})
    print(f"\n{str(dtype)[6:]} N={n} M={m}: choice among {len(cands)} -> {name(chosen)}; as timed: "
          + ", ".join(f"{name(c)} {t:.3f}" if t is not None else f"{name(c)} no fit" for c, t in seen.items()))
    args = (x, w, b)
    ours = fwd_bwd(lambda x, w, b: A.layer_norm_autograd(x, w, b, EPS), args, dy)
    impls = {"fwd": lambda: T.layer_norm(xd, wd, bd, EPS),
             "fwd+stats": lambda: T._forward(xd, wd, bd, EPS, False, True, "gap")}
    for p in cands + extra:
        impls[f"bwd {name(p)}"] = lambda p=p: T.layer_norm_backward(dy, xd, wd, mean, rstd, plan=p)
    impls["bwd default"] = lambda: T.layer_norm_backward(dy, xd, wd, mean, rstd)
    impls["fwd+bwd default"] = ours
    impls["fwd then bwd, no autograd"] = lambda: T.layer_norm_backward(
        dy, xd, wd, *T._forward(xd, wd, bd, EPS, False, True, "gap")[1:])
    impls["fwd+bwd default (graph)"] = (ours, lambda f, **k: timing.time_ms(f, cuda_graph=True, graph_calls=4, **k))
    for p in cands + extra:
        impls[f"fwd+bwd {name(p)}"] = pinned(ours, p)
    if lg is not None:
        impls["fwd+bwd liger"] = fwd_bwd(lg, args, dy)
    impls["fwd+bwd torch"] = fwd_bwd(lambda x, w, b: F.layer_norm(x, (n,), w, b, EPS), args, dy)
    if smoke:  # every callable runs once: the script works, nothing is timed
        for f in impls.values():
            (f[0] if isinstance(f, tuple) else f)()
        return [(str(dtype)[6:], n, k, float("nan")) for k in impls]
    errors: dict = {}
    got = timing.time_rounds(impls, ROUNDS, errors=errors, warmup=3, rep=20)
    rows = [(str(dtype)[6:], n, k, t.median, t.p20, t.p80) for k, t in got.items()]
    rows.append((str(dtype)[6:], n, "host us/call fwd+bwd default", host_us(ours), float("nan"), float("nan")))
    for k, e in errors.items():
        print(f"  {k} failed: {e[:200]}")
    return rows


def main(argv):
    smoke = "--smoke" in argv
    if not smoke and not cu.on_gpu():
        print("layernorm_gap.py needs a CUDA GPU (or --smoke under the interpreter)", file=sys.stderr)
        return 2
    device = env.DEVICE
    torch.manual_seed(0)
    t0 = time.time()
    if not smoke:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; design {T.BACKWARD_DESIGN}")
    check(device)
    lg = None if smoke else liger()
    rows = []
    for dtype in DTYPES:
        for n in ((64, 128) if smoke else NS):
            rows += case(n, dtype, lg, device, smoke)
            if not smoke:
                torch.cuda.empty_cache()  # the case's 256 MiB tensors are gone with it
    print(f"\n{'dtype':>8} {'N':>6}  {'what':<52} {'ms':>8} {'p20':>7} {'p80':>7}   (host: us)")
    for r in rows:
        d, n, k, ms = r[:4]
        p20, p80 = (r[4], r[5]) if len(r) > 4 else (float("nan"),) * 2
        print(f"{d:>8} {n:>6}  {k:<52} {ms:8.3f} {p20:7.3f} {p80:7.3f}")
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
