"""The step by hand on a GPU: its gradients against the autograd step's on GPT-2 small (bf16 weights), per
parameter, then three training steps of each from the same weights (losses side by side). ``--compiled``
takes the steps with the compiled step by hand (one torch.compile graph of the registered ops);
``--layers`` keeps the first few blocks (a smaller graph to look into).

    python tools/gpu_checks/hand_step.py [--config gpt2-b8] [--compiled] [--layers 2]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

from benchmarks import training as T
from course_utils import gpt, step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gpt2-b8", choices=list(T.CONFIGS))
    ap.add_argument("--compiled", action="store_true", help="the steps by hand run compiled")
    ap.add_argument("--layers", type=int, default=None, help="keep this many blocks")
    a = ap.parse_args()
    cfg, batch, _ = T.CONFIGS[a.config]
    if a.layers:
        cfg = dataclasses.replace(cfg, n_layer=a.layers)
    model = T._model(cfg, "course")
    x, y = T._batch(cfg, gpt.tokens(), batch=batch)
    diffs = step.grads_match(model, x, y)
    worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:6]
    print("largest relative gradient differences, hand vs autograd (bf16):")
    for name, d in worst:
        print(f"  {name:32s} {d:.3e}")
    other = copy.deepcopy(model)
    opt_a, opt_b = gpt.optimizer(model), gpt.optimizer(other)
    hand = step.HandStep(other, opt_b, compiled=a.compiled)
    for i in range(3):
        la, lb = gpt.train_step(model, opt_a, x, y), hand(x, y)
        print(f"step {i}: autograd {la.item():.6f}  hand {lb.item():.6f}")


if __name__ == "__main__":
    main()
