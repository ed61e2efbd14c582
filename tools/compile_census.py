"""How many Triton compiles each test would cost on a GPU, counted under the interpreter (no GPU needed).

On a GPU host the suite's time goes mostly to compiling: every distinct specialization a test launches, the
kernel with its constexprs, its options (num_warps, num_stages, ...) and what Triton specializes its other
arguments on (a tensor's dtype and 16-byte alignment; an int's 1, divisibility by 16 and 32/64-bit range; a
float as fp32; a bool; None), is one compile of tens of seconds when 16 workers compile at once. Under
``TRITON_INTERPRET=1`` nothing compiles, but the launches are the same calls: this counts, per test, the distinct
specializations it launches (``specs``: what the test costs alone, cold) and those its worker process had not
launched before (``new``: the compiles it costs in that process), and its launches.

    python tools/compile_census.py [--out FILE] [--times LOG] [--top 40] -- <pytest arguments>
    python tools/compile_census.py --read FILE [--times LOG]

The first form runs ``pytest -p compile_census <pytest arguments>`` under the interpreter (xdist works: every
worker appends its lines) and prints the table; ``--times`` puts the seconds a GPU run measured beside each
test (a ``COURSE_TEST_TIMES`` file, or the per-test table of ``tools/test_times.py`` as in
``results/h200/test_gpu_s17.log``). What this cannot see: the checkers' GPU-only cases (larger shapes, bfloat16,
other dtype/tile paths), tests skipped without a GPU, torch.compile/Inductor's kernels, CUDA C++ builds, and
launches in child processes (the grading tests run notebooks in kernels of their own: they count 0 here).
Read its counts as a proxy for a test's compiles, not as the GPU's own.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ENV = "COURSE_COMPILE_CENSUS"
ROOT = Path(__file__).resolve().parent.parent
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
            "launch_pdl", "num_buffers_warp_spec", "num_consumer_groups", "reg_dec_producer", "reg_inc_consumer")


# ---- the key: what Triton compiles a launch for ------------------------------------------------------------
def _arg_spec(a, align: bool = True):
    """What Triton's launcher specializes a non-constexpr argument on (its signature type and attributes)."""
    import torch
    if isinstance(a, bool):
        return ("i1",)
    if isinstance(a, int):
        kind = "i32" if -2**31 <= a < 2**31 else "u64" if a >= 2**63 else "i64"
        return (kind, a == 1, a % 16 == 0)
    if isinstance(a, float):
        return ("fp32",)
    if a is None:
        return ("none",)
    if isinstance(a, torch.Tensor):
        return ("*", str(a.dtype), align and a.data_ptr() % 16 == 0)
    if isinstance(a, (tuple, list)):
        return ("tuple", tuple(_arg_spec(x, align) for x in a))
    base = getattr(a, "base", None)
    if base is not None and hasattr(a, "block_shape"):   # a host TensorDescriptor
        return ("desc", str(base.dtype), tuple(a.block_shape), str(getattr(a, "padding", "")))
    if hasattr(a, "dtype") and hasattr(a, "data_ptr"):   # a tensor-like (a tracer's, a wrapper)
        return ("*", str(a.dtype), True)
    return ("const", repr(a))   # dtypes, strings and the like are constants to Triton


def _source_hash(fn) -> str:
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        src = fn.__qualname__
    return hashlib.sha1(src.encode()).hexdigest()[:10]


def _is_constexpr(param) -> bool:
    ann = param.annotation
    return ann is not inspect.Parameter.empty and "constexpr" in (ann if isinstance(ann, str) else repr(ann))


_SIGS: dict = {}


def _signature(kernel):
    """(name, params, constexpr flags, do_not_specialize names, do_not_specialize_on_alignment names, hash)."""
    fn = getattr(kernel, "fn", kernel)
    got = _SIGS.get(id(fn))
    if got is None or got[0] is not fn:
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        kw = getattr(kernel, "kwargs", {}) or {}

        def names(which):
            given = getattr(kernel, which, None) or kw.get(which) or ()
            return {params[x].name if isinstance(x, int) else x for x in given}
        got = (fn, sig, {p.name: _is_constexpr(p) for p in params}, names("do_not_specialize"),
               names("do_not_specialize_on_alignment"), f"{fn.__module__}.{fn.__qualname__}@{_source_hash(fn)}")
        _SIGS[id(fn)] = got
    return got[1:]


def launch_key(kernel, args: tuple, kwargs: dict):
    """The compile key of ``kernel[grid](*args, **kwargs)``: (kernel name@source hash, constexprs, options,
    specialization of the other arguments)."""
    sig, constexpr, no_spec, no_align, name = _signature(kernel)
    options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k in _OPTIONS))
    rest = {k: v for k, v in kwargs.items() if k not in _OPTIONS and k not in ("grid", "warmup")}
    try:
        bound = sig.bind_partial(*args, **rest)
    except TypeError:
        return (name, "unbound", options, repr(args), repr(sorted(rest)))
    consts, spec = [], []
    for p in sig.parameters.values():
        if p.name in bound.arguments:
            v = bound.arguments[p.name]
        elif p.default is not inspect.Parameter.empty:
            v = p.default
        else:
            continue
        if constexpr.get(p.name):
            consts.append((p.name, repr(getattr(v, "value", v))))
        elif p.name in no_spec:
            spec.append((p.name, _arg_spec(v)[0]))
        else:
            spec.append((p.name, _arg_spec(v, align=p.name not in no_align)))
    return (name, tuple(consts), options, tuple(spec))


# ---- the pytest plugin (-p compile_census) ------------------------------------------------------------------
class _Census:
    def __init__(self, out: str):
        self.out = out
        self.seen: set = set()        # this process's keys so far
        self.current: set | None = None
        self.launches = 0

    def on_launch(self, kernel, args, kwargs):
        if self.current is None:
            return
        try:
            key = launch_key(kernel, args, kwargs)
        except Exception as e:   # never break a test: count it as its own key
            key = ("?", type(e).__name__, getattr(kernel, "__name__", "?"))
        self.current.add(key)
        self.launches += 1


_STATE: _Census | None = None


def pytest_configure(config):
    global _STATE
    out = os.environ.get(ENV)
    if not out:
        return
    _STATE = _Census(out)
    from course_utils.triton_internals import launch_classes
    for cls in launch_classes():
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            if not kwargs.get("warmup", False) and _STATE is not None:
                _STATE.on_launch(self, args, kwargs)
            return _original(self, *args, **kwargs)
        cls.run = run


def pytest_runtest_protocol(item, nextitem):
    if _STATE is None:
        return None
    _STATE.current, _STATE.launches = set(), 0
    return None


def pytest_runtest_logfinish(nodeid, location):
    st = _STATE
    if st is None or st.current is None:
        return
    new = len(st.current - st.seen)
    st.seen |= st.current
    kernels = defaultdict(int)
    for key in st.current:
        kernels[key[0].split("@")[0].rsplit(".", 1)[-1]] += 1
    detail = ",".join(f"{k}:{n}" for k, n in sorted(kernels.items(), key=lambda kv: -kv[1]))
    with open(st.out, "a") as f:   # one short line a write: xdist workers' lines do not interleave
        f.write(f"{len(st.current)}\t{new}\t{st.launches}\t{nodeid}\t{detail}\n")
    st.current = None


# ---- reading and printing -----------------------------------------------------------------------------------
def read(path: str) -> dict[str, tuple[int, int, int, str]]:
    """node id -> (specs, new, launches, per-kernel detail)."""
    rows = {}
    for line in Path(path).read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 4 and parts[0].isdigit():
            rows[parts[3]] = (int(parts[0]), int(parts[1]), int(parts[2]), parts[4] if len(parts) > 4 else "")
    return rows


def read_times(path: str) -> dict[str, float]:
    """node id -> GPU seconds, from a COURSE_TEST_TIMES file (phases summed) or tools/test_times.py's table."""
    times: dict[str, float] = defaultdict(float)
    for line in Path(path).read_text().splitlines():
        parts = line.split("\t")
        if len(parts) in (3, 4):
            try:
                times[parts[2]] += float(parts[0])
                continue
            except ValueError:
                pass
        m = re.match(r"\s*([0-9.]+)\s+(tests/\S.*::.*)$", line)
        if m:
            times[m.group(2)] = float(m.group(1))
    return dict(times)


def table(rows, times=None, top: int = 40) -> str:
    times = times or {}
    out = [f"{len(rows)} tests, {sum(r[0] for r in rows.values())} specializations launched in all "
           f"(per test, summed), {sum(r[1] for r in rows.values())} new to their process",
           f"\n{'specs':>6} {'new':>5} {'launch':>7} {'gpu s':>7}  test  [kernel:specs ...]"]
    for node, (s, n, k, detail) in sorted(rows.items(), key=lambda kv: (-kv[1][0], kv[0]))[:top]:
        t = f"{times[node]:7.1f}" if node in times else f"{'':>7}"
        out.append(f"{s:6d} {n:5d} {k:7d} {t}  {node}  [{detail[:120]}]")
    both = [(times[n], rows[n][0]) for n in rows if n in times]
    if len(both) >= 3:
        out.append(f"\n{len(both)} tests timed on the GPU too; Spearman rank correlation of specs and GPU seconds: "
                   f"{_spearman(both):.2f}")
    return "\n".join(out)


def _spearman(pairs) -> float:
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for m in range(i, j + 1):
                r[order[m]] = (i + j) / 2
            i = j + 1
        return r
    a, b = ranks([p[0] for p in pairs]), ranks([p[1] for p in pairs])
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5
    return cov / var if var else 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/compile_census.tsv", help="the census lines (appended; emptied first)")
    ap.add_argument("--read", help="print the table of an existing census file, run nothing")
    ap.add_argument("--times", help="GPU seconds per test to print beside the counts")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args(argv)
    path = a.read or a.out
    rc = 0
    if not a.read:
        Path(a.out).write_text("")
        env = {**os.environ, ENV: a.out, "TRITON_INTERPRET": "1", "COURSE_MODE": "interpreter",
               "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT / "tools"), str(ROOT),
                                                           os.environ.get("PYTHONPATH"))))}
        rc = subprocess.run([sys.executable, "-m", "pytest", "-p", "compile_census", "-p", "no:cacheprovider",
                             *a.pytest_args], cwd=ROOT, env=env).returncode
    print(table(read(path), read_times(a.times) if a.times else None, a.top))
    return rc


if __name__ == "__main__":
    sys.exit(main())
