"""Does torch.profiler leave the host slower? (issue 27: the host_ms column of the c710c7f run)

Builds chapter 12's course step (one autograd node a block) and eager at B=8, then per version: the host time
to issue a step from an idle GPU and the wall time of steps back to back, before and after one
``profile.step_kernels`` call (the profile the training benchmark takes of each version), every thread on one
core as the benchmark times. Then the per-op host table (``ops.host_overhead_table``) unpinned, pinned, and
unpinned again; the pinned one is what the training benchmark records as ``training_overhead.csv``, and is
saved under that name with ``--save``.

    python tools/gpu_checks/host_after_profiler.py [--save]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

from benchmarks import training as T
from course_utils import affinity, bench, gpt, ops, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_process import _wall  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", action="store_true", help="record the pinned per-op table as training_overhead.csv")
    a = ap.parse_args()
    cfg, batch, _ = T.CONFIGS["gpt2-b8"]
    data = gpt.tokens()
    steps = {name: T.build(name, cfg, data, batch=batch) for name in ("eager", "course")}
    print("=== gpt2-b8, every thread on one core: host ms from an idle GPU / wall ms back to back")
    with affinity.one_core() as core:
        print(f"(core {core})")
        for name, step in steps.items():
            before = (T.host_ms(step, 10), _wall(step, 10))
            profile.step_kernels(step, steps=2)
            after = (T.host_ms(step, 10), _wall(step, 10))
            print(f"{name:8s} before the profile: host {before[0]:6.2f} wall {before[1]:6.2f}; "
                  f"after: host {after[0]:6.2f} wall {after[1]:6.2f}")
    del steps
    torch.cuda.empty_cache()
    tables = {"unpinned": ops.host_overhead_table()}
    with affinity.one_core():
        tables["one core"] = ops.host_overhead_table()
    tables["unpinned again"] = ops.host_overhead_table()
    cols = ["course_us", "aten_us", "course_fwd_bwd_us", "aten_fwd_bwd_us", "course_over_aten"]
    print("\n=== host us per call, tiny shapes (course_over_aten: the larger of the forward and fwd+bwd ratios)")
    print(pd.concat({k: t.set_index("op")[cols] for k, t in tables.items()}, axis=1).round(1).to_string())
    if a.save:
        print(f"wrote {bench.save(tables['one core'], 'training_overhead')}")


if __name__ == "__main__":
    main()
