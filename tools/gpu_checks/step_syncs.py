"""Which calls in chapter 12's training step make the host wait for the GPU (torch's sync debug mode).

A step whose host waits for the GPU cannot issue the next kernels while the GPU runs: on a host-bound step
that costs the whole of the host's time again. Prints, per version, each synchronizing call's place.

    python tools/gpu_checks/step_syncs.py [--config gpt2-b8]
"""

from __future__ import annotations

import argparse
import traceback
import warnings

import torch

from benchmarks import training as T
from course_utils import gpt


def syncs_of(step) -> list[str]:
    step()
    torch.cuda.synchronize()
    places = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        for w in caught:
            if "synchroniz" in str(w.message):
                places.append(f"{w.filename}:{w.lineno}: {str(w.message)[:90]}")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return places


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gpt2-b8")
    a = ap.parse_args()
    cfg, batch, _ = T.CONFIGS[a.config]
    data = gpt.tokens()
    one = torch.ones(1, device="cuda")
    control = syncs_of(lambda: one.sum().item())   # a step that reads a GPU value on the host must be caught
    print(f"=== control (one .item()): {len(control)} synchronizing call(s) caught")
    if not control:
        raise SystemExit("the sync debug mode caught nothing in the control: the counts below would mean nothing")
    for name in ("eager", "course", "course, one autograd node an op", "course, step by hand"):
        try:
            step = T.build(name, cfg, data, batch=batch)
            places = syncs_of(step)
        except Exception:
            places = ["failed: " + traceback.format_exc(limit=3)]
        print(f"\n=== {name}: {len(places)} synchronizing calls in one step")
        for p in places[:12]:
            print("  " + p)


if __name__ == "__main__":
    main()
