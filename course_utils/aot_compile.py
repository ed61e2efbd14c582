"""The compile matrix's second half: compiling one recorded launch for a target GPU, and what its PTX says.

Split from :mod:`course_utils.aot` (which records the launches and runs the command line); every name
here is importable from there too.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import hardware
from . import triton_internals as internals

KERNEL_PACKAGE = "course_utils.kernels"

if TYPE_CHECKING:
    from .aot import Launch


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


def kernel_name(fn) -> str:
    return f"{fn.fn.__module__}.{fn.fn.__name__}"


def bind_launch(launch: Launch, target):
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


def tile_volume(launch: Launch, src, options) -> int:
    """How much on-chip memory a launch's choice asks for, roughly: the product of its ``BLOCK*``
    constexprs times its stages (what decides whether it fits a T4's 64 KiB)."""
    volume = max(options.num_stages, 1)
    for (pos, *_), v in src.constants.items():
        if "BLOCK" in launch.kernel.arg_names[pos].upper() and isinstance(v, int) and not isinstance(v, bool):
            volume *= max(v, 1)
    return volume


def smoke_subset(launches: list[Launch], target) -> list[Launch]:
    """Per kernel, its smallest and its largest tile choice (``tile_volume``): every kernel compiles
    for the target, and the choice most likely to overflow shared memory is built (``--smoke``)."""
    by_kernel: dict[str, list[tuple[int, int, Launch]]] = {}
    for i, launch in enumerate(launches):
        try:
            src, options = bind_launch(launch, target)
            volume = tile_volume(launch, src, options)
        except Exception:  # noqa: BLE001 - kept: compile_launches reports the binding error
            volume = 0
        by_kernel.setdefault(kernel_name(launch.kernel), []).append((volume, i, launch))
    keep = set()
    for choices in by_kernel.values():
        keep.add(min(choices, key=lambda c: (c[0], c[1]))[1])
        keep.add(max(choices, key=lambda c: (c[0], -c[1]))[1])
    return [launch for i, launch in enumerate(launches) if i in keep]


def compile_launches(launches: list[Launch], info: hardware.DeviceInfo, quick: bool = False,
                     smoke: bool = False) -> list[Result]:
    """Compile each distinct launch for ``info.arch``; one Result per distinct compilation.

    ``quick``: launches that differ only in their arguments' dtypes and specializations (int64
    offsets, divisibility) count as one, so every kernel is still built with every tile, warps and
    stages choice its launchers make, once. ``smoke``: per kernel, only its smallest and largest
    tile choice (``smoke_subset``; what ``make test`` compiles; ``make compile-matrix`` builds all).
    """
    target = internals.gpu_target(info.arch)
    if smoke:
        launches, quick = smoke_subset(launches, target), True
    results: dict[str, Result] = {}
    for launch in launches:
        name = kernel_name(launch.kernel)
        try:
            src, options = bind_launch(launch, target)
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


def ptx_of(call: Callable[[], object], arch: int) -> list[dict]:
    """Compile every launch ``call()`` makes when pretending to be sm_``arch``: one dict per launch
    with ``kernel``, ``ptx``, ``shared_bytes``, ``num_stages`` (TRITON_INTERPRET must be unset)."""
    from .aot import kernel_modules, pretend  # the recording half (it imports this module)
    info = hardware.DeviceInfo.for_arch(arch)
    with pretend(info, kernel_modules()) as launches:
        call()
    target = internals.gpu_target(arch)
    out = []
    for launch in launches:
        src, options = bind_launch(launch, target)
        k = internals.compile_for(src, target, options)
        out.append({"kernel": kernel_name(launch.kernel), "ptx": k.asm["ptx"], "shared_bytes": int(k.metadata.shared),
                    "num_stages": options.num_stages})
    return out
