"""Elementwise kernels (chapters 3 and 4): vector add, GELU, and the chains fused around GELU.

Version ladder:
- v0 eager PyTorch (the ``*_ref`` functions): one kernel per operator, every intermediate through HBM.
- v1 ``add``: one program per BLOCK_SIZE tile of a flat tensor, the partial last tile masked.
- v2 ``gelu``: tanh approximation (as ``x / (1 + e^(-2a))``, the stable form of the tanh) or exact erf,
  fp32 math.
- v3 ``bias_gelu_scale``: ``gelu(x + bias) * scale`` (bias per column, scalar scale), one read, one write.
- v4 ``bias_gelu_dropout``: ``dropout(gelu(x + bias), p)`` with the keep mask drawn inside the kernel
  (Philox, from the seed and the element's index): no mask tensor is ever stored or read.

Every launcher takes BLOCK_SIZE, num_warps and the offset width from :func:`launch_config`, a pure
function of the element count, the dtype and a :class:`~course_utils.hardware.DeviceInfo`, so what
a launcher would pick on a T4, an A100 or an H100 can be asked on a machine with no GPU. Inputs
are float32, float16 or bfloat16 (bfloat16 from sm_80 on); the math is float32 and the output has
the input's dtype. Offsets are int64 when a tensor comes within reach of 2^31 elements. On a GPU,
calls after the first skip Triton's per-call argument binding and go straight to the compiled
kernel's launcher (:func:`_launch`): small tensors are launch-bound.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import env, hardware

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)   # sqrt(2 / pi)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)       # 1 / sqrt(2)
GELU_CUBIC = tl.constexpr(0.044715)


@triton.jit
def tile_start(pid, BLOCK_SIZE: tl.constexpr, INT64: tl.constexpr):
    """First element of program ``pid``'s tile; int64 when pid * BLOCK_SIZE could pass 2^31 - 1."""
    if INT64:
        pid = pid.to(tl.int64)
    return pid * BLOCK_SIZE


# How a tile of BLOCK_SIZE flat indices meets rows of n_cols (the WRAPS constexpr of the bias kernels)
IN_ROW, ONE_WRAP, ANY_WRAP = 0, 1, 2


def bias_wraps(block_size: int, n_cols: int) -> int:
    """IN_ROW when every tile lies inside one row, ONE_WRAP when a tile crosses at most one row
    end, ANY_WRAP otherwise (rows shorter than a tile)."""
    if n_cols % block_size == 0:
        return IN_ROW
    return ONE_WRAP if block_size <= n_cols else ANY_WRAP


@triton.jit
def bias_columns(start, n_cols, BLOCK_SIZE: tl.constexpr, WRAPS: tl.constexpr):
    """Column of each element of the tile that starts at flat index ``start`` (rows of n_cols).

    One modulo per program, not one per element (an integer division by a value known only at run
    time costs about twenty instructions). WRAPS (see :func:`bias_wraps`): inside one row the
    columns are consecutive and the tile's first one is a multiple of BLOCK_SIZE, which the hints
    tell the compiler so the bias loads are as wide as the loads of x.
    """
    cols = start % n_cols + tl.arange(0, BLOCK_SIZE)
    if WRAPS == 0:    # IN_ROW (a jit function reads module globals only as constexprs: plain ints here)
        cols = tl.max_contiguous(tl.multiple_of(cols, BLOCK_SIZE), BLOCK_SIZE)
    elif WRAPS == 1:  # ONE_WRAP
        cols = tl.where(cols >= n_cols, cols - n_cols, cols)
    else:
        cols = cols % n_cols
    return cols


@triton.jit
def gelu_math(x, APPROXIMATE: tl.constexpr):
    """GELU of a float32 block: tanh approximation if APPROXIMATE else exact (erf).

    Chapter 4 builds the tanh from exp stably (sign(a) (1 - e^(-2|a|)) / (1 + e^(-2|a|))); one step
    further, 0.5 * (1 + tanh(a)) = 1 / (1 + e^(-2a)), so the tanh form is x / (1 + e^(-2a)): one exp and one
    division, no cancellation where tanh(a) is near -1, and e^(-2a) = inf for very negative x gives
    x / inf = -0, the right limit. ``tl.fdiv`` is the fast division (within 2 ulp), not the
    correctly rounded one that ``/`` compiles to (several times the instructions).
    """
    if APPROXIMATE:
        a = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)
        y = tl.fdiv(x, 1.0 + tl.exp(-2.0 * a))
    else:
        y = 0.5 * x * (1.0 + tl.math.erf(x * INV_SQRT_2))
    return y


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr, INT64: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = tile_start(pid, BLOCK_SIZE, INT64) + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements                       # the last tile may run past the end
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_kernel(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr, APPROXIMATE: tl.constexpr,
                 INT64: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = tile_start(pid, BLOCK_SIZE, INT64) + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)      # one read of x
    y = gelu_math(x, APPROXIMATE)                                # everything else in registers
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)  # one write of y


@triton.jit
def _bias_gelu_scale_kernel(x_ptr, bias_ptr, y_ptr, n_elements, n_cols, scale, BLOCK_SIZE: tl.constexpr,
                            APPROXIMATE: tl.constexpr, INT64: tl.constexpr, WRAPS: tl.constexpr):
    pid = tl.program_id(axis=0)
    start = tile_start(pid, BLOCK_SIZE, INT64)
    offsets = start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    cols = bias_columns(start, n_cols, BLOCK_SIZE, WRAPS)     # the bias is one value per column
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=mask).to(tl.float32)      # n_cols values: they stay in L2
    y = gelu_math(x + b, APPROXIMATE) * scale
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _bias_gelu_dropout_kernel(x_ptr, bias_ptr, y_ptr, n_elements, n_cols, p, keep_scale, seed,
                              BLOCK_SIZE: tl.constexpr, APPROXIMATE: tl.constexpr, INT64: tl.constexpr,
                              WRAPS: tl.constexpr):
    pid = tl.program_id(axis=0)
    start = tile_start(pid, BLOCK_SIZE, INT64)
    offsets = start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    cols = bias_columns(start, n_cols, BLOCK_SIZE, WRAPS)
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=mask).to(tl.float32)
    y = gelu_math(x + b, APPROXIMATE)
    r = tl.rand(seed, offsets)                                   # uniform [0, 1): a function of (seed, index)
    y = tl.where(r >= p, y * keep_scale, 0.0)                    # keep with probability 1 - p, rescale
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _keep_mask_kernel(keep_ptr, n_elements, p, seed, BLOCK_SIZE: tl.constexpr, INT64: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = tile_start(pid, BLOCK_SIZE, INT64) + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    r = tl.rand(seed, offsets)                                   # the same numbers as the fused kernel
    tl.store(keep_ptr + offsets, (r >= p).to(tl.int8), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch configuration: a pure function of (n_elements, dtype, DeviceInfo)
# ----------------------------------------------------------------------------------------------

MAX_BLOCK_SIZE = 2**16
# Offsets are int64 once a tile could reach 2^31 - 1: the margin (one largest tile) makes the
# choice independent of BLOCK_SIZE, so every kernel agrees on it (and on the dropout mask).
INT64_THRESHOLD = 2**31 - MAX_BLOCK_SIZE
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DROPOUT_MAX_BLOCK = 1024  # Philox costs ~10 rounds of integer work per element: smaller tiles


@dataclass(frozen=True)
class LaunchConfig:
    """What a launcher passes to an elementwise kernel for one (n_elements, dtype, device)."""

    BLOCK_SIZE: int
    num_warps: int
    int64: bool
    grid: tuple


def needs_int64(n_elements: int) -> bool:
    """True when element offsets (pid * BLOCK_SIZE + lane) could pass the int32 range."""
    return n_elements >= INT64_THRESHOLD


def input_dtypes(info: hardware.DeviceInfo) -> tuple[torch.dtype, ...]:
    """Input dtypes the elementwise kernels accept on ``info`` (no bfloat16 before sm_80)."""
    return FLOAT_DTYPES if info.has_bf16 else (torch.float32, torch.float16)


@functools.lru_cache(maxsize=4096)
def launch_config(n_elements: int, dtype: torch.dtype, info: hardware.DeviceInfo,
                  max_block: int = MAX_BLOCK_SIZE) -> LaunchConfig:
    """BLOCK_SIZE, num_warps, offset width and grid for ``n_elements`` of ``dtype`` on ``info``.

    On sm_90 a program takes 16 bytes per thread with 4 warps (512 float32 or 1024 16-bit elements):
    one 128-bit load and one store per thread, the pattern of ``copy_``. On an H100 (GELU, 256 MiB
    and 1 GiB, ``results/h100-80gb-hbm3/elementwise_tile_explore.csv``) that ran at copy speed in
    every dtype, where 4096 bf16 elements per program ran 1.4% slower; an H200 with the same tiles
    ran it at 98.9-100.8% of copy speed (``results/h200/elementwise.csv``). sm_80-89 keep the
    earlier choice, 1024 float32 or 4096 16-bit elements (an H200 sweep with the earlier, costlier
    GELU math; not measured on those GPUs), sm_75 (T4: a tenth of the bandwidth, 64 KiB of shared
    memory) 1024 or 2048. Smaller tensors get smaller tiles so that about 4 programs land on each
    SM, never below 16 bytes per thread. Under the interpreter
    (no SMs to fill) tiles are as large as allowed: fewer programs run faster in Python.
    ``max_block`` caps the tile for kernels with much arithmetic per element (the dropout's Philox).
    """
    if not isinstance(n_elements, int) or n_elements < 0:
        raise ValueError(f"n_elements must be a non-negative int, got {n_elements!r}")
    if dtype not in input_dtypes(info):
        raise TypeError(f"{info.name or f'sm_{info.arch}'} (sm_{info.arch}) takes "
                        f"{[str(d).removeprefix('torch.') for d in input_dtypes(info)]}, got {dtype}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if info == hardware.INTERPRETER_DEVICE:
        block = min(MAX_BLOCK_SIZE, max(16, triton.next_power_of_2(max(n_elements, 1))))
        num_warps = 4
    else:
        num_warps = 4
        min_block = 32 * num_warps * 16 // itemsize          # 16 bytes per thread
        if info.arch >= 90:
            block = min_block
        elif info.arch >= 80:
            block = 1024 if itemsize >= 4 else 4096
        else:
            block = 1024 if itemsize >= 4 else 2048
        fill = triton.next_power_of_2(max(1, -(-n_elements // (4 * info.sms))))
        block = max(min_block, min(block, fill))
    block = min(block, max_block)
    grid = (max(1, triton.cdiv(n_elements, block)),)
    return LaunchConfig(block, num_warps, needs_int64(n_elements), grid)


# ----------------------------------------------------------------------------------------------
# A lean launch path (GPU only)
# ----------------------------------------------------------------------------------------------
# ``kernel[grid](...)`` re-binds the arguments, recomputes the specialization key and looks up the
# compiled kernel on every call: microseconds of Python per launch, as long as a 1 MiB tensor
# takes on the GPU. After the first call we keep, per specialization, the compiled kernel's C
# launcher and call it directly, with raw device addresses instead of tensors (the launcher would
# otherwise call data_ptr() and ask the driver about every pointer). Anything unusual (a launch
# hook, count_launches wrapping the JIT, the interpreter, a kernel that needs scratch memory)
# takes the ordinary path. LAUNCHES counts which path each launch took.

try:  # pragma: no cover - the attribute paths are stable across Triton 3.x
    from triton import knobs as _knobs
    from triton.runtime.jit import JITFunction as _JITFunction
    _JIT_RUN = _JITFunction.run
except Exception:  # pragma: no cover
    _knobs, _JITFunction, _JIT_RUN = None, None, None

_COMPILED: dict = {}
_STREAM = None
FAST_LAUNCH = True  # set False to compare with Triton's ordinary launch path
LAUNCHES = {"lean": 0, "ordinary": 0}


def _int_spec(a):
    """What Triton specializes an int argument on: == 1, divisible by 16, and its width."""
    if type(a) is int:
        return (a == 1, a & 15 == 0, -(2**31) <= a < 2**31)
    return None


def _no_hook(hook) -> bool:
    # Triton 3.6 keeps launch hooks in a HookChain (never None): empty means no hook
    return hook is None or (type(hook).__name__ == "HookChain" and not hook.calls)


def _fast_ok() -> bool:
    return (FAST_LAUNCH and _JIT_RUN is not None and env.MODE == "cuda" and _JITFunction.run is _JIT_RUN
            and _no_hook(_knobs.runtime.launch_enter_hook) and _no_hook(_knobs.runtime.launch_exit_hook))


def _direct(compiled):
    """A function f(grid0, stream, *args) that launches ``compiled`` through its C launcher.

    Triton 3.6's launcher takes (grid x, y, z, stream, function, cooperative, pdl, global scratch,
    profile scratch, packed metadata, launch metadata, enter hook, exit hook, *args); kernels that
    need scratch memory or a launcher of another shape go through ``compiled.run`` instead.
    """
    launcher = compiled.run
    c_launch = getattr(launcher, "launch", None)
    plain = (c_launch is not None and getattr(launcher, "global_scratch_size", 1) == 0
             and getattr(launcher, "profile_scratch_size", 1) == 0 and hasattr(launcher, "launch_pdl"))
    function, packed = compiled.function, compiled.packed_metadata
    if plain:
        coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        return lambda grid0, stream, *args: c_launch(grid0, 1, 1, stream, function, coop, pdl, None, None,
                                                     packed, None, None, None, *args)
    return lambda grid0, stream, *args: launcher(grid0, 1, 1, stream, function, packed, None, None, None, *args)


def _cache_key(kernel, num_warps: int, meta: tuple, index: int, tensors: tuple, ptrs: list, scalars: tuple):
    """What tells two compilations of ``kernel`` apart: the tensors' dtypes and 16-byte alignment,
    for each int whether it is 1, divisible by 16 and fits in 32 bits (floats are not specialized).

    The launchers give every tensor of a call one dtype, so the first one's stands for all.
    """
    any_bits = 0
    for p in ptrs:
        any_bits |= p
    aligned = any_bits & 15 == 0 or tuple(p & 15 == 0 for p in ptrs)  # True: all 16-byte aligned
    return (kernel, num_warps, meta, index, tensors[0].dtype, aligned, *map(_int_spec, scalars))


def _launch(kernel, cfg: LaunchConfig, tensors: tuple, scalars: tuple, meta: tuple, meta_names: tuple):
    """Launch ``kernel[cfg.grid](*tensors, *scalars, **dict(zip(meta_names, meta)), num_warps=...)``.

    Every kernel of this module takes its tensors first, then its scalars, then its constexprs, and
    every launcher has checked that its tensors share one dtype and one device. Returns the direct
    launcher when every pointer is 16-byte aligned (what :func:`_remember` keeps), else None.
    """
    global _STREAM
    fast = _fast_ok()
    run = None
    if fast:
        index = tensors[0].get_device()
        ptrs = [t.data_ptr() for t in tensors]
        key = _cache_key(kernel, cfg.num_warps, meta, index, tensors, ptrs, scalars)
        run = _COMPILED.get(key)
        if run is not None:
            run(cfg.grid[0], _STREAM(index), *ptrs, *scalars, *meta)
            LAUNCHES["lean"] += 1
    if run is None:
        compiled = kernel[cfg.grid](*tensors, *scalars, **dict(zip(meta_names, meta, strict=True)),
                                    num_warps=cfg.num_warps)
        LAUNCHES["ordinary"] += 1
        if fast and compiled is not None and hasattr(compiled, "packed_metadata"):
            from triton.runtime import driver
            _STREAM = driver.active.get_current_stream
            run = _COMPILED[key] = _direct(compiled)
    return run if fast and key[5] is True else None


# The shortest path: after a full call has validated and launched, a later call with tensors of the
# same dtype and shapes needs only a few attribute reads before the C launcher. _LEAN maps
# (kernel, flag, dtype, shape) to what that call worked out.

@dataclass(frozen=True)
class _Lean:
    run: object        # the compiled kernel's direct launcher (16-byte aligned pointers)
    grid0: int
    fixed: tuple       # the int arguments the shapes fix (n_elements, n_cols)
    meta: tuple        # the constexprs
    index: int         # the CUDA device
    aux_shape: tuple   # shape of the second input (y of add, the bias), () when there is none


_LEAN: dict = {}


def _remember(run, key: tuple, cfg: LaunchConfig, fixed: tuple, meta: tuple, x, aux) -> None:
    if run is not None:
        _LEAN[key] = _Lean(run, cfg.grid[0], fixed, meta, x.get_device(),
                           () if aux is None else tuple(aux.shape))


def _lean_launch(key: tuple, x, aux, out, free: tuple):
    """Launch as an earlier call with these dtypes and shapes did; the output, or None when this
    call is not like that one (the caller then takes the full path, checks and all)."""
    lean = _LEAN.get(key)
    if lean is None or not (x.is_contiguous() and x.get_device() == lean.index) or not _fast_ok():
        return None
    if out is None:
        out = torch.empty_like(x)
    elif not _like(out, x, x.shape, lean.index):
        return None
    x_ptr, out_ptr = x.data_ptr(), out.data_ptr()
    if lean.aux_shape:
        if not _like(aux, x, lean.aux_shape, lean.index):
            return None
        aux_ptr = aux.data_ptr()
        if (x_ptr | aux_ptr | out_ptr) & 15:  # the kernel was compiled for 16-byte aligned pointers
            return None
        lean.run(lean.grid0, _STREAM(lean.index), x_ptr, aux_ptr, out_ptr, *lean.fixed, *free, *lean.meta)
    else:
        if (x_ptr | out_ptr) & 15:
            return None
        lean.run(lean.grid0, _STREAM(lean.index), x_ptr, out_ptr, *lean.fixed, *free, *lean.meta)
    LAUNCHES["lean"] += 1
    return out


def _like(t, x, shape, index: int) -> bool:
    """t is a contiguous tensor of x's dtype with this shape on CUDA device ``index``."""
    return (type(t) is torch.Tensor and t.dtype is x.dtype and t.shape == shape and t.is_contiguous()
            and t.get_device() == index)


_INFO: dict = {}


def _device_info(x) -> hardware.DeviceInfo:
    """hardware.device_info() of the device ``x`` lives on, asked once per device (launchers call
    this per launch); for anything that is not a tensor, of the current device."""
    if type(x) is not torch.Tensor or not x.is_cuda:
        return hardware.device_info()
    index = x.get_device()
    info = _INFO.get(index)
    if info is None:
        with torch.cuda.device(index):
            info = _INFO[index] = hardware.device_info()
    return info


_CONFIGS: dict = {}


def _config(n: int, dtype: torch.dtype, info: hardware.DeviceInfo, max_block: int = MAX_BLOCK_SIZE) -> LaunchConfig:
    """launch_config(), remembered per (n, dtype, device): the per-launch lookup skips hashing a DeviceInfo."""
    key = (n, dtype, id(info), max_block)  # the DeviceInfo objects live in _INFO for good: ids stay unique
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = launch_config(n, dtype, info, max_block)
    return cfg


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_CHECKED: set = set()  # (dtype, device) pairs already validated: the per-call check stays cheap


def _check_tensor(name: str, t, info: hardware.DeviceInfo) -> None:
    if type(t) is torch.Tensor and t.is_contiguous() and (t.dtype, t.device) in _CHECKED:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != env.DEVICE.type:
        raise ValueError(f"{name} is on {t.device}, but in {env.MODE} mode the kernels run on "
                         f"{env.DEVICE.type}: move it with {name}.to(cu.DEVICE)")
    if t.dtype not in input_dtypes(info):
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of "
                        f"{[str(d).removeprefix('torch.') for d in input_dtypes(info)]} on this device")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (strides {tuple(t.stride())}): these kernels index it as "
                         f"one flat array; pass {name}.contiguous() (a copy: one more read and write of it)")
    _CHECKED.add((t.dtype, t.device))


def _output(x: torch.Tensor, out, info) -> torch.Tensor:
    if out is None:
        return torch.empty_like(x)
    if (type(out) is torch.Tensor and out.dtype is x.dtype and out.is_contiguous()
            and out.device == x.device and out.shape == x.shape):  # x passed _check_tensor: so does out
        return out
    _check_tensor("out", out, info)
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must have the input's shape {tuple(x.shape)}, dtype {x.dtype} and device "
                         f"{x.device}, got {tuple(out.shape)} {out.dtype} {out.device}")
    return out


def _approximate_flag(approximate: str) -> bool:
    if approximate == "tanh":
        return True
    if approximate == "none":
        return False
    raise ValueError(f"approximate must be 'tanh' or 'none' (exact erf), got {approximate!r}")


def _check_bias(x: torch.Tensor, bias, info) -> int:
    if (type(bias) is torch.Tensor and bias.dim() == 1 and bias.dtype is x.dtype and bias.is_contiguous()
            and bias.device == x.device and x.dim() > 0 and bias.shape[0] == x.shape[-1]):
        return bias.shape[0]  # x passed _check_tensor: so does a bias like it
    _check_tensor("bias", bias, info)
    if x.dim() == 0 or bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias must be 1-D with one value per column of x (x.shape[-1] = "
                         f"{x.shape[-1] if x.dim() else 'none: x is 0-D'}), got shape {tuple(bias.shape)}")
    if bias.dtype != x.dtype:
        raise TypeError(f"bias has dtype {bias.dtype} but x has {x.dtype}: pass them in the same dtype")
    if bias.device != x.device:
        raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
    return bias.shape[0]


def add(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x + y`` for two tensors of the same shape and dtype, in one Triton kernel."""
    if type(x) is torch.Tensor:
        done = _lean_launch((_add_kernel, None, x.dtype, x.shape), x, y, out, ())
        if done is not None:
            return done
    info = _device_info(x)
    _check_tensor("x", x, info)
    _check_tensor("y", y, info)
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        raise ValueError(f"x and y must have the same shape, dtype and device, got {tuple(x.shape)} {x.dtype} "
                         f"{x.device} and {tuple(y.shape)} {y.dtype} {y.device}")
    out = _output(x, out, info)
    n = x.numel()
    if n == 0:
        return out
    cfg = _config(n, x.dtype, info)
    meta = (cfg.BLOCK_SIZE, cfg.int64)
    run = _launch(_add_kernel, cfg, (x, y, out), (n,), meta, ("BLOCK_SIZE", "INT64"))
    _remember(run, (_add_kernel, None, x.dtype, x.shape), cfg, (n,), meta, x, y)
    return out


def gelu(x: torch.Tensor, approximate: str = "tanh", out: torch.Tensor | None = None) -> torch.Tensor:
    """GELU of ``x`` in one kernel: ``approximate='tanh'`` (the tanh approximation) or ``'none'`` (erf)."""
    if type(x) is torch.Tensor:
        done = _lean_launch((_gelu_kernel, approximate, x.dtype, x.shape), x, None, out, ())
        if done is not None:
            return done
    info = _device_info(x)
    flag = _approximate_flag(approximate)
    _check_tensor("x", x, info)
    out = _output(x, out, info)
    n = x.numel()
    if n == 0:
        return out
    cfg = _config(n, x.dtype, info)
    meta = (cfg.BLOCK_SIZE, flag, cfg.int64)
    run = _launch(_gelu_kernel, cfg, (x, out), (n,), meta, ("BLOCK_SIZE", "APPROXIMATE", "INT64"))
    _remember(run, (_gelu_kernel, approximate, x.dtype, x.shape), cfg, (n,), meta, x, None)
    return out


_BIAS_META = ("BLOCK_SIZE", "APPROXIMATE", "INT64", "WRAPS")


def bias_gelu_scale(x: torch.Tensor, bias: torch.Tensor, scale: float, approximate: str = "tanh",
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(x + bias) * scale`` in one kernel; ``bias`` has one value per column (x.shape[-1])."""
    if type(x) is torch.Tensor and type(scale) is float and -math.inf < scale < math.inf:
        done = _lean_launch((_bias_gelu_scale_kernel, approximate, x.dtype, x.shape), x, bias, out, (scale,))
        if done is not None:
            return done
    info = _device_info(x)
    flag = _approximate_flag(approximate)
    _check_tensor("x", x, info)
    n_cols = _check_bias(x, bias, info)
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale}")
    out = _output(x, out, info)
    n = x.numel()
    if n == 0:
        return out
    cfg = _config(n, x.dtype, info)
    meta = (cfg.BLOCK_SIZE, flag, cfg.int64, bias_wraps(cfg.BLOCK_SIZE, n_cols))
    run = _launch(_bias_gelu_scale_kernel, cfg, (x, bias, out), (n, n_cols, scale), meta, _BIAS_META)
    _remember(run, (_bias_gelu_scale_kernel, approximate, x.dtype, x.shape), cfg, (n, n_cols), meta, x, bias)
    return out


def _check_dropout(p, seed) -> tuple[float, int]:
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1), got {p}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2^63), got {seed!r}")
    return p, seed


def bias_gelu_dropout(x: torch.Tensor, bias: torch.Tensor, p: float, seed: int, approximate: str = "tanh",
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``dropout(gelu(x + bias), p)`` in one kernel, the mask drawn in the kernel from ``seed``.

    Element i is kept when Philox(seed, i) >= p and then scaled by 1 / (1 - p): the same seed gives
    the same mask on any GPU and under the interpreter, whatever BLOCK_SIZE is.
    """
    info = _device_info(x)
    flag = _approximate_flag(approximate)
    p, seed = _check_dropout(p, seed)
    _check_tensor("x", x, info)
    n_cols = _check_bias(x, bias, info)
    out = _output(x, out, info)
    n = x.numel()
    if n == 0:
        return out
    cfg = _config(n, x.dtype, info, DROPOUT_MAX_BLOCK)
    _launch(_bias_gelu_dropout_kernel, cfg, (x, bias, out), (n, n_cols, p, 1.0 / (1.0 - p), seed),
            (cfg.BLOCK_SIZE, flag, cfg.int64, bias_wraps(cfg.BLOCK_SIZE, n_cols)), _BIAS_META)
    return out


def dropout_keep_mask(shape, p: float, seed: int, device=None) -> torch.Tensor:
    """The boolean keep mask :func:`bias_gelu_dropout` uses for ``shape``, ``p`` and ``seed``."""
    p, seed = _check_dropout(p, seed)
    device = torch.device(device) if device is not None else env.DEVICE
    keep = torch.empty(tuple(shape), dtype=torch.int8, device=device)
    n = keep.numel()
    if n == 0:
        return keep.bool()
    cfg = _config(n, torch.float32, _device_info(keep), DROPOUT_MAX_BLOCK)
    _launch(_keep_mask_kernel, cfg, (keep,), (n, p, seed), (cfg.BLOCK_SIZE, cfg.int64), ("BLOCK_SIZE", "INT64"))
    return keep.bool()


# ----------------------------------------------------------------------------------------------
# The same GELU in CUDA C++ (chapter 4 compares the three ways to fuse), built where nvcc exists
# ----------------------------------------------------------------------------------------------

CUDA_GELU_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cstdint>

__device__ __forceinline__ float gelu_tanh(float x) {
    const float a = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(a));   // CUDA's tanhf is accurate for any input
}

template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

// Grid-stride loop; each thread moves 16 bytes per load and store (V elements) where aligned.
template <typename T>
__global__ void gelu_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n, bool vectorize) {
    constexpr int V = 16 / sizeof(T);
    using P = Pack<T, V>;
    const int64_t n_vec = vectorize ? n / V : 0;
    const int64_t start = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t k = start; k < n_vec; k += stride) {
        P p = reinterpret_cast<const P*>(x)[k];
        #pragma unroll
        for (int j = 0; j < V; ++j) p.v[j] = static_cast<T>(gelu_tanh(static_cast<float>(p.v[j])));
        reinterpret_cast<P*>(y)[k] = p;
    }
    for (int64_t k = n_vec * V + start; k < n; k += stride)
        y[k] = static_cast<T>(gelu_tanh(static_cast<float>(x[k])));
}

torch::Tensor gelu_cuda(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
    auto y = torch::empty_like(x);
    const int64_t n = x.numel();
    if (n == 0) return y;
    const int threads = 256;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gelu_cuda", [&] {
        constexpr int V = 16 / sizeof(scalar_t);
        const bool vectorize = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0
                               && reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0;
        const int64_t work = vectorize ? (n + V - 1) / V : n;
        const int64_t blocks =
            std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, 1 << 20));
        gelu_kernel<scalar_t><<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
            x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), n, vectorize);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return y;
}
"""


def cuda_gelu_unavailable() -> str | None:
    """Why the CUDA C++ GELU cannot be built here, or None when it can (a GPU and nvcc)."""
    import shutil

    if not env.on_gpu():
        return "no CUDA GPU here (interpreter mode): the CUDA C++ version needs a GPU and nvcc"
    from torch.utils.cpp_extension import CUDA_HOME
    if shutil.which("nvcc") is None and not (CUDA_HOME and shutil.which("nvcc", path=f"{CUDA_HOME}/bin")):
        return "nvcc (the CUDA compiler) is not installed: torch.utils.cpp_extension cannot build the kernel"
    return None


@functools.lru_cache(maxsize=1)
def load_cuda_gelu():
    """Build (once; about a minute) and return the extension module with ``gelu_cuda(x)``."""
    reason = cuda_gelu_unavailable()
    if reason:
        raise RuntimeError(reason)
    from torch.utils.cpp_extension import load_inline
    return load_inline(name="course_gelu_cuda", cpp_sources="torch::Tensor gelu_cuda(torch::Tensor x);",
                       cuda_sources=CUDA_GELU_SOURCE, functions=["gelu_cuda"],
                       extra_cuda_cflags=["-O3"], verbose=False)


def gelu_cuda(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU through the CUDA C++ kernel above (GPU with nvcc only)."""
    return load_cuda_gelu().gelu_cuda(x)


# ----------------------------------------------------------------------------------------------
# PyTorch references (eager, unfused: one kernel per operator)
# ----------------------------------------------------------------------------------------------

def add_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


def gelu_ref(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GELU written operator by operator, as a student would in eager PyTorch (9 kernels for tanh)."""
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    if approximate == "none":
        return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))
    raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")


def bias_gelu_scale_ref(x: torch.Tensor, bias: torch.Tensor, scale: float, approximate: str = "tanh"):
    """The eager chain: add, F.gelu, mul (three kernels, two intermediates through HBM)."""
    return F.gelu(x + bias, approximate=approximate) * scale


def bias_gelu_dropout_ref(x: torch.Tensor, bias: torch.Tensor, p: float, seed: int,
                          approximate: str = "tanh"):
    """The eager chain with the fused kernel's own mask (torch's dropout draws different numbers)."""
    keep = dropout_keep_mask(x.shape, p, seed, device=x.device)
    return F.gelu(x + bias, approximate=approximate) * keep.to(x.dtype) / (1.0 - p)
