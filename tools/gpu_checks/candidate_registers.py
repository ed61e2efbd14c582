"""Registers, local-memory spills and shared memory of the timed candidates, for sm_90, without a GPU.

Each LayerNorm backward candidate (``backward_candidates``, bf16 and fp32, N = 4096, 8192, 16384; the "row" and
"mix" ones for RMSNorm too, which has no db to hold) and each
d=128 attention backward configuration (``backward_configs`` and kernel_candidates.py's tries) is compiled
for sm_90 as its launcher configures it (the compile matrix's recording, ``course_utils.aot_compile``),
and the wheel's ``ptxas -v`` reports the registers per thread and the bytes each thread spills to local
memory. A spilling candidate is not wrong, but its loads and stores go through L1 on every row: why a
one-row-per-program 1-D LayerNorm backward (Liger-Kernel's layout) is slow at N = 16384, where one row of
x, dy, w, dw and db in float32 (5 x 64 KiB) is more than an SM's 256 KiB of registers.

    python tools/gpu_checks/candidate_registers.py [--out results/ptx/candidate_registers.csv]

(Runs on a CPU machine with the Linux Triton wheel; about a minute.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402  (before course_utils: triton's own modules load without the interpreter)
import triton.language  # noqa: E402, F401

import course_utils  # noqa: E402, F401  (it sets TRITON_INTERPRET on a machine without a GPU)

os.environ.pop("TRITON_INTERPRET", None)  # the kernels below must be real JITFunctions, compiled, never run

import argparse  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

from course_utils import hardware  # noqa: E402
from course_utils.aot import empty  # noqa: E402
from course_utils.aot_compile import ptx_of  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def ptxas_report(ptx: str) -> tuple[int, int, int]:
    """(registers per thread, spill store bytes, spill load bytes) that ptxas -v reports for sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([str(PTXAS), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", out.stderr + out.stdout)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr + out.stdout)
    stores, loads = spills[-1] if spills else (0, 0)
    return int(regs[-1]), int(stores), int(loads)


def layernorm_rows(info) -> list[dict]:
    from course_utils.tuned import layernorm as T
    rows = []
    for dt in (torch.bfloat16, torch.float32):
        for n in (4096, 8192, 16384):
            m = 2**28 // (n * dt.itemsize)  # the benchmark's 256 MiB input
            x, w, st = empty(m, n, dtype=dt), empty(n, dtype=dt), empty(m)
            cands = T.backward_candidates(m, n, dt.itemsize, info, interpreter=False)
            norms = {c: (False, True) if c.version in ("row", "mix") else (False,) for c in cands}   # rms or not
            for p, rms in [(c, rms) for c in cands for rms in norms[c]]:
                for k in ptx_of(lambda p=p, rms=rms: T._backward(x, x, w, st, st, rms, False, "registers", p), 90):
                    if "column_sum" in k["kernel"]:
                        continue
                    regs, stores, loads = ptxas_report(k["ptx"])
                    rows.append({"op": "rmsnorm_bwd" if rms else "layernorm_bwd", "dtype": str(dt)[6:], "N": n,
                                 "version": p.version,
                                 "block": p.BLOCK_N, "num_warps": p.num_warps, "grid": p.grid, "stages": p.stages,
                                 "chunk": p.chunk, "kernel": k["kernel"].rsplit(".", 1)[-1], "registers": regs,
                                 "spill_store_bytes": stores, "spill_load_bytes": loads,
                                 "shared_bytes": k["shared_bytes"]})
    return rows


def attention_rows(info) -> list[dict]:
    from course_utils.tuned import attention_backward as TB
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    tries = []
    try:
        import kernel_candidates
        tries = kernel_candidates.ATTN_TRIES
    except Exception as e:  # noqa: BLE001 - the candidates alone then
        print(f"kernel_candidates.py's tries skipped: {type(e).__name__}: {e}")
    rows = []
    dt = torch.bfloat16
    q, o, do, k, v = (empty(1, 16, 4096, 128, dtype=dt) for _ in range(5))
    lse = empty(1, 16, 4096)
    for c in list(dict.fromkeys(TB.backward_configs(info, 128, dt) + tries)):
        for kk in ptx_of(lambda c=c: TB.flash_attention_backward(q, k, v, o, lse, do, False, config=c), 90):
            if "preprocess" in kk["kernel"]:
                continue
            regs, stores, loads = ptxas_report(kk["ptx"])
            rows.append({"op": "attention_bwd d=128", "dtype": "bfloat16", "N": 4096, "version": str(c),
                         "num_warps": c.num_warps, "stages": c.num_stages, "kernel": kk["kernel"].rsplit(".", 1)[-1],
                         "registers": regs, "spill_store_bytes": stores, "spill_load_bytes": loads,
                         "shared_bytes": kk["shared_bytes"]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the table here as CSV")
    args = ap.parse_args(argv)
    if not PTXAS.exists():
        print(f"no ptxas at {PTXAS}: this needs the Linux Triton wheel", file=sys.stderr)
        return 2
    import pandas as pd
    pd.set_option("display.width", 250)
    info = hardware.DeviceInfo.for_arch(90)
    df = pd.DataFrame(layernorm_rows(info) + attention_rows(info))
    df["triton"] = triton.__version__
    if args.out:
        df.to_csv(args.out, index=False)
    print(df.drop(columns=["triton"]).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
