"""HBM-traffic calculators and a roofline + launch time model (pure Python: no torch import).

One module per job, every name importable from ``course_utils.traffic``: :mod:`.units` (dtypes,
argument checks), :mod:`.model` (``Kernel``, ``Traffic``, ``Comparison``, ``Op``), :mod:`.ops`
(elementwise chains, GELU, softmax, bias+GELU+dropout, LayerNorm), :mod:`.matmul` (GEMM prologue
and epilogue, attention), :mod:`.launch` (the recorded launch overhead), :mod:`.timemodel` (L2,
the time estimate), :mod:`.ncu` (the Nsight Compute comparison), :mod:`.backward` (backward passes),
:mod:`.classifier` (the LM head + cross-entropy: eager, unchunked fused, chunked fused; bytes and memory),
:mod:`.optimizer` (the AdamW step under mixed precision), :mod:`.links` (bytes across NVLink per collective, the
alpha-beta model).

Conventions, stated once and used everywhere in the course:

- **Logical traffic.** A kernel reads each tensor it takes from HBM once and writes each tensor it
  produces once; bytes = elements x bytes per element. This is what a calculator can count; what
  the DRAM counters see differs by what the L2 cache catches (see :func:`dram_bytes_cold`).
- **Unfused** means one kernel per op (eager PyTorch): every intermediate is written once by its
  producer and read once by its consumer. **Fused** means one kernel: each distinct input is read
  once, the final output written once, intermediates stay in registers.
- **Operands** of an elementwise op, besides the running value: ``"full"`` (another tensor of the
  same shape), ``"col"`` (a per-column vector of length ``cols``, e.g. a bias), ``"row"`` (a per-row
  vector of length ``rows``), ``"scalar"`` (a Python number passed as a kernel argument: 0 bytes)
  and ``"input"`` (the chain's own input ``x`` again: eager reads it again, a fused kernel already
  holds it in registers).
- Shapes are ``numel`` or a tuple whose last entry is ``cols`` (rows = product of the others).
- MB = 1e6 bytes, MiB = 2**20 bytes; GB/s = 1e9 bytes per second.

The time model (:func:`estimate_time`) is ``max(bytes / bandwidth, flops / peak)`` per kernel plus
``launches x launch overhead`` (recorded on a named host: :data:`LAUNCH_OVERHEAD_SOURCE`), with an
optional estimate of L2 reuse between consecutive kernels.
Every formula here is pinned by hand-worked values in ``tests/test_traffic.py``, and the DRAM bytes
measured with Nsight Compute on an H100 (``results/h100-80gb-hbm3/dram_traffic.csv``) are checked
against it in ``tests/test_dram_traffic.py``.
"""

from __future__ import annotations

from . import (
    backward,  # chapter 11's calculators: traffic.backward.<name>)
    links,  # chapter 13: bytes across links, the alpha-beta model (traffic.links.<name>)
)
from .classifier import HeadVersion, lm_head_loss, lm_head_table
from .launch import (
    LAUNCH_OVERHEAD_FALLBACK_US,
    LAUNCH_OVERHEAD_SOURCE,
    LAUNCH_OVERHEAD_US,
    LaunchOverhead,
    launch_overhead,
)
from .matmul import KV_READS, TRAILING_MODES, attention, flash_kv_rows, gemm_epilogue, matmul_chain
from .model import Comparison, Kernel, Op, Traffic, format_bytes, table
from .ncu import NCU_CHAIN_OPS, compare_with_ncu, ncu_case
from .ops import MASK_MODES, bias_gelu_dropout, elementwise_chain, gelu_eager, layernorm, softmax
from .optimizer import autocast_adamw_bytes_per_param, master_adamw_bytes_per_param, optimizer_step
from .timemodel import (
    L2_DIRTY_FRACTION,
    L2_REUSE_FULL,
    L2_REUSE_NONE,
    Machine,
    TimeEstimate,
    dram_bytes_cold,
    estimate_time,
    l2_hit_fraction,
    machine,
    machine_from_ceilings,
    speedup,
)
from .units import DTYPE_BYTES, OPERAND_KINDS, dtype_bytes, dtype_name

__all__ = ["LAUNCH_OVERHEAD_US", "LAUNCH_OVERHEAD_SOURCE", "LAUNCH_OVERHEAD_FALLBACK_US", "LaunchOverhead",
           "launch_overhead", "L2_REUSE_FULL", "L2_REUSE_NONE", "L2_DIRTY_FRACTION", "DTYPE_BYTES", "OPERAND_KINDS",
           "dtype_name", "dtype_bytes", "Kernel", "Traffic", "Comparison", "Op", "elementwise_chain", "gelu_eager",
           "softmax", "MASK_MODES", "bias_gelu_dropout", "layernorm", "TRAILING_MODES", "matmul_chain",
           "gemm_epilogue", "flash_kv_rows", "KV_READS", "attention", "l2_hit_fraction", "dram_bytes_cold",
           "Machine", "machine", "machine_from_ceilings", "TimeEstimate", "estimate_time", "speedup",
           "format_bytes", "table", "NCU_CHAIN_OPS", "ncu_case", "compare_with_ncu", "backward",
           "HeadVersion", "lm_head_loss", "lm_head_table",
           "autocast_adamw_bytes_per_param", "master_adamw_bytes_per_param", "optimizer_step", "links"]
