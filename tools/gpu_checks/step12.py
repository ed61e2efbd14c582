"""Where chapter 12's step stands on a GPU, in a few minutes: GPT-2 small (or ``--config``), eager,
torch.compile and the course's ops from Python (ms per step, host ms to issue one, GPU-busy ms, GPU ms by
category), the course step's host time by who spends it (cProfile), and every op's host cost against
aten's. ``--bf16`` runs the course's step on bf16 weights with float32 masters (needs MasterAdamW).

    python tools/gpu_checks/step12.py [--config gpt2-b8] [--bf16] [--no-compile]
"""

from __future__ import annotations

import argparse
import gc
import time

import pandas as pd
import torch

from benchmarks import training as T
from course_utils import bench, gpt, profile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gpt2-b8", choices=list(T.CONFIGS))
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    cfg, batch, _ = T.CONFIGS[a.config]
    data = gpt.tokens()
    names = ["eager", "course"] + ([] if a.no_compile else ["torch.compile"])
    steps, t0 = {}, time.perf_counter()
    for name in names:
        ops, how = T.IMPLS[name]
        model = T._model(cfg, ops, bf16=a.bf16 and ops == "course")
        opt = gpt.optimizer(model)
        x, y = T._batch(cfg, data, batch=batch)
        run = torch.compile(model, fullgraph=True) if how == "compile" else model
        steps[name] = (lambda run=run, opt=opt, x=x, y=y: gpt.train_step(run, opt, x, y))
        for _ in range(3):
            steps[name]()
        torch.cuda.synchronize()
        print(f"[{time.perf_counter() - t0:6.1f} s] built {name}", flush=True)
    times = bench.time_rounds(steps, rounds=3, warmup=2, rep=10, flush_l2=False)
    rows, cats = [], []
    for name, fn in steps.items():
        k = profile.step_kernels(fn, steps=2)
        rows.append({"impl": name, "ms": times[name].median, "host_ms": T.host_ms(fn),
                     "gpu_busy_ms": k["us"].sum() / 2e3, "launches": len(k) / 2})
        cats.append(profile.by_category(k, 2).set_index("category")["gpu_ms"].rename(name))
    split = profile.host_split(steps["course"])
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    steps["course"]()
    prof.disable()
    torch.cuda.synchronize()
    print("\ncourse step, top functions by own time (cProfile):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    gc.collect()
    from course_utils import ops
    over = ops.host_overhead_table()
    pd.set_option("display.width", 200)
    print("\ncourse step's host time by who spends it (ms, cProfile):")
    print(pd.Series(split).round(2).to_string())
    print("\nhost us per call, course vs aten:")
    print(over.round(1).to_string())
    print("\nGPU ms per step by category:")
    print(pd.concat(cats, axis=1).round(3).to_string())
    print(f"\n{a.config} ({T.config_name(cfg, batch)}), bf16 weights: {a.bf16}, {torch.cuda.get_device_name()}")
    print(pd.DataFrame(rows).round(2).to_string(index=False))


if __name__ == "__main__":
    main()
