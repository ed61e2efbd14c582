"""Launch configuration and argument checks of the tuned elementwise kernels
(:mod:`course_utils.tuned.elementwise`).

:func:`launch_config` is a pure function of the element count, the dtype and a
:class:`~course_utils.hardware.DeviceInfo`, so what a launcher would pick on a T4, an A100 or an
H100 can be asked on a machine with no GPU; :func:`config_for` is what a launch calls, remembered per
(size, dtype, device) so that a call costs a dictionary lookup, not a recomputation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from .. import env, hardware
from ..kernels.layouts import is_dense, lead_layout

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
    SM, never below 16 bytes per thread. Under the interpreter (no SMs to fill) tiles are as large
    as allowed: fewer programs run faster in Python. ``max_block`` caps the tile for kernels with
    much arithmetic per element (the dropout's Philox).
    """
    if not isinstance(n_elements, int) or n_elements < 0:
        raise ValueError(f"n_elements must be a non-negative int, got {n_elements!r}")
    if dtype not in input_dtypes(info):
        raise TypeError(f"{info.name or 'this GPU'} (sm_{info.arch}) takes "
                        f"{[str(d).removeprefix('torch.') for d in input_dtypes(info)]}, got {dtype}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    num_warps = 4
    if info == hardware.INTERPRETER_DEVICE:
        block = min(MAX_BLOCK_SIZE, max(16, triton.next_power_of_2(max(n_elements, 1))))
    else:
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
    return LaunchConfig(block, num_warps, needs_int64(n_elements), (max(1, triton.cdiv(n_elements, block)),))


_CONFIGS: dict = {}   # (n, dtype, device index, max_block) -> LaunchConfig, without hashing a DeviceInfo


def device_of(t: torch.Tensor) -> hardware.DeviceInfo:
    """The DeviceInfo of the GPU ``t`` lives on (hardware.device_info caches it per device); for a
    CPU tensor (the interpreter, or the compile matrix pretending to be a GPU) the current one."""
    return hardware.device_info(t.get_device()) if t.is_cuda else hardware.device_info()


def config_for(x: torch.Tensor, dtype: torch.dtype, max_block: int = MAX_BLOCK_SIZE) -> LaunchConfig:
    """launch_config() for ``x``'s size on its device, remembered per (size, dtype, device)."""
    if not x.is_cuda:
        return launch_config(x.numel(), dtype, device_of(x), max_block)
    key = (x.numel(), dtype, x.get_device(), max_block)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        if len(_CONFIGS) >= 4096:  # many distinct sizes (a sweep): start over rather than grow
            _CONFIGS.clear()
        cfg = _CONFIGS[key] = launch_config(key[0], dtype, device_of(x), max_block)
    return cfg




# Argument checks of the launchers (the full check once per (dtype, device); the rest every call)

_CHECKED: set = set()


def _check_tensor(name: str, t, any_layout: bool = False) -> None:
    if type(t) is torch.Tensor and t.is_contiguous() and (t.dtype, t.device) in _CHECKED:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != env.DEVICE.type:
        raise ValueError(f"{name} is on {t.device}, but in {env.MODE} mode the kernels run on "
                         f"{env.DEVICE.type}: move it with {name}.to(cu.DEVICE)")
    allowed = input_dtypes(device_of(t))
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of "
                        f"{[str(d).removeprefix('torch.') for d in allowed]} on this device")
    if not any_layout and not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (strides {tuple(t.stride())}): these kernels index it as "
                         f"one flat array; pass {name}.contiguous() (a copy: one more read and write of it)")
    _CHECKED.add((t.dtype, t.device))


def _same(name: str, t, x: torch.Tensor, shape, what: str, any_layout: bool = False) -> None:
    """``t`` passes the tensor checks and has x's dtype and device and this shape."""
    _check_tensor(name, t, any_layout)
    if t.shape != shape or t.dtype != x.dtype or t.device != x.device:
        raise ValueError(f"{name} must {what}: shape {tuple(shape)}, dtype {x.dtype}, device {x.device}; "
                         f"got {tuple(t.shape)} {t.dtype} {t.device}")


def _output(x: torch.Tensor, out) -> torch.Tensor:
    if out is None:  # x's strides when x is dense in memory (a transpose), else contiguous
        return torch.empty_like(x)
    strided = not x.is_contiguous()
    _same("out", out, x, x.shape, "match the input (same shape, dtype and device)", strided)
    if strided and [st for st, n in zip(out.stride(), out.shape) if n != 1] != \
            [st for st, n in zip(torch.empty_like(x, device="meta").stride(), x.shape) if n != 1]:
        raise ValueError(f"out must have the strides the kernel writes ({torch.empty_like(x, device='meta').stride()}"
                         f": x's, for an x dense in memory, else contiguous), got {out.stride()}")
    return out


def _flat(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` when contiguous, or dense with leading dims the strided bias kernel addresses (it is read
    in place and the output gets its strides), else one contiguous copy (one more read and write)."""
    _check_tensor(name, t, any_layout=True)
    return t if t.is_contiguous() or (dense_in_memory(t) and lead_layout(t) is not None) else t.contiguous()


def _approximate_flag(approximate: str) -> bool:
    if approximate == "tanh":
        return True
    if approximate == "none":
        return False
    raise ValueError(f"approximate must be 'tanh' or 'none' (exact erf), got {approximate!r}")


def _check_bias(x: torch.Tensor, bias) -> int:
    _check_tensor("bias", bias)
    if x.dim() == 0 or bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias must be 1-D with one value per column of x (x.shape[-1] = "
                         f"{x.shape[-1] if x.dim() else 'none: x is 0-D'}), got shape {tuple(bias.shape)}")
    if bias.dtype != x.dtype:
        raise TypeError(f"bias has dtype {bias.dtype} but x has {x.dtype}: pass them in the same dtype")
    if bias.device != x.device:
        raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
    return bias.shape[0]


# How an input's elements lie in memory (the GELU launchers accept any layout)

# dense_in_memory(t): True when t's elements fill one block of memory without gaps or overlaps
# (contiguous, or a transpose or permutation of a contiguous tensor). An elementwise kernel may then walk
# the block in memory order and write an output with the same strides (the teaching shelf's is_dense).
dense_in_memory = is_dense


def rows_of(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``(n_rows, n_cols, row_stride)`` when ``t`` is rows of contiguous columns one row stride apart
    (``x[:, :k]``, ``x[::2]``, a broadcast row; leading dims merged as ``t.view(-1, n_cols)`` merges
    them), else None."""
    if t.dim() == 0:
        return None
    try:
        v = t.view(-1, t.shape[-1])
    except RuntimeError:  # the leading dims do not merge into one row index
        return None
    if v.shape[1] > 1 and v.stride(1) != 1:
        return None
    return v.shape[0], v.shape[1], v.stride(0)


def dropout_args(p, seed) -> tuple[float, int]:
    """``(p, seed)`` checked: p in [0, 1), seed an int in [0, 2^63)."""
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1), got {p}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2^63), got {seed!r}")
    return p, seed
