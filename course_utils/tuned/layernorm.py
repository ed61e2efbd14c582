"""LayerNorm and RMSNorm, the shelf ``make bench`` times (chapter 10, v4 of ``kernels/layernorm.py``).
(The plans themselves, pure functions of shape and device, are in :mod:`.layernorm_plans`, the backward's launches in
:mod:`.layernorm_launches`; both re-exported here.)

Forward: a tile of ROWS rows x BLOCK_N columns per program (several rows per program when rows are
short), statistics in float32, mean/rstd stored only when a backward pass will need them.
Backward: one kernel reads x and dy once, writes dx, and sums dy * x_hat and dy over its rows into
one float32 partial row per program; ``column_sum_pair_kernel`` adds both partial buffers up in one launch
(deterministic; the teaching ``column_sum`` takes one launch per buffer, in the same order: same bits).
``atomic=True`` adds each program's sums into one float32 row with ``tl.atomic_add`` instead: no
reduction kernel, but no fewer launches (the float32 rows are zeroed first, and converted after in 16-bit
dtypes), and the order of the additions changes from run to run (the notebook counts and measures both).
Tiles, warps and programs per SM come from :func:`plan_forward` and :func:`backward_candidates`; the
kernels are in ``layernorm_kernels.py``. ``BACKWARD_DESIGN`` ("course", "per-sm": Liger-Kernel's layout,
"both") picks the backward candidates; the fastest is kept per shape, unless
``torch.use_deterministic_algorithms(True)`` pins the first (a pure function of shape and device: the
bits of dw and db depend on the plan, since each plan sums the rows in its own order).
"""

from __future__ import annotations

import contextlib

import torch

from .. import env, hardware
from ..kernels.layernorm import REDUCE_BLOCK_N, as_rows, column_sum
from . import choice
from .launch import launch
from .layernorm_kernels import (  # noqa: F401  (the backward kernels re-exported: chapter 10 reads T.norm_bwd_kernel)
    column_sum_pair_kernel,
    norm_bwd_chunked_kernel,
    norm_bwd_kernel,
    norm_bwd_row_kernel,
    norm_bwd_split_kernel,
    norm_fwd_kernel,
)
from .layernorm_launches import (  # noqa: F401  (re-exported: the ops launch the backward through these)
    BackwardLaunch,
    _launch_backward,
    backward_launch,
    launch_backward,
)
from .layernorm_plans import (  # noqa: F401  (re-exported: the shelf's plans, by the names callers use)
    BWD_PROGRAMS_PER_SM,
    BWD_TILES,
    CHUNKED,
    CHUNKED_FROM,
    COLUMN_SUM_ROWS,
    ELEMENTS_PER_THREAD,
    FWD_TILES,
    LOOP_STAGES,
    MAX_BLOCK_N,
    MIX,
    MIX_ROWS,
    PER_SM_MAX_BLOCK,
    RMS_FWD_RELOAD,
    RMS_FWD_TILES,
    ROW_PIPELINED,
    ROW_WARPS,
    SMEM_SPARE,
    SPLIT,
    TILE_ELEMENTS,
    Plan,
    _block,
    _grid,
    _rows,
    _warps,
    column_sum_block_n,
    loop_stages,
    mix_plans,
    per_sm_plan,
    plan_forward,
    row_plans,
    split_plan,
    split_plans,
)

# --------------------------------------------------------------------------- the backward's candidates

BACKWARD_DESIGNS = ("course", "per-sm", "both")
BACKWARD_DESIGN = "both"  # the per-SM layout joins the timed choice: it can only win where it is faster
_BEST: dict = {}
_PINNED = None              # a Plan that backward_plan() forces instead of the timed choice


@contextlib.contextmanager
def backward_design(design: str):
    """Use backward ``design`` (one of BACKWARD_DESIGNS) inside the block, autograd included."""
    global BACKWARD_DESIGN
    if design not in BACKWARD_DESIGNS:
        raise ValueError(f"backward design must be one of {BACKWARD_DESIGNS}, got {design!r}")
    saved, BACKWARD_DESIGN = BACKWARD_DESIGN, design
    try:
        yield
    finally:
        BACKWARD_DESIGN = saved


def backward_candidates(n_rows: int, n_cols: int, itemsize: int, info: hardware.DeviceInfo, *,
                        interpreter: bool | None = None, design: str | None = None) -> list[Plan]:
    """The backward plans worth trying, best guess first (on a GPU :func:`_backward` times them once
    per shape and keeps the fastest; under the interpreter, or deterministic, the first is used)."""
    block = _block(n_cols)
    interpreter = (not env.on_gpu()) if interpreter is None else interpreter
    design = design or BACKWARD_DESIGN
    if design == "per-sm" and block <= PER_SM_MAX_BLOCK:
        return [per_sm_plan(n_rows, n_cols, info)]
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
        if design == "both":   # the same tiles with the row loop pipelined, at the table's warps and at 4
            stages = loop_stages(rows * block, 2 * itemsize, info)
            cands += [Plan("tiles", block, rows, w, *_grid(n_rows, rows, info.sms * per_sm), stages)
                      for w in dict.fromkeys((warps or _warps(rows * block), 4)) if stages]
    if block >= CHUNKED_FROM:
        for chunk, warps, per_sm in CHUNKED:
            cands.append(Plan("chunked", min(chunk, block), 1, warps, *_grid(n_rows, 1, info.sms * per_sm)))
    if design == "both" and block <= PER_SM_MAX_BLOCK:  # (for some shapes the per-SM-1 candidate already is it)
        cands += [p for p in (per_sm_plan(n_rows, n_cols, info),) if p not in cands]
    if design == "both" and CHUNKED_FROM <= block <= PER_SM_MAX_BLOCK:
        # the per-SM layout as 1-D blocks: in layernorm.csv (H100) the 2-D tile kernel with Liger's layout takes
        # 2.3-2.6 ms at N=16384 where Liger's 1-D kernel takes 0.7-0.77 (fwd+bwd); timed, kept only if faster
        cands += [Plan("row", block, 1, w, *_grid(n_rows, 1, info.sms)) for w in ROW_WARPS]
    if design == "both":
        cands += [p for p in row_plans(n_rows, n_cols, info) + split_plans(n_rows, n_cols, info)
                  + mix_plans(n_rows, n_cols, itemsize, info) if p not in cands]
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
        p = plan_forward(n_rows, n_cols, x.element_size(), hardware.device_info(), rms=rms)
        dummy = y  # pointers the kernel never touches (no bias, no statistics)
        launch(norm_fwd_kernel, "norm_fwd", (p.grid,),
               (y, x2, weight, dummy if bias is None else bias, dummy if mean is None else mean,
                dummy if rstd is None else rstd, n_rows, n_cols, x2.stride(0), y.stride(0), eps),
               dict(BLOCK_N=p.BLOCK_N, ROWS=p.ROWS, RMS=rms, HAS_BIAS=bias is not None, STATS=stats,
                    RELOAD=p.reload, num_warps=p.num_warps))
    return y.view(x.shape), mean, rstd


def _finish_backward(p: Plan, dx, dy2, x2, weight, mean, rstd, rms: bool, atomic: bool):
    """The whole backward of plan ``p`` as autograd runs it: the launch, then the reduction of its ``p.grid``
    partial rows (``column_sum``) or the conversion of the atomic sums; returns (dx, dw, db) in the weight's dtype."""
    dw, db = _launch_backward(p, dx, dy2, x2, weight, mean, rstd, rms, atomic)
    if atomic:
        return dx, dw.to(weight.dtype), None if rms else db.to(weight.dtype)
    if rms:
        return dx, column_sum(dw, weight.dtype), None
    return (dx, *column_sum_pair(dw, db, weight.dtype))


def column_sum_pair(dw_partial: torch.Tensor, db_partial: torch.Tensor, dtype: torch.dtype):
    """(dw, db): the column sums of two contiguous float32 (n_partials, N) buffers of one shape, in ``dtype``,
    in one launch; the bits of ``column_sum`` (kernels/layernorm.py) with the same tile on each, two launches."""
    n_partials, n_cols = dw_partial.shape
    # empty_strided and empty_like: the cheap allocations from Python (course_utils.ops._lib says why)
    dw = torch.empty_strided((n_cols,), (1,), dtype=dtype, device=dw_partial.device)
    db = torch.empty_like(dw)
    grid, meta = _SUMS.get(n_cols) or _column_sums_launch(n_cols)
    launch(column_sum_pair_kernel, "column_sum_pair", grid, (dw, db, dw_partial, db_partial, n_partials, n_cols), meta)
    return dw, db


_SUMS: dict = {}   # N -> (grid, meta) of column_sum_pair's launch: worked out once per width (host time)


def _column_sums_launch(n_cols: int) -> tuple:
    block_n = column_sum_block_n(n_cols, REDUCE_BLOCK_N)
    _SUMS[n_cols] = ((-(-n_cols // block_n),), dict(BLOCK_M=COLUMN_SUM_ROWS, BLOCK_N=block_n))
    return _SUMS[n_cols]


def _choose(cands: list[Plan], key, launch) -> Plan:
    """The fastest candidate plan for ``key`` (timed once, on a GPU only: :mod:`.choice`); ``launch(plan)``
    must run the whole backward (:func:`_finish_backward`): a plan with more programs leaves more partial
    rows for ``column_sum``, a cost the choice must see."""
    return choice.fastest(cands, key, launch, _BEST,
                          timer=lambda f: choice.do_bench_median(f, warmup=3, rep=10))


@contextlib.contextmanager
def backward_plan(plan: Plan):
    """Launch ``plan`` for every backward inside the block (autograd included), instead of the timed
    choice: how a check times one candidate end to end. The plan must fit the shapes it meets."""
    global _PINNED
    if not isinstance(plan, Plan):
        raise TypeError(f"backward_plan needs a Plan, got {type(plan).__name__}")
    saved, _PINNED = _PINNED, plan
    try:
        yield
    finally:
        _PINNED = saved


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
    deterministic = torch.are_deterministic_algorithms_enabled()
    if atomic and deterministic:
        raise RuntimeError(f"{what}: atomic=True adds in a different order on every run, and "
                           "torch.use_deterministic_algorithms(True) is on: use atomic=False")
    plan = _PINNED if plan is None else plan
    key = (n_rows, n_cols, x.dtype, weight.dtype, rms, atomic, str(x.device), BACKWARD_DESIGN)
    if plan is None and not deterministic:
        plan = _BEST.get(key)  # chosen before: no candidate list to rebuild on every call (host time)
    if plan is None:
        cands = backward_candidates(n_rows, n_cols, x.element_size(), hardware.device_info())
        plan = cands[0] if deterministic else _choose(
            cands, key, lambda p: _finish_backward(p, dx, dy2, x2, weight, mean, rstd, rms, atomic))
    _, dw, db = _finish_backward(plan, dx, dy2, x2, weight, mean, rstd, rms, atomic)
    return dx.view(x.shape), dw, db


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


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (see course_utils/aot.py): both shelves."""
    from ..aot import dtype_name, dtypes_for, empty
    from ..kernels import layernorm as K
    for dt in dtypes_for(info):
        name = dtype_name(dt)
        for m, n in ((7, 1000),):
            x, w, st = empty(m, n, dtype=dt), empty(n, dtype=dt), empty(m)
            yield f"teaching layer_norm {name} {m}x{n}", lambda x=x, w=w: K.layer_norm_teaching(x, w, w)
            yield f"teaching rms_norm {name} {m}x{n}", lambda x=x, w=w: K.rms_norm_teaching(x, w)
            yield f"teaching backward {name} {m}x{n}", lambda x=x, w=w, st=st: K.layer_norm_backward_teaching(
                x, x, w, st, st)
            yield f"teaching rms backward {name} {m}x{n}", lambda x=x, w=w, st=st: K.rms_norm_backward_teaching(
                x, x, w, st)
        for n in (1000, 4096, 16384, 40000):  # a tile of rows, one row, the longest rows
            m = max(1, 2**26 // (n * dt.itemsize))
            x, w = empty(m, n, dtype=dt), empty(n, dtype=dt)
            yield f"layer_norm {name} N={n}", lambda x=x, w=w: layer_norm(x, w, w)
            yield f"rms_norm {name} N={n}", lambda x=x, w=w: rms_norm(x, w)
            if n == 4096:
                yield f"layer_norm with stats {name} N={n}", lambda x=x, w=w: _forward(x, w, w, 1e-5, False, True, "")
        for n in (1024, 8192):  # tiles; tiles and the chunked candidates
            m = 2**26 // (n * dt.itemsize)
            x, w, st = empty(m, n, dtype=dt), empty(n, dtype=dt), empty(m)
            for i, p in enumerate(backward_candidates(m, n, dt.itemsize, info, interpreter=False)):
                for rms, atomic in ((False, False),) + (((True, False), (False, True), (True, True)) if i == 0 else ()):
                    yield (f"backward {p.version} {name} N={n} BLOCK_N={p.BLOCK_N} w={p.num_warps} grid={p.grid} "
                           f"stages={p.stages} chunk={p.chunk} rms={rms} atomic={atomic}",
                           lambda x=x, w=w, st=st, p=p, rms=rms, atomic=atomic: _backward(
                               x, x, w, st, st, rms, atomic, "aot", p))
        for n in (1000, 4096):   # torch.compile's layout (sm_90's candidates above) masked and not, on every arch
            m = 2**20 // (n * dt.itemsize)
            x, w, st = empty(m, n, dtype=dt), empty(n, dtype=dt), empty(m)
            p = Plan("mix", _block(n), 1, 8, *_grid(m, 1, -(-m // MIX_ROWS)))
            for rms in (False, True):
                yield f"backward mix {name} N={n} rms={rms}", lambda x=x, w=w, st=st, p=p, rms=rms: _backward(
                    x, x, w, st, st, rms, False, "aot", p)
        for n in (1024, 16384):  # the per-SM (Liger-Kernel) layout, shortest and longest rows it takes
            m = 2**26 // (n * dt.itemsize)
            x, w, st = empty(m, n, dtype=dt), empty(n, dtype=dt), empty(m)
            p = per_sm_plan(m, n, info)
            yield f"backward per-sm {name} N={n} w={p.num_warps}", lambda x=x, w=w, st=st, p=p: _backward(
                x, x, w, st, st, False, False, "aot", p)
    yield "layer_norm int64 offsets", lambda: layer_norm(empty(2**21, 1024, dtype=torch.float16),
                                                         empty(1024, dtype=torch.float16))
