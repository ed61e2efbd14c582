"""Chapter 9's checks' operands and calls: each operand inside NaN guard zones (:class:`Operand`), the
loads a student's kernel made held against them (:func:`require_loads_inside`, which names an operand's strides
swapped or a K mask k <= K when every load of it fits that slip, and :func:`require_slice_walked`; the
interpreter records loads, a GPU does not), and a student's function called with its errors said plainly
(:func:`call`). :mod:`course_utils.checkers.gemm` judges with them. Not a checker itself: every check of
``gemm`` refuses the course's answers (``check.refuse_answer_key`` over ``answer_keys``, and the launches'
kernels) before it hands a student's function to :func:`call` (tests/test_gemm_checkers.py holds that).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import check


class Operand:
    """``t`` (its strides kept: a transposed view stays transposed) inside guard zones of NaN wider than
    any tile a student picks, so a load past its end reads a NaN (0 * NaN is NaN: a K mask missing on
    one operand poisons the sum every time) and never leaves the buffer."""

    def __init__(self, name: str, t: torch.Tensor, pad_cols: int = 0):
        self.name = name
        flip = t.dim() == 2 and t.stride(0) == 1 and t.shape[1] > 1
        store = t.T if flip else t
        rows, cols = store.shape if store.dim() == 2 else (1, store.shape[0])
        self.guard = 256 * (cols + pad_cols) + 4096
        n = rows * (cols + pad_cols)
        self.buffer = torch.full((n + 2 * self.guard,), float("nan"), dtype=t.dtype, device=t.device)
        inner = self.buffer[self.guard:self.guard + n]
        if store.dim() == 2:
            inner = inner.view(rows, cols + pad_cols)[:, :cols]   # pad columns stay NaN
        else:
            inner = inner.view(cols)
        inner.copy_(store)
        self.view = inner.T if flip else inner

    def unchanged(self, case: str, original: torch.Tensor) -> None:
        g = self.guard
        edges = torch.cat([self.buffer[:g], self.buffer[-g:]])
        check.require(bool(torch.isnan(edges).all()), f"{case}: your kernel wrote into the memory around input "
                      f"{self.name}: mask your tl.store with rows < M and columns < N.")
        check.require(torch.equal(self.view, original), f"{case}: your function changed its input {self.name}")

    def holds(self, addr: np.ndarray) -> np.ndarray:
        start = self.buffer.data_ptr()
        return (addr >= start) & (addr < start + self.buffer.numel() * self.buffer.element_size())


LOAD_FAULTS = {
    "a": "a's load reads past its rows (mask offs_m < M) or past column K (mask k < K)",
    "b": "b's load reads past row K (mask k < K) or past its columns (mask offs_n < N)",
    "bias": "the bias load reads past its N entries: mask it with offs_n < N",
    "residual": "the residual load reads past its M x N tile: mask it with rows < M and columns < N",
}


#: the stride names of the operands (the exercise kernels' arguments) and their two index names
ADDRESSING = {"a": ("a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak", "column", "k"),
              "b": ("b_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn", "row", "k"),
              "residual": ("r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]", None, None)}


def _addressing_fault(o: Operand, addr: np.ndarray) -> str:
    """The slip that explains every load ``addr`` of ``o`` (some outside its elements): its two strides swapped
    (every load at a transposed address), or (a, b) a K mask that lets index K itself through (every load at an
    element or at index K); '' when neither fits."""
    if o.view.dim() != 2 or o.name not in ADDRESSING:
        return ""
    size = o.view.element_size()
    off = (addr.astype(np.int64) - o.view.data_ptr()) // size
    rows, cols = o.view.shape
    s0, s1 = o.view.stride()
    i, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    right, how, _ = ADDRESSING[o.name]
    if how is not None:   # first: the element just past a row of a (or a column of b) is another's transpose
        edge = (np.arange(rows) * s0 + cols * s1) if how == "column" else (rows * s0 + np.arange(cols) * s1)
        # all of index K read (every row of a, every column of b: a column overrun of b's last row wraps there
        # too, but onto a few of them), and nothing else outside
        if np.isin(edge, off).all() and np.isin(off, np.concatenate([(i * s0 + j * s1).ravel(), edge])).all():
            return (f"the K mask of {o.name}'s load lets k = K through (the {how} just past its last): mask with "
                    "k < K, not k <= K")
    if np.isin(off, (i * s1 + j * s0).ravel()).all():
        return (f"{o.name}'s two strides are swapped (each element is addressed as its transpose): address it as "
                f"{right}")
    return ""


def require_loads_inside(case: str, loads, operands, what: str) -> None:
    """Name the operand a masked-in lane read outside of (interpreter only: a GPU records nothing)."""
    from .loads import outside, span

    bad = outside(loads, [o.view for o in operands])
    if not bad:
        return
    addr = loads.flat()
    inside = np.zeros(addr.size, dtype=bool)
    for o in operands:
        lo, hi = span(o.view)
        inside |= (addr >= lo) & (addr < hi)
    names = [o.name for o in operands if bool((o.holds(addr) & ~inside).any())]
    slips = [_addressing_fault(o, addr[o.holds(addr)]) for o in operands if o.name in names]
    if slips and all(slips):
        raise check.CheckFailure(f"{case}: your kernel loaded {bad} element(s) outside its operands: "
                                 f"{'; '.join(dict.fromkeys(slips))}. A masked-off lane must not load: past the end "
                                 "of a buffer there may be no memory at all.")
    faults = "; ".join(LOAD_FAULTS[n] for n in names) or "a load reads memory that is none of the operands"
    if "ragged K" in what and any(n in ("a", "b") for n in names):
        faults = (f"the K mask is missing on the load of {' and '.join(n for n in names if n in 'ab')}: the last "
                  f"K tile reads past K. Mask both loads with k < K and other=0.0 ({faults})")
    raise check.CheckFailure(f"{case}: your kernel loaded {bad} element(s) outside its operands: {faults}. A "
                             "masked-off lane must not load: past the end of a buffer there may be no memory at all.")


def require_slice_walked(case: str, loads, k_slices: int, operands=()) -> None:
    """9.1: each slice walks its own K tiles only (interpreter only). A tile walked outside the slice shows in
    one of two ways. Loaded with every lane masked off: a loop from k_start walks none; one aligned below
    k_start, or with a fixed trip count, a few (at most one a slice); a loop over the whole K range masked
    with k >= k_start on both loads walks every earlier slice's tiles again. Or loaded for real and zeroed
    after (the k >= k_start mask on one operand only, or a tl.where): then the elements of the earlier
    slices' K range are read more often than those of the last slice, where a kernel that walks only its
    slice reads every element of an operand equally often (once per tile of the other operand)."""
    empty = sum(1 for a in loads.addresses if a.size == 0)
    useful = len(loads.addresses) - empty
    walk_only = ("so each slice walks the tiles of the slices before it again and the split saves no work. Walk "
                 "only the slice: for k0 in range(k_start, k_stop, BLOCK_K).")
    if k_slices > 1 and useful and 4 * empty > useful:
        raise check.CheckFailure(
            f"{case}: {empty} of your kernel's {empty + useful} loads had every lane masked off: the K loop walks "
            f"tiles outside its slice (from 0, or past k_stop) and masks them away, {walk_only}")
    if k_slices < 2 or not loads.active:
        return
    for o in operands:
        if o.name not in ("a", "b"):
            continue
        reads = _reads_per_element(loads, o)
        k_axis = 1 if o.name == "a" else 0
        per_k = reads.amax(dim=1 - k_axis)
        if reads.numel() and int(reads.max()) > int(reads.min()):
            ks = (per_k > int(reads.min())).nonzero().flatten()
            raise check.CheckFailure(
                f"{case}: your kernel read the elements of {o.name} in K indices {int(ks[0])} to {int(ks[-1])} "
                f"up to {int(reads.max())} times each and others {int(reads.min())} times: a slice's K loop loads "
                "tiles of the slices before it (from 0, or past k_stop) and zeroes them (the k >= k_start mask on "
                f"one operand only, or tl.where after the load), {walk_only}")


def _reads_per_element(loads, operand) -> torch.Tensor:
    """How many masked-in lanes read each element of ``operand.view`` (its shape; interpreter only)."""
    buf = operand.buffer
    addr = loads.flat(buf.element_size()).astype(np.int64) - buf.data_ptr()
    addr = addr[(addr >= 0) & (addr < buf.numel() * buf.element_size()) & (addr % buf.element_size() == 0)]
    counts = torch.from_numpy(np.bincount(addr // buf.element_size(), minlength=buf.numel()))
    view = operand.view
    return counts.as_strided(tuple(view.shape), view.stride(), view.storage_offset() - buf.storage_offset())


def call(fn, args, case):
    try:
        with np.errstate(over="ignore"):   # the interpreter's exp overflows to inf in GELU: on purpose
            return fn(*args)
    except (NotImplementedError, check.CheckFailure):
        raise
    except Exception as e:
        from .loads import interpreter_limit, stub_message
        stub = stub_message(e)   # the interpreter or the compiler wraps what a kernel raises
        if stub is not None:
            raise NotImplementedError(stub or f"not done yet ({e})") from None
        limit = interpreter_limit(e)
        raise check.CheckFailure(f"{case}: {limit}" if limit else
                                 f"{case}: your function raised {type(e).__name__}: {e}") from e
