"""What a student's kernel reads, seen under Triton's interpreter: loads outside the inputs, and passes.

Guard zones make an unmasked out-of-bounds *read* harmless to the answer, so the output alone cannot
show a missing load mask, and a three-pass softmax gives the same numbers as a two-pass one. Under
the interpreter every ``tl.load`` goes through one method of its builder, with the addresses and the
mask of every lane; :func:`track_loads` records them while a check calls the student's kernel. On a
GPU there is no such hook: the records stay empty and these checks say nothing (the grader's CI runs
the interpreter).

The hook is one Triton internal, ``InterpreterBuilder.create_masked_load``, held like every other
internal in :mod:`course_utils.triton_internals` (``interpreter_load_hook``): :func:`problem` says
when its assumption breaks, and ``tests/test_elementwise_checkers.py`` and
``tests/test_triton_internals.py`` fail loudly then.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import env, triton_internals

HOOK = "InterpreterBuilder.create_masked_load"
#: what a verdict's "no load outside" vouches for: every address here; on a GPU only a load that reaches an output
LOADS_SEEN = "(loads checked address by address under Triton's interpreter; on a GPU, those that reach an output)"


def problem() -> str:
    """'' when the interpreter's load hook is as this module assumes, else what changed."""
    broken = [line for line in triton_internals.problems() if line.startswith(HOOK)]
    return broken[0] if broken else ""


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
    if env.on_gpu():
        yield loads
        return

    def on_load(ptrs, mask):
        addr = np.asarray(ptrs.data).reshape(-1).astype(np.uint64)
        m = np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).reshape(-1).astype(bool)
        loads.addresses.append(addr[m])
        loads.itemsizes.append(ptrs.get_element_ty().primitive_bitwidth // 8)
        loads.widths.append(addr.size)

    with triton_internals.interpreter_load_hook(on_load) as hooked:
        loads.active = hooked
        yield loads


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


def interpreter_limit(error: BaseException) -> str:
    """What to write instead, when ``error`` is a limit of Triton's interpreter rather than a fault of the
    kernel ('' otherwise): under the interpreter the variable of ``for r in tl.range(...)`` (or ``range``)
    is a plain Python int, so a tensor method on it (``r.to(tl.int64)``) raises, though compiled Triton
    accepts it."""
    if env.on_gpu() or "'int' object has no attribute" not in str(error):
        return ""
    return ("Triton's interpreter (the CPU mode this check runs in) gives the variable of `for r in tl.range(...)` "
            "as a plain Python int, so a tensor method on it such as r.to(tl.int64) fails here, though a compiled "
            "kernel accepts it: a limit of the interpreter, not a fault of your kernel. Write tl.cast(r, tl.int64) "
            "instead, which works in both.")


def stub_message(error: BaseException) -> str | None:
    """The message of an exercise's untouched ``raise NotImplementedError("...")`` inside a kernel, when ``error``
    comes from one (None otherwise; '' when the message cannot be read). The interpreter wraps what a kernel
    raises; a GPU's compiler fails on the raise line, naming it only in the error of the jit function that holds
    it, which can be the cause of the error of its caller: so the whole chain is read."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = f"{error!r} {error}"
        if "NotImplementedError" in text:
            found = re.search(r"NotImplementedError\((['\"])(.*?)\1\)", text)
            return found.group(2) if found else ""
        error = error.__cause__ or error.__context__
    return None


def in_guards(loads: Loads, guarded) -> int:
    """How many masked-in lanes read a guard zone of ``guarded`` (a :class:`course_utils.check.Guarded`):
    the elements just before and just after its tensor, which no right kernel reads."""
    addr = loads.flat()
    if addr.size == 0:
        return 0
    start, end = span(guarded.buffer)
    lo, hi = span(guarded.tensor)
    hits = ((addr >= start) & (addr < lo)) | ((addr >= hi) & (addr < end))
    return int(hits.sum())
