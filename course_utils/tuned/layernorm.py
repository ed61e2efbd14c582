"""LayerNorm and RMSNorm, the shelf ``make bench`` times (chapter 10, v4 of ``kernels/layernorm.py``).

Forward: a tile of ROWS rows x BLOCK_N columns per program (several rows per program when rows are
short), statistics in float32, mean/rstd stored only when a backward pass will need them.
Backward: one kernel reads x and dy once, writes dx, and sums dy * x_hat and dy over its rows into
one float32 partial row per program; ``column_sum_kernel`` adds the partials up (deterministic).
``atomic=True`` adds each program's sums into one float32 row with ``tl.atomic_add`` instead: one
launch fewer, but the order of the additions changes from run to run (the notebook measures both).
Tiles, warps and programs per SM come from :func:`plan`, tuned on an H100 (benchmarks/layernorm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import env, hardware
from ..kernels.layernorm import as_rows, column_sum


@triton.jit
def _norm_fwd_kernel(y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_rows, n_cols, x_row_stride, y_row_stride,
                     eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     STATS: tl.constexpr):
    """Rows pid * ROWS + [0, ROWS): y = (x - mean) * rstd * w + b (RMSNorm: x * rstd * w)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / n_cols
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64 * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STATS:
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        if not RMS:
            tl.store(mean_ptr + rows, mean, mask=row_mask)


@triton.jit
def _norm_bwd_kernel(dx_ptr, dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, n_rows, n_cols,
                     x_row_stride, dy_row_stride, dx_row_stride, rows_per_program, BLOCK_N: tl.constexpr,
                     ROWS: tl.constexpr, RMS: tl.constexpr, ATOMIC: tl.constexpr):
    """dx for the rows [pid * rows_per_program, ...) in tiles of ROWS, and their sums of dy * x_hat
    and dy: stored as partial row pid (ATOMIC=False) or added into dw/db with atomics."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    start = first
    while start < end:
        rows = start + tl.arange(0, ROWS)
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        if RMS:
            x_hat = x * rstd[:, None]
        else:
            x_hat = (x - tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]) * rstd[:, None]
        g = dy * w[None, :]
        c1 = tl.sum(g * x_hat, axis=1) / n_cols
        if RMS:
            dx = (g - x_hat * c1[:, None]) * rstd[:, None]
        else:
            dx = (g - x_hat * c1[:, None] - (tl.sum(g, axis=1) / n_cols)[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * x_hat, axis=0)
        db += tl.sum(dy, axis=0)
        start += ROWS
    if ATOMIC:
        tl.atomic_add(dw_ptr + cols, dw, mask=col_mask)
        if not RMS:
            tl.atomic_add(db_ptr + cols, db, mask=col_mask)
    else:
        out = pid.to(tl.int64) * n_cols + cols
        tl.store(dw_ptr + out, dw, mask=col_mask)
        if not RMS:
            tl.store(db_ptr + out, db, mask=col_mask)


@triton.jit
def _norm_bwd_chunked_kernel(dx_ptr, dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, dw_out_ptr, db_out_ptr,
                             n_rows, n_cols, x_row_stride, dy_row_stride, dx_row_stride, rows_per_program,
                             CHUNK: tl.constexpr, RMS: tl.constexpr, ATOMIC: tl.constexpr):
    """Long rows (more than registers hold next to two accumulators of a row): one row at a time in
    chunks of CHUNK columns. Pass 1 sums g * x_hat and g; pass 2 reads the row again (from L2: one
    row per program is in flight), writes dx and adds dy * x_hat, dy into this program's partial row
    of dw/db, which stays in L2 (it is written on the first row, read and rewritten on the next).
    ATOMIC: the partial row is then added into dw_out/db_out with atomics."""
    pid = tl.program_id(0)
    offsets = tl.arange(0, CHUNK)
    part = pid.to(tl.int64) * n_cols
    first = pid * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    row = first
    while row < end:
        r64 = row.to(tl.int64)
        rstd = tl.load(rstd_ptr + row)
        mean = 0.0 if RMS else tl.load(mean_ptr + row)
        acc1 = tl.zeros((CHUNK,), dtype=tl.float32)
        acc2 = tl.zeros((CHUNK,), dtype=tl.float32)
        start = 0
        while start < n_cols:  # pass 1: c1 = mean(g * x_hat), c2 = mean(g)
            cols = start + offsets
            mask = cols < n_cols
            x = tl.load(x_ptr + r64 * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(dy_ptr + r64 * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32) * \
                tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            acc1 += g * (x - mean) * rstd
            acc2 += g
            start += CHUNK
        c1 = tl.sum(acc1, axis=0) / n_cols
        c2 = 0.0 if RMS else tl.sum(acc2, axis=0) / n_cols
        keep = row > first  # the first row writes the partial row, the next ones add to it
        start = 0
        while start < n_cols:  # pass 2: dx, and the partial sums of dw and db
            cols = start + offsets
            mask = cols < n_cols
            x = tl.load(x_ptr + r64 * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + r64 * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            x_hat = (x - mean) * rstd
            g = dy * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            dx = (g - x_hat * c1 - c2) * rstd
            tl.store(dx_ptr + r64 * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw = tl.load(dw_ptr + part + cols, mask=mask & keep, other=0.0) + dy * x_hat
            tl.store(dw_ptr + part + cols, dw, mask=mask)
            if not RMS:
                db = tl.load(db_ptr + part + cols, mask=mask & keep, other=0.0) + dy
                tl.store(db_ptr + part + cols, db, mask=mask)
            start += CHUNK
        tl.debug_barrier()  # this row's partial sums are stored before any thread reads them again
        row += 1
    if ATOMIC:
        start = 0
        while start < n_cols:
            cols = start + offsets
            mask = (cols < n_cols) & (first < end)
            tl.atomic_add(dw_out_ptr + cols, tl.load(dw_ptr + part + cols, mask=mask, other=0.0), mask=mask)
            if not RMS:
                tl.atomic_add(db_out_ptr + cols, tl.load(db_ptr + part + cols, mask=mask, other=0.0), mask=mask)
            start += CHUNK


# --------------------------------------------------------------------------- plans

MAX_BLOCK_N = 65536
# Measured on an H100 (results/h100-80gb-hbm3/layernorm_tune.csv, 256 MiB inputs), used on sm_90:
# (BLOCK_N, bytes per element) -> (tile elements, num_warps) of the forward kernel, and
# -> (tile elements, num_warps, programs per SM) of the backward tile kernel.
FWD_TILES: dict[tuple[int, int], tuple[int, int]] = {
    (1024, 2): (4096, 4), (2048, 2): (4096, 8), (4096, 2): (4096, 8), (8192, 2): (8192, 16), (16384, 2): (16384, 16),
    (1024, 4): (4096, 8), (2048, 4): (4096, 8), (4096, 4): (8192, 8), (8192, 4): (8192, 32), (16384, 4): (16384, 32)}
BWD_TILES: dict[tuple[int, int], tuple[int, int, int]] = {
    (1024, 2): (2048, 4, 4), (2048, 2): (2048, 4, 4), (4096, 2): (4096, 8, 2), (8192, 2): (8192, 16, 2),
    (1024, 4): (4096, 8, 2), (2048, 4): (4096, 8, 2), (4096, 4): (8192, 16, 2), (8192, 4): (8192, 32, 2)}
TILE_ELEMENTS = 4096          # elsewhere: rows per program = this // BLOCK_N
ELEMENTS_PER_THREAD = 16      # elsewhere: num_warps = tile / (32 x this), between 4 and 32
BWD_PROGRAMS_PER_SM = 2       # backward grid: SMs x this programs, each summing a contiguous run of rows
CHUNKED_FROM = 8192           # BLOCK_N from which the chunked backward is a candidate (the only one above)
CHUNKED = ((2048, 4, 1), (4096, 8, 1), (2048, 4, 2), (4096, 8, 2))  # (CHUNK, num_warps, programs per SM)
CHOICE_ROUNDS = 3
_BEST: dict = {}


@dataclass(frozen=True)
class Plan:
    """A launch: the version ("tiles" or "chunked"), BLOCK_N columns (CHUNK for "chunked"), ROWS rows
    per tile, num_warps, grid programs, and (backward) the rows each program sums."""

    version: str
    BLOCK_N: int
    ROWS: int
    num_warps: int
    grid: int
    rows_per_program: int = 0


def _warps(tile: int) -> int:
    return max(4, min(32, tile // (32 * ELEMENTS_PER_THREAD)))


def _rows(n_rows: int, block: int, tile: int) -> int:
    return max(1, min(tile // block, triton.next_power_of_2(n_rows)))


def _block(n_cols: int) -> int:
    block = triton.next_power_of_2(n_cols)
    if block > MAX_BLOCK_N:
        raise ValueError(f"layer_norm/rms_norm keep a row in registers: at most {MAX_BLOCK_N} columns, got {n_cols}")
    return block


def plan_forward(n_rows: int, n_cols: int, itemsize: int, info: hardware.DeviceInfo, *,
                 interpreter: bool | None = None) -> Plan:
    """Tile and warps of the forward kernel: a pure function of the shape and the device."""
    block = _block(n_cols)
    interpreter = (not env.on_gpu()) if interpreter is None else interpreter
    tile, warps = FWD_TILES.get((block, itemsize), (TILE_ELEMENTS, None)) if info.arch >= 90 else (TILE_ELEMENTS, None)
    rows = _rows(n_rows, block, 16384 if interpreter else tile)
    return Plan("tiles", block, rows, warps or _warps(rows * block), triton.cdiv(n_rows, rows))


def _grid(n_rows: int, rows: int, programs: int) -> tuple[int, int]:
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, programs), rows) * rows
    return triton.cdiv(n_rows, rows_per_program), rows_per_program


def backward_candidates(n_rows: int, n_cols: int, itemsize: int, info: hardware.DeviceInfo, *,
                        interpreter: bool | None = None) -> list[Plan]:
    """The backward plans worth trying, best guess first (on a GPU :func:`_backward` times them once
    per shape and keeps the fastest; under the interpreter the first is used)."""
    block = _block(n_cols)
    interpreter = (not env.on_gpu()) if interpreter is None else interpreter
    if interpreter:
        rows = _rows(n_rows, block, 16384)
        return [Plan("tiles", block, rows, 4, *_grid(n_rows, rows, 4))]
    cands = []
    if block <= CHUNKED_FROM:
        default = (TILE_ELEMENTS, None, BWD_PROGRAMS_PER_SM)
        tile, warps, per_sm = BWD_TILES.get((block, itemsize), default) if info.arch >= 90 else default
        rows = _rows(n_rows, block, tile)
        for k in dict.fromkeys((per_sm, 1)):
            cands.append(Plan("tiles", block, rows, warps or _warps(rows * block), *_grid(n_rows, rows, info.sms * k)))
    if block >= CHUNKED_FROM:
        for chunk, warps, per_sm in CHUNKED:
            cands.append(Plan("chunked", min(chunk, block), 1, warps, *_grid(n_rows, 1, info.sms * per_sm)))
    return cands


# --------------------------------------------------------------------------- ops


def _forward(x, weight, bias, eps, rms: bool, stats: bool, what: str):
    x2 = as_rows(x, weight, what, ("bias", bias))
    if bias is not None and bias.shape != weight.shape:
        raise ValueError(f"{what}: bias must have the shape of weight {tuple(weight.shape)}, got {tuple(bias.shape)}")
    n_rows, n_cols = x2.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device) if stats else None
    mean = torch.empty_like(rstd) if stats and not rms else None
    if x.numel():
        p = plan_forward(n_rows, n_cols, x.element_size(), hardware.device_info())
        dummy = y  # pointers the kernel never touches (no bias, no statistics)
        _norm_fwd_kernel[(p.grid,)](y, x2, weight, dummy if bias is None else bias, dummy if mean is None else mean,
                                    dummy if rstd is None else rstd, n_rows, n_cols, x2.stride(0), y.stride(0), eps,
                                    BLOCK_N=p.BLOCK_N, ROWS=p.ROWS, RMS=rms, HAS_BIAS=bias is not None,
                                    STATS=stats, num_warps=p.num_warps)
    return y.view(x.shape), mean, rstd


def _launch_backward(p: Plan, dx, dy2, x2, weight, mean, rstd, rms: bool, atomic: bool):
    """One backward launch of plan ``p``; returns (dw, db) in float32 (db is None for RMSNorm)."""
    n_rows, n_cols = x2.shape
    dev = x2.device
    strides = (x2.stride(0), dy2.stride(0), dx.stride(0))
    if p.version == "tiles":
        shape = (n_cols,) if atomic else (p.grid, n_cols)
        dw = (torch.zeros if atomic else torch.empty)(shape, dtype=torch.float32, device=dev)
        db = dw if rms else (torch.zeros_like(dw) if atomic else torch.empty_like(dw))
        _norm_bwd_kernel[(p.grid,)](dx, dy2, x2, weight, rstd if rms else mean, rstd, dw, db, n_rows, n_cols,
                                    *strides, p.rows_per_program, BLOCK_N=p.BLOCK_N, ROWS=p.ROWS, RMS=rms,
                                    ATOMIC=atomic, num_warps=p.num_warps)
        return dw, None if rms else db
    dw = torch.empty((p.grid, n_cols), dtype=torch.float32, device=dev)
    db = dw if rms else torch.empty_like(dw)
    dw_out = torch.zeros(n_cols, dtype=torch.float32, device=dev) if atomic else dw
    db_out = dw_out if rms or not atomic else torch.zeros_like(dw_out)
    _norm_bwd_chunked_kernel[(p.grid,)](dx, dy2, x2, weight, rstd if rms else mean, rstd, dw, db, dw_out, db_out,
                                        n_rows, n_cols, *strides, p.rows_per_program, CHUNK=p.BLOCK_N, RMS=rms,
                                        ATOMIC=atomic, num_warps=p.num_warps)
    return (dw_out, None if rms else db_out) if atomic else (dw, None if rms else db)


def _choose(cands: list[Plan], key, launch) -> Plan:
    """Time each candidate once per ``key`` (GPU only) in interleaved rounds; keep the fastest."""
    if len(cands) == 1 or not env.on_gpu():
        return cands[0]
    if key not in _BEST:
        from triton.testing import do_bench
        times: dict = {}
        for _ in range(CHOICE_ROUNDS):  # a clock drift during the choice reaches every candidate
            for c in cands:
                t = do_bench(lambda c=c: launch(c), warmup=3, rep=10, return_mode="median")
                times[c] = min(t, times.get(c, t))
        _BEST[key] = min(times, key=times.get)
    return _BEST[key]


def _backward(dy, x, weight, mean, rstd, rms: bool, atomic: bool, what: str, plan: Plan | None = None):
    x2 = as_rows(x, weight, what, ("dy", dy))
    if dy.shape != x.shape:
        raise ValueError(f"{what}: dy must have the shape of x {tuple(x.shape)}, got {tuple(dy.shape)}")
    dy2 = as_rows(dy, None, what)
    n_rows, n_cols = x2.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        zero = torch.zeros_like(weight)
        return dx.view(x.shape), zero, None if rms else zero.clone()
    if plan is None:
        info = hardware.device_info()
        cands = backward_candidates(n_rows, n_cols, x.element_size(), info)
        key = (n_rows, n_cols, x.dtype, weight.dtype, rms, atomic, str(x.device))
        plan = _choose(cands, key, lambda p: _launch_backward(p, dx, dy2, x2, weight, mean, rstd, rms, atomic))
    dw, db = _launch_backward(plan, dx, dy2, x2, weight, mean, rstd, rms, atomic)
    if atomic:
        return dx.view(x.shape), dw.to(weight.dtype), None if rms else db.to(weight.dtype)
    return dx.view(x.shape), column_sum(dw, weight.dtype), None if rms else column_sum(db, weight.dtype)


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """LayerNorm of ``x`` over its last dim (one launch; ``bias`` may be None). No autograd: see
    ``layer_norm_autograd`` in :mod:`course_utils.tuned.layernorm_autograd`."""
    return _forward(x, weight, bias, eps, False, False, "layer_norm")[0]


def rms_norm(x, weight, eps: float = 1e-6):
    """RMSNorm of ``x`` over its last dim (one launch). No autograd: see ``rms_norm_autograd``."""
    return _forward(x, weight, None, eps, True, False, "rms_norm")[0]


def layer_norm_backward(dy, x, weight, mean, rstd, *, atomic: bool = False, plan: Plan | None = None):
    """(dx, dw, db) of LayerNorm from the saved float32 statistics; ``atomic`` as in the docstring,
    ``plan`` forces a launch (by default the fastest of :func:`backward_candidates`)."""
    return _backward(dy, x, weight, mean, rstd, False, atomic, "layer_norm_backward", plan)


def rms_norm_backward(dy, x, weight, rstd, *, atomic: bool = False, plan: Plan | None = None):
    """(dx, dw) of RMSNorm from the saved float32 ``rstd``."""
    return _backward(dy, x, weight, None, rstd, True, atomic, "rms_norm_backward", plan)[:2]
