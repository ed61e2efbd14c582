"""Chapter 8's measurements: each rule of the timing protocol measured the wrong way and the right way.

One DataFrame, one row per measurement, ``demo`` says which rule it shows:

- ``sync``: a device-to-device copy timed by the host clock without a sync (the queue), with one
  sync after the loop, with a sync around every call (launch + sync included), and by the
  protocol (events, L2 flushed, median).
- ``warmup``: the first call of a Triton kernel that has never been compiled, the second call and
  the steady state; the same for ``torch.compile``.
- ``quantiles``: every repetition of two timings (a launch-bound kernel and a 64 MiB GELU).
- ``l2``: bandwidth of y = 2x against the working set, from the same buffers back to back (L2 warm),
  from rotating buffers whose footprint is at least 4x L2 (cold), and by ``time_ms`` with and
  without its L2 flush.
- ``graphs``: a small Triton kernel over sizes, by ``time_ms`` with and without a CUDA graph,
  Triton's ``do_bench`` and ``do_bench_cudagraph``, and the host clock.
- ``profiler``: the CUDA kernels the profiler saw for the eager five-op softmax and the fused one.
- ``roofline``: FLOPs, minimum bytes and time of the course's kernels and their references.

The ``l2`` and ``graphs`` demos compare their methods with ``bench.time_rounds`` (each method once
per round, the median round kept; columns ``ms``, ``ms_p20``, ``ms_p80``).

``python -m benchmarks.run --only benchmarking`` writes ``results/<gpu>/benchmarking.csv``; the
notebook shows it when no GPU is present.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time

import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils import bench
from course_utils.tuned import attention as TA
from course_utils.tuned import elementwise as TE
from course_utils.tuned import softmax as TS

TITLE = "Benchmarking done right: the protocol measured (chapter 8)"
MIB = 2**20
ROUNDS = bench.ROUNDS  # the l2 and graphs demos compare methods in interleaved rounds (median round)

# FLOP per element, counted on the formula (tanh and exp count one each): GELU-tanh
# 0.5*x*(1+tanh(c*(x+0.044715*x^3))) is 9, softmax (max, subtract, exp, sum, divide) is 5.
FLOP_PER_ELEMENT = {"gelu": 9, "softmax": 5}


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n_elements, scale, BLOCK_SIZE: tl.constexpr, SALT: tl.constexpr):
    """y = x * scale. SALT changes nothing but the compilation key, so a new SALT compiles anew."""
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(y_ptr + offsets, x * scale + SALT * 0, mask=mask)


def scale(x: torch.Tensor, y: torch.Tensor, salt: int = 0, BLOCK_SIZE: int = 1024) -> torch.Tensor:
    """Launch :func:`_scale_kernel` (y = 2x) on contiguous float32 tensors of the same size."""
    if x.shape != y.shape or not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError("scale: x and y must be contiguous and of the same shape")
    n = x.numel()
    if n == 0:
        return y
    _scale_kernel[(triton.cdiv(n, BLOCK_SIZE),)](x, y, n, 2.0, BLOCK_SIZE=BLOCK_SIZE, SALT=salt)
    return y


def _sync():
    torch.cuda.synchronize()


def _host_ms(fn, calls: int, sync_each: bool = False, sync_end: bool = True) -> float:
    """Milliseconds per call from the host clock (wrong ways included, on purpose)."""
    _sync()
    if sync_each:
        per = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            _sync()
            per.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(per)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if sync_end:
        _sync()
    ms = (time.perf_counter() - t0) * 1e3 / calls
    _sync()
    return ms


def demo_sync(sizes_mib=(1, 64, 1024), calls: int = 20) -> list[dict]:
    rows = []
    for mib in sizes_mib:
        x = torch.randn(mib * MIB // 4, device="cuda")
        y = torch.empty_like(x)
        fn = lambda: y.copy_(x)  # noqa: E731
        nbytes = 2 * x.numel() * 4
        bench.time_ms(fn, rep=5)  # warm-up
        measured = {
            "host clock, no sync": _host_ms(fn, calls, sync_end=False),
            "host clock, one sync after the loop": _host_ms(fn, calls),
            "host clock, sync around each call": _host_ms(fn, calls, sync_each=True),
            "events, L2 flushed, median (time_ms)": bench.time_ms(fn).median,
        }
        for method, ms in measured.items():
            rows.append(dict(demo="sync", case=f"copy {mib} MiB", size_mib=mib, method=method, ms=ms,
                             bytes=nbytes, gbps=bench.gbps(nbytes, ms)))
    return rows


def demo_warmup(n: int = 2**20) -> list[dict]:
    rows = []
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    salt = random.randrange(1, 2**30)  # never compiled before, on any machine

    def first_calls(fn, label):
        _sync()
        for i, what in enumerate(("first call", "second call")):
            t0 = time.perf_counter()
            fn()
            _sync()
            rows.append(dict(demo="warmup", case=label, method=what, call=i + 1,
                             ms=(time.perf_counter() - t0) * 1e3))
        rows.append(dict(demo="warmup", case=label, method="steady state (time_ms)", call=0,
                         ms=bench.time_ms(fn).median))

    first_calls(lambda: scale(x, y, salt), f"Triton kernel, {n} elements")
    compiled = torch.compile(lambda t: torch.nn.functional.gelu(t, approximate="tanh") * 2.0)
    first_calls(lambda: compiled(x), f"torch.compile(gelu * 2), {n} elements")
    return rows


def demo_quantiles(rep: int = 200) -> list[dict]:
    rows = []
    from course_utils.kernels import launch
    tiny = torch.zeros(1, device="cuda")
    x = torch.randn(64 * MIB // 4, device="cuda")
    cases = {"add_one, 1 element (launch-bound)": lambda: launch.add_one(tiny),
             "F.gelu, 64 MiB fp32": lambda: torch.nn.functional.gelu(x, approximate="tanh")}
    for label, fn in cases.items():
        t = bench.time_ms(fn, rep=rep)
        for i, ms in enumerate(t.times):
            rows.append(dict(demo="quantiles", case=label, method="repetition", rep=i, ms=ms))
    return rows


def _ms_timer(measure):
    """A timer for ``bench.time_rounds`` from a function that returns milliseconds (no percentiles)."""
    return lambda fn: bench.Timing(measure(fn), math.nan, math.nan, 1)


def _per_call(t: bench.Timing, calls: int) -> bench.Timing:
    """A graph replay's Timing divided by the calls it holds."""
    return bench.Timing(t.median / calls, t.p20 / calls, t.p80 / calls, t.reps)


def _graph_of(calls) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return g


def demo_l2(sizes_kib=None, quick: bool = False) -> list[dict]:
    """y = 2x (the Triton scale kernel: a copy through the SMs; a captured ``copy_`` would become a
    copy-engine memcpy) over working sets from 256 KiB to 1 GiB per tensor."""
    rows = []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    if sizes_kib is None:
        sizes_kib = [256 * 4**i for i in range(7)]  # 256 KiB ... 1 GiB per tensor
        if quick:
            sizes_kib = sizes_kib[::2]
    for kib in sizes_kib:
        nbytes_t = kib * 1024
        n = nbytes_t // 4
        reps = max(2, min(512, math.ceil(4 * l2 / (2 * nbytes_t))))
        srcs = [torch.randn(n, device="cuda") for _ in range(reps)]
        dsts = [torch.empty_like(srcs[0]) for _ in range(reps)]
        moved = 2 * nbytes_t
        warm = _graph_of([lambda: scale(srcs[0], dsts[0])] * reps)
        cold = _graph_of([(lambda i=i: scale(srcs[i], dsts[i])) for i in range(reps)])
        one = lambda: scale(srcs[0], dsts[0])  # noqa: E731
        measured = bench.time_rounds({
            "same buffers back to back (L2 warm), graph":
                (warm.replay, lambda f: _per_call(bench.time_ms(f, flush_l2=False), reps)),  # noqa: B023
            "rotating buffers >= 4x L2 (cold), graph":
                (cold.replay, lambda f: _per_call(bench.time_ms(f, flush_l2=False), reps)),  # noqa: B023
            "time_ms, L2 flushed": (one, bench.time_ms),
            "time_ms, no flush": (one, lambda f: bench.time_ms(f, flush_l2=False)),
        }, rounds=ROUNDS)
        for method, t in measured.items():
            rows.append(dict(demo="l2", case="y = 2x (Triton)", size_mib=kib / 1024, method=method, **t.columns(),
                             bytes=moved, gbps=bench.gbps(moved, t), l2_bytes=l2, footprint_bytes=moved * reps))
        srcs = dsts = warm = cold = None
        torch.cuda.empty_cache()
    return rows


def demo_graphs(quick: bool = False) -> list[dict]:
    from triton.testing import do_bench, do_bench_cudagraph
    rows = []
    exps = range(10, 29, 2) if not quick else range(10, 29, 6)
    for e in exps:
        n = 2**e
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        fn = lambda: scale(x, y)  # noqa: E731
        moved = 2 * n * 4
        measured = bench.time_rounds({
            "time_ms (events, L2 flushed)": (fn, bench.time_ms),
            "time_ms, CUDA graph of 20 calls": (fn, lambda f: bench.time_ms(f, cuda_graph=True)),
            "triton do_bench": (fn, _ms_timer(lambda f: do_bench(f, return_mode="median"))),
            "triton do_bench_cudagraph": (fn, _ms_timer(lambda f: do_bench_cudagraph(f, return_mode="median"))),
            "host clock, back to back": (fn, _ms_timer(lambda f: _host_ms(f, 200))),
        }, rounds=ROUNDS)
        for method, t in measured.items():
            rows.append(dict(demo="graphs", case="Triton scale kernel", elements=n, method=method, **t.columns(),
                             bytes=moved, gbps=bench.gbps(moved, t)))
    return rows


def _kernel_rows(fn, label: str, iters: int = 3) -> list[dict]:
    from torch.autograd import DeviceType
    fn()
    _sync()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        _sync()
    rows = []
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != DeviceType.CUDA:
            continue
        dev_us = getattr(evt, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "cuda_time_total", 0.0)
        rows.append(dict(demo="profiler", case=label, method=evt.key[:120], calls=evt.count / iters,
                         ms=dev_us / evt.count / 1e3 if evt.count else float("nan")))
    if not rows:
        rows.append(dict(demo="profiler", case=label, method="(the profiler saw no CUDA kernels)", calls=0))
    return rows


def demo_profiler(rows_n: int = 4096, cols_n: int = 4096) -> list[dict]:
    from course_utils.kernels import softmax as sm
    x = torch.randn(rows_n, cols_n, device="cuda")
    return (_kernel_rows(lambda: sm.softmax_ref(x), "naive softmax (5 eager ops)")
            + _kernel_rows(lambda: TS.softmax(x), "fused Triton softmax")
            + _kernel_rows(lambda: torch.softmax(x, -1), "torch.softmax"))


def demo_roofline(quick: bool = False) -> list[dict]:
    import torch.nn.functional as F
    rows = []

    def point(name, fn, flops, nbytes, dtype):
        try:
            t = bench.time_ms(fn, rep=30)
            rows.append(dict(demo="roofline", case=name, method="time_ms", ms=t.median, flops=flops,
                             bytes=nbytes, gbps=bench.gbps(nbytes, t), dtype=dtype))
        except Exception as e:  # a kernel that is not there or fails: say so, go on
            rows.append(dict(demo="roofline", case=name, method="error", error=f"{type(e).__name__}: {e}"[:200]))
        torch.cuda.empty_cache()

    n = 256 * MIB // 2
    xb = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    gelu_flops = FLOP_PER_ELEMENT["gelu"] * n
    point("copy_ (bf16, 256 MiB)", lambda: torch.empty_like(xb).copy_(xb), 0, 4 * n, "bfloat16")
    point("F.gelu tanh (bf16, 256 MiB)", lambda: F.gelu(xb, approximate="tanh"), gelu_flops, 4 * n, "bfloat16")
    try:
        from course_utils.kernels import elementwise as ew
        point("course gelu, Triton (bf16, 256 MiB)", lambda: TE.gelu(xb), gelu_flops, 4 * n, "bfloat16")
        point("gelu_ref, eager ops (bf16, 256 MiB)", lambda: ew.gelu_ref(xb), gelu_flops, 4 * n, "bfloat16")
    except ImportError as e:
        rows.append(dict(demo="roofline", case="course gelu", method="error", error=str(e)))
    xb = None
    m, k = 4096, 16384
    xs = torch.randn(m, k, device="cuda")
    sm_flops, sm_bytes = FLOP_PER_ELEMENT["softmax"] * m * k, 2 * m * k * 4
    point("torch.softmax (fp32, 4096x16384)", lambda: torch.softmax(xs, -1), sm_flops, sm_bytes, "float32")
    try:
        from course_utils.kernels import softmax as sm
        point("course softmax, Triton (fp32, 4096x16384)", lambda: TS.softmax(xs), sm_flops, sm_bytes, "float32")
        point("softmax_ref, 5 eager ops (fp32, 4096x16384)", lambda: sm.softmax_ref(xs), sm_flops, sm_bytes,
              "float32")
    except ImportError as e:
        rows.append(dict(demo="roofline", case="course softmax", method="error", error=str(e)))
    xs = None
    for size in ((1024, 4096, 8192) if not quick else (8192,)):
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        point(f"matmul bf16 {size}^3", lambda a=a, b=b: a @ b, 2 * size**3, 3 * size * size * 2, "bfloat16")
    B, H, N, D = 4, 16, 4096, 128
    q, k_, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    att_flops, att_bytes = 4 * B * H * N * N * D, 4 * B * H * N * D * 2
    point(f"SDPA (bf16, B={B} H={H} N={N} d={D})", lambda: F.scaled_dot_product_attention(q, k_, v),
          att_flops, att_bytes, "bfloat16")
    try:
        from course_utils.kernels import attention as A
        point(f"course flash_attention, Triton (bf16, N={N} d={D})", lambda: TA.flash_attention(q, k_, v),
              att_flops, att_bytes, "bfloat16")
        q1, k1, v1 = q[:1], k_[:1], v[:1]
        point(f"attention_ref, eager (bf16, B=1 H={H} N={N} d={D})", lambda: A.attention_ref(q1, k1, v1),
              att_flops // B, att_bytes // B, "bfloat16")
    except ImportError as e:
        rows.append(dict(demo="roofline", case="course attention", method="error", error=str(e)))
    return rows


DEMOS = {"sync": demo_sync, "warmup": demo_warmup, "quantiles": demo_quantiles, "l2": demo_l2,
         "graphs": demo_graphs, "profiler": demo_profiler, "roofline": demo_roofline}


def sweep(quick: bool = False):
    """Every demo; one that fails becomes an ``error`` row and the others still run."""
    import pandas as pd
    from tqdm.auto import tqdm

    if not cu.on_gpu():
        raise RuntimeError("chapter 8's measurements need a CUDA GPU; recorded: cu.bench.recorded('benchmarking')")
    rows = []
    for name, demo in tqdm(DEMOS.items(), desc="benchmarking", leave=False):
        t0 = time.perf_counter()
        try:
            kw = {"quick": quick} if name in ("l2", "graphs", "roofline") else {}
            rows += demo(**kw)
        except Exception as e:
            rows.append(dict(demo=name, case="(demo failed)", method="error", error=f"{type(e).__name__}: {e}"[:300]))
        print(f"  benchmarking/{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        if os.environ.get("OUT"):  # keep what was measured if the run is cut short
            pd.DataFrame(rows).to_csv(os.path.join(os.environ["OUT"], "benchmarking_partial.csv"), index=False)
    df = pd.DataFrame(rows)
    if "error" not in df.columns:
        df["error"] = ""
    return df


def targets(df) -> list:
    """Chapter 8 has no speed target of its own: it measures how to measure."""
    return []


def plot(df):
    """Two figures: copy GB/s against the working set (L2), and time against size (CUDA graphs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = []
    for demo, x, y, title in (("l2", "size_mib", "gbps", "y = 2x: L2 warm vs cold"),
                              ("graphs", "elements", "ms", "small kernel: graphs and do_bench")):
        sel = df[(df["demo"] == demo) & df["ms"].notna()] if "demo" in df.columns else df.iloc[0:0]
        if sel.empty:
            continue
        fig, ax = plt.subplots(figsize=(8, 4.5))
        bench.plot_sweep(sel, x=x, y=y, hue="method", ax=ax, title=f"{title} ({sel['gpu'].iloc[0]})")
        if y == "ms":
            ax.set_yscale("log")
        figs.append(fig)
    return figs
