"""(Over 300 lines: recording the launches and the command line share the fresh-process boot below.)
The compile matrix: every kernel of the course, configured as its launcher would configure it on a
T4 (sm_75), an A100 (sm_80) or an H100 (sm_90), compiled ahead of time to PTX and cubin on a
machine with no GPU.

    python -m course_utils.aot [--arch 75 80 90] [--module gemm] [--quick | --smoke] [--json matrix.json]

How (:func:`main` starts a fresh process that imports Triton with ``TRITON_INTERPRET`` unset, so
that ``@triton.jit`` makes real ``JITFunction`` objects):

1. *Pretend*: ``hardware.device_info()`` is ``DeviceInfo.for_arch(arch)`` and ``env.on_gpu()`` True:
   launchers choose tiles, warps, stages and dtypes as on that GPU (on small CPU tensors).
2. *Record*: ``kernel[grid](...)`` records its launches (all configs of an autotuned kernel).
3. *Compile* (:mod:`course_utils.aot_compile`): Triton's binder and ``triton.compile`` for
   ``GPUTarget("cuda", arch, 32)`` build PTX and a cubin with the wheel's ``ptxas``; the shared
   memory is checked against the device's limit; a kernel no case reaches is reported.

Which launcher calls to make comes from the modules themselves: every module of
``course_utils.kernels`` and ``course_utils.tuned`` may define ``compile_cases(info)``, yielding
``(label, zero-argument callable)`` pairs; each callable calls a launcher on small CPU tensors
(:func:`empty`) in the dtypes :func:`dtypes_for` gives for ``info`` (a shelf without any falls back
on :data:`DEFAULT_CASES`, empty today). Example::

    def compile_cases(info):                       # in course_utils/kernels/<op>.py or tuned/<op>.py
        from ..aot import dtypes_for, dtype_name, empty
        for dt in dtypes_for(info):                # no bfloat16 before sm_80
            yield f"gelu {dtype_name(dt)}", lambda dt=dt: gelu(empty(4096, 4096, dtype=dt))

Triton's internals used here all live in :mod:`course_utils.triton_internals`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import pkgutil
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass

import torch

from . import env, hardware, state
from . import triton_internals as internals
from .aot_compile import (  # noqa: F401  (re-exported: python -m course_utils.aot and the tests use them)
    KERNEL_PACKAGE,
    Result,
    async_copies,
    bind_launch,
    compile_launches,
    describe,
    failures,
    kernel_name,
    ptx_of,
    table,
)

ARCHS = (75, 80, 90)
PACKAGES = (KERNEL_PACKAGE, "course_utils.tuned")  # the two shelves: what a student reads, what make bench times


# --------------------------------------------------------------------------------------------------
# What a launcher would do on a given GPU
# --------------------------------------------------------------------------------------------------

def dtypes_for(info: hardware.DeviceInfo) -> tuple[torch.dtype, ...]:
    """Floating dtypes a course kernel must handle on ``info``: no bfloat16 before sm_80."""
    base = (torch.float32, torch.float16)
    return (*base, torch.bfloat16) if info.has_bf16 else base


@dataclass
class Launch:
    """One ``kernel[grid](*args, **kwargs)`` call that a launcher made (and that did not run)."""

    kernel: object          # a triton JITFunction
    args: tuple
    kwargs: dict
    case: str = ""


def _jit_classes():
    return internals.jit_classes()


@contextlib.contextmanager
def pretend(info: hardware.DeviceInfo, modules: Iterable = ()) -> Iterator[list[Launch]]:
    """Within the block, launchers see ``info`` as the GPU in hand and their launches are recorded.

    Yields the list the launches are appended to. ``modules``: kernel modules whose own names for
    ``device_info``/``on_gpu``/``supported_dtypes`` (``from ..hardware import device_info``) must be
    redirected too.
    """
    launches: list[Launch] = []
    fakes = {
        "device_info": (hardware.device_info, lambda: info),
        "on_gpu": (env.on_gpu, lambda: True),
        "supported_dtypes": (env.supported_dtypes, lambda: dtypes_for(info)),
    }
    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        patch(hardware, "device_info", fakes["device_info"][1])
        patch(env, "on_gpu", fakes["on_gpu"][1])
        patch(env, "supported_dtypes", fakes["supported_dtypes"][1])
        for module in modules:
            for original, fake in fakes.values():
                for attr, value in list(vars(module).items()):
                    if value is original:
                        patch(module, attr, fake)
        with internals.record_launches(lambda kernel, args, kwargs: launches.append(Launch(kernel, args, kwargs))):
            yield launches
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


# --------------------------------------------------------------------------------------------------
# Which launcher calls to make: each module's compile_cases(info); DEFAULT_CASES for the others
# --------------------------------------------------------------------------------------------------

Case = tuple[str, Callable[[], object]]


def empty(*shape, dtype=torch.float32) -> torch.Tensor:
    """A CPU tensor for a case: launchers read its shape, dtype and strides; nothing touches it."""
    return torch.empty(*shape, dtype=dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_e, _name = empty, dtype_name


# A module whose shelf defines no compile_cases could be given default cases here (every shelf has its own now).
DEFAULT_CASES: dict[str, Callable] = {}


def kernel_modules() -> list:
    """Every module of ``course_utils.kernels`` and ``course_utils.tuned`` (imported: call this with
    TRITON_INTERPRET unset). A package that does not exist yet is skipped."""
    modules = []
    for package_name in PACKAGES:
        try:
            package = importlib.import_module(package_name)
        except ModuleNotFoundError:
            continue
        names = sorted(i.name for i in pkgutil.iter_modules(package.__path__) if not i.name.startswith("_"))
        for n in names:
            try:
                modules.append(importlib.import_module(f"{package_name}.{n}"))
            except Exception as e:  # noqa: BLE001 - one broken module must not hide the others' results
                IMPORT_ERRORS[f"{package_name}.{n}"] = "".join(traceback.format_exception_only(e)).strip()
    return modules


IMPORT_ERRORS: dict[str, str] = state.RuntimeCache()  # module -> why kernel_modules() could not import it


def _shelf_siblings(module) -> list[str]:
    """``course_utils.kernels.softmax`` -> both shelves' names for the op (kernels/ and tuned/)."""
    short = module.__name__.rsplit(".", 1)[-1]
    return [f"{p}.{short}" for p in PACKAGES]


def cases_for(module, info: hardware.DeviceInfo) -> list[Case]:
    """The module's own ``compile_cases(info)``; else, when neither shelf of its op defines one,
    the cases :data:`DEFAULT_CASES` keeps for it."""
    if callable(getattr(module, "compile_cases", None)):
        return list(module.compile_cases(info))
    siblings = [sys.modules.get(n) for n in _shelf_siblings(module)]
    if any(callable(getattr(m, "compile_cases", None)) for m in siblings if m is not None):
        return []
    if module.__name__ in DEFAULT_CASES:
        return list(DEFAULT_CASES[module.__name__](module, info))
    return []


def jit_functions(modules) -> dict[str, object]:
    """``module.name`` -> every ``@triton.jit`` function defined in those modules."""
    JITFunction, _ = _jit_classes()
    found = {}
    for module in modules:
        for obj in vars(module).values():
            fn = getattr(obj, "fn", None) if not isinstance(obj, JITFunction) else obj
            while fn is not None and not isinstance(fn, JITFunction):  # autotune/heuristics wrappers
                fn = getattr(fn, "fn", None)
            if fn is not None and getattr(fn.fn, "__module__", None) == module.__name__:
                found[f"{module.__name__}.{fn.fn.__name__}"] = fn
    return found


def launched_kernels(modules) -> dict[str, object]:
    """The JIT functions that are kernels (launched by a host), not ``@triton.jit`` helpers.

    A helper is called from another JIT function's body; a kernel is called by none.
    """
    fns = jit_functions(modules)
    sources = {k: inspect.getsource(f.fn) for k, f in fns.items()}
    kernels = {}
    for key, fn in fns.items():
        name = fn.fn.__name__
        called = re.compile(rf"\b{re.escape(name)}\s*\(")
        if not any(called.search(src) for k, src in sources.items() if k != key):
            kernels[key] = fn
    return kernels




def run_matrix(archs: Iterable[int] = ARCHS, module_filter: str | None = None,
               progress: Callable[[str], None] | None = None, quick: bool = False, smoke: bool = False) -> dict:
    """Trace and compile every case for each arch. Needs real JITFunctions (TRITON_INTERPRET unset)."""
    JITFunction, _ = _jit_classes()
    modules = [m for m in kernel_modules() if not module_filter or module_filter in m.__name__]
    kernels = launched_kernels(modules)
    from triton.language import standard
    interpreted = [k for k, f in jit_functions(modules).items() if internals.is_interpreted(f)]
    if interpreted or not isinstance(standard.cdiv, JITFunction) or \
            any(not isinstance(f, JITFunction) for f in kernels.values()):
        raise RuntimeError("Triton or the kernels were imported under TRITON_INTERPRET=1: run the compile "
                           "matrix through course_utils.aot.main() (python -m course_utils.aot)")
    out = {"archs": list(archs), "kernels": sorted(kernels), "results": [],
           "case_errors": [{"arch": a, "case": f"{name}: importing the module", "error": error}
                           for name, error in IMPORT_ERRORS.items() if not module_filter or module_filter in name
                           for a in archs],
           "uncovered": {}, "versions": env.versions()}
    for arch in archs:
        info = hardware.DeviceInfo.for_arch(arch)
        launches: list[Launch] = []
        for module in modules:
            with pretend(info, modules) as recorded:
                try:
                    cases = cases_for(module, info)
                except Exception as e:  # noqa: BLE001
                    out["case_errors"].append({"arch": arch, "case": f"{module.__name__}: listing cases",
                                               "error": repr(e)})
                    cases = []
                for label, call in cases:
                    start = len(recorded)
                    try:
                        call()
                    except Exception as e:  # noqa: BLE001 - a launcher refusing a case is a finding
                        out["case_errors"].append({"arch": arch, "case": f"{module.__name__}: {label}",
                                                   "error": "".join(traceback.format_exception_only(e)).strip()})
                    for launch in recorded[start:]:
                        launch.case = f"{module.__name__.rsplit('.', 1)[-1]}: {label}"
            launches += recorded
        if progress:
            progress(f"sm_{arch}: {len(launches)} launches recorded, compiling")
        results = compile_launches(launches, info, quick=quick, smoke=smoke)
        out["results"] += [asdict(r) for r in results]
        reached = {r.kernel for r in results}
        out["uncovered"][str(arch)] = sorted(set(kernels) - reached)
        if progress:
            bad = sum(not r.ok for r in results)
            progress(f"sm_{arch}: {len(results)} compilations, {bad} failed, "
                     f"{len(out['uncovered'][str(arch)])} kernels not reached")
    return out


_BOOT = ("import triton, triton.language, sys\n"
         "from course_utils import aot\n"
         "sys.exit(aot.main(sys.argv[1:], _booted=True))")


def subprocess_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "COURSE_MODE")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run_per_arch(args, argv: list[str]) -> int:
    """One fresh process per target: a launcher that caches its DeviceInfo sees only that target."""
    import subprocess
    import tempfile
    rest, skip = [], False
    for a in argv:  # the arguments other than --arch/--json, passed on to every child
        if skip and not a.startswith("--"):
            continue
        skip = a in ("--arch", "--json")
        if not skip and not a.startswith(("--arch=", "--json=")):
            rest.append(a)
    codes, parts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            part = os.path.join(tmp, f"sm_{arch}.json")
            codes.append(subprocess.call([sys.executable, "-c", _BOOT, "--arch", str(arch), "--json", part, *rest],
                                         env=subprocess_env()))
            if os.path.exists(part):
                with open(part) as f:
                    parts.append(json.load(f))
    if args.json and parts:
        merged = {"archs": [a for p in parts for a in p["archs"]], "kernels": parts[0]["kernels"],
                  "results": [r for p in parts for r in p["results"]],
                  "case_errors": [c for p in parts for c in p["case_errors"]],
                  "uncovered": {k: v for p in parts for k, v in p["uncovered"].items()},
                  "versions": parts[0]["versions"], "seconds": sum(p.get("seconds", 0) for p in parts)}
        with open(args.json, "w") as f:
            json.dump(merged, f, indent=1, default=str)
    return max(codes) if len(parts) == len(args.arch) else max(max(codes), 2)


def main(argv: list[str] | None = None, _booted: bool = False) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="python -m course_utils.aot",
                                 description="Compile every course kernel for sm_75/80/90 without a GPU.")
    ap.add_argument("--arch", type=int, nargs="*", default=list(ARCHS), help="targets (default 75 80 90)")
    ap.add_argument("--module", help="only kernel modules whose name contains this")
    ap.add_argument("--json", help="write the whole matrix here")
    ap.add_argument("--quiet", action="store_true", help="no table, only problems")
    ap.add_argument("--quick", action="store_true", help="one compilation per kernel and tile/warps/stages choice")
    ap.add_argument("--smoke", action="store_true", help="per kernel, its smallest and largest tile choice only")
    args = ap.parse_args(argv)
    if not _booted:
        return _run_per_arch(args, argv)
    os.environ.pop("TRITON_INTERPRET", None)  # import course_utils set it (no GPU): kernels must be real
    t0 = time.perf_counter()
    matrix = run_matrix(args.arch, args.module, progress=lambda s: print(s, file=sys.stderr, flush=True),
                        quick=args.quick, smoke=args.smoke)
    matrix["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(matrix, f, indent=1, default=str)
    if not args.quiet:
        print(table(matrix))
    problems = failures(matrix)
    for line in problems:
        print("FAIL", line)
    print(f"compile matrix: {len(matrix['results'])} compilations for "
          f"{', '.join(f'sm_{a}' for a in args.arch)} in {matrix['seconds']} s, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
