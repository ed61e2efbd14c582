"""The time model: what the DRAM counters see (L2 reuse, dirty lines) and a roofline + launch
estimate of a sequence of kernels.

:func:`estimate_time` is ``max(bytes / bandwidth, flops / peak)`` per kernel (the roofline of
:mod:`course_utils.ceilings`) plus ``launches x launch overhead`` (:mod:`.launch`: recorded on a
named host), with an optional estimate of L2 reuse between consecutive kernels. The machine is a
:class:`course_utils.ceilings.Ceilings` (``machine`` builds one from the hardware table).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..ceilings import Ceilings, roofline_seconds
from .launch import LAUNCH_OVERHEAD_US
from .model import Comparison, Kernel, Traffic
from .units import _count, dtype_name

#: L2 reuse between consecutive kernels (:func:`l2_hit_fraction`): a tensor the previous kernel
#: touched is found in L2 entirely when that kernel's footprint (bytes read + written) is at most
#: ``L2_REUSE_FULL`` x L2, not at all above ``L2_REUSE_NONE`` x L2, linearly in between. Fitted to
#: the Nsight Compute measurements with a warm L2 (``--cache-control none``) on an H100
#: (``results/h100-80gb-hbm3/dram_traffic.csv``): full reuse at 0.25-0.5x L2, 13-74% at 1x, none at 2x.
L2_REUSE_FULL = 0.5
L2_REUSE_NONE = 1.25

#: Share of the L2 still holding a kernel's dirty output lines when the kernel ends, per unit of
#: its write share of traffic (:func:`dram_bytes_cold`). Fitted to the same H100 measurements with
#: a flushed L2 (``--cache-control all``): a kernel that writes as much as it reads leaves 22-24 MB
#: of its output in the 50 MiB L2, one that reads two streams 17-19 MB; 0.88 is the median over kernels.
L2_DIRTY_FRACTION = 0.88


def l2_hit_fraction(footprint_bytes: float, l2_bytes: float) -> float:
    """Share of a tensor the previous kernel touched that the next kernel finds in L2.

    1 when the previous kernel's footprint (bytes read + written) is at most
    ``L2_REUSE_FULL`` x L2, 0 above ``L2_REUSE_NONE`` x L2, linear in between (fitted on an H100).
    """
    if l2_bytes <= 0:
        return 0.0
    x = footprint_bytes / l2_bytes
    return min(1.0, max(0.0, (L2_REUSE_NONE - x) / (L2_REUSE_NONE - L2_REUSE_FULL)))


def dram_bytes_cold(kernel: Kernel, l2_bytes: float) -> tuple[float, float]:
    """(read, write) DRAM bytes of one kernel started on a flushed L2, as ``ncu`` measures them.

    Reads: all of them (the L2 is cold). Writes: all but the output lines still dirty in L2 when
    the kernel ends; the L2 then holds recently touched lines in proportion to the kernel's
    traffic, so about ``L2_DIRTY_FRACTION`` x L2 x (write share) of them are the kernel's output.
    """
    if kernel.total_bytes == 0:
        return 0.0, 0.0
    share = kernel.write_bytes / kernel.total_bytes
    resident = min(kernel.write_bytes, L2_DIRTY_FRACTION * l2_bytes * share)
    return float(kernel.read_bytes), kernel.write_bytes - resident


#: The time model's machine is the course's one type for a GPU's ceilings (see :mod:`..ceilings`).
Machine = Ceilings


def machine(gpu="h100-sxm", dtype="bfloat16", *, hbm_gbps=None, peak_tflops=None, l2_bytes=None,
            launch_us=None) -> Ceilings:
    """Ceilings from the hardware table (a key such as 'h100-sxm' or a device name), any of which
    can be replaced by a measured value (``hbm_gbps`` from a copy, ``peak_tflops`` from a matmul).

    ``gpu=None`` needs all three of ``hbm_gbps``, ``peak_tflops`` and ``l2_bytes``. ``launch_us``
    defaults to the recorded host cost per launch, :data:`LAUNCH_OVERHEAD_US`.
    """
    launch_us = LAUNCH_OVERHEAD_US if launch_us is None else launch_us
    if gpu is None:
        if None in (hbm_gbps, peak_tflops, l2_bytes):
            raise ValueError("gpu: with gpu=None give hbm_gbps, peak_tflops and l2_bytes")
        name, key = "measured", dtype_name(dtype)
    else:
        from .. import hardware  # imported here: the hardware table needs torch, this module does not

        spec = gpu if hasattr(gpu, "tflops") else hardware.lookup(gpu)
        name = spec.name
        key = dtype_name(dtype)
        key = "float16" if key in ("float8_e4m3fn", "float8_e5m2") else key
        if peak_tflops is None:
            try:
                peak_tflops = spec.peak_tflops(key)
            except ValueError as e:
                raise ValueError(f"dtype: {e}") from None
        hbm_gbps = spec.hbm_gbps if hbm_gbps is None else hbm_gbps
        l2_bytes = spec.l2_bytes if l2_bytes is None else l2_bytes
    for arg, v in (("hbm_gbps", hbm_gbps), ("peak_tflops", peak_tflops)):
        if not (isinstance(v, (int, float)) and v > 0):
            raise ValueError(f"{arg} must be positive, got {v!r}")
    if not (isinstance(launch_us, (int, float)) and launch_us >= 0):
        raise ValueError(f"launch_us must be >= 0, got {launch_us!r}")
    source = "datasheet" if gpu is not None and hbm_gbps == spec.hbm_gbps else "measured"
    return Ceilings(name, float(hbm_gbps), float(peak_tflops), key, source, "",
                    _count("l2_bytes", l2_bytes, allow_zero=True), float(launch_us))


def machine_from_ceilings(ceilings, *, l2_bytes=None, launch_us=None) -> Ceilings:
    """The time model's ceilings from measured ones (a :class:`Ceilings`: ``gpu``, ``copy_gbps``,
    ``matmul_tflops``), e.g. ``bench.measure_ceilings()`` on the GPU in hand or
    ``bench.Ceilings.from_frame(bench.recorded("ceilings"))`` without one.

    The copy bandwidth counts bytes read + written, as this package does. The L2 size and the
    launch cost are the ceilings' own (else the hardware table's L2 and the recorded launch
    overhead), unless given. The matmul rate stands for every
    dtype's peak: the memory-bound kernels of this chapter never reach it.
    """
    for attr in ("gpu", "copy_gbps", "matmul_tflops"):
        if not hasattr(ceilings, attr):
            raise ValueError(f"ceilings: expected a bench.Ceilings (with {attr}), got {type(ceilings).__name__}")
    if launch_us is None:
        launch_us = getattr(ceilings, "launch_us", None)
    if l2_bytes is None:
        l2_bytes = getattr(ceilings, "l2_bytes", 0) or None
    if l2_bytes is None:
        from .. import hardware
        try:
            l2_bytes = hardware.lookup(str(ceilings.gpu)).l2_bytes
        except ValueError as e:
            raise ValueError(f"l2_bytes: give it, the GPU is not in the table ({e})") from None
    m = machine(None, getattr(ceilings, "matmul_dtype", "bfloat16"), hbm_gbps=ceilings.copy_gbps,
                peak_tflops=ceilings.matmul_tflops, l2_bytes=l2_bytes, launch_us=launch_us)
    return dataclasses.replace(m, gpu=f"{ceilings.gpu} (measured)", source=getattr(ceilings, "source", "measured"))


@dataclass(frozen=True)
class TimeEstimate:
    """What :func:`estimate_time` predicts, with its parts (seconds) and the HBM bytes it assumed."""

    seconds: float
    memory_s: float
    compute_s: float
    launch_s: float
    hbm_bytes: float
    l2_hit_bytes: float
    launches: int

    @property
    def us(self) -> float:
        return self.seconds * 1e6


def estimate_time(traffic: Traffic, gpu="h100-sxm", dtype="bfloat16", *, l2_reuse=True,
                  overlap_launches=False, **ceilings) -> TimeEstimate:
    """Time of a sequence of kernels: sum of ``max(hbm bytes / bandwidth, flops / peak)`` per
    kernel, plus ``launches x launch overhead``.

    ``l2_reuse``: a kernel's reads of data the previous kernel touched come from L2 in the share
    :func:`l2_hit_fraction` gives (writes are counted in full: dirty lines reach HBM eventually).
    ``overlap_launches``: the host enqueues kernels while the GPU runs earlier ones, so each kernel
    costs ``max(device time, launch overhead)`` instead of their sum (what eager PyTorch does on
    large tensors). ``ceilings``: ``hbm_gbps``, ``peak_tflops``, ``l2_bytes``, ``launch_us`` (see
    :func:`machine`); ``gpu`` may also be a :class:`Machine`.
    """
    if not isinstance(traffic, Traffic):
        raise ValueError(f"traffic must be a Traffic (e.g. comparison.unfused), got {type(traffic).__name__}")
    mach = gpu if isinstance(gpu, Ceilings) else machine(gpu, dtype, **ceilings)
    launch = (LAUNCH_OVERHEAD_US if mach.launch_us is None else mach.launch_us) * 1e-6
    l2 = mach.l2_bytes
    total = mem_total = comp_total = hbm_total = hit_total = 0.0
    prev = None
    for kern in traffic.kernels:
        hit = 0.0
        if l2_reuse and prev is not None:
            hit = kern.reuse_bytes * l2_hit_fraction(prev.total_bytes, l2)
        hbm = kern.total_bytes - hit
        mem, comp = roofline_seconds(hbm, kern.flops, mach.hbm_gbps, mach.peak_tflops)
        device = max(mem, comp)
        total += max(device, launch) if overlap_launches else device + launch
        mem_total += mem
        comp_total += comp
        hbm_total += hbm
        hit_total += hit
        prev = kern
    return TimeEstimate(total, mem_total, comp_total, traffic.launches * launch, hbm_total, hit_total,
                        traffic.launches)


def speedup(comparison: Comparison, gpu="h100-sxm", dtype="bfloat16", **options) -> dict:
    """Fusion's payoff: the traffic-only ceiling and the time model's estimate, side by side."""
    if not isinstance(comparison, Comparison):
        raise ValueError(f"comparison must be a Comparison, got {type(comparison).__name__}")
    t_unfused = estimate_time(comparison.unfused, gpu, dtype, **options)
    t_fused = estimate_time(comparison.fused, gpu, dtype, **options)
    return {"traffic_ratio": comparison.ratio, "unfused_us": t_unfused.us, "fused_us": t_fused.us,
            "estimated_speedup": t_unfused.seconds / t_fused.seconds}


__all__ = ["L2_REUSE_FULL", "L2_REUSE_NONE", "L2_DIRTY_FRACTION", "l2_hit_fraction", "dram_bytes_cold", "Machine",
           "machine", "machine_from_ceilings", "TimeEstimate", "estimate_time", "speedup"]
