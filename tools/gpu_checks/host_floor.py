"""Where an op's host time goes between Python and the autograd engine (issue 27, the lean host path).

For each course op at a tiny shape (launch-bound), prints host microseconds per call of:
- its forward and backward functions called directly (no autograd: the course's own Python and launches),
- the forward + backward through autograd (what ``host_overhead_table`` times),
- how many launches per forward + backward missed the compiled-launch cache (``plain_launch``);
and, as floors, a Python ``autograd.Function`` that launches nothing against aten's ``neg`` (a C++ node).

    python tools/gpu_checks/host_floor.py [--calls 300] [--one-core]

``--one-core``: every thread of the process on one core while timing (:mod:`course_utils.affinity`), as the
training benchmark times; the direct rows then include aten's own forward and backward functions called
directly, so that course and aten are compared without autograd on both sides.
"""

from __future__ import annotations

import argparse

import torch

from course_utils import affinity, ops
from course_utils.ops import norms
from course_utils.ops import overhead as O
from course_utils.tuned import launch as TL


class _Nothing(torch.autograd.Function):
    """The cheapest Python node: one allocation forward, the gradient passed through backward."""

    @staticmethod
    def forward(ctx, x):
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx, g):
        return g


def _us(fn, calls):
    return O._per_call_us(fn, calls, torch.cuda.synchronize)


def floors(calls):
    x = torch.randn(16, 64, device="cuda", requires_grad=True)
    rows = [("python Function, no launch: forward", _us(lambda: _Nothing.apply(x), calls)),
            ("python Function, no launch: fwd+bwd", _us(O._with_backward(lambda: _Nothing.apply(x)), calls)),
            ("aten neg: forward", _us(lambda: x.neg(), calls)),
            ("aten neg: fwd+bwd", _us(O._with_backward(lambda: x.neg()), calls))]
    return rows


def direct_norms(calls):
    """layer_norm and add_layer_norm's forward and backward functions called directly."""
    dt = torch.bfloat16
    x = torch.randn(1, 16, 64, device="cuda", dtype=dt)
    r = torch.randn_like(x)
    w = torch.randn(64, device="cuda", dtype=dt)
    b = torch.randn_like(w)
    y, mean, rstd = norms.layer_norm_fwd(x, w, b, 1e-5)
    dy = torch.randn_like(y)
    _, s, m2, r2 = norms.add_layer_norm_fwd(x, r, w, b, 1e-5)
    _, am, ar = torch.ops.aten.native_layer_norm(x, (64,), w, b, 1e-5)
    mask = [True, True, True]
    return [("layer_norm_fwd direct", _us(lambda: norms.layer_norm_fwd(x, w, b, 1e-5), calls)),
            ("aten native_layer_norm direct", _us(lambda: torch.ops.aten.native_layer_norm(x, (64,), w, b, 1e-5),
                                                  calls)),
            ("three new_empty (the forward's outputs)", _us(lambda: (x.new_empty(x.shape),
                                                                     x.new_empty(16, dtype=torch.float32),
                                                                     x.new_empty(16, dtype=torch.float32)), calls)),
            ("layer_norm_bwd direct", _us(lambda: norms.layer_norm_bwd(dy, x, w, mean, rstd), calls)),
            ("aten native_layer_norm_backward direct", _us(
                lambda: torch.ops.aten.native_layer_norm_backward(dy, x, (64,), am, ar, w, b, mask), calls)),
            ("add_layer_norm_fwd direct", _us(lambda: norms.add_layer_norm_fwd(x, r, w, b, 1e-5), calls)),
            ("add_layer_norm_bwd direct", _us(lambda: norms.add_layer_norm_bwd(dy, None, s, w, m2, r2), calls))]


def misses(calls):
    """Launches per forward + backward that went through ``plain_launch`` (no cached compiled launch)."""
    t = O._block_inputs(1, 16, 64, 2, 64, torch.bfloat16, torch.bfloat16, torch.device("cuda"))
    seed = torch.zeros(1, dtype=torch.int64, device="cuda")
    seen = []
    orig = TL.plain_launch

    def counting(kernel, grid, args, meta):
        seen.append(getattr(kernel, "__name__", type(kernel).__name__))
        return orig(kernel, grid, args, meta)

    rows = []
    for name, fn in O._block_calls(t, ops, seed):
        call = O._with_backward(fn)
        for _ in range(5):
            call()
        seen.clear()
        TL.plain_launch = counting
        try:
            for _ in range(calls):
                call()
        finally:
            TL.plain_launch = orig
        torch.cuda.synchronize()
        kinds = sorted(set(seen))
        rows.append((f"{name}: plain launches per fwd+bwd", len(seen) / calls, ",".join(kinds)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--one-core", action="store_true", help="every thread on one core while timing")
    a = ap.parse_args()
    ops.warmup(1, 16, 64, 2, 64)
    if a.one_core:
        with affinity.one_core():
            print("every thread of the process on one core while timing")
            report(a.calls)
    else:
        report(a.calls)


def report(calls):
    table = O.host_overhead_table(calls)
    print(table.to_string(), flush=True)
    print("\n=== floors and direct calls, host us per call")
    for what, us in floors(calls) + direct_norms(calls):
        print(f"{what:45s} {us:8.1f}")
    print("\n=== compiled-launch cache misses")
    for what, n, kinds in misses(50):
        print(f"{what:45s} {n:6.2f}  {kinds}")


if __name__ == "__main__":
    main()
