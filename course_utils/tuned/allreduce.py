"""All-reduce over symmetric memory, the fast path: chapter 13's one-shot and its fused residual +
RMSNorm epilogue, with what the teaching kernel (course_utils/kernels/allreduce.py) leaves on the table
at 4 GPUs, and a two-shot all-reduce for large messages
(results/h100-80gb-hbm3/multigpu_w4_analysis.md has the numbers).

1. **Signals need no answer.** The teaching barrier visits the peers one after another: W-1
   compare-and-swaps over NVLink, each waiting for its answer. Here a barrier is a vector of W flags,
   one lane (one thread) per peer: every peer is signalled at once. A flag is a *counter*: the signaller
   adds 1 (release), the waiter polls it until it is at least 1, then subtracts 1 (acquire). A signal
   needs no answer, and one flag serves every barrier of a call (the k-th wait on a peer's flag passes
   once that peer signalled k times). The wait polls each peer's flag with a scalar atomic read, whose
   value every warp of the program shares (``allreduce_barrier.wait_all`` says why a vector load there
   hangs a GPU). Pads are back to zero after every call, as with the teaching protocol; the counters live in their
   own half of the pads (``Ranks.tuned_pad_offset``), so the two protocols never meet on one flag.
2. **Every rank's row in flight at once, 16 bytes a load.** A row is loaded from all W buffers in one
   (W, BLOCK_N) load, and the table's addresses are declared 16-byte aligned (``Ranks.tables`` checks
   it): 8 bf16 per instruction instead of one (a pointer read from memory has no known alignment, so
   without the hint the compiler emits 2-byte loads).
3. **Two-shot for large messages.** The one-shot reads ``(W-1) x nbytes`` per rank over the links; the
   two-shot reads ``2 (W-1)/W x nbytes``, as NCCL's ring does: a reduce-scatter (each rank sums a
   W-th of the rows, from every rank, and stores the sum in place in its own buffer), a second barrier,
   then an all-gather (every row read back from its owner) with the epilogue fused into the gather.
   At W = 2 both move the same bytes and the one-shot saves a barrier; at W = 4 the two-shot halves
   the bytes (traffic.links.all_reduce).
   ``"two-shot-push"`` (as PyTorch's ``two_shot_all_reduce_``): the owner stores each sum into every
   rank's buffer (stores the sender need not wait for); after barrier 2 each rank reads its own. A row is
   read and written by its owner alone, so no new race. Measured by the benchmark, not yet picked by auto.
4. **No copy where the producer writes into the buffer.** ``ranks.staging(shape)`` is the part of this
   rank's buffer the next call publishes from; an x written there (``torch.matmul(..., out=)``) and
   passed with ``in_buffer=True`` saves the call its copy (2 x nbytes of HBM before the barrier).

Layout of the work: program pid handles rows pid, pid + P, pid + 2P, ... (P programs), on every rank;
in the two-shot, the j-th of those rows belongs to rank (j + pid) % W (the + pid spreads the owners
over the ranks when programs have fewer rows than ranks: rows of 4096 at 1-8 MiB give one or two rows
a program). A program only waits for the same program on the peers, so no grid-wide barrier is
needed, and the rows it reads are exactly the rows its peers' same program wrote. The grid is no larger
than what the GPU holds resident at once (``Ranks.programs``): a waiting program keeps its SM.

``all_reduce(xs, ranks, algorithm="auto", in_buffer=False)`` and ``all_reduce_add_rms_norm(xs,
residuals, weight, ranks, eps, algorithm="auto", in_buffer=False)`` take and return what the teaching
launchers do; ``pick_algorithm`` says which algorithm "auto" runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.allreduce import _rows
from ..symmetric import Ranks
from .allreduce_barrier import signal_all, wait_all

ALGORITHMS = ("one-shot", "two-shot", "two-shot-push")
TWO_SHOT_MIN_WORLD = 3          # at W = 2 both move the same bytes: the one-shot's single barrier wins
# measured crossover at W = 4 on H100s (multigpu_allreduce_graphs_small_w4.csv): the one-shot is faster up to
# 0.5 MiB per rank, the two-shot from 1 MiB (22.8 vs 23.0 us at width 768, 21.8 vs 23.9 at 4096); the threshold
# sits between them, below a whole MiB so that 1 MiB of rows of 768 (682 rows, 1,024 bytes short) is a two-shot
TWO_SHOT_MIN_BYTES = 3 * 2**18
ELEMENTS_PER_THREAD = 32        # of the (W, BLOCK_N) tile: 4 ranks x one 16-byte load of bf16, in fp32 registers


# --------------------------------------------------------------------------- rows


@triton.jit
def buffer_table(buf_table_ptr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """Every rank's buffer address (int64, one lane per rank, 0 in padding lanes), read once per program
    rather than once per row."""
    lanes = tl.arange(0, WORLD_P2)
    return tl.load(buf_table_ptr + lanes, mask=lanes < WORLD, other=0)


@triton.jit
def owner_buffer(addrs, owner, buf_offset, DTYPE: tl.constexpr, WORLD_P2: tl.constexpr):
    """Rank ``owner``'s buffer (this call's half), picked from :func:`buffer_table` in registers."""
    addr = tl.sum(tl.where(tl.arange(0, WORLD_P2) == owner, addrs, 0), axis=0)
    return tl.multiple_of(addr.to(tl.pointer_type(DTYPE)), 16) + buf_offset


@triton.jit
def sum_all_ranks(addrs, offsets, mask, buf_offset, DTYPE: tl.constexpr, WORLD: tl.constexpr,
                  WORLD_P2: tl.constexpr):
    """The float32 sum over ranks of one row, every rank's row loaded in one (WORLD_P2, BLOCK_N) load (all
    peers' bytes in flight at once); the same order on every rank, so every rank gets the same bits."""
    lanes = tl.arange(0, WORLD_P2)
    bases = tl.multiple_of(addrs.to(tl.pointer_type(DTYPE)), 16) + buf_offset
    rows = tl.load(bases[:, None] + offsets[None, :], mask=(lanes < WORLD)[:, None] & mask[None, :], other=0.0)
    return tl.sum(rows.to(tl.float32), axis=0)


@triton.jit
def store_all_ranks(addrs, offsets, mask, buf_offset, row, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """One row stored into every rank's buffer in one (WORLD_P2, BLOCK_N) store."""
    bases = tl.multiple_of(addrs.to(tl.pointer_type(row.dtype)), 16) + buf_offset
    tl.store(bases[:, None] + offsets[None, :], tl.broadcast_to(row[None, :], (WORLD_P2, row.shape[0])),
             mask=(tl.arange(0, WORLD_P2) < WORLD)[:, None] & mask[None, :])


@triton.jit
def copy_rows(x_ptr, my_buf, n_rows, n_cols, BLOCK_N: tl.constexpr):
    """This program's rows of x into this rank's buffer."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    for row in tl.range(pid, n_rows, tl.num_programs(0)):
        offsets = tl.cast(row, tl.int64) * n_cols + cols   # int64: rows * n_cols can pass 2^31
        tl.store(my_buf + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)


@triton.jit
def finish_row(acc, offsets, mask, y_ptr, s_ptr, r_ptr, w, n_cols, eps, FUSED: tl.constexpr):
    """Store one summed row: as is (y = sum), or fused: s = sum + residual, y = RMSNorm(s) * w."""
    if FUSED:
        s_out = (acc + tl.load(r_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + offsets, s_out, mask=mask)
        s = s_out.to(tl.float32)   # normalize the stream as stored
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / n_cols + eps)
        tl.store(y_ptr + offsets, (s * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def poison(y_ptr, s_ptr, n_rows, n_cols, BLOCK_N: tl.constexpr, FUSED: tl.constexpr):
    """NaN in this program's rows of the outputs: a peer that never came gives a visible failure."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    nan = tl.full((BLOCK_N,), float("nan"), tl.float32)
    for row in tl.range(pid, n_rows, tl.num_programs(0)):
        offsets = tl.cast(row, tl.int64) * n_cols + cols
        tl.store(y_ptr + offsets, nan.to(y_ptr.dtype.element_ty), mask=cols < n_cols)
        if FUSED:
            tl.store(s_ptr + offsets, nan.to(s_ptr.dtype.element_ty), mask=cols < n_cols)


# --------------------------------------------------------------------------- kernels


@triton.jit
def one_shot_kernel(y_ptr, s_ptr, x_ptr, r_ptr, w_ptr, buf_table_ptr, pad_table_ptr, rank, n_rows, n_cols,
                    buf_offset, pad_offset, eps, max_spins, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                    BLOCK_N: tl.constexpr, FUSED: tl.constexpr, COPY: tl.constexpr, PUBLISH: tl.constexpr,
                    REDUCE: tl.constexpr):
    """Publish (copy x into this rank's buffer unless it is there already, then signal), one barrier, every
    rank's rows summed: y = sum (or, FUSED, s = sum + r, y = RMSNorm(s) * w)."""
    pid = tl.program_id(0)
    slot = pad_offset + pid * WORLD
    if PUBLISH:
        if COPY:
            my_buf = owner_buffer(buffer_table(buf_table_ptr, WORLD, WORLD_P2), rank, buf_offset,
                                  x_ptr.dtype.element_ty, WORLD_P2)
            copy_rows(x_ptr, my_buf, n_rows, n_cols, BLOCK_N)
        signal_all(pad_table_ptr, rank, slot, WORLD, WORLD_P2)
    if REDUCE:
        my_pad = tl.load(pad_table_ptr + rank).to(tl.pointer_type(tl.int32))
        if wait_all(my_pad, rank, slot, max_spins, WORLD):
            cols = tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) if FUSED else None
            addrs = buffer_table(buf_table_ptr, WORLD, WORLD_P2)
            for row in tl.range(pid, n_rows, tl.num_programs(0)):
                offsets = tl.cast(row, tl.int64) * n_cols + cols
                acc = sum_all_ranks(addrs, offsets, mask, buf_offset, x_ptr.dtype.element_ty, WORLD, WORLD_P2)
                finish_row(acc, offsets, mask, y_ptr, s_ptr, r_ptr, w, n_cols, eps, FUSED)
        elif PUBLISH:   # one launch (a GPU's): the wait gave up; NaN, not stale memory
            poison(y_ptr, s_ptr, n_rows, n_cols, BLOCK_N, FUSED)


@triton.jit
def two_shot_kernel(y_ptr, s_ptr, x_ptr, r_ptr, w_ptr, buf_table_ptr, pad_table_ptr, rank, n_rows, n_cols,
                    buf_offset, pad_offset, eps, max_spins, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                    BLOCK_N: tl.constexpr, FUSED: tl.constexpr, COPY: tl.constexpr, PUBLISH: tl.constexpr,
                    SCATTER: tl.constexpr, GATHER: tl.constexpr, PUSH: tl.constexpr = False):
    """Publish; barrier; reduce-scatter (this program's j-th row belongs to rank (j + pid) % W; this rank's
    rows summed in place in its own buffer, or with PUSH in every rank's); barrier; all-gather (every row
    read from its owner, or with PUSH from this rank's own buffer) with the epilogue of :func:`finish_row`."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    slot = pad_offset + pid * WORLD
    dtype = x_ptr.dtype.element_ty
    addrs = buffer_table(buf_table_ptr, WORLD, WORLD_P2)
    my_buf = owner_buffer(addrs, rank, buf_offset, dtype, WORLD_P2)
    my_pad = tl.load(pad_table_ptr + rank).to(tl.pointer_type(tl.int32))
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    ok = True
    if PUBLISH:
        if COPY:
            copy_rows(x_ptr, my_buf, n_rows, n_cols, BLOCK_N)
        signal_all(pad_table_ptr, rank, slot, WORLD, WORLD_P2)
    if SCATTER:
        ok = wait_all(my_pad, rank, slot, max_spins, WORLD)
        if ok:
            first = (rank - pid % WORLD + WORLD) % WORLD   # the first j with (j + pid) % W == rank
            for row in tl.range(pid + first * programs, n_rows, WORLD * programs):
                offsets = tl.cast(row, tl.int64) * n_cols + cols
                acc = sum_all_ranks(addrs, offsets, mask, buf_offset, dtype, WORLD, WORLD_P2)
                if PUSH:   # into every rank's buffer at once; no rank reads this row there before barrier 2
                    store_all_ranks(addrs, offsets, mask, buf_offset, acc.to(dtype), WORLD, WORLD_P2)
                else:
                    tl.store(my_buf + offsets, acc.to(dtype), mask=mask)   # no peer reads this row before barrier 2
            signal_all(pad_table_ptr, rank, slot, WORLD, WORLD_P2)
    if GATHER:
        if ok:
            ok = wait_all(my_pad, rank, slot, max_spins, WORLD)
        if ok:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) if FUSED else None
            for row in tl.range(pid, n_rows, programs):
                owner = rank if PUSH else ((row - pid) // programs + pid) % WORLD
                offsets = tl.cast(row, tl.int64) * n_cols + cols
                source = owner_buffer(addrs, owner, buf_offset, dtype, WORLD_P2)
                summed = tl.load(source + offsets, mask=mask, other=0.0)
                finish_row(summed.to(tl.float32), offsets, mask, y_ptr, s_ptr, r_ptr, w, n_cols, eps, FUSED)
        elif PUBLISH:   # one launch: a wait gave up; NaN, not stale memory
            poison(y_ptr, s_ptr, n_rows, n_cols, BLOCK_N, FUSED)


# --------------------------------------------------------------------------- launchers


def pick_algorithm(nbytes: int, world: int) -> str:
    """"two-shot" (pulled) from TWO_SHOT_MIN_WORLD ranks and TWO_SHOT_MIN_BYTES per rank, else "one-shot"."""
    return "two-shot" if world >= TWO_SHOT_MIN_WORLD and nbytes >= TWO_SHOT_MIN_BYTES else "one-shot"


def num_warps_for(world: int, block_n: int) -> int:
    """Enough warps that the (W, BLOCK_N) tile is about ELEMENTS_PER_THREAD values a thread (4 to 16 warps)."""
    p2 = triton.next_power_of_2(world)
    return max(4, min(16, p2 * block_n // (32 * ELEMENTS_PER_THREAD)))


def _phases(ranks: Ranks, names: tuple[str, ...]) -> list[tuple[int, dict]]:
    """``(rank, {phase: bool})`` launches: a GPU's one launch per rank with every phase; simulated ranks run
    each phase on every rank before the next phase (the interpreter runs one program at a time)."""
    schedule = ranks.schedule()
    if all(publish and reduce for _, publish, reduce in schedule):
        return [(rank, dict.fromkeys(names, True)) for rank, _, _ in schedule]
    return [(rank, {n: n == phase for n in names}) for phase in names for rank in ranks.local_ranks]


def _check_staged(rows, ranks: Ranks) -> None:
    """``in_buffer=True``: every x must be the view ``ranks.staging`` gives for this call."""
    for rank, x in zip(ranks.local_ranks, rows):
        want = ranks.staging(x.shape, rank)
        if x.data_ptr() != want.data_ptr():
            raise ValueError("in_buffer=True: x must be ranks.staging(shape) taken just before this call (the half "
                             "this call publishes from), filled by its producer")


def _launch(algorithm, ys, ss, rows, res, weight, ranks, n_rows, n_cols, eps, fused, in_buffer):
    if algorithm not in ALGORITHMS + ("auto",):
        raise ValueError(f"algorithm must be one of {ALGORITHMS + ('auto',)}, got {algorithm!r}")
    if in_buffer:
        _check_staged(rows, ranks)
    world = ranks.world_size
    if algorithm == "auto":
        algorithm = pick_algorithm(n_rows * n_cols * rows[0].element_size(), world)
    kernel, names = ((one_shot_kernel, ("PUBLISH", "REDUCE")) if algorithm == "one-shot"
                     else (two_shot_kernel, ("PUBLISH", "SCATTER", "GATHER")))
    block = triton.next_power_of_2(n_cols)
    warps = num_warps_for(world, block)
    offset, grid = ranks.next_offset(), (min(n_rows, ranks.programs(warps)),)   # every program resident at once
    push = {"PUSH": True} if algorithm == "two-shot-push" else {}
    for rank, phases in _phases(ranks, names):
        i = ranks.local_ranks.index(rank)
        kernel[grid](ys[i], ss[i], rows[i], res[i], weight, ranks.buf_table, ranks.pad_table, rank, n_rows, n_cols,
                     offset, ranks.tuned_pad_offset, eps, ranks.max_spins, WORLD=world,
                     WORLD_P2=triton.next_power_of_2(world), BLOCK_N=block, FUSED=fused, COPY=not in_buffer,
                     num_warps=warps, **phases, **push)


def all_reduce(xs, ranks: Ranks, algorithm: str = "auto", in_buffer: bool = False) -> list[torch.Tensor]:
    """For each local rank, a new tensor holding the sum of every rank's x (one-shot or two-shot). With
    ``in_buffer``, each x is ``ranks.staging(shape, rank)``, already written: the call skips its copy."""
    rows, n_rows, n_cols = _rows("all_reduce", xs, ranks)
    outs = [torch.empty_like(x) for x in xs]
    if n_rows * n_cols:
        _launch(algorithm, outs, outs, rows, rows, rows[0], ranks, n_rows, n_cols, 0.0, False, in_buffer)
    return outs


def all_reduce_add_rms_norm(xs, residuals, weight, ranks: Ranks, eps: float = 1e-6, algorithm: str = "auto",
                            in_buffer: bool = False):
    """For each local rank, (y, s): s = sum of every rank's x + residual, y = RMSNorm(s) * weight. In the
    two-shot the sum is rounded to x's dtype before the residual is added (NCCL's all-reduce + add does too).
    ``in_buffer`` as in :func:`all_reduce`."""
    rows, n_rows, n_cols = _rows("all_reduce_add_rms_norm", xs, ranks)
    res, _, _ = _rows("all_reduce_add_rms_norm", residuals, ranks, "residuals")
    if not isinstance(weight, torch.Tensor) or weight.shape != (n_cols,) or weight.device != ranks.device:
        raise ValueError(f"all_reduce_add_rms_norm: weight must be a tensor of shape ({n_cols},) on {ranks.device}")
    ys, ss = [torch.empty_like(x) for x in xs], [torch.empty_like(x) for x in xs]
    if n_rows * n_cols:
        _launch(algorithm, ys, ss, rows, res, weight.contiguous(), ranks, n_rows, n_cols, eps, True, in_buffer)
    return list(zip(ys, ss))


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (course_utils/aot.py): one launch per rank,
    both algorithms, plain and fused."""
    from ..aot import dtype_name, dtypes_for, empty
    from ..kernels.allreduce import _GpuRank
    for dt in dtypes_for(info):
        for world, (m, n) in ((2, (8192, 768)), (4, (7, 4099))):
            ranks = _GpuRank(world, m * n, dt)
            x, w = empty(m, n, dtype=dt), empty(n, dtype=dt)
            for algorithm in ALGORITHMS:
                name = f"{algorithm} {dtype_name(dt)} {world} ranks {m}x{n}"
                yield (f"tuned all-reduce {name}",
                       lambda x=x, ranks=ranks, a=algorithm: all_reduce([x], ranks, a))
                yield (f"tuned all-reduce + add + rms_norm {name}",
                       lambda x=x, w=w, ranks=ranks, a=algorithm: all_reduce_add_rms_norm([x], [x], w, ranks, 1e-6, a))
