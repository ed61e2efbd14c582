"""Registers and spills of the LayerNorm backward's plans, compiled for sm_90 on any machine (no GPU).

Chapter 10 compares Liger-Kernel's backward layout (one program per SM, one row at a time, dw and db
summed in registers) run on the course's kernel (``T.per_sm_plan``) with Liger's own kernel. This
compiles, for sm_90, the launch of each backward plan the tuned shelf can choose at N = 4096, 8192 and
16384 (256 MiB inputs, bf16 and fp32), through ``course_utils.aot``'s pretend-and-compile, and runs
the Triton wheel's ``ptxas -v`` on each PTX: registers per thread, and the bytes per thread that the
kernel spills to local memory (stores and loads; local memory is cached in L1 and L2). Static counts
from the compiler, not a measurement of traffic on a GPU.

    python tools/layernorm_spills.py [--out results/ptx]     # writes layernorm_bwd_spills.csv
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile

_BOOT = ("import os, sys, runpy, triton, triton.language\nimport course_utils\n"
         "os.environ.pop('TRITON_INTERPRET', None)  # import course_utils set it (no GPU): kernels must be real\n"
         "sys.argv = [sys.argv[0], '--booted', *sys.argv[1:]]\nrunpy.run_path(%r, run_name='__main__')")
NS = (4096, 8192, 16384)
INPUT_BYTES = 256 * 2**20


def ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers, stack and spill bytes per thread that ``ptxas -v`` reports for ``ptx``."""
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr

    def num(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0
    return {"registers": num(r"Used (\d+) registers"), "stack_bytes": num(r"(\d+) bytes stack frame"),
            "spill_store_bytes": num(r"(\d+) bytes spill stores"), "spill_load_bytes": num(r"(\d+) bytes spill loads")}


def rows(arch: int = 90) -> list[dict]:
    import torch
    import triton

    from course_utils import aot_compile, hardware
    from course_utils.tuned import layernorm as T
    info = hardware.DeviceInfo.for_arch(arch)
    out = []
    for dt in (torch.bfloat16, torch.float32):
        for n in NS:
            m = INPUT_BYTES // (n * dt.itemsize)
            x, w, st = torch.empty(m, n, dtype=dt), torch.empty(n, dtype=dt), torch.empty(m)
            plans = {"per-SM (Liger's layout)": T.per_sm_plan(m, n, info)}
            for p in T.backward_candidates(m, n, dt.itemsize, info, interpreter=False):
                plans.setdefault(f"{p.version} BLOCK_N={p.BLOCK_N} w{p.num_warps} grid={p.grid}", p)
            for name, p in plans.items():
                def call(p=p):
                    return T._launch_backward(p, torch.empty_like(x), x, x, w, st, st, False, False)
                for k in aot_compile.ptx_of(call, arch):
                    out.append({"arch": arch, "dtype": str(dt).removeprefix("torch."), "n_cols": n, "plan": name,
                                "version": p.version, "block": p.BLOCK_N, "num_warps": p.num_warps,
                                "kernel": k["kernel"].rsplit(".", 1)[-1], **ptxas_usage(k["ptx"], arch),
                                "shared_bytes": k["shared_bytes"], "triton": triton.__version__,
                                "date": datetime.date.today().isoformat()})
                    print(f"  {out[-1]['dtype']:8s} N={n:5d} {name:40s} {out[-1]['registers']:3d} registers, "
                          f"{out[-1]['spill_store_bytes']:5d} B spill stores", file=sys.stderr, flush=True)
    return out + liger_rows(arch)


def liger_rows(arch: int) -> list[dict]:
    """The same counts for Liger-Kernel's backward kernel, as its launcher configures it on CUDA (one
    program per SM, 16 warps from 8192 columns), when ``liger_kernel`` imports; else none."""
    import torch
    import triton

    from course_utils import hardware
    from course_utils import triton_internals as internals
    try:
        import importlib.metadata

        from liger_kernel.ops.layer_norm import _layer_norm_backward_kernel
        from liger_kernel.ops.utils import calculate_settings
        version = importlib.metadata.version("liger-kernel")
    except Exception as e:  # noqa: BLE001 - an absent peer is reported, not fatal
        print(f"  Liger-Kernel rows skipped: {type(e).__name__}: {e}", file=sys.stderr)
        return []
    sms, target, out = hardware.DeviceInfo.for_arch(arch).sms, internals.gpu_target(arch), []
    for dt in (torch.bfloat16, torch.float32):
        for n in NS:
            m = INPUT_BYTES // (n * dt.itemsize)
            x, st, part = torch.empty(m, n, dtype=dt), torch.empty(m), torch.empty(sms, n)
            block, warps = calculate_settings(n)
            args = (x, n, torch.empty(n, dtype=dt), st, 1, st, 1, x, n, part, n, part, n, x, n, m, n)
            launch = dict(rows_per_program=-(-m // sms), BLOCK_SIZE=block, num_warps=warps)
            src, options = internals.bind(_layer_norm_backward_kernel, args, launch, target)
            k = internals.compile_for(src, target, options)
            out.append({"arch": arch, "dtype": str(dt).removeprefix("torch."), "n_cols": n,
                        "plan": f"Liger-Kernel {version}", "version": "liger", "block": block, "num_warps": warps,
                        "kernel": "_layer_norm_backward_kernel", **ptxas_usage(k.asm["ptx"], arch),
                        "shared_bytes": int(k.metadata.shared), "triton": triton.__version__,
                        "date": datetime.date.today().isoformat()})
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--booted" not in argv:   # a fresh process that imports Triton before course_utils (interpreter off)
        from course_utils import aot
        return subprocess.call([sys.executable, "-c", _BOOT % os.path.abspath(__file__), *argv],
                               env=aot.subprocess_env())
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--booted", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join("results", "ptx"))
    a = ap.parse_args(argv)
    import pandas as pd
    df = pd.DataFrame(rows())
    os.makedirs(a.out, exist_ok=True)
    df.to_csv(os.path.join(a.out, "layernorm_bwd_spills.csv"), index=False)
    pd.set_option("display.width", 200)
    print(df[["dtype", "n_cols", "plan", "kernel", "registers", "spill_store_bytes", "spill_load_bytes"]]
          .to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
