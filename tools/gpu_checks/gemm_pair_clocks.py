"""Why a GEMM followed by GELU took less time than the two kernels timed alone (chapter 9, cell
``model-vs-measured-says``; issue 30 A2): the GPU's SM clock and power, sampled by ``nvidia-smi`` while
each pattern runs, beside the time of the GEMM inside each pattern (CUDA events around each kernel).

Patterns, at 16384 x 4096 x 16384 bf16 (``addmm`` as ``linear`` runs it, then the GELU kernel chapter 9
times alone):
- ``addmm back to back``: the GEMM alone, call after call (how gemm.csv times ``addmm``);
- ``addmm, then GELU``: the pair, call after call (how gemm.csv times ``addmm+gelu``), each kernel timed;
- ``addmm, GPU idle between``: the GEMM alone with the GPU idle ~0.5 ms before each call.

    python tools/gpu_checks/gemm_pair_clocks.py [--seconds 4]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time

import torch
import torch.nn.functional as F

M, K, N = 16384, 4096, 16384
SAMPLE_MS = 50


def sampler(path: str) -> subprocess.Popen:
    """nvidia-smi writing (time, SM clock MHz, power W) every SAMPLE_MS ms to ``path``."""
    return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                             "--format=csv,noheader,nounits", f"-lms={SAMPLE_MS}", f"--filename={path}"])


def card_limits() -> str:
    """The card's power limit and SM clock ceiling as nvidia-smi reports them (what "at the limit" is held to)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=power.limit,clocks.max.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()[0]
        limit_w, max_mhz = (float(v) for v in out.split(","))
    except (OSError, IndexError, subprocess.SubprocessError, ValueError):
        return "power limit not read"
    return f"power limit {limit_w:.0f} W, SM clock at most {max_mhz:.0f} MHz"


def run(pattern: str, seconds: float, x, w, b):
    """(GEMM ms per call, GELU ms per call or None, wall start, wall end) of ``pattern`` for ``seconds``."""
    gemm = []
    t_start = time.time()
    while time.time() - t_start < seconds:
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        if pattern == "idle":
            torch.cuda.synchronize()
            time.sleep(0.0005)
        e[0].record()
        y = torch.addmm(b, x, w.t())
        e[1].record()
        if pattern == "pair":
            F.gelu(y, approximate="tanh")
            e[2].record()
        if pattern == "idle" or len(gemm) % 8 == 7:
            torch.cuda.synchronize()
        gemm.append(e)
    torch.cuda.synchronize()
    t_end = time.time()
    g = [a.elapsed_time(c) for a, c, _ in gemm]
    h = [c.elapsed_time(d) for _, c, d in gemm] if pattern == "pair" else None
    return statistics.median(g[3:]), (statistics.median(h[3:]) if h else None), t_start, t_end


def clocks(path: str, start: float, end: float):
    """Median SM clock and power over the samples taken between ``start`` and ``end`` (epoch seconds)."""
    import datetime
    mhz, watts = [], []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            if start + 0.5 <= t <= end:   # the first half second: the pattern settles
                mhz.append(float(parts[1]))
                watts.append(float(parts[2]))
        except ValueError:
            continue
    return (statistics.median(mhz) if mhz else float("nan"), statistics.median(watts) if watts else float("nan"),
            len(mhz))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        F.gelu(torch.addmm(b, x, w.t()), approximate="tanh")
    torch.cuda.synchronize()
    path = tempfile.mktemp(suffix=".csv")
    smi = sampler(path)
    time.sleep(1.0)
    rows = []
    try:
        for name, pattern in (("addmm back to back", "alone"), ("addmm, then GELU", "pair"),
                              ("addmm, GPU idle between", "idle"), ("addmm back to back (again)", "alone")):
            gm, gl, t0, t1 = run(pattern, a.seconds, x, w, b)
            time.sleep(0.3)
            rows.append((name, gm, gl, t0, t1))
    finally:
        time.sleep(0.3)
        smi.terminate()
        smi.wait()
    print(f"{torch.cuda.get_device_name()}, {M} x {K} x {N} bf16; nvidia-smi every {SAMPLE_MS} ms; {card_limits()}")
    print(f"{'pattern':30s} {'GEMM ms':>8s} {'GELU ms':>8s} {'SM MHz':>7s} {'power W':>8s} {'samples':>7s}")
    for name, gm, gl, t0, t1 in rows:
        mhz, watts, n = clocks(path, t0, t1)
        print(f"{name:30s} {gm:8.3f} {gl if gl is not None else float('nan'):8.3f} {mhz:7.0f} {watts:8.0f} {n:7d}")


if __name__ == "__main__":
    main()
