"""Chapter 12's B=8 step with the add_layer_norm backward pipelined (3 stages, 4 warps) against the same step with
the loop as written before (no stages, 8 warps), on one machine, in interleaved rounds, every thread on one core.

Why: the training benchmark's B=8 rows from Python moved from run to run after the change (the course under
``torch.compile`` 17.19 ms a step at 4572154, then 22.10 and 28.49 ms at 5cca9aa on two other machines, while its
GPU-busy time fell from 16.35 to 15.36 and 15.44 ms). Runs on different machines cannot tell the change from the
host; this check builds both variants in one process and times them side by side. Run from the repository
root on a GPU (about two minutes):

    python tools/gpu_checks/norm_stages_ab.py
"""

from __future__ import annotations

import contextlib
import sys

import torch

import course_utils as cu
from benchmarks import training as B
from course_utils import affinity, gpt, timing
from course_utils.ops import norms
from course_utils.tuned import layernorm as T

STEPS = ("torch.compile", "course + torch.compile", "course, one autograd node the model", "course + CUDA graph")


@contextlib.contextmanager
def loop_as_before(on: bool):
    """Inside the block (when ``on``), the op plans the backward without stages, so with 8 warps at 768 columns."""
    real = T.loop_stages
    if on:
        T.loop_stages = lambda *a, **k: 0
    norms.PLANS.clear()
    try:
        yield
    finally:
        T.loop_stages = real


def main() -> int:
    if not cu.on_gpu():
        print("norm_stages_ab.py needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg, batch, _ = B.CONFIGS["gpt2-b8"]
    data, steps = gpt.tokens(), {}
    for variant in ("pipelined", "as before"):
        with loop_as_before(variant == "as before"):
            torch.compiler.reset()
            for name in STEPS[variant == "as before":]:   # torch's own step once
                steps[(variant, name)] = B.build(name, cfg, data, batch=batch)
                steps[(variant, name)]()
            plan = {k[0]: (v["stages"], v["num_warps"]) for k, v in norms.PLANS.items() if k[0] == "aln_bwd"}
            print(f"{variant}: add_layer_norm backward (stages, warps) = {plan}")
    torch.cuda.synchronize()
    with affinity.one_core():
        got = timing.time_rounds(steps, rounds=3, warmup=2, rep=10, flush_l2=False)
        host = {k: B.host_ms(s) for k, s in steps.items()}
    print(f"{torch.cuda.get_device_name()}, GPT-2 small B={batch}, ms a step (median of 3 interleaved rounds)")
    for (variant, name), t in got.items():
        h = host[(variant, name)]
        print(f"{variant:10} {name:40} {t.median:7.2f} ms (p20 {t.p20:6.2f} p80 {t.p80:6.2f}) host {h:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
