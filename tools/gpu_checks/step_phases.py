"""Host time of chapter 12's step, phase by phase (issue 27: why the autograd step trails the step by hand).

For eager, torch.compile, the course's step op by op, one autograd node a block, and by hand, prints
per step: the wall time of steps back to back, and the host time to issue the forward, the backward and
the optimizer from an idle GPU (synchronized before each step, not inside it, so each phase's time is the host's). Each
autograd version runs twice: with the autograd engine's device thread (PyTorch's default on a GPU) and
with ``torch.autograd.set_multithreading_enabled(False)`` (the backward runs on the calling thread).

    python tools/gpu_checks/step_phases.py [--config gpt2-b8,gpt2-b16] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import training as T
from course_utils import gpt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_process import _wall  # noqa: E402

#: (label, ops, under torch.compile)
VERSIONS = [("eager", "torch", False), ("torch.compile", "torch", True), ("course, a node an op", "course", False),
            ("course, a node a block", "course-blocks", False)]


def _phases(model, opt, x, y):
    """(forward, backward, optimizer) host ms of one step, issued from an idle GPU."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with gpt._precision(model, x.device):
        _, loss = model(x, y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3


def run(config: str, steps: int):
    from course_utils.step import HandStep
    cfg, batch, _ = T.CONFIGS[config]
    data = gpt.tokens()
    x, y = T._batch(cfg, data, batch=batch)
    rows = []
    for label, ops, compiled in VERSIONS:
        for threads in (True, False):
            model = T._model(cfg, ops)
            opt = gpt.optimizer(model)
            net = torch.compile(model, fullgraph=True) if compiled else model
            with torch.autograd.set_multithreading_enabled(threads):
                for _ in range(3):
                    gpt.train_step(net, opt, x, y)
                wall = _wall(lambda net=net, opt=opt: gpt.train_step(net, opt, x, y), steps)
                ph = [_phases(net, opt, x, y) for _ in range(steps)]
            med = [statistics.median(p[i] for p in ph) for i in range(3)]
            rows.append((f"{label}, engine thread {'on' if threads else 'off'}", wall, *med))
            del model, opt, net
    model = T._model(cfg, "course")
    opt = gpt.optimizer(model)
    hand = HandStep(model, opt)
    for _ in range(3):
        hand(x, y)
    wall = _wall(lambda: hand(x, y), steps)
    issue = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hand(x, y)
        issue.append((time.perf_counter() - t) * 1e3)
    rows.append(("course, step by hand", wall, statistics.median(issue), float("nan"), float("nan")))
    print(f"\n=== {config}: ms per step (wall, back to back) and host ms to issue each phase from an idle GPU")
    print(f"{'version':40s} {'wall':>8} {'fwd':>8} {'bwd':>8} {'opt':>8}")
    for name, *v in rows:
        print(f"{name:40s} " + " ".join(f"{a:8.2f}" for a in v))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gpt2-b8")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    for config in a.config.split(","):
        torch.compiler.reset()
        run(config, a.steps)


if __name__ == "__main__":
    main()
