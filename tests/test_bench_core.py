"""The pure parts of the benchmark harness: timing summaries, units, results on disk, provenance;
and chapter 1's benchmark module keeps the contract of benchmarks/."""

from __future__ import annotations

import math

import pandas as pd
import pytest

import course_utils as cu
from course_utils import bench, results


def test_timing_summary_is_median_and_quantiles():
    t = bench.Timing.from_times([5.0, 1.0, 3.0, 2.0, 4.0, 100.0])
    assert t.median == pytest.approx(3.5)
    assert t.p20 <= t.median <= t.p80
    assert t.mean > t.median  # one slow outlier pulls the mean, not the median
    assert t.us == pytest.approx(3500)
    one = bench.Timing.from_times([2.5])
    assert (one.median, one.p20, one.p80, one.reps) == (2.5, 2.5, 2.5, 1)


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [-1.0], [math.inf]])
def test_timing_rejects_meaningless_repetitions(bad):
    with pytest.raises(bench.BenchmarkError):
        bench.Timing.from_times(bad)


def test_units():
    assert bench.gbps(2e9, 1.0) == pytest.approx(2000)  # 2 GB in 1 ms
    assert bench.tflops(1e12, 1.0) == pytest.approx(1000)
    t = bench.Timing.from_times([1.0])
    assert bench.gbps(2e9, t) == bench.gbps(2e9, 1.0)


@pytest.mark.skipif(cu.on_gpu(), reason="checks the CPU message")
def test_time_ms_refuses_to_time_the_cpu_and_rejects_bad_arguments():
    with pytest.raises(RuntimeError, match="recorded"):
        bench.time_ms(lambda: None)
    with pytest.raises(TypeError):
        bench.time_ms(42)
    with pytest.raises(ValueError):
        bench.time_ms(lambda: None, rep=0)
    with pytest.raises(ValueError):
        bench.time_ms(lambda: None, warmup=-1)


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"), ("NVIDIA H200", "h200"), ("Tesla T4", "tesla-t4"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"), ("NVIDIA_GeForce  RTX 4090", "geforce-rtx-4090"),
])
def test_gpu_slug(name, slug):
    assert bench.gpu_slug(name) == slug


def test_save_adds_provenance_and_recorded_reads_it_back(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)  # where the results module looks
    df = pd.DataFrame({"impl": ["a", "b"], "us": [1.5, 2.5]})
    path = bench.save(df, "demo", gpu="h200")
    assert path == tmp_path / "h200" / "demo.csv"
    assert list(df.columns) == ["impl", "us"]  # the caller's frame is not modified
    bench.save(df.assign(gpu="NVIDIA H100 80GB HBM3"), "demo", gpu="h100-80gb-hbm3")
    assert bench.recorded_gpus() == ["h100-80gb-hbm3", "h200"]  # H100 first
    back = bench.recorded("demo")
    assert back.attrs["gpu_folder"] == "h100-80gb-hbm3"
    assert back.gpu[0] == "NVIDIA H100 80GB HBM3"  # a gpu column already there is kept
    h200 = bench.recorded("demo", gpu="h200")
    assert {"gpu", "torch", "triton", "date"} <= set(h200.columns)
    assert list(h200.us) == [1.5, 2.5]
    assert bench.provenance_line(back).startswith("measured on NVIDIA H100 80GB HBM3 (torch ")
    with pytest.raises(FileNotFoundError, match="nope"):
        bench.recorded("nope")


def test_recorded_gpus_without_results(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path / "missing")
    assert bench.recorded_gpus() == []
    assert bench.provenance_line(pd.DataFrame({"x": [1]})).startswith("provenance unknown")


def test_target():
    t = bench.Target(1, "x vs y", measured=0.95, required=0.9)
    assert t.passed and t.row()["status"] == "pass"
    assert not bench.Target(1, "x vs y", 0.5, 0.9).passed


def test_recorded_launch_overhead_names_its_gpu():
    """The chapter 1 notebook shows these numbers on the CPU: they must exist, with provenance."""
    if not any((bench.RESULTS / g / "launch_overhead.csv").exists() for g in bench.recorded_gpus()):
        pytest.skip("no recorded launch_overhead results yet")
    df = bench.recorded("launch_overhead")
    assert {"case", "impl", "method", "n_ops", "us", "gpu", "torch", "triton", "date"} <= set(df.columns)
    assert (df.us > 0).all()
    chain = df[df.case == "chain"]
    assert set(chain.n_ops) >= {10, 100, 500}


def test_launch_overhead_benchmark_keeps_the_contract():
    from benchmarks import launch_overhead as lo

    assert isinstance(lo.TITLE, str) and lo.TITLE
    assert lo.targets(pd.DataFrame()) == []
    if not cu.on_gpu():
        with pytest.raises(RuntimeError, match="recorded"):
            lo.sweep(quick=True)
    rows = [lo._row("tiny op", i, "host clock", 5.0) for i in ("torch.relu(x)", "x + y", "x.add_(1) in place")]
    rows += [lo._row("empty triton kernel", i, "host clock", 12.0)
             for i in ("empty kernel, 1 arg", "empty kernel, 10 args", "add_one, 1 element")]
    for n in (10, 100):
        rows += [lo._row("chain", f"eager, {n} launches", "host clock", 5.0 * n, n_ops=n),
                 lo._row("chain", "CUDA graph, 1 replay", "host clock", 1.0 * n, n_ops=n)]
    rows += [lo._row("triton chain", "eager, 100 launches", "host clock", 1500.0, n_ops=100),
             lo._row("triton chain", "CUDA graph, 1 replay", "host clock", 100.0, n_ops=100),
             lo._row("relu size sweep", "torch.relu", "cuda events", 700.0, elements=2**28, nbytes=2**31)]
    df = pd.DataFrame(rows)
    assert df.us_per_op[df.n_ops == 100].tolist() == [5.0, 1.0, 15.0, 1.0]
    text = lo.summary(df)
    assert "chain of 100: eager / graph" in text and "(5.0x)" in text and "(15.0x)" in text
    assert df.gbps.iloc[-1] == pytest.approx(2**31 / 700e-6 / 1e9)
