"""What a calculator returns: kernels with their bytes and FLOPs, the traffic of a version, and an
unfused-vs-fused comparison; the elementwise :class:`Op`; formatting helpers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .units import OPERAND_KINDS, _count


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



__all__ = ["Kernel", "Traffic", "Comparison", "Op", "format_bytes", "table"]
