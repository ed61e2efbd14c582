"""Launch configuration of the tuned elementwise kernels (:mod:`course_utils.tuned.elementwise`).

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

from .. import hardware

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


