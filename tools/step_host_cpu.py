"""The host's cost of chapter 12's step with every Triton launch stubbed out, on the CPU (issue 27).

A GPT of GPT-2 small's depth (12 blocks) at a tiny width, on CPU tensors: the course's kernels run once
under Triton's interpreter (so every launch plan is chosen), then ``plain_launch`` is replaced by a no-op,
and what a step costs is the Python of the ops, autograd's bookkeeping and aten's CPU work on tiny
tensors. It compares the autograd step with one node an op, with one node a block, with one node the model
(:class:`course_utils.step.OneNode`) and the step by hand, where no GPU can say whether an autograd path costs
the host more than the same kernels called by hand. (float16 weights with MasterAdamW, the H200's setup, were
tried: its kernel does not go through ``plain_launch``, so it ran under the interpreter, 1.3 s a step.) Set
PYTHONPATH to the checkout: from tools/ Python imports the installed course_utils (/work/main's editable one).

    PYTHONPATH=. TRITON_INTERPRET=1 COURSE_MODE=interpreter python tools/step_host_cpu.py --rounds 5 [--profile X]
"""

from __future__ import annotations

import argparse
import time

import torch

from course_utils import gpt, profile
from course_utils.step import HandStep, OneNode


def _ms(step, calls: int = 30) -> float:
    for _ in range(3):
        step()
    t = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - t) / calls * 1e3


def steps(cfg: gpt.GPTConfig, batch: int) -> dict:
    """name -> a zero-argument training step, each run once with its kernels (plans chosen)."""
    def model_of(ops):
        return gpt.GPT(cfg).use(ops)

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=g)
    out = {}
    for ops in ("course", "course-blocks"):
        model = model_of(ops)
        opt = gpt.optimizer(model)
        out[ops] = lambda model=model, opt=opt: gpt.train_step(model, opt, x, y)
    model = model_of("course")
    one, opt = OneNode(model), gpt.optimizer(model)
    out["one-node"] = lambda: gpt.train_step(one, opt, x, y)
    model = model_of("course")
    hand = HandStep(model, gpt.optimizer(model))
    out["step by hand"] = lambda: hand(x, y)
    for step in out.values():
        step()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None,
                    help="cProfile one version: course, course-blocks, one-node or 'step by hand'")
    ap.add_argument("--rounds", type=int, default=1, help="time the versions interleaved, the min of this many")
    a = ap.parse_args()
    cfg = gpt.GPTConfig(n_layer=12, n_head=2, d_model=32, seq_len=16)
    runs = steps(cfg, batch=2)
    with profile.launches_stubbed():   # from here on no kernel runs
        best = {name: _ms(step) for name, step in runs.items()}
        for _ in range(a.rounds - 1):   # interleaved: a noisy shared host slows all versions alike
            for name, step in runs.items():
                best[name] = min(best[name], _ms(step))
        for name, ms in best.items():
            print(f"{name:15s} {ms:7.2f} ms a step (launches stubbed)")
        if a.profile:
            profile.print_cprofile(runs[a.profile], 20, 25)

if __name__ == "__main__":
    main()
