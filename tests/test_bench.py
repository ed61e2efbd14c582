"""course_utils.bench beyond the core (sweeps, ceilings, roofline, plots, the simulated GPU) and the
chapter 8 checkers, which must pass the protocol and fail each usual mistake."""

from __future__ import annotations

import math
import statistics

import matplotlib
import pandas as pd
import pytest
import torch

import course_utils as cu
from course_utils import bench
from course_utils.check import CheckFailure
from course_utils.checkers import bench as checks

matplotlib.use("Agg")


# ------------------------------------------------------------------ the simulated GPU and time_ms

def sim(**kw):
    kw.setdefault("seed", 3)
    return bench.SimulatedGPU(**kw)


def test_time_ms_on_the_simulator_finds_the_true_time():
    gpu = sim()
    for nbytes in (gpu.l2_bytes // 8, 8 * gpu.l2_bytes):  # in L2 and far beyond it
        k = gpu.kernel(nbytes)
        t = bench.time_ms(k, device=gpu)
        assert t.median == pytest.approx(gpu.true_ms(k), rel=0.03)
        assert t.p20 <= t.median <= t.p80 and t.reps == 50 and len(t.times) == 50
        assert t.mean > t.median  # the simulator's slow repetitions pull the mean


def test_simulator_shows_each_mistake():
    gpu = sim(spike_prob=0.0)
    k = gpu.kernel(8 * gpu.l2_bytes)
    t0 = gpu.host_time()
    k()
    assert gpu.host_time() - t0 >= gpu.jit_ms  # the first call compiles
    gpu.synchronize()
    t0 = gpu.host_time()
    for _ in range(10):
        k()
    no_sync = (gpu.host_time() - t0) / 10
    assert no_sync == pytest.approx(gpu.launch_us * 1e-3)  # the queue, not the kernel
    small = gpu.kernel(gpu.l2_bytes // 4)
    cold = bench.time_ms(small, device=gpu).median
    warm = bench.time_ms(small, device=gpu, flush_l2=False, cuda_graph=True).median
    assert warm < 0.8 * cold  # L2


def test_events_must_be_synchronized_before_reading():
    gpu = sim()
    k = gpu.kernel(8 * gpu.l2_bytes)
    k()
    s, e = gpu.Event(), gpu.Event()
    s.record()
    k()
    e.record()
    with pytest.raises(RuntimeError, match="synchronize"):
        s.elapsed_time(e)
    gpu.synchronize()
    assert s.elapsed_time(e) > 0
    with pytest.raises(RuntimeError, match="recorded"):
        gpu.Event().elapsed_time(e)


def test_cuda_graph_replays_every_captured_call():
    gpu = sim()
    k = gpu.kernel(1 << 20)
    k()
    launches = gpu.launches
    t = bench.time_ms(k, device=gpu, cuda_graph=True, graph_calls=7, rep=3, warmup=1)
    assert t.cuda_graph and gpu.launches == launches + 1  # only the warm-up launched from the host
    with pytest.raises(ValueError):
        bench.time_ms(k, device=gpu, cuda_graph=True, graph_calls=0)


def test_time_ms_bad_input():
    gpu = sim()
    with pytest.raises(TypeError):
        bench.time_ms(42, device=gpu)
    with pytest.raises(ValueError):
        bench.time_ms(lambda: None, device=gpu, rep=0)
    with pytest.raises(ValueError):
        bench.time_ms(lambda: None, device=gpu, warmup=-1)

    def broken():
        raise ZeroDivisionError("oops")
    with pytest.raises(bench.BenchmarkError, match="raised ZeroDivisionError on its first call"):
        bench.time_ms(broken, device=gpu)
    if not cu.on_gpu():
        with pytest.raises(RuntimeError, match="recorded"):
            bench.time_ms(lambda: None)
    with pytest.raises(ValueError):
        gpu.kernel(0)


# ------------------------------------------------------------------ sweeps

def _fake_timer(fn, **kw):
    fn()
    return bench.Timing(2.0, 1.9, 2.1, 5)


def test_sweep_rows_and_units():
    x = torch.randn(1001, dtype=torch.float64)
    df = bench.sweep([{"n": 1001}, {"n": 7}], {"neg": lambda c: (lambda: -x[:c["n"]]),
                                                "abs": lambda c: (lambda: x[:c["n"]].abs())},
                     nbytes=lambda c: 16 * c["n"], flops=lambda c: c["n"], timer=_fake_timer, progress=False)
    assert len(df) == 4 and set(df.impl) == {"neg", "abs"}
    assert (df.error == "").all()
    r = df.iloc[0]
    assert r.gbps == pytest.approx(16 * 1001 / 2e-3 / 1e9) and r.tflops == pytest.approx(1001 / 2e-3 / 1e12)
    c = bench.with_ceilings(df, bench.Ceilings("x", 1.0, 1.0))
    assert c.pct_of_copy.iloc[0] == pytest.approx(100 * r.gbps) and "pct_of_matmul" in c


def test_sweep_reports_broken_callables_and_goes_on():
    calls = {"n": 0}

    def nondeterministic(case):
        def fn():
            calls["n"] += 1
            return torch.full((5,), float(calls["n"]))
        return fn
    impls = {"nothing": lambda c: (lambda: None),
             "raises": lambda c: (lambda: 1 / 0),
             "setup fails": lambda c: (_ for _ in ()).throw(MemoryError("CUDA out of memory")),
             "random": nondeterministic,
             "ok": lambda c: (lambda: torch.ones(3))}
    df = bench.sweep([{"n": 1}], impls, timer=_fake_timer, progress=False).set_index("impl")
    assert "returned nothing" in df.error["nothing"]
    assert "ZeroDivisionError" in df.error["raises"]
    assert "out of memory" in df.error["setup fails"]
    assert "not deterministic" in df.error["random"]
    assert df.error["ok"] == "" and df.ms["ok"] == 2.0
    assert math.isnan(df.ms["random"])


def test_sweep_empty_range_and_sizes():
    with pytest.raises(bench.BenchmarkError, match="empty sweep"):
        bench.sweep([], {"a": lambda c: (lambda: 1)}, timer=_fake_timer)
    with pytest.raises(bench.BenchmarkError, match="no implementations"):
        bench.sweep([{"n": 1}], {}, timer=_fake_timer)
    with pytest.raises(bench.BenchmarkError, match="empty"):
        bench.sizes(1024, 16)
    assert bench.sizes(1, 16) == [1, 2, 4, 8, 16] and bench.sizes(3, 100, 4) == [3, 12, 48]


def test_verify_callable_accepts_tuples_and_rejects_changing_ones():
    a = torch.randn(4)
    bench.verify_callable(lambda: (a * 2, a + 1))
    with pytest.raises(bench.BenchmarkError, match="not deterministic"):
        bench.verify_callable(lambda: torch.randn(4))
    state = {"i": 0}

    def shape_changes():
        state["i"] += 1
        return torch.zeros(state["i"])
    with pytest.raises(bench.BenchmarkError, match="shape"):
        bench.verify_callable(shape_changes)


# ------------------------------------------------------------------ ceilings and the roofline

def test_ceilings_known_unknown_and_datasheet():
    c = bench.ceilings_for("NVIDIA H100 80GB HBM3", 3000.0, 800.0)
    assert c.source == "measured" and "datasheet 3350 GB/s" in c.note
    assert c.ridge == pytest.approx(800e12 / 3000e9)
    u = bench.ceilings_for("Imaginary GPU 5000", 5000.0, 2000.0)
    assert u.source == "measured" and "not in the hardware table" in u.note
    with pytest.raises(ValueError, match="not in the hardware table"):
        bench.ceilings_for("Imaginary GPU 5000")
    d = bench.ceilings_for("NVIDIA H200")
    assert d.source == "datasheet" and d.copy_gbps == 4800
    with pytest.raises(ValueError):
        bench.ceilings_for("NVIDIA H200", -1.0, 5.0)


def test_ceilings_round_trip_both_csv_formats():
    c = bench.ceilings_for("NVIDIA H200", 4200.0, 790.0)
    back = bench.Ceilings.from_frame(pd.DataFrame([c.row()]))
    assert (back.copy_gbps, back.matmul_tflops, back.matmul_dtype) == (4200.0, 790.0, "bfloat16")
    lo = bench.Ceilings.from_frame(pd.DataFrame([{"copy_gbps": 3000.0, "matmul_bf16_tflops": 800.0,
                                                  "gpu": "NVIDIA H100 80GB HBM3"}]))
    assert lo.matmul_tflops == 800.0 and lo.gpu == "NVIDIA H100 80GB HBM3"
    with pytest.raises(ValueError):
        bench.Ceilings.from_frame(pd.DataFrame())


def test_attainable_and_roofline_frame():
    assert bench.attainable_tflops(1.0, 100.0, 2000.0) == pytest.approx(2.0)    # memory side
    assert bench.attainable_tflops(1e4, 100.0, 2000.0) == pytest.approx(100.0)  # compute side
    assert bench.attainable_tflops(0.0, 100.0, 2000.0) == 0.0
    for bad in ((-1, 1, 1), (float("nan"), 1, 1), (1, 1, "fast")):
        with pytest.raises(ValueError):
            bench.attainable_tflops(*bad)
    ceil = bench.Ceilings("g", 1000.0, 100.0)
    pts = [{"name": "copy", "flops": 0, "bytes": 1e9, "ms": 2.0},
           {"name": "gemm", "flops": 2e12, "bytes": 1e8, "ms": 40.0}]
    df = bench.roofline_frame(pts, ceil).set_index("name")
    assert df.bound["copy"] == "memory" and df.bound["gemm"] == "compute"
    assert df.pct_of_attainable["copy"] == pytest.approx(50.0)   # 500 GB/s of 1000
    assert df.pct_of_attainable["gemm"] == pytest.approx(50.0)   # 50 TFLOP/s of 100
    with pytest.raises(ValueError, match="missing"):
        bench.roofline_frame([{"name": "x", "flops": 1}], ceil)
    with pytest.raises(ValueError):
        bench.roofline_frame(pd.DataFrame(columns=["name", "flops", "bytes", "ms"]), ceil)
    with pytest.raises(ValueError, match="bytes > 0"):
        bench.roofline_frame([{"name": "x", "flops": 1, "bytes": 0, "ms": 1}], ceil)


def test_plots_draw():
    ceil = bench.Ceilings("g", 1000.0, 100.0)
    roof = bench.roofline_frame([{"name": "a", "flops": 1e9, "bytes": 1e9, "ms": 2.0}], ceil)
    ax = bench.plot_roofline(roof, ceil)
    assert ax.get_lines()
    df = pd.DataFrame({"n": [1, 2, 4, 1, 2, 4], "impl": list("aaabbb"), "gbps": [1, 2, 3, 2, 3, 4],
                       "ms": [1.0] * 6})
    ax = bench.plot_sweep(df, x="n", ceiling=5.0)
    assert len(ax.get_lines()) == 3
    with pytest.raises(ValueError):
        bench.plot_sweep(df, x="nope")


# ------------------------------------------------------------------ recorded results for notebook 8

def test_recorded_chapter8_results_have_every_demo_and_provenance():
    rec = bench.recorded("benchmarking")
    assert {"sync", "warmup", "quantiles", "l2", "graphs", "profiler", "roofline"} <= set(rec.demo)
    assert bench.provenance_line(rec).startswith("measured on NVIDIA")
    prof = rec[rec.demo == "profiler"].groupby("case").calls.sum()
    assert prof["naive softmax (5 eager ops)"] == 5 and prof["fused Triton softmax"] == 1
    ceil = bench.Ceilings.from_frame(bench.recorded("benchmarking_ceilings", gpu=rec.attrs["gpu_folder"]))
    assert ceil.copy_gbps > 100 and ceil.matmul_tflops > 10


def test_topic_loads_benchmark_modules(tmp_path):
    mod = bench.topic("benchmarking")
    assert set(mod.DEMOS) >= {"sync", "l2", "roofline"} and mod.targets(pd.DataFrame()) == []
    p = bench.save(pd.DataFrame([{"a": 1}]), "t", gpu="fake", root=tmp_path)
    assert {"gpu", "torch", "triton", "date"} <= set(pd.read_csv(p).columns)


# ------------------------------------------------------------------ the chapter 8 checkers

def protocol(gpu, fn, rep=30):
    for _ in range(3):
        fn()
    gpu.synchronize()
    s = [gpu.Event() for _ in range(rep)]
    e = [gpu.Event() for _ in range(rep)]
    for a, b in zip(s, e):
        gpu.flush_l2()
        a.record()
        fn()
        b.record()
    gpu.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(s, e))


def no_sync(gpu, fn, rep=30):
    t0 = gpu.host_time()
    for _ in range(rep):
        fn()
    return (gpu.host_time() - t0) / rep


def mean_not_median(gpu, fn, rep=30):
    for _ in range(3):
        fn()
    gpu.synchronize()
    s = [gpu.Event() for _ in range(rep)]
    e = [gpu.Event() for _ in range(rep)]
    for a, b in zip(s, e):
        gpu.flush_l2()
        a.record()
        fn()
        b.record()
    gpu.synchronize()
    return statistics.fmean(a.elapsed_time(b) for a, b in zip(s, e))


def no_flush(gpu, fn, rep=30):
    for _ in range(3):
        fn()
    gpu.synchronize()
    s = [gpu.Event() for _ in range(rep)]
    e = [gpu.Event() for _ in range(rep)]
    for a, b in zip(s, e):
        a.record()
        fn()
        b.record()
    gpu.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(s, e))


def no_warmup_mean(gpu, fn, rep=30):
    s = [gpu.Event() for _ in range(rep)]
    e = [gpu.Event() for _ in range(rep)]
    for a, b in zip(s, e):
        gpu.flush_l2()
        a.record()
        fn()
        b.record()
    gpu.synchronize()
    return statistics.fmean(a.elapsed_time(b) for a, b in zip(s, e))


def host_clock(gpu, fn, rep=30):
    for _ in range(3):
        fn()
    per = []
    for _ in range(rep):
        gpu.flush_l2()
        gpu.synchronize()
        t0 = gpu.host_time()
        fn()
        gpu.synchronize()
        per.append(gpu.host_time() - t0)
    return statistics.median(per)


def uses_harness(gpu, fn):
    return bench.time_ms(fn, device=gpu).median


def test_check_timer_passes_the_protocol():
    checks.check_timer(protocol)


@pytest.mark.parametrize("wrong, words", [(no_sync, "never synchronized"), (mean_not_median, "median"),
                                          (no_flush, "flush"), (no_warmup_mean, "no warm-up"),
                                          (host_clock, "host clock"), (uses_harness, "yourself"),
                                          (lambda gpu, fn: None, "returned nothing"),
                                          (lambda gpu, fn: "fast", "expected a number")])
def test_check_timer_fails_each_mistake(wrong, words):
    for _ in range(3):  # fresh random GPUs each time: it must fail every time
        with pytest.raises(CheckFailure, match=words):
            checks.check_timer(wrong)
    assert bench.time_ms.__name__ == "time_ms"  # the harness is restored after the check


def good_bw(gpu):
    k = gpu.kernel(8 * gpu.l2_bytes)
    return bench.gbps(k.nbytes, bench.time_ms(k, device=gpu))


def test_check_bandwidth():
    checks.check_bandwidth(good_bw)

    def fits_in_l2(gpu):
        k = gpu.kernel(gpu.l2_bytes // 2)
        return bench.gbps(k.nbytes, bench.time_ms(k, device=gpu, flush_l2=False, cuda_graph=True))

    def small(gpu):
        k = gpu.kernel(gpu.l2_bytes // 16)
        return bench.gbps(k.nbytes, bench.time_ms(k, device=gpu))

    def wrong_units(gpu):
        return good_bw(gpu) * 1e3

    for wrong, words in ((fits_in_l2, "4x"), (small, "4x"), (wrong_units, "bytes"),
                         (lambda gpu: 3000.0, "never made a kernel")):
        with pytest.raises(CheckFailure, match=words):
            checks.check_bandwidth(wrong)


def test_check_attainable():
    checks.check_attainable(lambda i, p, b: min(p, i * b / 1e3))
    for wrong, words in ((lambda i, p, b: max(p, i * b / 1e3), "min, not max"),
                         (lambda i, p, b: min(p, i * b), "Units"),
                         (lambda i, p, b: p, "expected"),
                         (lambda i, p, b: None, "nothing")):
        with pytest.raises(CheckFailure, match=words):
            checks.check_attainable(wrong)


def test_chapter8_scale_kernel_under_the_interpreter():
    bb = bench.topic("benchmarking")
    for n in (1, 7, 1000, 3001):
        x = torch.randn(n, device=cu.DEVICE) * 100
        y = torch.full_like(x, float("nan"))
        bb.scale(x, y, salt=n)
        assert torch.equal(y, 2 * x)
    empty = torch.empty(0, device=cu.DEVICE)
    assert bb.scale(empty, empty.clone()).numel() == 0
    with pytest.raises(ValueError):
        bb.scale(torch.zeros(4, device=cu.DEVICE), torch.zeros(5, device=cu.DEVICE))
    with pytest.raises(ValueError):
        bb.scale(torch.zeros(4, 2, device=cu.DEVICE).t(), torch.zeros(2, 4, device=cu.DEVICE))
    if not cu.on_gpu():
        with pytest.raises(RuntimeError, match="recorded"):
            bb.sweep(quick=True)
