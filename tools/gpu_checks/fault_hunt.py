"""Which version of chapter 12's step faults on the GPU: each version built and timed in a process of its own.

A CUDA fault (an illegal memory access) ends its process's context, and it is reported asynchronously, at a
later call: in one process that runs several versions, as ``make bench`` does, the version named in the
traceback need not be the one that faulted. Here each version of ``benchmarks.training.IMPLS`` (the course's
by default) runs alone through ``tools/gpu_checks/compile_course.py``, with a fresh Inductor cache, and the
table at the end says per version whether it built and was timed, failed its build, faulted, or ran out of
time. ``--blocking`` sets ``CUDA_LAUNCH_BLOCKING=1`` (a fault is then reported at the launch that made it, and
a fault that only happens without it is a race, not an index); ``--together`` also runs every version of the
benchmark (the torch ones too) in one process, in its order, as the benchmark does (a fault that needs an
earlier version's state shows only there); ``--attention-visible`` makes attention's ops triton_ops
(``COURSE_ATTENTION_VISIBLE=1``).

    python tools/gpu_checks/fault_hunt.py --config gpt2-b16 [--blocking] [--together] [--attention-visible]
        [--impls "course, step by hand + torch.compile;course + CUDA graph"] [--budget 540]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import training as T  # noqa: E402

PER_RUN_S = 150          # one version's build (Inductor's compile included) and its timing rounds
FAULT_WORDS = ("illegal memory access", "misaligned address", "unspecified launch failure", "CUDA error")


def course_versions() -> list[str]:
    return [name for name, (ops, _) in T.IMPLS.items() if ops.startswith("course")]


def runs(args) -> list[tuple[str, list[str], dict]]:
    """(label, command, environment) of each run: one per version, then all of them together if asked."""
    impls = [s for s in args.impls.split(";") if s] if args.impls else course_versions()
    unknown = [n for n in impls if n not in T.IMPLS]
    if unknown:
        raise SystemExit(f"unknown versions {unknown}; the versions are {list(T.IMPLS)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    if args.attention_visible:
        env["COURSE_ATTENTION_VISIBLE"] = "1"
    tool = [sys.executable, str(ROOT / "tools" / "gpu_checks" / "compile_course.py"), "--config", args.config]
    # together: every version of the benchmark in its order (a fault may need a torch version's state too)
    groups = [(name, [name]) for name in impls] + ([("(all, in order)", list(T.IMPLS))] if args.together else [])
    return [(label, tool + ["--impls", ";".join(names)], env) for label, names in groups]


def verdict(rc: int | None, out: str) -> tuple[str, str]:
    """(verdict, the line that says why) from a run's exit code and output."""
    lines = out.splitlines()
    fault = next((ln for ln in lines if any(w in ln for w in FAULT_WORDS)), "")
    failed = next((ln for ln in lines if ln.startswith("FAILED ")), "")
    if rc is None:
        return "timeout", (lines[-1] if lines else "")[:160]
    if fault:
        return ("fault in the build" if failed else "fault"), (failed or fault)[:160]
    if failed:
        return "build failed", failed[:160]
    return ("ok" if rc == 0 else f"exit {rc}"), (lines[-1] if lines else "")[:160]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="gpt2-b16", choices=list(T.CONFIGS))
    ap.add_argument("--impls", default="", help="versions separated by ; (default: every course version)")
    ap.add_argument("--blocking", action="store_true", help="CUDA_LAUNCH_BLOCKING=1")
    ap.add_argument("--together", action="store_true", help="also every version in one process, in order")
    ap.add_argument("--attention-visible", action="store_true", help="COURSE_ATTENTION_VISIBLE=1")
    ap.add_argument("--budget", type=float, default=540, help="seconds for all the runs")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    plan = runs(args)
    if args.dry_run:
        for label, cmd, _ in plan:
            print(f"{label}: {' '.join(repr(c) if ' ' in c else c for c in cmd)}")
        return 0
    start, table = time.perf_counter(), []
    for label, cmd, env in plan:
        left = args.budget - (time.perf_counter() - start)
        if left < 30:
            table.append((label, "not run", f"the budget of {args.budget:.0f} s is spent", 0.0))
            continue
        env = dict(env, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="fault_hunt_"))   # no cached graph
        t = time.perf_counter()
        try:
            limit = left if label == "(all, in order)" else min(PER_RUN_S, left)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit, cwd=ROOT)
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            got = e.stdout or ""
            rc, out = None, got.decode(errors="replace") if isinstance(got, bytes) else got
        what, why = verdict(rc, out)
        table.append((label, what, why, time.perf_counter() - t))
        print(f"--- {label}: {what} ({table[-1][3]:.0f} s)\n{out[-1500:]}", flush=True)
    print(f"\n{args.config}, CUDA_LAUNCH_BLOCKING={'1' if args.blocking else 'unset'}, attention "
          f"{'visible' if args.attention_visible else 'opaque'}:")
    for label, what, why, s in table:
        print(f"  {label:42s} {what:20s} {s:5.0f} s  {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
