"""The tuned LayerNorm/RMSNorm kernels (chapter 10; their plans and launchers: ``tuned/layernorm.py``).

``norm_fwd_kernel``: a tile of ROWS rows x BLOCK_N columns per program (RMS and bias as constexprs,
mean/rstd stored only when a backward pass needs them). ``norm_bwd_kernel``: dx for a contiguous run of
rows in tiles of ROWS, plus that run's sums of dy * x_hat and dy (partial row, or atomics).
``norm_bwd_row_kernel``: the same one row at a time as 1-D blocks (Liger-Kernel's layout, no ROWS axis),
optionally with the row loop software-pipelined (the next row's x and dy loads issued during this one).
``norm_bwd_mix_kernel``: the row kernel as (1, BLOCK_N) blocks, w reloaded every row (torch.compile's shape).
``norm_bwd_split_kernel``: rows whose x, dy, w, dw and db do not all fit one program's registers: the
row's two sums first, in chunks, then dx and dw/db of one column slice (the whole row or a part of it).
``norm_bwd_chunked_kernel``: the same for rows too long for registers, one row at a time in chunks.
"""

import triton
import triton.language as tl


@triton.jit
def norm_fwd_kernel(y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_rows, n_cols, x_row_stride, y_row_stride,
                     eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     STATS: tl.constexpr, RELOAD: tl.constexpr = False):
    """Rows pid * ROWS + [0, ROWS): y = (x - mean) * rstd * w + b (RMSNorm: x * rstd * w). RELOAD: x is read
    twice, kept in L2 for the sums (evict_last) and loaded again for y (evict_first), as torch.compile does."""
    eps = tl.cast(eps, tl.float32)  # fp64 from torch.compile: math in float32
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x_ptrs = x_ptr + rows64 * x_row_stride + cols[None, :]
    if RELOAD:
        x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    else:
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    # w before the row's sums, b after them: the order of tools/gpu_checks/norm_fwd_tiles.py's kernel, whose
    # tiles ran faster than the same tiles here with both loaded after (chapter 10, section 3)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / n_cols
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    if RELOAD:   # x again, from L2: the registers that held it are free while the sums reduce
        xc = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if not RMS:
            xc = tl.where(mask, xc - mean[:, None], 0.0)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64 * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STATS:
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        if not RMS:
            tl.store(mean_ptr + rows, mean, mask=row_mask)


@triton.jit
def _store_sums(dw_ptr, db_ptr, dw, db, part, n_cols, cols, mask, RMS: tl.constexpr, ATOMIC: tl.constexpr):
    """A backward program's sums of dy * x_hat and dy (db: LayerNorm only): added into dw/db with atomics, or
    stored as partial row ``part`` of the float32 (programs, n_cols) buffers that a column sum adds up."""
    if ATOMIC:
        tl.atomic_add(dw_ptr + cols, dw, mask=mask)
        if not RMS:
            tl.atomic_add(db_ptr + cols, db, mask=mask)
    else:
        out = part.to(tl.int64) * n_cols + cols
        tl.store(dw_ptr + out, dw, mask=mask)
        if not RMS:
            tl.store(db_ptr + out, db, mask=mask)


@triton.jit
def norm_bwd_kernel(dx_ptr, dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, n_rows, n_cols,
                     x_row_stride, dy_row_stride, dx_row_stride, rows_per_program, BLOCK_N: tl.constexpr,
                     ROWS: tl.constexpr, RMS: tl.constexpr, ATOMIC: tl.constexpr, STAGES: tl.constexpr = None):
    """dx for the rows [pid * rows_per_program, ...) in tiles of ROWS, and their sums of dy * x_hat
    and dy: stored as partial row pid (ATOMIC=False) or added into dw/db with atomics. STAGES (None: the
    loop as written): the next tiles of x and dy travel to shared memory while this one computes."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    for start in tl.range(first, end, ROWS, num_stages=STAGES):
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
    _store_sums(dw_ptr, db_ptr, dw, db, pid, n_cols, cols, col_mask, RMS, ATOMIC)


@triton.jit
def norm_bwd_row_kernel(dx_ptr, dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, n_rows, n_cols,
                        x_row_stride, dy_row_stride, dx_row_stride, rows_per_program, BLOCK_N: tl.constexpr,
                        RMS: tl.constexpr, ATOMIC: tl.constexpr, STAGES: tl.constexpr = None):
    """``norm_bwd_kernel`` with one row per step as 1-D blocks (no ROWS axis to reduce across, as
    Liger-Kernel's kernel): dx of rows [pid * rows_per_program, ...), their dw/db sums in registers.
    STAGES (None: the loop as written): Triton pipelines a loop whose loads feed no dot product only when
    asked, so with STAGES=2 the next row's x and dy travel (to shared memory) while this row computes."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    for row in tl.range(first, end, num_stages=STAGES):
        r64 = first.to(tl.int64) + (row - first)  # int64 (the interpreter's loop index is a Python int)
        x = tl.load(x_ptr + r64 * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64 * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = (x if RMS else x - tl.load(mean_ptr + row)) * rstd
        g = dy * w
        c1 = tl.sum(g * x_hat, axis=0) / n_cols
        c2 = 0.0 if RMS else tl.sum(g, axis=0) / n_cols
        dx = (g - x_hat * c1 - c2) * rstd
        tl.store(dx_ptr + r64 * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
    _store_sums(dw_ptr, db_ptr, dw, db, pid, n_cols, cols, mask, RMS, ATOMIC)


@triton.jit
def norm_bwd_chunked_kernel(dx_ptr, dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, dw_out_ptr, db_out_ptr,
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
    # num_stages=1: row r + 1 reads the partial sums row r wrote, so its loads must not be issued early
    for row in tl.range(first, end, num_stages=1):
        r64 = first.to(tl.int64) + (row - first)  # int64 (the interpreter's loop index is a Python int)
        rstd = tl.load(rstd_ptr + row)
        mean = 0.0 if RMS else tl.load(mean_ptr + row)
        acc1 = tl.zeros((CHUNK,), dtype=tl.float32)
        acc2 = tl.zeros((CHUNK,), dtype=tl.float32)
        for start in tl.range(0, n_cols, CHUNK):  # pass 1: c1 = mean(g * x_hat), c2 = mean(g)
            cols = start + offsets
            mask = cols < n_cols
            x = tl.load(x_ptr + r64 * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(dy_ptr + r64 * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32) * \
                tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            acc1 += g * (x - mean) * rstd
            acc2 += g
        c1 = tl.sum(acc1, axis=0) / n_cols
        c2 = 0.0 if RMS else tl.sum(acc2, axis=0) / n_cols
        # the first row writes the partial row, the next ones add to it (a block, not a scalar: Triton 3.9's
        # interpreter refuses a scalar mask)
        keep = (offsets * 0 + row) > first
        for start in tl.range(0, n_cols, CHUNK):  # pass 2: dx, and the partial sums of dw and db
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
        tl.debug_barrier()  # this row's partial sums are stored before any thread reads them again
    if ATOMIC:
        for start in tl.range(0, n_cols, CHUNK):
            cols = start + offsets
            mask = (cols < n_cols) & ((offsets * 0 + first) < end)  # a block, not a scalar (Triton 3.9)
            tl.atomic_add(dw_out_ptr + cols, tl.load(dw_ptr + part + cols, mask=mask, other=0.0), mask=mask)
            if not RMS:
                tl.atomic_add(db_out_ptr + cols, tl.load(db_ptr + part + cols, mask=mask, other=0.0), mask=mask)


@triton.jit
def norm_bwd_mix_kernel(dx_ptr, dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, n_rows, n_cols,
                        x_row_stride, dy_row_stride, dx_row_stride, rows_per_program, BLOCK_N: tl.constexpr,
                        RMS: tl.constexpr, ATOMIC: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr = None):
    """``norm_bwd_row_kernel`` in the shape of torch.compile's kernel for wide rows (its "mix order reduction"):
    each row a (1, BLOCK_N) block at a row index that is itself a (1, 1) tensor, w loaded again on every row (it
    stays in L2) instead of held in registers through the loop; EVEN (n_cols == BLOCK_N): no masks. For sm_90a
    at bf16 N=16384 (RMSNorm, 8 warps) ptxas spills 8 bytes a thread of it, against the row kernel's 304 at 8 warps."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = cols < n_cols
    dw = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    db = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    first = pid * rows_per_program
    inv_n = 1.0 / n_cols
    rows = (first + tl.zeros((1, 1), dtype=tl.int32)).to(tl.int64)
    for _ in tl.range(0, tl.minimum(rows_per_program, n_rows - first), num_stages=STAGES):
        row = rows
        rows += 1
        if EVEN:
            x = tl.load(x_ptr + (cols + x_row_stride * row)).to(tl.float32)
            dy = tl.load(dy_ptr + (cols + dy_row_stride * row)).to(tl.float32)
            w = tl.load(w_ptr + cols, eviction_policy="evict_last").to(tl.float32)
        else:
            x = tl.load(x_ptr + (cols + x_row_stride * row), mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + (cols + dy_row_stride * row), mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        rstd = tl.load(rstd_ptr + row, eviction_policy="evict_last")
        if RMS:
            x_hat = x * rstd
        else:
            x_hat = (x - tl.load(mean_ptr + row, eviction_policy="evict_last")) * rstd
        g = dy * w
        # dx = rstd * (g - x_hat * mean(g * x_hat) - mean(g)), the last term for LayerNorm only
        if RMS:
            dx = (g - x_hat * inv_n * tl.sum(x_hat * g, 1)[:, None]) * rstd
        else:
            dx = (g - x_hat * inv_n * tl.sum(x_hat * g, 1)[:, None] - inv_n * tl.sum(g, 1)[:, None]) * rstd
        dx = dx.to(dx_ptr.dtype.element_ty)
        if EVEN:
            tl.store(dx_ptr + (cols + dx_row_stride * row), dx)
        else:
            tl.store(dx_ptr + (cols + dx_row_stride * row), dx, mask=mask)
        dw += tl.sum(dy * x_hat, 0)
        if not RMS:
            db += tl.sum(dy, 0)
    _store_sums(dw_ptr, db_ptr, dw, db, pid, n_cols, cols, mask, RMS, ATOMIC)


@triton.jit
def norm_bwd_split_kernel(dx_ptr, dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, n_rows, n_cols,
                          x_row_stride, dy_row_stride, dx_row_stride, rows_per_program, n_slices,
                          SLICE: tl.constexpr, CHUNK: tl.constexpr, RMS: tl.constexpr, ATOMIC: tl.constexpr):
    """Rows too long for the 1-D kernel's registers, which hold x, dy, w, dw and db of the whole row
    while the row's sums are reduced (5 x N floats; an H100 SM has 64K 4-byte registers). Program pid
    takes run pid // n_slices of rows, and the SLICE columns of slice pid % n_slices. Per row:
        pass 1 (the whole row, CHUNK columns a step): c1 = mean(g * x_hat), c2 = mean(g), g = dy * w
        pass 2 (its slice, read again, now from L1 or L2): dx = (g - x_hat * c1 - c2) * rstd,
                dw += dy * x_hat, db += dy
    Pass 2 knows c1 and c2 before it loads: x and dy live only until their dx is stored, so what stays
    in registers is w, dw and db of the slice (3 x SLICE floats). dw and db are stored once, as the
    slice's part of partial row pid // n_slices (ATOMIC: added into dw/db). With several slices, the
    programs of one run are neighbours in the grid and read the same rows at about the same time: DRAM
    serves a row about once, L2 the other n_slices - 1 reads."""
    pid = tl.program_id(0)
    run = pid // n_slices
    cols = (pid % n_slices) * SLICE + tl.arange(0, SLICE)
    mask = cols < n_cols
    offsets = tl.arange(0, CHUNK)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((SLICE,), dtype=tl.float32)
    db = tl.zeros((SLICE,), dtype=tl.float32)
    first = run * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    for row in tl.range(first, end):
        r64 = first.to(tl.int64) + (row - first)  # int64 (the interpreter's loop index is a Python int)
        rstd = tl.load(rstd_ptr + row)
        mean = 0.0 if RMS else tl.load(mean_ptr + row)
        acc1 = tl.zeros((CHUNK,), dtype=tl.float32)
        acc2 = tl.zeros((CHUNK,), dtype=tl.float32)
        for start in tl.range(0, n_cols, CHUNK):  # pass 1: sum g * (x - mean) and g (zero past the row's end)
            c = start + offsets
            m = c < n_cols
            xc = tl.load(x_ptr + r64 * x_row_stride + c, mask=m, other=0.0).to(tl.float32) - mean
            g = tl.load(dy_ptr + r64 * dy_row_stride + c, mask=m, other=0.0).to(tl.float32) * \
                tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
            acc1 += g * xc
            acc2 += g
        c1 = tl.sum(acc1, axis=0) * rstd / n_cols
        c2 = 0.0 if RMS else tl.sum(acc2, axis=0) / n_cols
        x = tl.load(x_ptr + r64 * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64 * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x_hat = (x - mean) * rstd
        dx = (dy * w - x_hat * c1 - c2) * rstd
        tl.store(dx_ptr + r64 * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat  # dy = 0 past the row's end
        db += dy
    _store_sums(dw_ptr, db_ptr, dw, db, run, n_cols, cols, mask, RMS, ATOMIC)


@triton.jit
def column_sum_pair_kernel(dw_ptr, db_ptr, dw_partial_ptr, db_partial_ptr, n_partials, n_cols,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dw[j] = sum_i dw_partial[i, j] and db[j] = sum_i db_partial[i, j]: the teaching ``column_sum_kernel``
    on both float32 (n_partials, n_cols) buffers in one launch, each summed in the teaching kernel's order
    (the same tiles of BLOCK_M rows, so the same bits as its two launches)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc_w = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in tl.range(0, n_partials, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        acc_w += tl.sum(tl.load(dw_partial_ptr + offsets, mask=mask, other=0.0), axis=0)
        acc_b += tl.sum(tl.load(db_partial_ptr + offsets, mask=mask, other=0.0), axis=0)
    tl.store(dw_ptr + cols, acc_w.to(dw_ptr.dtype.element_ty), mask=col_mask)
    tl.store(db_ptr + cols, acc_b.to(db_ptr.dtype.element_ty), mask=col_mask)
