"""The LayerNorm shelf's launch plans (chapter 10): tiles, warps and grids of the forward and of each backward
candidate, as pure functions of the shape and the device. :mod:`course_utils.tuned.layernorm` picks among
them (its ``backward_candidates``, the timed choice) and launches them; it re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from .. import env, hardware

MAX_BLOCK_N = 65536
# The forward's entries: (BLOCK_N, bytes per element) -> (tile elements, num_warps), on sm_90. Re-measured on an
# H200 on 1 GiB inputs (tools/gpu_checks/norm_fwd_tiles.py, results/h200/layernorm_fwd_tiles_s19.log: every rows x
# warps candidate against torch.compile's kernel in interleaved rounds, LayerNorm and RMSNorm, which share the
# entry). Six entries moved; torch.compile's time over ours, LayerNorm/RMSNorm, the old tile -> the new one in the
# same rounds: float32 N=1024 0.97/0.97 -> 1.00/1.00, N=2048 0.985/0.955 -> 0.997/0.961, N=8192 0.988/0.975 ->
# 1.004/0.978, N=16384 1.085/0.942 -> 1.072/0.972; bf16 N=1024 0.977/0.977 -> 1.00/1.00, N=8192 0.980/0.960 ->
# 1.064/0.972. Float32 N=4096: 8 rows x 32 warps, as fast as any there, took 0.603 ms against 2 x 8's 0.522 while
# this kernel loaded w and b after the row's sums; loading both first cost LayerNorm's widest rows up to 37%
# (results/h200/bench_layernorm_s19_w_before_sums.log). With the tool's order (w before the sums, b after) 8 x 32
# is kept: the full sweep of a7d625f (bench_layernorm_s20.log) took the forward of float32 N=4096 against
# torch.compile from 0.955 to 0.971 (LayerNorm) and 0.946 to 0.968 (RMSNorm), 124 of 140 targets met (from 118).
# That sweep slowed bfloat16 N=4096 (1 row x 8 warps, picked under the old order): LayerNorm 0.522 -> 0.557 ms; in
# the tool (the new order) that tile took 0.558 ms and 2 rows x 16 warps 0.513 (RMSNorm 0.519), so bfloat16 N=4096
# takes 2 x 16: the full sweep of 95d0000 (bench_layernorm_s20b.log) took LayerNorm's forward there from 0.557 to
# 0.510 ms (1.077 of Liger-Kernel's speed, from 0.994), 125 of 140 targets met. Eviction hints (x evict_first,
# w and b evict_last) were slower in 59 of the 60 pairs.
# The backward's entries: from the first run of results/h100-80gb-hbm3/layernorm_tune.csv (2026-11-24, 256 MiB
# inputs, before the backward's tl.range loops): (tile elements, num_warps, programs per SM) of the backward tile
# kernel; in the file's re-run with these loops (2026-11-27) each was within 4% of its size's fastest tile (where 1
# program per SM was faster, backward_candidates times the same tile at 1 per SM too).
FWD_TILES: dict[tuple[int, int], tuple[int, int]] = {
    (1024, 2): (2048, 4), (2048, 2): (4096, 8), (4096, 2): (8192, 16), (8192, 2): (16384, 16), (16384, 2): (16384, 16),
    (1024, 4): (1024, 4), (2048, 4): (4096, 16), (4096, 4): (32768, 32), (8192, 4): (8192, 16),
    (16384, 4): (32768, 32)}
# RMSNorm's own entries where its fastest tile is not LayerNorm's: bfloat16 N=4096, 4 rows x 16 warps took 0.515 ms
# in the tool against 0.520 at LayerNorm's 2 x 16 (results/h200/layernorm_fwd_tiles_s21.log, code bc8d6ed; 0.510
# against 0.519 in layernorm_fwd_tiles_s19.log); the full sweep of bc8d6ed (bench_layernorm_s21.log) took RMSNorm's
# forward there from 0.989 to 0.996 of Liger-Kernel's speed, a tie at the copy ceiling.
RMS_FWD_TILES: dict[tuple[int, int], tuple[int, int]] = {(4096, 2): (16384, 16), (4096, 4): (4096, 16),
                                                          (8192, 2): (8192, 16)}
# RMSNorm's entries that read x again for the output (the kernel's RELOAD: x kept in L2 by an evict_last load for
# the row's sum of squares, then loaded again, evict_first, for y), as torch.compile's kernel does. On an H200, 1 GiB
# inputs (tools/gpu_checks/norm_fwd_forms.py, results/h200/norm_fwd_forms_s22.log), torch.compile's time over the
# shipped kernel's (masks, 64-bit offsets), one read -> two, in the same rounds: float32 N=2048 0.961 -> 0.999,
# N=4096 0.960 (8 rows x 32 warps) -> 1.001 (1 x 16, the entry above; 8 x 32 took 0.959 with two reads), N=8192
# 0.973 -> 1.002, N=16384 0.971 -> 0.992; bfloat16 N=8192 0.969 (2 x 16) -> 1.001 (1 x 16, above; 2 x 16 took 0.765
# with two reads). The read twice helps only at some tiles, and not LayerNorm's float32 N=4096 in this kernel (every
# masked form of it with two reads took 0.679-0.929): LayerNorm keeps one read.
RMS_FWD_RELOAD = frozenset({(2048, 4), (4096, 4), (8192, 4), (16384, 4), (8192, 2)})
BWD_TILES: dict[tuple[int, int], tuple[int, int, int]] = {
    (1024, 2): (2048, 4, 4), (2048, 2): (2048, 4, 4), (4096, 2): (4096, 8, 2), (8192, 2): (8192, 16, 2),
    (1024, 4): (4096, 8, 2), (2048, 4): (4096, 8, 2), (4096, 4): (8192, 16, 2), (8192, 4): (8192, 32, 2)}
TILE_ELEMENTS = 4096          # elsewhere: rows per program = this // BLOCK_N
ELEMENTS_PER_THREAD = 16      # elsewhere: num_warps = tile / (32 x this), between 4 and 32
BWD_PROGRAMS_PER_SM = 2       # backward grid: SMs x this programs, each summing a contiguous run of rows
CHUNKED_FROM = 8192           # BLOCK_N from which the chunked backward is a candidate (the only one above)
# (CHUNK, num_warps, programs per SM): all four are timed at first use of a shape (layernorm_tune.csv's re-run
# of 2026-11-27 times them too, its "ours chunked" rows)
CHUNKED = ((2048, 4, 1), (4096, 8, 1), (2048, 4, 2), (4096, 8, 2))
PER_SM_MAX_BLOCK = 16384    # the per-SM layout keeps a whole row and two accumulator rows in registers
ROW_WARPS = (16, 32)        # num_warps of the 1-D "row" candidates (N from CHUNKED_FROM to PER_SM_MAX_BLOCK)
# More 1-D "row" candidates, not yet measured (tools/gpu_checks/kernel_candidates.py times them against
# Liger-Kernel): BLOCK_N -> (num_warps, programs per SM, pipeline stages of the row loop). Triton pipelines
# a loop whose loads feed no dot product only when the loop asks (tl.range(num_stages=)): ROW_WARPS' loops,
# like Liger-Kernel's, wait for each row's loads. Stages keep one more row of x and dy in shared memory
# (bf16 N=16384: 64 KiB a stage; fp32 N=16384 does not fit two, and is skipped as "no fit").
# At N=16384 ptxas spills 0.7-2.3 KB a thread of every 1-D row kernel but the pipelined 32-warp one (about
# 0.26 KB; results/ptx/candidate_registers.csv), so that one only.
ROW_PIPELINED = {4096: ((8, 1, None), (8, 2, None), (8, 1, 2), (8, 2, 2)), 8192: ((16, 1, 2), (32, 1, 2)),
                 16384: ((32, 1, 2),)}
# "mix": BLOCK_N -> (num_warps, pipeline stages) of norm_bwd_mix_kernel, MIX_ROWS rows a program (torch.compile's
# layout: 2048 programs for 32768 rows), on sm_90. On an H200 (tools/gpu_checks/rms_bwd_variants.py, 2026-11-29, 1 GiB
# of bf16 RMSNorm; the kernel as torch.compile generated it, which norm_bwd_mix_kernel follows) the backward took
# 0.928 ms at N=16384 with 8 warps unpipelined against torch.compile's 0.949 and 1.130 for the row kernel at the same
# grid; at N=8192 0.890-0.891 with 3 stages (8 or 16 warps) against 1.075 and 1.076-1.087. Timed with the others:
# in the H200's sweep of bfc63c0 (results/h200/layernorm_bwd_choice_s22.log, 256 MiB) the choice kept a mix plan only
# at bf16 RMSNorm N=16384 (16 warps, 3 stages: 0.244 ms against 0.297 at 8 warps), and that row's forward + backward
# went from 0.917 to 1.008 of torch.compile's speed (bench_layernorm_s22.log).
MIX = {8192: ((8, 3), (16, 3)), 16384: ((8, 0), (16, 3))}
MIX_ROWS = 16
# "split": BLOCK_N -> (SLICE, CHUNK, num_warps, programs per SM). At N=16384 the 1-D kernels hold x, dy, w,
# dw and db of a row, 5 x 64 KiB in float32, more than an SM's 256 KiB of registers: they spill (0.7-2.3 KB
# a thread for sm_90, results/ptx/candidate_registers.csv, where the 8192 and 4096 slices spill nothing). The split
# kernel sums the row first (CHUNK columns a step), then reads it again for dx: what stays in registers is w,
# dw and db of its SLICE columns (SLICE = BLOCK_N: one program per row, which it reads twice; less: several
# programs share a row, each keeping a slice, and L2 serves all but one of their reads).
SPLIT = {8192: ((8192, 2048, 16, 1), (4096, 2048, 8, 2)),
         16384: ((8192, 2048, 16, 1), (4096, 2048, 8, 2), (16384, 2048, 32, 1))}
COLUMN_SUM_ROWS = 32        # BLOCK_M of the teaching column_sum, which column_sum_pair sums as (same bits)
# BLOCK_N of column_sum_pair: columns never mix, so any BLOCK_N gives the same bits. On an H100 the teaching
# column_sum of 132-528 partial rows of 768 columns ran 7.1-16.3 us with 16 columns a program (48 programs)
# against 9.3-23.8 us with 64 (12 programs): too few programs to fill the GPU (tools/gpu_checks/
# kernel_candidates.py, results/h100-80gb-hbm3/kernel_candidates.log). Wider rows were not timed: they keep 64.
NARROW_SUM_COLS, NARROW_SUM_BLOCK_N = 1024, 16


# Pipelined row loops (tl.range(num_stages=)): Triton keeps STAGES - 1 tiles of every loaded tensor in shared
# memory. On an H200 (tools/gpu_checks/add_layernorm_bwd.py, 2026-11-28, GPT-2's 8192 and 16384 x 768 bf16;
# results/h200/add_layernorm_bwd_candidates.log) the add_layer_norm backward took 114 us at 16384 rows unpipelined
# with 8 warps, 110 us with 3 stages and 8 warps, 67 us unpipelined with 4 warps and 37 us with both (the copy of
# its bytes: 26 us): the win needs both. 4 warps beat 8 in 92 of the 96 launches timed.
LOOP_STAGES = 3
SMEM_SPARE = 4096            # bytes of shared memory left for the reductions' scratch


def loop_stages(tile_elements: int, bytes_per_element: int, info: hardware.DeviceInfo, want: int = LOOP_STAGES) -> int:
    """The most pipeline stages, at most ``want``, whose buffers fit one program's shared memory; 0: none
    (fewer than 2, or a GPU before sm_80, which has no asynchronous copies). ``bytes_per_element``: the bytes of
    one tile element summed over the loop's loaded tensors (x and dy in bf16: 4)."""
    if info.arch < 80:
        return 0
    fit = (info.smem_per_block_bytes - SMEM_SPARE) // (tile_elements * bytes_per_element) + 1
    stages = min(want, fit)
    return stages if stages >= 2 else 0


def column_sum_block_n(n_cols: int, default: int) -> int:
    """Columns per program of the partial-row reduction: 16 up to ``NARROW_SUM_COLS`` columns, else ``default``."""
    return NARROW_SUM_BLOCK_N if n_cols <= NARROW_SUM_COLS else default


@dataclass(frozen=True)
class Plan:
    """A launch: the version ("tiles", "row": one row at a time as 1-D blocks, "mix": the same as (1, BLOCK_N)
    blocks in torch.compile's shape, "split": a column slice of one row at a time, or "chunked"), BLOCK_N
    columns (CHUNK for "chunked", SLICE for "split"), ROWS rows per tile, num_warps, grid programs, (backward)
    the rows each program sums, (row, mix, tiles) the pipeline stages of the row loop (0: not pipelined) and
    (split) the columns per step of the row's sums (0: SLICE), and (forward) whether x is read again for the output
    (``RMS_FWD_RELOAD``)."""

    version: str
    BLOCK_N: int
    ROWS: int
    num_warps: int
    grid: int
    rows_per_program: int = 0
    stages: int = 0
    chunk: int = 0
    reload: bool = False


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
                 interpreter: bool | None = None, rms: bool = False) -> Plan:
    """Tile and warps of the forward kernel (LayerNorm's, or RMSNorm's): a pure function of the shape and the
    device."""
    block = _block(n_cols)
    interpreter = (not env.on_gpu()) if interpreter is None else interpreter
    key = (block, itemsize)
    entry = (rms and RMS_FWD_TILES.get(key)) or FWD_TILES.get(key)   # no merged dict per call: host time
    tuned = entry is not None and info.arch >= 90
    tile, warps = entry if tuned else (TILE_ELEMENTS, None)
    rows = _rows(n_rows, block, 16384 if interpreter else tile)
    return Plan("tiles", block, rows, warps or _warps(rows * block), triton.cdiv(n_rows, rows),
                reload=tuned and rms and key in RMS_FWD_RELOAD)


def _grid(n_rows: int, rows: int, programs: int) -> tuple[int, int]:
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, programs), rows) * rows
    return triton.cdiv(n_rows, rows_per_program), rows_per_program


def per_sm_plan(n_rows: int, n_cols: int, info: hardware.DeviceInfo) -> Plan:
    """Liger-Kernel's backward layout on the course's kernel: one program per SM, each a contiguous run of
    rows taken one row at a time (dx written, dw/db summed in registers), warps by row length as Liger's."""
    block = _block(n_cols)
    warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return Plan("tiles", block, 1, warps, *_grid(n_rows, 1, max(1, info.sms)))


def row_plans(n_rows: int, n_cols: int, info: hardware.DeviceInfo) -> list[Plan]:
    """The ``ROW_PIPELINED`` candidates of this row length (none for other lengths)."""
    return [Plan("row", _block(n_cols), 1, w, *_grid(n_rows, 1, info.sms * k), stages or 0)
            for w, k, stages in ROW_PIPELINED.get(_block(n_cols), ())]


def mix_plans(n_rows: int, n_cols: int, itemsize: int, info: hardware.DeviceInfo) -> list[Plan]:
    """The ``MIX`` candidates of this row length on sm_90 (none elsewhere), their stages cut to what fits."""
    block = _block(n_cols)
    if info.arch < 90:
        return []
    grid, rows_per_program = _grid(n_rows, 1, triton.cdiv(n_rows, MIX_ROWS))
    plans = [Plan("mix", block, 1, w, grid, rows_per_program,
                  loop_stages(block, 2 * itemsize, info, want=stages) if stages else 0)
             for w, stages in MIX.get(block, ())]
    return list(dict.fromkeys(plans))


def split_plan(n_rows: int, n_cols: int, slice_: int, warps: int, programs: int, chunk: int = 0) -> Plan:
    """The "split" launch: runs of rows x column slices of ``slice_`` columns, about ``programs`` programs
    (at least one per slice), the slices of a run adjacent in the grid; the row's sums ``chunk`` columns a step."""
    slices = triton.cdiv(n_cols, slice_)
    runs, rows_per_program = _grid(n_rows, 1, max(1, programs // slices))
    return Plan("split", slice_, 1, warps, runs * slices, rows_per_program, chunk=chunk)


def split_plans(n_rows: int, n_cols: int, info: hardware.DeviceInfo) -> list[Plan]:
    """The ``SPLIT`` candidates of this row length (none for other lengths)."""
    return [split_plan(n_rows, n_cols, s, w, info.sms * k, c) for s, c, w, k in SPLIT.get(_block(n_cols), ())]
