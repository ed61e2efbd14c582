"""What a student's kernel reads, seen under Triton's interpreter: loads outside the inputs, and passes.

Guard zones make an unmasked out-of-bounds *read* harmless to the answer, so the output alone cannot
show a missing load mask, and a three-pass softmax gives the same numbers as a two-pass one. Under
the interpreter every ``tl.load`` goes through one method of its builder, with the addresses and the
mask of every lane; :func:`track_loads` records them while a check calls the student's kernel. On a
GPU there is no such hook: the records stay empty and these checks say nothing (the grader's CI runs
the interpreter).

This wraps one Triton internal, ``InterpreterBuilder.create_masked_load`` of
``triton.runtime.interpreter`` (Triton 3.6): :func:`problem` says when that assumption breaks and
``tests/test_elementwise_checkers.py`` fails loudly then.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import env

PARAMS = ["self", "ptrs", "mask", "other", "cache_modifier", "eviction_policy", "is_volatile"]


def problem() -> str:
    """'' when the interpreter's load hook is as this module assumes, else what changed."""
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError as e:
        return f"triton.runtime.interpreter.InterpreterBuilder is gone ({e})"
    got = list(inspect.signature(InterpreterBuilder.create_masked_load).parameters)
    return "" if got == PARAMS else f"InterpreterBuilder.create_masked_load's parameters are now {got}"


@dataclass
class Loads:
    """Every masked-in lane's byte address and the width (lanes) of each load."""
    addresses: list[np.ndarray] = field(default_factory=list)
    itemsizes: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)
    active: bool = False

    def flat(self, itemsize: int | None = None) -> np.ndarray:
        parts = [a for a, s in zip(self.addresses, self.itemsizes) if itemsize is None or s == itemsize]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


@contextlib.contextmanager
def track_loads():
    """Record the loads of every interpreted kernel launched inside the block (GPU: records nothing)."""
    loads = Loads()
    if env.on_gpu() or problem():
        yield loads
        return
    from triton.runtime.interpreter import InterpreterBuilder
    original = InterpreterBuilder.create_masked_load

    def create_masked_load(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile):
        addr = np.asarray(ptrs.data).reshape(-1).astype(np.uint64)
        m = np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).reshape(-1).astype(bool)
        loads.addresses.append(addr[m])
        loads.itemsizes.append(ptrs.get_element_ty().primitive_bitwidth // 8)
        loads.widths.append(addr.size)
        return original(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile)

    InterpreterBuilder.create_masked_load = create_masked_load
    loads.active = True
    try:
        yield loads
    finally:
        InterpreterBuilder.create_masked_load = original


def span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [start, end) a tensor's elements occupy (strides included)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def outside(loads: Loads, tensors: list[torch.Tensor]) -> int:
    """How many masked-in lanes read outside every one of ``tensors``."""
    addr = loads.flat()
    if addr.size == 0:
        return 0
    ok = np.zeros(addr.size, dtype=bool)
    for t in tensors:
        lo, hi = span(t)
        ok |= (addr >= lo) & (addr < hi)
    return int((~ok).sum())


def reads_per_element(loads: Loads, x: torch.Tensor) -> float:
    """Loads of the elements of the 2-D row-strided ``x`` divided by its element count."""
    addr = loads.flat(x.element_size()).astype(np.int64) - x.data_ptr()
    idx = addr // x.element_size()
    rows, cols = idx // x.stride(0), idx % x.stride(0)
    inside = (addr >= 0) & (addr % x.element_size() == 0) & (rows < x.shape[0]) & (cols < x.shape[1])
    return float(inside.sum()) / max(x.numel(), 1)
