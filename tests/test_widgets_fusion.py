"""The chapter 2 widgets, driven headlessly: set a control, read the numbers they display."""

import re

import pytest

pytest.importorskip("ipywidgets")
import matplotlib  # noqa: E402

matplotlib.use("Agg")

from course_utils import hardware  # noqa: E402
from course_utils import traffic as T  # noqa: E402
from course_utils.widgets import fusion as F  # noqa: E402

pytestmark = pytest.mark.machinery   # left out of the newest-Triton run (pyproject.toml says why)


def _numbers(text):
    return [float(x.replace(",", "")) for x in re.findall(r"(-?[\d,]+\.?\d*) MB", text)]


@pytest.mark.parametrize("n_ops", [1, 3, 9, 16])
def test_chain_traffic_follows_the_calculator(n_ops):
    w = F.ChainTraffic()
    w.controls["n_ops"].value = n_ops
    c = T.elementwise_chain(n_ops, 32_000_000, "bf16")  # 64 MB of bf16
    s = w.state()
    assert (s["unfused_bytes"], s["fused_bytes"]) == (c.unfused.total_bytes, c.fused.total_bytes)
    shown = w.output.value
    assert f"{c.unfused.total_bytes / 1e6:,.1f} MB" in shown
    assert f"{c.fused.total_bytes / 1e6:,.1f} MB" in shown
    assert f"{n_ops} kernels" in shown or n_ops == 1


def test_chain_traffic_gpu_selector_changes_the_time():
    w = F.ChainTraffic(n_ops=4)
    w.controls["gpu"].value = "t4"
    s = w.state()
    assert s["unfused_us"] == pytest.approx(s["unfused_bytes"] / (hardware.SPECS["t4"].hbm_gbps * 1e9) * 1e6)
    assert f"{s['unfused_us']:,.1f} us" in w.output.value
    w.controls["gpu"].value = "h200"
    assert w.state()["unfused_us"] < s["unfused_us"]


def test_values_out_of_range_are_clamped_not_raised():
    w = F.ChainTraffic()
    w.update(n_ops=1000)
    assert w.controls["n_ops"].value == 16
    w.update(n_ops=-3)
    assert w.controls["n_ops"].value == 1
    w.update(n_ops="many", gpu="GeForce 256")  # nonsense is ignored
    assert w.controls["n_ops"].value == 1 and w.controls["gpu"].value == "h100-sxm"
    assert F.ChainTraffic(n_ops=99).controls["n_ops"].value == 16
    with pytest.raises(ValueError, match="control"):
        w.update(colour="red")


@pytest.mark.parametrize("n_ops,size,dtype", [(1, 10**6, "float32"), (5, 64 * 10**6, "bfloat16"),
                                              (12, 10**9, "float16")])
def test_per_op_bars_follow_the_calculator(n_ops, size, dtype):
    w = F.PerOpBars()
    w.update(n_ops=n_ops, size=size, dtype=dtype)
    c = T.elementwise_chain(n_ops, size // T.dtype_bytes(dtype), dtype)
    s = w.state()
    assert s["op_bytes"] == [k.total_bytes for k in c.unfused.kernels]
    shown = _numbers(w.output.value)
    # one bar per op with its MB, then the fused bar, then the totals line (unfused, fused)
    assert shown[:n_ops] == [round(k.total_bytes / 1e6, 1) for k in c.unfused.kernels]
    assert shown[n_ops] == round(c.fused.total_bytes / 1e6, 1)
    assert shown[n_ops + 1] == round(c.unfused.total_bytes / 1e6, 1)
    assert w.output.value.count("op ") >= n_ops


def test_per_op_bar_widths_are_proportional():
    w = F.PerOpBars(n_ops=4)
    widths = [float(x) for x in re.findall(r"width:([\d.]+)%", w.output.value)]
    assert widths == [100.0] * 5  # 4 ops and the fused kernel move the same bytes each


def test_accountant_softmax_matmul_bias_preset():
    w = F.FusionAccountant(preset="softmax + matmul + bias", m_log2=10, n_log2=11, k_log2=12)
    c = T.matmul_chain([T.Op("softmax", (), 5)], [T.Op("add bias", ("col",))], 1024, 2048, 4096, "bf16")
    s = w.state()
    assert (s["unfused_bytes"], s["fused_bytes"]) == (c.unfused.total_bytes, c.fused.total_bytes)
    assert s["kernels"] == ["softmax", "gemm", "add bias"]
    assert s["traffic_ratio"] == pytest.approx(c.ratio)
    sp = T.speedup(c, "h100-sxm", "bfloat16")
    assert s["estimated_speedup"] == pytest.approx(sp["estimated_speedup"])
    assert f"{c.ratio:.2f}x" in w.output.value
    assert f"{sp['estimated_speedup']:.2f}x" in w.output.value


def test_accountant_add_remove_reorder():
    w = F.FusionAccountant(preset="matmul only")
    assert w.state()["kernels"] == ["gemm"]
    w.menus["add"].value = "after: GELU"          # through the menu, as a student would
    assert w.menus["add"].value == F._ADD           # the menu resets to its prompt
    w.add("after: add bias").add("before: scale").add("not an op")
    assert w.ops == ["after: GELU", "after: add bias", "before: scale"]
    assert w.state()["kernels"] == ["scale", "gemm", "gelu", "add bias"]
    w.menus["move"].value = "2: after: add bias"   # move the bias before the GELU
    assert w.state()["kernels"] == ["scale", "gemm", "add bias", "gelu"]
    w.menus["remove"].value = "3: before: scale"
    assert w.state()["kernels"] == ["gemm", "add bias", "gelu"]
    w.remove(10).move_earlier(0).move_earlier(-1)   # out of range: ignored
    assert w.ops == ["after: add bias", "after: GELU"]
    w.menus["preset"].value = "matmul + bias + GELU + dropout"
    assert w.state()["kernels"] == ["gemm", "add bias", "gelu", "dropout"]
    c = w.comparison()
    assert f"{c.unfused.total_bytes / 1e6:,.1f} MB" in w.output.value


def test_accountant_gpu_selector_and_t4_without_bf16():
    w = F.FusionAccountant(preset="matmul + bias + GELU + dropout")
    h100 = w.state()["estimated_speedup"]
    w.update(gpu="t4")  # no bf16 peak on a T4: the time model uses its fp16 peak instead of failing
    t4 = w.state()
    assert t4["gpu"] == "t4" and t4["estimated_speedup"] > 1
    assert t4["estimated_speedup"] != h100
    w.update(m_log2=99)
    assert w.controls["m_log2"].value == 16


def test_speedup_curve_follows_the_time_model():
    w = F.SpeedupCurve(size=64 * 10**3, gpu="h100-sxm")
    s = w.state()
    assert s["ceiling"] == [float(k) for k in s["n_ops"]]
    for k, est in zip(s["n_ops"], s["estimate"]):
        c = T.elementwise_chain(k, 32_000, "bfloat16")
        assert est == pytest.approx(T.speedup(c, "h100-sxm", "bfloat16")["estimated_speedup"])
    # on 64 KB the launches dominate and the estimate is close to the number of launches
    assert s["estimate"][-1] == pytest.approx(16, rel=0.02)
    w.update(overlap=True, size=10**9)
    s2 = w.state()
    assert s2["overlap"] is True and s2["estimate"][-1] < 16
    assert f"{s2['estimate'][-1]:.2f}x" in w.output.value
    fig = w.figure()
    assert len(fig.axes[0].lines) == 2


def test_widgets_use_only_portable_widget_classes():
    import ipywidgets as iw

    allowed = (iw.IntSlider, iw.FloatSlider, iw.Dropdown, iw.ToggleButtons, iw.Play, iw.HBox, iw.VBox,
               iw.Output, iw.HTML)

    def walk(widget):
        yield widget
        for child in getattr(widget, "children", ()):
            yield from walk(child)

    for w in (F.ChainTraffic(), F.PerOpBars(), F.FusionAccountant(), F.SpeedupCurve()):
        for child in walk(w.widget):
            assert isinstance(child, allowed), type(child)
