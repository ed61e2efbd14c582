"""Decode-shape tile sweep of the tuned GEMM (issue 29: fused >= 1.0x addmm + GELU at M in {1, 16, 64}).

At decode shapes (M <= 64, K = 4096, N = 16384) the product is memory-bound: W's 128 MiB stream through
the SMs once, and what decides the time is how many bytes each SM keeps in flight and how evenly the
programs cover the 132 SMs. For each M and dtype, every tile below is checked against float64 math
(max |error| / max |reference| < 1e-2), then all of them are timed as CUDA graphs in interleaved rounds
beside ``torch.mm``, ``addmm + gelu`` and ``torch._addmm_activation``, and the launcher's own choice
(``fused``). Prints, per case, the shipped candidates' and the sweep's best time against addmm + gelu.

    python tools/gpu_checks/gemm_decode_tiles.py [--out DIR]      # one H100/H200, about 3 minutes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import course_utils as cu  # noqa: E402
from course_utils import bench, hardware  # noqa: E402
from course_utils.tuned import gemm as TG  # noqa: E402

K, N = 4096, 16384
MS = (1, 16, 64)
DTYPES = (torch.bfloat16, torch.float16)
# (block_n, block_k, num_stages) for pointer and descriptor tiles; block_m is 16 (M <= 16) or 64
SHAPES = [(32, 256, 4), (64, 256, 3), (64, 256, 4), (64, 128, 6), (64, 128, 8), (128, 128, 4), (128, 64, 8),
          (32, 128, 8), (128, 256, 3)]


def sweep(m: int, itemsize: int) -> list[TG.TileConfig]:
    """Every tile of SHAPES, pointers and descriptors (1 or 2 programs per SM), that fits shared memory."""
    bm = 16 if m <= 16 else 64
    budget = int(hardware.device_info().smem_per_block_bytes * 0.95)
    cands = []
    for bn, bk, st in SHAPES:
        for tma, per_sm in ((False, 1), (True, 1), (True, 2)):
            c = TG.TileConfig(bm, bn, bk, 4, st, tma=tma, per_sm=per_sm)
            if c.smem_bytes(itemsize) * per_sm <= budget:
                cands.append(c)
    return cands


def tag(c: TG.TileConfig) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k} s{c.num_stages}" + (f" tma x{c.per_sm}" if c.tma else "")


def case(m: int, dtype) -> list[dict]:
    x = torch.randn(m, K, device=cu.DEVICE, dtype=dtype)
    w = torch.randn(K, N, device=cu.DEVICE, dtype=dtype) / K ** 0.5
    b = torch.randn(N, device=cu.DEVICE, dtype=dtype)
    ref = F.gelu(x.double() @ w.double() + b.double(), approximate="tanh")
    shipped = TG.gemm_configs(hardware.device_info(), m, N, K, dtype)
    cands = list(dict.fromkeys(shipped + sweep(m, dtype.itemsize)))
    impls, errs = {}, {}
    for c in cands:
        try:
            got = TG.linear_gelu(x, w, b, config=c)
            errs[tag(c)] = float((got.double() - ref).abs().max() / ref.abs().max())
        except Exception as e:  # noqa: BLE001 - a tile that does not build here is listed, not fatal
            errs[tag(c)] = f"{type(e).__name__}: {str(e)[:80]}"
            continue
        if errs[tag(c)] < 1e-2:
            impls[tag(c)] = lambda c=c: TG.linear_gelu(x, w, b, config=c)
    TG.linear_gelu(x, w, b)
    chosen = tag(TG.last_config)
    impls |= {"fused": lambda: TG.linear_gelu(x, w, b), "mm": lambda: torch.mm(x, w),
              "addmm+gelu": lambda: F.gelu(torch.addmm(b, x, w), approximate="tanh"),
              "addmm_act": lambda: torch._addmm_activation(b, x, w, use_gelu=True)}
    t = bench.time_rounds(impls, 3, warmup=5, rep=20, cuda_graph=True)
    rows = []
    for key in impls:
        rows.append({"m": m, "dtype": str(dtype)[6:], "impl": key, "us": t[key].median * 1e3,
                     "p20": t[key].p20 * 1e3, "p80": t[key].p80 * 1e3,
                     "shipped": key in {tag(c) for c in shipped}, "chosen": key == chosen,
                     "err": errs.get(key, "")})
    rows += [{"m": m, "dtype": str(dtype)[6:], "impl": k, "err": e} for k, e in errs.items() if k not in impls]
    return rows


def main(argv=None) -> int:
    import pandas as pd
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for gemm_decode_tiles.csv")
    args = ap.parse_args(argv)
    if not cu.on_gpu():
        print("gemm_decode_tiles.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(cu.env.banner(), flush=True)
    t0, rows = time.time(), []
    for m in MS:
        for dtype in DTYPES:
            rows += case(m, dtype)
            print(f"  M={m} {dtype}: done ({time.time() - t0:.0f} s)", flush=True)
    df = pd.DataFrame(rows)
    df["gpu"], df["torch"], df["triton"] = cu.env.device_name(), torch.__version__, __import__("triton").__version__
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        df.to_csv(Path(args.out) / "gemm_decode_tiles.csv", index=False)
    for (m, dt), g in df[df.us.notna()].groupby(["m", "dtype"], sort=False):
        ref = float(g[g.impl == "addmm+gelu"].us.iloc[0])
        ours = g[~g.impl.isin(["mm", "addmm+gelu", "addmm_act", "fused"])]
        best, ship = ours.loc[ours.us.idxmin()], ours[ours.shipped]
        print(f"M={m:>2} {dt:>8}: addmm+gelu {ref:6.2f} us, mm {float(g[g.impl == 'mm'].us.iloc[0]):6.2f}, "
              f"fused (chosen {g[g.chosen].impl.tolist()}) {float(g[g.impl == 'fused'].us.iloc[0]):6.2f} -> "
              f"{ref / float(g[g.impl == 'fused'].us.iloc[0]):.3f}x; best shipped {ship.us.min():6.2f} "
              f"({ref / ship.us.min():.3f}x); best of sweep {best.impl} {best.us:6.2f} ({ref / best.us:.3f}x)")
    print(f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
