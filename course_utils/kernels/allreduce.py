"""One-shot all-reduce over symmetric memory, and the same kernel with the residual add and RMSNorm
fused after the sum: the epilogue of a tensor-parallel block (chapter 13).

Every rank owns a *symmetric* buffer (same size, same layout on every rank) and a signal pad of
int32 flags. The kernel takes two tables of addresses, ``buf_table`` and ``pad_table`` (int64, one
entry per rank): where they point is the launcher's business. On several GPUs they are the peers'
memory mapped into this GPU (``torch.distributed._symmetric_memory``); on one GPU or the CPU they are
W buffers of one process, the *simulated ranks*; :mod:`course_utils.symmetric` builds both.

v1  ``all_reduce_ref``: the float64 sum of every rank's tensor (what NCCL's ``all_reduce`` computes).
v2  the sketch: each rank copies x into its buffer, then reads every rank's buffer and sums. It has no
    barrier, so a rank can read a peer's buffer before the peer wrote it (tests/test_allreduce.py
    keeps it as the wrong kernel the tests must catch).
v3  ``one_shot_all_reduce_kernel``: publish, then a barrier on the signal pads (each program sets its
    flag on every peer with *release* semantics and waits for every peer's flag with *acquire*,
    resetting it to 0 for the next call), then read all W buffers and sum in float32. Calls alternate
    between the two halves of the buffer, so a rank that runs ahead into the next call never
    overwrites what a slower peer is still reading.
v4  ``all_reduce_add_rms_norm_kernel``: v3 with ``s = sum + residual`` and ``y = RMSNorm(s) * w``
    computed in registers before the one store: the sum never travels through HBM.

The two halves of a call, *publish* and *reduce*, are constexpr flags. A GPU runs both in one launch;
the simulated ranks run all publishes, then all reduces (programs of Triton's interpreter run one
after another, so a rank waiting for a peer that has not started would spin forever). Waits give
up after ``max_spins`` tries and then skip the reduce: a check can launch a reduce too early on
purpose and see that a correct kernel refuses to read (course_utils/checkers/allreduce.py).

Launchers: ``one_shot_all_reduce_teaching`` and ``all_reduce_add_rms_norm_teaching`` (lists of
tensors in, one per local rank, lists out). No multicast, no inline assembly. The fast path, with a
barrier that talks to every peer at once and a two-shot all-reduce for large messages on 4 GPUs, is
:mod:`course_utils.tuned.allreduce` (results/h100-80gb-hbm3/multigpu_w4_analysis.md says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..symmetric import PROGRAMS_PER_SM, SPINS_GPU, Ranks, SimulatedRanks

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_BLOCK_N = 16384          # a row stays in registers


@triton.jit
def signal_peers(pad_table_ptr, rank, slot, max_spins, WORLD: tl.constexpr):
    """Set flag ``slot + rank`` on every peer's pad, 0 -> 1, with release semantics: the rows this
    program stored are visible to a peer before it can see the flag."""
    tl.debug_barrier()   # every thread of the program has stored its part of the rows
    for i in tl.static_range(1, WORLD):
        peer = (rank + i) % WORLD
        flag = tl.load(pad_table_ptr + peer).to(tl.pointer_type(tl.int32)) + slot + rank
        old = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
        spins = 0
        while (old != 0) & (spins < max_spins):   # the peer has not consumed the last call's flag yet
            old = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
            spins += 1


@triton.jit
def wait_peers(pad_ptr, rank, slot, max_spins, WORLD: tl.constexpr):
    """Wait for flag ``slot + peer`` of every peer on this rank's pad and reset it, 1 -> 0, with
    acquire semantics (what the peer stored before it signalled is visible after). True if all came."""
    arrived = 0
    for i in tl.static_range(1, WORLD):
        peer = (rank + i) % WORLD
        old = tl.atomic_cas(pad_ptr + slot + peer, 1, 0, sem="acquire", scope="sys")
        spins = 0
        while (old != 1) & (spins < max_spins):
            old = tl.atomic_cas(pad_ptr + slot + peer, 1, 0, sem="acquire", scope="sys")
            spins += 1
        arrived += (old == 1).to(tl.int32)
    tl.debug_barrier()   # no thread reads a peer's rows before the flags were seen
    return arrived == WORLD - 1


@triton.jit
def rank_buffer(buf_table_ptr, r, buf_offset, DTYPE: tl.constexpr):
    """Rank r's symmetric buffer, this call's half. The address comes from memory, so the compiler knows
    nothing of its alignment and would load one element per instruction; the launcher guarantees 16 bytes
    (symmetric.Ranks.tables checks it), and saying so lets it load 16 bytes (8 bf16) per instruction."""
    return tl.multiple_of(tl.load(buf_table_ptr + r).to(tl.pointer_type(DTYPE)), 16) + buf_offset


@triton.jit
def publish_rows(x_ptr, buf_table_ptr, pad_table_ptr, rank, n_rows, n_cols, buf_offset, max_spins,
                 WORLD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Copy this program's rows of x into this rank's symmetric buffer, then signal every peer."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    my_buf = rank_buffer(buf_table_ptr, rank, buf_offset, x_ptr.dtype.element_ty)
    for row in tl.range(pid, n_rows, tl.num_programs(0)):
        offsets = tl.cast(row, tl.int64) * n_cols + cols   # int64: rows * n_cols can pass 2^31
        tl.store(my_buf + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
    signal_peers(pad_table_ptr, rank, pid * WORLD, max_spins, WORLD)


@triton.jit
def sum_ranks(buf_table_ptr, offsets, mask, buf_offset, DTYPE: tl.constexpr, WORLD: tl.constexpr):
    """The float32 sum over ranks 0..W-1 of one row; the same order on every rank, so every rank
    gets the same bits."""
    acc = tl.zeros(offsets.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        buf = rank_buffer(buf_table_ptr, r, buf_offset, DTYPE)
        acc += tl.load(buf + offsets, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def poison_rows(out_ptr, n_rows, n_cols, BLOCK_N: tl.constexpr):
    """NaN in this program's rows of out: a peer that never signalled gives a visible failure, never
    whatever the output's memory held."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    nan = tl.full((BLOCK_N,), float("nan"), tl.float32).to(out_ptr.dtype.element_ty)
    for row in tl.range(pid, n_rows, tl.num_programs(0)):
        tl.store(out_ptr + tl.cast(row, tl.int64) * n_cols + cols, nan, mask=cols < n_cols)


@triton.jit
def one_shot_all_reduce_kernel(out_ptr, x_ptr, buf_table_ptr, pad_table_ptr, rank, n_rows, n_cols, buf_offset,
                               max_spins, WORLD: tl.constexpr, BLOCK_N: tl.constexpr, PUBLISH: tl.constexpr,
                               REDUCE: tl.constexpr):
    """v3: out = sum over ranks of x, rows pid, pid + programs, ... (rows contiguous, n_cols wide)."""
    if PUBLISH:
        publish_rows(x_ptr, buf_table_ptr, pad_table_ptr, rank, n_rows, n_cols, buf_offset, max_spins,
                     WORLD, BLOCK_N)
    if REDUCE:
        pid = tl.program_id(0)
        my_pad = tl.load(pad_table_ptr + rank).to(tl.pointer_type(tl.int32))
        if wait_peers(my_pad, rank, pid * WORLD, max_spins, WORLD):
            cols = tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            for row in tl.range(pid, n_rows, tl.num_programs(0)):
                offsets = tl.cast(row, tl.int64) * n_cols + cols   # int64: rows * n_cols can pass 2^31
                acc = sum_ranks(buf_table_ptr, offsets, mask, buf_offset, x_ptr.dtype.element_ty, WORLD)
                tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
        elif PUBLISH:   # one launch (a GPU's): the wait gave up, so say so in the output (split phases: a probe)
            poison_rows(out_ptr, n_rows, n_cols, BLOCK_N)


@triton.jit
def all_reduce_add_rms_norm_kernel(y_ptr, s_ptr, x_ptr, r_ptr, w_ptr, buf_table_ptr, pad_table_ptr, rank,
                                   n_rows, n_cols, buf_offset, eps, max_spins, WORLD: tl.constexpr,
                                   BLOCK_N: tl.constexpr, PUBLISH: tl.constexpr, REDUCE: tl.constexpr):
    """v4: s = sum over ranks of x + residual, y = s / sqrt(mean(s^2) + eps) * w, one store of each."""
    if PUBLISH:
        publish_rows(x_ptr, buf_table_ptr, pad_table_ptr, rank, n_rows, n_cols, buf_offset, max_spins,
                     WORLD, BLOCK_N)
    if REDUCE:
        pid = tl.program_id(0)
        my_pad = tl.load(pad_table_ptr + rank).to(tl.pointer_type(tl.int32))
        if wait_peers(my_pad, rank, pid * WORLD, max_spins, WORLD):
            cols = tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            for row in tl.range(pid, n_rows, tl.num_programs(0)):
                offsets = tl.cast(row, tl.int64) * n_cols + cols   # int64: rows * n_cols can pass 2^31
                acc = sum_ranks(buf_table_ptr, offsets, mask, buf_offset, x_ptr.dtype.element_ty, WORLD)
                s = acc + tl.load(r_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                s_out = s.to(s_ptr.dtype.element_ty)
                tl.store(s_ptr + offsets, s_out, mask=mask)
                s = s_out.to(tl.float32)   # normalize the stream as stored
                rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / n_cols + eps)
                tl.store(y_ptr + offsets, (s * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
        elif PUBLISH:   # one launch: the wait gave up; NaN in y and s, not stale memory
            poison_rows(y_ptr, n_rows, n_cols, BLOCK_N)
            poison_rows(s_ptr, n_rows, n_cols, BLOCK_N)


# --------------------------------------------------------------------------- launchers


def _rows(what: str, xs, ranks: Ranks, name: str = "xs") -> tuple[list, int, int]:
    """Checks one tensor per local rank, same shape, the group's dtype and device; returns the
    contiguous (rows, n_cols) views, n_rows, n_cols."""
    if not isinstance(ranks, Ranks):
        raise TypeError(f"{what}: ranks must be SimulatedRanks or SymmetricRanks, got {type(ranks).__name__}")
    if isinstance(xs, torch.Tensor) or len(xs) != len(ranks.local_ranks):
        raise ValueError(f"{what}: {name} must be a list of {len(ranks.local_ranks)} tensors (one per local "
                         f"rank), got {type(xs).__name__}" + ("" if isinstance(xs, torch.Tensor) else f" of {len(xs)}"))
    for x in xs:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what}: {name} must hold torch.Tensors, got {type(x).__name__}")
        if x.dtype not in DTYPES:
            raise TypeError(f"{what}: {name} must be float32, float16 or bfloat16, got {x.dtype}")
        if x.dtype != ranks.dtype or x.device != ranks.device:
            raise TypeError(f"{what}: the group holds {ranks.dtype} on {ranks.device}, got {x.dtype} on {x.device}")
        if x.shape != xs[0].shape or x.dim() == 0:
            raise ValueError(f"{what}: every rank needs the same shape of at least one dimension, got "
                             f"{[tuple(t.shape) for t in xs]}")
    n_cols = xs[0].shape[-1]
    if triton.next_power_of_2(max(n_cols, 1)) > MAX_BLOCK_N:
        raise ValueError(f"{what}: a row stays in registers: at most {MAX_BLOCK_N} columns, got {n_cols}")
    if xs[0].numel() > ranks.capacity:
        raise ValueError(f"{what}: {xs[0].numel()} elements do not fit the symmetric buffers' {ranks.capacity}")
    n_rows = xs[0].numel() // max(n_cols, 1)
    return [x.contiguous().view(n_rows, n_cols) for x in xs], n_rows, n_cols


def one_shot_all_reduce_teaching(xs, ranks: Ranks) -> list[torch.Tensor]:
    """v3: for each local rank, a new tensor holding the sum of every rank's x."""
    rows, n_rows, n_cols = _rows("one_shot_all_reduce", xs, ranks)
    outs = [torch.empty_like(x) for x in xs]
    if n_rows * n_cols == 0:
        return outs
    offset, grid = ranks.next_offset(), (min(n_rows, ranks.max_programs),)
    for rank, publish, reduce in ranks.schedule():
        i = ranks.local_ranks.index(rank)
        one_shot_all_reduce_kernel[grid](outs[i], rows[i], ranks.buf_table, ranks.pad_table, rank, n_rows, n_cols,
                                         offset, ranks.max_spins, WORLD=ranks.world_size,
                                         BLOCK_N=triton.next_power_of_2(n_cols), PUBLISH=publish, REDUCE=reduce)
    return outs


def all_reduce_add_rms_norm_teaching(xs, residuals, weight, ranks: Ranks, eps: float = 1e-6):
    """v4: for each local rank, (y, s) with s = sum of every rank's x + residual, y = RMSNorm(s) * weight."""
    rows, n_rows, n_cols = _rows("all_reduce_add_rms_norm", xs, ranks)
    res, _, _ = _rows("all_reduce_add_rms_norm", residuals, ranks, "residuals")
    if residuals[0].shape != xs[0].shape:
        raise ValueError(f"all_reduce_add_rms_norm: residuals must have shape {tuple(xs[0].shape)}, "
                         f"got {tuple(residuals[0].shape)}")
    if not isinstance(weight, torch.Tensor) or weight.shape != (n_cols,) or weight.device != ranks.device:
        raise ValueError(f"all_reduce_add_rms_norm: weight must be a tensor of shape ({n_cols},) on {ranks.device}")
    weight = weight.contiguous()
    ys, ss = [torch.empty_like(x) for x in xs], [torch.empty_like(x) for x in xs]
    if n_rows * n_cols == 0:
        return list(zip(ys, ss))
    offset, grid = ranks.next_offset(), (min(n_rows, ranks.max_programs),)
    for rank, publish, reduce in ranks.schedule():
        i = ranks.local_ranks.index(rank)
        all_reduce_add_rms_norm_kernel[grid](
            ys[i], ss[i], rows[i], res[i], weight, ranks.buf_table, ranks.pad_table, rank, n_rows, n_cols,
            offset, eps, ranks.max_spins, WORLD=ranks.world_size, BLOCK_N=triton.next_power_of_2(n_cols),
            PUBLISH=publish, REDUCE=reduce)
    return list(zip(ys, ss))


def all_reduce_ref(xs) -> torch.Tensor:
    """v1: the float64 sum of every rank's tensor."""
    return sum(x.double() for x in xs)


def all_reduce_add_rms_norm_ref(xs, residual, weight, eps: float = 1e-6, dtype=None):
    """(y, s) in float64: s = sum(xs) + residual, y = s / sqrt(mean(s^2) + eps) * weight; with ``dtype``,
    y is computed from s rounded to it, as the kernel stores s and normalizes what it stored."""
    s = all_reduce_ref(xs) + residual.double()
    s_n = s.to(dtype).double() if dtype is not None else s
    y = s_n * torch.rsqrt(s_n.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return y, s


class _GpuRank(SimulatedRanks):
    """Rank 0 of a W-rank group as a GPU launches it: publish and reduce in one launch (compile matrix)."""

    def __init__(self, world_size, capacity, dtype):
        super().__init__(world_size, capacity, dtype, device="cpu", max_programs=PROGRAMS_PER_SM * 132)
        self.local_ranks, self.max_spins = [0], SPINS_GPU

    def schedule(self):
        return [(0, True, True)]


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (course_utils/aot.py): one launch per rank."""
    from ..aot import dtype_name, dtypes_for, empty
    for dt in dtypes_for(info):
        for world, (m, n) in ((2, (8192, 768)), (4, (7, 4099))):
            ranks = _GpuRank(world, m * n, dt)
            x, w = empty(m, n, dtype=dt), empty(n, dtype=dt)
            name = f"{dtype_name(dt)} {world} ranks {m}x{n}"
            yield f"one-shot all-reduce {name}", lambda x=x, ranks=ranks: one_shot_all_reduce_teaching([x], ranks)
            yield (f"all-reduce + add + rms_norm {name}",
                   lambda x=x, w=w, ranks=ranks: all_reduce_add_rms_norm_teaching([x], [x], w, ranks))
