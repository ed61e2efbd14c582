"""How every course op is registered (``torch.ops.course.<name>``) and how its eager fast path is built.

Each op is one or two ``torch.library.custom_op``s that run the course's Triton kernels: a forward that
also returns what the backward needs (statistics, log-sum-exps), and a backward. Both have a fake
(meta) implementation, so ``torch.compile`` traces through them and Inductor fuses around them. The
public op with the documented signature (``course::layer_norm(x, weight, bias, eps) -> y``) is a
``CompositeImplicitAutograd`` op that calls the forward and drops the extras.

The same forward, ``setup_context`` and backward functions also make a ``torch.autograd.Function``
(:func:`fast_function`): the Python wrappers in :mod:`course_utils.ops` call it when they are not being
compiled, which skips the dispatcher's Python path (tens of microseconds a call, measured by
:func:`course_utils.ops.host_overhead_table`). The backward reaches the backward kernels through
``ctx.bwd``: the registered op when autograd runs the op, the plain function on the fast path.

On a GPU (``INDUCTOR_SEES_KERNELS``) every kernel op is a ``torch.library.triton_op``: eager calls run the
same function, and while ``torch.compile`` traces, the function runs on functional tensors and each launch
becomes ``wrap_triton(kernel)[grid](...)`` (:func:`course_utils.tuned.launch.launch` does that), so the
compiled graph holds the kernels themselves and Inductor's generated code launches them, with no Python of
the course's per call. Under Triton's interpreter (the CPU, CI) the ops stay ``custom_op``s, opaque to
Inductor: there a ``triton_op`` fails ``opcheck``'s fake-tensor test and ``torch.compile`` (the
interpreter asks the fake tensors for data pointers; tried with torch 2.13 and Triton 3.6), and Inductor
launches user kernels on GPUs only. ``COURSE_OPAQUE_OPS=1`` keeps the custom ops on a GPU too (to compare).

The ops launch their hot kernels through :func:`launch` (:mod:`course_utils.tuned.launch`): on a GPU it
keeps the compiled kernel that ``kernel[grid]`` found for each specialization and calls it directly,
skipping the binder and the cache key (``course_utils.tuned.launch.ENABLED = False`` turns it off).
It lives on the tuned shelf, not here, so that tuned modules can import it without importing the ops.
"""

from __future__ import annotations

import inspect
import operator
import os
import tempfile
from collections.abc import Callable

import torch

from .. import env
from ..state import RuntimeCache
from ..tuned.launch import launch, traced  # noqa: F401  (the ops' hot launches: course_utils.tuned.launch says why)

NAMESPACE = "course"
#: ``COURSE_OPAQUE_OPS``: "1" keeps every op opaque on a GPU; a comma-separated list of kernel op names
#: ("linear_cross_entropy_fwd,linear_cross_entropy_bwd") keeps those opaque (to find which op a fault needs)
_OPAQUE_ENV = os.environ.get("COURSE_OPAQUE_OPS", "0").strip()


def opaque_names(value: str) -> frozenset:
    """The kernel ops that a ``COURSE_OPAQUE_OPS`` value names ("0", "" and "1" name none one by one)."""
    value = value.strip()
    return frozenset() if value in ("", "0", "1") else frozenset(n.strip() for n in value.split(",") if n.strip())


OPAQUE_NAMES = opaque_names(_OPAQUE_ENV)
#: whether torch.compile sees the ops' kernels (triton_op) or calls each op as one opaque custom op
INDUCTOR_SEES_KERNELS = env.on_gpu() and _OPAQUE_ENV != "1"
if env.on_gpu() and _OPAQUE_ENV not in ("", "0"):
    # Inductor's caches key a graph by its ops' names, not by how they are registered: an opaque build would
    # reuse a visible one's code (seen on an H100). The opaque builds keep a cache of their own.
    tag = "" if _OPAQUE_ENV == "1" else "_" + "_".join(sorted(OPAQUE_NAMES))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"torchinductor_course_opaque{tag}"))
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_DEFINED: dict[str, object] = {}
KERNEL_OPS: dict[str, tuple[str, Callable]] = RuntimeCache()   # name -> (schema, impl) of every kernel op


def kernel_op(name: str, schema: str, impl: Callable, fake: Callable, visible: bool = True):
    """``course::<name>`` running ``impl``, with ``fake`` for tracing (registered once per process); ``visible``
    False keeps it an opaque custom op on a GPU too."""
    if name in _DEFINED:
        return _DEFINED[name]
    KERNEL_OPS[name] = (schema, impl)
    if INDUCTOR_SEES_KERNELS and visible and name not in OPAQUE_NAMES:
        # the schema comes from the annotations: give impl the schema's own
        opaque = _custom_op(f"{name}_opaque", schema, impl, fake)
        op = torch.library.triton_op(f"{NAMESPACE}::{name}", annotated(impl, schema, opaque), mutates_args=())
        op.register_fake(fake)   # in place of impl itself: ours also takes symbolic shapes
    else:
        op = _custom_op(name, schema, impl, fake)
    _DEFINED[name] = op
    return op


def _custom_op(name: str, schema: str, impl: Callable, fake: Callable):
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    _inductor_fast_fallback(name)
    return op


_PY_TYPES = {"Tensor": torch.Tensor, "Optional[Tensor]": torch.Tensor | None, "float": float, "int": int, "bool": bool}


def annotated(impl: Callable, schema: str, opaque: Callable | None = None) -> Callable:
    """``impl`` behind a signature annotated as ``schema`` says ("(Tensor x, float eps) -> (Tensor, Tensor)"):
    ``triton_op`` infers an op's schema from its function's annotations, and the course writes schemas. (The
    inferred schema says SymInt where ``schema`` says int: an int annotation is inferred as SymInt.)

    ``opaque``: the same op as an opaque custom op, called instead of ``impl`` when a shape, a stride or an
    int argument is symbolic (torch.compile's dynamic shapes): the ops' launch plans are keyed by concrete
    sizes, so such a trace records the op whole, as the custom op would have been, and runs it per call."""
    parsed = torch._C.parse_schema(f"{NAMESPACE}::_{schema}")

    def py(t) -> type:
        return _PY_TYPES[str(t)]

    params = [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=py(a.type),
                                default=a.default_value if a.has_default_value() else inspect.Parameter.empty)
              for a in parsed.arguments]
    rets = [py(r.type) for r in parsed.returns]
    ret = rets[0] if len(rets) == 1 else tuple.__class_getitem__(tuple(rets))

    def fn(*args, **kwargs):
        if opaque is not None and _symbolic(args):
            return opaque(*args, **kwargs)
        return impl(*args, **kwargs)

    fn.__signature__ = inspect.Signature(params, return_annotation=ret)
    fn.__name__, fn.__doc__ = impl.__name__, impl.__doc__
    return fn


def _symbolic(args) -> bool:
    """Whether a tensor's shape or strides, or an int argument, holds a symbol (dynamic-shape tracing)."""
    for a in args:
        if isinstance(a, torch.SymInt):
            return True
        if isinstance(a, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*a.shape, *a.stride())):
            return True
    return False


def _inductor_fast_fallback(name: str) -> None:
    """Put ``course::<name>`` on Inductor's list of known fallbacks, on torch < 2.13 with CUDA only.

    Why: Inductor before torch 2.13 formats every input of an op it meets without a lowering into a log
    line, eagerly, by printing each input's IR, and each input prints its own inputs. A GPT's residual
    stream feeds every ``add_layer_norm`` from the one before (both its inputs), so the printing doubles
    with each layer: GPT-2 small's 24 of them did not compile within 120 s on an H100 (torch 2.11, stack
    in ``results/h100-80gb-hbm3/bench_training.log``). A listed op takes the same fallback without the
    log line. torch 2.13 formats the line lazily; the interpreter's CPU runs need nothing."""
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 13) or not torch.cuda.is_available():
        return
    from torch._inductor import lowering  # imported only where the bug is
    lowering.FALLBACK_ALLOW_LIST.add(f"{NAMESPACE}::{name}")


def public_op(name: str, schema: str, fn: Callable) -> None:
    """``course::<name>``: a composite of kernel ops (autograd comes from theirs)."""
    if name in _DEFINED:
        return
    _LIB.define(f"{name}{schema}")
    _LIB.impl(name, fn, "CompositeImplicitAutograd")
    _DEFINED[name] = fn


def autograd(op, setup: Callable, backward: Callable, bwd_op) -> None:
    """``register_autograd`` with ``ctx.bwd`` set to the registered backward op."""
    def setup_context(ctx, inputs, output):
        setup(ctx, inputs, output)
        ctx.bwd = bwd_op
    torch.library.register_autograd(op, backward, setup_context=setup_context)


def fast_function(name: str, impl: Callable, setup: Callable, backward: Callable, bwd_impl: Callable,
                  public: int | None = 1):
    """An ``autograd.Function`` over the same functions as the registered op (the eager fast path).

    ``public``: how many of ``impl``'s outputs the call returns (the op's documented result); the others
    (statistics, log-sum-exps: what the backward reads) are saved for the backward, not returned, so
    autograd wraps and tracks only what the caller gets (chapter 12: host time is speed). None: ``impl``
    returns one tensor, returned as it is."""
    # operator.itemgetter picks the public outputs in C: a Python function would add a frame to every call
    public_of = (lambda out: out) if public is None else operator.itemgetter(0 if public == 1 else slice(public))

    def forward(ctx, *args):
        ctx.set_materialize_grads(False)   # an output nothing reads gets None, not a zeros kernel
        out = impl(*args)
        setup(ctx, args, out)
        ctx.bwd = bwd_impl
        return public_of(out)

    cls = type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
    })

    def run(*args):
        """``apply`` when autograd must record the call, else the forward itself: with nothing to
        differentiate (inference, ``torch.no_grad()``), aten records no node either, and neither does this."""
        if torch.is_grad_enabled():
            for a in args:
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    return cls.apply(*args)
        return public_of(impl(*args))

    cls.run = staticmethod(run)
    return cls


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts matrix products to on ``device_type``, or None when it is off."""
    if device_type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def cast(dtype: torch.dtype | None, *ts):
    """``ts`` in ``dtype`` (unchanged when dtype is None or a tensor already has it)."""
    if dtype is None:
        return ts
    return tuple(t if t is None or t.dtype == dtype or not t.is_floating_point() else t.to(dtype) for t in ts)


# --------------------------------------------------------------------------- the hot path's arithmetic
# ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in Triton >= 3.4: about 3 us a
# call on a host CPU, several per launch. The ops compute grids with these plain-integer twins.


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive integers."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# ``torch.empty(shape, dtype=..., device=...)`` and ``x.new_empty(shape)`` cost a host CPU 1.7-3.1 us a call from
# Python, most of it spent on the arguments, not on the allocation: ``torch.empty_strided(shape, strides, dtype=...,
# device=...)`` with plain int tuples costs 1.1-1.2 us and ``torch.empty_like(x)`` 0.9-1.1 us for the same tensor
# (CPU tensors, 3-D shapes, min of repeats; the same argument parsing runs before a CUDA allocation). So the
# ops' hot paths allocate through these two, with the shapes and strides kept in their plans.


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape`` (as torch counts them: a dim of size 0 steps as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def tracing(*ts) -> bool:
    """Whether torch.compile is tracing (or ``ts`` hold a tracer's tensors: a triton_op's function runs on
    functional tensors while AOTAutograd traces it): launch plans are then looked up or taken by rule,
    never timed."""
    return torch.compiler.is_compiling() or any(traced(t) for t in ts)
