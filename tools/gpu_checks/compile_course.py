"""Does the course's GPT step build under torch.compile, and how fast does it run? Builds the named versions
of ``benchmarks.training.IMPLS`` for one configuration, prints each one's build time, then ms per step
(interleaved rounds) and host ms to issue a step.

    python tools/gpu_checks/compile_course.py [--config gpt2-b8] [--impls "course;course + torch.compile"]
"""

from __future__ import annotations

import argparse
import time
import traceback

import torch

from benchmarks import training as T
from course_utils import bench, gpt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gpt2-b8", choices=list(T.CONFIGS))
    ap.add_argument("--impls", default="torch.compile;course;course + torch.compile", help="names separated by ;")
    a = ap.parse_args()
    cfg, batch, _ = T.CONFIGS[a.config]
    data = gpt.tokens()
    steps = {}
    for name in a.impls.split(";"):
        t = time.perf_counter()
        try:
            steps[name] = T.build(name, cfg, data, batch=batch)
            torch.cuda.synchronize()
            print(f"built {name} in {time.perf_counter() - t:.1f} s", flush=True)
        except Exception as e:   # report and go on: the point is which versions build
            frames = [f for x in (e, e.__cause__, e.__context__) if x is not None
                      for f in traceback.extract_tb(x.__traceback__) if "course_utils" in f.filename]
            where = "".join(traceback.format_list(frames[-8:]))
            print(f"FAILED {name} after {time.perf_counter() - t:.1f} s: {type(e).__name__}: {str(e)[:400]}\n{where}",
                  flush=True)
    times = bench.time_rounds(steps, rounds=3, warmup=2, rep=10, flush_l2=False)
    print(f"\n{a.config} on {torch.cuda.get_device_name()}")
    for name, fn in steps.items():
        print(f"{name:40s} {times[name].median:8.2f} ms/step   host {T.host_ms(fn):7.2f} ms")


if __name__ == "__main__":
    main()
