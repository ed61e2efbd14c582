"""Is the autograd engine's worker thread part of the course ops' host cost per call (issue 27)? The per-op
host table (``course_utils.ops.overhead.host_overhead_table``) three times in one process: as recorded (the
backward of a CUDA tensor runs on the engine's GPU worker thread while the caller waits), with the backward on
the calling thread (``torch.autograd.set_multithreading_enabled(False)``), and both again with every thread on
the fastest core (``affinity.one_core``). Prints the forward + backward columns and the ratio against aten's.

    python tools/gpu_checks/host_engine_thread.py [--calls 500]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from course_utils import affinity
from course_utils.ops import overhead as O

COLS = ["op", "course_us", "aten_us", "course_fwd_bwd_us", "torch_ops_fwd_bwd_us", "aten_fwd_bwd_us",
        "course_over_aten"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=500)
    a = ap.parse_args()
    O.warmup(1, 16, 64, 2, 64)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call, medians of "
          f"{O.ROUNDS} interleaved rounds of {a.calls // O.ROUNDS} calls")
    for pinned in (False, True):
        for threads in (True, False):
            pin = affinity.one_core() if pinned else contextlib.nullcontext()
            with pin, torch.autograd.set_multithreading_enabled(threads):
                table = O.host_overhead_table(a.calls)
            print(f"\n== backward on the {'engine worker' if threads else 'calling'} thread, "
                  f"{'every thread on one core' if pinned else 'threads unpinned'}")
            print(table[COLS].round(1).to_string(index=False))


if __name__ == "__main__":
    main()
