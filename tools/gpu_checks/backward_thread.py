"""Where the course's layer_norm backward spends its host time inside autograd (issue 27, the lean host path).

``host_floor.py --one-core`` found the course's LayerNorm forward + backward through autograd far dearer than
its forward and backward functions called directly plus an empty Python node. This splits the difference,
host microseconds per call at a tiny shape (launch-bound), every thread on one core (``--unpinned``: not):

- the backward function called directly on the main thread, and on another Python thread;
- nodes whose backward does one piece of the real one (nothing; one allocation; one Triton launch; the
  course's backward function), each timed whole (forward + backward through autograd) and, inside the
  node, the backward body alone (perf_counter around it, on the engine's thread);
- the course's LayerNorm through autograd as the ops call it.

    python tools/gpu_checks/backward_thread.py [--calls 300] [--unpinned]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from course_utils import affinity, ops
from course_utils.ops import norms
from course_utils.ops import overhead as O

BODY: list[float] = []   # seconds spent inside each timed backward body


def node(fwd, bwd):
    """An autograd.Function whose forward is ``fwd(x)`` and whose backward runs ``bwd(g)`` (timed) and passes g."""
    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return fwd(x)

        @staticmethod
        def backward(ctx, g):
            t = time.perf_counter()
            bwd(g)
            BODY.append(time.perf_counter() - t)
            return g
    return Node


def per_call(fn, calls):
    return O._per_call_us(fn, calls, torch.cuda.synchronize)


def on_thread(fn, calls):
    out = []
    th = threading.Thread(target=lambda: out.append(per_call(fn, calls)))
    th.start()
    th.join()
    return out[0]


def table(calls):
    dt = torch.bfloat16
    x = torch.randn(1, 16, 64, device="cuda", dtype=dt, requires_grad=True)
    w = torch.randn(64, device="cuda", dtype=dt, requires_grad=True)
    b = torch.randn_like(w, requires_grad=True)
    with torch.no_grad():
        y, mean, rstd = norms.layer_norm_fwd(x, w, b, 1e-5)
    dy = torch.randn_like(y)
    one = torch.zeros(1, device="cuda")
    bwd = lambda: norms.layer_norm_bwd(dy, x.detach(), w.detach(), mean, rstd)   # noqa: E731
    pieces = {
        "nothing": lambda g: None,
        "one new_empty": lambda g: g.new_empty(g.shape),
        "one Triton launch": lambda g: O.touch_kernel[(1,)](one),
        "the course's layer_norm backward": lambda g: bwd(),
    }
    rows = [("layer_norm_bwd direct, main thread", per_call(bwd, calls), float("nan")),
            ("layer_norm_bwd direct, another Python thread", on_thread(bwd, calls), float("nan"))]
    for name, piece in pieces.items():
        fn = node(lambda t: t.new_empty(t.shape), piece)
        piece(dy)
        BODY.clear()
        us = per_call(O._with_backward(lambda fn=fn: fn.apply(x)), calls)
        body = sum(BODY) / max(len(BODY), 1) * 1e6
        rows.append((f"node: backward does {name}", us, body))
    rows.append(("course layer_norm through autograd (ops)", per_call(O._with_backward(
        lambda: ops.layer_norm(x, w, b, 1e-5)), calls), float("nan")))
    rows.append(("aten layer_norm through autograd", per_call(O._with_backward(
        lambda: torch.nn.functional.layer_norm(x, (64,), w, b, 1e-5)), calls), float("nan")))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--unpinned", action="store_true")
    a = ap.parse_args()
    ops.warmup(1, 16, 64, 2, 64)
    table(20)
    if a.unpinned:
        rows = table(a.calls)
    else:
        with affinity.one_core():
            rows = table(a.calls)
    print(f"{'host us per call (' + ('unpinned' if a.unpinned else 'one core') + ')':58s} {'whole':>8s} {'body':>8s}")
    for what, us, body in rows:
        print(f"{what:58s} {us:8.1f} {body:8.1f}")


if __name__ == "__main__":
    main()
