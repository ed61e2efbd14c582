"""A cheaper launch for the ops' hot kernels (chapter 12: host time is speed), on Triton's public API.

``kernel[grid](*args, **meta)`` costs a host CPU tens of microseconds on every call: Triton's launcher
binds the arguments, specializes each of them, builds the compile cache key and looks it up, all
before the launch itself. The compiled kernel it finds is a pure function of what the specialization
reads, and ``kernel[grid](...)`` returns it: its call ``compiled[grid](*all)`` launches it directly, with
every parameter of the kernel in signature order (constexprs included, as the launcher passes them).
:func:`launch` keeps that compiled kernel per specialization and calls it. What this needs of Triton's
internals (the classes, the launcher method, the parameter list, the knobs) comes from
:mod:`course_utils.triton_internals`, where each assumption is written down and checked:

    key = (id(kernel), call site's key, grid, the specialization of args, meta, debug knobs, current device)

where the specialization of ``args`` is exactly what Triton's depends on, and more: each tensor's dtype
and whether its data pointer is 16-byte aligned, each int's value (Triton reads 1, divisible by 16, and
32- or 64-bit range from it), bool values, None, "a float" for floats (Triton passes a float as an fp32
runtime value, never specialized), a host tensor descriptor's base dtype, block shape, padding, shape
and strides (Triton reads the first three; its base is 16-byte aligned by construction). ``meta``
(constexprs and options such as ``num_warps``) enters the key by name, value and type (True and 1 are
equal keys in Python, not to Triton). So a launch reuses a compiled kernel only where ``kernel[grid]``
would have picked the same one; the call site's ``key`` (a name for the launch) adds to this, it is
never trusted alone.

The first call of a key goes through ``kernel[grid]``, which checks, compiles and launches as always.
Anything this module does not map goes through ``kernel[grid]`` every time and is not cached: the
interpreter (``env.on_gpu()`` false), ``ENABLED = False``, a kernel that is not a plain ``@triton.jit`` one
(an autotuner, heuristics) or has pre-run hooks, the launcher method replaced by a launch counter
(``course_utils.profile.count_launches`` counts every launch), a launch-enter hook set (a profiler
sees the plain launch), a grid that is not a tuple of ints, an argument of another type (a
tensor subclass, a tuple), a non-constexpr parameter passed by keyword, a constexpr passed
positionally that is not an int, bool or None, a parameter missing with no default. One thing
Triton's launcher checks that the cached call does not: that the kernel's global constants have not
changed since it was compiled (the course never rebinds them; the first call of each key still checks).

While ``torch.compile`` traces a ``triton_op`` (the ops on a GPU, :mod:`course_utils.ops._lib`), the tensors are a
tracer's (functional, fake: :func:`traced`), and the launch is ``torch.library.wrap_triton(kernel)[grid]``:
the compiled graph records the kernel and its arguments, and Inductor's code launches it.

The cache holds at most ``MAX_ENTRIES`` compiled launches and is emptied when full (ints that change on
every call, a seed or a step, would make a new key every call: they cost one plain launch each, never
unbounded memory). The stream is looked up at every launch, as ``kernel[grid]`` does, so the same call
works on any stream and inside a CUDA graph capture.
"""

from __future__ import annotations

import inspect

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import env
from ..triton_internals import (
    TritonInternalsError,
    compiled_launch_classes,
    launch_hook_set,
    launch_knobs,
    launch_method,
    launch_parameters,
)

try:   # the one documented place for Triton's internals; a Triton that breaks their assumptions: plain launches
    _JIT, _COMPILED = compiled_launch_classes()
    _INTERNALS_OK = True
except TritonInternalsError:
    _JIT = _COMPILED = type(None)
    _INTERNALS_OK = False

ENABLED = _INTERNALS_OK  # False: every launch is the plain kernel[grid](*args, **meta) (checks compare both)
MAX_ENTRIES = 4096      # compiled launches kept; the cache is emptied when it holds more
_CACHE: dict = {}
_TENSORS = (torch.Tensor, torch.nn.Parameter)   # exact types: a tensor subclass may mean another data_ptr
_MISSING = object()
_TRACERS = (FunctionalTensor, FakeTensor)
# the types these names stand for, replaced by fakes in the tests of the cache logic (no GPU there)
JIT_TYPES: tuple = (_JIT,)
COMPILED_TYPES: tuple = (_COMPILED,)
current_device = torch.cuda.current_device
# the launcher method as Triton defines it: a launch counter or recorder that replaces it (course_utils.profile's
# triton_launch_hook, aot's pretend launches) must see every launch, so then every launch is the plain one
PLAIN_RUN = launch_method(_JIT)


def launch(kernel, key, grid: tuple, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)``, through the compiled kernel kept for this specialization when there is
    one (on a GPU only). ``key``: the call site's plan key (hashable), added to the specialization."""
    if not ENABLED or not env.on_gpu():
        plain_launch(kernel, grid, args, meta)
        return
    fast_launch(kernel, key, grid, args, meta)


def traced(t) -> bool:
    """Whether ``t`` is a tracer's tensor (functional or fake: what AOTAutograd traces with), with no data."""
    # a plain tensor first: isinstance against the tracers' classes costs the ops' hot path ~0.5 us a tensor
    return type(t) is not torch.Tensor and isinstance(t, _TRACERS)


def aligned16(t: torch.Tensor) -> bool:
    """Whether ``t``'s data starts on a 16-byte boundary; for a tracer's tensor, whether its offset keeps the
    boundary of its storage (which the allocator aligns): it has no data pointer."""
    if traced(t):
        return t.storage_offset() * t.element_size() % 16 == 0
    return t.data_ptr() % 16 == 0


def plain_launch(kernel, grid, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)``; while torch.compile traces (a tracer's tensor among ``args``),
    ``wrap_triton(kernel)[grid](...)``, which records the launch in the graph instead."""
    for a in args:
        if traced(a):
            torch.library.wrap_triton(kernel)[grid](*args, **with_defaults(kernel, len(args), meta))
            return
    kernel[grid](*args, **meta)


def with_defaults(kernel, n_args: int, meta: dict) -> dict:
    """``meta`` plus the default of every parameter after the first ``n_args`` that it leaves out. Why: a traced
    launch records the arguments it is given, and Inductor's generated code passes those alone, so a constexpr
    left to its default goes missing at the launch (torch 2.11: ``launcher() missing ... '_grid_2'``)."""
    fn = kernel
    while hasattr(fn, "fn"):   # an autotuner or heuristics wraps a JITFunction, which wraps the Python function
        fn = fn.fn
    try:
        later = list(inspect.signature(fn).parameters.values())[n_args:]
    except (TypeError, ValueError):   # no Python signature to read (a stand-in kernel): what the call gives
        return meta
    missing = {p.name: p.default for p in later if p.name not in meta and p.default is not p.empty}
    return {**meta, **missing} if missing else meta


def fast_launch(kernel, key, grid: tuple, args: tuple, meta: dict) -> None:
    """:func:`launch` without its mode check (the tests drive it with fake kernels on the CPU)."""
    spec = specialization(args)
    if (spec is None or launch_method(type(kernel)) is not PLAIN_RUN or launch_hook_set()
            or type(grid) is not tuple):
        plain_launch(kernel, grid, args, meta)
        return
    try:
        # id(kernel): a JITFunction hashes through its cache_key property (microseconds a launch); the kernels
        # are module-level objects, and the entry holds the kernel so that its id is never reused
        full_key = (id(kernel), key, grid, spec, tuple(meta.items()), tuple(map(type, meta.values())),
                    launch_knobs(), current_device())
        entry = _CACHE.get(full_key)
    except TypeError:    # something unhashable in the key or in meta: not cached
        kernel[grid](*args, **meta)
        return
    if entry is not None:
        runner, tail, _ = entry
        runner(*args, *tail)
        return
    compiled = kernel[grid](*args, **meta)
    tail = _tail(kernel, args, meta)
    if tail is None or not isinstance(compiled, COMPILED_TYPES) or not all(type(g) is int for g in grid):
        return
    if len(_CACHE) >= MAX_ENTRIES:
        _CACHE.clear()
    _CACHE[full_key] = (compiled[grid + (1,) * (3 - len(grid))], tail, kernel)


def specialization(args: tuple):
    """What Triton's specialization of ``args`` reads, one item per argument (None when an argument is of a
    type not mapped here). Items of different kinds never compare equal (an int; a tuple that starts with
    a dtype, the type ``bool`` or ``TensorDescriptor``; the type ``float``; None), so equal tuples mean
    equal kinds in every position, whatever Python's 1 == True and 1 == 1.0 say."""
    out = []
    put = out.append
    for a in args:
        t = type(a)
        if t is int:
            put(a)
        elif t in _TENSORS:
            put((a.dtype, a.data_ptr() % 16 == 0))
        elif t is float:
            put(float)
        elif t is bool:
            put((bool, a))
        elif a is None:
            put(None)
        elif t is TensorDescriptor:   # Triton reads the base's dtype and the block shape; shape and strides too here
            put((TensorDescriptor, a.base.dtype, tuple(a.block_shape), a.padding, a.shape, a.strides))
        else:
            return None
    return tuple(out)


def _tail(kernel, args: tuple, meta: dict):
    """The parameters after ``args`` in signature order (from ``meta`` or their defaults), or None when the
    call's layout is not the simple one mapped here: then the launch is never cached."""
    params = launch_parameters(kernel) if isinstance(kernel, JIT_TYPES) else None
    if params is None or len(args) > len(params):
        return None
    for (_, is_constexpr, _, _), a in zip(params, args):   # a constexpr given positionally: keyed only if an int
        if is_constexpr and type(a) not in (int, bool, type(None)):
            return None
    tail = []
    for name, is_constexpr, has_default, default in params[len(args):]:
        value = meta.get(name, _MISSING)
        if value is _MISSING:
            if not has_default:
                return None
            value = default
        elif not is_constexpr:   # a runtime argument by keyword: its value would key the cache
            return None
        tail.append(value)
    return tuple(tail)


def clear() -> None:
    """Forget every compiled launch (the next call of each key goes through ``kernel[grid]`` again)."""
    _CACHE.clear()


def size() -> int:
    return len(_CACHE)


__all__ = ["launch", "fast_launch", "plain_launch", "with_defaults", "traced", "aligned16", "specialization", "clear",
           "size", "ENABLED", "MAX_ENTRIES"]
