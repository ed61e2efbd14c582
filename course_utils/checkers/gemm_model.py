"""Checks for chapter 9's modelling exercises: a fused epilogue's saving predicted with the traffic model
(:func:`check_residual_prediction`) and GROUP_M chosen from the operand bytes the kernel's waves read
(:func:`check_group_m`).

Each check compares the student's function with the course's own computation on several shapes, and
when they disagree it recomputes the usual mistakes (the wrong baseline, the datasheet's ceilings, the
launch cost counted, the residual left out, one operand forgotten...) and names the one that matches.
The course's computations here are the answer key: a function that calls them is refused, by name in its
code and by behaviour (a call of the function object while the student's function runs:
:mod:`course_utils.checkers.calls`). The residual prediction's epilogue is also read from the op list the
student hands ``traffic.gemm_epilogue``: the residual placed before GELU moves the same bytes and FLOPs, so
only the list shows it.
"""

from __future__ import annotations

import math

from .. import check
from .calls import Calls

MEASURED_GPU = "h100-80gb-hbm3"   # results/<slug>/ceilings.csv: the ceilings the prediction uses
GROUPS = (1, 2, 4, 8, 16, 32, 64)
RESIDUAL_SHAPES = ((4096, 16384, 4096), (8192, 8192, 2048), (16, 16384, 4096), (333, 1000, 777))   # M, N, K
GROUP_SHAPES = ((4096, 16384, 4096, 128, 256, 132), (8192, 8192, 2048, 128, 256, 132),
                (1000, 3000, 512, 64, 128, 108), (200, 50000, 1024, 128, 128, 132), (4096, 4096, 4096, 128, 128, 16),
                (2048, 8192, 1024, 128, 128, 132),   # the first wave alone picks 8, every wave 16
                (4096, 200, 1024, 128, 256, 132),    # one column of tiles: every GROUP_M ties, the answer is 1
                (8192, 8192, 512, 64, 128, 2048))    # small tiles, 2048 programs a wave: the answer is 64
#: GELU's tanh form, counted as the course counts it (traffic.matmul.DEFAULT_EPILOGUE: Op("gelu", (), 9))
GELU_FLOPS = 9


def _epilogue(residual: bool = True, residual_kind: str = "full", gelu_flops: float = GELU_FLOPS):
    from .. import traffic as T
    ops = [T.Op("add bias", ("col",)), T.Op("gelu", (), gelu_flops)]
    return ops + [T.Op("add residual", (residual_kind,))] if residual else ops


def _machine(measured: bool = True, launches: bool = False):
    from .. import bench
    from .. import traffic as T
    launch = None if launches else 0.0
    if not measured:
        return T.machine("h100-sxm", "bfloat16", launch_us=launch)
    ceilings = bench.Ceilings.from_frame(bench.recorded("ceilings", gpu=MEASURED_GPU))
    return T.machine_from_ceilings(ceilings, launch_us=launch)


def residual_prediction(m, n, k, *, trailing="addmm", residual=True, residual_kind="full", measured=True,
                        launches=False, dtype="bfloat16", inverted=False, gelu_flops=GELU_FLOPS):
    """(bytes saved, model speedup) of ``gelu(x @ w + b) + r`` fused against PyTorch's
    ``gelu(addmm(b, x, w)) + r`` on the measured H100 ceilings, device time only; the keywords make the
    usual mistakes."""
    from .. import traffic as T
    comp = T.gemm_epilogue(m, n, k, _epilogue(residual, residual_kind, gelu_flops), dtype, trailing=trailing)
    mach = _machine(measured, launches)
    slow = T.estimate_time(comp.unfused, mach, dtype).us
    fast = T.estimate_time(comp.fused, mach, dtype).us
    speedup = fast / slow if inverted else slow / fast
    return comp.unfused.total_bytes - comp.fused.total_bytes, speedup


RESIDUAL_FAULTS = (
    ("the baseline is PyTorch's addmm (the bias inside cuBLASLt's GEMM: trailing='addmm'), not one kernel per "
     "op", {"trailing": "eager"}),
    ("the baseline runs one kernel per op after the GEMM (trailing='addmm'), not one fused elementwise kernel",
     {"trailing": "fused"}),
    ("the residual is missing from the epilogue: add an op that reads a full M x N operand", {"residual": False}),
    ("the residual is a full M x N tensor (operand kind 'full'), not one value per column",
     {"residual_kind": "col"}),
    ("use the ceilings measured on the H100 (results/h100-80gb-hbm3/ceilings.csv through "
     "traffic.machine_from_ceilings), not the datasheet's", {"measured": False}),
    ("device time only: pass launch_us=0.0 (a CUDA graph replays the kernels without the host's launch cost)",
     {"launches": True}),
    ("the operands are bf16 (2 bytes), not float32", {"dtype": "float32"}),
    ("the speedup is the baseline's time over the fused kernel's (above 1 when fusion wins), not the inverse",
     {"inverted": True}),
    (f"GELU's op counts {GELU_FLOPS} FLOPs per element (the tanh form, as the exercise states and "
     f"traffic.gemm_epilogue's default counts it: traffic.Op(\"gelu\", (), {GELU_FLOPS})); an Op without flops "
     "counts 1", {"gelu_flops": 1}),
)


def _close(a, b, rel=1e-6) -> bool:
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-9)


def _epilogue_fault(post) -> str:
    """What is wrong with the op list handed to traffic.gemm_epilogue for gelu(acc + b) + r ('' if right)."""
    from .. import traffic as T
    ops = [o if isinstance(o, T.Op) else T.Op(o) for o in post]
    unary = [i for i, o in enumerate(ops) if not o.operands]
    full = [i for i, o in enumerate(ops) if o.operands == ("full",)]
    if unary and full and full[0] < unary[0]:
        return ("the residual is placed before GELU in your epilogue list: y = gelu(acc + b) + r adds r to GELU's "
                "output, so the ops run bias, GELU, then the residual. (The bytes and FLOPs come out the same "
                "either way, so the check reads the list you hand traffic.gemm_epilogue.)")
    if len(unary) == 1 and ops[unary[0]].flops != GELU_FLOPS:
        return (f"your GELU op counts {ops[unary[0]].flops:g} FLOP(s) per element; the course counts the tanh "
                f"form's {GELU_FLOPS} (the exercise text, and gemm_epilogue's default: "
                f"traffic.Op(\"gelu\", (), {GELU_FLOPS}))")
    return ""


UNITS = (("megabytes (1e6 bytes)", 1e6), ("MiB (2**20 bytes)", 2**20), ("kilobytes (1e3 bytes)", 1e3),
         ("gigabytes (1e9 bytes)", 1e9))
#: (hint, how the student's number relates to the right one) for the bytes saved and the speedup
BYTES_SLIPS = (
    ("the bytes saved are the baseline's bytes minus the fused kernel's (positive when fusion saves): yours has "
     "the opposite sign", lambda b: -b),
    ("the saving is in bytes, not megabytes (1e6 bytes): return comp.unfused.total_bytes - "
     "comp.fused.total_bytes as it is", lambda b: b / 1e6),
    ("the saving is in bytes, not MiB (2**20 bytes): return comp.unfused.total_bytes - comp.fused.total_bytes as "
     "it is", lambda b: b / 2**20),
    ("the saving is in bytes, not kilobytes (1e3 bytes)", lambda b: b / 1e3),
    ("the saving is in bytes, not gigabytes (1e9 bytes)", lambda b: b / 1e9),
)
SPEEDUP_SLIPS = (
    ("the model speedup is the ratio of the times, baseline / fused (1.3 means 1.3x), not the fraction of time "
     "saved (baseline / fused - 1)", lambda s: s - 1),
    ("the model speedup is the ratio of the times, baseline / fused (1.3 means 1.3x), not a percentage",
     lambda s: (s - 1) * 100),
    ("the model speedup is the ratio of the times, baseline / fused, not the share of time saved "
     "(1 - fused / baseline)", lambda s: 1 - 1 / s),
)


def _residual_hint(got, want, m, n, k) -> str:
    """The usual mistake whose numbers are the student's: both, else the one that differs."""
    for i, slips in ((0, BYTES_SLIPS), (1, SPEEDUP_SLIPS)):
        if _close(got[1 - i], want[1 - i]):   # one number right, the other a slip of units or sign
            hint = next((h for h, f in slips if _close(got[i], f(want[i]))), "")
            if hint:
                return hint
    faults = [(h, residual_prediction(m, n, k, **kw)) for h, kw in RESIDUAL_FAULTS]
    both = [h for h, f in faults if all(_close(g, w) for g, w in zip(got, f))]
    if both:
        return both[0]
    wrong = [i for i in (0, 1) if not _close(got[i], want[i])]
    return next((h for h, f in faults if all(_close(got[i], f[i]) for i in wrong)), "")


def check_residual_prediction(fn, name: str = "predicted saving of the residual epilogue") -> None:
    """``fn(m, n, k) -> (bytes_saved, model_speedup)`` for the bias + GELU + residual epilogue."""
    from .. import traffic as T
    from .calls import refuse_calls, run_watched
    key = {"reference prediction (checkers.gemm_model.residual_prediction)": residual_prediction}
    check.refuse_answer_key(name, fn, key)
    for m, n, k in RESIDUAL_SHAPES:
        case = f"{name} (M={m}, N={n}, K={k})"
        got, calls = run_watched(fn, (m, n, k), {**key, "traffic.matmul_chain": T.matmul_chain})
        refuse_calls(name, Calls([c for c in calls.seen if c[0] != "traffic.matmul_chain"]))
        check.require(isinstance(got, tuple) and len(got) == 2, f"{case}: return (bytes_saved, model_speedup), "
                      f"got {type(got).__name__}")
        post = calls.first("traffic.matmul_chain")
        fault = _epilogue_fault(post["post"]) if post and post.get("post") is not None else ""
        if fault:
            raise check.CheckFailure(f"{case}: {fault}")
        want = residual_prediction(m, n, k)
        if all(_close(g, w) for g, w in zip(got, want)):
            continue
        hint = _residual_hint(got, want, m, n, k)
        which = " and ".join(w for w, g, x in (("bytes saved", got[0], want[0]), ("model speedup", got[1], want[1]))
                             if not _close(g, x))
        raise check.CheckFailure(f"{case}: the {which} differ from the traffic model's (saved "
                                 f"{T.format_bytes(want[0])}, speedup {want[1]:.6g}; yours {got[0]!r}, {got[1]!r})."
                                 + (f"\nHint: {hint}" if hint else ""))
    check.verdict(name, "the bytes and the model speedup match the traffic model at the MLP, decode and odd shapes")


def wave_bytes(m, n, k, block_m, block_n, group_m, programs, itemsize=2, *, only=None, times_k=True,
               whole_grid=False, first_only=False, floor=False) -> int:
    """Operand bytes the whole grid reads from HBM when it runs in waves of ``programs`` tiles (in grouped
    order) and each wave reads every A row tile (block_m x K) and B column tile (K x block_n) it needs
    once, nothing kept from one wave to the next; the keywords make the usual mistakes."""
    from ..kernels.gemm import tile_order
    tiles = (lambda x, b: x // b) if floor else (lambda x, b: math.ceil(x / b))
    order = tile_order(tiles(m, block_m), tiles(n, block_n), group_m)
    if whole_grid:
        waves = [order]
    else:
        waves = [order[i:i + programs] for i in range(0, programs if first_only else len(order), programs)]
    total = 0
    for wave in waves:
        a = len({pm for pm, _ in wave}) * block_m
        b = len({pn for _, pn in wave}) * block_n
        total += {"a": a, "b": b}.get(only, a + b)
    return total * (k if times_k else 1) * itemsize


def group_choice(m, n, k, block_m, block_n, programs, itemsize=2, *, largest=False, groups=GROUPS, **mistake):
    """(GROUP_M, bytes): the GROUP_M of :data:`GROUPS` whose waves read the fewest operand bytes."""
    costs = [(wave_bytes(m, n, k, block_m, block_n, g, programs, itemsize, **mistake), g) for g in groups]
    best = min(c for c, _ in costs)
    ties = [g for c, g in costs if c == best]
    return (max(ties) if largest else min(ties)), best


GROUP_FAULTS = (
    ("count both operands: each wave's A row tiles (block_m x K each) and its B column tiles (K x block_n each)",
     {"only": "a"}),
    ("count both operands: each wave's A row tiles (block_m x K each) and its B column tiles (K x block_n each)",
     {"only": "b"}),
    ("a tile of A is block_m x K elements and a tile of B is K x block_n: multiply by K (and by the itemsize)",
     {"times_k": False}),
    ("count every wave, not only the first: the grid runs in waves of `programs` tiles (the last one may be "
     "short), and each wave reads the tiles it needs again", {"first_only": True}),
    ("the tiles are shared within a wave, not across the whole grid: counting each tile once over the grid "
     "gives the same bytes for every GROUP_M. Split the grouped order into waves of `programs` tiles and "
     "count each wave's tiles", {"whole_grid": True}),
    ("among GROUP_M values that read the same bytes, take the smallest", {"largest": True}),
    ("GROUP_M = 1 is a candidate too (1, 2, 4, 8, 16, 32, 64): here the output is one column of tiles, every "
     "GROUP_M reads the same bytes, and the smallest, 1, is the answer", {"groups": GROUPS[1:]}),
    ("the candidates go up to GROUP_M = 64 (1, 2, 4, 8, 16, 32, 64): at this shape 64 reads the fewest bytes",
     {"groups": GROUPS[:-1]}),
    ("the operands are 2 bytes an element (bf16), not 4", {"itemsize": 4}),
    ("count the tiles with a ceiling division, triton.cdiv(m, block_m) and triton.cdiv(n, block_n): a ragged "
     "edge is a tile too, read in full", {"floor": True}),
)


def check_group_m(fn, name: str = "GROUP_M from the L2 arithmetic") -> None:
    """``fn(m, n, k, block_m, block_n, programs) -> (group_m, bytes)`` for 2-byte operands."""
    from .calls import refuse_calls, run_watched
    key = {"reference choice (checkers.gemm_model.group_choice)": group_choice,
           "reference bytes (checkers.gemm_model.wave_bytes)": wave_bytes}
    check.refuse_answer_key(name, fn, key)
    for m, n, k, bm, bn, programs in GROUP_SHAPES:
        case = f"{name} (M={m}, N={n}, K={k}, {bm} x {bn} tiles, {programs} programs)"
        got, calls = run_watched(fn, (m, n, k, bm, bn, programs), key)
        refuse_calls(name, calls)
        check.require(isinstance(got, tuple) and len(got) == 2, f"{case}: return (group_m, bytes), "
                      f"got {type(got).__name__}")
        want = group_choice(m, n, k, bm, bn, programs)
        if int(got[0]) == want[0] and _close(got[1], want[1]):
            continue
        hint = next((h for h, kw in GROUP_FAULTS if tuple(got) == group_choice(m, n, k, bm, bn, programs, **kw)), "")
        if not hint and int(got[1]) == want[0] and _close(got[0], want[1]):
            hint = "return (group_m, bytes), in that order: yours are swapped"
        if not hint and int(got[0]) == want[0]:
            unit = next((u for u, d in UNITS if _close(got[1], want[1] / d)), "")
            hint = f"the second value is the operand bytes in bytes, not {unit}" if unit else ""
        raise check.CheckFailure(f"{case}: expected GROUP_M={want[0]} reading {want[1]} bytes over all its waves, "
                                 f"got GROUP_M={got[0]} and {got[1]} bytes." + (f"\nHint: {hint}" if hint else ""))
    check.verdict(name, f"the operand bytes of every wave and the GROUP_M that minimizes them, "
                        f"{len(GROUP_SHAPES)} shapes")
