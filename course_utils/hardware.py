"""GPU specifications, lookup of the GPU in hand, and measuring its real ceilings.

Datasheet numbers are upper bounds: a kernel is judged against the measured ceilings of the GPU it
runs on (:func:`measure_copy_gbps`, :func:`measure_matmul_tflops`), and the table is for what-if
questions about GPUs you do not have. Peak FLOP/s are dense (no structured sparsity); the tensor-core
rates for fp16/bf16 assume fp32 accumulation, which is what the course's kernels use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from . import env, timing
from .ceilings import Ceilings, ridge_point


@dataclass(frozen=True)
class GPUSpec:
    key: str
    name: str
    arch: str                 # compute capability as 'sm_XX'
    hbm_gbps: float           # datasheet DRAM bandwidth, GB/s (1e9 bytes per second)
    sms: int
    smem_per_sm_kib: int      # shared memory per SM
    smem_per_block_kib: int   # the most one program (thread block) can ask for
    l2_mib: float
    tflops: dict = field(default_factory=dict)  # dtype name -> dense peak TFLOP/s
    aliases: tuple = ()       # substrings of torch.cuda.get_device_name() that identify it

    @property
    def l2_bytes(self) -> int:
        return int(self.l2_mib * 2**20)

    def peak_tflops(self, dtype: str) -> float:
        if dtype not in self.tflops:
            raise ValueError(f"{self.name} has no {dtype} peak in the table (it has: {sorted(self.tflops)})")
        return self.tflops[dtype]

    def ridge_flops_per_byte(self, dtype: str) -> float:
        """Arithmetic intensity at which the roofline turns from memory- to compute-bound."""
        return ridge_point(self.peak_tflops(dtype), self.hbm_gbps)

    def ceilings(self, dtype: str = "bfloat16") -> Ceilings:
        """The datasheet's ceilings (upper bounds: real kernels reach less; measure on the GPU)."""
        dt = dtype if dtype in self.tflops else "float16"
        return Ceilings(self.name, self.hbm_gbps, self.tflops[dt], dt, "datasheet",
                        "datasheet peaks (nothing measured)", self.l2_bytes)


def _spec(key, name, arch, gbps, sms, smem_sm, smem_block, l2, fp32, fp16, bf16, tf32, aliases):
    flops = {"float32": fp32, "float16": fp16, "tf32": tf32}
    if bf16:
        flops["bfloat16"] = bf16
    return GPUSpec(key, name, arch, gbps, sms, smem_sm, smem_block, l2, flops, aliases)


# Sources (dense rates, i.e. half the "with sparsity" figures of the datasheets; fp16/bf16 with fp32
# accumulation): NVIDIA datasheets for T4, L4, A100 (40/80 GB, SXM and PCIe), H100 (SXM and PCIe) and
# H200; the Ampere GA102 and Ada AD102 whitepapers for the RTX 3090/4090 (GeForce tensor cores run
# fp16/bf16 with fp32 accumulation at half their fp16-accumulate rate). The A10G (AWS G5) has no NVIDIA
# datasheet: 80 SMs as the driver reports them, FP32 35 and tensor rates as AWS/Baseten publish them
# (unlike the 72-SM A10, whose datasheet says 31.2 / 62.5 / 125). L2 of the H100 and H200 as torch
# reports it on the course's lent machines (50 MiB and 60 MiB); shared memory per SM and the per-block
# opt-in limit from the CUDA programming guide's table for each compute capability.
SPECS: dict[str, GPUSpec] = {s.key: s for s in [
    #      key          name                    arch    GB/s  SMs smem/SM blk  L2MiB  fp32  fp16   bf16   tf32
    _spec("t4", "Tesla T4", "sm_75", 320, 40, 64, 64, 4, 8.1, 65, None, None, ("T4",)),
    _spec("l4", "NVIDIA L4", "sm_89", 300, 58, 100, 99, 48, 30.3, 121, 121, 60, ("L4",)),
    _spec("a10g", "NVIDIA A10G", "sm_86", 600, 80, 100, 99, 6, 35, 70, 70, 35, ("A10G",)),
    _spec("a100-40gb", "NVIDIA A100 40GB", "sm_80", 1555, 108, 164, 163, 40, 19.5, 312, 312, 156,
          ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB")),
    _spec("a100-80gb", "NVIDIA A100 80GB (SXM)", "sm_80", 2039, 108, 164, 163, 80, 19.5, 312, 312, 156,
          ("A100-SXM4-80GB", "A100-SXM-80GB", "A100 80GB")),
    _spec("a100-80gb-pcie", "NVIDIA A100 80GB PCIe", "sm_80", 1935, 108, 164, 163, 80, 19.5, 312, 312, 156,
          ("A100 80GB PCIe", "A100-PCIE-80GB")),
    _spec("h100-sxm", "NVIDIA H100 SXM 80GB", "sm_90", 3350, 132, 228, 227, 50, 67, 989, 989, 495,
          ("H100 80GB HBM3", "H100 SXM")),
    _spec("h100-pcie", "NVIDIA H100 PCIe 80GB", "sm_90", 2000, 114, 228, 227, 50, 51, 756, 756, 378,
          ("H100 PCIe",)),
    _spec("h200", "NVIDIA H200", "sm_90", 4800, 132, 228, 227, 60, 67, 989, 989, 495, ("H200",)),
    _spec("rtx3090", "NVIDIA GeForce RTX 3090", "sm_86", 936, 82, 100, 99, 6, 35.6, 71, 71, 35.6,
          ("RTX 3090",)),
    _spec("rtx4090", "NVIDIA GeForce RTX 4090", "sm_89", 1008, 128, 100, 99, 72, 82.6, 165.2, 165.2, 82.6,
          ("RTX 4090",)),
]}


def lookup(name: str) -> GPUSpec:
    """The spec for a key ('h100-sxm') or a device name ('NVIDIA H100 80GB HBM3')."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"gpu must be a non-empty string, got {name!r}")
    if name in SPECS:
        return SPECS[name]
    hits = [(len(a), s) for s in SPECS.values() for a in s.aliases if _names(a, name)]
    if not hits:
        raise ValueError(f"unknown GPU {name!r}: known keys are {sorted(SPECS)}")
    return max(hits, key=lambda hit: hit[0])[1]


def _names(alias: str, name: str) -> bool:
    """True when ``alias`` appears in ``name`` as whole words ('L4' is not in 'NVIDIA L40S')."""
    return re.search(rf"(?<![a-z0-9]){re.escape(alias.lower())}(?![a-z0-9])", name.lower()) is not None


def current() -> GPUSpec | None:
    """The spec of the GPU torch sees, or None (no GPU, or a GPU missing from the table)."""
    if not torch.cuda.is_available():
        return None
    try:
        return lookup(torch.cuda.get_device_name())
    except ValueError:
        return None


def device_properties() -> dict:
    """What the driver says about the GPU in hand (no table needed)."""
    p = torch.cuda.get_device_properties(0)
    return {"name": p.name, "sms": p.multi_processor_count, "l2_bytes": getattr(p, "L2_cache_size", 0),
            "arch": f"sm_{p.major}{p.minor}", "memory_gib": p.total_memory / 2**30,
            "smem_per_block_bytes": getattr(p, "shared_memory_per_block_optin", 0)}


def _need_gpu(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} measures the GPU in hand, and torch sees no CUDA GPU; "
                           "under the interpreter read the recorded ceilings: bench.recorded('ceilings')")


def measure_copy_gbps(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth of the GPU in hand, GB/s, counting bytes read + written."""
    _need_gpu("measure_copy_gbps")
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    t = timing.time_ms(lambda: dst.copy_(src), flush_l2=False)
    return timing.gbps(2 * src.numel() * 4, t)


def measure_matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense matmul rate of the GPU in hand on random data, TFLOP/s."""
    _need_gpu("measure_matmul_tflops")
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    t = timing.time_ms(lambda: a @ b, flush_l2=False)
    return timing.tflops(2 * n**3, t)


@dataclass(frozen=True)
class DeviceInfo:
    """What a launcher needs to choose tiles and dtypes, with or without the GPU in hand.

    Launchers call pure functions of a DeviceInfo, so the compile matrix can ask what a launcher
    would pick on a T4 (sm_75), an A100 (sm_80) or an H100 (sm_90) on a machine with no GPU.
    """

    arch: int                   # compute capability as an int: 75, 80, 86, 89, 90
    sms: int
    smem_per_block_bytes: int   # the most shared memory one program can ask for
    name: str = ""

    @property
    def has_bf16(self) -> bool:
        return self.arch >= 80

    @classmethod
    def from_spec(cls, spec: GPUSpec) -> DeviceInfo:
        return cls(int(spec.arch.removeprefix("sm_")), spec.sms, spec.smem_per_block_kib * 1024, spec.name)

    @classmethod
    def for_arch(cls, arch: int) -> DeviceInfo:
        """A representative GPU of an architecture: 75 -> T4, 80 -> A100, 90 -> H100 SXM."""
        key = {75: "t4", 80: "a100-80gb", 86: "a10g", 89: "l4", 90: "h100-sxm"}.get(arch)
        if key is None:
            raise ValueError(f"no representative GPU for sm_{arch}; expected one of 75, 80, 86, 89, 90")
        return cls.from_spec(SPECS[key])


# What launchers assume under the interpreter: an sm_80-class device (tiles that also fit a GPU).
INTERPRETER_DEVICE = DeviceInfo(80, 108, 163 * 1024, "Triton interpreter (CPU)")


_DEVICE_INFO: dict[int, DeviceInfo] = {}


def device_info(device=None) -> DeviceInfo:
    """The DeviceInfo of a GPU (``device``: a tensor, a ``torch.device``, an index, or None for the
    current one), or :data:`INTERPRETER_DEVICE` without a GPU.

    Asked of the driver once per device and cached, so launchers may call it on every launch;
    ``device_info.cache_clear()`` forgets what was asked (tests).
    """
    if not env.on_gpu():
        return INTERPRETER_DEVICE
    if isinstance(device, torch.Tensor):
        device = device.device
    if isinstance(device, torch.device):
        device = device.index if device.type == "cuda" else None
    index = torch.cuda.current_device() if device is None else int(device)
    info = _DEVICE_INFO.get(index)
    if info is None:
        p = torch.cuda.get_device_properties(index)
        smem = getattr(p, "shared_memory_per_block_optin", 0) or 48 * 1024
        info = _DEVICE_INFO[index] = DeviceInfo(p.major * 10 + p.minor, p.multi_processor_count, smem, p.name)
    return info


device_info.cache_clear = _DEVICE_INFO.clear
