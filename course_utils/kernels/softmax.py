"""Softmax along the last dimension (chapters 5 and 6): the version ladder.

v1  ``softmax_ref``: five eager PyTorch ops (max, subtract, exp, sum, divide), five launches.
v2  ``_softmax_row_kernel``: fused, one row per program, ``BLOCK_SIZE = next_power_of_2(N)`` (on a GPU,
    16-bit rows up to 32768 with 32 warps).
v2b ``_softmax_two_block_kernel``: v2 for a row of two blocks, BLOCK_SIZE + TAIL (on a GPU, rows just
    over 16K columns: 16384 lanes plus the next power of two of the rest, one program of 32 warps).
v3  ``_softmax_persistent_kernel``: fused, a grid of SMs x occupancy looping over tiles of rows.
v4  ``_softmax_online_kernel``: rows of any length, one program per row, online max/sum over tiles
    then a normalizing pass (the recurrence of chapter 6; three passes over HBM when rows are long).
v5  ``_softmax_split_kernel``: long rows on a GPU, each row split over several programs that keep
    their chunk in registers, publish (max, sum) and wait for their siblings: one read, one write.

``softmax(x, dim=-1)`` picks the version from the row length and the device through
:func:`plan`, a pure function of a :class:`course_utils.hardware.DeviceInfo`, so what it would pick
on a T4, an A100 or an H100 can be asked on a machine with no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import env, hardware

# --------------------------------------------------------------------------- kernels


@triton.jit
def _softmax_row_kernel(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    """v2: program ``pid`` normalizes row ``pid``; the whole row is one block of registers."""
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    row_start = pid.to(tl.int64) * x_row_stride
    # -inf padding: masked lanes add exp(-inf) = 0 to the sum and never win the max.
    x = tl.load(x_ptr + row_start + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    numerator = tl.exp(x)
    y = numerator / tl.sum(numerator, axis=0)
    tl.store(y_ptr + pid.to(tl.int64) * y_row_stride + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_two_block_kernel(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr,
                              TAIL: tl.constexpr):
    """v2b: v2 with the row held as two blocks, columns [0, BLOCK_SIZE) and then TAIL more, so a row
    just past a power of two fills its lanes (17000 columns: 16384 + 1024 lanes, not 32768)."""
    pid = tl.program_id(0)
    x_row = x_ptr + pid.to(tl.int64) * x_row_stride
    y_row = y_ptr + pid.to(tl.int64) * y_row_stride
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
def _softmax_persistent_kernel(y_ptr, x_ptr, n_rows, n_cols, x_row_stride, y_row_stride, tiles_per_program,
                               BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr):
    """v3: a fixed grid; program ``pid`` takes the tiles of ROWS rows pid, pid + n_programs, ..."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_SIZE)
    col_mask = cols < n_cols
    i = 0
    while i < tiles_per_program:  # a while loop: the interpreter (numpy >= 2.4) rejects range(tensor)
        tile = pid + i * n_programs  # past the last tile, every row is masked off
        rows = tile * ROWS + tl.arange(0, ROWS)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask,
                    other=-float("inf")).to(tl.float32)
        x = x - tl.max(x, axis=1)[:, None]
        numerator = tl.exp(x)
        y = numerator * (1.0 / tl.sum(numerator, axis=1))[:, None]  # one division per row, not per element
        tl.store(y_ptr + rows64 * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        i += 1


@triton.jit
def _softmax_online_kernel(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    """v4: one program per row of any length. Pass 1 keeps a running max m and sum s per lane,
    rescaling s by exp(m_old - m_new) whenever the max grows; pass 2 writes exp(x - m) / s."""
    pid = tl.program_id(0)
    x_row = x_ptr + pid.to(tl.int64) * x_row_stride
    y_row = y_ptr + pid.to(tl.int64) * y_row_stride
    offsets = tl.arange(0, BLOCK_SIZE)
    m = tl.full((BLOCK_SIZE,), -float("inf"), tl.float32)
    s = tl.zeros((BLOCK_SIZE,), tl.float32)
    start = 0
    while start < n_cols:  # while, not range: the interpreter (numpy >= 2.4) rejects range(tensor)
        cols = start + offsets
        x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        empty = m_new == -float("inf")  # nothing finite seen yet in this lane: keep s = 0
        correction = tl.where(empty, 0.0, tl.exp(m - m_new))
        s = s * correction + tl.where(empty, 0.0, tl.exp(x - m_new))
        m = m_new
        start += BLOCK_SIZE
    # Combine the lanes: the same rescaling, once more, towards the row's max.
    row_max = tl.max(m, axis=0)
    row_sum = tl.sum(tl.where(m == -float("inf"), 0.0, s * tl.exp(m - row_max)), axis=0)
    inv_sum = 1.0 / row_sum
    start = 0
    while start < n_cols:
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = tl.exp(x - row_max) * inv_sum  # a row of all -inf gives NaN, as torch.softmax does
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        start += BLOCK_SIZE


@triton.jit
def _softmax_split_kernel(y_ptr, x_ptr, stats_ptr, sync_ptr, n_cols, x_row_stride, y_row_stride, n_chunks,
                          BLOCK_SIZE: tl.constexpr, CHUNKS: tl.constexpr):
    """v5 (GPU only): row r is split into n_chunks chunks of BLOCK_SIZE, one program each.

    Each program loads its chunk once into registers, publishes the chunk's (max, sum), waits until
    all chunks of its row have published, combines them and writes its chunk: one read and one write
    of HBM. A program takes its (row, chunk) from an atomic ticket, in the order programs really
    start, so a waiting program only ever waits for siblings that already run or can start: no
    deadlock as long as n_chunks programs fit on the GPU at once. Under the interpreter programs
    run one after another, so only n_chunks = 1 works there (the launcher never picks it).
    """
    ticket = tl.atomic_add(sync_ptr, 1)
    row = ticket // n_chunks
    chunk = ticket % n_chunks
    cols = chunk * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
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
    while arrived < n_chunks:
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
    tl.store(y_ptr + row.to(tl.int64) * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


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


def warps_for(tile_elements: int) -> int:
    """num_warps for a tile: ELEMENTS_PER_THREAD values per thread, between 4 and 16 warps."""
    return max(4, min(16, tile_elements // (32 * ELEMENTS_PER_THREAD)))


def estimate_programs_per_sm(tile_elements: int, num_warps: int, info: hardware.DeviceInfo) -> int:
    """Occupancy without compiling: registers ~ 2 fp32 values per element held + 32 of overhead.

    On a GPU, :func:`occupancy` gives the real number from the compiled kernel.
    """
    per_thread = tile_elements // (32 * num_warps)
    regs = min(255, 32 + 2 * per_thread)
    by_regs = REGISTERS_PER_SM // (regs * 32 * num_warps)
    by_warps = max_warps_per_sm(info) // num_warps
    return max(1, min(by_regs, by_warps))


def plan(n_rows: int, n_cols: int, info: hardware.DeviceInfo, itemsize: int = 4, *,
         interpreter: bool | None = None) -> Plan:
    """The version and launch parameters :func:`softmax` uses for ``n_rows`` rows of ``n_cols``.

    A pure function of the shape and the device: ask it what an sm_75 or sm_90 GPU would get.
    """
    if n_rows < 1 or n_cols < 1:
        raise ValueError(f"plan needs n_rows >= 1 and n_cols >= 1, got {n_rows} x {n_cols}")
    if interpreter is None:
        interpreter = not env.on_gpu()
    block = triton.next_power_of_2(n_cols)
    if block <= MAX_FUSED_BLOCK:
        rows = max(1, min(TILE_ELEMENTS // block, triton.next_power_of_2(n_rows)))
        tile = rows * block
        num_warps = warps_for(tile)
        n_tiles = triton.cdiv(n_rows, rows)
        if interpreter:  # every program costs Python time under the interpreter: few and long
            return Plan("persistent", block, rows, num_warps, min(n_tiles, 8))
        # Measured on an H200 (results/h200/softmax_tune.csv): one tile per program beat a grid of
        # SMs x occupancy at every N, so the grid covers all tiles.
        return Plan("persistent", block, rows, num_warps, n_tiles)
    if interpreter:
        return Plan("online", ONLINE_BLOCK, 1, 8, n_rows)
    if n_cols <= MAX_FUSED_BLOCK + (MAX_TAIL if itemsize >= 4 else MAX_TAIL_16BIT):
        return _two_block_plan(n_rows, n_cols)
    if itemsize == 2 and block <= MAX_FUSED_BLOCK_16BIT and n_cols >= MIN_LANES_USED * block:
        # A 16-bit row of 32768 in one program of 32 warps (32 values a thread): on an H100 (bf16,
        # 256 MiB) 94% of the copy bandwidth against 84% for the split kernel, whose 16-bit chunks
        # hold twice their bytes in float32 registers (results/h100-80gb-hbm3/softmax_split_explore.csv).
        return Plan("fused", block, 1, MAX_WARPS, n_rows)
    split_block, split_warps = (SPLIT_BLOCK, SPLIT_WARPS) if itemsize >= 4 else (SPLIT_BLOCK_16BIT, SPLIT_WARPS_16BIT)
    chunks = triton.cdiv(n_cols, split_block)
    if chunks > info.sms:  # every chunk of a row must fit on the GPU at once
        return Plan("online", ONLINE_BLOCK, 1, 8, n_rows)
    return Plan("split", split_block, chunks, split_warps, n_rows * chunks)


def _two_block_plan(n_rows: int, n_cols: int) -> Plan:
    """One program of 32 warps per row of 16K-24K columns, held as 16384 lanes plus the next power
    of two of the rest: at least 83% of the lanes hold columns.

    On an H100 (256 MiB, results/h100-80gb-hbm3/softmax_split_explore.csv) float32 rows of
    16500-24576 ran at 98-99% of the copy bandwidth (the split kernel: 83-97%); bfloat16 rows up to
    20000 (tails up to 4096) at 80-100%, but with a tail of 8192 only at 66-68%, less than split.
    """
    tail = triton.next_power_of_2(n_cols - MAX_FUSED_BLOCK)
    return Plan("two_block", MAX_FUSED_BLOCK, 1, MAX_WARPS, n_rows, tail)


def occupancy(compiled, num_warps: int, info: hardware.DeviceInfo, smem_per_sm: int | None = None) -> dict:
    """Programs per SM of a compiled kernel, from its registers and shared memory (GPU only)."""
    n_regs = compiled.n_regs
    smem = compiled.metadata.shared
    smem_per_sm = smem_per_sm or info.smem_per_block_bytes
    by_regs = REGISTERS_PER_SM // max(1, n_regs * 32 * num_warps)
    by_smem = smem_per_sm // smem if smem else 10**9
    by_warps = max_warps_per_sm(info) // num_warps
    return {"n_regs": n_regs, "shared_bytes": smem, "by_registers": by_regs, "by_shared_memory": by_smem,
            "by_warps": by_warps, "programs_per_sm": min(by_regs, by_smem, by_warps)}


# --------------------------------------------------------------------------- launchers

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _as_rows(x: torch.Tensor, dim: int, what: str):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{what}: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{what}: expected a tensor with at least one dimension, got a scalar")
    if x.device != env.DEVICE and not (x.device.type == env.DEVICE.type == "cuda"):
        raise ValueError(f"{what}: expected a tensor on {env.DEVICE} (mode {env.MODE}), got one on {x.device}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{what}: dim={dim} is out of range for a {x.dim()}-d tensor")
    dim = dim % x.dim()
    if dim != x.dim() - 1:
        x = x.movedim(dim, -1)
    n_cols = x.shape[-1]
    if x.numel() == 0:
        return x, None, dim
    # Rows may be strided (row_stride), but each row must be contiguous; flatten leading dims.
    if x.numel() and (x.stride(-1) != 1 and n_cols > 1):
        x = x.contiguous()
    if x.dim() == 1:
        x2 = x.unsqueeze(0)
    else:
        try:
            x2 = x.view(-1, n_cols)
        except RuntimeError:
            x2 = x.reshape(-1, n_cols)
    return x, x2, dim


def softmax(x: torch.Tensor, dim: int = -1, *, version: str | None = None, out: torch.Tensor | None = None):
    """Softmax of ``x`` along ``dim`` (any number of leading dims; strided rows are read in place).

    ``version`` forces one rung of the ladder ("fused", "two_block", "persistent", "online", "split");
    by default :func:`plan` picks it. Statistics are kept in float32 for every input dtype.
    """
    xm, x2, dim = _as_rows(x, dim, "softmax")
    if x.numel() == 0:
        return torch.empty_like(x) if out is None else out
    n_rows, n_cols = x2.shape
    info = hardware.device_info()
    p = plan(n_rows, n_cols, info, x.dtype.itemsize)
    if version is not None and version != p.version:
        p = _forced(version, n_rows, n_cols, info)
    if out is None:
        y2 = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    else:
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"softmax: out must have shape {tuple(x.shape)}, dtype {x.dtype} on {x.device}")
        if dim != x.dim() - 1 or not out.is_contiguous():
            raise ValueError("softmax: out= is supported for a contiguous output along the last dim")
        y2 = out.view(n_rows, n_cols)
    _launch(p, y2, x2)
    y = y2.view(xm.shape)
    if dim != x.dim() - 1:
        y = y.movedim(-1, dim)
    return y if out is None else out


def _forced(version: str, n_rows: int, n_cols: int, info) -> Plan:
    block = triton.next_power_of_2(n_cols)
    if version == "fused":
        if block > 4 * MAX_FUSED_BLOCK:
            raise ValueError(f"softmax version='fused' keeps a row in registers: {n_cols} columns is too long")
        return Plan("fused", block, 1, warps_for(block), n_rows)
    if version == "persistent":
        if block > 4 * MAX_FUSED_BLOCK:
            raise ValueError(f"softmax version='persistent' keeps rows in registers: {n_cols} is too long")
        rows = max(1, min(TILE_ELEMENTS // block, triton.next_power_of_2(n_rows)))
        n_warps = warps_for(rows * block)
        grid = min(triton.cdiv(n_rows, rows), info.sms * estimate_programs_per_sm(rows * block, n_warps, info))
        return Plan("persistent", block, rows, n_warps, grid)
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


def _launch(p: Plan, y2: torch.Tensor, x2: torch.Tensor) -> None:
    n_rows, n_cols = x2.shape
    xs, ys = x2.stride(0), y2.stride(0)
    if p.version == "fused":
        _softmax_row_kernel[(n_rows,)](y2, x2, n_cols, xs, ys, BLOCK_SIZE=p.BLOCK_SIZE, num_warps=p.num_warps)
    elif p.version == "two_block":
        _softmax_two_block_kernel[(n_rows,)](y2, x2, n_cols, xs, ys, BLOCK_SIZE=p.BLOCK_SIZE, TAIL=p.tail,
                                             num_warps=p.num_warps)
    elif p.version == "persistent":
        tiles_per_program = triton.cdiv(triton.cdiv(n_rows, p.ROWS), p.grid)
        _softmax_persistent_kernel[(p.grid,)](y2, x2, n_rows, n_cols, xs, ys, tiles_per_program,
                                              BLOCK_SIZE=p.BLOCK_SIZE,
                                              ROWS=p.ROWS, num_warps=p.num_warps)
    elif p.version == "online":
        _softmax_online_kernel[(n_rows,)](y2, x2, n_cols, xs, ys, BLOCK_SIZE=p.BLOCK_SIZE, num_warps=p.num_warps)
    elif p.version == "split":
        chunks = p.ROWS
        stats = torch.empty(n_rows * chunks * 2, dtype=torch.float32, device=x2.device)
        sync = torch.zeros(1 + n_rows, dtype=torch.int32, device=x2.device)
        _softmax_split_kernel[(n_rows * chunks,)](y2, x2, stats, sync, n_cols, xs, ys, chunks,
                                                  BLOCK_SIZE=p.BLOCK_SIZE, CHUNKS=triton.next_power_of_2(chunks),
                                                  num_warps=p.num_warps)
    else:  # pragma: no cover - plan() only makes the versions above
        raise ValueError(f"unknown version {p.version!r}")


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """v1: the five-op eager softmax (max, subtract, exp, sum, divide): five kernels, five passes."""
    row_max = x.amax(dim=dim, keepdim=True)
    shifted = x - row_max
    numerator = torch.exp(shifted)
    denominator = numerator.sum(dim=dim, keepdim=True)
    return numerator / denominator


def compile_cases(info):
    """The launches the compile matrix (``python -m course_utils.aot``) compiles for ``info``."""
    from ..aot import dtype_name, dtypes_for, empty
    # persistent, two_block (just over 16K), 32-warp rows (16-bit) or split, split, online
    shapes = [(64, 1000), (16, 4096), (4, 16384), (4, 17000), (4, 30000), (2, 65536), (1, 2**19)]
    forced = [("fused", (64, 1000)), ("fused", (4, 16384)), ("persistent", (64, 4096)),
              ("two_block", (4, 24576)), ("online", (2, 65536))]
    for dt in dtypes_for(info):
        for shape in shapes:
            yield f"softmax {dtype_name(dt)} {shape}", lambda s=shape, dt=dt: softmax(empty(*s, dtype=dt))
        for version, shape in forced:
            yield (f"softmax {version} {dtype_name(dt)} {shape}",
                   lambda s=shape, dt=dt, v=version: softmax(empty(*s, dtype=dt), version=v))
