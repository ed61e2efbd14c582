"""Does the course's GPT step build under torch.compile, and how fast does it run? Builds the named versions
of ``benchmarks.training.IMPLS`` for one configuration, prints each one's build time, then ms per step
(interleaved rounds) and host ms to issue a step.

    python tools/gpu_checks/compile_course.py [--config gpt2-b8] [--impls "course;course + torch.compile"]
        [--csv results/<gpu>/training_visible_ops.csv]

``--csv`` writes the rows with their provenance (GPU, torch, Triton, date, the commit checked out) and how
torch.compile saw the course's ops in each compiled course version.
"""

from __future__ import annotations

import argparse
import subprocess
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

from benchmarks import training as T
from course_utils import bench, gpt, results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gpt2-b8", choices=list(T.CONFIGS))
    ap.add_argument("--impls", default="torch.compile;course;course + torch.compile", help="names separated by ;")
    ap.add_argument("--csv", default=None, help="write the rows here, with their provenance")
    a = ap.parse_args()
    cfg, batch, _ = T.CONFIGS[a.config]
    data = gpt.tokens()
    steps, build_s = {}, {}
    for name in a.impls.split(";"):
        t = time.perf_counter()
        try:
            steps[name] = T.build(name, cfg, data, batch=batch)
            torch.cuda.synchronize()
            build_s[name] = time.perf_counter() - t
            print(f"built {name} in {build_s[name]:.1f} s", flush=True)
        except Exception as e:   # report and go on: the point is which versions build
            frames = [f for x in (e, e.__cause__, e.__context__) if x is not None
                      for f in traceback.extract_tb(x.__traceback__) if "course_utils" in f.filename]
            where = "".join(traceback.format_list(frames[-8:]))
            print(f"FAILED {name} after {time.perf_counter() - t:.1f} s: {type(e).__name__}: {str(e)[:400]}\n{where}",
                  flush=True)
    times = bench.time_rounds(steps, rounds=3, warmup=2, rep=10, flush_l2=False)
    print(f"\n{a.config} on {torch.cuda.get_device_name()}")
    rows = []
    for name, fn in steps.items():
        rows.append({"impl": name, "ms": times[name].median, "host_ms": T.host_ms(fn), "build_s": build_s[name],
                     "config_key": a.config, "course_kernel_ops": T._registration(name)})
        print(f"{name:40s} {rows[-1]['ms']:8.2f} ms/step   host {rows[-1]['host_ms']:7.2f} ms")
    if a.csv:
        _write(rows, Path(a.csv), " ".join(["tools/gpu_checks/compile_course.py", "--config", a.config, "--impls",
                                            repr(a.impls)]))


def _write(rows: list, path: Path, source: str) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    df = pd.DataFrame(rows).assign(**results.provenance(), commit=commit or "unknown", source=source)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
