"""(Over 300 lines: recording, compiling and the command line share the fresh-process boot below; the
``_cases_*`` of other owners' modules, about 80 lines, leave as those modules define compile_cases.)

The compile matrix: every kernel of the course, configured as its launcher would configure it on a
T4 (sm_75), an A100 (sm_80) or an H100 (sm_90), compiled ahead of time to PTX and cubin on a
machine with no GPU.

    python -m course_utils.aot                 # all three targets, a table; exit 1 on any failure
    python -m course_utils.aot --arch 75 --json matrix.json

How, in a fresh process that imports Triton with ``TRITON_INTERPRET`` unset, so that ``@triton.jit``
(Triton's own ``tl.max``, ``tl.cdiv`` included) makes real ``JITFunction`` objects (:func:`main`
starts it; ``import course_utils`` switches the interpreter on when there is no GPU, so it is
switched off again before any kernel module is imported):

1. *Pretend*: ``hardware.device_info()`` returns ``DeviceInfo.for_arch(arch)`` and ``env.on_gpu()``
   returns True, so launchers choose tiles, warps, stages and dtypes as they would on that GPU.
   Tensors stay small CPU tensors (``torch.empty``: nothing is computed or touched).
2. *Record*: ``JITFunction.run`` (what ``kernel[grid](...)`` calls) is replaced by a recorder, so a
   launcher call records its launches instead of running them. An autotuned kernel records every
   config (all of them may be launched while tuning).
3. *Compile*: Triton's own binder turns each recorded launch into the signature, constexprs and
   specialization attributes it would use on the device, and ``triton.compile(...,
   target=GPUTarget("cuda", arch, 32))`` builds PTX and a cubin with the ``ptxas`` shipped in the
   Triton wheel. The shared memory the kernel needs is checked against the device's limit (a GPU
   would refuse the launch); a kernel that no case reaches is reported as uncovered.

Which launcher calls to make comes from the modules themselves: every module of
``course_utils.kernels`` and ``course_utils.tuned`` may define ``compile_cases(info)``, yielding
``(label, zero-argument callable)`` pairs; each callable calls a launcher on small CPU tensors
(:func:`empty`) in the dtypes :func:`dtypes_for` gives for ``info``. A module whose shelf (its
``kernels/<op>.py`` or ``tuned/<op>.py`` sibling) defines none falls back on :data:`DEFAULT_CASES`
below (kept here only until those modules' owners move them). Example (a module's own cases)::

    def compile_cases(info):                       # in course_utils/kernels/<op>.py or tuned/<op>.py
        from ..aot import dtypes_for, dtype_name, empty
        for dt in dtypes_for(info):                # no bfloat16 before sm_80
            yield f"gelu {dtype_name(dt)}", lambda dt=dt: gelu(empty(4096, 4096, dtype=dt))

Triton's internals used here all live in :mod:`course_utils.triton_internals`.
"""

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
from dataclasses import asdict, dataclass, field

import torch

from . import env, hardware
from . import triton_internals as internals

ARCHS = (75, 80, 90)
KERNEL_PACKAGE = "course_utils.kernels"
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


def _cases_launch(m, info) -> Iterator[Case]:
    yield "empty", lambda: m.empty(_e(16))
    yield "empty10", lambda: m.empty10(*[_e(16) for _ in range(10)])
    for dt in dtypes_for(info):
        yield f"add_one {_name(dt)}", lambda dt=dt: m.add_one(_e(1000, dtype=dt))


def _cases_elementwise(m, info) -> Iterator[Case]:
    sizes = [(1000,), (4096, 4096)]  # a tile for a small tensor, the full tile for a large one
    for dt in dtypes_for(info):
        for shape in sizes:
            tag = f"{_name(dt)} {'x'.join(map(str, shape))}"
            bias = shape[-1]
            yield f"add {tag}", lambda s=shape, dt=dt: m.add(_e(*s, dtype=dt), _e(*s, dtype=dt))
            for approx in ("tanh", "none"):
                yield f"gelu {approx} {tag}", lambda s=shape, dt=dt, a=approx: m.gelu(_e(*s, dtype=dt), a)
                yield (f"bias_gelu_scale {approx} {tag}",
                       lambda s=shape, b=bias, dt=dt, a=approx:
                       m.bias_gelu_scale(_e(*s, dtype=dt), _e(b, dtype=dt), 0.5, a))
                yield (f"bias_gelu_dropout {approx} {tag}",
                       lambda s=shape, b=bias, dt=dt, a=approx:
                       m.bias_gelu_dropout(_e(*s, dtype=dt), _e(b, dtype=dt), 0.1, 1234, a))
    yield "dropout_keep_mask", lambda: m.dropout_keep_mask((4096, 4096), 0.1, 1234)
    # rows shorter than a tile: the bias columns wrap several times per tile (WRAPS=ANY_WRAP)
    narrow = (4096, 100)
    yield "bias_gelu_scale narrow rows", lambda: m.bias_gelu_scale(_e(*narrow), _e(100), 0.5)
    yield "bias_gelu_dropout narrow rows", lambda: m.bias_gelu_dropout(_e(*narrow), _e(100), 0.1, 7)
    # Offsets in int64 from 2^31 elements on (2-byte elements: 4 GiB of address space per tensor,
    # never touched, so no memory is used).
    big = (2**21, 1024)
    dt = torch.float16
    yield "add int64", lambda: m.add(_e(*big, dtype=dt), _e(*big, dtype=dt))
    yield "gelu int64", lambda: m.gelu(_e(*big, dtype=dt))
    yield "bias_gelu_scale int64", lambda: m.bias_gelu_scale(_e(*big, dtype=dt), _e(1024, dtype=dt), 0.5)
    yield "bias_gelu_dropout int64", lambda: m.bias_gelu_dropout(_e(*big, dtype=dt), _e(1024, dtype=dt), 0.1, 7)
    yield "dropout_keep_mask int64", lambda: m.dropout_keep_mask(big, 0.1, 7)


def _cases_attention(m, info) -> Iterator[Case]:
    """Every tile configuration the tuned launcher may try, at the largest head_dim (the most shared
    memory); causal, the smaller head_dim and the log-sum-exp output with the preferred one."""
    dts = [dt for dt in m.DTYPES if dt in dtypes_for(info)]
    d_max, d_min = max(m.HEAD_DIMS), min(d for d in m.HEAD_DIMS if d >= 64)

    def qkv(d, dt):
        return [_e(1, 2, 256, d, dtype=dt) for _ in range(3)]

    for dt in dts:
        n = _name(dt)
        for cfg in m.attention_configs(info, d_max, dt, False):
            yield (f"flash_attention {n} d={d_max} {cfg}",
                   lambda dt=dt, cfg=cfg: m.flash_attention(*qkv(d_max, dt), False, config=cfg))
        for d in (d_max, d_min):
            for causal in ((True,) if d == d_max else (False, True)):
                cfg = m.attention_configs(info, d, dt, causal)[0]
                yield (f"flash_attention {n} d={d} causal={causal} {cfg}",
                       lambda d=d, dt=dt, c=causal, cfg=cfg: m.flash_attention(*qkv(d, dt), c, config=cfg))
            yield (f"flash_attention_teaching {n} d={d}",
                   lambda d=d, dt=dt: m.flash_attention_teaching(*qkv(d, dt), False))
        yield (f"flash_attention_teaching causal {n} d={d_max}",
               lambda dt=dt: m.flash_attention_teaching(*qkv(d_max, dt), True))
        cfg = m.attention_configs(info, d_min, dt, True)[0]
        yield (f"flash_attention lse {n} d={d_min}",
               lambda dt=dt, cfg=cfg: m.flash_attention(*qkv(d_min, dt), True, return_lse=True, config=cfg))
        yield (f"flash_attention_teaching lse {n} d={d_min}",
               lambda dt=dt: m.flash_attention_teaching(*qkv(d_min, dt), True, return_lse=True))


# The cases of modules owned by other helpers, until each module defines its own compile_cases(info).
DEFAULT_CASES: dict[str, Callable] = {
    f"{KERNEL_PACKAGE}.launch": _cases_launch,
    f"{KERNEL_PACKAGE}.elementwise": _cases_elementwise,
    f"{KERNEL_PACKAGE}.attention": _cases_attention,
}


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


IMPORT_ERRORS: dict[str, str] = {}  # module -> why kernel_modules() could not import it


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


# --------------------------------------------------------------------------------------------------
# Compiling one recorded launch for a target
# --------------------------------------------------------------------------------------------------

@dataclass
class Result:
    kernel: str
    arch: int
    case: str
    signature: str = ""
    constexprs: str = ""
    num_warps: int = 0
    num_stages: int = 0
    shared_bytes: int = 0
    smem_limit: int = 0
    ptx_bytes: int = 0
    cubin_bytes: int = 0
    cp_async: int = 0       # async copies in the PTX (see async_copies): > 0 where a loop is pipelined
    cp_async_bulk: int = 0
    seconds: float = 0.0
    ok: bool = False
    error: str = ""
    cases: list = field(default_factory=list)


def _key_name(fn) -> str:
    return f"{fn.fn.__module__}.{fn.fn.__name__}"


def _bind(launch: Launch, target):
    """What JITFunction.run would compile for this launch on ``target``: (src, options)."""
    return internals.bind(launch.kernel, launch.args, launch.kwargs, target)


# Async copies in the PTX: what Triton's software pipeliner (num_stages > 1) emits for the loads of a
# pipelined loop on sm_80+ (cp.async) and with TMA on sm_90 (cp.async.bulk); a loop it does not
# pipeline has none.
_CP_ASYNC = re.compile(r"^\s*(?:@%p\d+\s+)?cp\.async\.(?!bulk)(?:ca|cg)\b", re.M)
_CP_ASYNC_BULK = re.compile(r"^\s*(?:@%p\d+\s+)?cp\.async\.bulk\.(?!commit|wait)", re.M)


def async_copies(ptx: str) -> dict:
    """Counts of ``cp.async`` (per-thread async copy) and ``cp.async.bulk`` (TMA) instructions."""
    return {"cp_async": len(_CP_ASYNC.findall(ptx)), "cp_async_bulk": len(_CP_ASYNC_BULK.findall(ptx))}


def _short(v) -> str:
    return getattr(v, "__name__", None) or str(v)


def describe(e: BaseException, limit: int = 800) -> str:
    """A compile error in a few lines: where (Triton's ``at L:C``), what, and what caused it."""
    text = str(e).strip()
    where = text.splitlines()[0] if text.startswith("at ") else ""
    what = getattr(e, "error_message", None) or (text.splitlines()[-1] if text else "")
    if what.strip() in ("", "^"):
        what = ""
    cause = e.__cause__ or e.__context__
    parts = [f"{type(e).__name__} {where}".strip() + ":", what]
    if cause is not None:
        said = str(cause).strip().splitlines()[-1] if str(cause).strip() else ""
        parts.append(f"(caused by {type(cause).__name__}: {said})")
    return " ".join(p for p in parts if p)[:limit]


def compile_launches(launches: list[Launch], info: hardware.DeviceInfo, quick: bool = False) -> list[Result]:
    """Compile each distinct launch for ``info.arch``; one Result per distinct compilation.

    ``quick``: launches that differ only in their arguments' dtypes and specializations (int64
    offsets, divisibility) count as one, so every kernel is still built with every tile, warps and
    stages choice its launchers make, once (what the second Triton's check in ``make test`` runs).
    """
    target = internals.gpu_target(info.arch)
    results: dict[str, Result] = {}
    for launch in launches:
        name = _key_name(launch.kernel)
        try:
            src, options = _bind(launch, target)
        except Exception as e:  # noqa: BLE001 - reported per launch
            key = f"{name}|bind|{launch.case}"
            results[key] = Result(name, info.arch, launch.case, error=f"binding the arguments: {e!r}")
            continue
        sig = ", ".join(f"{k}: {v}" for k, v in src.signature.items() if v != "constexpr")
        cex = ", ".join(f"{launch.kernel.arg_names[p[0]]}={_short(v)}" for p, v in sorted(src.constants.items()))
        key = f"{name}|{sig}|{cex}|{sorted(src.attrs.items())}|{options.num_warps}|{options.num_stages}"
        if quick:
            key = f"{name}|{cex}|{options.num_warps}|{options.num_stages}"
        if key in results:
            results[key].cases.append(launch.case)
            continue
        r = Result(name, info.arch, launch.case, sig, cex, options.num_warps, options.num_stages,
                   smem_limit=info.smem_per_block_bytes, cases=[launch.case])
        t0 = time.perf_counter()
        try:
            k = internals.compile_for(src, target, options)
            r.shared_bytes = int(k.metadata.shared)
            r.ptx_bytes = len(k.asm.get("ptx", ""))
            counts = async_copies(k.asm.get("ptx", ""))
            r.cp_async, r.cp_async_bulk = counts["cp_async"], counts["cp_async_bulk"]
            r.cubin_bytes = len(k.asm.get("cubin", b""))
            if not r.cubin_bytes:
                r.error = "no cubin was produced"
            elif r.shared_bytes > info.smem_per_block_bytes:
                r.error = (f"needs {r.shared_bytes} bytes of shared memory, sm_{info.arch} "
                           f"({info.name}) allows {info.smem_per_block_bytes} per program")
            else:
                r.ok = True
        except Exception as e:  # noqa: BLE001 - reported per kernel
            r.error = describe(e)
        r.seconds = round(time.perf_counter() - t0, 3)
        results[key] = r
    return list(results.values())


def ptx_of(call: Callable[[], object], arch: int) -> list[dict]:
    """Compile every launch ``call()`` makes when pretending to be sm_``arch``: one dict per launch
    with ``kernel``, ``ptx``, ``shared_bytes``, ``num_stages`` (TRITON_INTERPRET must be unset)."""
    info = hardware.DeviceInfo.for_arch(arch)
    with pretend(info, kernel_modules()) as launches:
        call()
    target = internals.gpu_target(arch)
    out = []
    for launch in launches:
        src, options = _bind(launch, target)
        k = internals.compile_for(src, target, options)
        out.append({"kernel": _key_name(launch.kernel), "ptx": k.asm["ptx"], "shared_bytes": int(k.metadata.shared),
                    "num_stages": options.num_stages})
    return out


def run_matrix(archs: Iterable[int] = ARCHS, module_filter: str | None = None,
               progress: Callable[[str], None] | None = None, quick: bool = False) -> dict:
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
        results = compile_launches(launches, info, quick=quick)
        out["results"] += [asdict(r) for r in results]
        reached = {r.kernel for r in results}
        out["uncovered"][str(arch)] = sorted(set(kernels) - reached)
        if progress:
            bad = sum(not r.ok for r in results)
            progress(f"sm_{arch}: {len(results)} compilations, {bad} failed, "
                     f"{len(out['uncovered'][str(arch)])} kernels not reached")
    return out


def failures(matrix: dict) -> list[str]:
    """Every problem in a matrix, one line each (empty when the matrix is green)."""
    lines = [f"sm_{r['arch']} {r['kernel']} [{r['case']}]: {r['error']}" for r in matrix["results"] if not r["ok"]]
    lines += [f"sm_{c['arch']} {c['case']}: the launcher raised {c['error']}" for c in matrix["case_errors"]]
    for arch, names in matrix["uncovered"].items():
        lines += [f"sm_{arch} {n}: no case launches this kernel (add it to compile_cases(info) in its module)"
                  for n in names]
    return lines


def table(matrix: dict) -> str:
    rows = sorted(matrix["results"], key=lambda r: (r["kernel"], r["arch"], r["constexprs"]))
    lines = [f"{'kernel':<42} {'sm':>3} {'warps':>5} {'stages':>6} {'smem KiB':>8} {'async':>5} {'ok':>3}  constexprs"]
    for r in rows:
        lines.append(f"{r['kernel'].removeprefix(KERNEL_PACKAGE + '.'):<42} {r['arch']:>3} {r['num_warps']:>5} "
                     f"{r['num_stages']:>6} {r['shared_bytes'] / 1024:>8.1f} {r['cp_async'] + r['cp_async_bulk']:>5} "
                     f"{'yes' if r['ok'] else 'NO':>3}  "
                     f"{r['constexprs'][:70]}")
    return "\n".join(lines)


# Triton's own library (tl.max, tl.cdiv, ...) is decorated when triton.language is first imported, and
# `import course_utils` imports Triton's interpreter after switching it on. So the matrix runs in a
# fresh process that imports Triton first, with the interpreter off, then course_utils; no GPU is
# used even where there is one (the tensors the cases pass are CPU tensors, nothing runs).
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
    ap.add_argument("--quick", action="store_true",
                    help="one compilation per kernel and tile/warps/stages choice (dtypes folded together)")
    args = ap.parse_args(argv)
    if not _booted:
        return _run_per_arch(args, argv)
    os.environ.pop("TRITON_INTERPRET", None)  # import course_utils set it (no GPU): kernels must be real
    t0 = time.perf_counter()
    matrix = run_matrix(args.arch, args.module, progress=lambda s: print(s, file=sys.stderr, flush=True),
                        quick=args.quick)
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
