"""Where the host's time goes, op by op and in chapter 12's step (cProfile, own time): the evidence behind
the lean host path of issue 27. Prints, for each course op at a tiny shape (launch-bound), the functions
that spend the most own time over ``--calls`` forward + backward calls, then the same for one GPT-2 small
step of the course (bf16 weights, MasterAdamW), and the per-call host table against aten.

    python tools/gpu_checks/host_profile.py [--calls 200] [--top 14] [--config gpt2-b8]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from benchmarks import training as T
from course_utils import gpt, ops
from course_utils.ops import overhead as O


def _top(prof: cProfile.Profile, n: int, per: int, sort: str = "tottime") -> str:
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats(sort)
    rows = []
    for func, (_cc, nc, tt, ct, _) in st.stats.items():
        rows.append((tt if sort == "tottime" else ct, tt, ct, nc, func))
    rows.sort(reverse=True)
    lines = [f"{'own us':>8} {'cum us':>8} {'calls':>7}  function"]
    for _, tt, ct, nc, (path, line, name) in rows[:n]:
        short = "/".join(path.split("/")[-2:])
        lines.append(f"{tt / per * 1e6:8.1f} {ct / per * 1e6:8.1f} {nc / per:7.2f}  {short}:{line}({name})")
    return "\n".join(lines)


def per_op(calls: int, top: int):
    dtype = torch.bfloat16
    for grad in (False, True):
        t = O._block_inputs(1, 16, 64, 2, 64, dtype, dtype, torch.device("cuda"), requires_grad=grad)
        seed = torch.zeros(1, dtype=torch.int64, device="cuda")
        for name, fn in O._block_calls(t, ops, seed):
            call = O._with_backward(fn) if grad else fn
            with torch.set_grad_enabled(grad):
                for _ in range(5):
                    call()
                torch.cuda.synchronize()
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(calls):
                    call()
                prof.disable()
            torch.cuda.synchronize()
            what = "forward + backward" if grad else "forward alone (no grad)"
            print(f"\n=== {name}: {what}, per call (cProfile)\n{_top(prof, top, calls)}", flush=True)


def step(config: str, top: int, hand: bool = False, ops_name: str = "course"):
    from course_utils.step import HandStep
    cfg, batch, _ = T.CONFIGS[config]
    model = T._model(cfg, ops_name)
    opt = gpt.optimizer(model)
    x, y = T._batch(cfg, gpt.tokens(), batch=batch)
    run = HandStep(model, opt) if hand else (lambda a, b: gpt.train_step(model, opt, a, b))
    name = "step by hand" if hand else f"autograd step ({ops_name})"
    for _ in range(3):
        run(x, y)
    torch.cuda.synchronize()
    n = 5
    t0 = time.perf_counter()
    for _ in range(n):
        run(x, y)
    host = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    print(f"\n=== course {name} {config}: host {host:.2f} ms per step without cProfile", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        run(x, y)
    prof.disable()
    torch.cuda.synchronize()
    print(f"\n=== course {name} {config}, per step, by own time\n{_top(prof, top, n)}")
    print(f"\n=== course {name} {config}, per step, by cumulative time\n{_top(prof, top, n, 'cumtime')}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--config", default="gpt2-b8")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--blocks-only", action="store_true", help="profile only the step of one autograd node a block")
    a = ap.parse_args()
    if not a.skip_ops:
        per_op(a.calls, a.top)
    if a.blocks_only:
        step(a.config, 3 * a.top, ops_name="course-blocks")
        return
    if not a.skip_step:
        step(a.config, 3 * a.top)
        step(a.config, 3 * a.top, hand=True)
    import pandas as pd
    pd.set_option("display.width", 200)
    print(ops.host_overhead_table().round(1).to_string())


if __name__ == "__main__":
    main()
