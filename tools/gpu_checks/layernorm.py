"""LayerNorm forward + backward on a GPU: the tuned backward's designs against Liger-Kernel and F.layer_norm.

Checks every implementation against float64 autograd first (odd and offset rows), then times forward +
backward through autograd (x, weight and bias get gradients) on 256 MiB inputs, bf16 and fp32, N from
1024 to 16384: the median of ROUNDS interleaved rounds of ``triton.testing.do_bench`` medians. Columns:

- ``course``: chapter 10's own candidates (``backward_design("course")``: tiles of rows, 1-4 programs per SM,
  the chunked kernel for N >= 8192; the fastest candidate timed at first use);
- ``per-sm``: Liger-Kernel's layout on the course's kernel (one program per SM, one row at a time);
- ``both``: the timed choice among all of them;
- ``liger`` (Liger-Kernel, if ``import liger_kernel`` works) and ``torch`` (``F.layer_norm``);
- ``fwd`` and ``bwd``: the course's forward (statistics stored) and default backward alone, to show
  where the fwd+bwd time goes; and, per case, the backward alone with every candidate plan.

The last table gives each time ratio (theirs / ours: >= 1.0 is the issue's target) and the plan the
default design picked. Run from the repository root on an H100 (under 3 minutes):

    python tools/gpu_checks/layernorm.py          # (--smoke: tiny sizes on the CPU, to test the script)
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
import triton

import course_utils as cu
from course_utils import hardware
from course_utils.tuned import choice
from course_utils.tuned import layernorm as T
from course_utils.tuned import layernorm_autograd as A

NS = (1024, 2048, 4096, 8192, 16384)
DTYPES = (torch.float32, torch.bfloat16)
INPUT_BYTES = 256 * 2**20
ROUNDS = 3
EPS = 1e-5
CHECK_SHAPES = ((777, 1000), (333, 4097), (301, 16384))
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}  # relative to max(|ref|, 1), as tests/test_layernorm.py


def liger():
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except Exception as e:  # noqa: BLE001 - a missing peer is a skipped column, not a failure
        print(f"liger column skipped: liger_kernel does not import ({type(e).__name__}: {str(e)[:100]})")
        return None
    import liger_kernel
    print(f"Liger-Kernel {getattr(liger_kernel, '__version__', '?')}")
    return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)


def implementations(lg):
    """{name: fn(x, w, b) -> y}; for the course's designs (named as BACKWARD_DESIGNS) the caller sets the
    design around forward and backward both (autograd runs the backward after ``fn`` returns)."""
    ours = lambda x, w, b: A.layer_norm_autograd(x, w, b, EPS)  # noqa: E731
    impls = {"course": ours, "per-sm": ours, "both": ours,
             "torch": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS)}
    if lg is not None:
        impls["liger"] = lg
    return impls


def fwd_bwd(name, fn, x, w, b, dy):
    """fwd+bwd as a training step runs it, inside the backward design ``name`` when it is one."""
    def run():
        with T.backward_design(name if name in T.BACKWARD_DESIGNS else T.BACKWARD_DESIGN):
            y = fn(x, w, b)
            return torch.autograd.grad(y, (x, w, b), dy)
    return run


def check(impls) -> bool:
    ok = True
    for dtype in DTYPES:
        for m, n in CHECK_SHAPES:
            x = (torch.randn(m, n + 3, device=cu.DEVICE) * 2 + 30).to(dtype)[:, :n]
            w, b = (1 + 0.1 * torch.randn(n, device=cu.DEVICE)).to(dtype), torch.randn(n, device=cu.DEVICE).to(dtype)
            dy = torch.randn(m, n, device=cu.DEVICE).to(dtype)
            xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
            yd = F.layer_norm(xd, (n,), wd, bd, EPS)
            want = [yd.detach(), *torch.autograd.grad(yd, (xd, wd, bd), dy.double())]
            for name, fn in impls.items():
                a = [t.detach().clone().requires_grad_() for t in (x, w, b)]
                with T.backward_design(name if name in T.BACKWARD_DESIGNS else "course"):
                    y = fn(*a)
                    got = [y.detach(), *torch.autograd.grad(y, a, dy)]
                errs = [float((g.double() - r).abs().max() / r.abs().max().clamp_min(1)) for g, r in zip(got, want)]
                good = all(e <= TOL[dtype] for e in errs) and not any(bool(g.isnan().any()) for g in got)
                ok &= good or name in ("torch", "liger")  # the peers are reported, ours must pass
                print(f"{'ok ' if good else 'BAD'} {str(dtype)[6:]:>8} {m}x{n} {name:>6}: rel errs y dx dw db "
                      + " ".join(f"{e:.1e}" for e in errs), flush=True)
    return ok


def median_ms(fn) -> float:
    if not cu.on_gpu():  # --smoke under the interpreter: one wall-clock call, only to exercise the script
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def main(argv) -> int:
    global NS, DTYPES, INPUT_BYTES, ROUNDS, CHECK_SHAPES
    if "--smoke" in argv:  # the CPU test: tiny sizes under the interpreter, times meaningless
        NS, DTYPES, INPUT_BYTES, ROUNDS = (64, 256), (torch.float32,), 64 * 1024, 1
        CHECK_SHAPES = ((13, 100),)
    elif not cu.on_gpu():
        print("tools/gpu_checks/layernorm.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    start = time.time()
    impls = implementations(liger())
    if not check(impls):
        print("FAIL: one of the course's designs disagrees with float64 (above); no timings")
        return 1
    info = hardware.device_info()
    rows = []
    for dtype in DTYPES:
        for n in NS:
            m = INPUT_BYTES // (n * dtype.itemsize)
            x = torch.randn(m, n, device=cu.DEVICE, dtype=dtype, requires_grad=True)
            w = (1 + 0.1 * torch.randn(n, device=cu.DEVICE)).to(dtype).requires_grad_()
            b = (0.1 * torch.randn(n, device=cu.DEVICE)).to(dtype).requires_grad_()
            dy = torch.randn_like(x)
            xd, wd, bd = x.detach(), w.detach(), b.detach()
            _, mean, rstd = T._forward(xd, wd, bd, EPS, False, True, "gpu check")
            runs = {name: fwd_bwd(name, fn, x, w, b, dy) for name, fn in impls.items()}
            runs["fwd"] = lambda xd=xd, wd=wd, bd=bd: T._forward(xd, wd, bd, EPS, False, True, "gpu check")
            runs["bwd"] = lambda dy=dy, xd=xd, wd=wd, mean=mean, rstd=rstd: T.layer_norm_backward(  # noqa: E731
                dy, xd, wd, mean, rstd)
            for run in runs.values():
                run()  # compile, and time the candidate plans once per shape
            times = {k: [] for k in runs}
            for _ in range(ROUNDS):
                for k, run in runs.items():
                    times[k].append(median_ms(run))
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            plans = T.backward_candidates(m, n, dtype.itemsize, info, design="both")
            each = {}
            for p in plans:
                try:
                    each[p] = median_ms(lambda p=p: T.layer_norm_backward(dy, xd, wd, mean, rstd, plan=p))
                except Exception as e:  # a plan this GPU cannot fit (the timed choice skips it too)
                    if not choice.out_of_resources(e):
                        raise
                    each[p] = float("nan")
            print("  backward alone, every candidate plan (ms, nan: does not fit): " + "; ".join(
                f"{p.version} {p.ROWS}x{p.BLOCK_N} w={p.num_warps} grid={p.grid} s={p.stages}: {t:.3f}"
                for p, t in each.items()))
            key = (m, n, dtype, dtype, False, False, str(x.device), "course")
            rows.append((str(dtype)[6:], n, med, T._BEST.get(key)))
            print(f"{str(dtype)[6:]:>8} N={n:>5}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)
            torch.cuda.empty_cache()
    print(f"\n{cu.env.device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{info.sms} SMs, {time.time() - start:.0f} s; ms are fwd+bwd medians; ratios are theirs / ours")
    cols = ("dtype", "N", "course", "per-sm", "both", "liger", "torch", "fwd+bwd", "|", "lig/crs", "trc/crs",
            "lig/psm", "trc/psm", "lig/bth", "trc/bth")
    print(" ".join(f"{c:>7}" if c != "|" else c for c in cols) + "  plan picked by the default")
    for d, n, med, plan in rows:
        lig, tor = med.get("liger", float("nan")), med["torch"]
        r = [lig / med["course"], tor / med["course"], lig / med["per-sm"], tor / med["per-sm"],
             lig / med["both"], tor / med["both"]]
        print(f"{d:>7} {n:>7} {med['course']:7.3f} {med['per-sm']:7.3f} {med['both']:7.3f} {lig:7.3f} {tor:7.3f} "
              f"{med['fwd'] + med['bwd']:7.3f} | " + " ".join(f"{v:7.2f}" for v in r) + f"  {plan}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
