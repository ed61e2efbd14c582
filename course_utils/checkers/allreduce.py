"""Checks for chapter 13: a student's one-shot all-reduce over symmetric memory, and the same kernel
with the residual add and RMSNorm fused after the sum.

The checker launches the student's kernel on W simulated ranks (:class:`SimulatedRanks`: W buffers
of one process, tables of their addresses) exactly as :mod:`course_utils.kernels.allreduce`
launches its own::

    kernel[grid](out_ptr, x_ptr, buf_table_ptr, pad_table_ptr, rank, n_rows, n_cols, buf_offset,
                 max_spins, WORLD=W, BLOCK_N=..., PUBLISH=..., REDUCE=...)
    kernel[grid](y_ptr, s_ptr, x_ptr, r_ptr, w_ptr, buf_table_ptr, pad_table_ptr, rank, n_rows, n_cols,
                 buf_offset, eps, max_spins, WORLD=W, BLOCK_N=..., PUBLISH=..., REDUCE=...)   # fused

Flag ``pid * WORLD + src`` of rank r's pad says "rank src's program pid has published": set 0 -> 1 by
src (release), reset 1 -> 0 by r when it waits (acquire). Every call draws fresh inputs, poisons the
outputs with NaN inside guard zones, and runs a schedule a GPU could run: first rank 0's reduce half
*before any rank published* (a correct kernel's wait gives up after ``max_spins`` tries and writes
nothing), then every publish (rank 1's reduce once more when rank 1 alone has published: it must give up
too, or it waited on the peers' pads for its own flags), then every reduce in reverse order; then it
checks that the pads are all zero again. Several calls back to back, with new data and alternating
buffer halves. A wrong answer is matched against the usual faults, each named; under the interpreter the
loads of those early reduces are recorded too, so a kernel that reads the peers' buffers before its wait
(and keeps the result only if the wait succeeds) is caught as well. Every rank must get the same bits (a
rank-dependent order of the sum is named), and a sum accumulated in x's dtype is named on its exact
bits, below the tolerance; a reduce that wrote nothing is told apart by the pads as they stood after
every publish. The fused check's rows cycle through drawn, quiet (mean(s^2) = eps) and loud (s about 1024)
ones, where eps outside the square root and the norm's statistics taken in x's dtype show and are named.
:mod:`course_utils.faults.allreduce_probes` adds three: an interpreted launch that never returns is stopped
and named (a wait that ignores max_spins), a reduce that reads rows of a program whose flags it never waited
for (rows split otherwise than published; interpreter), and in 16 bits a y that is not the stored s's norm
rounded once.
What the interpreter cannot see, since it runs one program at a time: a missing release or acquire
(``sem="relaxed"``), or a signal placed before the stores of the same half. Those show on GPUs, in
the stress loop of benchmarks/multigpu.py.
"""

from __future__ import annotations

import torch

from .. import check, env
from ..checker_texts.allreduce import HINT
from ..faults import allreduce_probes as probes
from ..faults.allreduce import EPS, _diagnose, _fail, _low_precision_sum, _rmsnorm, _same_bits
from ..symmetric import SimulatedRanks
from . import answer_keys
from .loads import span

CALLS = 3            # back-to-back calls: the second reuses the pads, the third the first call's half
# The fused check's rows cycle through three kinds (row % ROW_CYCLE): drawn as they come (s's RMS about 3 to 4),
# quiet and loud. Drawn rows alone let two wrong norms through, within the tolerance:
# - quiet: x and the residual scaled so that mean(s^2) equals eps; eps outside the square root
#   (1 / (sqrt(ms) + eps)) then scales y by up to sqrt(2) against 1 / sqrt(ms + eps), where on drawn rows
#   (ms about 10) the two differ by about 3e-7, relative.
# - loud: s about LOUD_MEAN all along the row, as where a large model's residual stream carries a massive
#   activation: its squares (about 1e6) overflow float16 (65504), so statistics taken on s in x's dtype become inf
#   and y becomes 0, where float32's are exact to 1e-7. Every rank's x and the residual carry an equal share of
#   the offset: terms of one sign, so s and s - r keep float32's relative precision (large terms of both signs
#   would leave s, or s - r that the faults are matched on, the small difference of large numbers).
ROW_CYCLE, QUIET_ROW, LOUD_ROW = 3, 1, 2    # row 0 drawn: the one-row cases stay as they were
QUIET_RMS = EPS ** 0.5
LOUD_MEAN = 1024.0


def _shapes():
    # one column last: there every RMSNorm is +-w, so a fault of the norm matched another's too in some runs (4 of
    # 21 named both); a wider case first names it alone, and the one column still judges a right answer
    return env.pick(gpu=((7, 100), (300, 1000), (33, 4099), (1, 1)), cpu=((5, 37), (7, 100), (1, 1)))


def _programs(n_rows: int) -> int:
    return min(n_rows, 3)    # fewer programs than rows: each program's rows wrap around the grid


def _launch(kernel, fused, ranks, rank, publish, reduce, t, i, n_rows, n_cols, offset, case):
    w = ranks.world_size
    block = 1 << max(n_cols - 1, 0).bit_length()
    common = dict(WORLD=w, BLOCK_N=block, PUBLISH=publish, REDUCE=reduce)
    half = "publish half" if publish else "reduce half"
    try:
        with probes.watchdog(case, f"rank {rank}'s {half}"):
            _launch_now(kernel, fused, ranks, rank, t, i, n_rows, n_cols, offset, common)
    except (NotImplementedError, check.CheckFailure):
        raise
    except Exception as e:
        raise check.CheckFailure(f"{case}: your kernel raised {type(e).__name__}: {str(e)[:400]}\nIt is launched "
                                 "as described in course_utils/checkers/allreduce.py.") from e


def _launch_now(kernel, fused, ranks, rank, t, i, n_rows, n_cols, offset, common):
    if fused:
        kernel[(_programs(n_rows),)](t["y"][i].tensor, t["s"][i].tensor, t["x"][i], t["r"], t["w"],
                                     ranks.buf_table, ranks.pad_table, rank, n_rows, n_cols, offset, EPS,
                                     ranks.max_spins, **common)
    else:
        kernel[(_programs(n_rows),)](t["out"][i].tensor, t["x"][i], ranks.buf_table, ranks.pad_table, rank,
                                     n_rows, n_cols, offset, ranks.max_spins, **common)


def _outputs(t, fused):
    return [g.tensor for g in (t["y"] + t["s"] if fused else t["out"])]


def _rms(v: torch.Tensor) -> torch.Tensor:
    return v.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(torch.finfo(torch.float32).tiny)


def _fused_operands(world, dtype, n_rows, n_cols):
    """Every rank's x and the residual, drawn in float32, quiet rows scaled, loud rows offset, rounded to dtype."""
    xs = [check.randn((n_rows, n_cols), torch.float32, scale=2.0).double() for _ in range(world)]
    r = check.randn((n_rows, n_cols), torch.float32).double()
    kind = (torch.arange(n_rows, device=r.device) % ROW_CYCLE).unsqueeze(-1)
    scale = torch.where(kind == QUIET_ROW, QUIET_RMS / _rms(sum(xs) + r), 1.0)
    share = torch.where(kind == LOUD_ROW, LOUD_MEAN / (world + 1), 0.0)
    return [(v * scale + share).to(dtype) for v in xs], (r * scale + share).to(dtype)


def _inputs(ranks, dtype, n_rows, n_cols, fused):
    w = ranks.world_size
    if not fused:
        return {"x": [check.randn((n_rows, n_cols), dtype, scale=2.0) for _ in range(w)],
                "out": [check.Guarded((n_rows, n_cols), dtype) for _ in range(w)]}
    xs, r = _fused_operands(w, dtype, n_rows, n_cols)
    return {"x": xs, "r": r, "w": check.randn((n_cols,), dtype, offset=1.0, scale=0.5),
            "y": [check.Guarded((n_rows, n_cols), dtype) for _ in range(w)],
            "s": [check.Guarded((n_rows, n_cols), dtype) for _ in range(w)]}


def _pads_hold_every_flag(ranks, programs) -> bool:
    """Whether, once every rank published, each rank's pad holds flag pid * WORLD + src for every program pid
    and every peer src (nonzero: 1, or a count), and nothing else."""
    w = ranks.world_size
    for rank, pad in enumerate(ranks.pads):
        want = torch.zeros(ranks.tuned_pad_offset, dtype=torch.bool)
        for pid in range(programs):
            for src in range(w):
                want[pid * w + src] = src != rank
        if not torch.equal(pad[:ranks.tuned_pad_offset].cpu() != 0, want):
            return False
    return True


def _one_call(kernel, fused, ranks, dtype, n_rows, n_cols, name):
    w = ranks.world_size
    case = f"{name} ({str(dtype).removeprefix('torch.')}, {w} ranks, {n_rows} rows x {n_cols} cols)"
    t = _inputs(ranks, dtype, n_rows, n_cols, fused)
    offset = ranks.next_offset()
    n = n_rows * n_cols
    other = ranks.capacity - offset
    stale = [b[offset:offset + n].view(n_rows, n_cols).double().cpu() for b in ranks.buffers]
    other_half = [b[other:other + n].view(n_rows, n_cols).double().cpu() for b in ranks.buffers]
    pads_before = [p.clone() for p in ranks.pads]
    # a reduce before anyone published: a correct kernel waits, gives up, and reads and writes nothing
    with check.track_loads() as loads:
        _launch(kernel, fused, ranks, 0, False, True, t, 0, n_rows, n_cols, offset, case)
    early = _peer_reads(loads, ranks, rank=0)
    if early:
        _fail(case + f", rank 0's reduce launched before any rank published: it loaded {early} element(s) of the "
                     "peers' buffers before their flags came", "no barrier")
    written = [o for o in _outputs(t, fused)[0::w]]
    if not all(bool(o.isnan().all()) for o in written):
        _fail(case + ", rank 0's reduce launched before any rank published", "no barrier")
    if not all(torch.equal(a, b) for a, b in zip(pads_before, ranks.pads)):
        raise check.CheckFailure(f"{case}: rank 0's reduce half, launched before any peer signalled, changed the "
                                 "signal pads: it may only reset a flag that was 1 (atomic_cas(flag, 1, 0)).")
    for rank in list(range(1, w)) + [0]:
        _launch(kernel, fused, ranks, rank, True, False, t, rank, n_rows, n_cols, offset, case)
        if rank == 1:
            _alone_published(kernel, fused, ranks, t, n_rows, n_cols, offset, case)
    pads_ok = _pads_hold_every_flag(ranks, _programs(n_rows))
    split = probes.split_probe(
        lambda: _launch(kernel, fused, ranks, 0, False, True, t, 0, n_rows, n_cols, offset, case),
        ranks, _outputs(t, fused)[0::w], n_rows, n_cols, offset, _programs(n_rows), case)
    for rank in reversed(range(w)):
        _launch(kernel, fused, ranks, rank, False, True, t, rank, n_rows, n_cols, offset, case)
    for g in (t["y"] + t["s"] if fused else t["out"]):
        try:
            g.check(case, HINT)
        except check.CheckFailure:
            if bool(g.tensor.isnan().any()):   # holes inside and stores past the end: not a mask, the rows' stride
                _fail(case + ": your stores went past the output's end and left elements inside it unwritten",
                      "rows BLOCK_N apart")
            raise
    atol, rtol = check.tolerance(dtype)
    if fused:
        y64, s64 = _reference_fused(t, dtype)
        pairs = ([("y", t["y"][r].tensor, y64, r) for r in range(w)]
                 + [("s", t["s"][r].tensor, s64, r) for r in range(w)])
    else:
        ref = sum(v.double() for v in t["x"])
        pairs = [("out", t["out"][r].tensor, ref, r) for r in range(w)]
    for what, got, want, rank in sorted(pairs, key=lambda p: (p[0] == "y", -p[3])):   # in the order ranks reduced
        if not bool(torch.isclose(got.double().cpu(), want.cpu(), atol=atol, rtol=rtol).all()):
            sub = t["r"].double().cpu() if what == "s" else 0.0
            _low_precision_sum(case, t, fused, dtype)
            _diagnose(f"{case}, rank {rank}", t, got.double().cpu() - sub, stale, other_half, rank, what, dtype,
                      want.cpu() - sub, _programs(n_rows), pads_ok)
            check.compare(f"{case}, rank {rank}'s {what}", got, want, dtype=dtype, hint=HINT)
    _low_precision_sum(case, t, fused, dtype)
    _same_bits(case, t, fused)
    if fused:
        probes.stored_s_probe(case, t, dtype)
    if split:
        _fail(split, "rows split otherwise than published")
    for rank in range(w):
        if not torch.equal(ranks.buffers[rank][offset:offset + n].view(n_rows, n_cols), t["x"][rank]):
            raise check.CheckFailure(f"{case}: rank {rank}'s buffer does not hold its x at buf_offset after the call: "
                                     "publish your rows at your buffer + buf_offset + row * n_cols (calls alternate "
                                     "between two halves, so a rank that runs ahead into the next call never "
                                     "overwrites rows a slower peer is still reading).\nHint: " + HINT)
    if any(bool(p.any()) for p in ranks.pads):
        _fail(case + ", after the call", "signal pad never reset")


def _alone_published(kernel, fused, ranks, t, n_rows, n_cols, offset, case) -> None:
    """Rank 1's reduce, launched when rank 1 alone has published: its own pad holds no flag yet, so a right kernel
    gives up and reads, writes and resets nothing. One that waits for the flags it set itself on the peers' pads
    finds them there and reads the peers' old rows (a schedule where every rank published first hides it)."""
    w = ranks.world_size
    pads_before = [p.clone() for p in ranks.pads]
    with check.track_loads() as loads:
        _launch(kernel, fused, ranks, 1, False, True, t, 1, n_rows, n_cols, offset, case)
    where = case + ", rank 1's reduce launched when rank 1 alone had published"
    early = _peer_reads(loads, ranks, rank=1)
    if early:
        _fail(where + f": it loaded {early} element(s) of the peers' buffers", "waits on the peers' pads")
    if not all(bool(o.isnan().all()) for o in _outputs(t, fused)[1::w]):
        _fail(where + ": it wrote its output", "waits on the peers' pads")
    if not all(torch.equal(a, b) for a, b in zip(pads_before, ranks.pads)):
        _fail(where + ": it changed the signal pads", "waits on the peers' pads")


def _order_verdict() -> str:
    """What the verdict says of the wait, the same on the CPU and on a GPU (the grader compares the line with the
    solution's): the loads before the wait are seen under Triton's interpreter only (a GPU records no loads, and
    the simulated ranks' launches run one after another, so an early read finds the data a late one would)."""
    return ("it leaves the pads reset; that it reads a peer's rows only after that peer's flag is checked under "
            "Triton's interpreter only (TRITON_INTERPRET=1, as CI grades)")


def _peer_reads(loads, ranks, rank: int) -> int:
    """How many loaded lanes (recorded under the interpreter; none on a GPU) fell in a peer's buffer."""
    addr = loads.flat()
    if addr.size == 0:
        return 0
    hits = 0
    for r, buf in enumerate(ranks.buffers):
        if r != rank:
            start, end = span(buf)
            hits += int(((addr >= start) & (addr < end)).sum())
    return hits


def _reference_fused(t, dtype):
    s = sum(v.double() for v in t["x"]) + t["r"].double()
    s_n = s.to(dtype).double()   # the kernel normalizes s as it stored it
    return _rmsnorm(s_n, t["w"].double()), s


def _library_ops() -> dict[str, object]:
    """torch's own collectives and symmetric-memory ops, where this build has them."""
    import torch.distributed as dist
    found = {}
    for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "reduce_scatter", "all_gather"):
        if hasattr(dist, name):
            found[f"torch.distributed.{name} (NCCL)"] = getattr(dist, name)
    for name in ("one_shot_all_reduce", "two_shot_all_reduce_", "multimem_all_reduce_",
                 "one_shot_all_reduce_out", "fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        try:
            found[f"torch.ops.symm_mem.{name}"] = getattr(torch.ops.symm_mem, name)
        except (AttributeError, RuntimeError):
            pass
    return found


def _refuse(kernel, name):
    forbidden = answer_keys.course_answers("course_utils.kernels.allreduce")
    forbidden.update(_library_ops())
    module = getattr(getattr(kernel, "fn", None), "__module__", "") or ""
    if module.startswith("course_utils"):
        raise check.CheckFailure(f"{name}: this is the course's own kernel ({module}): write yours.")
    answer_keys.refuse(name, kernel, forbidden)
    for fn in (kernel, getattr(kernel, "fn", None)):
        for dotted, _ in check._referenced(fn) if fn is not None else ():
            if "symm_mem" in dotted or "all_reduce" in dotted or "distributed" in dotted:
                raise check.CheckFailure(f"{name}: your code uses {dotted}: that is a library's all-reduce, the "
                                         "answer the check compares with. Write the kernel yourself.")


def stress(kernel, name: str = "all-reduce kernel", fused: bool = False) -> None:
    """The schedules, calls and comparisons of the checks, without refusing anything (the course's tests
    run its own kernels and the wrong ones through this)."""
    device = env.DEVICE
    for world in (2, 4):
        for dtype in env.supported_dtypes():
            biggest = max(r * c for r, c in _shapes())
            ranks = SimulatedRanks(world, biggest, dtype, device=device, max_programs=3)
            for b in ranks.buffers:   # old contents that differ from every call's data: a stale read shows
                b.copy_(check.randn(b.shape, dtype, scale=3.0, offset=7.0))
            for n_rows, n_cols in _shapes():
                for _ in range(CALLS):
                    _one_call(kernel, fused, ranks, dtype, n_rows, n_cols, name)


def check_all_reduce_kernel(kernel, name: str = "one-shot all-reduce") -> None:
    """Judge a student's all-reduce ``kernel`` (see the module docstring) on 2 and 4 simulated ranks."""
    _refuse(kernel, name)
    stress(kernel, name, fused=False)
    check.verdict(name, "matches the float64 sum on every rank, for 2 and 4 ranks, every dtype tried, calls back "
                        "to back with new data; " + _order_verdict())


def check_all_reduce_add_rms_norm_kernel(kernel, name: str = "all-reduce + residual + RMSNorm") -> None:
    """Judge a student's fused kernel: y = RMSNorm(sum over ranks of x + residual) * w and s on every rank."""
    _refuse(kernel, name)
    stress(kernel, name, fused=True)
    check.verdict(name, "y and s match float64 on every rank, for 2 and 4 ranks, every dtype tried, calls back "
                        "to back with new data; " + _order_verdict())
