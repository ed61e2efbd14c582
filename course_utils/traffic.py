"""HBM-traffic calculators and a roofline + launch time model (pure Python: no torch import).

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
``launches x launch overhead``, with an optional estimate of L2 reuse between consecutive kernels.
Every formula here is pinned by hand-worked values in ``tests/test_traffic.py``, and the DRAM bytes
measured with Nsight Compute on an H100 (``results/h100-80gb-hbm3/dram_traffic.csv``) are checked
against it in ``tests/test_dram_traffic.py``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------
# Constants, each with its source
# ---------------------------------------------------------------------------------------------

#: Host-side cost of one eager launch, microseconds. Source: ../shared/ANCHORS.md, a tiny torch op
#: (relu/add on 1 element) measured back to back: 9.4 us on an H100 80GB HBM3 and 9.9 us on an H200
#: (torch 2.11, Triton 3.6, November 2026).
LAUNCH_OVERHEAD_US = 10.0

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

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "tf32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "bool": 1,
}
_DTYPE_ALIASES = {
    "fp64": "float64", "double": "float64", "f64": "float64",
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2",
}

OPERAND_KINDS = ("full", "col", "row", "scalar", "input")


# ---------------------------------------------------------------------------------------------
# Input checking
# ---------------------------------------------------------------------------------------------

def dtype_name(dtype) -> str:
    """Canonical name of a dtype given as a string ('bf16', 'torch.float16') or a torch dtype."""
    text = str(dtype).strip().lower().removeprefix("torch.")
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPE_BYTES:
        raise ValueError(f"dtype: unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)} "
                         f"or an alias {sorted(_DTYPE_ALIASES)}")
    return text


def dtype_bytes(dtype) -> int:
    """Bytes per element: ``dtype_bytes('bf16') == 2``."""
    return DTYPE_BYTES[dtype_name(dtype)]


def _count(name: str, value, *, allow_zero: bool = False) -> int:
    """``value`` as a positive int, or a ValueError naming the argument."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        if isinstance(value, float) and value.is_integer():
            v = int(value)
        else:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else 'positive'}, got {v}")
    return v


def _shape(shape) -> tuple[int, int]:
    """(rows, cols) of a shape given as numel or a tuple (the last entry is cols)."""
    if isinstance(shape, (tuple, list)):
        if not shape:
            raise ValueError("shape must not be empty")
        dims = [_count(f"shape[{i}]", d) for i, d in enumerate(shape)]
        return math.prod(dims[:-1]), dims[-1]
    return 1, _count("shape", shape)


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kernel:
    """One kernel launch: logical bytes read and written, FLOPs, and the reads L2 could serve.

    ``reuse_bytes`` is the part of ``read_bytes`` that the previous kernel read or wrote: the data
    that may still be in L2 when this kernel starts (see :func:`estimate_time`).
    """

    name: str
    read_bytes: int
    write_bytes: int
    flops: float = 0.0
    reuse_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes


@dataclass(frozen=True)
class Traffic:
    """The kernels a version launches, in order, and their totals."""

    label: str
    kernels: tuple[Kernel, ...]

    @property
    def read_bytes(self) -> int:
        return sum(k.read_bytes for k in self.kernels)

    @property
    def write_bytes(self) -> int:
        return sum(k.write_bytes for k in self.kernels)

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    @property
    def launches(self) -> int:
        return len(self.kernels)

    @property
    def flops(self) -> float:
        return sum(k.flops for k in self.kernels)

    @property
    def total_mb(self) -> float:
        return self.total_bytes / 1e6

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(f"{self.label} + {other.label}", self.kernels + other.kernels)


@dataclass(frozen=True)
class Comparison:
    """Unfused vs fused traffic of the same computation."""

    name: str
    unfused: Traffic
    fused: Traffic
    notes: tuple[str, ...] = field(default=())

    @property
    def ratio(self) -> float:
        """Unfused / fused bytes: the traffic-only speedup ceiling of fusing."""
        return self.unfused.total_bytes / self.fused.total_bytes

    @property
    def saved_bytes(self) -> int:
        return self.unfused.total_bytes - self.fused.total_bytes


# ---------------------------------------------------------------------------------------------
# Elementwise chains
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    """An elementwise op applied to the running value, with extra operands of the given kinds.

    ``Op("relu")`` is unary; ``Op("add", ("col",))`` adds a bias; ``Op("mul", ("input",))``
    multiplies by the chain's input again (``x * x``); ``flops`` is per output element.
    """

    name: str
    operands: tuple[str, ...] = ()
    flops: float = 1.0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ops: an op needs a non-empty name, got {self.name!r}")
        if isinstance(self.operands, str):
            object.__setattr__(self, "operands", (self.operands,))
        for kind in self.operands:
            if kind not in OPERAND_KINDS:
                raise ValueError(f"ops: operand kind {kind!r} of op {self.name!r} is not one of {OPERAND_KINDS}")
        if not (isinstance(self.flops, (int, float)) and self.flops >= 0):
            raise ValueError(f"ops: flops of op {self.name!r} must be >= 0, got {self.flops!r}")


def _ops(ops) -> tuple[Op, ...]:
    """An op list from Ops, names (unary ops) or an int k (k unary ops)."""
    if isinstance(ops, int) and not isinstance(ops, bool):
        return tuple(Op(f"op{i + 1}") for i in range(_count("ops (chain length)", ops)))
    if isinstance(ops, (str, Op)) or not isinstance(ops, Iterable):
        raise ValueError(f"ops must be a chain length or a list of ops, got {ops!r}")
    out = tuple(o if isinstance(o, Op) else Op(o) for o in ops)
    if not out:
        raise ValueError("ops: the chain is empty; give at least one op")
    return out


def _operand_elems(kind: str, rows: int, cols: int) -> int:
    return {"full": rows * cols, "col": cols, "row": rows, "scalar": 0, "input": rows * cols}[kind]


def elementwise_chain(ops, shape, dtype="bfloat16") -> Comparison:
    """Traffic of an elementwise chain, one kernel per op vs one fused kernel.

    ``ops``: a chain length (that many unary ops) or a list of :class:`Op` / op names.
    ``shape``: numel, or a tuple whose last entry is the number of columns (needed for ``"col"``).
    """
    ops = _ops(ops)
    rows, cols = _shape(shape)
    b = dtype_bytes(dtype)
    n = rows * cols
    kernels = []
    for i, op in enumerate(ops):
        extra = sum(_operand_elems(k, rows, cols) for k in op.operands)
        # the running value (x for the first op) was written (or, for x, read) by the previous kernel
        reuse = n if i > 0 else 0
        if i > 0 and (i == 1 or "input" in ops[i - 1].operands):  # x itself, if the previous kernel read it
            reuse += sum(_operand_elems(k, rows, cols) for k in op.operands if k == "input")
        kernels.append(Kernel(op.name, (n + extra) * b, n * b, op.flops * n, reuse * b))
    fused_extra = sum(_operand_elems(k, rows, cols) for op in ops for k in op.operands if k != "input")
    fused = Kernel("fused " + "+".join(o.name for o in ops), (n + fused_extra) * b, n * b,
                   sum(o.flops for o in ops) * n)
    name = f"chain of {len(ops)} op(s) on {rows}x{cols} {dtype_name(dtype)}"
    return Comparison(name, Traffic("unfused", tuple(kernels)), Traffic("fused", (fused,)))


#: The tanh-GELU of chapter 4 written as 9 eager torch ops:
#: 0.5 * x * (1 + tanh(0.79788456 * (x + 0.044715 * x * x * x))), evaluated left to right as
#: t1 = x*x, t2 = t1*x, t3 = 0.044715*t2, t4 = x+t3, t5 = 0.79788456*t4, t6 = tanh(t5), t7 = 1+t6,
#: t8 = 0.5*x, y = t8*t7. Ops 1, 2 and 4 read x again and op 8 starts from x, so this is no simple chain:
#: :func:`gelu_eager` counts it kernel by kernel.
def gelu_eager(shape, dtype="bfloat16") -> Comparison:
    """The 9-op eager tanh-GELU vs one fused kernel (read x once, write y once)."""
    rows, cols = _shape(shape)
    b = dtype_bytes(dtype)
    n = rows * cols * b
    # (name, tensors read, reads of a tensor the previous kernel touched)
    plan = [("x*x", 2, 0), ("t1*x", 2, 2), ("0.044715*t2", 1, 1), ("x+t3", 2, 1), ("0.798*t4", 1, 1),
            ("tanh", 1, 1), ("1+t6", 1, 1), ("0.5*x", 1, 0), ("t8*t7", 2, 1)]
    kernels = tuple(Kernel(name, reads * n, n, rows * cols, reuse * n) for name, reads, reuse in plan)
    fused = Kernel("fused gelu", n, n, 9 * rows * cols)
    return Comparison(f"9-op eager GELU on {rows}x{cols} {dtype_name(dtype)}",
                      Traffic("unfused", kernels), Traffic("fused", (fused,)))


# ---------------------------------------------------------------------------------------------
# Softmax, bias + GELU + dropout, LayerNorm
# ---------------------------------------------------------------------------------------------

def softmax(rows, cols, dtype="float32") -> Comparison:
    """Softmax along rows: five eager ops vs one fused pass.

    Eager: ``m = x.amax(1)`` (read MN, write M), ``z = x - m`` (read MN + M, write MN),
    ``e = exp(z)`` (read MN, write MN), ``s = e.sum(1)`` (read MN, write M), ``y = e / s``
    (read MN + M, write MN): reads 5MN + 2M and writes 3MN + 2M elements. Fused: reads MN, writes MN.
    """
    m, n = _count("rows", rows), _count("cols", cols)
    b = dtype_bytes(dtype)
    mn = m * n
    kernels = (
        Kernel("amax", mn * b, m * b, mn, 0),
        Kernel("sub", (mn + m) * b, mn * b, mn, (mn + m) * b),
        Kernel("exp", mn * b, mn * b, mn, mn * b),
        Kernel("sum", mn * b, m * b, mn, mn * b),
        Kernel("div", (mn + m) * b, mn * b, mn, mn * b),
    )
    fused = Kernel("fused softmax", mn * b, mn * b, 5 * mn)
    return Comparison(f"softmax of {m}x{n} {dtype_name(dtype)}", Traffic("unfused", kernels),
                      Traffic("fused", (fused,)))


MASK_MODES = ("read", "generated")


def bias_gelu_dropout(rows, cols, dtype="float16", *, mask="generated", mask_dtype="bool") -> Comparison:
    """``dropout(gelu(x + bias))`` with a per-column bias: three eager kernels vs one fused kernel.

    ``mask="read"``: the dropout mask is a tensor in HBM (``mask_dtype``, 1 byte per element for
    bool) that the dropout step reads; ``"generated"``: the kernel draws it from a counter-based RNG
    (Philox) in registers and reads nothing. The same choice applies to both versions.
    """
    m, n = _count("rows", rows), _count("cols", cols)
    if mask not in MASK_MODES:
        raise ValueError(f"mask must be one of {MASK_MODES}, got {mask!r}")
    b = dtype_bytes(dtype)
    mb = dtype_bytes(mask_dtype) if mask == "read" else 0
    mn = m * n
    kernels = (
        Kernel("x + bias", (mn + n) * b, mn * b, mn, 0),
        Kernel("gelu", mn * b, mn * b, 9 * mn, mn * b),
        Kernel("dropout", mn * b + mn * mb, mn * b, 2 * mn, mn * b),
    )
    fused = Kernel("fused bias+gelu+dropout", (mn + n) * b + mn * mb, mn * b, 12 * mn)
    return Comparison(f"bias + GELU + dropout ({mask} mask) on {m}x{n} {dtype_name(dtype)}",
                      Traffic("unfused", kernels), Traffic("fused", (fused,)))


def layernorm(rows, cols, dtype="float32", *, save_stats=False) -> Comparison:
    """LayerNorm over rows of length ``cols`` with weight and bias: nine eager ops vs one kernel.

    Eager (the pattern torch.compile recognises): ``mean`` (read MN, write M), ``x - mean``
    (MN + M, MN), ``pow 2`` (MN, MN), ``mean`` (MN, M), ``+ eps`` (M, M), ``sqrt`` (M, M),
    ``/ std`` (MN + M, MN), ``* weight`` (MN + N, MN), ``+ bias`` (MN + N, MN): reads 7MN + 4M + 2N,
    writes 5MN + 4M elements. Fused: reads MN + 2N, writes MN (+ 2M when it saves mean and rstd
    for the backward pass, ``save_stats=True``).
    """
    m, n = _count("rows", rows), _count("cols", cols)
    b = dtype_bytes(dtype)
    mn = m * n
    k = [("mean", mn, m, 0), ("x - mean", mn + m, mn, mn + m), ("pow 2", mn, mn, mn), ("mean", mn, m, mn),
         ("+ eps", m, m, m), ("sqrt", m, m, m), ("/ std", mn + m, mn, m), ("* weight", mn + n, mn, mn),
         ("+ bias", mn + n, mn, mn)]
    kernels = tuple(Kernel(name, r * b, w * b, max(r, w), reuse * b) for name, r, w, reuse in k)
    fused = Kernel("fused layernorm", (mn + 2 * n) * b, (mn + (2 * m if save_stats else 0)) * b, 8 * mn)
    return Comparison(f"LayerNorm of {m}x{n} {dtype_name(dtype)}", Traffic("unfused", kernels),
                      Traffic("fused", (fused,)))


# ---------------------------------------------------------------------------------------------
# GEMM + epilogue, attention
# ---------------------------------------------------------------------------------------------

TRAILING_MODES = ("eager", "fused")


def _op_list(name: str, ops) -> tuple[Op, ...]:
    """Like :func:`_ops` but an empty list is allowed (no ops on that side of the matmul)."""
    if isinstance(ops, (str, Op)) or not isinstance(ops, Iterable):
        raise ValueError(f"{name} must be a list of ops, got {ops!r}")
    return tuple(o if isinstance(o, Op) else Op(o) for o in ops)


def matmul_chain(pre, post, m, n, k, dtype="bfloat16", *, trailing="eager") -> Comparison:
    """Ops on A before ``C = A @ B`` and on C after it (A is m x k, B is k x n): the fusion accountant.

    ``pre`` ops act on A elementwise, or row-wise like a softmax over the k entries of a row (a
    fused kernel can apply it in the GEMM's prologue only if it holds whole rows, as FlashAttention
    does); ``post`` ops act on C (the epilogue). The GEMM reads its A and B once each from HBM (its
    tiles re-read them from L2: the ideal a good GEMM approaches) and writes C.
    Unfused: one kernel per op and one for the GEMM; with ``trailing="fused"`` the ops on each side
    run as one elementwise kernel instead. Fused: one kernel reads A, B and every operand once and
    writes the final result.
    """
    pre, post = _op_list("pre", pre), _op_list("post", post)
    m, n, k = _count("m", m), _count("n", n), _count("k", k)
    if trailing not in TRAILING_MODES:
        raise ValueError(f"trailing must be one of {TRAILING_MODES}, got {trailing!r}")
    b = dtype_bytes(dtype)
    kernels: list[Kernel] = []
    extra = 0  # bytes of the ops' own operands (a bias...)
    if pre:
        chain = elementwise_chain(pre, (m, k), dtype)
        kernels += chain.unfused.kernels if trailing == "eager" else chain.fused.kernels
        extra += chain.fused.read_bytes - m * k * b
    gemm = Kernel("gemm", (m * k + k * n) * b, m * n * b, 2.0 * m * n * k, m * k * b if pre else 0)
    kernels.append(gemm)
    if post:
        chain = elementwise_chain(post, (m, n), dtype)
        tail = chain.unfused.kernels if trailing == "eager" else chain.fused.kernels
        kernels += [Kernel(t.name, t.read_bytes, t.write_bytes, t.flops, t.reuse_bytes or m * n * b) if i == 0
                    else t for i, t in enumerate(tail)]
        extra += chain.fused.read_bytes - m * n * b
    flops = sum(kk.flops for kk in kernels)
    fused = Kernel("fused " + " + ".join([*(o.name for o in pre), "gemm", *(o.name for o in post)]),
                   gemm.read_bytes + extra, m * n * b, flops)
    name = " + ".join([*(o.name for o in pre), f"GEMM {m}x{n}x{k}", *(o.name for o in post)]) + f", {dtype_name(dtype)}"
    return Comparison(name, Traffic(f"unfused ({trailing} ops)", tuple(kernels)), Traffic("fused", (fused,)))


def gemm_epilogue(m, n, k, epilogue=(Op("add bias", ("col",)), Op("gelu", (), 9)), dtype="bfloat16", *,
                  trailing="eager") -> Comparison:
    """``C = A @ B`` followed by elementwise ops on C: trailing kernels vs the GEMM's epilogue.

    The special case of :func:`matmul_chain` with no ops before the matmul; ``trailing="eager"``
    runs one kernel per epilogue op after the GEMM, ``"fused"`` one elementwise kernel for all of them.
    """
    return matmul_chain((), _ops(epilogue), m, n, k, dtype, trailing=trailing)


def flash_kv_rows(seq_len: int, block_m: int, causal: bool) -> int:
    """Rows of K (and of V) that a FlashAttention forward loads for one head.

    Each query tile of ``block_m`` rows streams all of K and V (``seq_len`` rows each), or, when
    causal, only the rows up to the end of its own tile.
    """
    n_tiles = math.ceil(seq_len / block_m)
    if not causal:
        return n_tiles * seq_len
    return sum(min(seq_len, (i + 1) * block_m) for i in range(n_tiles))


KV_READS = ("per_tile", "once")


def attention(batch, heads, seq_len, head_dim, dtype="bfloat16", *, causal=False, block_m=128,
              save_lse=False, kv_reads="per_tile") -> Comparison:
    """Attention forward: standard (S and P materialized) vs FlashAttention-style tiling.

    Standard, three kernels per (batch, head): ``S = Q K^T`` (scale folded into it; reads Q, K,
    writes S: N x N), ``P = softmax(S)`` (causal mask applied there; reads S, writes P), ``O = P V``
    (reads P and V, writes O). Causal or not, S and P are full N x N matrices.
    Flash, one kernel: reads Q once, K and V once per query tile of ``block_m`` rows (fewer when
    causal: :func:`flash_kv_rows`), writes O (and the log-sum-exp per row, fp32, if ``save_lse``).
    Counting every K/V re-read as HBM traffic (``kv_reads="per_tile"``, the FlashAttention paper's
    count) is an upper bound: the L2 serves many of them. ``kv_reads="once"`` is the lower bound
    where K and V come from HBM once and every re-read hits L2.
    FLOPs: 4 B H N^2 d for the two products (halved for causal in the flash kernel only).
    """
    bsz, h = _count("batch", batch), _count("heads", heads)
    n, d = _count("seq_len", seq_len), _count("head_dim", head_dim)
    bm = _count("block_m", block_m)
    if kv_reads not in KV_READS:
        raise ValueError(f"kv_reads must be one of {KV_READS}, got {kv_reads!r}")
    b = dtype_bytes(dtype)
    bh = bsz * h
    qkv = bh * n * d * b  # one of Q, K, V or O
    s = bh * n * n * b
    mm = 2.0 * bh * n * n * d
    standard = (
        Kernel("S = Q K^T", 2 * qkv, s, mm, 0),
        Kernel("P = softmax(S)", s, s, 5.0 * bh * n * n, s),
        Kernel("O = P V", s + qkv, qkv, mm, s),
    )
    kv = 2 * bh * (flash_kv_rows(n, bm, causal) if kv_reads == "per_tile" else n) * d * b
    lse = bh * n * 4 if save_lse else 0
    flash = Kernel("flash attention", qkv + kv, qkv + lse, 2 * mm * (0.5 if causal else 1.0))
    return Comparison(f"attention B={bsz} H={h} N={n} d={d} {dtype_name(dtype)}"
                      + (" causal" if causal else "") + (", K/V read once" if kv_reads == "once" else ""),
                      Traffic("standard", standard), Traffic("flash", (flash,)))


# ---------------------------------------------------------------------------------------------
# What the DRAM counters see, and the time model
# ---------------------------------------------------------------------------------------------

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


@dataclass(frozen=True)
class Machine:
    """The ceilings a time estimate uses: datasheet values or measured ones."""

    name: str
    hbm_gbps: float
    peak_tflops: float
    l2_bytes: int
    launch_us: float = LAUNCH_OVERHEAD_US


def machine(gpu="h100-sxm", dtype="bfloat16", *, hbm_gbps=None, peak_tflops=None, l2_bytes=None,
            launch_us=LAUNCH_OVERHEAD_US) -> Machine:
    """Ceilings from the hardware table (a key such as 'h100-sxm' or a device name), any of which
    can be replaced by a measured value (``hbm_gbps`` from a copy, ``peak_tflops`` from a matmul).

    ``gpu=None`` needs all three of ``hbm_gbps``, ``peak_tflops`` and ``l2_bytes``.
    """
    if gpu is None:
        if None in (hbm_gbps, peak_tflops, l2_bytes):
            raise ValueError("gpu: with gpu=None give hbm_gbps, peak_tflops and l2_bytes")
        name = "measured"
    else:
        from . import hardware  # imported here: the hardware table needs torch, this module does not

        spec = gpu if hasattr(gpu, "hbm_gbps") else hardware.lookup(gpu)
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
    return Machine(name, float(hbm_gbps), float(peak_tflops), _count("l2_bytes", l2_bytes, allow_zero=True),
                   float(launch_us))


def machine_from_ceilings(ceilings, *, l2_bytes=None, launch_us=LAUNCH_OVERHEAD_US) -> Machine:
    """A :class:`Machine` from measured ceilings (a ``bench.Ceilings``: ``gpu``, ``copy_gbps``,
    ``matmul_tflops``), e.g. ``bench.measure_ceilings()`` on the GPU in hand or
    ``bench.Ceilings.from_frame(bench.recorded("ceilings"))`` without one.

    The copy bandwidth counts bytes read + written, as this module does. The L2 size comes from
    the hardware table unless given. The matmul rate stands for every dtype's peak: the
    memory-bound kernels of this chapter never reach it.
    """
    for attr in ("gpu", "copy_gbps", "matmul_tflops"):
        if not hasattr(ceilings, attr):
            raise ValueError(f"ceilings: expected a bench.Ceilings (with {attr}), got {type(ceilings).__name__}")
    if l2_bytes is None:
        from . import hardware
        try:
            l2_bytes = hardware.lookup(str(ceilings.gpu)).l2_bytes
        except ValueError as e:
            raise ValueError(f"l2_bytes: give it, the GPU is not in the table ({e})") from None
    m = machine(None, hbm_gbps=ceilings.copy_gbps, peak_tflops=ceilings.matmul_tflops, l2_bytes=l2_bytes,
                launch_us=launch_us)
    return Machine(f"{ceilings.gpu} (measured)", m.hbm_gbps, m.peak_tflops, m.l2_bytes, m.launch_us)


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
    mach = gpu if isinstance(gpu, Machine) else machine(gpu, dtype, **ceilings)
    bw = mach.hbm_gbps * 1e9
    peak = mach.peak_tflops * 1e12
    launch = mach.launch_us * 1e-6
    total = mem_total = comp_total = hbm_total = hit_total = 0.0
    prev = None
    for kern in traffic.kernels:
        hit = 0.0
        if l2_reuse and prev is not None:
            hit = kern.reuse_bytes * l2_hit_fraction(prev.total_bytes, mach.l2_bytes)
        hbm = kern.total_bytes - hit
        mem, comp = hbm / bw, kern.flops / peak
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


def format_bytes(nbytes: float) -> str:
    """'1.07 GB', '327.7 KB': decimal units, as bandwidths are quoted."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.0f} B"


def table(comparisons: Sequence[Comparison]) -> list[dict]:
    """One row per comparison (for a DataFrame): MB unfused / fused, launches and the ratio."""
    return [{"what": c.name, "unfused MB": round(c.unfused.total_bytes / 1e6, 3),
             "fused MB": round(c.fused.total_bytes / 1e6, 3), "unfused launches": c.unfused.launches,
             "fused launches": c.fused.launches, "traffic ratio": round(c.ratio, 3)} for c in comparisons]


# ---------------------------------------------------------------------------------------------
# The cases measured with Nsight Compute (benchmarks/ncu_traffic.py)
# ---------------------------------------------------------------------------------------------

#: ``relu((x + bias) * s) + r`` as benchmarks/ncu_traffic.py runs it: a bias per column, a scalar,
#: a unary op and a second full tensor.
NCU_CHAIN_OPS = (Op("add bias", ("col",)), Op("mul s", ("scalar",)), Op("relu"), Op("add r", ("full",)))


def ncu_case(case: str, rows: int, cols: int, dtype: str) -> Traffic:
    """The calculator's kernels for one case of benchmarks/ncu_traffic.py."""
    cases = {"chain-eager": lambda: elementwise_chain(NCU_CHAIN_OPS, (rows, cols), dtype).unfused,
             "chain-fused": lambda: elementwise_chain(NCU_CHAIN_OPS, (rows, cols), dtype).fused,
             "softmax-eager": lambda: softmax(rows, cols, dtype).unfused,
             "softmax-fused": lambda: softmax(rows, cols, dtype).fused}
    if case not in cases:
        raise ValueError(f"case must be one of {sorted(cases)}, got {case!r}")
    return cases[case]()


def compare_with_ncu(rows: Iterable[dict]) -> list[dict]:
    """Predicted vs measured DRAM bytes, one row per (cache mode, case, size).

    ``rows``: the per-kernel records of ``results/<gpu>/dram_traffic.csv`` (e.g.
    ``df.to_dict("records")``). Each output row has the logical bytes, the cold-L2 estimate of
    :func:`dram_bytes_cold` (for ``--cache-control all``), the reads left once L2 reuse between
    kernels is taken off (:func:`l2_hit_fraction`, for ``--cache-control none``) and the measured bytes.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["cache_control"], r["case"], float(r["factor"])), []).append(r)
    out = []
    for (mode, case, factor), recs in groups.items():
        first = recs[0]
        traffic = ncu_case(case, int(first["rows"]), int(first["cols"]), first["dtype"])
        l2 = int(first["l2_bytes"])
        cold = [dram_bytes_cold(k, l2) for k in traffic.kernels]
        hits = [0.0] + [k.reuse_bytes * l2_hit_fraction(p.total_bytes, l2)
                        for p, k in zip(traffic.kernels, traffic.kernels[1:])]
        out.append({
            "cache_control": mode, "case": case, "factor": factor, "l2_bytes": l2,
            "kernels": len(recs), "predicted_kernels": traffic.launches,
            "logical_read": traffic.read_bytes, "logical_write": traffic.write_bytes,
            "logical_total": traffic.total_bytes,
            "cold_read": sum(c[0] for c in cold), "cold_write": sum(c[1] for c in cold),
            "warm_read": traffic.read_bytes - sum(hits),
            "measured_read": sum(int(r["dram_read_bytes"]) for r in recs),
            "measured_write": sum(int(r["dram_write_bytes"]) for r in recs),
        })
        o = out[-1]
        o["cold_total"] = o["cold_read"] + o["cold_write"]
        o["measured_total"] = o["measured_read"] + o["measured_write"]
        o["measured_over_logical"] = o["measured_total"] / o["logical_total"]
    return out
