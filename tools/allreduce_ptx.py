"""Load widths and barrier atomics of chapter 13's all-reduce kernels, read from sm_90 PTX (no GPU needed).

    python tools/allreduce_ptx.py [--out results/ptx/allreduce_ptx.csv]

Each launcher (teaching one-shot and fused; the fast path's one-shot and two-shot, plain and fused) is
called as rank 0 of a 2- and a 4-rank group on a bf16 (8192, 768) tensor, recorded and compiled for
sm_90 with the argument specialization a GPU launch gets (course_utils.aot's pretend-and-compile).
Per kernel: the global loads and stores by width (static instructions in the PTX, each executed once
per row and thread), the atomics (compare-and-swap or add, release or acquire) and the block barriers
(``bar.sync``). A 2-byte load (``ld.global.b16``) moves one bf16; a 16-byte one (``ld.global.v4.b32``)
moves eight.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys

BOOT = ("import os, sys, triton, triton.language\nimport course_utils\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "sys.path.insert(0, os.path.join(os.getcwd(), 'tools'))\n"
        "import allreduce_ptx\nsys.exit(allreduce_ptx.main(sys.argv[1:], _booted=True))")
WIDTH = {"b16": 2, "b32": 4, "b64": 8, "v2.b32": 8, "v4.b32": 16, "v2.b64": 16}


def count(ptx: str) -> dict:
    """Static counts of global loads and stores by bytes per thread, atomics and barriers in ``ptx``."""
    row = {f"{op}_{n}B": 0 for op in ("ld", "st") for n in sorted(set(WIDTH.values()))}
    for op in ("ld", "st"):
        for m in re.finditer(rf"\b{op}\.global(?:\.volatile)?\.((?:v[24]\.)?b(?:16|32|64))\b", ptx):
            key = f"{op}_{WIDTH[m.group(1)]}B"
            row[key] += 1
    row["ld_volatile"] = len(re.findall(r"\bld\.volatile\.global", ptx))
    row["atom_cas"] = len(re.findall(r"\batom\.global\.\S*cas", ptx))
    row["atom_add"] = len(re.findall(r"\batom\.global\.\S*add", ptx))
    row["bar_sync"] = len(re.findall(r"\bbar\.sync\b", ptx))
    return row


def cases():
    """(what, call) pairs: every launcher as rank 0 of a world of 2 and 4 (nothing runs; launches are recorded)."""
    import torch

    from course_utils.kernels import allreduce as K
    dt = torch.bfloat16
    for world in (2, 4):
        ranks = K._GpuRank(world, 8192 * 768, dt)
        x, w = torch.empty(8192, 768, dtype=dt), torch.empty(768, dtype=dt)
        yield f"teaching one-shot, W={world}", lambda x=x, r=ranks: K.one_shot_all_reduce_teaching([x], r)
        yield f"teaching fused, W={world}", lambda x=x, w=w, r=ranks: K.all_reduce_add_rms_norm_teaching([x], [x], w, r)
        try:
            from course_utils.tuned import allreduce as T
        except ImportError:   # a commit before the fast path
            continue
        for a in T.ALGORITHMS:
            yield f"tuned {a}, W={world}", lambda x=x, r=ranks, a=a: T.all_reduce([x], r, a)
            yield (f"tuned fused {a}, W={world}",
                   lambda x=x, w=w, r=ranks, a=a: T.all_reduce_add_rms_norm([x], [x], w, r, 1e-6, a))


def facts(arch: int = 90):
    import pandas as pd
    import triton

    from course_utils import aot_compile
    rows = []
    for what, call in cases():
        for launch in aot_compile.ptx_of(call, arch):
            rows.append({"arch": arch, "what": what, "kernel": launch["kernel"], **count(launch["ptx"]),
                         "shared_bytes": launch["shared_bytes"], "triton": triton.__version__,
                         "date": datetime.date.today().isoformat()})
    return pd.DataFrame(rows).fillna(0)


def main(argv=None, _booted: bool = False) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("results", "ptx", "allreduce_ptx.csv"))
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args(argv)
    if not _booted:   # Triton first, the interpreter off, then course_utils: in a fresh process
        from course_utils import aot
        return subprocess.call([sys.executable, "-c", BOOT, *argv], env=aot.subprocess_env())
    df = facts(a.arch)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    df.to_csv(a.out, index=False)
    cols = [c for c in df.columns if c not in ("arch", "triton", "date")]
    print(df[cols].to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
