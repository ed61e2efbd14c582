"""Three more probes of chapter 13's all-reduce check, beside its fault catalogue (:mod:`.allreduce`). Not a
checker: :mod:`course_utils.checkers.allreduce` runs them, and it refuses the course's own kernels and torch's
symmetric-memory ops as the answer before any probe runs:

- :func:`watchdog`: a launch that has not returned after :data:`WAIT_LIMIT_S` seconds under Triton's interpreter
  is stopped and named: a wait that ignores ``max_spins`` spins forever on the check's reduce launched before any
  peer published (a GPU's would hang the job; the interpreter's hangs the check cell). A GPU cannot be stopped
  from the host: there the cell hangs, as the job would.
- :func:`split_probe`: after every rank published, rank 0's reduce with the flags of its last program taken
  away (that program of every peer "has not published yet"): the peers' rows that program published, rows
  ``k, k + programs, ...``, may not be read by any program, since no program waited for them. A reduce half
  that splits the rows otherwise than the publish half (chunks of rows, or a stride other than the grid's)
  reads rows whose flag it never checked: right on the check's schedule, a race on GPUs. Loads are recorded
  under the interpreter only.
- :func:`stored_s_probe`: in 16 bits, y must be RMSNorm of the s the kernel stored, rounded once (within
  half a unit in its last place of the float64 norm of that s, plus float32's error): a y normalized from the
  float32 sum before its rounding passes the dtype's tolerance, not this.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import torch

from .. import check, env
from ..checkers.loads import span
from .allreduce import EPS, _fail

#: seconds one launch may take under the interpreter: a right reduce gives up after max_spins (2) tries per flag,
#: well under a second; the slowest launch of the check on two busy cores takes a few tenths
WAIT_LIMIT_S = 30.0
#: float32's error in y, relative: a sum of squares, a square root and two products, a few ulps each
F32_Y = 4e-6


class _Expired(BaseException):
    """Raised in the kernel's frame by the alarm: a BaseException, so that the interpreter's
    ``except Exception`` (which wraps errors in InterpreterError) lets it through."""


@contextlib.contextmanager
def watchdog(case: str, half: str):
    """Stop, and name, an interpreted launch that runs past :data:`WAIT_LIMIT_S` (main thread, POSIX only)."""
    usable = (not env.on_gpu() and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def expired(signum, frame):
        raise _Expired

    old_handler = signal.signal(signal.SIGALRM, expired)
    old_timer = signal.setitimer(signal.ITIMER_REAL, WAIT_LIMIT_S)
    try:
        yield
    except _Expired:
        _fail(f"{case}, {half}: it had not returned after {WAIT_LIMIT_S:g} s", "wait never gives up")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_timer[0] > 0:   # someone else's alarm (a test timeout): give it back what was left
            signal.setitimer(signal.ITIMER_REAL, *old_timer)


def split_probe(reduce_rank0, ranks, outputs, n_rows: int, n_cols: int, offset: int, programs: int,
                case: str) -> str:
    """Rank 0's reduce with program ``programs - 1``'s flags gone (see the module docstring): no load may fall in
    the rows that program of a peer published. ``reduce_rank0()`` launches it; afterwards rank 0's ``outputs``
    are poisoned again and the pads and this call's half of every buffer put back as they were, for the reduces
    that follow. Returns the failure's text ("" if none), for the checker to raise once the values were judged
    (a wrong value names a fault that also reads other rows, rows BLOCK_N apart, better)."""
    if programs < 2 or n_rows <= programs:
        return ""
    w, k, n = ranks.world_size, programs - 1, n_rows * n_cols
    pads = [p.clone() for p in ranks.pads]
    halves = [b[offset:offset + n].clone() for b in ranks.buffers]
    ranks.pads[0][k * w:(k + 1) * w] = 0
    with check.track_loads() as loads:
        reduce_rank0()
    for p, before in zip(ranks.pads, pads):
        p.copy_(before)
    for b, before in zip(ranks.buffers, halves):
        b[offset:offset + n] = before
    for o in outputs:
        o.fill_(float("nan"))
    addr = loads.flat()
    if addr.size == 0:
        return ""
    hits = 0
    for p in range(1, w):
        buf = ranks.buffers[p]
        for row in range(k, n_rows, programs):
            start, end = span(buf[offset + row * n_cols:offset + (row + 1) * n_cols])
            hits += int(((addr >= start) & (addr < end)).sum())
    if not hits:
        return ""
    return (f"{case}, rank 0's reduce launched when every peer's program {k} had not yet published: it loaded "
            f"{hits} element(s) of the rows those programs publish ({k}, {k + programs}, ...)")


def stored_s_probe(case: str, t, dtype) -> None:
    """16-bit y: RMSNorm(stored s) * w in float32, rounded once (see the module docstring)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return
    unit = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    w = t["w"].double().cpu()
    for rank, (sg, yg) in enumerate(zip(t["s"], t["y"])):
        s = sg.tensor.double().cpu()
        want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w
        got = yg.tensor.double().cpu()
        bad = (got - want).abs() > (unit + F32_Y) * want.abs() + 1e-7
        if bool(bad.any()):
            i = tuple(int(v) for v in bad.nonzero()[0])
            _fail(f"{case}, rank {rank}'s y: {int(bad.sum())} element(s) further from the float64 norm of the s you "
                  f"stored than one rounding to {str(dtype).removeprefix('torch.')} (first at {i}: got "
                  f"{float(got[i]):.6g}, expected {float(want[i]):.6g})", "norm of s before its rounding")
