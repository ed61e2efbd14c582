"""The trailing-vs-fused timeline widget: its pure functions, and the widget driven headlessly."""

from __future__ import annotations

import pytest

from course_utils import bench, traffic
from course_utils.widgets import gemm_timeline as g


@pytest.mark.parametrize("shape", list(g.SHAPES.values()))
@pytest.mark.parametrize("mode", list(g.MODES))
def test_timelines_add_up_to_the_traffic_model(shape, mode):
    m, n, k = shape
    tl = g.timeline(m, n, k, trailing=mode)
    comp = traffic.gemm_epilogue(m, n, k, dtype="bfloat16", trailing=mode)
    assert [s["name"] for s in tl["trailing"]] == [kk.name for kk in comp.unfused.kernels]
    assert len(tl["fused"]) == 1
    for side, tr in (("trailing", comp.unfused), ("fused", comp.fused)):
        segs = tl[side]
        est = traffic.estimate_time(tr, "h100-sxm", "bfloat16", launch_us=0.0)
        assert segs[-1]["end_us"] == pytest.approx(est.us)
        assert segs[-1]["bytes_end"] == pytest.approx(est.hbm_bytes)
        for a, b in zip(segs, segs[1:]):
            assert a["end_us"] == b["start_us"] and a["bytes_end"] == b["bytes_start"]
        assert all(s["end_us"] > s["start_us"] for s in segs)
    st = g.state(tl, g.STEPS)
    assert st["trailing"]["finished"] and st["fused"]["finished"]
    assert st["bytes_saved"] == pytest.approx(tl["trailing"][-1]["bytes_end"] - tl["fused"][-1]["bytes_end"])
    assert st["bytes_saved"] > 0 and st["speedup"] >= 1.0


def test_bytes_grow_with_time_and_start_at_zero():
    tl = g.timeline(4096, 16384, 4096)
    prev = None
    for step in range(0, g.STEPS + 1, 5):
        st = g.state(tl, step)
        if prev is not None:
            assert st["trailing"]["bytes"] >= prev["trailing"]["bytes"]
            assert st["fused"]["bytes"] >= prev["fused"]["bytes"]
        prev = st
    st0 = g.state(tl, 0)
    assert st0["trailing"]["bytes"] == 0 and st0["trailing"]["running"] == "gemm + bias"
    assert g.state(tl, -3)["step"] == 0 and g.state(tl, 10**6)["step"] == g.STEPS


def test_in_bytes_decode_saves_little_and_a_large_square_a_lot():
    """At decode the weights dominate the bytes (the (M, N) round trips are ~1%); at 8192^3 the round
    trips are over half the bytes, and the GEMM's compute hides only part of them."""
    decode = g.state(g.timeline(16, 16384, 4096, trailing="eager"), g.STEPS)
    square = g.state(g.timeline(8192, 8192, 8192, trailing="eager"), g.STEPS)
    share = lambda st: st["bytes_saved"] / st["trailing"]["total_bytes"]  # noqa: E731
    assert share(decode) < 0.02 < 0.5 < share(square)
    assert decode["speedup"] < 1.02 < square["speedup"]


def test_widget_headless():
    pytest.importorskip("ipywidgets")
    w = g.GemmTimeline()
    assert w.view.value == w.render() and "t = 0.0 us" in w.render()
    w.step.value = g.STEPS
    assert "finished" in w.view.value and w.view.value == w.render()
    assert "the bias in cuBLASLt's GEMM" in w.view.value
    w.mode.value = "fused"
    assert "one fused elementwise kernel" in w.view.value
    w.ceilings.value = "measured"
    recorded = bench.Ceilings.from_frame(bench.recorded("ceilings", gpu=g.MEASURED))
    assert f"{recorded.matmul_tflops:.0f} TFLOP/s" in w.view.value and w.view.value == w.render()
    w.shape.value = "square: 8192 x 8192 x 8192"
    assert "M=8192" in w.view.value and w.view.value == w.render()
    assert len(w.controls) == 5
    with pytest.raises(ValueError, match="shape must be one of"):
        g.GemmTimeline(shape="nope")


def test_the_addmm_baseline_is_two_kernels_and_570_mb_at_the_mlp_shape():
    """PyTorch's addmm with a 1-D bias runs the bias in cuBLASLt's epilogue: GEMM + bias, then GELU."""
    tl = g.timeline(4096, 16384, 4096)
    assert [s["name"] for s in tl["trailing"]] == ["gemm + bias", "gelu"]
    comp = traffic.gemm_epilogue(4096, 16384, 4096, dtype="bfloat16", trailing="addmm")
    assert comp.unfused.total_bytes == pytest.approx(570.458112e6)
    assert traffic.gemm_epilogue(4096, 16384, 4096, dtype="bfloat16").unfused.total_bytes == pytest.approx(838.893568e6)
    assert comp.fused.total_bytes == traffic.gemm_epilogue(4096, 16384, 4096, dtype="bfloat16").fused.total_bytes


def test_measured_ceilings_slow_every_kernel_alike():
    """On the measured ceilings (results/h100-80gb-hbm3/ceilings.csv: about 790 TFLOP/s and 3.0 TB/s against
    989 and 3350) both sides take longer, and
    the model's speedup at the MLP shape stays near 1.15x: the model, not the measured 1.00x."""
    sheet = g.state(g.timeline(4096, 16384, 4096), g.STEPS)
    meas = g.state(g.timeline(4096, 16384, 4096, gpu="measured"), g.STEPS)
    assert meas["fused"]["end_us"] > sheet["fused"]["end_us"]
    assert meas["speedup"] == pytest.approx(sheet["speedup"], abs=0.02)
    assert 1.1 < meas["speedup"] < 1.2
