"""The ONE place where the course touches Triton's internals (nothing else under ``course_utils`` may): this
package, whose modules split it by job. :mod:`.catalogue` lists every internal and the assumption it makes;
here are the checks of those assumptions and the helpers for the launch path, launch counting and the compile
matrix; :mod:`.interpreter` holds the hooks into Triton's interpreter (re-exported here).
``tests/test_triton_internals.py`` holds the rule that no file under course_utils outside this package touches
Triton's internals.

A student's call never comes here: kernels launch through ``kernel[grid](...)`` only. What needs
internals is tooling:

- the compile matrix (``course_utils.aot``) records launches instead of running them (it replaces
  ``JITFunction.run`` and ``Autotuner.run``) and binds a recorded launch the way ``JITFunction.run``
  would, for a target GPU that is not there (``create_function_from_signature``, ``_pack_args``,
  ``ASTSource``, ``make_backend``, ``GPUTarget``);
- launch counting (``course_utils.profile``) wraps ``run`` of the classes ``kernel[grid]`` calls;
- checkers see a kernel's loads (:func:`interpreter_load_hook`) and run the last programs of a grid
  past 2**31 elements (:func:`interpreter_programs_from`) under the interpreter;
- the interpreter on NumPy >= 2.4 needs :func:`patch_interpreter_index`.

Every internal is listed in :data:`INTERNALS` with the Triton version it was written for and the
assumption it makes. :func:`problems` checks those assumptions against the installed Triton (without
compiling anything); a helper here that needs one calls :func:`require` first, which raises
:class:`TritonInternalsError` naming the broken assumption when the installed Triton differs from
the version it was written for AND the assumption no longer holds. ``tests/test_triton_internals.py``
runs :func:`problems` on every CI run, so a Triton upgrade that breaks one fails loudly there.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

try:   # the launch path reads two knobs per launch (launch_hook_set, launch_knobs); require() checks they exist
    from triton import knobs as _knobs
except ImportError:
    _knobs = None

from .catalogue import INTERNALS, WRITTEN_FOR, Internal  # noqa: F401, E402  (re-exported: the tests read them here)


class TritonInternalsError(RuntimeError):
    """An internal the course relies on is missing or changed in the installed Triton."""


def triton_version() -> tuple[int, int] | None:
    try:
        import triton
    except ImportError:  # pragma: no cover - Triton ships Linux wheels only
        return None
    major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in triton.__version__.split(".")[:2])
    return major, minor


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _check(name: str) -> str:
    """'' when the assumption of ``INTERNALS[name]`` holds in the installed Triton, else what broke."""
    try:
        if name == "JITFunction.run":
            from triton.runtime.jit import JITFunction
            sig = inspect.signature(JITFunction.run).parameters
            if not {"grid", "warmup"} <= set(sig) or sig["grid"].kind != inspect.Parameter.KEYWORD_ONLY:
                return f"JITFunction.run's parameters are now {list(sig)}"
            sets = JITFunction.__init__.__code__.co_names
            missing = [a for a in ("params", "signature", "arg_names", "debug", "pre_run_hooks") if a not in sets]
            if missing:
                return f"JITFunction no longer sets {missing}"
            from triton.runtime.jit import KernelParam
            gone = [a for a in ("name", "is_constexpr", "has_default", "default") if not hasattr(KernelParam, a)]
            return f"KernelParam has no {gone}" if gone else ""
        if name == "Autotuner.run":
            import triton
            from triton.runtime.autotuner import Autotuner
            if not callable(getattr(Autotuner, "run", None)) or not hasattr(triton.Config, "all_kwargs"):
                return "Autotuner.run or triton.Config.all_kwargs is gone"
            names = Autotuner.__init__.__code__.co_names
            return "" if {"configs", "fn"} <= set(names) else "Autotuner no longer sets .configs and .fn"
        if name == "InterpretedFunction":
            from triton.runtime.interpreter import InterpretedFunction
            sig = inspect.signature(InterpretedFunction.run).parameters
            return "" if {"grid", "warmup"} <= set(sig) else f"InterpretedFunction.run's parameters: {list(sig)}"
        if name == "create_function_from_signature":
            from triton.runtime.jit import create_function_from_signature
            got = _params(create_function_from_signature)
            return "" if got[:3] == ["sig", "kparams", "backend"] else f"its parameters are now {got}"
        if name == "JITFunction._pack_args":
            from triton.runtime.jit import JITFunction
            if not hasattr(JITFunction, "_pack_args"):
                return "JITFunction._pack_args is gone"
            got = _params(JITFunction._pack_args)
            want = ["self", "backend", "kwargs", "bound_args", "specialization", "options"]
            return "" if got == want else f"its parameters are now {got}, expected {want}"
        if name == "CompiledKernel.__getitem__":
            from triton.compiler import CompiledKernel
            from triton.runtime.jit import JITFunction
            run = inspect.getsource(JITFunction.run)
            if "bound_args.values()" not in run or "return kernel" not in run:
                return "JITFunction.run no longer launches *bound_args.values() and returns the compiled kernel"
            return "" if callable(getattr(CompiledKernel, "__getitem__", None)) else "CompiledKernel[grid] is gone"
        if name == "knobs":
            from triton import knobs
            knobs.runtime.debug, knobs.compilation.instrumentation_mode  # noqa: B018 - attribute check
            return ""
        if name == "compiler":
            import triton
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource, make_backend
            got = _params(ASTSource.__init__)
            if got[:5] != ["self", "fn", "signature", "constexprs", "attrs"]:
                return f"ASTSource's parameters are now {got}"
            GPUTarget("cuda", 90, 32), make_backend  # noqa: B018 - constructible, importable
            return "" if callable(getattr(triton, "compile", None)) else "triton.compile is gone"
        if name == "InterpreterBuilder.create_masked_load":
            from triton.runtime.interpreter import InterpreterBuilder
            got = _params(getattr(InterpreterBuilder.create_masked_load, "_course_original",
                                  InterpreterBuilder.create_masked_load))
            want = ["self", "ptrs", "mask"]  # the hook passes everything after these through (3.9 renamed some)
            return "" if got[:3] == want else f"its parameters are now {got}, expected {want} first"
        if name == "InterpreterBuilder.set_grid_idx":
            from triton.runtime.interpreter import InterpreterBuilder
            idx, dim = InterpreterBuilder.set_grid_idx, InterpreterBuilder.set_grid_dim
            got = (_params(getattr(idx, "_course_original", idx)), _params(getattr(dim, "_course_original", dim)))
            if got != (["self", "x", "y", "z"], ["self", "nx", "ny", "nz"]):
                return f"set_grid_idx / set_grid_dim's parameters are now {got[0]} / {got[1]}"
            reads = InterpreterBuilder.create_get_program_id.__code__.co_names
            return "" if "grid_idx" in reads else "tl.program_id no longer reads builder.grid_idx"
        if name == "interpreter._patch_lang_tensor":
            from triton.runtime import interpreter
            original = getattr(interpreter, "_patch_lang_tensor", None)
            if original is None:
                return "triton.runtime.interpreter._patch_lang_tensor is gone"
            original = getattr(original, "_course_original", original)
            got = _params(original)
            return "" if got == ["tensor", "scope"] else f"its parameters are now {got}"
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    raise KeyError(f"unknown Triton internal {name!r}: one of {sorted(INTERNALS)}")


def problems() -> list[str]:
    """One line per internal whose assumption does not hold in the installed Triton (empty: all hold)."""
    version = triton_version()
    if version is None:
        return []
    lines = []
    for name, internal in INTERNALS.items():
        broken = _check(name)
        if broken:
            lines.append(f"{name} (written for Triton {'.'.join(map(str, internal.written_for))}, installed "
                         f"{'.'.join(map(str, version))}; used by {internal.used_by}): {broken}. "
                         f"Assumed: {internal.assumption}")
    return lines


def require(*names: str) -> None:
    """Raise :class:`TritonInternalsError` when a named internal's assumption fails (the gate: on the
    version it was written for, nothing is checked at run time; on any other, its assumption is)."""
    if triton_version() == WRITTEN_FOR:
        return
    broken = [line for line in problems() if line.split(" ", 1)[0] in names]
    if broken:
        raise TritonInternalsError("the installed Triton differs from what course_utils/triton_internals/ "
                                   "was written for:\n" + "\n".join(broken))


# --------------------------------------------------------------------------- the internals themselves

def jit_classes():
    """(JITFunction, Autotuner): what ``@triton.jit`` and ``@triton.autotune`` make (compiled mode)."""
    require("JITFunction.run", "Autotuner.run")
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    return JITFunction, Autotuner


def compiled_launch_classes():
    """(JITFunction, CompiledKernel): what ``@triton.jit`` makes and what its launch returns (compiled mode)."""
    require("JITFunction.run", "CompiledKernel.__getitem__", "knobs")
    from triton.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction
    return JITFunction, CompiledKernel


def launch_method(cls):
    """The method ``kernel[grid](...)`` calls on a kernel of class ``cls`` (``JITFunction.run``): a launch counter
    or recorder replaces it (profile, aot), and the fast launch then leaves every launch to it."""
    return getattr(cls, "run", None)


def launch_parameters(kernel):
    """``(name, is_constexpr, has_default, default)`` of each parameter of a ``JITFunction``, in signature order
    (``JITFunction.params``), or None when its launch is not the plain one (it has pre-run hooks)."""
    if kernel.pre_run_hooks:
        return None
    return tuple((p.name, p.is_constexpr, p.has_default, p.default) for p in kernel.params)


def launch_hook_set() -> bool:
    """Whether a launch-enter hook is set (a profiler's); Triton 3.6 keeps an empty ``HookChain`` when none is.
    (``knobs`` is imported once, at the module's import: an import statement per launch costs host time.)"""
    hook = _knobs.runtime.launch_enter_hook
    return hook is not None and (type(hook).__name__ != "HookChain" or bool(getattr(hook, "calls", True)))


def launch_knobs() -> tuple:
    """The knobs ``JITFunction.run`` adds to every launch's options (debug, instrumentation mode)."""
    return _knobs.runtime.debug, _knobs.compilation.instrumentation_mode


def launch_classes() -> list[type]:
    """The classes whose ``run`` a ``kernel[grid](...)`` call goes through (compiled and interpreted)."""
    classes = []
    with contextlib.suppress(ImportError):
        from triton.runtime.jit import JITFunction
        classes.append(JITFunction)
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    return classes


def is_interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


@contextlib.contextmanager
def record_launches(on_launch: Callable[[object, tuple, dict], None]) -> Iterator[None]:
    """Within the block ``kernel[grid](*args, **kwargs)`` calls ``on_launch(kernel, args, kwargs)``
    instead of compiling and running; an autotuned kernel reports every config (all may run)."""
    JITFunction, Autotuner = jit_classes()

    def record(self, *args, grid=None, warmup=False, **kwargs):
        on_launch(self, args, dict(kwargs))

    def record_all_configs(self, *args, **kwargs):
        kwargs.pop("warmup", None)
        for config in self.configs:
            self.fn.run(*args, **kwargs, **config.all_kwargs())

    saved = (JITFunction.run, Autotuner.run)
    JITFunction.run, Autotuner.run = record, record_all_configs
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run = saved


def gpu_target(arch: int):
    """Triton's target for an NVIDIA GPU of compute capability ``arch`` (75, 80, 90...)."""
    require("compiler")
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", arch, 32)


def bind(kernel, args: tuple, kwargs: dict, target):
    """What ``JITFunction.run`` would compile for ``kernel[grid](*args, **kwargs)`` on ``target``:
    ``(src, options)``, ``src`` having ``.signature``, ``.constants`` and ``.attrs``."""
    require("create_function_from_signature", "JITFunction._pack_args", "knobs", "compiler")
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return ASTSource(kernel, signature, constexprs, attrs), options


def compile_for(src, target, options):
    """``triton.compile`` for a target that need not be present: PTX and cubin in ``.asm``."""
    import triton
    return triton.compile(src, target=target, options=options.__dict__)


from .interpreter import interpreter_load_hook, interpreter_programs_from, patch_interpreter_index  # noqa: E402, F401, I001
