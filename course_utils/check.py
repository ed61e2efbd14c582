"""The checker toolkit: how a check cell judges a student's code.

Every call draws fresh random inputs (signed, with magnitude outliers where stability matters),
tries sizes that are not multiples of any block size, poisons outputs with NaN, surrounds buffers
with guard zones, compares with a float64 reference under a per-dtype tolerance and, where the
lesson is fusion, counts kernel launches. A check that passes prints one deterministic line
(:func:`verdict`), the same on CPU and GPU; one that fails raises :class:`CheckFailure` with the
first bad index, got vs expected, and a hint of where to look.
"""

from __future__ import annotations

import contextlib
import dis
import inspect
import os
from collections.abc import Callable, Sequence

import torch

from . import env
from .profile import count_launches, triton_launch_hook


def track_loads():
    """:func:`course_utils.checkers.loads.track_loads` (imported late: checkers import this module)."""
    from .checkers.loads import track_loads as _track
    return _track()


class CheckFailure(AssertionError):
    """A check that failed; the message tells the student what to look at."""


# (atol, rtol) against a float64 reference of the same (rounded) inputs; outputs are stored in
# the input dtype, so the tolerance is a few units in its last place.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}

GUARD = 8192  # elements on each side of a guarded buffer: more than any BLOCK_SIZE a student picks


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for outputs stored in ``dtype``."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype}; expected one of {list(TOLERANCES)}")
    return TOLERANCES[dtype]


def generator(device=None) -> torch.Generator:
    """A generator seeded from the OS: fresh inputs on every call."""
    g = torch.Generator(device=device or env.DEVICE)
    g.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    return g


def randn(shape, dtype=torch.float32, *, device=None, scale=1.0, offset=0.0, outliers=0.0,
          outlier_scale=100.0, gen: torch.Generator | None = None) -> torch.Tensor:
    """Signed normal samples (``offset + scale * N(0, 1)``) in ``dtype``.

    ``outliers`` is the fraction of elements replaced by values of magnitude up to
    ``outlier_scale`` (both signs), to catch formulas that overflow.
    """
    device = device or env.DEVICE
    gen = gen or generator(device)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale + offset
    if outliers > 0 and x.numel() > 0:
        pick = torch.rand(shape, generator=gen, device=device) < outliers
        big = (torch.rand(shape, generator=gen, device=device) * 2 - 1) * outlier_scale
        x = torch.where(pick, big, x)
    return x.to(dtype)


def odd_sizes() -> tuple[int, ...]:
    """Sizes that are not multiples of any block size (smaller under the interpreter)."""
    return env.pick(gpu=(1, 7, 1000, 1_000_003), cpu=(1, 7, 1000, 100_003))


class Guarded:
    """A tensor inside a larger buffer whose guard zones reveal out-of-bounds writes.

    The guards hold random bits; the tensor itself starts as NaN (poisoned), so an element the
    kernel never wrote shows up as NaN.
    """

    def __init__(self, shape, dtype=torch.float32, *, device=None, fill: torch.Tensor | None = None):
        device = device or env.DEVICE
        shape = tuple(shape)
        n = 1
        for s in shape:
            n *= s
        self.n = n
        self.buffer = torch.empty(n + 2 * GUARD, dtype=dtype, device=device)
        bits = torch.randint(-(2**15), 2**15, (self.buffer.numel(),), dtype=torch.int16, device=device)
        self.buffer.view(torch.int16 if dtype.itemsize == 2 else torch.int32).copy_(
            bits if dtype.itemsize == 2 else bits.to(torch.int32) * 65599)
        self.guard_bits = self._guards().clone()
        self.tensor = self.buffer[GUARD:GUARD + n].view(shape)
        if fill is None:
            self.tensor.fill_(float("nan"))
        else:
            self.tensor.copy_(fill)

    def _guards(self) -> torch.Tensor:
        b = self.buffer
        raw = b.view(torch.int16 if b.dtype.itemsize == 2 else torch.int32) if b.dtype.itemsize <= 4 \
            else b.view(torch.int64)
        return torch.cat([raw[:GUARD], raw[GUARD + self.n:]])

    def check(self, what: str, hint: str = "") -> None:
        """Raise if anything was written into the guard zones."""
        changed = (self._guards() != self.guard_bits).nonzero().flatten()
        if changed.numel() == 0:
            return
        first = int(changed[0])
        where = (f"{GUARD - first} element(s) before the start" if first < GUARD
                 else f"{first - GUARD} element(s) past the end")
        raise CheckFailure(
            f"{what}: your kernel wrote outside its buffer ({changed.numel()} element(s) changed in the "
            f"guard zones, the first {where}). Check the mask on your tl.store: lanes of the last "
            f"tile whose offsets are >= n must not store." + (f"\nHint: {hint}" if hint else ""))


def guarded_copy(x: torch.Tensor) -> Guarded:
    """``x`` copied into a guarded buffer (NaN would appear in the output if guards were read)."""
    return Guarded(x.shape, x.dtype, device=x.device, fill=x)


def nan_tailed(x: torch.Tensor, tail: int = GUARD) -> torch.Tensor:
    """A copy of the 1-D ``x`` followed in memory by ``tail`` NaNs: a kernel that reads past its end without a
    mask takes a NaN into its result, on a GPU too, where no load is inspected (a guard's random bits would be
    finite and could vanish, multiplied by a masked zero)."""
    buf = torch.full((x.numel() + tail,), float("nan"), dtype=x.dtype, device=x.device)
    buf[:x.numel()] = x
    return buf[:x.numel()]


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def compare(what: str, got: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None,
            atol: float | None = None, rtol: float | None = None, hint: str = "") -> None:
    """Raise :class:`CheckFailure` unless ``got`` matches the float64 ``expected``.

    NaN in ``got`` passes only where ``expected`` is NaN too; infinities must match exactly.
    """
    if not isinstance(got, torch.Tensor):
        raise CheckFailure(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        raise CheckFailure(f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}")
    dtype = dtype or got.dtype
    d_atol, d_rtol = tolerance(dtype)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    g = got.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    ok = torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
    if bool(ok.all()):
        return
    bad = (~ok).nonzero()
    idx = tuple(int(i) for i in bad[0])
    gv, ev = float(g[idx]), float(e[idx])
    idx_txt = idx[0] if len(idx) == 1 else idx
    msg = (f"{what}: {bad.shape[0]} of {g.numel()} elements differ from the float64 reference "
           f"(atol={atol:g}, rtol={rtol:g}). First at index {idx_txt}: got {_fmt(gv)}, expected {_fmt(ev)}.")
    if gv != gv and ev == ev:
        msg += ("\nThat element still holds the NaN the output was poisoned with, or your formula made a "
                "NaN: does the grid cover every element, and does the math overflow for large inputs?")
    if hint:
        msg += f"\nHint: {hint}"
    raise CheckFailure(msg)


def check_loads_inside(case: str, loads, inputs: Sequence[torch.Tensor]) -> None:
    """Raise if a masked-in lane of a recorded load read outside every input (a missing load mask).

    Only under the interpreter (see :mod:`course_utils.checkers.loads`); on a GPU nothing is recorded."""
    from .checkers.loads import outside

    bad = outside(loads, list(inputs))
    if bad:
        raise CheckFailure(f"{case}: your kernel loaded {bad} element(s) outside its inputs (lanes past the "
                           "end of the last tile): pass mask=offsets < n_elements to every tl.load, not only to "
                           "tl.store. A masked-off lane must not load: past the end of a buffer there may be no "
                           "memory at all.")


def verdict(name: str, detail: str = "passed") -> None:
    """Print the deterministic line a passing check cell shows (same text on CPU and GPU)."""
    print(f"PASS {name}: {detail}")


def check_launches(what: str, fn: Callable, *args, expected: int, **kwargs) -> None:
    """Raise unless ``fn(*args, **kwargs)`` launches exactly ``expected`` kernels."""
    counts = count_launches(fn, *args, **kwargs)
    if counts.total != expected:
        raise CheckFailure(
            f"{what}: expected {expected} kernel launch(es), counted {counts}. "
            + ("A fused version does all its work in one Triton kernel: no torch ops on the data "
               "before or after it." if expected == 1 else ""))


class _NoTorch:
    paused = 0


def check_kernel_launches(what: str, fn: Callable, *args, expected: int = 1, **kwargs) -> None:
    """Raise unless ``fn`` launches exactly ``expected`` Triton kernels of the student's own, and no
    torch operator that computes (an ``F.gelu`` or ``torch.softmax`` is one launch too, but not a kernel)."""
    launched: list[tuple[str, str]] = []

    def record(original, kernel, a, kw):
        launched.append((getattr(kernel, "__name__", "kernel"), getattr(getattr(kernel, "fn", None), "__module__", "")))

    def run():
        with triton_launch_hook(record, _NoTorch()):
            fn(*args, **kwargs)
    counts = count_launches(run)
    theirs = [n for n, m in launched if not m.startswith("course_utils")]
    course = [n for n, m in launched if m.startswith("course_utils")]
    if course:  # named first: the course's launcher may also run a torch op of its own (a zero_ on a GPU)
        raise CheckFailure(f"{what}: it launched the course's own kernel ({', '.join(course)}): launch yours.")
    if counts.torch:
        ops = ", ".join(f"aten.{k}" for k in counts.torch)
        raise CheckFailure(f"{what}: the work ran in torch ({ops}), not in a Triton kernel of yours: write it as "
                           f"a @triton.jit kernel launched with kernel[grid](...), no torch ops on the data.")
    if len(theirs) != expected:
        raise CheckFailure(f"{what}: expected {expected} launch(es) of your Triton kernel, counted {len(theirs)}"
                           + (f" ({', '.join(theirs)})" if theirs else "") + ".")


def _referenced(fn, depth: int = 3, seen=None):
    """(dotted name, object) for every global, and attribute chain of one, that ``fn``'s code loads,
    through the student's own helper functions, nested functions and closures."""
    seen = set() if seen is None else seen
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen or depth < 0:
        return
    seen.add(id(code))
    glb = dict(getattr(fn, "__globals__", {}))
    for var, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        with contextlib.suppress(ValueError):
            glb[var] = cell.cell_contents  # a closure variable resolves like a global
    codes = [code]
    while codes:
        c = codes.pop()
        codes += [k for k in c.co_consts if inspect.iscode(k)]
        cur, name = None, ""
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF") and isinstance(ins.argval, str) \
                    and ins.argval in glb:
                cur, name = glb[ins.argval], ins.argval
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and cur is not None and isinstance(ins.argval, str):
                cur, name = getattr(cur, ins.argval, None), f"{name}.{ins.argval}"
                if cur is None:
                    continue
            else:
                cur = None
                continue
            yield name, cur
            if inspect.isfunction(cur) and cur.__module__ == getattr(fn, "__module__", None):
                yield from _referenced(cur, depth - 1, seen)


def refuse_answer_key(what: str, fn: Callable, forbidden: dict[str, object]) -> None:
    """Raise if the student's ``fn`` calls one of the course's answers (``{description: object}``),
    under any name: the check judges the student's work, not the course's."""
    wanted = {id(o): d for d, o in forbidden.items()}
    if id(fn) in wanted:
        raise CheckFailure(f"{what}: this is the course's own {wanted[id(fn)]}: write it yourself.")
    for name, obj in _referenced(fn):
        if id(obj) in wanted:
            raise CheckFailure(f"{what}: your code calls {name}, the course's {wanted[id(obj)]}: that is the "
                               "answer the check compares with. Write the computation yourself.")


def require(condition: bool, message: str) -> None:
    """Raise :class:`CheckFailure` with ``message`` unless ``condition``."""
    if not condition:
        raise CheckFailure(message)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN equals NaN)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def _accepts_out(fn: Callable) -> bool:
    try:
        return "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def check_elementwise(name: str, fn: Callable, ref: Callable, *, n_inputs: int = 1,
                      sizes: Sequence[int] | None = None, dtypes: Sequence[torch.dtype] | None = None,
                      outliers: float = 0.0, outlier_scale: float = 100.0, launches: int | None = None,
                      atol: float | None = None, rtol: float | None = None, hint: str = "") -> None:
    """Judge an elementwise ``fn(*inputs[, out=...])`` against ``ref`` computed in float64.

    If ``fn`` takes an ``out`` argument it gets a NaN-poisoned output inside guard zones, so
    writes past the end are caught. Inputs sit in guard zones too and must come back unchanged.
    """
    sizes = tuple(sizes or odd_sizes())
    dtypes = tuple(dtypes or env.supported_dtypes())
    with_out = _accepts_out(fn)
    for dtype in dtypes:
        for n in sizes:
            case = f"{name} ({str(dtype).removeprefix('torch.')}, n={n})"
            xs = [guarded_copy(randn((n,), dtype, outliers=outliers, outlier_scale=outlier_scale))
                  for _ in range(n_inputs)]
            before = [x.tensor.clone() for x in xs]
            out = Guarded((n,), dtype) if with_out else None
            try:
                with track_loads() as loads:
                    got = fn(*[x.tensor for x in xs], out=out.tensor) if with_out else fn(*[x.tensor for x in xs])
            except NotImplementedError:
                raise
            except CheckFailure:
                raise
            except Exception as e:  # a crash in the student's code: say where
                raise CheckFailure(f"{case}: your function raised {type(e).__name__}: {e}") from e
            check_loads_inside(case, loads, [x.tensor for x in xs])
            if with_out:
                got = out.tensor if got is None else got
                out.check(case, hint)
            expected = ref(*[b.to(torch.float64) for b in before])
            compare(case, got, expected, dtype=dtype, atol=atol, rtol=rtol, hint=hint)
            for x, b in zip(xs, before):
                x.check(f"{case}, an input buffer")
                if not _same_bits(x.tensor, b):
                    raise CheckFailure(f"{case}: your function changed its input; it must only write the output")
    if launches is not None:
        x = [randn((sizes[-1],), dtypes[0]) for _ in range(n_inputs)]
        kw = {"out": torch.empty_like(x[0])} if with_out else {}
        fn(*x, **kw)  # compile (and autotune) first: only the second call is counted
        check_kernel_launches(name, fn, *x, expected=launches, **kw)
    detail = "matches the float64 reference on every size and dtype tried"
    if with_out:
        detail += ", no writes outside the output"
    if launches is not None:
        detail += f", {launches} kernel launch" + ("es" if launches != 1 else "")
    verdict(name, detail)
