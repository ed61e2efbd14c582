"""The host's cost of chapter 12's step with every Triton launch stubbed out, on the CPU (issue 27).

A GPT of GPT-2 small's depth (12 blocks) at a tiny width, on CPU tensors: the course's kernels run once
under Triton's interpreter (so every launch plan is chosen), then ``plain_launch`` is replaced by a no-op,
and what a step costs is the Python of the ops, autograd's bookkeeping and aten's CPU work on tiny
tensors. It compares the autograd step with one node an op, with one node a block, and the step by hand,
where no GPU can say whether an autograd path costs the host more than the same kernels called by hand.

    TRITON_INTERPRET=1 COURSE_MODE=interpreter python tools/step_host_cpu.py [--profile course-blocks]
"""

from __future__ import annotations

import argparse
import time

import torch

from course_utils import gpt, profile
from course_utils.step import HandStep


def _ms(step, calls: int = 30) -> float:
    for _ in range(3):
        step()
    t = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - t) / calls * 1e3


def steps(cfg: gpt.GPTConfig, batch: int) -> dict:
    """name -> a zero-argument training step, each run once with its kernels (plans chosen)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=g)
    out = {}
    for ops in ("course", "course-blocks"):
        model = gpt.GPT(cfg).use(ops)
        opt = gpt.optimizer(model)
        out[ops] = lambda model=model, opt=opt: gpt.train_step(model, opt, x, y)
    model = gpt.GPT(cfg).use("course")
    hand = HandStep(model, gpt.optimizer(model))
    out["step by hand"] = lambda: hand(x, y)
    for step in out.values():
        step()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None, help="cProfile one version: course, course-blocks or 'step by hand'")
    a = ap.parse_args()
    cfg = gpt.GPTConfig(n_layer=12, n_head=2, d_model=32, seq_len=16)
    runs = steps(cfg, batch=2)
    with profile.launches_stubbed():   # from here on no kernel runs
        for name, step in runs.items():
            print(f"{name:15s} {_ms(step):7.2f} ms a step (launches stubbed)")
        if a.profile:
            profile.print_cprofile(runs[a.profile], 20, 25)

if __name__ == "__main__":
    main()
