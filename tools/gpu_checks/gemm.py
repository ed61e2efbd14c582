"""Chapter 9 on a GPU: the checkers' GPU-side verdicts, the tuned GEMM against float64, and where the time goes.

1. Checkers (issue 23): on a GPU nothing records loads, so the NaN guard zones and the exact float32 case
   must do the work. A correct kernel passes; the erf GELU fails exercise 9.2's checks naming "erf"; a K
   mask on one operand fails the matmul check every time (5 runs each, fresh inputs).
2. The tuned ``linear_gelu`` and ``matmul`` against float64 at the benchmark's MLP and decode shapes (bf16,
   fp16), max |error| / max |reference| under 1e-2.
3. Timing, bf16 and fp16, interleaved rounds of the course's harness (``bench.time_rounds``; decode shapes
   as CUDA graphs, as ``make bench`` does): ``fused``, ``matmul``, ``mm``, ``addmm`` (cuBLASLt with its
   bias epilogue), ``gelu`` (the GELU kernel alone on a product computed beforehand), ``addmm+gelu`` and
   ``addmm_act`` (``torch._addmm_activation``). The table gives the ratios the chapter reads: fused vs
   addmm+gelu and vs addmm_act, the epilogue's cost in each kernel (fused / matmul - 1, addmm_act / mm - 1),
   and the GELU kernel alone against ``addmm+gelu - addmm`` (what the old "GELU kernel's cost" inferred),
   with the GB/s of its own 2 x M x N bytes. At the decode shapes, the split-K plan (``TileConfig.split_k``
   2 and 4 on the fused kernel's own tiles; not a default) as speed ratios to ``fused`` (> 1: split-K is
   faster), and its accuracy in part 2; at the MLP shapes, the same for the subtiled epilogue
   (``subtile=True``: the epilogue and its TMA store in two halves, so the first half's store is in flight
   while the second half's GELU runs).

Run from the repository root on an H100 (under 3 minutes):

    python tools/gpu_checks/gemm.py            # (--smoke: tiny sizes on the CPU, to test the script)
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import course_utils as cu
from course_utils import bench, check

SMOKE = "--smoke" in sys.argv
MLP = ((4096, 4096, 16384), (8192, 2048, 8192), (16384, 4096, 16384))   # M, K, N
DECODE = ((1, 4096, 16384), (16, 4096, 16384), (64, 4096, 16384))
DTYPES = (torch.bfloat16, torch.float16)
if SMOKE:
    MLP, DECODE, DTYPES = ((40, 32, 48),), ((1, 32, 48),), (torch.float16,)


def checkers() -> list[str]:
    sys.path.insert(0, ".")
    from course_utils.checkers import gemm as cg
    from tests import test_gemm_checkers as T
    lines = []
    fp32 = (torch.float32,)
    cg.check_matmul(T._launcher(T.OK, False))
    cg.check_linear_gelu(T._launcher(T.OK, True))
    cg.check_linear_gelu_residual(T._launcher(T.OK, True, residual=True))
    lines.append("correct kernels: PASS x 3")
    for what, fn, checker, words in (
            ("erf GELU, 9.2 bias + GELU", T._launcher(T.ERF_GELU, True), cg.check_linear_gelu, "erf"),
            ("erf GELU, 9.2 residual", T._launcher(T.ERF_GELU, True, residual=True), cg.check_linear_gelu_residual,
             "erf"),
            ("K mask on a only", T._launcher(T.K_MASK_A_ONLY, False), cg.check_matmul, "K mask"),
            ("K mask on b only", T._launcher(T.K_MASK_B_ONLY, False), cg.check_matmul, "K mask")):
        named = 0
        for _ in range(1 if SMOKE else 5):
            try:
                checker(fn, dtypes=fp32)
            except check.CheckFailure as e:
                named += words in str(e)
        lines.append(f"{what}: failed naming '{words}' in {named} of {1 if SMOKE else 5} runs")
    return lines


def _inputs(m, k, n, dtype):
    x = torch.randn(m, k, device=cu.DEVICE, dtype=dtype)
    w = torch.randn(k, n, device=cu.DEVICE, dtype=dtype) / k ** 0.5
    b = torch.randn(n, device=cu.DEVICE, dtype=dtype)
    return x, w, b


def accuracy() -> list[str]:
    from course_utils.tuned import gemm as TG
    lines = []
    for m, k, n in MLP + DECODE:
        for dtype in DTYPES:
            x, w, b = _inputs(m, k, n, dtype)
            ref = F.gelu(x.double() @ w.double() + b.double(), approximate="tanh")
            runs = {"linear_gelu": (TG.linear_gelu(x, w, b), ref), "matmul": (TG.matmul(x, w), x.double() @ w.double())}
            for key, cfg in (_split_configs(x, w, b) if m <= 64 else _subtile_configs(x, w, b)).items():
                runs[key] = (TG.linear_gelu(x, w, b, config=cfg), ref)
            errs = {key: float((got.double() - want).abs().max() / want.abs().max())
                    for key, (got, want) in runs.items()}
            ok = all(e < 1e-2 for e in errs.values())
            lines.append(f"{m}x{k}x{n} {str(dtype)[6:]}: " + ", ".join(f"{key} {e:.1e}" for key, e in errs.items())
                         + (" ok" if ok else " TOO LARGE"))
    return lines


def _split_configs(x, w, b):
    """The fused kernel's own tiles with split-K 2 and 4 (pointer loads), as benchmarks/gemm.py times them."""
    from dataclasses import replace

    from course_utils.tuned import gemm as TG
    TG.linear_gelu(x, w, b)
    plain = replace(TG.last_config, tma=False, ws=False, subtile=False, per_sm=1)
    return {f"fused_splitk{s}": replace(plain, split_k=s) for s in (2, 4)}


def _subtile_configs(x, w, b):
    """The fused kernel's own tiles with the epilogue and TMA store in two halves (MLP shapes, sm_90)."""
    from dataclasses import replace

    from course_utils.tuned import gemm as TG
    TG.linear_gelu(x, w, b)
    cfg = TG.last_config
    return {"fused_subtile": replace(cfg, subtile=True)} if cfg.tma and not cfg.subtile else {}


def _impls(x, w, b, split=False):
    from course_utils.tuned import gemm as TG
    y = torch.addmm(b, x, w)   # the product the GELU kernel alone reads
    plans = _split_configs(x, w, b) if split else _subtile_configs(x, w, b)
    extra = {key: (lambda c=c: TG.linear_gelu(x, w, b, config=c)) for key, c in plans.items()}
    return extra | {"fused": lambda: TG.linear_gelu(x, w, b), "matmul": lambda: TG.matmul(x, w),
            "mm": lambda: torch.mm(x, w), "addmm": lambda: torch.addmm(b, x, w),
            "gelu": lambda: F.gelu(y, approximate="tanh"),
            "addmm+gelu": lambda: F.gelu(torch.addmm(b, x, w), approximate="tanh"),
            "addmm_act": lambda: torch._addmm_activation(b, x, w, use_gelu=True)}


def _wall_clock(fn, **_):
    """--smoke only (no GPU timer on the CPU): one wall-clock call, to run the table's code."""
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    return bench.Timing(ms, ms, ms, 1)


def timing():
    import pandas as pd

    from course_utils.tuned import gemm as TG
    rows = []
    for kind, shapes in (("mlp", MLP), ("decode", DECODE)):
        for m, k, n in shapes:
            for dtype in DTYPES:
                impls = _impls(*_inputs(m, k, n, dtype), split=kind == "decode")
                for fn in impls.values():   # compile, choose tiles outside the timing
                    fn()
                impls["fused"]()
                config = str(TG.last_config).replace("TileConfig", "")[:60]
                graph = kind == "decode" and cu.on_gpu()
                t = bench.time_rounds(impls, 1 if SMOKE else 3, warmup=5, rep=20 if graph else 10, cuda_graph=graph,
                                      **({"timer": _wall_clock} if SMOKE else {}))
                ms = {key: v.median for key, v in t.items()}
                rows.append({"shape": f"{m}x{k}x{n}", "dtype": str(dtype)[6:],
                             "fused/addmm+gelu": ms["addmm+gelu"] / ms["fused"],
                             "fused/addmm_act": ms["addmm_act"] / ms["fused"],
                             "epi fused": ms["fused"] / ms["matmul"] - 1,
                             "epi addmm_act": ms["addmm_act"] / ms["mm"] - 1,
                             **{f"{key}/fused": ms["fused"] / ms[key] for key in ms if key.startswith("fused_")},
                             "gelu ms": ms["gelu"], "addmm+gelu-addmm ms": ms["addmm+gelu"] - ms["addmm"],
                             "addmm+gelu-mm ms": ms["addmm+gelu"] - ms["mm"],
                             "gelu GB/s": 2 * m * n * dtype.itemsize / (ms["gelu"] * 1e-3) / 1e9,
                             "config": config})
                del impls
                if cu.on_gpu():
                    torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def main() -> int:
    import pandas as pd
    if not cu.on_gpu() and not SMOKE:
        print("tools/gpu_checks/gemm.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    t0 = time.time()
    print(f"device: {cu.env.device_name()}", flush=True)
    for line in ([] if "--no-checkers" in sys.argv else checkers()):
        print("checker:", line, flush=True)
    print(f"({time.time() - t0:.0f} s)", flush=True)
    for line in accuracy():
        print("accuracy:", line, flush=True)
    print(f"({time.time() - t0:.0f} s)", flush=True)
    df = timing()
    pd.set_option("display.width", 250)
    print(f"timing ({time.time() - t0:.0f} s), device {cu.env.device_name()}:")
    print(df.round(4).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
