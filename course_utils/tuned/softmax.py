"""Softmax, the production path ``make bench`` times: a plan per shape and device, extra kernels.
(Over 300 lines: three kernels, the plan that picks among them and its launcher belong together.)

``softmax(x, dim=-1)`` picks a version through :func:`plan`, a pure function of the shape and a
:class:`course_utils.hardware.DeviceInfo` (ask it what a T4, an A100 or an H100 would get):

- ``persistent`` (N <= 16384): tiles of several rows per program (about TILE_ELEMENTS values);
- ``two_block`` (rows just over 16K columns): 16384 lanes plus a tail block, 32 warps;
- ``fused`` (16-bit rows filling 32768 lanes): the teaching row kernel with 32 warps;
- ``split`` (long rows, GPU): a row over several programs that exchange their (max, sum);
- ``online`` (anything else, and long rows under the interpreter): the teaching online kernel.

Vector loads: Triton sees that an integer argument is a multiple of 16, not of 8, so rows of 1000
load one element per instruction (sm_90 PTX: results/ptx/softmax_ptx.csv). The kernels take n_cols
and row strides in units of ALIGN (the largest power of two <= 16 dividing all three) and multiply by
the constexpr inside: 16-byte loads again. H100, one run of interleaved rounds: bf16 rows of 1000
from 91% to 101% of the copy bandwidth (results/h100-80gb-hbm3/softmax_dips_explore.csv).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import env, hardware
from ..kernels.softmax import as_rows, softmax_online_kernel, softmax_row_kernel


@triton.jit
def tile_rows(tile, ROWS: tl.constexpr):
    """The rows of tile ``tile``, in int64: tile * ROWS passes 2^31 with more than 2^31 rows
    (a (2_200_000_000, 1) input has 537_110 tiles of 4096 rows)."""
    return tl.cast(tile, tl.int64) * ROWS + tl.arange(0, ROWS)  # tl.cast: under the interpreter tile is an int


@triton.jit
def softmax_persistent_kernel(y_ptr, x_ptr, n_rows, n_cols_a, x_stride_a, y_stride_a, n_tiles,
                              BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, ALIGN: tl.constexpr,
                              NUM_STAGES: tl.constexpr):
    """Tiles of ROWS rows; program ``pid`` takes tiles pid, pid + n_programs, ... (one each when the
    grid covers every tile). ``for ... in tl.range``: pipelined when NUM_STAGES > 1 (a while loop
    never is)."""
    pid = tl.program_id(0)
    n_cols, x_row_stride, y_row_stride = n_cols_a * ALIGN, x_stride_a * ALIGN, y_stride_a * ALIGN
    cols = tl.arange(0, BLOCK_SIZE)
    col_mask = cols < n_cols
    for tile in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=NUM_STAGES):
        rows = tile_rows(tile, ROWS)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask,
                    other=-float("inf")).to(tl.float32)
        x = x - tl.max(x, axis=1)[:, None]
        numerator = tl.exp(x)
        y = numerator * (1.0 / tl.sum(numerator, axis=1))[:, None]  # one division per row, not per element
        tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_two_block_kernel(y_ptr, x_ptr, n_cols_a, x_stride_a, y_stride_a, BLOCK_SIZE: tl.constexpr,
                             TAIL: tl.constexpr, ALIGN: tl.constexpr):
    """v2 with the row held as two blocks, columns [0, BLOCK_SIZE) and then TAIL more, so a row
    just past a power of two fills its lanes (17000 columns: 16384 + 1024 lanes, not 32768)."""
    pid = tl.program_id(0)
    n_cols = n_cols_a * ALIGN
    x_row = x_ptr + pid.to(tl.int64) * x_stride_a * ALIGN
    y_row = y_ptr + pid.to(tl.int64) * y_stride_a * ALIGN
    head = tl.arange(0, BLOCK_SIZE)  # all inside the row: n_cols > BLOCK_SIZE
    tail = BLOCK_SIZE + tl.arange(0, TAIL)
    tail_mask = tail < n_cols
    a = tl.load(x_row + head).to(tl.float32)
    b = tl.load(x_row + tail, mask=tail_mask, other=-float("inf")).to(tl.float32)
    row_max = tl.maximum(tl.max(a, axis=0), tl.max(b, axis=0))
    ea = tl.exp(a - row_max)
    eb = tl.exp(b - row_max)
    inv_sum = 1.0 / (tl.sum(ea, axis=0) + tl.sum(eb, axis=0))
    tl.store(y_row + head, (ea * inv_sum).to(y_ptr.dtype.element_ty))
    tl.store(y_row + tail, (eb * inv_sum).to(y_ptr.dtype.element_ty), mask=tail_mask)


@triton.jit
def softmax_split_kernel(y_ptr, x_ptr, stats_ptr, sync_ptr, n_cols_a, x_stride_a, y_stride_a, n_chunks,
                         BLOCK_SIZE: tl.constexpr, CHUNKS: tl.constexpr, ALIGN: tl.constexpr):
    """GPU only: row r is split into n_chunks chunks of BLOCK_SIZE, one program each.

    Each program loads its chunk once into registers, publishes the chunk's (max, sum), waits until
    all chunks of its row have published, combines them and writes its chunk: one read and one write
    of HBM. A program takes its (row, chunk) from an atomic ticket, in the order programs really
    start, so it only waits for siblings that already run or can start: no deadlock while n_chunks
    programs fit on the GPU at once. Under the interpreter programs run one after another, so only
    n_chunks = 1 works there (the plan never picks it).
    """
    ticket = tl.atomic_add(sync_ptr, 1)
    row = ticket // n_chunks
    chunk = ticket % n_chunks
    n_cols = n_cols_a * ALIGN
    cols = chunk * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride_a * ALIGN + cols, mask=mask, other=-float("inf")).to(tl.float32)
    chunk_max = tl.max(x, axis=0)
    safe_max = tl.where(chunk_max == -float("inf"), 0.0, chunk_max)
    e = tl.exp(x - safe_max)  # kept in registers: the chunk is never read again
    chunk_sum = tl.sum(e, axis=0)
    slot = stats_ptr + (row.to(tl.int64) * n_chunks + chunk) * 2
    tl.store(slot, chunk_max)
    tl.store(slot + 1, chunk_sum)
    tl.debug_barrier()
    tl.atomic_add(sync_ptr + 1 + row, 1, sem="release")
    arrived = tl.atomic_add(sync_ptr + 1 + row, 0, sem="acquire")
    while arrived < n_chunks:  # a spin-wait on the siblings, not a loop over data: nothing to pipeline
        arrived = tl.atomic_add(sync_ptr + 1 + row, 0, sem="acquire")
    tl.debug_barrier()
    c = tl.arange(0, CHUNKS)
    c_mask = c < n_chunks
    base = stats_ptr + row.to(tl.int64) * n_chunks * 2
    maxes = tl.load(base + c * 2, mask=c_mask, other=-float("inf"), volatile=True)
    sums = tl.load(base + c * 2 + 1, mask=c_mask, other=0.0, volatile=True)
    row_max = tl.max(maxes, axis=0)
    row_sum = tl.sum(tl.where(maxes == -float("inf"), 0.0, sums * tl.exp(maxes - row_max)), axis=0)
    y = e * (tl.exp(safe_max - row_max) / row_sum)  # all -inf row: 0 * inf = NaN, as torch
    tl.store(y_ptr + row.to(tl.int64) * y_stride_a * ALIGN + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- choosing a version

# Tunables (chosen from measurements on an H100/H200, see benchmarks/softmax.py and results/).
MAX_FUSED_BLOCK = 16384      # longest row (next power of two) that one program keeps in registers
MAX_FUSED_BLOCK_16BIT = 32768  # the same for 16-bit rows on a GPU, with MAX_WARPS warps
MAX_WARPS = 32               # 1024 threads: the most one program can have
MAX_TAIL = 8192              # two_block: the longest second block (float32)
MAX_TAIL_16BIT = 4096        # the same for 16-bit rows
TILE_ELEMENTS = 4096         # persistent kernel: rows per tile = TILE_ELEMENTS // BLOCK_SIZE
ELEMENTS_PER_THREAD = 32     # num_warps = tile / (32 threads x 32 elements), between 4 and 16
SPLIT_BLOCK = 8192           # chunk length of the split long-row kernel (fp32)
SPLIT_WARPS = 8
SPLIT_BLOCK_16BIT = 8192     # the same for fp16/bf16 inputs
SPLIT_WARPS_16BIT = 4
ONLINE_BLOCK = 4096          # tile length of the online kernel
MIN_LANES_USED = 0.75        # a 16-bit row in 32 warps: at least this share of its lanes on real columns
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64        # sm_80/sm_90 (48 on sm_86/89, 32 on sm_75)
MAX_ALIGN = 16               # elements; Triton's own specialization sees multiples of 16
PIPELINE_STAGES = 3          # num_stages of the persistent loop when a program takes several tiles
VECTOR_HINT = True           # pass n_cols and strides in units of ALIGN (False: as before, for measuring)


def max_warps_per_sm(info: hardware.DeviceInfo) -> int:
    return {75: 32, 86: 48, 89: 48}.get(info.arch, MAX_WARPS_PER_SM)


@dataclass(frozen=True)
class Plan:
    """What :func:`softmax` launches: the version and its meta-parameters."""

    version: str      # "fused" | "two_block" | "persistent" | "online" | "split"
    BLOCK_SIZE: int
    ROWS: int = 1     # rows per tile (persistent) ; chunks per row (split)
    num_warps: int = 4
    grid: int = 1
    tail: int = 0     # two_block: the second block's lanes
    stages: int = 1   # persistent: num_stages of its tile loop (1 when each program takes one tile)


def warps_for(tile_elements: int) -> int:
    """num_warps for a tile: ELEMENTS_PER_THREAD values per thread, between 4 and 16 warps."""
    return max(4, min(16, tile_elements // (32 * ELEMENTS_PER_THREAD)))


def estimate_programs_per_sm(tile_elements: int, num_warps: int, info: hardware.DeviceInfo) -> int:
    """Occupancy without compiling: registers ~ 2 fp32 values per element held + 32 of overhead."""
    regs = min(255, 32 + 2 * (tile_elements // (32 * num_warps)))
    by_regs = REGISTERS_PER_SM // (regs * 32 * num_warps)
    return max(1, min(by_regs, max_warps_per_sm(info) // num_warps))


def plan(n_rows: int, n_cols: int, info: hardware.DeviceInfo, itemsize: int = 4, *,
         interpreter: bool | None = None) -> Plan:
    """The version and launch parameters :func:`softmax` uses for ``n_rows`` rows of ``n_cols``."""
    if n_rows < 1 or n_cols < 1:
        raise ValueError(f"plan needs n_rows >= 1 and n_cols >= 1, got {n_rows} x {n_cols}")
    if interpreter is None:
        interpreter = not env.on_gpu()
    block = triton.next_power_of_2(n_cols)
    if block <= MAX_FUSED_BLOCK:
        rows = max(1, min(TILE_ELEMENTS // block, triton.next_power_of_2(n_rows)))
        num_warps, n_tiles = warps_for(rows * block), triton.cdiv(n_rows, rows)
        if interpreter:  # every program costs Python time under the interpreter: few and long
            return Plan("persistent", block, rows, num_warps, min(n_tiles, 8))
        # One tile per program beat a grid of SMs x occupancy at every N on an H200
        # (results/h200/softmax_tune.csv) and on an H100 with the tile loop pipelined or not (99-101%
        # of copy against 90-96%: results/h100-80gb-hbm3/softmax_persistent_explore.csv). So the grid
        # covers all tiles and the loop runs once (1 stage: nothing to overlap).
        return Plan("persistent", block, rows, num_warps, n_tiles)
    if interpreter:
        return Plan("online", ONLINE_BLOCK, 1, 8, n_rows)
    if n_cols <= MAX_FUSED_BLOCK + (MAX_TAIL if itemsize >= 4 else MAX_TAIL_16BIT):
        return _two_block_plan(n_rows, n_cols)
    if itemsize == 2 and block <= MAX_FUSED_BLOCK_16BIT and n_cols >= MIN_LANES_USED * block:
        # A 16-bit row of 32768 in one program of 32 warps: on an H100 (bf16, 256 MiB) 94% of the copy
        # bandwidth against 84% for split (results/h100-80gb-hbm3/softmax_split_explore.csv).
        return Plan("fused", block, 1, MAX_WARPS, n_rows)
    split_block, split_warps = (SPLIT_BLOCK, SPLIT_WARPS) if itemsize >= 4 else (SPLIT_BLOCK_16BIT, SPLIT_WARPS_16BIT)
    chunks = triton.cdiv(n_cols, split_block)
    if chunks > info.sms:  # every chunk of a row must fit on the GPU at once
        return Plan("online", ONLINE_BLOCK, 1, 8, n_rows)
    return Plan("split", split_block, chunks, split_warps, n_rows * chunks)


def _two_block_plan(n_rows: int, n_cols: int) -> Plan:
    """32 warps per row of 16K-24K columns (H100: fp32 98-99% of copy, bf16 tails <= 4096 80-100%)."""
    return Plan("two_block", MAX_FUSED_BLOCK, 1, MAX_WARPS, n_rows, triton.next_power_of_2(n_cols - MAX_FUSED_BLOCK))


def persistent_grid_plan(n_rows: int, n_cols: int, info: hardware.DeviceInfo, stages: int = PIPELINE_STAGES,
                         rows: int | None = None, num_warps: int | None = None) -> Plan:
    """Chapter 5's experiment: the plan's tiles on a grid of SMs x programs per SM, each program
    looping over tiles in a ``tl.range`` loop software-pipelined over ``stages`` stages."""
    block = triton.next_power_of_2(n_cols)
    rows = rows or max(1, min(TILE_ELEMENTS // block, triton.next_power_of_2(n_rows)))
    num_warps = num_warps or warps_for(rows * block)
    grid = min(triton.cdiv(n_rows, rows), info.sms * estimate_programs_per_sm(rows * block, num_warps, info))
    return Plan("persistent", block, rows, num_warps, grid, stages=stages)


def occupancy(compiled, num_warps: int, info: hardware.DeviceInfo, smem_per_sm: int | None = None) -> dict:
    """Programs per SM of a compiled kernel, from its registers and shared memory (GPU only)."""
    n_regs, smem = compiled.n_regs, compiled.metadata.shared
    by_regs = REGISTERS_PER_SM // max(1, n_regs * 32 * num_warps)
    by_smem = (smem_per_sm or info.smem_per_block_bytes) // smem if smem else 10**9
    by_warps = max_warps_per_sm(info) // num_warps
    return {"n_regs": n_regs, "shared_bytes": smem, "by_registers": by_regs, "by_shared_memory": by_smem,
            "by_warps": by_warps, "programs_per_sm": min(by_regs, by_smem, by_warps)}


# --------------------------------------------------------------------------- launchers


def alignment(n_cols: int, *strides: int) -> int:
    """The largest power of two <= MAX_ALIGN dividing n_cols and every row stride (1 without the hint)."""
    g = math.gcd(n_cols, *strides)
    return min(MAX_ALIGN, g & -g) if VECTOR_HINT and g else 1


def softmax(x: torch.Tensor, dim: int = -1, *, version: str | None = None, out: torch.Tensor | None = None):
    """Softmax of ``x`` along ``dim`` (any number of leading dims; strided rows are read in place).

    ``version`` forces one version ("fused", "two_block", "persistent", "online", "split"); by
    default :func:`plan` picks it. Statistics are kept in float32 for every input dtype.
    """
    if isinstance(x, torch.Tensor) and x.dim() and not -x.dim() <= dim < x.dim():
        raise ValueError(f"softmax: dim={dim} is out of range for a {x.dim()}-d tensor")
    moved = isinstance(x, torch.Tensor) and x.dim() and dim % x.dim() != x.dim() - 1
    xm = x.movedim(dim, -1) if moved else x
    x2 = as_rows(xm, "softmax")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"softmax: out must have shape {tuple(x.shape)}, dtype {x.dtype} on {x.device}")
    if out is not None and (moved or not out.is_contiguous()):
        raise ValueError("softmax: out= is supported for a contiguous output along the last dim")
    if x.numel() == 0:
        return torch.empty_like(x) if out is None else out
    n_rows, n_cols = x2.shape
    info = hardware.device_info()
    p = plan(n_rows, n_cols, info, x.dtype.itemsize)
    if version is not None and version != p.version:
        p = _forced(version, n_rows, n_cols, info)
    y2 = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device) if out is None else out.view(n_rows, n_cols)
    launch(p, y2, x2)
    if out is not None:
        return out
    y = y2.view(xm.shape)
    return y.movedim(-1, dim) if moved else y


def _forced(version: str, n_rows: int, n_cols: int, info) -> Plan:
    block = triton.next_power_of_2(n_cols)
    if version in ("fused", "persistent") and block > 4 * MAX_FUSED_BLOCK:
        raise ValueError(f"softmax version={version!r} keeps rows in registers: {n_cols} columns is too long")
    if version == "fused":
        return Plan("fused", block, 1, warps_for(block), n_rows)
    if version == "persistent":
        return persistent_grid_plan(n_rows, n_cols, info)
    if version == "two_block":
        if not MAX_FUSED_BLOCK < n_cols <= 2 * MAX_FUSED_BLOCK:
            raise ValueError(f"softmax version='two_block' holds rows of {MAX_FUSED_BLOCK + 1} to "
                             f"{2 * MAX_FUSED_BLOCK} columns, got {n_cols}")
        return _two_block_plan(n_rows, n_cols)
    if version == "online":
        return Plan("online", ONLINE_BLOCK, 1, 8, n_rows)
    if version == "split":
        chunks = triton.cdiv(n_cols, SPLIT_BLOCK)
        if not env.on_gpu() and chunks > 1:
            raise ValueError("softmax version='split' needs a GPU for rows longer than one chunk "
                             f"({SPLIT_BLOCK}): its programs wait for each other")
        if chunks > info.sms:
            raise ValueError(f"softmax version='split': {chunks} chunks per row exceed the {info.sms} SMs")
        return Plan("split", SPLIT_BLOCK, chunks, SPLIT_WARPS, n_rows * chunks)
    raise ValueError(f"unknown softmax version {version!r}: expected fused, two_block, persistent, online or split")


def launch(p: Plan, y2: torch.Tensor, x2: torch.Tensor) -> None:
    """Launch plan ``p`` on rows ``x2`` into ``y2`` (both 2-D, rows contiguous)."""
    n_rows, n_cols = x2.shape
    xs, ys = x2.stride(0), y2.stride(0)
    a = alignment(n_cols, xs, ys)
    if p.version == "fused":
        softmax_row_kernel[(n_rows,)](y2, x2, n_cols, xs, ys, BLOCK_SIZE=p.BLOCK_SIZE, num_warps=p.num_warps)
    elif p.version == "two_block":
        softmax_two_block_kernel[(n_rows,)](y2, x2, n_cols // a, xs // a, ys // a, BLOCK_SIZE=p.BLOCK_SIZE,
                                            TAIL=p.tail, ALIGN=a, num_warps=p.num_warps)
    elif p.version == "persistent":
        softmax_persistent_kernel[(p.grid,)](y2, x2, n_rows, n_cols // a, xs // a, ys // a,
                                             triton.cdiv(n_rows, p.ROWS), BLOCK_SIZE=p.BLOCK_SIZE, ROWS=p.ROWS,
                                             ALIGN=a, NUM_STAGES=p.stages, num_warps=p.num_warps)
    elif p.version == "online":
        softmax_online_kernel[(n_rows,)](y2, x2, n_cols, xs, ys, BLOCK_SIZE=p.BLOCK_SIZE, num_warps=p.num_warps)
    elif p.version == "split":
        chunks = p.ROWS
        stats = torch.empty(n_rows * chunks * 2, dtype=torch.float32, device=x2.device)
        sync = torch.zeros(1 + n_rows, dtype=torch.int32, device=x2.device)
        softmax_split_kernel[(n_rows * chunks,)](y2, x2, stats, sync, n_cols // a, xs // a, ys // a, chunks,
                                                 BLOCK_SIZE=p.BLOCK_SIZE, CHUNKS=triton.next_power_of_2(chunks),
                                                 ALIGN=a, num_warps=p.num_warps)
    else:
        raise ValueError(f"unknown version {p.version!r}")


def compile_cases(info):
    """What ``python -m course_utils.aot`` compiles: every version, dtype, ALIGN 8 (1000), > 2^31 rows."""
    from ..aot import dtype_name, dtypes_for, empty
    # persistent, two_block (just over 16K), 32-warp rows (16-bit) or split, split, online
    shapes = [(64, 1000), (16, 4096), (4, 16384), (4, 17000), (4, 30000), (2, 65536), (1, 2**19)]
    forced = [("fused", (64, 1000)), ("fused", (4, 16384)), ("persistent", (64, 4096)), ("persistent", (64, 1000)),
              ("two_block", (4, 24576)), ("online", (2, 65536))]
    for dt in dtypes_for(info):
        for shape in shapes:
            yield f"softmax {dtype_name(dt)} {shape}", lambda s=shape, dt=dt: softmax(empty(*s, dtype=dt))
        for version, shape in forced:
            yield (f"softmax {version} {dtype_name(dt)} {shape}",
                   lambda s=shape, dt=dt, v=version: softmax(empty(*s, dtype=dt), version=v))
    for stages in (1, PIPELINE_STAGES):  # chapter 5's persistent grid, its tile loop pipelined or not
        for dt in dtypes_for(info):
            yield (f"softmax persistent grid stages={stages} {dtype_name(dt)}",
                   lambda dt=dt, st=stages: launch(persistent_grid_plan(4096, 1000, info, st),
                                                   empty(4096, 1000, dtype=dt), empty(4096, 1000, dtype=dt)))
    yield "softmax 2^31+ rows", lambda: softmax(empty(2_200_000_000, 1))
