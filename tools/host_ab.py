"""Host microseconds per call of one or more course ops, on the CPU with every Triton launch stubbed out.

Chapter 12's host table (``course_utils.ops.overhead.host_overhead_table``) needs a GPU; this times the same
calls (the table's tiny GPT-block shapes and its ``_with_backward``) on CPU tensors: each op runs once with
its kernels under Triton's interpreter (so every launch plan is chosen), then ``plain_launch`` (where
``launch`` goes off a GPU) is a no-op, and what is left is the ops' Python, autograd's bookkeeping and aten's
CPU work on tiny tensors (torch.mm included). The min over repeats, for A/B runs across commits:

    TRITON_INTERPRET=1 COURSE_MODE=interpreter python tools/host_ab.py [--ops linear_gelu,cross_entropy]
        [--dtype float32] [--repeats 25] [--calls 4000] [--profile linear_gelu]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout's course_utils

import torch  # noqa: E402

import course_utils.ops as ops  # noqa: E402
from course_utils import profile  # noqa: E402
from course_utils.ops import overhead as O  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def calls(grad: bool, dtype: torch.dtype, aten: bool = False) -> dict:
    """op name -> the table's call of the course's wrapper, or of aten's counterpart (forward alone, or
    forward + backward)."""
    t = O._block_inputs(1, 16, 64, 2, 64, dtype, dtype, torch.device("cpu"), requires_grad=grad)
    seed = torch.zeros(1, dtype=torch.int64)
    fns = O._aten_calls(t) if aten else dict(O._block_calls(t, ops, seed))
    return {name: O._with_backward(fn) if grad else fn for name, fn in fns.items()}


def best_us(fn, repeats: int, n: int) -> float:
    """The min over ``repeats`` of the mean us per call over ``n`` calls."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="linear_gelu,cross_entropy")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--calls", type=int, default=4000)
    # float32 by default: the CPU's float16 matmul computes for ~45 us a call on these shapes, hiding the host's
    # work that a GPU's asynchronous matmul does not; float32's is a few us
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--aten", action="store_true", help="also time aten's counterparts (the table's)")
    ap.add_argument("--profile", default=None, help="cProfile the forward + backward of this op")
    a = ap.parse_args()
    torch.set_num_threads(1)   # the table's host: all threads on one core
    # stubbed launches leave outputs unwritten: the matmuls then read whatever memory held, and a denormal there
    # makes a CPU matmul 10-100x slower (seen: 780 us for linear_gelu's backward instead of 50)
    torch.set_flush_denormal(True)
    names = a.ops.split(",")
    dtype = DTYPES[a.dtype]
    fwd, both = calls(False, dtype), calls(True, dtype)
    aten = (calls(False, dtype, True), calls(True, dtype, True)) if a.aten else None
    for name in names:   # the kernels once, under the interpreter: plans chosen
        with torch.no_grad():
            fwd[name]()
        both[name]()
    with profile.launches_stubbed():   # from here on no kernel runs
        for name in names:
            with torch.no_grad():
                f = best_us(fwd[name], a.repeats, a.calls)
            fb = best_us(both[name], a.repeats, a.calls)
            print(f"{name:15s} fwd {f:7.2f} us   fwd+bwd {fb:7.2f} us   (launches stubbed, min of {a.repeats})")
            if aten:
                with torch.no_grad():
                    f = best_us(aten[0][name], a.repeats, a.calls)
                fb = best_us(aten[1][name], a.repeats, a.calls)
                print(f"{'  aten':15s} fwd {f:7.2f} us   fwd+bwd {fb:7.2f} us")
        if a.profile:
            profile.print_cprofile(both[a.profile], 2000, 30)

if __name__ == "__main__":
    main()
