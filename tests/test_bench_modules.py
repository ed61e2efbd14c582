"""The harness split by job: interleaved rounds, one column naming, one ceilings type shared with the
time model, the recorded launch overhead, the cached device_info, and no import cycle between them."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from course_utils import bench, ceilings, hardware, timing
from course_utils import traffic as T

PKG = Path(__file__).resolve().parent.parent / "course_utils"


# ------------------------------------------------------------------ interleaved rounds


def _fixed(ms):
    return bench.Timing(ms, ms * 0.9, ms * 1.1, 5)


def test_time_rounds_interleaves_and_keeps_the_median_round():
    order, per_round = [], {"a": iter([3.0, 1.0, 2.0]), "b": iter([10.0, 30.0, 20.0])}

    def timer(fn, **kw):
        assert kw == {"rep": 7}
        name = fn()
        order.append(name)
        return _fixed(next(per_round[name]))

    got = bench.time_rounds({"a": lambda: "a", "b": lambda: "b"}, rounds=3, timer=timer, rep=7, balance=False)
    assert order == ["a", "b", "a", "b", "a", "b"]  # A, B, A, B...: never A, A, A, B
    assert list(got) == ["a", "b"]
    assert got["a"].median == 2.0 and got["b"].median == 20.0
    assert got["a"].columns() == {"ms": 2.0, "ms_p20": pytest.approx(1.8), "ms_p80": pytest.approx(2.2)}
    assert tuple(got["a"].columns()) == bench.TIMING_COLUMNS == ("ms", "ms_p20", "ms_p80")


def test_time_rounds_balances_its_orders_by_default():
    order = []
    got = bench.time_rounds({k: (lambda k=k: k) for k in "abcdef"}, rounds=6,
                            timer=lambda fn, **kw: order.append(fn()) or _fixed(1.0))
    assert list(got) == list("abcdef")  # the result keeps the caller's order
    rounds = ["".join(order[i:i + 6]) for i in range(0, 36, 6)]
    assert all(sorted(r) == list("abcdef") for r in rounds)
    pairs = [r[j:j + 2] for r in rounds for j in range(5)]
    assert len(set(pairs)) == len(pairs) == 30  # over 6 rounds each entry follows each other one once
    assert {r.index(k) for r in rounds for k in "a"} == set(range(6))  # and sits at every place


@pytest.mark.parametrize("n, rounds", [(1, 3), (2, 3), (5, 7), (8, 3)])
def test_balanced_orders_are_permutations(n, rounds):
    orders = timing.balanced_orders(n, rounds)
    assert len(orders) == rounds and all(sorted(o) == list(range(n)) for o in orders)


def test_time_rounds_warms_each_entry_up_for_a_time_on_a_real_gpu_only(monkeypatch):
    seen = []
    monkeypatch.setattr(timing, "time_ms", lambda fn, **kw: seen.append(kw) or _fixed(1.0))
    timing.time_rounds({"a": lambda: None}, rounds=1)
    timing.time_rounds({"a": lambda: None}, rounds=1, warmup_ms=5.0)
    timing.time_rounds({"a": lambda: None}, rounds=1, device=bench.SimulatedGPU(seed=1))
    assert seen[0] == {"warmup_ms": timing.ROUND_WARMUP_MS} and seen[1] == {"warmup_ms": 5.0}
    assert "warmup_ms" not in seen[2]  # a simulated GPU is timed as asked


def test_time_ms_warmup_ms_calls_for_that_long_on_the_device():
    gpu = bench.SimulatedGPU(seed=3)
    k = gpu.kernel(512 << 20)  # far above the launch's few microseconds and L2
    calls = []
    fn = lambda: (calls.append(1), k())  # noqa: E731
    bench.time_ms(fn, warmup=2, rep=3, device=gpu)
    plain = len(calls)
    calls.clear()
    bench.time_ms(fn, warmup=2, rep=3, device=gpu, warmup_ms=50 * gpu.true_ms(k))
    assert 40 <= len(calls) - plain <= 60  # about 50 calls' worth more (one call timed, with its noise)
    calls.clear()
    bench.time_ms(lambda: calls.append(1), warmup=1, rep=1, device=gpu, warmup_ms=1.0)
    assert len(calls) <= timing.MAX_WARMUP_CALLS + 3  # a callable that takes no device time is capped


def test_time_rounds_calls_before_round_ahead_of_each_round():
    order = []
    got = bench.time_rounds({"a": lambda: None, "b": lambda: None}, rounds=2,
                            timer=lambda fn, **kw: order.append("t") or _fixed(1.0),
                            before_round=lambda i: order.append(f"round {i}"))
    assert order == ["round 0", "t", "t", "round 1", "t", "t"] and list(got) == ["a", "b"]


def test_time_rounds_even_rounds_take_the_lower_middle_and_entries_may_bring_their_timer():
    ms = iter([4.0, 1.0, 3.0, 2.0])
    got = bench.time_rounds({("k", "wall"): (lambda: None, lambda fn: _fixed(next(ms)))}, rounds=4)
    assert got[("k", "wall")].median == 2.0
    assert bench.median_round([_fixed(5.0)]).median == 5.0
    with pytest.raises(bench.BenchmarkError):
        bench.median_round([])


def test_time_rounds_records_or_raises_failures():
    def boom():
        raise MemoryError("CUDA out of memory")
    timer = lambda fn, **kw: (fn(), _fixed(1.0))[1]  # noqa: E731
    errors = {}
    got = bench.time_rounds({"ok": lambda: None, "oom": boom}, rounds=2, timer=timer, errors=errors)
    assert list(got) == ["ok"] and errors["oom"].startswith("MemoryError: CUDA out of memory")
    with pytest.raises(MemoryError):
        bench.time_rounds({"oom": boom}, timer=timer)
    for bad in ({}, {"x": 3}):
        with pytest.raises((bench.BenchmarkError, TypeError)):
            bench.time_rounds(bad, timer=timer)
    with pytest.raises(ValueError, match="rounds"):
        bench.time_rounds({"ok": lambda: None}, rounds=0, timer=timer)


def test_time_rounds_on_the_simulated_gpu():
    gpu = bench.SimulatedGPU(seed=5)
    small, big = gpu.kernel(1 << 20), gpu.kernel(64 << 20)
    got = bench.time_rounds({"small": small, "big": big}, rounds=3, device=gpu, rep=10)
    assert got["small"].median == pytest.approx(gpu.true_ms(small), rel=0.05)
    assert got["big"].median == pytest.approx(gpu.true_ms(big), rel=0.05)


def test_sweep_names_its_timing_columns_like_everyone():
    df = bench.sweep([{"n": 3}], {"neg": lambda c: (lambda: -torch.ones(c["n"]))},
                     timer=lambda fn, **kw: _fixed(2.0), progress=False)
    assert {"ms", "ms_p20", "ms_p80"} <= set(df.columns) and "p20_ms" not in df.columns


# ------------------------------------------------------------------ one ceilings type, one ridge, one roofline


def test_one_ceilings_type_for_bench_and_the_time_model():
    assert T.Machine is bench.Ceilings is ceilings.Ceilings
    m = T.machine("h100-sxm", "bf16")
    assert isinstance(m, bench.Ceilings) and m.source == "datasheet"
    assert (m.name, m.hbm_gbps, m.peak_tflops, m.l2_bytes) == ("NVIDIA H100 SXM 80GB", 3350.0, 989.0, 50 * 2**20)
    spec = hardware.lookup("h100-sxm")
    # one ridge formula: the datasheet's, the Ceilings' and the function agree
    assert spec.ridge_flops_per_byte("bfloat16") == m.ridge == spec.ceilings("bfloat16").ridge \
        == bench.ridge_point(989.0, 3350.0) == pytest.approx(989e12 / 3350e9)
    # one roofline: the time model's kernel time and the attainable rate are the same model
    intensity, nbytes = 100.0, 1e9
    mem, comp = bench.roofline_seconds(nbytes, intensity * nbytes, m.hbm_gbps, m.peak_tflops)
    assert intensity * nbytes / max(mem, comp) / 1e12 == pytest.approx(m.attainable_tflops(intensity))
    assert bench.attainable_tflops(intensity, 989.0, 3350.0) == pytest.approx(335.0)
    k = T.Traffic("one", (T.Kernel("k", int(nbytes), 0, intensity * nbytes),))
    est = T.estimate_time(k, m, l2_reuse=False)
    assert est.seconds == pytest.approx(max(mem, comp) + m.launch_us * 1e-6)


def test_ceilings_reject_nonsense():
    for bad in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="copy_gbps"):
            bench.Ceilings("x", bad, 1.0)
    with pytest.raises(ValueError, match="launch_us"):
        bench.Ceilings("x", 1.0, 1.0, launch_us=-1)
    with pytest.raises(ValueError):
        bench.ridge_point(0, 1)


def test_measured_ceilings_keep_their_l2_and_launch_cost_in_the_time_model():
    c = bench.Ceilings("Mystery GPU", 1000.0, 100.0, l2_bytes=4096, launch_us=2.5)
    m = T.machine_from_ceilings(c)
    assert (m.l2_bytes, m.launch_us, m.name) == (4096, 2.5, "Mystery GPU (measured)")
    assert T.machine_from_ceilings(bench.Ceilings("H200", 4000.0, 700.0)).l2_bytes == 60 * 2**20


# ------------------------------------------------------------------ the launch overhead comes from results/


def _write_launch_csv(folder: Path, us: float, gpu: str):
    folder.mkdir(parents=True)
    (folder / "launch_overhead.csv").write_text(
        "case,impl,method,n_ops,elements,us,us_per_op,gpu,torch,triton,date\n"
        f"tiny op,x + y,host clock,1,1,99,99,{gpu},2.11,3.6,2026-11-22\n"
        f"tiny op,torch.relu(x),host clock,1,1,{us},{us},{gpu},2.11,3.6,2026-11-22\n")


def test_launch_overhead_is_read_from_results_with_its_host_named(tmp_path):
    _write_launch_csv(tmp_path / "h200", 9.5, "NVIDIA H200")
    _write_launch_csv(tmp_path / "h100-80gb-hbm3", 17.5, "NVIDIA H100 80GB HBM3")
    first = T.launch_overhead(root=tmp_path)
    assert (first.us, first.gpu) == (17.5, "NVIDIA H100 80GB HBM3")  # H100 first, the tiny-op relu row
    assert "host of the lent NVIDIA H100 80GB HBM3" in first.describe()
    assert T.launch_overhead("h200", root=tmp_path).us == 9.5
    with pytest.raises(ValueError, match="gpu"):
        T.launch_overhead("a100", root=tmp_path)
    fallback = T.launch_overhead(root=tmp_path / "missing")
    assert fallback.us == T.LAUNCH_OVERHEAD_FALLBACK_US and "fallback" in fallback.describe()


def test_the_course_constant_is_the_recorded_one():
    rec = T.launch_overhead()
    assert T.LAUNCH_OVERHEAD_US == rec.us and T.LAUNCH_OVERHEAD_SOURCE == rec.describe()
    if rec.gpu:  # the repository has results/: the figure names a real GPU's host and its CSV
        assert "launch_overhead.csv" in T.LAUNCH_OVERHEAD_SOURCE and rec.us > 1
    assert T.machine("h200").launch_us == T.LAUNCH_OVERHEAD_US
    assert T.machine("h200", launch_us=0).launch_us == 0


# ------------------------------------------------------------------ one cached device_info


def test_device_info_is_asked_once_per_device(monkeypatch):
    calls = []

    class Props:
        major, minor, multi_processor_count, name = 9, 0, 132, "NVIDIA H100 80GB HBM3"
        shared_memory_per_block_optin = 227 * 1024

    def props(index):
        calls.append(index)
        return Props()

    monkeypatch.setattr(hardware.env, "on_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    hardware.device_info.cache_clear()
    try:
        a = hardware.device_info()
        b = hardware.device_info(torch.device("cuda", 0))
        c = hardware.device_info(1)
        hardware.device_info(1)
        assert a is b and a.arch == 90 and a.sms == 132 and c.arch == 90
        assert calls == [0, 1]  # the driver is asked once per device
    finally:
        hardware.device_info.cache_clear()
    monkeypatch.setattr(hardware.env, "on_gpu", lambda: False)
    assert hardware.device_info() is hardware.INTERPRETER_DEVICE


# ------------------------------------------------------------------ one job per module, no cycle


HARNESS = ("bench", "timing", "sweeps", "ceilings", "roofline", "simulator", "results", "hardware", "env")


def _top_level_imports(path: Path) -> set[str]:
    """course_utils modules a module imports at import time (not inside functions)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return out


def test_no_import_cycle_in_the_harness():
    graph = {m: _top_level_imports(PKG / f"{m}.py") & set(HARNESS) for m in HARNESS}
    assert "bench" not in set().union(*(graph[m] for m in HARNESS if m != "bench"))  # nothing imports the facade

    def visit(m, stack):
        assert m not in stack, f"import cycle: {' -> '.join([*stack, m])}"
        for d in graph[m]:
            visit(d, [*stack, m])
    for m in HARNESS:
        visit(m, [])


def test_traffic_stays_free_of_torch():
    for path in (PKG / "traffic").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                  and n.level == 0}
        assert "torch" not in names, f"{path.name} imports torch"


@pytest.mark.parametrize("module", [*(f"{m}.py" for m in HARNESS), *(f"traffic/{p.name}" for p in
                                                                      sorted((PKG / "traffic").glob("*.py")))])
def test_harness_modules_stay_small(module):
    lines = (PKG / module).read_text().count("\n")
    assert lines <= 300, f"course_utils/{module} has {lines} lines: split it by job"


def test_every_old_bench_name_is_still_there():
    old = ["RESULTS", "L2_FLUSH_BYTES", "BenchmarkError", "Timing", "time_ms", "gbps", "tflops", "verify_callable",
           "sweep", "sizes", "Ceilings", "measure_ceilings", "ceilings_for", "with_ceilings", "attainable_tflops",
           "roofline_frame", "plot_roofline", "plot_sweep", "SimulatedGPU", "SimKernel", "SimEvent", "topic",
           "provenance", "provenance_line", "gpu_slug", "recorded_gpus", "recorded", "save", "Target"]
    assert not [n for n in old if not hasattr(bench, n)]
    assert bench.time_ms is timing.time_ms
